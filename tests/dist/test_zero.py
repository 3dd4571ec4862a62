"""DeepSpeed ZeRO 1/2/3 on real gloo ranks equals one process (DDP path) on the same global batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpcdist.config import ConfigError, JobConfig
from hpcdist.env import DistEnv
from hpcdist.parallel.zero import deepspeed_config
from hpcdist.trainer import Trainer
from tests.dist.harness import run_ranks, single

pytestmark = pytest.mark.dist

STEPS = 10
RTOL = 1e-5  # fp32 on CPU: only the summation order differs from the single-process reference
NO_CKPT = ("checkpoint.every_steps=0", "checkpoint.save_final=false", "checkpoint.resume=none")


def _train(env: DistEnv, cfg: JobConfig) -> dict:
    trainer = Trainer(cfg, env)
    result = trainer.train()
    return {"losses": result.losses, "model": trainer.strategy.dcp_state()["model"]}


def _metrics(run_dir: Path, key: str) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r]


def _losses(out: dict) -> list[float]:
    return [out["losses"][s] for s in sorted(out["losses"])]


@pytest.fixture
def ref(small_cfg) -> dict:
    cfg = small_cfg(f"train.steps={STEPS}", "train.global_batch_size=8", "train.micro_batch_size=8")
    return {**single(_train, cfg), "run_dir": Path(cfg.run.dir)}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("micro", [4, 2], ids=["noaccum", "accum2"])
def test_zero_matches_single_process(small_cfg, ref, tmp_path: Path, stage: int, micro: int) -> None:
    cfg = small_cfg(
        f"train.steps={STEPS}", "train.global_batch_size=8", f"train.micro_batch_size={micro}",
        "parallel.strategy=zero", f"parallel.zero.stage={stage}", *NO_CKPT, run_dir=tmp_path / "zero",
    )  # fmt: skip
    outs = run_ranks(2, _train, cfg)
    expected = _losses(ref)
    assert len(expected) == STEPS and expected[-1] < expected[0]
    for out in outs:
        torch.testing.assert_close(_losses(out), expected, rtol=RTOL, atol=0)
    # DeepSpeed reports the pre-clip global gradient norm and steps the hpcdist LR schedule, like the reference
    for key in ("grad_norm", "lr"):
        got, want = _metrics(tmp_path / "zero", key), _metrics(ref["run_dir"], key)
        assert len(got) == STEPS
        torch.testing.assert_close(got, want, rtol=1e-4, atol=0, msg=key)
    for name, p in outs[0]["model"].items():
        torch.testing.assert_close(p, ref["model"][name], rtol=0, atol=1e-4, msg=name)


def test_deepspeed_config_batch_arithmetic() -> None:
    c = deepspeed_config(
        stage=2, micro_batch_size=4, grad_accum=3, dp_size=2, grad_clip=1.0, bf16=False,
        offload_optimizer=False, offload_params=False, overlap_comm=True, buckets=(100, 200),
    )  # fmt: skip
    assert c["train_batch_size"] == 24 and c["gradient_accumulation_steps"] == 3
    assert c["zero_optimization"]["stage"] == 2 and c["zero_optimization"]["allgather_bucket_size"] == 200
    assert c["bf16"] == {"enabled": False} and "optimizer" not in c  # no DS optimizer: no fused_adam build


def test_zero_config_validation(small_cfg) -> None:
    with pytest.raises(ConfigError, match="checkpoints are not supported"):
        small_cfg("parallel.strategy=zero")
    with pytest.raises(ConfigError, match="parallel.zero.stage"):
        small_cfg("parallel.strategy=zero", "parallel.zero.stage=4", *NO_CKPT)
    with pytest.raises(ConfigError, match="offload_params"):
        small_cfg("parallel.strategy=zero", "parallel.zero.offload_params=true", *NO_CKPT)
