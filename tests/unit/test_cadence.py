"""Components own their cadence (metrics, checkpoints, evaluation) and the watchdog's phases are context managers."""

from __future__ import annotations

import time
from pathlib import Path

from hpcdist.checkpoint import CheckpointManager
from hpcdist.evaluate import Evaluator
from hpcdist.fault.hang import HangWatchdog
from hpcdist.metrics.logger import MetricsLogger


def test_metrics_checkpoints_and_evaluation_say_when_they_are_due(tmp_path: Path) -> None:
    ml = MetricsLogger(tmp_path, enabled=False, every_steps=5)
    assert [s for s in range(1, 13) if ml.due(s, last=12)] == [1, 5, 10, 12]  # first, every 5th, the last
    ckpt = CheckpointManager(tmp_path / "ckpt", rank=0, world_size=1, every_steps=4)
    assert [s for s in range(1, 13) if ckpt.due(s)] == [4, 8, 12]
    assert not any(CheckpointManager(tmp_path / "c2", rank=0, world_size=1).due(s) for s in range(1, 13))
    ev = Evaluator(list(range(8)), every_steps=3, batches=1, global_batch_size=2, seed=0, dp_rank=0, dp_size=1)
    assert [s for s in range(1, 10) if ev.due(s)] == [3, 6, 9]
    no_val = Evaluator(None, every_steps=3, batches=1, global_batch_size=2, seed=0, dp_rank=0, dp_size=1)
    assert not any(no_val.due(s) for s in range(1, 10))


def test_a_slow_phase_is_timed_on_exit_and_its_next_run_gets_four_times_that(tmp_path: Path) -> None:
    w = HangWatchdog(rank=0, world_size=1, host="h", run_dir=tmp_path, timeout_s=0.5, slow_phase_s=100)
    with w.phase(1, "checkpoint save", slow=True):
        assert w.current_phase == "checkpoint save" and w._allow == 100  # its first time: the slow allowance
        time.sleep(0.3)
    time.sleep(0.4)  # after the phase: not part of its duration (the next beat no longer adds it)
    w.beat(1, "step")
    assert 0.3 <= w._seen["checkpoint save"] < 0.6
    with w.phase(2, "checkpoint save", slow=True):
        assert w._allow == max(0.5, 4 * w._seen["checkpoint save"])
