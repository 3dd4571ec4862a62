"""The cluster path on a real SLURM: batch scripts, preemption + requeue + exact resume, fail-fast, two hosts."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from hpcdist import config as config_mod
from hpcdist.trainer import Trainer
from tests.dist.harness import single
from tests.slurm.conftest import (
    REPO,
    Cluster,
    job_info,
    job_output,
    release_requeue_hold,
    run_cmd,
    side_by_side,
    wait_job,
)
from tests.slurm.harness import step_losses, submit, tiny_overrides, wait_for_step


@pytest.fixture(scope="module")
def one_node(slurm_cluster: Cluster, corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """This file's one-node scenarios driven side by side (conftest.side_by_side): the 13B script's 2 ranks, the
    preemption's two 2-rank jobs and the killed-rank job's 2 ranks fill the node's 8 GPUs at once."""
    root = tmp_path_factory.mktemp("train")
    dirs = {name: root / name for name in ("13b", "preemption", "killed")}
    for d in dirs.values():
        d.mkdir()
    with side_by_side(
        train_13b=lambda: _drive_13b(slurm_cluster, corpus_dir, dirs["13b"]),
        preemption=lambda: _drive_preemption(slurm_cluster, corpus_dir, dirs["preemption"]),
        killed=lambda: _drive_killed_rank(slurm_cluster, corpus_dir, dirs["killed"]),
    ) as futures:
        yield futures


def _drive_13b(cluster: Cluster, corpus: Path, tmp_path: Path) -> tuple[str, str, Path]:
    run = tmp_path / "13b"
    job = submit(
        cluster,
        "train_13b.sh",
        # --exclusive=user: the script's `#SBATCH --exclusive` would keep this file's other jobs off the node
        ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=2", "--exclusive=user"],
        tiny_overrides(run, corpus, 6, "checkpoint.save_final=true"),
        tmp_path / "out.txt",
    )
    state = wait_job(cluster, job, timeout=300)  # from submission: it may queue behind this file's other jobs
    return state, (tmp_path / "out.txt").read_text(), run


def test_train_13b_script_runs_with_sbatch_overrides(one_node: dict[str, Future]) -> None:
    """`sbatch --nodes=1 --ntasks-per-node=2 --gpus-per-node=2 --exclusive=user sbatch/train_13b.sh <tiny>`."""
    state, out, run = one_node["train_13b"].result()
    assert state == "COMPLETED", out[-4000:]
    assert "ddp on 2 rank(s)" in out and "NCCL profile ethernet" in out
    assert sorted(step_losses(run)) == list(range(1, 7))
    assert (run / "checkpoints" / "step-00000006" / "COMPLETE").is_file()


PREEMPT_STEPS = 60


def _drive_preemption(cluster: Cluster, corpus: Path, tmp_path: Path) -> tuple[Cluster, str, Path, Path, Path]:
    # 2 ranks: bitwise equality across a restart needs the same gradient summation order. DDP re-buckets its
    # gradients after the first iteration (autograd's ready order) and a fresh DDP after a resume starts from the
    # registration order once more, so the first resumed step sums in another order; with 2 ranks a + b is
    # order-free, with 4+ ranks that one step differs by ~1 ulp (tests/dist shows bitwise resume at 2 ranks too).
    steps, args = PREEMPT_STEPS, ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1"]
    straight_run, pre_run = tmp_path / "straight", tmp_path / "pre"
    # both jobs fit on the 8-GPU node at once
    demo = "configs/demo.yaml"
    straight = submit(
        cluster, "train.sh", args, [demo, *tiny_overrides(straight_run, corpus, steps)], tmp_path / "a.txt"
    )
    job = submit(cluster, "train.sh", args, [demo, *tiny_overrides(pre_run, corpus, steps)], tmp_path / "pre.txt")

    wait_for_step(pre_run, 5, timeout=300)  # from submission: it may queue behind this file's other jobs
    run_cmd(cluster, "scancel", "--signal=USR2", "--batch", job)  # what --signal=B:USR2@lead delivers
    info = release_requeue_hold(cluster, job)  # skip SLURM's ~150 s BeginTime hold after a requeue
    assert info["Restarts"] == "1"
    assert wait_job(cluster, job, timeout=300) == "COMPLETED", (tmp_path / "pre.txt").read_text()[-4000:]
    assert wait_job(cluster, straight, timeout=300) == "COMPLETED"
    return cluster, job, tmp_path / "pre.txt", straight_run, pre_run


def test_preemption_checkpoints_requeues_and_resumes_exactly(one_node: dict[str, Future]) -> None:
    cluster, job, out_file, straight_run, pre_run = one_node["preemption"].result()
    out = out_file.read_text()
    assert "forwarding to the tasks" in out and "stop requested (TIME_LIMIT)" in out
    assert "restart 1" in out and "resumed from" in out  # SLURM_RESTART_COUNT=1 in the second run
    assert job_info(cluster, job)["Restarts"] == "1"
    ref, got = step_losses(straight_run), step_losses(pre_run)
    steps = PREEMPT_STEPS
    assert sorted(got) == list(range(1, steps + 1))
    assert [got[s] for s in range(1, steps + 1)] == [ref[s] for s in range(1, steps + 1)]  # bitwise on CPU


def _rank_pid(job: str, rank: int) -> int | None:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SLURM_JOB_ID={job}".encode() in environ and f"SLURM_PROCID={rank}".encode() in environ:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            # the rank itself, not srun nor the rank's supervisor (python -m hpcdist.fault.supervise -- <rank>)
            if b"hpcdist" in cmdline and b"srun" not in cmdline and b".supervise" not in cmdline:
                return int(pid)
    return None


def _drive_killed_rank(cluster: Cluster, corpus: Path, tmp_path: Path) -> tuple[str, float]:
    run = tmp_path / "kill"
    args = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1"]
    # fault.max_failures=0: no failure requeue (tests/slurm/test_faults_slurm.py has the requeue after a kill)
    over = tiny_overrides(run, corpus, 100_000, "fault.max_failures=0")
    job = submit(cluster, "train.sh", args, ["configs/demo.yaml", *over], tmp_path / "out.txt")
    wait_for_step(run, 3, timeout=420)  # from submission: it may queue behind other jobs
    pid = _rank_pid(job, 1)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    state = wait_job(cluster, job, timeout=120)
    took = time.monotonic() - t0
    print(f"job {job} ended {state} {took:.1f}s after SIGKILL of rank 1")
    return state, took


def test_killed_rank_fails_the_job_fast(one_node: dict[str, Future]) -> None:
    state, took = one_node["killed"].result()
    assert state == "FAILED"
    assert took < 90  # fail fast: no rank waits out a collective timeout


def test_two_hosts_ddp_matches_one_process(slurm_cluster2: Cluster, corpus_dir: Path, tmp_path: Path) -> None:
    run, steps = tmp_path / "two", 6
    over = tiny_overrides(run, corpus_dir, steps)
    job = submit(
        slurm_cluster2,
        "train.sh",
        ["--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1"],
        ["configs/demo.yaml", *over],
        tmp_path / "out.txt",
    )
    # the same config (same global batch) in one process here is the reference: trained while the job runs
    cfg = config_mod.load(REPO / "configs/demo.yaml", tiny_overrides(tmp_path / "ref", corpus_dir, steps))
    ref = single(lambda env, c: Trainer(c, env).train().losses, cfg)

    state = wait_job(slurm_cluster2, job, timeout=300)
    assert state == "COMPLETED", (tmp_path / "out.txt").read_text()[-4000:]
    hosts = json.loads((run / "ranks.json").read_text())["hosts"]
    assert hosts == ["node1"] * 2 + ["node2"] * 2
    got = step_losses(run)
    # 4 ranks vs 1: summation order differs, so equal to fp32 round-off (same tolerance as tests/dist)
    torch.testing.assert_close(
        [got[s] for s in range(1, steps + 1)], [ref[s] for s in range(1, steps + 1)], rtol=1e-5, atol=0
    )
    assert "ranks by host: node1: 0-1; node2: 2-3" in job_output(slurm_cluster2, job)
