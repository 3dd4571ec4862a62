"""On the real sandbox: no local fallback on a login node whose controller hangs, a sweep as one job
array (each task requeued alone, resuming exactly, from the code snapshot although the checkout was edited), and a
chain of dependent jobs run through a stand-in container wrapper.

The sweep and the chain run at the same time (4 of the node's 8 fake GPUs, one rank each) to keep the tier short.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import hpcdist
from hpcdist import cli
from hpcdist.config import load as load_config
from tests.slurm.conftest import REPO, Cluster, job_info, release_requeue_hold, run_cmd, wait_job
from tests.slurm.harness import step_losses, tiny_overrides, wait_for_step

# `apptainer exec [--bind X | --pwd X]... IMAGE CMD...` -> records the image, mounts and command, then execs CMD
APPTAINER_STANDIN = """#!/bin/sh
[ "$1" = exec ] || {{ echo "stand-in apptainer: only exec" >&2; exit 64; }}
shift
binds=""
while [ $# -gt 0 ]; do
  case "$1" in
    --bind|-B) binds="$binds$2;"; shift 2 ;;
    --pwd) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
image=$1; shift
echo "image=$image bind=$binds cmd=$*" >> {log}
exec "$@"
"""


@pytest.fixture
def login_env(slurm_cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    """This test process acts as the login node: SLURM_CONF and PATH of the sandbox."""
    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    return slurm_cluster


def test_hanging_controller_is_an_error_and_nothing_runs_here(slurm_cluster: Cluster, tmp_path: Path) -> None:
    """The sandbox's real sbatch and srun are on PATH; sinfo and scontrol in front of them hang (a controller that
    does not answer). `hpcdist submit` (executor auto) must fail with the reason and start nothing locally."""
    bindir = tmp_path / "slow"
    bindir.mkdir()
    for tool in ("sinfo", "scontrol"):
        (bindir / tool).write_text("#!/bin/sh\nexec sleep 30\n")
        (bindir / tool).chmod(0o755)
    env = {
        **slurm_cluster.env,
        "PATH": f"{bindir}{os.pathsep}{slurm_cluster.env['PATH']}",
        "HPCDIST_SLURM_PING_TIMEOUT": "1",
    }
    run = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpcdist",
            "submit",
            "configs/demo.yaml",
            "--cluster",
            "sandbox",
            f"run.dir={run}",
            "train.global_batch_size=32",
            "train.steps=3",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "scontrol ping did not answer within 1 s" in proc.stderr and "nothing was started" in proc.stderr
    assert not run.exists()  # no local job wrote anything (no slurm/ folder, no metrics)


def test_sweep_array_requeues_one_task_exactly_and_a_chain_resumes(
    login_env: Cluster, corpus_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    steps = 30
    one_rank = dict(cluster="sandbox", nodes=1, gpus_per_node=1)
    base = tiny_overrides(
        tmp_path / "sweep", corpus_dir, steps, "train.global_batch_size=4", "train.micro_batch_size=1"
    )
    # tasks 0 and 1 train the same model (checkpoint.keep_last changes no number): task 0 is task 1's reference
    points = tmp_path / "points.yaml"
    points.write_text(
        "- {optim.lr: 2.0e-3, checkpoint.keep_last: 2}\n- {optim.lr: 2.0e-3, checkpoint.keep_last: 3}\n"
        "- {optim.lr: 1.0e-3}\n"
    )
    # submitted by `hpcdist submit --sweep-file` from a clone of this checkout (PYTHONPATH), which is edited after
    # submission: the requeued task must run the code snapshot, not the edited clone
    clone = tmp_path / "checkout"
    subprocess.run(["git", "clone", "--quiet", "--local", str(REPO), str(clone)], check=True, timeout=60)
    env = {**login_env.env, "PYTHONPATH": str(clone)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpcdist",
            "submit",
            "configs/demo.yaml",
            "--cluster",
            "sandbox",
            "--nodes",
            "1",
            "--gpus-per-node",
            "1",
            "--sweep-file",
            str(points),
            "--max-parallel",
            "3",
            *base,
        ],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    record = _record(tmp_path / "sweep")
    tasks = [Task(t["job_id"], tmp_path / "sweep" / "slurm" / f"{t['job_id']}_0_log.out") for t in record["tasks"]]
    task_py = clone / "hpcdist" / "launch" / "task.py"
    task_py.write_text(
        'raise RuntimeError("the edited checkout was imported, not the snapshot")\n' + task_py.read_text()
    )
    code = json.loads((Path(record["snapshot"]) / "snapshot.json").read_text())
    head = subprocess.run(["git", "-C", str(clone), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert (code["git_commit"], code["dirty"], code["source"]) == (head.strip(), False, str(clone))
    # the chain runs each task through a stand-in apptainer (drops its options and the image, records them, execs
    # the task: the supervisor and the trainer inside get srun's signals) after the profile's setup lines
    standin = tmp_path / "bin" / "apptainer"
    standin.parent.mkdir()
    standin.write_text(APPTAINER_STANDIN.format(log=tmp_path / "apptainer.log"))
    standin.chmod(0o755)
    container = {
        "runtime": "apptainer",
        "image": "/images/train.sif",
        "mounts": [f"{tmp_path}:{tmp_path}"],
        "executable": str(standin),
    }
    array = record["job_id"]
    assert [t.job_id for t in tasks] == [f"{array}_{i}" for i in range(3)]
    runs = [Path(info["run_dir"]) for info in record["tasks"]]
    assert [r.name for r in runs] == [
        "optim.lr=0.002_checkpoint.keep_last=2",
        "optim.lr=0.002_checkpoint.keep_last=3",
        "optim.lr=0.001",
    ]

    # USR2 (the time-limit warning) to task 1 alone: it saves, requeues itself (<array>_1), resumes
    wait_for_step(runs[1], 5)
    run_cmd(login_env, "scancel", "--signal=USR2", tasks[1].job_id)
    # the chain is submitted only now, with 8 micro-batches a step: submitted beside the sweep, its first job once
    # finished all its steps on an idle machine before the USR2 below reached it (no "fault.requeue is off")
    chain_run = tmp_path / "chain"
    chain = hpcdist.submit_chain(
        "configs/demo.yaml",
        tiny_overrides(chain_run, corpus_dir, steps),
        2,
        container=container,
        setup=['echo "site setup ran: $(hostname)"'],
        **one_rank,
    )
    # and to the first job of the chain: it saves and ends (fault.requeue=false); the second job continues
    wait_for_step(chain_run, 5)
    run_cmd(login_env, "scancel", "--signal=USR2", chain[0].job_id)
    assert release_requeue_hold(login_env, tasks[1].job_id)["Restarts"] == "1"
    for t in tasks:
        assert wait_job(login_env, t.job_id, timeout=300) == "COMPLETED", t.log.read_text()[-3000:]
    for handle in chain:
        assert handle.wait(timeout=300) == "COMPLETED", handle.paths[0].stdout.read_text()[-3000:]

    # the sweep: one array; only task 1 was requeued; each run dir's config has its overrides; exact resume
    assert [job_info(login_env, t.job_id)["Restarts"] for t in tasks] == ["0", "1", "0"]
    assert {job_info(login_env, t.job_id)["ArrayJobId"] for t in tasks} == {array}
    default_keep = load_config("configs/demo.yaml", base).checkpoint.keep_last
    for run, (lr, keep) in zip(runs, [(2e-3, 2), (2e-3, 3), (1e-3, default_keep)], strict=True):
        cfg = load_config(run / "config.yaml")
        assert (cfg.optim.lr, cfg.checkpoint.keep_last, cfg.run.dir) == (lr, keep, str(run))
    got, ref, other = (step_losses(r) for r in runs)
    assert sorted(got) == list(range(1, steps + 1))
    assert [got[s] for s in range(1, steps + 1)] == [ref[s] for s in range(1, steps + 1)]  # bitwise on CPU
    assert other[steps] != ref[steps]  # another learning rate trained another model
    log1 = tasks[1].log.read_text()
    assert "stop requested (TIME_LIMIT)" in log1 and "resumed from" in log1
    assert "the edited checkout was imported" not in log1  # the requeued attempt ran the snapshot
    assert "resumed from" not in tasks[0].log.read_text()
    assert cli.main(["status", array]) == 0
    table = capsys.readouterr().out
    for t, run in zip(tasks, runs, strict=True):
        assert any(
            line.split()[:2] == [t.job_id, "COMPLETED"] and line.split()[3] == str(steps) and line.endswith(str(run))
            for line in table.splitlines()
        ), table

    # the chain: the second job started after the first ended and resumed from its checkpoint
    first, second = (job_info(login_env, h.job_id) for h in chain)
    assert second["StartTime"] >= first["EndTime"], (first["EndTime"], second["StartTime"])
    log_first, log_second = (h.paths[0].stdout.read_text() for h in chain)
    assert "fault.requeue is off" in log_first and "resumed from" not in log_first
    assert "resumed from" in log_second
    assert sorted(step_losses(chain_run)) == list(range(1, steps + 1))
    assert "site setup ran: node1" in log_first and "site setup ran: node1" in log_second
    used = (tmp_path / "apptainer.log").read_text().splitlines()
    assert all(line.startswith("image=/images/train.sif bind=") for line in used), used
    # per chain job, both inside the image: the attempt loop and the ranks' supervisor (the trainer in it)
    modules = [line.partition("cmd=")[2].split()[1:3] for line in used]  # `<python> -m <module> ...`
    assert sorted(m[1] for m in modules) == ["hpcdist.fault.supervise"] * 2 + ["hpcdist.launch.attempts"] * 2, used


def _record(base: Path) -> dict:
    return json.loads((base / "sweep.json").read_text())


@dataclass(frozen=True)
class Task:
    job_id: str
    log: Path
