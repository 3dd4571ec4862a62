#!/usr/bin/env python3
"""The node-local snapshot's cost per step: the same run with ``checkpoint.local.every_steps: 1`` (goal: <= 1.05
of the step time without it) against the run without it, alternated in one invocation.

2 DDP ranks x 1 thread on CPU (gloo, fork-started), each on a host of its own name, so every snapshot is also
copied to the other "node" (the peer copy of the tier). The snapshot's directory is on /dev/shm (host memory), as
the tier is meant to run for a per-step cadence. Runs alternate A B, B A, A B, ...; the step time is the median
of the gaps between consecutive steps' ends after a warm-up (``metrics.jsonl``), so everything the loop does per
step is included: the snapshot's in-loop part, the staging fence before the optimizer step, and what the
background write and copy take from the step's cores. Both sides must log the same losses (a snapshot changes
nothing the training computes): the script exits 1 if they do not.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="pairs of runs (default 3)")
    p.add_argument("--steps", type=int, default=40, help="timed steps per run (default 40)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--shm", default="/dev/shm", help="where the snapshots go (default /dev/shm)")
    p.add_argument("--log-level", default="WARNING", help="the runs' run.log_level (INFO: every snapshot's split)")
    p.add_argument("--json", type=Path, help="write every number here too")
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, overrides: list[str], q: Any) -> None:
    import torch

    from hpcdist import config as config_mod
    from hpcdist.env import destroy_process_group, from_environ, init_process_group
    from hpcdist.trainer import Trainer

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK="0",
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="1",
        GROUP_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RUN_ID="bench",
    )
    torch.set_num_threads(1)
    try:
        env = dataclasses.replace(from_environ(cuda_available=False), hostname=f"node{rank}")
        init_process_group(env, timeout_s=300)
        Trainer(config_mod.load(None, overrides), env).train()
        q.put((rank, None))
    except BaseException:
        q.put((rank, traceback.format_exc()))
    finally:
        destroy_process_group()


def one_run(args: argparse.Namespace, work: Path, snapshot: bool) -> dict[str, Any]:
    run_dir = work / ("with" if snapshot else "without")
    shutil.rmtree(run_dir, ignore_errors=True)
    local = Path(tempfile.mkdtemp(prefix="hpcdist-bench-snapshot-", dir=args.shm))
    overrides = [
        f"model.preset={args.preset}",
        "data.source=synthetic",
        f"data.seq_len={args.seq_len}",
        f"train.steps={args.warmup + args.steps}",
        f"train.global_batch_size={args.global_batch}",
        f"train.micro_batch_size={args.micro_batch}",
        "logging.every_steps=1",
        "logging.tensorboard=false",
        "logging.peak_flops=6.300000e+10",
        "checkpoint.every_steps=0",
        "checkpoint.save_final=false",
        "checkpoint.resume=none",
        f"run.dir={run_dir}",
        f"run.log_level={args.log_level}",
    ]
    if snapshot:
        overrides += [f"checkpoint.local.dir={local}/{{host}}", "checkpoint.local.every_steps=1"]
    ctx, port = mp.get_context("fork"), _free_port()
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, overrides, q)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        errors = [err for _, err in (q.get(timeout=900) for _ in procs) if err]
        for p in procs:
            p.join(60)
    finally:
        shutil.rmtree(local, ignore_errors=True)
    if errors:
        raise RuntimeError(errors[0])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    times = [r["time"] for r in steps]
    gaps = [b - a for a, b in zip(times[args.warmup :], times[args.warmup + 1 :], strict=False)]
    return {"step_s": statistics.median(gaps), "losses": [r["loss"] for r in steps]}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="hpcdist-bench-snapshot-"))
    pairs = []
    try:
        for i in range(args.repeats):
            order = (False, True) if i % 2 == 0 else (True, False)
            got = {flag: one_run(args, work, flag) for flag in order}
            pairs.append(got)
            print(
                f"pair {i + 1}: without {got[False]['step_s'] * 1e3:.1f} ms/step, with {got[True]['step_s'] * 1e3:.1f}"
                f" ms/step, ratio {got[True]['step_s'] / got[False]['step_s']:.3f}",
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    same = all(p[True]["losses"] == p[False]["losses"] for p in pairs)
    ratios = [p[True]["step_s"] / p[False]["step_s"] for p in pairs]
    without = statistics.median(p[False]["step_s"] for p in pairs)
    with_ = statistics.median(p[True]["step_s"] for p in pairs)
    print()
    print("| run | median step (ms) |")
    print("|---|---|")
    print(f"| without a snapshot | {without * 1e3:.1f} |")
    print(f"| checkpoint.local.every_steps: 1 | {with_ * 1e3:.1f} |")
    print(f"| ratio (median of pairs; goal <= 1.05) | {statistics.median(ratios):.3f} |")
    print(f"losses equal on both sides: {same}")
    if args.json:
        args.json.write_text(json.dumps({"ratios": ratios, "without_s": without, "with_s": with_, "same": same}))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
