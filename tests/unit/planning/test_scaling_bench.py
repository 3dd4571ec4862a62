"""tools/bench/scaling.py's predicted column is the planner's own estimate_step (no second formula)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from hpcdist.planning import layouts as planner

REPO = Path(__file__).resolve().parents[3]


def _scaling():
    spec = importlib.util.spec_from_file_location("scaling_bench", REPO / "tools" / "bench" / "scaling.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_prediction_for_13b_on_a100_ib_comes_from_the_planner(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, planner.StepEstimate]] = []
    real = planner.estimate_step

    def spy(args, layout, **kw):
        est = real(args, layout, **kw)
        calls.append((layout.world_size, est))
        return est

    monkeypatch.setattr(planner, "estimate_step", spy)
    out = _scaling().predict(str(REPO / "configs" / "train_13b.yaml"), [8, 32], "a100_ib", None)
    by_world = dict(calls)
    assert set(by_world) == {1, 8, 32}  # ZeRO-3: one replica is one GPU
    base = by_world[1].tokens_per_s_per_gpu
    for n in (8, 32):
        assert out["at"][n]["efficiency"] == by_world[n].tokens_per_s_per_gpu / base
        assert 0 < out["at"][n]["efficiency"] <= 1
    assert out["at"][8]["target"] == 0.9 and out["at"][32]["target"] == 0.8
    assert out["per_replica_batch"] == 8  # 256 / 32 ranks: the config's own per-rank batch, fixed (weak scaling)
