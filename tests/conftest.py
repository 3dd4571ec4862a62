"""Shared fixtures: small configs and a prepared slice of the embedded corpus."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcdist import config as config_mod
from hpcdist.data import prepare_shards, stdlib_corpus

REPO = Path(__file__).resolve().parents[1]

# A model small enough that a 2-rank step takes milliseconds on a 2-core CI box, but with every part of the
# real architecture (GQA, RoPE, SwiGLU, several layers). peak_flops is fixed so no test measures the CPU.
SMALL = [
    "model.preset=tiny",
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=128",
    "data.seq_len=32",
    "optim.warmup_steps=2",
    "optim.lr=0.003",
    "logging.every_steps=1",
    "logging.tensorboard=false",
    "logging.peak_flops=1e11",
    "checkpoint.every_steps=0",
    "checkpoint.save_final=false",
]


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """200k tokens of the stdlib corpus, prepared once per test session."""
    out = tmp_path_factory.mktemp("corpus")
    return prepare_shards(stdlib_corpus(), out, max_tokens=200_000)


@pytest.fixture
def small_cfg(tmp_path: Path, corpus_dir: Path):
    """Factory: a validated small JobConfig in a fresh run dir; extra overrides win."""

    def make(*overrides: str, run_dir: Path | None = None) -> config_mod.JobConfig:
        base = [*SMALL, f"run.dir={run_dir or tmp_path / 'run'}", "data.source=files", f"data.path={corpus_dir}"]
        return config_mod.load(None, [*base, *overrides])

    return make
