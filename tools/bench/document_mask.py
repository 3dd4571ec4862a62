#!/usr/bin/env python3
"""Step time and peak memory of data.document_mask on vs off at the same shape, and the attention mechanisms it could
use (SDPA causal, SDPA with the block-causal mask, flex_attention with a BlockMask, eager and compiled).

    python tools/bench/document_mask.py                  # tiny, seq 1024, micro-batch 2: ~1 min on 2 idle cores
    python tools/bench/document_mask.py --preset 125m --seq-len 512 --micro-batch 1 --skip-attention
    python tools/bench/document_mask.py --flex-compile --json runs/bench/mask.json

Method. One process, one model (the preset, real init: hpcdist.models.build_model), bf16 autocast on CUDA, fp32 on
CPU. Tokens: random ids with an EOS every ``--doc-len`` tokens on average (exponential lengths), the same batch for
both modes. A step is forward + cross entropy + backward (no optimizer: the same either way); modes alternate
(off, on, off, on, ...) after one warm-up each, and the median is reported. Memory: CUDA ``max_memory_allocated``
minus the parameters'; on CPU glibc's live heap (mallinfo2) sampled every 0.5 ms during the step, minus its value
before (as tools/bench/activation_checkpointing.py). ``planned mask`` is hpcdist.planning.memory.document_mask_bytes.

The attention part times one layer's attention alone (B, H, S, Hd at the model's shape, forward + backward): SDPA
causal (what the mask replaces), SDPA with the additive block-causal mask (what hpcdist uses), flex_attention with
a document BlockMask eagerly, and compiled (``--flex-compile``; on CPU inductor needs a C++ compiler, and the first
call compiles for a while, excluded from the timing).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--doc-len", type=int, default=200, help="mean document length in tokens")
    p.add_argument("--steps", type=int, default=3, help="timed steps per mode (after one warm-up)")
    p.add_argument("--flex-compile", action="store_true", help="also time torch.compile(flex_attention)")
    p.add_argument("--skip-attention", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    import ctypes
    import dataclasses
    import gc
    import statistics
    import threading
    import time

    import torch
    import torch.nn.functional as F

    from hpcdist.models.args import ModelArgs, load_preset
    from hpcdist.models.llama import block_causal_mask, build_model, document_ids
    from hpcdist.parallel.base import cross_entropy
    from hpcdist.planning.memory import document_mask_bytes

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    eos = 0
    args = ModelArgs(**load_preset(a.preset))
    args = dataclasses.replace(args, max_seq_len=max(args.max_seq_len, a.seq_len))
    torch.manual_seed(0)
    model = build_model(args, device)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, args.vocab_size, (a.micro_batch, a.seq_len + 1), generator=g)
    lengths = torch.empty(a.seq_len).exponential_(1 / a.doc_len, generator=g).long().clamp(min=1)
    for row in tokens:
        at = torch.cumsum(lengths, 0)
        row[at[at < a.seq_len + 1]] = eos
    tokens = tokens.to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    n_docs = float((inputs == eos).sum(1).float().mean() + 1)

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (n, ctypes.c_size_t)
            for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
        ] + [("keepcost", ctypes.c_size_t)]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2

    def heap() -> int:
        m = libc.mallinfo2()
        return int(m.uordblks + m.hblkhd)

    def measure(fn) -> tuple[float, int]:
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            return time.perf_counter() - t0, torch.cuda.max_memory_allocated() - base
        base, peak, stop = heap(), [0], threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], heap())
                time.sleep(0.0005)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        stop.set()
        th.join()
        return dt, max(peak[0], heap()) - base

    def step(mask_on: bool) -> None:
        model.document_eos = eos if mask_on else None
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = cross_entropy(model(inputs), targets)
        loss.backward()
        model.zero_grad(set_to_none=False)  # gradients stay allocated: a step adds activations only

    step(False)  # allocate the gradients
    results: dict[str, dict[str, list[float]]] = {m: {"s": [], "bytes": []} for m in ("off", "on")}
    for m in ("off", "on"):
        measure(lambda m=m: step(m == "on"))  # warm-up
    for _ in range(a.steps):
        for m in ("off", "on"):
            dt, nbytes = measure(lambda m=m: step(m == "on"))
            results[m]["s"].append(dt)
            results[m]["bytes"].append(nbytes)
    planned = document_mask_bytes(micro_batch_size=a.micro_batch, seq_len=a.seq_len, element_bytes=2 if cuda else 4)
    where = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} thread(s)"
    print(
        f"{a.preset} ({args.n_layers} layers, dim {args.dim}), micro-batch {a.micro_batch} x seq {a.seq_len}, "
        f"{n_docs:.1f} documents per row, {where}, median of {a.steps}"
    )
    print(f"{'mask':>6}  {'step s':>8}  {'peak MiB':>9}")
    out: dict = {"preset": a.preset, "seq_len": a.seq_len, "micro_batch": a.micro_batch, "device": where}
    for m, r in results.items():
        s, b = statistics.median(r["s"]), statistics.median(r["bytes"])
        out[m] = {"step_s": s, "peak_bytes": b}
        print(f"{m:>6}  {s:8.3f}  {b / 2**20:9.1f}")
    ratio = out["on"]["step_s"] / out["off"]["step_s"]
    extra = (out["on"]["peak_bytes"] - out["off"]["peak_bytes"]) / 2**20
    print(f"on/off step time {ratio:.2f}x; peak +{extra:.1f} MiB (planned mask {planned / 2**20:.1f} MiB)")
    out.update(ratio=ratio, planned_mask_bytes=planned)

    if not a.skip_attention:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        h, hd = args.n_heads, args.head_dim
        dtype = torch.bfloat16 if cuda else torch.float32
        q, k, v = (
            torch.randn(a.micro_batch, h, a.seq_len, hd, device=device, dtype=dtype, requires_grad=True)
            for _ in range(3)
        )
        docs = document_ids(inputs, eos)
        bias = block_causal_mask(docs, dtype)

        def doc_causal(b, _h, qi, ki):  # flex's mask_mod: same document, not in the future
            return (docs[b, qi] == docs[b, ki]) & (ki <= qi)

        block = create_block_mask(doc_causal, a.micro_batch, None, a.seq_len, a.seq_len, device=device.type)
        kinds = {
            "sdpa causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "sdpa + mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias),
            "flex eager": lambda: flex_attention(q, k, v, block_mask=block),
        }
        if a.flex_compile:
            compiled = torch.compile(flex_attention)
            kinds["flex compiled"] = lambda: compiled(q, k, v, block_mask=block)
        print(f"attention alone (B {a.micro_batch}, H {h}, S {a.seq_len}, Hd {hd}, {dtype}), forward + backward:")
        print(f"  block mask sparsity {block.sparsity():.0f}% of blocks skipped by flex")
        att: dict[str, dict[str, float]] = {}
        for name, fn in kinds.items():
            try:
                fn().sum().backward()  # warm-up (compile)
                times, peaks = [], []
                for _ in range(a.steps):
                    dt, nbytes = measure(lambda fn=fn: fn().sum().backward())
                    times.append(dt)
                    peaks.append(nbytes)
                att[name] = {"s": statistics.median(times), "peak_bytes": statistics.median(peaks)}
                print(f"  {name:>14}: {att[name]['s'] * 1e3:9.1f} ms  peak {att[name]['peak_bytes'] / 2**20:8.1f} MiB")
            except Exception as e:  # a mechanism that cannot run here is a result too
                att[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
                print(f"  {name:>14}: cannot run: {att[name]['error']}")
        out["attention"] = att
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
