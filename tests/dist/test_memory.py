"""Measured model-state bytes per rank: ZeRO-3 at 4 ranks holds 18/64 of DDP's (DDP 16 bytes/param: fp32 weights,
gradients, Adam m and v; ZeRO-3 18 per param over 4 ranks: bf16 weights, fp32 gradient partitions, fp32 master, m and
v), and the memory estimator (hpcdist.planning.memory) predicts both measurements.

Both runs use bf16 mixed precision (DeepSpeed's bf16 mode; DDP under bf16 autocast with fp32 weights), the
precision the estimator models. Measured after the backward pass of the second step: parameters, gradients
and optimizer state all exist then, and ZeRO-3's gathered layers are already released.
"""

from __future__ import annotations

import pytest

from hpcdist.config import JobConfig
from hpcdist.env import DistEnv
from hpcdist.planning.memory import estimate_memory, largest_layer_params
from hpcdist.trainer import Trainer
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist

WORLD = 4
# big enough that the ZeRO-3 shards dominate (every matrix >= 65k elements, all sharded: persistence 0)
MODEL = ("model.dim=256", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=4", "model.ffn_dim=768")
COMMON = (*MODEL, "train.dtype=bf16", "train.global_batch_size=8", "train.micro_batch_size=2", "train.steps=2")


def measure(env: DistEnv, cfg: JobConfig) -> dict[str, int]:
    trainer = Trainer(cfg, env)
    strategy = trainer.strategy
    strategy.forward_backward(trainer.loader.next_batch())
    strategy.optimizer_step()  # creates the Adam moments
    strategy.forward_backward(trainer.loader.next_batch())
    return strategy.model_state_bytes()


def _estimate(cfg: JobConfig, strategy: str) -> int:
    """The estimator's model states, less ZeRO-3's gathered largest layer (bf16 weight and gradient: released by the
    time of the measurement)."""
    e = estimate_memory(
        cfg.model_args(),
        strategy=strategy,
        world_size=WORLD,
        gpus_per_node=WORLD,
        micro_batch_size=2,
        seq_len=cfg.data.seq_len,
        activation_checkpointing=False,
    )
    return e.model_states - (4 * largest_layer_params(cfg.model_args()) if strategy == "zero3" else 0)


def test_zero3_model_states_quarter_of_ddp(small_cfg, tmp_path) -> None:
    ddp_cfg = small_cfg(*COMMON, run_dir=tmp_path / "ddp")
    zero_cfg = small_cfg(
        *COMMON,
        "parallel.strategy=zero",
        "parallel.zero.stage=3",
        "parallel.zero.param_persistence_threshold=0",
        run_dir=tmp_path / "zero3",
    )
    ddp = run_ranks(WORLD, measure, ddp_cfg)
    zero = run_ranks(WORLD, measure, zero_cfg)
    for per_rank in (ddp, zero):
        assert all(v > 0 for r in per_rank for v in r.values()), per_rank  # every category was found
    ddp_bytes = max(sum(r.values()) for r in ddp)
    zero_bytes = max(sum(r.values()) for r in zero)
    print(f"\nmodel-state bytes per rank: ddp {ddp_bytes:,}  zero3 {zero_bytes:,}  ratio {zero_bytes / ddp_bytes:.3f}")
    assert zero_bytes <= 0.29 * ddp_bytes  # 18 / 64 = 0.281
    for measured, strategy in ((ddp_bytes, "ddp"), (zero_bytes, "zero3")):
        predicted = _estimate(zero_cfg, strategy)
        assert abs(predicted - measured) <= 0.10 * measured, (strategy, predicted, measured)
