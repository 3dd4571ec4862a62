"""In-job restart on the real SLURM sandbox: three hosts, two training nodes and a hot spare.

The attempt loop (hpcdist.launch.attempts) restarts a failed step inside the allocation: SIGKILL of one rank on a
host -> the loop blames the host, starts the next attempt on the other training host + the spare, and the job never
leaves RUNNING. With no spare but fault.min_nodes lower, training continues on fewer hosts with the same global
batch; with too few healthy hosts left it requeues as before, the bad host excluded. One uninterrupted reference run
(2 ranks) is shared by the scenarios that compare losses.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hpcdist
from hpcdist.fault.failures import read_failures
from hpcdist.fault.hang import read_heartbeats
from hpcdist.launch.restarts import load_ledger
from tests.slurm.conftest import REPO, Cluster, job_info, release_requeue_hold, run_cmd, wait_job
from tests.slurm.harness import (
    INJOB_STEPS,
    JOB_ENV,
    ONE_TASK,
    Reference,
    first_step_after,
    injob_overrides,
    rank_in_restart,
    shared_reference,
    step_losses,
    submit,
    tiny_overrides,
    wait_for_step,
)


@pytest.fixture(scope="module")
def reference(
    request: pytest.FixtureRequest, slurm_cluster2: Cluster, corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Reference:
    return shared_reference(request.config, slurm_cluster2, corpus_dir, tmp_path_factory)


def _kill_rank_on(run: Path, rank: int, restart: int) -> tuple[dict, float]:
    victim = rank_in_restart(run, rank, restart=restart)
    t = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    return victim, t


def _ranks_hosts(run: Path, restart: int, world: int) -> list[str]:
    return [rank_in_restart(run, r, restart=restart)["host"] for r in range(world)]


def _recovery_line(run: Path, what: str, t_kill: float) -> float:
    """Print the time from the kill to the next completed step and the attempt's recovery split (goodput.json)."""
    back = first_step_after(run, t_kill) - t_kill
    deadline = time.monotonic() + 30
    while True:  # rank 0 writes the recovery with its first step's flush
        recs = [a["recovery"] for a in json.loads((run / "goodput.json").read_text())["attempts"] if "recovery" in a]
        if recs or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert recs, f"no recovery in {run}/goodput.json"
    print(f"\n{what}: next completed step {back:.1f} s after the kill; recovery split {recs[-1]}")
    return back


def test_killed_rank_restarts_in_the_job_on_the_spare(
    slurm_cluster2: Cluster, corpus_dir: Path, tmp_path: Path, reference: Reference
) -> None:
    """SIGKILL of rank 1 on node2: no requeue (Restarts=0), the next attempt on node1 + node3, node2 excluded, the
    time to the next completed step <= 60 s, every step's loss equal to the uninterrupted run's."""
    run, out = tmp_path / "run", tmp_path / "out.txt"
    job = submit(
        slurm_cluster2,
        "train.sh",
        ["--nodes=3", *ONE_TASK],
        injob_overrides(run, corpus_dir, "fault.spare_nodes=1"),
        out,
    )
    assert _ranks_hosts(run, 0, 2) == ["node1", "node2"]  # the first two of the allocation; node3 is the spare
    wait_for_step(run, 6)
    victim, t_kill = _kill_rank_on(run, 1, restart=0)
    assert _ranks_hosts(run, 1, 2) == ["node1", "node3"]
    assert job_info(slurm_cluster2, job)["JobState"] == "RUNNING"
    back = _recovery_line(run, "in-job restart (SIGKILL rank 1 on node2)", t_kill)
    assert wait_job(slurm_cluster2, job, timeout=240) == "COMPLETED", out.read_text()[-4000:]

    info = job_info(slurm_cluster2, job)
    assert info["Restarts"] == "0"  # never went back to the queue
    ledger = load_ledger(run, job)
    first, second = ledger["attempts"]["0"], ledger["attempts"]["1"]
    assert first["ended"] == "failure" and first["restarted"] == "in-job" and first["requeued"] is None
    assert first["excluded"] == ["node2"] and first["blame"] == [{"rank": 1, "host": "node2"}]
    assert second["path"] == "in-job" and second["nodes"] == ["node1", "node3"]
    (rec,) = [r for r in read_failures(run, job_id=job) if r["kind"] == "killed"]
    assert (rec["restart"], rec["rank"], rec["host"], rec["pid"]) == (0, 1, "node2", victim["pid"])
    text = out.read_text()
    assert "restarting in the allocation" in text and "attempt 1 (in-job) on node1,node3" in text
    assert back <= 60
    got, ref = step_losses(run), reference.losses()
    assert [got[s] for s in range(1, INJOB_STEPS + 1)] == [ref[s] for s in range(1, INJOB_STEPS + 1)]


def test_too_few_healthy_nodes_requeue_as_before_with_the_bad_host_excluded(
    slurm_cluster2: Cluster, corpus_dir: Path, tmp_path: Path, reference: Reference
) -> None:
    """Two training nodes, no spare, no shrinking: a killed rank on node2 leaves too few -> requeue without node2."""
    run, out = tmp_path / "run", tmp_path / "out.txt"
    job = submit(slurm_cluster2, "train.sh", ["--nodes=2", *ONE_TASK], injob_overrides(run, corpus_dir), out)
    assert _ranks_hosts(run, 0, 2) == ["node1", "node2"]
    wait_for_step(run, 6)
    _, t_kill = _kill_rank_on(run, 1, restart=0)
    info = release_requeue_hold(slurm_cluster2, job, timeout=120)
    assert info["ExcNodeList"] == "node2"
    assert sorted(_ranks_hosts(run, 1, 2)) == ["node1", "node3"]
    _recovery_line(run, "requeue (SIGKILL rank 1 on node2, no spare)", t_kill)
    assert wait_job(slurm_cluster2, job, timeout=240) == "COMPLETED", out.read_text()[-4000:]
    ledger = load_ledger(run, job)
    assert ledger["attempts"]["0"]["requeued"] == "failure" and "restarted" not in ledger["attempts"]["0"]
    assert ledger["excluded"] == ["node2"] and ledger["attempts"]["1"]["path"] == "requeue"
    assert "usable node(s) left, 2 needed: requeueing" in out.read_text()
    got, ref = step_losses(run), reference.losses()
    assert [got[s] for s in range(1, INJOB_STEPS + 1)] == [ref[s] for s in range(1, INJOB_STEPS + 1)]


def test_no_spare_left_min_nodes_shrinks_to_one_host_through_submit(
    slurm_cluster2: Cluster, corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hpcdist.submit, 2 nodes, fault.min_nodes=1: rank 1's host dies -> one host, the same global batch; losses
    within 1e-5 of a run started on one host from the same checkpoint."""
    for key, value in slurm_cluster2.env.items():  # this process is the login node
        monkeypatch.setenv(key, value)
    run = tmp_path / "shrink"
    over = injob_overrides(run, corpus_dir, "fault.min_nodes=1", "checkpoint.keep_last=100")[
        1:
    ]  # the resume point stays
    job = hpcdist.submit("configs/demo.yaml", over, cluster="sandbox", nodes=2, gpus_per_node=1)
    wait_for_step(run, 6)
    _, t_kill = _kill_rank_on(run, 1, restart=0)
    assert _ranks_hosts(run, 1, 1) == ["node1"]
    _recovery_line(run, "in-job restart on fewer nodes (SIGKILL rank 1 on node2, fault.min_nodes=1)", t_kill)
    # the attempt on one host has logged a step: where it resumed is known (goodput.json), and its checkpoint stays
    # (keep_last=100), so the reference trains from it while the job finishes
    goodput = json.loads((run / "goodput.json").read_text())["attempts"]
    resumed = int(goodput[1]["first_step"])
    assert 0 < resumed < INJOB_STEPS

    # the reference: one host (1 rank, 8 micro-batches of accumulation) from the same checkpoint
    ref = tmp_path / "ref"
    name = f"step-{resumed:08d}"
    shutil.copytree(run / "checkpoints" / name, ref / "checkpoints" / name, symlinks=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    reference = subprocess.Popen(
        [sys.executable, "-m", "hpcdist", "train", "configs/demo.yaml", *over, f"run.dir={ref}"],
        cwd=REPO,
        env={**env, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert job.wait(timeout=300) == "COMPLETED", job.paths[0].stderr.read_text()[-3000:]
        assert job_info(slurm_cluster2, job.job_id)["Restarts"] == "0"
        ledger = load_ledger(run, job.job_id)
        assert ledger["attempts"]["1"]["nodes"] == ["node1"] and ledger["attempts"]["0"]["restarted"] == "in-job"
        assert int(json.loads((run / "goodput.json").read_text())["attempts"][1]["first_step"]) == resumed
        _, stderr = reference.communicate(timeout=300)
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.wait()
    assert reference.returncode == 0, stderr[-3000:]
    got, want = step_losses(run), step_losses(ref)
    assert sorted(want) == list(range(resumed + 1, INJOB_STEPS + 1))
    for s in range(resumed + 1, INJOB_STEPS + 1):
        assert got[s] == pytest.approx(want[s], rel=1e-5, abs=1e-6), s


STAND_IN_NVIDIA_SMI = """#!/bin/sh
# a stand-in nvidia-smi: node2 has 3 uncorrectable ECC errors, every other node is clean
case "$1" in
  --query-gpu=*) if [ "$(hostname)" = node2 ]; then n=3; else n=0; fi; echo "0, 00000000:07:00.0, $n, No" ;;
  --query-remapped-rows=*) echo "00000000:07:00.0, No, No" ;;
  *) exit 0 ;;
esac
"""


def test_a_node_that_fails_the_gate_at_the_first_start_runs_no_rank(
    slurm_cluster2: Cluster, corpus_dir: Path, tmp_path: Path
) -> None:
    """node2's (stand-in) nvidia-smi reports uncorrectable ECC errors: no rank starts on it, training starts on
    node1 + the spare node3, the reason is in failures.jsonl and in `hpcdist status`."""
    bindir, run, out = tmp_path / "bin", tmp_path / "run", tmp_path / "out.txt"
    bindir.mkdir()
    (bindir / "nvidia-smi").write_text(STAND_IN_NVIDIA_SMI)
    (bindir / "nvidia-smi").chmod(0o755)
    env = {**slurm_cluster2.env, **JOB_ENV, "PATH": f"{bindir}:{slurm_cluster2.env['PATH']}"}
    over = ["configs/demo.yaml", *tiny_overrides(run, corpus_dir, 4, "fault.spare_nodes=1")]
    args = ["--nodes=3", *ONE_TASK, f"--output={out}", str(REPO / "sbatch" / "train.sh"), *over]
    job = run_cmd(slurm_cluster2, "sbatch", "--parsable", *args, cwd=REPO, env=env).stdout.strip().split(";")[0]
    assert wait_job(slurm_cluster2, job, timeout=240) == "COMPLETED", out.read_text()[-4000:]
    assert sorted(b["host"] for b in read_heartbeats(run, 2).values()) == ["node1", "node3"]
    (rec,) = [r for r in read_failures(run, job_id=job) if r["kind"] == "health"]
    assert rec["host"] == "node2" and "3 uncorrectable ECC error(s)" in rec["cause"]
    assert load_ledger(run, job)["attempts"]["0"]["nodes"] == ["node1", "node3"]
    status = run_cmd(slurm_cluster2, sys.executable, "-m", "hpcdist", "status", job, "--run-dir", str(run), cwd=REPO)
    assert "unhealthy node node2: failed the health gate" in status.stdout and "uncorrectable ECC" in status.stdout
