"""MFU of the 125m / 350m / 1.3b presets on one GPU at sequence length 2048, against the device's bf16 peak.

Each preset trains ``--steps`` steps (bf16 autocast, synthetic tokens, one process, DDP path at world 1) with its
micro-batch from ``--micro`` (default 125m:8, 350m:4, 1.3b:2); the first ``--warmup`` steps (CUDA context, allocator,
cuDNN/cuBLAS heuristics) are not counted. MFU = tokens/s x ``flops_per_token`` (6N + attention, the trainer's own
count) / the bf16 dense peak of the device (``hpcdist.metrics.throughput.peak_flops``: the table for A100/H100/..., or
``--peak``). The memory column is the true peak allocated over the timed run (read after each step, before the
trainer's logging resets it). Prints a table and writes ``--json`` (default runs/bench/gpu.json). Exits 2 without
a CUDA device.

    python tools/bench/gpu.py
    python tools/bench/gpu.py --presets 125m --steps 30 --micro 125m:16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="125m,350m,1.3b")
    p.add_argument("--micro", nargs="*", default=[], help="preset:micro_batch overrides, e.g. 1.3b:4")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--ac", action="store_true", help="activation checkpointing (bigger micro-batches fit)")
    p.add_argument("--compile", action="store_true", help="torch.compile each transformer block (train.compile)")
    p.add_argument("--peak", type=float, default=None, help="bf16 peak FLOP/s (default: hpcdist's table)")
    p.add_argument("--json", type=Path, default=Path("runs/bench/gpu.json"))
    return p


if __name__ == "__main__":
    # --help and a bad flag answer here, before torch (and hpcdist's trainer) is imported: seconds on a
    # busy node. main() parses again; that costs nothing.
    build_parser().parse_args()


import torch  # noqa: E402

from hpcdist import config as config_mod  # noqa: E402
from hpcdist.env import from_environ  # noqa: E402
from hpcdist.metrics.throughput import peak_flops  # noqa: E402
from hpcdist.models import flops_per_token  # noqa: E402

MICRO = {"125m": 8, "350m": 4, "1.3b": 2}


def timed_run(train: Callable[[], Any], strategy: Any, warmup: int) -> tuple[float, int]:
    """Run ``train`` with ``strategy.optimizer_step`` timed: (median step seconds after ``warmup`` steps, peak
    bytes allocated on the current CUDA device over every step).

    The peak is read right after each optimizer step, before the trainer's logging reads and resets it
    (hpcdist.metrics.throughput.memory_stats): read once after ``train`` it would be only what stays resident
    after the last logged step (weights, optimizer state), not what the steps needed."""
    stamps: list[float] = []
    peak = 0
    step = strategy.optimizer_step

    def timed(**kw: bool) -> Any:
        nonlocal peak
        out = step(**kw)
        torch.cuda.synchronize()
        stamps.append(time.perf_counter())
        peak = max(peak, torch.cuda.max_memory_allocated())
        return out

    strategy.optimizer_step = timed
    torch.cuda.reset_peak_memory_stats()
    train()
    step_s = statistics.median(b - a for a, b in zip(stamps[warmup - 1 : -1], stamps[warmup:], strict=True))
    return step_s, max(peak, torch.cuda.max_memory_allocated())


def bench(preset: str, micro: int, a: argparse.Namespace, peak: float) -> dict[str, Any]:
    from hpcdist.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = config_mod.load(
            None,
            [
                f"model.preset={preset}",
                "data.source=synthetic",
                f"data.seq_len={a.seq_len}",
                f"data.synthetic_samples={max(64, micro * (a.steps + a.warmup))}",
                "data.val_fraction=0",
                f"train.steps={a.steps + a.warmup}",
                f"train.global_batch_size={micro}",
                f"train.micro_batch_size={micro}",
                "train.dtype=bf16",
                f"train.activation_checkpointing={str(a.ac).lower()}",
                f"train.compile={str(a.compile).lower()}",
                f"run.dir={tmp}",
                "checkpoint.every_steps=0",
                "checkpoint.save_final=false",
                "train.eval_every_steps=0",
                f"logging.every_steps={a.steps + a.warmup}",
                "logging.tensorboard=false",
                f"logging.peak_flops={peak}",
                "logging.straggler_every_steps=0",
            ],
        )
        trainer = Trainer(cfg, from_environ({}, cuda_available=True))
        step_s, peak_bytes = timed_run(trainer.train, trainer.strategy, a.warmup)
        tokens_per_s = micro * a.seq_len / step_s
        fpt = flops_per_token(cfg.model_args(), a.seq_len)
        return {
            "preset": preset,
            "micro_batch": micro,
            "seq_len": a.seq_len,
            "step_s": step_s,
            "tokens_per_s": tokens_per_s,
            "mfu": tokens_per_s * fpt / peak,
            "peak_alloc_gib": peak_bytes / 2**30,
        }


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("tools/bench/gpu.py needs a CUDA device: torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    micro = MICRO | {k: int(v) for k, v in (m.split(":") for m in a.micro)}
    peak = a.peak or peak_flops(torch.device("cuda"))
    name = torch.cuda.get_device_name(0)
    print(f"{name}: bf16 peak {peak / 1e12:.0f} TFLOP/s, seq {a.seq_len}, {a.steps} timed steps", flush=True)
    rows = [bench(preset, micro[preset], a, peak) for preset in a.presets.split(",")]
    head = ["preset", "micro", "tokens/s", "step s", "MFU", "peak alloc GiB"]
    body = [
        [
            r["preset"],
            str(r["micro_batch"]),
            f"{r['tokens_per_s']:,.0f}",
            f"{r['step_s']:.3f}",
            f"{100 * r['mfu']:.1f}%",
            f"{r['peak_alloc_gib']:.1f}",
        ]
        for r in rows
    ]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    print("\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *body]))
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"device": name, "peak_flops": peak, "rows": rows}, indent=1))
    print(f"json: {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
