"""A rank slowed artificially (its data loading sleeps) is reported as a straggler by rank 0: warning, metrics,
failures.jsonl line, once it was slow at two checks in a row."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest

from hpcdist.fault.failures import read_failures
from hpcdist.trainer import Trainer
from tests.dist.harness import run_ranks
from tests.training import train

pytestmark = pytest.mark.dist


def _slow_data(slow_rank: int, delay_s: float) -> Callable[[Trainer], None]:
    """A ``before`` hook: a slow file system on one host."""

    def patch(trainer: Trainer) -> None:
        next_batch = trainer.loader.next_batch

        def slow_next_batch():
            if trainer.env.rank == slow_rank:
                time.sleep(delay_s)
            return next_batch()

        trainer.loader.next_batch = slow_next_batch

    return patch


def test_a_rank_with_slow_data_loading_is_reported(small_cfg, tmp_path: Path) -> None:
    run = tmp_path / "slow"
    cfg = small_cfg(
        "train.steps=12",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "logging.straggler_every_steps=4",
        run_dir=run,
    )
    assert [out["step"] for out in run_ranks(2, partial(train, before=_slow_data(1, 0.05)), cfg)] == [12, 12]

    reports = [r for r in read_failures(run) if r["kind"] == "straggler"]
    slow = [r for r in reports if r["measure"] == "data"]
    assert [(r["rank"], r["step"]) for r in slow] == [(1, 8), (1, 12)]  # only the slowed rank; confirmed from check 2
    assert slow[0]["blame"] == [{"rank": 1, "host": slow[0]["host"]}] and slow[0]["ratio"] > 1.5
    assert "rank 1 on" in slow[0]["cause"] and "data loading per step" in slow[0]["cause"]
    per_rank = slow[0]["per_rank"]
    assert per_rank[1]["data_s"] >= 0.05 > per_rank[0]["data_s"]

    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    checks = [m for m in metrics if m.get("split") == "straggler"]
    assert [m["step"] for m in checks] == [4, 8, 12]  # every check's numbers
    assert all(m["data_ratio"] > 1.5 and m["data_s_max"] >= 0.05 for m in checks) and checks[-1]["count"] >= 1
