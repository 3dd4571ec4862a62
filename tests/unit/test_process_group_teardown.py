"""Leaving the process group (hpcdist.env.destroy_process_group) leaves nothing behind that a later one trips over:
a second ZeRO run in the same process (the Python API, a notebook, a test session) joins a new group, and
DeepSpeed must not hand it the first run's destroyed world group."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcdist.env import destroy_process_group, from_environ, init_process_group
from tests.dist.harness import free_port
from tests.training import train


def _one_zero_run(small_cfg, run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> float:
    environ = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "TORCHELASTIC_RUN_ID": "teardown",
    }
    env = from_environ(environ, cuda_available=False)
    for name, value in environ.items():  # undone after the test: later tests start ranks from this environment
        monkeypatch.setenv(name, value)
    init_process_group(env, timeout_s=120)
    try:
        cfg = small_cfg("train.steps=1", "parallel.strategy=zero", "checkpoint.save_final=false", run_dir=run_dir)
        return train(env, cfg)["losses"][1]
    finally:
        destroy_process_group()


def test_a_second_zero_run_in_the_same_process_joins_its_own_group(
    small_cfg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _one_zero_run(small_cfg, tmp_path / "a", monkeypatch)
    second = _one_zero_run(small_cfg, tmp_path / "b", monkeypatch)  # DeepSpeed cached the first run's world group
    assert second == first  # the same seed, the same step
