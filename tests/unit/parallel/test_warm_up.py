"""What a warm spare builds before it has a rank (hpcdist.parallel.warm_up): its meta model, taken by the Trainer in
place of its own build, trains exactly as the Trainer's own; a model of another config, or one already materialized,
is refused before anything trains."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcdist.config import JobConfig
from hpcdist.models import Transformer
from hpcdist.parallel import parallelize
from hpcdist.parallel.parallelize import warm_up
from hpcdist.rankfacts import rank_facts
from tests.dist.harness import single
from tests.training import train


def _warm_up(cfg: JobConfig) -> Transformer:
    return single(lambda env: warm_up(cfg, rank_facts(cfg, env).dims))


def test_a_model_built_ahead_trains_exactly_as_the_trainers_own(small_cfg, tmp_path: Path) -> None:
    steps = ("train.steps=2", "checkpoint.every_steps=0", "checkpoint.save_final=false")
    cfg, ahead_cfg = small_cfg(*steps), small_cfg(*steps, run_dir=tmp_path / "ahead")
    own = single(lambda env: train(env, cfg, params=True))
    model = _warm_up(ahead_cfg)
    assert all(p.is_meta for p in model.parameters())
    ahead = single(lambda env: train(env, ahead_cfg, params=True, model=model))
    assert ahead["losses"] == own["losses"] and len(own["losses"]) == 2
    assert own["params"].keys() == ahead["params"].keys()
    assert all(own["params"][k].equal(ahead["params"][k]) for k in own["params"])


def test_a_model_of_another_config_or_off_meta_is_refused(small_cfg) -> None:
    cfg = small_cfg("train.steps=1")
    other = _warm_up(small_cfg("model.n_layers=3"))
    with pytest.raises(ValueError, match="this config's model on the meta device"):
        single(lambda env: train(env, cfg, model=other))
    real = _warm_up(cfg).to_empty(device="cpu")
    with pytest.raises(ValueError, match="this config's model on the meta device"):
        single(lambda env: train(env, cfg, model=real))


def test_only_zero_imports_deepspeed_ahead(small_cfg, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(parallelize, "import_deepspeed", lambda: calls.append("deepspeed"))
    _warm_up(small_cfg("parallel.strategy=ddp"))
    assert calls == []
    _warm_up(small_cfg("parallel.strategy=zero"))
    assert calls == ["deepspeed"]
