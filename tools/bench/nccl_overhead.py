"""nccl_check overhead: the all_reduce busbw the tool reports against a bare torch.distributed timing loop.

Both sides run in the same 4 gloo ranks (fork-started, one thread each, CPU), set up like the tool (rendezvous
store, process group on it, the tool's ``Watchdog`` running), on the same message sizes with the same iteration
counts. For every size the two run back to back, alternating which goes first (tool raw, raw tool, ...), so drift
of a shared machine's load and order effects cancel within each pair:

- **tool**: exactly what ``tools/nccl_check`` does for one all_reduce row: ``hpcdist.diagnostics.collectives.
  sweep_op`` (a progress marker written to the rendezvous store and a watchdog deadline around the size, buffer
  setup, warm-up, barrier, the timed loop, then the result check), and busbw from the tool's own ``group_table``
  (time averaged over ranks, nccl-tests' 2(n-1)/n factor).
- **raw**: ``dist.barrier(); t0; for _ in range(iters): dist.all_reduce(t); t1`` on a plain tensor, averaged over
  ranks the same way.

The watchdog's two threads are alive for both sides; they never wake while collectives run (a condition wait until
the step's deadline, a blocking store wait), which is what lets the tool time without overhead.

Goal: tool / raw busbw >= 0.95 at every size from 1 KB to 64 MB (the tool adds no overhead of its own). The
figure judged is the median of the per-repeat ratios (each repeat's tool and raw ran back to back, so a shared
machine's drift cancels within a pair); beside it the ratio of the medians and of the best repeats (noise only
ever slows a run down), and the spread of the pair ratios (min / max) shows how much of a deviation is noise.
Timings are reported, never enforced.

Run from the repository root::

    python tools/bench/nccl_overhead.py                       # 1 KiB .. 64 MiB (x4), 5 repeats: ~2-4 min
    python tools/bench/nccl_overhead.py --repeats 9 --factor 2 --json runs/bench/nccl.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# a script run from a checkout: the checkout's hpcdist, and tools.bench for the shared table/process helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hpcdist.diagnostics.cli import parse_message_size  # torch-free: the parser needs it


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=4, help="gloo ranks (default 4)")
    p.add_argument("--min-bytes", type=parse_message_size, default=1024, help="smallest message (default 1K)")
    p.add_argument("--max-bytes", type=parse_message_size, default=64 << 20, help="largest message (default 64M)")
    p.add_argument("--factor", type=int, default=4, help="size multiplier (default 4)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per size, as nccl_check (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="warm-up iterations per size (default 5)")
    p.add_argument("--repeats", type=int, default=5, help="tool/raw pairs, alternating order (default 5)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before the run is declared hung")
    p.add_argument("--json", default="runs/bench/nccl_overhead.json", help="where to write every number")
    return p


if __name__ == "__main__":
    # --help and a bad flag answer here, before torch (and hpcdist's trainer) is imported: seconds on a
    # busy node. main() parses again; that costs nothing.
    build_parser().parse_args()


import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hpcdist.diagnostics.collectives import busbw_factor, group_table, message_sizes, sweep_op  # noqa: E402
from hpcdist.diagnostics.faults import Faults  # noqa: E402
from hpcdist.diagnostics.rendezvous import join  # noqa: E402
from hpcdist.diagnostics.report import human_bytes  # noqa: E402
from hpcdist.diagnostics.watchdog import Watchdog  # noqa: E402
from hpcdist.env import from_environ  # noqa: E402
from tools.bench.overhead import CpuShare, free_port, machine, run_processes, table  # noqa: E402

GOAL = 0.95
OP = "all_reduce"


def raw_loop(count: int, iters: int, warmup: int) -> float:
    """Seconds per all_reduce of ``count`` floats: the loop anyone would write."""
    t = torch.ones(count)
    for _ in range(warmup):
        dist.all_reduce(t)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    return (time.perf_counter() - start) / iters


def _rank(rank: int, world: int, port: int, a: argparse.Namespace, q: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    try:
        env = from_environ(cuda_available=False)
        joined = join(env, {"rank": rank, "hostname": env.hostname}, 120)  # the tool's rendezvous and store
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("pg", joined.store),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=600),
        )
        sizes = message_sizes(a.min_bytes, a.max_bytes, a.factor)
        wd = Watchdog(joined.store, rank, joined.hosts, 600, on_hang=lambda hang: None).start()
        out: dict[str, list[Any]] = {"tool": [], "raw": []}
        for repeat in range(a.repeats):
            tool_rows, raw_s = [], []
            for i, size in enumerate(sizes):
                for side in ("tool", "raw") if (repeat + i) % 2 == 0 else ("raw", "tool"):
                    if side == "tool":
                        tool_rows += sweep_op(
                            OP,
                            dist.group.WORLD,
                            [size],
                            dtype=torch.float32,
                            device=torch.device("cpu"),
                            iters=a.iters,
                            warmup=a.warmup,
                            rank=rank,
                            faults=Faults(),
                            step=wd.step,
                        )
                    else:
                        raw_s.append(raw_loop(max(size // 4, 1), a.iters, a.warmup))
            out["tool"].append(tool_rows)
            out["raw"].append(raw_s)
        wd.stop()
        q.put((rank, "ok", out))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def summarize(per_rank: list[dict[str, list[Any]]], a: argparse.Namespace) -> list[dict[str, Any]]:
    """Per size: tool and raw busbw of every repeat, their medians, and the ratios."""
    world = len(per_rank)
    ranks = list(range(world))
    sizes = message_sizes(a.min_bytes, a.max_bytes, a.factor)
    tool = [group_table(OP, [r["tool"][k] for r in per_rank], ranks, torch.float32) for k in range(a.repeats)]
    assert all(len(t) == len(sizes) for t in tool), "one tool row per size"
    out = []
    for i, size in enumerate(sizes):
        tool_bw = [tool[k][i]["in"]["busbw"] for k in range(a.repeats)]
        raw_s = [statistics.fmean(r["raw"][k][i] for r in per_rank) for k in range(a.repeats)]
        raw_bw = [size / s / 1e9 * busbw_factor(OP, world) for s in raw_s]
        pairs = [t / r for t, r in zip(tool_bw, raw_bw, strict=True)]
        out.append(
            {
                "size": size,
                "tool_busbw": tool_bw,
                "raw_busbw": raw_bw,
                "tool_median": statistics.median(tool_bw),
                "raw_median": statistics.median(raw_bw),
                "ratio_of_medians": statistics.median(tool_bw) / statistics.median(raw_bw),
                "ratio_of_best": max(tool_bw) / max(raw_bw),
                "pair_ratios": pairs,
                "ratio": statistics.median(pairs),
                "wrong": sum(tool[k][i]["in"]["wrong"] for k in range(a.repeats)),
            }
        )
    return out


def render(rows: list[dict[str, Any]], a: argparse.Namespace, others: float) -> str:
    cells = [["size", "tool busbw", "raw busbw", "tool/raw", "of medians", "of best", "pair ratios min / max"]]
    for r in rows:
        p = r["pair_ratios"]
        cells.append(
            [
                human_bytes(r["size"]),
                f"{r['tool_median']:.4f}",
                f"{r['raw_median']:.4f}",
                f"{r['ratio']:.3f}",
                f"{r['ratio_of_medians']:.3f}",
                f"{r['ratio_of_best']:.3f}",
                f"{min(p):.3f} / {max(p):.3f}",
            ]
        )
    worst = min(r["ratio"] for r in rows)
    median = statistics.median(r["ratio"] for r in rows)
    verdict = "PASS" if worst >= GOAL else "below the goal at some size"
    lines = [
        f"all_reduce busbw, {a.world_size} gloo ranks x 1 thread (CPU), {a.iters} iters after {a.warmup} warm-up, "
        f"{a.repeats} repeats, per size back to back alternating (tool raw, raw tool, ...); busbw in GB/s = medians "
        "over repeats; tool/raw = median of the per-repeat ratios",
        table(cells),
        f"tool/raw: worst {worst:.3f}, median over sizes {median:.3f} (goal >= {GOAL} at every size): {verdict}",
        f"CPU used by other processes meanwhile: {others:.2f} of {os.cpu_count()} cores"
        + (" -- noisy: rerun on a quiet machine" if others > 0.25 else ""),
        f"#wrong over all tool runs: {sum(r['wrong'] for r in rows)}",
    ]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    a = p.parse_args(argv)
    if a.world_size < 2 or a.iters < 1 or a.repeats < 1 or a.warmup < 0 or a.factor < 2:
        p.error("need --world-size >= 2, --iters >= 1, --repeats >= 1, --warmup >= 0, --factor >= 2")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    started = datetime.datetime.now().astimezone()
    info = machine()
    print(
        f"nccl_check overhead benchmark, {started:%Y-%m-%d %H:%M %Z}: {info['cpu_count']} x {info['cpu']}, "
        f"torch {info['torch']}",
        flush=True,
    )
    t0 = time.perf_counter()
    port = free_port()
    with CpuShare() as share:
        per_rank = run_processes([(_rank, (r, a.world_size, port, a)) for r in range(a.world_size)], a.timeout)
    rows = summarize(per_rank, a)
    print(render(rows, a, share.others))
    doc = {
        "date": started.isoformat(timespec="seconds"),
        "machine": info,
        "args": vars(a),
        "goal_ratio": GOAL,
        "rows": rows,
        "other_processes_cores": share.others,
        "wall_s": time.perf_counter() - t0,
    }
    path = Path(a.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"total wall time {doc['wall_s']:.0f} s; wrote {path}")
    return 1 if any(r["wrong"] for r in rows) else 0  # wrong results are a bug; timings are only reported


if __name__ == "__main__":
    sys.exit(main())
