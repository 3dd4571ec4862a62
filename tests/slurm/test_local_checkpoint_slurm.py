"""The node-local checkpoint tier on the SLURM sandbox: two hosts, the in-job restart onto the same
hosts (fault.exclude_failed_nodes=false). Host B's rank killed and B's local directory wiped: the restart takes B's
files from its copy on host A, the local tier being newer than the shared checkpoint; then both copies wiped: the
shared checkpoint. Every step's loss equals the uninterrupted run's (test_injob_slurm's reference: same model,
data and steps; the checkpoint cadences do not change the losses). With fault.in_process and a third host as the
warm spare, the same kill is recovered inside the surviving processes instead."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

import hpcdist
from hpcdist.fault.goodput import read_goodput
from hpcdist.launch.restarts import load_ledger
from tests.slurm.conftest import Cluster, job_info, wait_job
from tests.slurm.harness import (
    INJOB_STEPS,
    ONE_TASK,
    Reference,
    injob_overrides,
    rank_in_restart,
    shared_reference,
    step_losses,
    submit,
    wait_for_step,
)

# local every step, shared every 5: a kill after step 5k+3 finds local steps 5k+1.. newer than the shared 5k
LOCAL = ("checkpoint.every_steps=5", "checkpoint.local.every_steps=1", "fault.exclude_failed_nodes=false")


def _wait_for(out: Path, pattern: str, timeout: float = 30) -> tuple[str, re.Match[str]]:
    """The job's output once ``pattern`` is in it (srun forwards the ranks' lines with a delay)."""
    deadline = time.monotonic() + timeout
    while True:
        text = out.read_text()
        found = re.search(pattern, text)
        if found:
            return text, found
        assert time.monotonic() < deadline, text[-4000:]
        time.sleep(0.2)


@pytest.fixture(scope="module")
def reference(
    request: pytest.FixtureRequest, slurm_cluster2: Cluster, corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Reference:
    """test_injob_slurm's uninterrupted run (2 ranks, ddp, the same steps), trained once for both modules."""
    return shared_reference(request.config, slurm_cluster2, corpus_dir, tmp_path_factory)


def _kill_after(run: Path, rank: int, restart: int, steps: set[int], timeout: float = 120) -> int:
    """SIGKILL ``rank`` of attempt ``restart`` as soon as that attempt logs one of ``steps`` in metrics.jsonl; the
    step it had logged last."""
    victim = rank_in_restart(run, rank, restart=restart)
    since = victim["time"] if restart else 0.0  # the attempt's own lines: an earlier attempt logged steps too
    deadline = time.monotonic() + timeout
    while True:
        logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        last = max((m["step"] for m in logged if "split" not in m and m["time"] > since), default=0)
        if last in steps:
            os.kill(victim["pid"], signal.SIGKILL)
            return last
        assert last < max(steps) and time.monotonic() < deadline, f"missed steps {sorted(steps)} (at {last})"
        time.sleep(0.02)


def test_a_killed_hosts_files_come_from_its_peer_then_both_lost_resume_the_shared_checkpoint(
    slurm_cluster2: Cluster, corpus_dir: Path, tmp_path: Path, reference: Reference
) -> None:
    run, out, local = tmp_path / "run", tmp_path / "out.txt", tmp_path / "local-{host}"
    over = injob_overrides(run, corpus_dir, *LOCAL, f"checkpoint.local.dir={local}", "fault.restart_backoff_s=1")
    job = submit(slurm_cluster2, "train.sh", ["--nodes=2", *ONE_TASK], over, out)
    # host A runs rank 0, host B rank 1 (SLURM picks two of the three nodes; the reference job takes one too)
    host_a, host_b = (rank_in_restart(run, r, restart=0)["host"] for r in (0, 1))
    node_a, node_b = tmp_path / f"local-{host_a}", tmp_path / f"local-{host_b}"

    killed = _kill_after(run, 1, 0, {8, 13})  # host B's rank
    shutil.rmtree(node_b, ignore_errors=True)  # B's disk lost with it
    second = rank_in_restart(run, 0, restart=1)
    _, fetched = _wait_for(out, r"rank 1's files of step (\d+) come from rank 0's node")
    step = int(fetched.group(1))
    assert 5 * (killed // 5) < step <= killed  # newer than the shared checkpoint
    # the run's own subdirectory of the tier (named from its run dir: hpcdist.checkpoint.local.run_key)
    _wait_for(
        out, re.escape(f"resumed from {node_a}/") + r"run-[0-9a-f]{16}" + re.escape(f"/rank-00000/step-{step:08d}")
    )
    assert list(node_a.glob("run-*/replica-of-rank-00001")) and second["host"] == host_a

    again = _kill_after(run, 1, 1, {s for s in range(step + 1, INJOB_STEPS) if s % 5 in (1, 2, 3)})
    shutil.rmtree(node_a, ignore_errors=True)
    shutil.rmtree(node_b, ignore_errors=True)  # both copies gone
    assert wait_job(slurm_cluster2, job, timeout=240) == "COMPLETED", out.read_text()[-4000:]
    text = out.read_text()
    assert f"resumed from {run}/checkpoints/step-{5 * (again // 5):08d}" in text, text[-4000:]
    assert job_info(slurm_cluster2, job)["Restarts"] == "0"  # both restarts in the job
    got, ref = step_losses(run), reference.losses()
    assert [got[s] for s in range(1, INJOB_STEPS + 1)] == [ref[s] for s in range(1, INJOB_STEPS + 1)]


def _logs(folder: Path) -> str:
    """Every log a submitted job left in its folder (the batch script's, each task's, the spares')."""
    return "".join(p.read_text(errors="replace") for p in sorted(folder.glob("*_log.*")))


@pytest.mark.parametrize("entry", ["sbatch", "submit"])
def test_a_killed_rank_is_recovered_in_process_by_the_warm_spare(
    slurm_cluster2: Cluster,
    corpus_dir: Path,
    tmp_path: Path,
    reference: Reference,
    monkeypatch: pytest.MonkeyPatch,
    entry: str,
) -> None:
    """fault.in_process, 2 training hosts + 1 spare, SIGKILL of rank 1 on host B, started by `sbatch
    sbatch/train.sh` or by hpcdist.submit: rank 0's process lives on (the same pid), the spare host's waiting
    process takes rank 1 with its files from the peer copy on host A, the shared checkpoint is not read, at most one
    completed step is computed again, the job needs no second attempt (Restarts=0, one attempt in the ledger), and
    every step's loss equals the uninterrupted run's. Through submit, the spare's task writes its own log (not rank
    0's of the training step, whose task number it shares) and records rank 1's result."""
    run, out, local = tmp_path / "run", tmp_path / "out.txt", tmp_path / "local-{host}"
    over = injob_overrides(
        run,
        corpus_dir,
        *LOCAL,
        f"checkpoint.local.dir={local}",
        "fault.spare_nodes=1",
        "fault.in_process=true",
        "fault.regroup_settle_s=2",
    )
    if entry == "sbatch":
        job = submit(slurm_cluster2, "train.sh", ["--nodes=3", *ONE_TASK], over, out)
    else:
        for key, value in slurm_cluster2.env.items():  # this process is the login node
            monkeypatch.setenv(key, value)
        handle = hpcdist.submit(over[0], over[1:], cluster="sandbox", nodes=2, gpus_per_node=1)
        job = handle.job_id
    survivor, victim = (rank_in_restart(run, r, restart=0) for r in (0, 1))
    wait_for_step(run, 6)
    t_kill = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    if entry == "sbatch":
        assert wait_job(slurm_cluster2, job, timeout=240) == "COMPLETED", out.read_text()[-4000:]
        text = out.read_text()
    else:
        folder = handle.paths[0].stdout.parent
        assert handle.wait(timeout=240) == "COMPLETED", _logs(folder)[-4000:]
        text = _logs(folder)
        results = handle.results()
        assert [r["rank"] for r in results] == [0, 1] and results[1]["step"] == INJOB_STEPS, results
        spare_log = (folder / f"spare-{handle.paths[0].stdout.name}").read_text(errors="replace")
        assert "took rank 1" in spare_log and "took rank" not in handle.paths[0].stdout.read_text()
    assert "in-process recovery 1: generation 1 of 2 ranks formed" in text, text[-4000:]
    assert f"pid {survivor['pid']} stays" in text
    took = re.search(r"warm spare on (\S+): took rank 1 \(generation 1\)", text)
    assert took and took.group(1) not in (survivor["host"], victim["host"]), text[-4000:]
    assert "rank 1's files of step" in text and "come from rank 0's node" in text
    assert f"resumed from {run}/checkpoints" not in text  # the shared checkpoint was not read
    assert list(load_ledger(run, job)["attempts"]) == ["0"] and job_info(slurm_cluster2, job)["Restarts"] == "0"
    first, second = read_goodput(run)  # rank 0's accounting: the second generation is an attempt from the death on
    assert second.get("generation") == 1 and second["recovery"]["path"] == "in-process", second
    assert first["end"] == second["start"] >= t_kill
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m["step"] for m in logged if "split" not in m]
    back = [i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]]
    assert len(back) <= 1 and (not back or steps[back[0] - 1] - steps[back[0]] + 1 <= 1), steps
    got, ref = step_losses(run), reference.losses()
    assert [got[s] for s in range(1, INJOB_STEPS + 1)] == [ref[s] for s in range(1, INJOB_STEPS + 1)]
    after = next(m["time"] for m in logged if "split" not in m and m["time"] > t_kill)
    print(f"\nin-process recovery via {entry} (SIGKILL rank 1 on {victim['host']}): next step {after - t_kill:.1f} s")
