"""Data benchmark: ``hpcdist prepare`` throughput against the tokenizers library, and the loader's data wait.

Both parts measure against a baseline run in the same invocation (the machine is shared and noisy):

1. **prepare** -- a jsonl corpus (this interpreter's standard library sources as documents, repeated to ``--mb``
   MB) and a byte-level BPE of ``--vocab`` tokens trained on it by ``hpcdist.data.train_bpe``. Baseline: the
   ``tokenizers`` library's own ``encode_batch_fast`` over all documents, already in memory, on all cores (its Rust
   thread pool). hpcdist: ``prepare_corpus`` end to end -- read and parse the jsonl, tokenize in ``--workers``
   forked processes, add EOS, write the shards and meta.json -- with 1 worker and with ``--workers``. Each side
   runs ``--repeats`` times, alternating; the best run of each counts. Goal: hpcdist tokens/s >= 0.8 x the
   library's.

2. **loader** -- one process trains a small Llama (``--dim``, ``--layers``) at ``--seq-len`` 2048 and
   ``--batch`` samples per step on the corpus prepared byte-level (the model's compute stays small next to reading
   its batch), with ``data.prefetch=0`` (each batch built in the training
   thread: the baseline) and ``data.prefetch=2`` (built in a background thread), alternating ``--repeats`` times.
   The shards are dropped from the page cache (``posix_fadvise(DONTNEED)``, these files only) before each run, so
   batches come from disk as they do from a corpus larger than memory; samples are random windows. Per step: the
   wall time from one batch fetch to the next, and the time the loop waited inside ``next_batch``. Reported: the
   median step time and the data-wait share (waited / step time, summed over the timed steps), before and after.
   Two scenarios: this machine's local disk as it is, and a shared filesystem simulated by ``--read-latency-ms``
   (default 2 ms) of sleep before every sample read (``SlowReads``), the case prefetching exists for.

3. **array** -- the cluster prepare (``hpcdist prepare --cluster P --tasks N``) without the scheduler: the
   same corpus (jsonl, byte tokenizer) planned into 2 and 4 slices, each part prepared by its own process (one
   worker: what one array task on one core does) all at once, then merged; against the one-machine prepare (one
   worker) of the same corpus in the same invocation. Reported: wall time, tokens/s per task, the merge time, and
   the predicted wall time of ``--predict-tb`` TB of text on ``--predict-nodes`` nodes x ``--predict-cores`` cores
   from the measured per-core rate (linear: the tasks share nothing but the filesystem; SLURM's start-up latency
   and the filesystem's bandwidth are not in it). On 2 cores expect no speed-up from 4 tasks.

Run from the repository root::

    python tools/bench/data.py                     # ~2-3 min on an idle 2-core machine
    python tools/bench/data.py --mb 8 --repeats 1  # quicker
    python tools/bench/data.py --skip-loader

It prints one table per part and writes every number to ``--json`` (default ``runs/bench/data.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mb", type=float, default=24.0, help="corpus size in MB of text (default 24)")
    p.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary (default 8192)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="prepare workers (default: cores)")
    p.add_argument("--repeats", type=int, default=2, help="runs per side, alternating (default 2)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16, help="samples per step (default 16)")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--steps", type=int, default=12, help="timed steps per loader run (default 12)")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps per loader run (default 2)")
    p.add_argument(
        "--read-latency-ms",
        type=float,
        default=2.0,
        help="simulated shared-filesystem latency per sample read, second loader scenario (default 2)",
    )
    p.add_argument("--array-mb", type=float, default=8.0, help="array part: corpus MB (default 8)")
    p.add_argument("--predict-tb", type=float, default=1.0)
    p.add_argument("--predict-nodes", type=int, default=32)
    p.add_argument("--predict-cores", type=int, default=64)
    p.add_argument("--array-bpe", action="store_true", help="array part: a byte-level BPE of --vocab, not bytes")
    p.add_argument("--skip-array", action="store_true")
    p.add_argument("--skip-prepare", action="store_true")
    p.add_argument("--skip-loader", action="store_true")
    p.add_argument("--json", type=Path, default=Path("runs/bench/data.json"))
    return p


if __name__ == "__main__":
    # --help and a bad flag answer here, before torch (and hpcdist's trainer) is imported: seconds on a
    # busy node. main() parses again; that costs nothing.
    build_parser().parse_args()


import torch  # noqa: E402
from pagecache import drop_page_cache  # tools/bench/pagecache.py (the script's directory)  # noqa: E402

from hpcdist import config as config_mod  # noqa: E402
from hpcdist.data import load_tokenizer, prepare_corpus, stdlib_corpus, train_bpe  # noqa: E402
from hpcdist.env import from_environ  # noqa: E402
from hpcdist.trainer import Trainer  # noqa: E402


def write_corpus(path: Path, megabytes: float) -> tuple[list[str], int]:
    """The stdlib sources as jsonl documents, repeated until the file holds `megabytes` MB of text."""
    docs: list[str] = []
    size = 0
    sources = [p.read_text(encoding="utf-8", errors="replace") for p in stdlib_corpus()]
    with open(path, "w", encoding="utf-8") as fh:
        while size < megabytes * 1e6:
            for text in sources:
                fh.write(json.dumps({"text": text}) + "\n")
                docs.append(text)
                size += len(text.encode("utf-8"))
                if size >= megabytes * 1e6:
                    break
    return docs, size


def bench_prepare(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    corpus = root / "corpus.jsonl"
    docs, nbytes = write_corpus(corpus, args.mb)
    sample = root / "sample.jsonl"
    with open(sample, "w", encoding="utf-8") as fh:  # train on the first few MB: the benchmark is the encoding
        for text in docs[: max(1, len(docs) // 6)]:
            fh.write(json.dumps({"text": text}) + "\n")
    t0 = time.perf_counter()
    tok = train_bpe([sample], vocab_size=args.vocab, out_dir=root / "tok")
    train_s = time.perf_counter() - t0
    core = tok._tok  # the library's own Tokenizer object: the baseline calls it directly
    runs: dict[str, list[dict[str, float]]] = {"library": [], "hpcdist-1": [], f"hpcdist-{args.workers}": []}
    out_dir = root / "ds"
    for r in range(args.repeats):
        for name in list(runs) if r % 2 == 0 else list(reversed(runs)):
            if name == "library":
                t0 = time.perf_counter()
                tokens = sum(len(e.ids) + 1 for e in core.encode_batch_fast(docs, add_special_tokens=False))
                seconds = time.perf_counter() - t0
            else:
                workers = int(name.split("-")[1])
                target = root / f"ds-{workers}"
                res = prepare_corpus([corpus], target, tokenizer=load_tokenizer(root / "tok"), workers=workers)
                tokens, seconds = res.num_tokens, res.seconds
                for f in target.iterdir():  # a fresh prepare each time (else it is up to date at once)
                    if f.is_file():
                        f.unlink()
                out_dir = target
            runs[name].append(
                {"seconds": seconds, "tokens": tokens, "mb_s": nbytes / 1e6 / seconds, "tokens_s": tokens / seconds}
            )
    best = {name: max(v, key=lambda x: x["tokens_s"]) for name, v in runs.items()}
    base = best["library"]["tokens_s"]
    print(
        f"\n## prepare: {nbytes / 1e6:.1f} MB of jsonl, {len(docs)} documents, BPE vocab {args.vocab} "
        f"(trained in {train_s:.1f} s); best of {args.repeats}, {os.cpu_count()} cores"
    )
    print(f"{'':32} {'seconds':>8} {'MB/s':>8} {'tokens/s':>12} {'vs library':>11}")
    for name, b in best.items():
        workers = name.split("-")[-1]
        label = "tokenizers encode_batch_fast" if name == "library" else f"hpcdist prepare, {workers} worker(s)"
        print(f"{label:32} {b['seconds']:8.2f} {b['mb_s']:8.2f} {b['tokens_s']:12,.0f} {b['tokens_s'] / base:10.2f}x")
    assert len({b["tokens"] for b in best.values()}) == 1, "prepare and the library counted different tokens"
    del out_dir
    return {"mb": nbytes / 1e6, "documents": len(docs), "vocab": args.vocab, "runs": runs, "best": best}


def _part(out: Path, i: int) -> None:
    from hpcdist.data.array import prepare_part

    prepare_part(out, i, workers=1)
    os._exit(0)  # the forked copy of this process: no interpreter teardown


def bench_array(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One-machine prepare (1 worker) vs the array's parts (2 and 4 tasks, one process each, all at once) + merge."""
    import multiprocessing

    from hpcdist.data.array import merge_parts, plan_prepare, write_plan

    corpus = root / "array-corpus.jsonl"
    _, nbytes = write_corpus(corpus, args.array_mb)
    spec = "byte"
    if args.array_bpe:
        train_bpe([corpus], vocab_size=args.vocab, out_dir=root / "array-tok")
        spec = str(root / "array-tok")
    rows: dict[str, dict[str, float]] = {}
    res = prepare_corpus([corpus], root / "array-one", tokenizer=load_tokenizer(spec), workers=1)
    rows["one machine, 1 worker"] = {"tasks": 1, "seconds": res.seconds, "tokens": res.num_tokens, "merge_s": 0.0}
    one = (root / "array-one" / "meta.json").read_text()
    for n in (2, 4):
        out = root / f"array-{n}"
        t0 = time.perf_counter()
        write_plan(out, plan_prepare([corpus], out, tokenizer=spec, tasks=n))
        plan_s = time.perf_counter() - t0
        procs = [multiprocessing.get_context("fork").Process(target=_part, args=(out, i)) for i in range(n)]
        t1 = time.perf_counter()
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
            assert proc.exitcode == 0, f"part failed: {proc.exitcode}"
        parts_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        meta = merge_parts(out)
        merge_s = time.perf_counter() - t2
        assert meta.num_tokens == res.num_tokens and json.loads(one)["fingerprint"] == meta.fingerprint
        rows[f"array, {n} tasks"] = {
            "tasks": n,
            "seconds": plan_s + parts_s + merge_s,
            "tokens": meta.num_tokens,
            "plan_s": plan_s,
            "parts_s": parts_s,
            "merge_s": merge_s,
        }
    per_core = nbytes / rows["one machine, 1 worker"]["seconds"]  # bytes/s of one worker on one core
    cores = args.predict_nodes * args.predict_cores
    predict_s = args.predict_tb * 1e12 / (per_core * cores)
    kind = f"BPE {args.vocab}" if args.array_bpe else "byte tokenizer"
    print(f"\n## array prepare: {nbytes / 1e6:.1f} MB of jsonl, {kind}, {os.cpu_count()} cores")
    print(f"{'':24} {'wall s':>8} {'tokens/s':>12} {'tokens/s/task':>14} {'merge s':>8}")
    for name, r in rows.items():
        tps = r["tokens"] / r["seconds"]
        print(f"{name:24} {r['seconds']:8.2f} {tps:12,.0f} {tps / r['tasks']:14,.0f} {r['merge_s']:8.3f}")
    print(
        f"per-core rate {per_core / 1e6:.2f} MB/s: {args.predict_tb:g} TB on {args.predict_nodes} nodes x "
        f"{args.predict_cores} cores ({cores} workers) ~ {predict_s / 3600:.2f} h (linear; no scheduler or filesystem "
        "limit in it)"
    )
    return {"mb": nbytes / 1e6, "rows": rows, "per_core_mb_s": per_core / 1e6, "predict_hours": predict_s / 3600}


class SlowReads:
    """A dataset whose every sample read first waits `latency_s`: a shared filesystem (Lustre, NFS, GPFS) serving
    random reads of a corpus much larger than the page cache, where one small read costs ~1-5 ms, not the ~30 us of
    this machine's local disk. The wait is a sleep, so it occupies no core: it stands for I/O, not for CPU work."""

    def __init__(self, dataset: Any, latency_s: float) -> None:
        self.dataset, self.latency_s = dataset, latency_s

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        time.sleep(self.latency_s)
        return self.dataset[i]


def _loader_run(
    args: argparse.Namespace, dataset: Path, run_dir: Path, prefetch: int, latency_ms: float
) -> dict[str, Any]:
    over = [
        "model.preset=tiny",
        f"model.dim={args.dim}",
        f"model.n_layers={args.layers}",
        "model.n_heads=2",
        f"model.ffn_dim={4 * args.dim}",
        f"model.max_seq_len={args.seq_len}",
        "model.vocab_size=auto",
        "data.source=files",
        f"data.path={dataset}",
        f"data.seq_len={args.seq_len}",
        "data.val_fraction=0",
        f"data.prefetch={prefetch}",
        f"train.steps={args.warmup + args.steps}",
        f"train.global_batch_size={args.batch}",
        f"train.micro_batch_size={args.batch}",
        "optim.warmup_steps=0",
        "logging.every_steps=1000000",
        "logging.tensorboard=false",
        "logging.peak_flops=6.3e10",
        "checkpoint.every_steps=0",
        "checkpoint.save_final=false",
        "checkpoint.resume=none",
        f"run.dir={run_dir}",
        "run.log_level=WARNING",
    ]
    cfg = config_mod.load(None, over)
    drop_page_cache(dataset.glob("shard-*.bin"))
    trainer = Trainer(cfg, from_environ())
    batches = getattr(trainer.loader, "loader", trainer.loader)  # the BatchLoader, inside a PrefetchLoader or not
    if latency_ms:
        batches.dataset = SlowReads(batches.dataset, latency_ms / 1000)  # before the first batch: none is built yet
    fetch = trainer.loader.next_batch
    marks: list[tuple[float, float]] = []

    def timed() -> torch.Tensor:
        t0 = time.perf_counter()
        batch = fetch()
        marks.append((t0, time.perf_counter()))
        return batch

    trainer.loader.next_batch = timed  # type: ignore[method-assign]
    result = trainer.train()
    end = time.perf_counter()
    starts = [m[0] for m in marks] + [end]
    steps = [starts[i + 1] - starts[i] for i in range(len(marks))][args.warmup :]
    waits = [m[1] - m[0] for m in marks][args.warmup :]
    return {
        "median_step_s": statistics.median(steps),
        "data_wait_share": sum(waits) / sum(steps),
        "median_wait_s": statistics.median(waits),
        "final_loss": result.losses[max(result.losses)],
    }


def bench_loader(args: argparse.Namespace, root: Path, dataset: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    scenarios = {"local disk": 0.0, f"shared FS ({args.read_latency_ms:g} ms/read)": args.read_latency_ms}
    out: dict[str, Any] = {}
    print(
        f"\n## loader: seq {args.seq_len} x batch {args.batch}, dim {args.dim} x {args.layers} layers, "
        f"shards evicted from the page cache before each run; median of {args.repeats} runs x {args.steps} steps"
    )
    print(f"{'':44} {'step s':>8} {'wait s':>8} {'data-wait share':>16} {'step vs prefetch=0':>19}")
    for scenario, latency in scenarios.items():
        runs: dict[str, list[dict[str, Any]]] = {"prefetch=0": [], "prefetch=2": []}
        for r in range(args.repeats):
            for name in list(runs) if r % 2 == 0 else list(reversed(runs)):
                prefetch = int(name.split("=")[1])
                runs[name].append(_loader_run(args, dataset, root / f"run-{latency}-{name}-{r}", prefetch, latency))
        summary = {
            name: {
                "median_step_s": statistics.median(x["median_step_s"] for x in v),
                "data_wait_share": statistics.median(x["data_wait_share"] for x in v),
                "median_wait_s": statistics.median(x["median_wait_s"] for x in v),
            }
            for name, v in runs.items()
        }
        base = summary["prefetch=0"]["median_step_s"]
        for name, s in summary.items():
            label = f"{scenario}, {name}"
            print(
                f"{label:44} {s['median_step_s']:8.3f} {s['median_wait_s']:8.4f} "
                f"{s['data_wait_share'] * 100:15.1f}% {s['median_step_s'] / base:18.2f}x"
            )
        out[scenario] = {"runs": runs, "summary": summary}
    losses = {x["final_loss"] for sc in out.values() for v in sc["runs"].values() for x in v}
    print(f"final losses bitwise equal across all runs: {len(losses) == 1}")
    out["losses_equal"] = len(losses) == 1
    return out


def main() -> int:
    args = build_parser().parse_args()
    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cores": os.cpu_count(),
        "stdlib": sysconfig.get_paths()["stdlib"],
        "args": {**vars(args), "json": str(args.json)},
    }
    with tempfile.TemporaryDirectory(prefix="hpcdist-bench-data-") as tmp:
        root = Path(tmp)
        if not args.skip_array:
            out["array"] = bench_array(args, root)
        if not args.skip_prepare:
            out["prepare"] = bench_prepare(args, root)
        if not args.skip_loader:
            dataset = root / "loader-ds"
            if not (root / "corpus.jsonl").is_file():
                write_corpus(root / "corpus.jsonl", args.mb)
            # byte-level: ~4x the tokens of the BPE for the same text, and a 320-row output layer, so the model's
            # compute stays small next to reading the batch (this part measures the loader, not the tokenizer)
            prepare_corpus([root / "corpus.jsonl"], dataset, tokenizer=load_tokenizer("byte"), workers=args.workers)
            out["loader"] = bench_loader(args, root, dataset)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
