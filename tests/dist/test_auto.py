"""parallel.strategy=auto: the run resolves the planner's top layout for its world size once, says why, and the
trainer builds it; a Trainer never plans (it refuses an unresolved config)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from hpcdist.config import JobConfig
from hpcdist.env import DistEnv, from_environ
from hpcdist.planning.layouts import resolve_auto
from hpcdist.run import train
from hpcdist.trainer import Trainer
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist


def _run_train(env: DistEnv, cfg: JobConfig) -> dict:
    result = train(cfg, env)  # hpcdist.run's per-rank body: resolves auto, then Trainer(cfg, env).train()
    return {"losses": result.losses}


def test_auto_trains_with_the_planners_top_row(small_cfg, tmp_path: Path, capfd) -> None:
    cfg = small_cfg("parallel.strategy=auto", "train.steps=3", "train.global_batch_size=8", run_dir=tmp_path / "r")
    expected, reason = resolve_auto(cfg, 2, "a100_ib")
    assert expected.parallel.strategy != "auto" and reason
    out = run_ranks(2, _run_train, cfg)[0]
    assert sorted(out["losses"]) == [1, 2, 3] and all(math.isfinite(v) for v in out["losses"].values())
    assert "parallel.strategy=auto: " in capfd.readouterr().out
    saved = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())["parallel"]
    assert saved["strategy"] == expected.parallel.strategy  # the run records the layout it really used
    assert (saved["pp"], saved["dp"], saved["tp"]) == (expected.parallel.pp, expected.parallel.dp, expected.parallel.tp)


def test_a_trainer_refuses_an_unresolved_auto_config(small_cfg, tmp_path: Path) -> None:
    cfg = small_cfg("parallel.strategy=auto", run_dir=tmp_path / "r")
    env = from_environ({}, cuda_available=False)  # one process, no launcher
    with pytest.raises(ValueError, match="resolved before building a Trainer"):
        Trainer(cfg, env)
