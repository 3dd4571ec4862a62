"""A signal on one rank stops every rank after the same step, with one complete checkpoint; resume is exact."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from hpcdist.checkpoint.names import list_checkpoints
from hpcdist.config import JobConfig
from hpcdist.env import DistEnv
from hpcdist.fault.stop import StopReason
from hpcdist.trainer import Trainer
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist


def _train_with_signal(env: DistEnv, cfg: JobConfig, rank: int, at_step: int, sig: int) -> dict:
    """Train; on `rank`, deliver `sig` to this process in the middle of step `at_step` (after the backward)."""
    trainer = Trainer(cfg, env)
    step_fn = trainer.strategy.optimizer_step

    def step_and_maybe_signal(**kw):
        if env.rank == rank and trainer.step + 1 == at_step:
            os.kill(os.getpid(), sig)  # the handler only sets a flag; the step still completes
        return step_fn(**kw)

    trainer.strategy.optimizer_step = step_and_maybe_signal
    r = trainer.train()
    return {"losses": r.losses, "step": r.step, "reason": r.stop_reason, "code": r.exit_code}


def _plain(env: DistEnv, cfg: JobConfig) -> dict:
    r = Trainer(cfg, env).train()
    return {"losses": r.losses, "step": r.step}


@pytest.mark.parametrize(
    ("sig", "reason"), [(signal.SIGUSR2, StopReason.TIME_LIMIT), (signal.SIGTERM, StopReason.TERMINATE)]
)
def test_signal_on_one_rank_stops_all_and_resumes_exactly(small_cfg, tmp_path: Path, sig: int, reason) -> None:
    over = ("train.steps=8", "train.global_batch_size=8", "train.micro_batch_size=4")
    straight = run_ranks(2, _plain, small_cfg(*over, run_dir=tmp_path / "straight"))[0]

    cfg = small_cfg(*over, run_dir=tmp_path / "pre")
    outs = run_ranks(2, _train_with_signal, cfg, 1, 3, int(sig))
    # both ranks stopped although only rank 1 got the signal: the agreement started after step 3 is read after
    # step 4 (it runs asynchronously); no SLURM here, so no requeue
    assert [(o["step"], o["reason"], o["code"]) for o in outs] == [(4, reason, 0)] * 2
    assert [s for s, _ in list_checkpoints(cfg.checkpoint_dir)[0]] == [4]

    resumed = run_ranks(2, _plain, cfg)[0]
    assert resumed["step"] == 8
    merged = {**outs[0]["losses"], **resumed["losses"]}
    assert [merged[s] for s in range(1, 9)] == [straight["losses"][s] for s in range(1, 9)]  # bitwise
