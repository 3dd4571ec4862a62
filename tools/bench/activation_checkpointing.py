#!/usr/bin/env python3
"""Step time and peak activation memory of train.activation_checkpointing none / full / selective, side by side,
against the planner's predictions (hpcdist.planning.memory), in one run.

    python tools/bench/activation_checkpointing.py                      # 125m, seq 1024, fp32 CPU: ~5 min on 2 cores
    python tools/bench/activation_checkpointing.py --preset tiny --seq-len 256 --steps 2

Method. One process, one model (the preset, real init), wrapped per mode exactly as the trainer wraps it
(hpcdist.parallel.parallelize.apply_activation_checkpointing). Gradients are allocated by a warm-up step and kept
(zeroed, not freed), so what a step adds on top is activations and backward's transients. Memory: glibc's live heap
bytes (mallinfo2: arena + mmapped blocks; torch's CPU allocator is malloc), sampled by a thread every 0.5 ms during
forward + backward; ``saved`` is the value right after forward (what backward will read), ``peak`` the highest
sample minus the value before the step. Time: the median of the timed forward + backward passes (no optimizer: it
is the same in every mode). Planner: ``saved_activation_bytes`` and ``activation_bytes`` (its peak: + one layer
recomputed) at the compute dtype's size, and a step time relative to none of (3 + recompute) / 3 forward passes
(``recompute_flops_fraction``). On a GPU the same comparison would use torch.cuda.max_memory_allocated.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MODES = ("none", "full", "selective")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="125m")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=2, help="timed steps per mode (after one warm-up)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--json", type=Path, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    import ctypes
    import gc
    import statistics
    import threading
    import time

    import torch

    from hpcdist.models.args import ModelArgs, load_preset
    from hpcdist.models.llama import build_model
    from hpcdist.parallel.base import cross_entropy
    from hpcdist.parallel.parallelize import apply_activation_checkpointing
    from hpcdist.planning.memory import activation_bytes, recompute_flops_fraction, saved_activation_bytes

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (n, ctypes.c_size_t)
            for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
        ] + [("keepcost", ctypes.c_size_t)]

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
    except (OSError, AttributeError):
        print("needs glibc >= 2.33 (mallinfo2) to read live heap bytes", file=sys.stderr)
        return 2

    def heap() -> int:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd

    torch.manual_seed(0)
    args = ModelArgs(**load_preset(a.preset))
    if a.seq_len > args.max_seq_len:
        print(f"--seq-len {a.seq_len} exceeds the preset's max_seq_len {args.max_seq_len}", file=sys.stderr)
        return 2
    model = build_model(args, "cpu")
    blocks = dict(model.layers.named_children())
    tokens = torch.randint(0, args.vocab_size, (a.micro_batch, a.seq_len + 1))
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    rows = []
    for mode in a.modes:
        for name, block in blocks.items():  # one model, re-wrapped per mode
            model.layers.register_module(name, block)
        apply_activation_checkpointing(model, mode)
        cross_entropy(model(inputs), targets).backward()  # warm-up; allocates the gradients
        model.zero_grad(set_to_none=False)
        times, saved, peaks = [], [], []
        for _ in range(a.steps):
            gc.collect()
            base = heap()
            top = [base]
            done = threading.Event()

            def poll(top: list[int] = top, done: threading.Event = done) -> None:
                while not done.is_set():
                    top[0] = max(top[0], heap())
                    time.sleep(0.0005)

            t = threading.Thread(target=poll, daemon=True)
            t.start()
            start = time.perf_counter()
            loss = cross_entropy(model(inputs), targets)
            saved.append(heap() - base)
            loss.backward()
            times.append(time.perf_counter() - start)
            done.set()
            t.join()
            peaks.append(max(top[0], heap()) - base)
            del loss
            model.zero_grad(set_to_none=False)
        kw = {"micro_batch_size": a.micro_batch, "seq_len": a.seq_len, "activation_checkpointing": mode}
        rows.append(
            {
                "mode": mode,
                "step_s": statistics.median(times),
                "saved_bytes": max(saved),
                "peak_bytes": max(peaks),
                "planned_saved_bytes": saved_activation_bytes(args, element_bytes=4, **kw),
                "planned_peak_bytes": activation_bytes(args, element_bytes=4, **kw),
                "planned_time_ratio": (3 + recompute_flops_fraction(args, mode, a.seq_len)) / 3,
            }
        )
        print(f"{mode}: {rows[-1]}", file=sys.stderr, flush=True)
    ref = next((r for r in rows if r["mode"] == "none"), rows[0])
    mib = 2**20
    print(f"{a.preset}, seq {a.seq_len} x micro batch {a.micro_batch}, fp32 CPU, {torch.get_num_threads()} threads")
    head = ("mode", "step s", "x none", "plan x", "saved MiB", "plan MiB", "peak MiB", "plan MiB")
    print("  ".join(f"{h:>10}" for h in head))
    for r in rows:
        cells = (
            r["mode"],
            f"{r['step_s']:.2f}",
            f"{r['step_s'] / ref['step_s']:.2f}",
            f"{r['planned_time_ratio']:.2f}",
            f"{r['saved_bytes'] / mib:.0f}",
            f"{r['planned_saved_bytes'] / mib:.0f}",
            f"{r['peak_bytes'] / mib:.0f}",
            f"{r['planned_peak_bytes'] / mib:.0f}",
        )
        print("  ".join(f"{c:>10}" for c in cells))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"preset": a.preset, "seq_len": a.seq_len, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
