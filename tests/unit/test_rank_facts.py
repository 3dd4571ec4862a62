"""A rank's facts (the resolved config, its layout's ParallelDims, the config and data checks) are
built once, by one function, and handed down: run.main -> run.train -> Trainer -> build_strategy."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hpcdist import config as config_mod
from hpcdist import run
from hpcdist.env import from_environ
from hpcdist.parallel.dims import ParallelDims
from hpcdist.planning import layouts as planner
from hpcdist.rankfacts import rank_facts
from hpcdist.trainer import Trainer
from tests.conftest import SMALL


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A plain ``python`` process (no launcher, no scheduler); run.main's exports are undone afterwards."""
    saved = dict(os.environ)
    launcher = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "HPCDIST_EXPORTED")
    for name in list(os.environ):
        if name.startswith(("SLURM_", "TORCHELASTIC_")) or name in launcher:
            monkeypatch.delenv(name)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _count(monkeypatch: pytest.MonkeyPatch, counts: Counter[str], owner: Any, name: str) -> None:
    real: Callable[..., Any] = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        counts[name] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)


def _overrides(corpus_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        *SMALL,
        "data.source=files",
        f"data.path={corpus_dir}",
        f"run.dir={run_dir}",
        "train.steps=1",
        "train.global_batch_size=2",
        "train.micro_batch_size=1",
        "data.prefetch=0",
        *extra,
    ]


def test_one_rank_resolves_checks_and_builds_its_layout_once(
    one_rank: None, corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counts: Counter[str] = Counter()
    _count(monkeypatch, counts, config_mod, "check_world")
    _count(monkeypatch, counts, config_mod, "check_data")
    _count(monkeypatch, counts, ParallelDims, "__post_init__")  # every ParallelDims built, by whichever function
    result = run.main(None, _overrides(corpus_dir, tmp_path / "run", "parallel.strategy=ddp"))
    assert result.step == 1 and result.exit_code == 0
    assert counts == {"check_world": 1, "check_data": 1, "__post_init__": 1}, counts


def test_auto_is_planned_once_per_rank(
    one_rank: None, corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counts: Counter[str] = Counter()
    _count(monkeypatch, counts, planner, "resolve_auto")
    _count(monkeypatch, counts, config_mod, "check_data")
    result = run.main(None, _overrides(corpus_dir, tmp_path / "run", "parallel.strategy=auto"))
    assert result.step == 1 and result.exit_code == 0
    assert counts == {"resolve_auto": 1, "check_data": 1}, counts


def test_a_trainer_refuses_facts_built_from_another_config(small_cfg, tmp_path: Path) -> None:
    """Facts handed down must be the ones of the config being trained: otherwise the loader and the strategy would
    read a layout the config does not name."""
    env = from_environ({}, cuda_available=False)
    cfg = small_cfg("parallel.strategy=ddp", run_dir=tmp_path / "r")
    other = rank_facts(small_cfg("parallel.strategy=ddp", run_dir=tmp_path / "r"), env)
    with pytest.raises(ValueError, match="built from another config"):
        Trainer(cfg, env, facts=other)
    assert not (tmp_path / "r").exists()  # refused before anything was written
