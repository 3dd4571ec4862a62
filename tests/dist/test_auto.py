"""parallel.strategy=auto: the trainer runs the planner's top layout for its world size and says why."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from hpcdist.config import JobConfig
from hpcdist.env import DistEnv
from hpcdist.planner import resolve_auto
from hpcdist.trainer import Trainer
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist


def _train(env: DistEnv, cfg: JobConfig) -> dict:
    result = Trainer(cfg, env).train()
    return {"losses": result.losses}


def test_auto_trains_with_the_planners_top_row(small_cfg, tmp_path: Path, capfd) -> None:
    cfg = small_cfg("parallel.strategy=auto", "train.steps=3", "train.global_batch_size=8", run_dir=tmp_path / "r")
    expected, reason = resolve_auto(cfg, 2, "a100_ib")
    assert expected.parallel.strategy != "auto" and reason
    out = run_ranks(2, _train, cfg)[0]
    assert sorted(out["losses"]) == [1, 2, 3] and all(math.isfinite(v) for v in out["losses"].values())
    assert "parallel.strategy=auto: " in capfd.readouterr().out
    saved = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())["parallel"]
    assert saved["strategy"] == expected.parallel.strategy  # the run records the layout it really used
    assert (saved["pp"], saved["dp"], saved["tp"]) == (expected.parallel.pp, expected.parallel.dp, expected.parallel.tp)
