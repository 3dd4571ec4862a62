"""The dataset recipe on real ranks: rank 0 prepares the stdlib corpus and the others wait; when rank 0's
preparation fails, every rank learns it at once (they used to wait at the barrier until the watchdog fired)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcdist import config as config_mod
from hpcdist.config import ConfigError, JobConfig
from hpcdist.data.build import build_datasets
from hpcdist.env import DistEnv
from tests.conftest import SMALL
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist


def _build(env: DistEnv, cfg: JobConfig) -> str:
    try:
        train, _ = build_datasets(cfg, is_main=env.is_main)
    except ConfigError as e:  # a refusal: one line on every rank
        return f"refused: {e}"
    return f"built {len(train)}"


def test_a_failed_rank0_preparation_stops_every_rank_with_its_reason(tmp_path: Path) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a dataset\n")  # prepare refuses a non-empty directory it did not make
    cfg = config_mod.load(None, [*SMALL, f"run.dir={tmp_path / 'run'}", "data.source=stdlib", f"data.path={foreign}"])
    out = run_ranks(2, _build, cfg, timeout=60)  # before the fix: rank 1 sat in the barrier (queue.Empty here)
    assert all(o.startswith("refused: ") and str(foreign) in o for o in out), out
    assert out[0] == out[1]  # rank 1 names rank 0's reason
    assert (foreign / "notes.txt").read_text() == "not a dataset\n"


def test_rank0_prepares_and_every_rank_reads_the_same_data(tmp_path: Path) -> None:
    cfg = config_mod.load(None, [*SMALL, f"run.dir={tmp_path / 'run'}", "data.source=stdlib"])
    out = run_ranks(2, _build, cfg, timeout=120)
    assert out[0] == out[1] and out[0].startswith("built "), out
