"""A signal on one rank stops every rank after the same step, with one complete checkpoint; resume is exact."""

from __future__ import annotations

import signal
from functools import partial
from pathlib import Path

import pytest

from hpcdist.checkpoint.names import list_checkpoints
from hpcdist.fault.stop import StopReason
from tests.dist.harness import run_ranks
from tests.training import signal_at, train

pytestmark = pytest.mark.dist


@pytest.mark.parametrize(
    ("sig", "reason"), [(signal.SIGUSR2, StopReason.TIME_LIMIT), (signal.SIGTERM, StopReason.TERMINATE)]
)
def test_signal_on_one_rank_stops_all_and_resumes_exactly(small_cfg, tmp_path: Path, sig: int, reason) -> None:
    over = ("train.steps=8", "train.global_batch_size=8", "train.micro_batch_size=4")
    straight = run_ranks(2, train, small_cfg(*over, run_dir=tmp_path / "straight"))[0]

    cfg = small_cfg(*over, run_dir=tmp_path / "pre")
    outs = run_ranks(2, partial(train, before=signal_at(1, 3, int(sig))), cfg)
    # both ranks stopped although only rank 1 got the signal: the agreement started after step 3 is read after
    # step 4 (it runs asynchronously); no SLURM here, so no requeue
    assert [(o["step"], o["reason"], o["code"]) for o in outs] == [(4, reason, 0)] * 2
    assert [s for s, _ in list_checkpoints(cfg.checkpoint_dir)[0]] == [4]

    resumed = run_ranks(2, train, cfg)[0]
    assert resumed["step"] == 8
    merged = {**outs[0]["losses"], **resumed["losses"]}
    assert [merged[s] for s in range(1, 9)] == [straight["losses"][s] for s in range(1, 9)]  # bitwise
