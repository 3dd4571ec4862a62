#!/usr/bin/env python3
"""Measured per-rank model-state bytes of ddp, zero1, zero2, zero3 and fsdp, next to the memory estimator,
and each strategy's step time relative to DDP, all in one invocation.

    python tools/bench/memory.py                    # 2 and 4 ranks, ~134 MB (fp32) model: ~4 min on 2 cores
    python tools/bench/memory.py --worlds 4 --dim 256 --layers 4 --json runs/bench/memory.json

Method. Every strategy trains the same model (seed, data) through the real ``Trainer`` on fork-started gloo
ranks, in bf16 mixed precision (DeepSpeed's bf16 mode; DDP and FSDP under fp32 weights with bf16 compute),
the precision the estimator models. ``Strategy.model_state_bytes()`` is read after the backward pass of the
second step, when parameters, gradients and Adam moments all exist and ZeRO-3's / FSDP's gathered layers are
released; each tensor storage is counted once, on the rank that holds it (local shards). The largest rank is
reported. Step time: the median of the timed steps after a warm-up, each ended by a barrier (rank 0's clock).

Columns: ``measured`` (params + grads + optimizer), the estimator's ``ideal`` model states (ZeRO paper: 16
bytes/param, sharded as the strategy shards it; what is resident between steps), its ``peak`` model states
(``params + grads + optimizer`` of ``estimate_memory``: adds the largest gathered layer and DeepSpeed's fp32
gradient copy made during the step), DeepSpeed's own estimator where it has one, and ``ideal / measured``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STRATEGIES: dict[str, tuple[str, ...]] = {
    "ddp": (),
    "zero1": ("parallel.strategy=zero", "parallel.zero.stage=1"),
    "zero2": ("parallel.strategy=zero", "parallel.zero.stage=2"),
    # persistence 0: every parameter is partitioned, as the estimator assumes (DeepSpeed's default keeps
    # parameters under 100k elements whole on every rank)
    "zero3": ("parallel.strategy=zero", "parallel.zero.stage=3", "parallel.zero.param_persistence_threshold=0"),
    "fsdp": ("parallel.strategy=fsdp",),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    return p


if __name__ == "__main__":
    # --help and a bad flag answer here, before torch (and hpcdist's trainer) is imported: seconds on a
    # busy node. main() parses again; that costs nothing.
    build_parser().parse_args()


import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hpcdist import config as config_mod  # noqa: E402
from hpcdist.config import JobConfig  # noqa: E402
from hpcdist.env import DistEnv  # noqa: E402
from hpcdist.models.args import num_params  # noqa: E402
from hpcdist.planning.memory import estimate_memory  # noqa: E402
from hpcdist.trainer import Trainer  # noqa: E402
from tests.dist.harness import run_ranks  # noqa: E402
from tools.bench.overhead import table  # noqa: E402

MB = 1e6


def _worker(env: DistEnv, cfg: JobConfig, warmup: int, steps: int) -> dict[str, Any]:
    trainer = Trainer(cfg, env)
    s = trainer.strategy
    s.forward_backward(trainer.loader.next_batch())
    s.optimizer_step()
    s.forward_backward(trainer.loader.next_batch())
    measured = s.model_state_bytes()
    s.optimizer_step()
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        s.forward_backward(trainer.loader.next_batch())
        s.optimizer_step()
        if dist.is_initialized():
            dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return {"bytes": measured, "step_s": statistics.median(times)}


def _config(args: argparse.Namespace, name: str, run_dir: Path) -> JobConfig:
    over = [
        "model.preset=tiny",
        f"model.dim={args.dim}",
        f"model.n_layers={args.layers}",
        f"model.n_heads={args.heads}",
        f"model.n_kv_heads={args.heads}",
        f"model.ffn_dim={4 * args.dim}",
        f"data.seq_len={args.seq_len}",
        "data.source=synthetic",
        "train.dtype=bf16",
        f"train.global_batch_size={args.global_batch}",
        f"train.micro_batch_size={args.micro_batch}",
        f"train.steps={args.warmup + args.steps + 2}",
        "logging.tensorboard=false",
        "logging.every_steps=1000",
        "checkpoint.every_steps=0",
        "checkpoint.save_final=false",
        f"run.dir={run_dir}",
        *STRATEGIES[name],
    ]
    return config_mod.load(None, over)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            for name in args.strategies:
                cfg = _config(args, name, Path(tmp) / f"{name}-{world}")
                out = run_ranks(world, _worker, cfg, args.warmup, args.steps, timeout=1800)
                worst = max(out, key=lambda r: sum(r["bytes"].values()))
                est = estimate_memory(
                    cfg.model_args(),
                    strategy=name,
                    world_size=world,
                    gpus_per_node=world,
                    micro_batch_size=args.micro_batch,
                    seq_len=args.seq_len,
                    activation_checkpointing=False,
                )
                rows.append(
                    {
                        "world": world,
                        "strategy": name,
                        **{f"measured_{k}": v for k, v in worst["bytes"].items()},
                        "measured": sum(worst["bytes"].values()),
                        "ideal": est.model_states_ideal,
                        "peak": est.model_states,
                        "deepspeed": est.model_states_deepspeed,
                        "step_s": out[0]["step_s"],
                    }
                )
                print(f"  {name} on {world} ranks: {rows[-1]['measured'] / MB:.1f} MB, {out[0]['step_s']:.3f} s/step")

    params = num_params(_config(args, "ddp", Path("/")).model_args())
    header = [
        "strategy",
        "ranks",
        "params MB",
        "grads MB",
        "optim MB",
        "measured MB",
        "ideal MB",
        "ideal/meas",
        "peak MB",
        "DeepSpeed MB",
        "vs ddp",
        "step s",
        "step vs ddp",
    ]
    lines = [header]
    for r in rows:
        same_world = [x for x in rows if x["world"] == r["world"] and x["strategy"] == "ddp"]
        ddp = same_world[0] if same_world else r  # without a ddp row, ratios are against the row itself
        ds = "-" if r["deepspeed"] is None else f"{r['deepspeed'] / MB:.1f}"
        lines.append(
            [
                r["strategy"],
                str(r["world"]),
                f"{r['measured_params'] / MB:.1f}",
                f"{r['measured_grads'] / MB:.1f}",
                f"{r['measured_optimizer'] / MB:.1f}",
                f"{r['measured'] / MB:.1f}",
                f"{r['ideal'] / MB:.1f}",
                f"{r['ideal'] / r['measured']:.3f}",
                f"{r['peak'] / MB:.1f}",
                ds,
                f"{r['measured'] / ddp['measured']:.3f}",
                f"{r['step_s']:.3f}",
                f"{r['step_s'] / ddp['step_s']:.2f}",
            ]
        )
    print(
        f"\nmodel: {params / 1e6:.1f}M params ({4 * params / MB:.0f} MB fp32), bf16 mixed precision, "
        f"seq {args.seq_len}, global batch {args.global_batch}, micro-batch {args.micro_batch}"
    )
    print(table(lines))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"params": params, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
