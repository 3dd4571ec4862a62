"""train.dtype=fp16 on 2 ranks (CPU, gloo): the loss scaler under DDP (GradScaler) and FSDP2 (ShardedGradScaler).
An overflow injected on ONE rank is skipped on both (the verdict is shared), and a resume at step 2 is exact.
ZeRO's fp16 (DeepSpeed's own scaler, no CPU support) is the GPU tier's (tests/gpu/test_gpu.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from hpcdist.env import DistEnv
from hpcdist.trainer import Trainer
from tests.dist.harness import run_ranks
from tests.training import full_tensor, train

pytestmark = pytest.mark.dist

OVERFLOW = "HPCDIST_TEST_FP16_OVERFLOW_AT"


def _scaler_and_model(trainer: Trainer, _: object) -> dict[str, Any]:
    sd = trainer.strategy.dcp_state()["model"]
    return {"scaler": trainer.strategy.scaler_state(), "model": {k: full_tensor(v) for k, v in sd.items()}}


def _run(env: DistEnv, cfg: Any, until: int | None, inject: bool) -> dict[str, Any]:
    if inject and env.rank == 1:  # one rank's gradients overflow (ShardedGradScaler: that rank's shards only)
        os.environ[OVERFLOW] = "2"
    else:
        os.environ.pop(OVERFLOW, None)
    return train(env, cfg, until, after=_scaler_and_model)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_fp16_two_ranks_overflow_on_one_rank_and_exact_resume(small_cfg, tmp_path: Path, strategy: str) -> None:
    over = (
        "train.dtype=fp16",
        "train.steps=4",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        f"parallel.strategy={strategy}",
        "checkpoint.every_steps=0",
    )
    straight = run_ranks(2, _run, small_cfg(*over, run_dir=tmp_path / "straight"), None, True)
    cfg = small_cfg(*over, run_dir=tmp_path / "split")
    first = run_ranks(2, _run, cfg, 2, True)
    second = run_ranks(2, _run, cfg, None, False)
    want = {"scale": 32768.0, "growth_tracker": 2, "overflow_steps": 1}  # step 2 skipped on both ranks
    for s, f, r in zip(straight, first, second, strict=True):
        assert s["scaler"] == r["scaler"] == want
        assert f["scaler"] == {**want, "growth_tracker": 0}
        assert {**f["losses"], **r["losses"]} == s["losses"]
        for name, p in s["model"].items():
            assert torch.equal(r["model"][name], p), name
