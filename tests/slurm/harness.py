"""Helpers the SLURM tier's modules share: submitting a training job to the sandbox, reading what its ranks wrote
(losses, heartbeats), and the layouts and references several scenarios use."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from hpcdist.fault.hang import read_heartbeats
from tests.conftest import SMALL
from tests.slurm.conftest import REPO, Cluster, run_cmd, wait_job

# every rank on CPU; the sandbox's "GPUs" are fake devices, so torch picks gloo. ethernet profile: gloo's
# interface is auto-detected per host (needed across the namespaced hosts).
JOB_ENV = {"HPCDIST_NCCL_PROFILE": "ethernet", "OMP_NUM_THREADS": "1"}


def tiny_overrides(run_dir: Path, corpus: Path, steps: int, *extra: str) -> list[str]:
    return [
        *SMALL,
        f"run.dir={run_dir}",
        "data.source=files",
        f"data.path={corpus}",
        f"train.steps={steps}",
        "train.global_batch_size=8",
        "train.micro_batch_size=1",
        "train.eval_every_steps=0",
        "train.activation_checkpointing=false",
        "checkpoint.async_save=false",
        "parallel.strategy=ddp",
        *extra,
    ]


def env_with(cluster: Cluster) -> dict[str, str]:
    return {**cluster.env, **JOB_ENV}


def submit(cluster: Cluster, script: str, sbatch_args: list[str], overrides: list[str], out: Path) -> str:
    args = [*sbatch_args, f"--output={out}", str(REPO / "sbatch" / script), *overrides]  # scripts append on requeue
    proc = run_cmd(cluster, "sbatch", "--parsable", *args, cwd=REPO, env=env_with(cluster))
    return proc.stdout.strip().split(";")[0]


def step_losses(run_dir: Path) -> dict[int, float]:
    """Per-step loss from metrics.jsonl; a step redone after a restart keeps its last value."""
    out: dict[int, float] = {}
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        m = json.loads(line)
        if "split" not in m:
            out[m["step"]] = m["loss"]
    return out


def wait_for_step(run_dir: Path, step: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while max(step_losses(run_dir), default=0) < step:
        assert time.monotonic() < deadline, f"no step {step} in {run_dir}/metrics.jsonl after {timeout}s"
        time.sleep(0.1)


def rank_in_restart(run: Path, rank: int, restart: int, timeout: float = 180) -> dict[str, Any]:
    """The heartbeat of ``rank`` once the attempt ``restart`` is training (pid, host, step)."""
    deadline = time.monotonic() + timeout
    while True:
        beat = read_heartbeats(run, rank + 1).get(rank, {})
        if beat.get("restart") == restart:
            return beat
        assert time.monotonic() < deadline, f"rank {rank} of restart {restart} never started training in {run}"
        time.sleep(0.1)


def first_step_after(run: Path, t: float, timeout: float = 120) -> float:
    """When metrics.jsonl first logged a step after time ``t`` (training has resumed); waits for it."""
    deadline = time.monotonic() + timeout
    while True:
        for line in (run / "metrics.jsonl").read_text().splitlines():
            m = json.loads(line)
            if "split" not in m and m["time"] > t:
                return m["time"]
        assert time.monotonic() < deadline, f"no step logged after {t} in {run}"
        time.sleep(0.1)


# the in-job restart scenarios: one task per host, their run length and common overrides
INJOB_STEPS = 16
ONE_TASK = ["--ntasks-per-node=1", "--gpus-per-node=1", "--cpus-per-task=1"]
INJOB_COMMON = ("checkpoint.every_steps=4", "logging.straggler_every_steps=0", "fault.restart_backoff_s=1")


def injob_overrides(run: Path, corpus: Path, *extra: str) -> list[str]:
    return ["configs/demo.yaml", *tiny_overrides(run, corpus, INJOB_STEPS, *INJOB_COMMON, *extra)]


class Reference:
    """The uninterrupted run of the same layout (2 ranks, ddp), submitted once for the module and waited for only
    where its losses are compared: it trains beside the first scenario instead of before it."""

    def __init__(self, cluster: Cluster, corpus: Path, d: Path) -> None:
        self.cluster, self.d = cluster, d
        args = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1"]
        self.job = submit(cluster, "train.sh", args, injob_overrides(d / "run", corpus), d / "out.txt")
        self._losses: dict[int, float] | None = None

    def losses(self) -> dict[int, float]:
        if self._losses is None:
            state = wait_job(self.cluster, self.job, timeout=240)
            assert state == "COMPLETED", (self.d / "out.txt").read_text()[-3000:]
            self._losses = step_losses(self.d / "run")
            assert sorted(self._losses) == list(range(1, INJOB_STEPS + 1))
        return self._losses


_SHARED_REFERENCE = pytest.StashKey[tuple[Any, Reference]]()


def shared_reference(
    config: pytest.Config, cluster: Cluster, corpus: Path, factory: pytest.TempPathFactory
) -> Reference:
    """The session's one Reference: test_injob_slurm and test_local_checkpoint_slurm compare their losses with the same
    uninterrupted run (same model, data, steps and 2 ranks; the checkpoint cadences do not change the losses), so it
    trains once for both. A sandbox started afresh in between (its job ids start again at 1) gets a new one."""
    daemons = json.loads((cluster.dir / "state.json").read_text())["pids"]
    held = config.stash.get(_SHARED_REFERENCE, None)
    if held is None or held[0] != daemons:
        held = (daemons, Reference(cluster, corpus, factory.mktemp("injob_ref")))
        config.stash[_SHARED_REFERENCE] = held
    return held[1]


# nccl_check's arguments on the throttled two-host sandbox. The throttle makes node2's link ~100x slower than the
# unthrottled veth; the threshold is far from both, so the noise of a shared machine neither hides the slow host nor
# invents one.
NCCL_CHECK = [
    "--max-bytes",
    "64K",
    "--iters",
    "3",
    "--warmup",
    "1",
    "--finder-bytes",
    "1M",
    "--finder-iters",
    "5",
    "--slow-threshold",
    "0.1",
    "--timeout",
    "90",
]
