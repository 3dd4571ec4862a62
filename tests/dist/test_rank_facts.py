"""On real ranks: each rank builds one ParallelDims, and the trainer's data loader and its strategy read
that same object (they were two, three with the layout line, each rebuilt from the config)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from hpcdist import config as config_mod
from hpcdist.config import JobConfig
from hpcdist.env import DistEnv
from hpcdist.parallel.dims import ParallelDims
from hpcdist.trainer import Trainer
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist

COUNTS: Counter[str] = Counter()  # each forked rank counts in its own copy


def _build(env: DistEnv, cfg: JobConfig) -> dict[str, Any]:
    COUNTS.clear()
    trainer = Trainer(cfg, env)  # the Python API: the facts built once, here
    try:
        return {"same": trainer.strategy.dims is trainer.dims, "counts": dict(COUNTS), "dp": trainer.dims.dp}
    finally:
        trainer.run_lock.release()


def test_the_trainer_and_its_strategy_share_one_parallel_dims(
    small_cfg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for owner, name in ((config_mod, "check_world"), (config_mod, "check_data"), (ParallelDims, "__post_init__")):
        real = getattr(owner, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            COUNTS[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
    cfg = small_cfg(
        "parallel.strategy=fsdp",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "data.prefetch=0",
        run_dir=tmp_path / "r",
    )
    for out in run_ranks(2, _build, cfg):
        assert out["same"] and out["dp"] == 2
        assert out["counts"] == {"check_world": 1, "check_data": 1, "__post_init__": 1}, out["counts"]
