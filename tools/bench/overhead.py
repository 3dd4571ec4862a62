"""Trainer overhead and CPU MFU benchmark: hpcdist's ``Trainer`` against a hand-written PyTorch loop.

What it measures (both parts in one invocation, so a noisy shared machine affects both sides alike):

1. **Overhead** -- the same model (``--preset``, default ``tiny``), the same synthetic batches in the same order,
   the same global batch / micro-batch / sequence length, on the same DDP world (``--world-size`` ranks on CPU,
   gloo, one thread each, started by fork), once through ``hpcdist.trainer.Trainer(cfg, env).train()`` (A) and
   once through a minimal loop (B): ``build_model`` under the same seed, plain ``DistributedDataParallel``,
   ``torch.optim.AdamW`` with the same parameter groups, ``no_sync`` on all but the last micro-batch,
   ``clip_grad_norm_``. A and B alternate for ``--repeats`` pairs, in the order A B, B A, A B, ... (so neither
   side always runs first: slow drift of the machine's load and order effects cancel). Each run trains
   ``--warmup + --steps`` optimizer steps; only the last ``--steps`` are timed, so start-up (process group,
   data, model build) and the first slow steps are excluded. Both use a constant LR (no schedule to copy).

   A step is timed from the moment the loop fetches its batch to the moment it fetches the next one (the last
   step: to the end of its optimizer step), so everything the loop does per step is inside. On the hpcdist side
   this is done by wrapping the trainer's ``loader.next_batch`` and ``strategy.optimizer_step`` on the instance;
   nothing in hpcdist is changed. The trainer's own ``step_time_s`` from ``metrics.jsonl`` (mean of its last 20
   steps, which it times from batch fetch to optimizer step) is reported beside it as a cross-check.

2. **MFU** -- one process, all cores (``torch.set_num_threads(os.cpu_count())``), the hpcdist trainer on a model
   big enough to be matmul-bound (``--mfu-preset``, default ``125m``, at ``--mfu-seq-len`` 256). The CPU peak is
   ``hpcdist.metrics.throughput.measure_cpu_peak_flops()`` (best fp32 2048^3 matmul), measured in the same process
   before the first step and again after every step, so each timed step has a peak taken next to it (the larger of the
   two around it). MFU of a step = its tokens x ``flops_per_token(args, seq_len)`` / its seconds / its peak; the
   table gives each timed step's MFU and their median (goal >= 50%), and as a lower bound the median step
   against the highest peak seen in the whole run.

How to read the tables:

- ``hpcdist/baseline`` of the median step time is the overhead figure (goal <= 1.02). ``pair ratios`` (min /
  median / max over the adjacent A/B pairs) and the ``fastest step`` ratio show how much of a deviation is noise:
  a real per-step overhead moves all of them; a neighbour's burst moves one pair.
- ``optimizer phase`` is clip + AdamW + LR schedule + zero_grad, timed on both sides.
- ``final loss`` and ``final grad norm`` must agree (to ~1e-6 relative): both sides did the same work on the
  same data. A mismatch makes the script exit 1; the timing goals are reported, never enforced.
- ``CPU used by other processes`` (machine busy time from /proc/stat minus this benchmark's own CPU time): above
  ~0.25 cores the absolute numbers, and MFU most of all, are pessimistic; rerun on a quiet machine.

Run from the repository root::

    python tools/bench/overhead.py                  # both parts: ~2.5 min on an idle 2-core CPU, 4-7 min busy
    python tools/bench/overhead.py --skip-mfu --repeats 9 --steps 40
    python tools/bench/overhead.py --skip-overhead --mfu-preset 350m --mfu-seq-len 128

It prints one table per part and writes every number (per-run and per-step times included) to ``--json``
(default ``runs/bench/overhead.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import resource
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    g = p.add_argument_group("overhead (part 1)")
    g.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    g.add_argument("--seq-len", type=int, default=128, help="tokens per sample (default 128)")
    g.add_argument("--global-batch", type=int, default=16, help="samples per optimizer step, all ranks (default 16)")
    g.add_argument("--micro-batch", type=int, default=4, help="samples per forward pass per rank (default 4)")
    g.add_argument("--world-size", type=int, default=2, help="DDP ranks, 1 thread each (default 2)")
    g.add_argument("--steps", type=int, default=20, help="timed steps per run (default 20)")
    g.add_argument("--warmup", type=int, default=5, help="untimed steps before them (default 5)")
    g.add_argument("--repeats", type=int, default=7, help="A/B pairs, alternating (default 7)")
    g.add_argument("--skip-overhead", action="store_true", help="skip part 1")
    g = p.add_argument_group("MFU (part 2)")
    g.add_argument("--mfu-preset", default="125m", help="model preset (default 125m)")
    g.add_argument("--mfu-seq-len", type=int, default=256, help="tokens per sample (default 256)")
    g.add_argument("--mfu-micro-batch", type=int, default=4, help="samples per step, no accumulation (default 4)")
    g.add_argument("--mfu-steps", type=int, default=3, help="timed steps (default 3)")
    g.add_argument("--mfu-warmup", type=int, default=2, help="untimed steps before them (default 2)")
    g.add_argument("--mfu-threads", type=int, default=0, help="torch threads (default 0 = all cores)")
    g.add_argument("--skip-mfu", action="store_true", help="skip part 2")
    p.add_argument("--lr", type=float, default=1e-3, help="constant learning rate of every run (default 1e-3)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a run is declared hung")
    p.add_argument("--json", default="runs/bench/overhead.json", help="where to write all numbers")
    return p


if __name__ == "__main__":
    # --help and a bad flag answer here, before torch (and hpcdist's trainer) is imported: seconds on a
    # busy node. main() parses again; that costs nothing.
    build_parser().parse_args()


import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from hpcdist import config as config_mod  # noqa: E402
from hpcdist.config import JobConfig  # noqa: E402
from hpcdist.data import SyntheticDataset  # noqa: E402
from hpcdist.env import DistEnv, destroy_process_group, from_environ, init_process_group  # noqa: E402
from hpcdist.metrics.throughput import measure_cpu_peak_flops  # noqa: E402
from hpcdist.models import build_model, flops_per_token, num_params  # noqa: E402
from hpcdist.trainer import Trainer  # noqa: E402

# The overhead runs log only at their final step; MFU for them is irrelevant, so a fixed peak spares the ~1 s
# CPU measurement the trainer would otherwise do at start-up (FACTS.md: ~63 GFLOP/s on 2 threads).
NOMINAL_PEAK_FLOPS = 6.3e10
NEVER = 1_000_000  # logging.every_steps for runs that should log only their final step
LOSS_RTOL = 1e-4  # final losses of identical work agree to ~1e-6; a different batch or init shows ~1e-3
GRAD_NORM_RTOL = 1e-3


# ------------------------------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class RunSpec:
    """One training run's shape; both sides of the comparison are built from the same spec."""

    preset: str
    seq_len: int
    global_batch: int
    micro_batch: int
    warmup: int
    steps: int
    lr: float
    seed: int = 1234
    log_level: str = "WARNING"

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps


def job_config(spec: RunSpec, run_dir: str, *, peak_flops: float, every_steps: int = NEVER) -> JobConfig:
    """The hpcdist JobConfig of ``spec``: synthetic data, constant LR, no checkpoints, no TensorBoard."""
    overrides = [
        f"model.preset={spec.preset}",
        "data.source=synthetic",
        f"data.seq_len={spec.seq_len}",
        f"train.steps={spec.total_steps}",
        f"train.global_batch_size={spec.global_batch}",
        f"train.micro_batch_size={spec.micro_batch}",
        # constant LR: the baseline needs no copy of the schedule to do bit-for-bit the same updates
        "optim.schedule=constant",
        "optim.warmup_steps=0",
        f"optim.lr={spec.lr:.6e}",
        f"logging.every_steps={every_steps}",
        "logging.tensorboard=false",
        # "6.300000e+10" (with a dot) is a float in YAML 1.1; "6.3e10" would be read as a string
        f"logging.peak_flops={peak_flops:.6e}",
        "checkpoint.every_steps=0",
        "checkpoint.save_final=false",
        "checkpoint.resume=none",
        f"run.dir={run_dir}",
        f"run.seed={spec.seed}",
        f"run.log_level={spec.log_level}",
    ]
    return config_mod.load(None, overrides)


# ------------------------------------------------------------------------------------------------- timing


@dataclass
class StepClock:
    """Per-step timestamps of one run: batch fetch, optimizer phase start, optimizer phase end."""

    starts: list[float] = field(default_factory=list)
    opt_starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)

    def start(self) -> None:
        self.starts.append(time.perf_counter())

    def opt_start(self) -> None:
        self.opt_starts.append(time.perf_counter())

    def end(self) -> None:
        self.ends.append(time.perf_counter())

    def durations(self) -> list[float]:
        """Seconds per step: fetch to next fetch (all loop code included); the last step to its optimizer end."""
        out = [b - a for a, b in itertools.pairwise(self.starts)]
        if self.starts and self.ends:
            out.append(self.ends[-1] - self.starts[-1])
        return out

    def compute_durations(self) -> list[float]:
        """Seconds per step from batch fetch to the end of the optimizer phase (the loop's bookkeeping left out)."""
        return [b - a for a, b in zip(self.starts, self.ends, strict=True)]

    def optimizer_durations(self) -> list[float]:
        """Seconds per step in the optimizer phase: clip + AdamW + LR schedule + zero_grad."""
        return [b - a for a, b in zip(self.opt_starts, self.ends, strict=True)]


def instrument(trainer: Trainer, clock: StepClock, after_step: Callable[[], None] | None = None) -> None:
    """Wrap the trainer's batch fetch and optimizer step (on the instance only) to timestamp each step.

    ``after_step`` runs after each step's end timestamp (outside the step's fetch-to-optimizer-end interval).
    """
    loader, strategy = trainer.loader, trainer.strategy
    next_batch: Callable[[], torch.Tensor] = loader.next_batch
    optimizer_step: Callable[[], torch.Tensor] = strategy.optimizer_step

    def timed_next_batch() -> torch.Tensor:
        clock.start()
        return next_batch()

    def timed_optimizer_step(**kw: bool) -> torch.Tensor:
        clock.opt_start()
        norm = optimizer_step(**kw)
        clock.end()
        if after_step is not None:
            after_step()
        return norm

    loader.next_batch = timed_next_batch  # type: ignore[method-assign]
    strategy.optimizer_step = timed_optimizer_step  # type: ignore[method-assign]


def summarize(seconds: Sequence[float]) -> dict[str, float]:
    return {
        "median_s": statistics.median(seconds),
        "mean_s": statistics.fmean(seconds),
        "min_s": min(seconds),
        "max_s": max(seconds),
    }


def last_metrics(run_dir: str) -> dict[str, Any]:
    """The final training step's record of the run's metrics.jsonl, {} if there is none (end-of-run records such
    as goodput carry no loss and are skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return {}
    records = [json.loads(line) for line in path.read_text().strip().splitlines()]
    steps = [r for r in records if "loss" in r and "split" not in r]
    return steps[-1] if steps else {}


class CpuShare:
    """Average number of cores other processes kept busy while the block ran (machine-wide busy time from
    /proc/stat minus this process's and its reaped children's CPU time): how noisy the measurement was."""

    others: float = math.nan

    @staticmethod
    def _machine_busy_s() -> float:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # user..steal; guest is inside user

    @staticmethod
    def _ours_s() -> float:
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    def __enter__(self) -> CpuShare:
        self._t0 = time.perf_counter()
        try:
            self._busy0: float | None = self._machine_busy_s()
        except (OSError, ValueError, IndexError):
            self._busy0 = None
        self._ours0 = self._ours_s()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._busy0 is None:
            return
        wall = time.perf_counter() - self._t0
        others = (self._machine_busy_s() - self._busy0) - (self._ours_s() - self._ours0)
        self.others = max(0.0, others / max(wall, 1e-9))


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # Linux: kilobytes


# ------------------------------------------------------------------------------------------------- the two sides


def hpcdist_run(env: DistEnv, cfg: JobConfig, spec: RunSpec) -> dict[str, Any]:
    """Side A: the hpcdist trainer exactly as a task runs it."""
    trainer = Trainer(cfg, env)
    clock = StepClock()
    instrument(trainer, clock)
    result = trainer.train()
    out: dict[str, Any] = {
        "step_times_s": clock.durations()[spec.warmup :],
        "optimizer_times_s": clock.optimizer_durations()[spec.warmup :],
    }
    if env.is_main:
        record = last_metrics(cfg.run.dir)
        out.update(
            final_loss=result.losses.get(result.step, math.nan),
            final_grad_norm=record.get("grad_norm", math.nan),
            metrics_step_time_s=record.get("step_time_s", math.nan),
            metrics_mfu=record.get("mfu", math.nan),
        )
    return out


def baseline_run(cfg: JobConfig, spec: RunSpec) -> dict[str, Any]:
    """Side B: a minimal hand-written DDP loop doing the same work as the trainer on the same data."""
    rank, world = dist.get_rank(), dist.get_world_size()
    o = cfg.optim
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model_args(), device="cpu")
    ddp = DistributedDataParallel(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
    )
    data = SyntheticDataset(cfg.data.synthetic_samples, cfg.data.seq_len, cfg.model.vocab_size, seed=cfg.run.seed)
    # one epoch's shuffled order, drawn like the trainer's sampler: randperm seeded with run.seed
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(cfg.run.seed)).tolist()
    local = spec.global_batch // world
    accum = local // spec.micro_batch
    max_norm = o.grad_clip if o.grad_clip > 0 else math.inf

    clock = StepClock()
    loss_sum = torch.zeros(())
    norm = torch.zeros(())
    for step in range(spec.total_steps):
        clock.start()
        first = step * spec.global_batch + rank * local
        batch = torch.from_numpy(np.stack([data[i] for i in order[first : first + local]]))
        loss_sum = torch.zeros(())
        for j, mb in enumerate(batch.split(spec.micro_batch)):
            with ddp.no_sync() if j < accum - 1 else contextlib.nullcontext():
                logits = ddp(mb[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), mb[:, 1:].flatten()) / accum
                loss.backward()
            loss_sum += loss.detach()
        clock.opt_start()
        norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.end()
    dist.all_reduce(loss_sum)  # the final step's global mean loss, for the agreement check only
    return {
        "step_times_s": clock.durations()[spec.warmup :],
        "optimizer_times_s": clock.optimizer_durations()[spec.warmup :],
        "final_loss": float(loss_sum) / world,
        "final_grad_norm": float(norm),
    }


# ------------------------------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world: int, port: int, side: str, cfg: JobConfig, spec: RunSpec, q: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)  # world ranks share os.cpu_count() cores; both sides alike
    try:
        if side == "hpcdist":
            env = from_environ()
            init_process_group(env, timeout_s=600)
            out = hpcdist_run(env, cfg, spec)
        else:
            dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
            out = baseline_run(cfg, spec)
        q.put((rank, "ok", out))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
    finally:
        destroy_process_group()


def _mfu_main(cfg: JobConfig, spec: RunSpec, threads: int, q: Any) -> None:
    """One local process: the trainer, with the CPU peak measured before the first step and after every step."""
    try:
        torch.set_num_threads(threads)
        measure_cpu_peak_flops(repeats=2)  # discarded warm-up: thread pool start, first-touch page faults
        peaks: list[float] = []

        def measure() -> None:
            peaks.append(measure_cpu_peak_flops(repeats=3))

        measure()
        cfg.logging.peak_flops = peaks[0]  # the trainer's own logged MFU then uses a peak measured here too
        env = from_environ({}, cuda_available=False)  # one local process, wherever the benchmark runs
        trainer = Trainer(cfg, env)
        clock = StepClock()
        instrument(trainer, clock, after_step=measure)
        result = trainer.train()
        record = last_metrics(cfg.run.dir)
        w = spec.warmup
        out = {
            "step_times_s": clock.compute_durations()[w:],
            "optimizer_times_s": clock.optimizer_durations()[w:],
            # step k (0-based) ran between peaks[k] and peaks[k + 1]
            "peaks_around_step": [max(a, b) for a, b in itertools.pairwise(peaks)][w:],
            "peaks": peaks,
            "final_loss": result.losses.get(result.step, math.nan),
            "metrics_mfu": record.get("mfu", math.nan),
            "threads": torch.get_num_threads(),
            "peak_rss_gib": peak_rss_gib(),
        }
        q.put((0, "ok", out))
    except BaseException:
        q.put((0, "error", traceback.format_exc()))


def run_processes(targets: list[tuple[Callable[..., None], tuple[Any, ...]]], timeout_s: float) -> list[Any]:
    """Fork one process per target (each gets a result queue as its last argument); return rank-ordered results."""
    ctx = mp.get_context("fork")  # forked ranks start in ~0.1 s; spawned ones re-import torch (~3 s each here)
    q = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(*args, q), daemon=True) for fn, args in targets]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < len(procs):
            try:
                rank, status, value = q.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a benchmark process died (exit code {dead[0].exitcode})") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"benchmark processes still running after {timeout_s:.0f} s") from None
                continue
            if status != "ok":
                raise RuntimeError(f"benchmark process {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(len(procs))]


def run_side(side: str, world: int, cfg: JobConfig, spec: RunSpec, timeout_s: float) -> dict[str, Any]:
    port = free_port()
    targets = [(_rank_main, (r, world, port, side, cfg, spec)) for r in range(world)]
    return run_processes(targets, timeout_s)[0]  # rank 0: ranks run in lock step (DDP all-reduce each step)


# ------------------------------------------------------------------------------------------------- the two parts


def bench_overhead(a: argparse.Namespace) -> dict[str, Any]:
    spec = RunSpec(a.preset, a.seq_len, a.global_batch, a.micro_batch, a.warmup, a.steps, a.lr)
    runs: dict[str, list[dict[str, Any]]] = {"hpcdist": [], "baseline": []}
    with tempfile.TemporaryDirectory(prefix="hpcdist-bench-") as tmp:
        cfg = job_config(spec, tmp, peak_flops=NOMINAL_PEAK_FLOPS)  # validated here, before any fork
        config_mod.check_world(cfg, a.world_size)
        for rep in range(a.repeats):
            # A B, B A, A B, ...: a side never always goes first, so drift and order effects cancel
            for side in ("hpcdist", "baseline") if rep % 2 == 0 else ("baseline", "hpcdist"):
                cfg.run.dir = tempfile.mkdtemp(prefix=f"{side}-{rep}-", dir=tmp)  # fresh metrics.jsonl
                t0 = time.perf_counter()
                out = run_side(side, a.world_size, cfg, spec, timeout_s=a.timeout)
                out["wall_s"] = time.perf_counter() - t0
                out.update(summarize(out["step_times_s"]))
                out["optimizer_median_s"] = statistics.median(out["optimizer_times_s"])
                runs[side].append(out)
                print(
                    f"  pair {rep + 1}/{a.repeats} {side:8s} median step {out['median_s'] * 1e3:8.2f} ms "
                    f"(run incl. start-up {out['wall_s']:.1f} s)",
                    flush=True,
                )

    med = {side: statistics.median(r["median_s"] for r in rs) for side, rs in runs.items()}
    pairs = [h["median_s"] / b["median_s"] for h, b in zip(runs["hpcdist"], runs["baseline"], strict=True)]
    last_h, last_b = runs["hpcdist"][-1], runs["baseline"][-1]
    loss_rel = abs(last_h["final_loss"] - last_b["final_loss"]) / abs(last_b["final_loss"])
    gn_rel = abs(last_h["final_grad_norm"] - last_b["final_grad_norm"]) / max(abs(last_b["final_grad_norm"]), 1e-30)
    tokens_per_step = spec.global_batch * spec.seq_len
    ratio = med["hpcdist"] / med["baseline"]
    return {
        "spec": spec.__dict__,
        "world_size": a.world_size,
        "threads_per_rank": 1,
        "grad_accum": spec.global_batch // (spec.micro_batch * a.world_size),
        "params": num_params(cfg.model_args()),
        "median_step_s": med,
        "mean_step_s": {side: statistics.fmean(r["mean_s"] for r in rs) for side, rs in runs.items()},
        "fastest_step_s": {side: min(r["min_s"] for r in rs) for side, rs in runs.items()},
        "median_optimizer_s": {
            side: statistics.median(r["optimizer_median_s"] for r in rs) for side, rs in runs.items()
        },
        "tokens_per_s": {side: tokens_per_step / m for side, m in med.items()},
        "metrics_step_time_s": statistics.median(r["metrics_step_time_s"] for r in runs["hpcdist"]),
        "ratio": ratio,
        "pair_ratios": pairs,
        "goal_ratio_max": 1.02,
        "pass": ratio <= 1.02,
        "final_loss": {"hpcdist": last_h["final_loss"], "baseline": last_b["final_loss"], "rel_diff": loss_rel},
        "final_grad_norm": {
            "hpcdist": last_h["final_grad_norm"],
            "baseline": last_b["final_grad_norm"],
            "rel_diff": gn_rel,
        },
        "same_work": loss_rel <= LOSS_RTOL and gn_rel <= GRAD_NORM_RTOL,
        "runs": runs,
    }


def bench_mfu(a: argparse.Namespace) -> dict[str, Any]:
    spec = RunSpec(a.mfu_preset, a.mfu_seq_len, a.mfu_micro_batch, a.mfu_micro_batch, a.mfu_warmup, a.mfu_steps, a.lr)
    with tempfile.TemporaryDirectory(prefix="hpcdist-bench-mfu-") as run_dir:
        # every step logged: one .item() and one JSON line per multi-second step cost nothing measurable
        cfg = job_config(spec, run_dir, peak_flops=NOMINAL_PEAK_FLOPS, every_steps=1)
        threads = a.mfu_threads or os.cpu_count() or 1
        t0 = time.perf_counter()
        out = run_processes([(_mfu_main, (cfg, spec, threads))], a.timeout)[0]
        wall = time.perf_counter() - t0
    args = cfg.model_args()
    fpt = flops_per_token(args, spec.seq_len)
    step_flops = spec.global_batch * spec.seq_len * fpt
    times, peaks = out["step_times_s"], out["peaks_around_step"]
    per_step = [step_flops / t / p for t, p in zip(times, peaks, strict=True)]
    step = summarize(times)
    value = statistics.median(per_step)
    return {
        "spec": spec.__dict__,
        "threads": out["threads"],
        "params": num_params(args),
        "flops_per_token": fpt,
        "peaks_flops": out["peaks"],
        "peak_flops_median": statistics.median(peaks),
        "peak_flops_max": max(out["peaks"]),
        "step": step,
        "step_times_s": times,
        "optimizer_times_s": out["optimizer_times_s"],
        "optimizer_median_s": statistics.median(out["optimizer_times_s"]),
        "tokens_per_s": spec.global_batch * spec.seq_len / step["median_s"],
        "achieved_flops": step_flops / step["median_s"],
        "mfu_per_step": per_step,
        "mfu": value,
        "mfu_vs_max_peak": step_flops / step["median_s"] / max(out["peaks"]),
        "trainer_logged_mfu_window": out["metrics_mfu"],
        "final_loss": out["final_loss"],
        "peak_rss_gib": out["peak_rss_gib"],
        "goal_mfu_min": 0.5,
        "pass": value >= 0.5,
        "wall_s": wall,
    }


# ------------------------------------------------------------------------------------------------- report


def table(rows: Sequence[Sequence[str]]) -> str:
    """Plain-text table: the first row is the header; the first column is left-aligned, the others right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def line(r: Sequence[str]) -> str:
        cells = [r[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True))]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(rows[0]), rule, *(line(r) for r in rows[1:])])


def load_line(part: dict[str, Any]) -> str:
    others = part.get("other_processes_cores", math.nan)
    if not math.isfinite(others):
        return "CPU used by other processes: unknown (no /proc/stat)"
    note = " -- a busy machine: absolute times and MFU are pessimistic" if others > 0.25 else ""
    return f"CPU used by other processes during this part: {others:.2f} of {os.cpu_count()} cores on average{note}"


def overhead_table(o: dict[str, Any]) -> str:
    s = o["spec"]
    h, b = o["median_step_s"]["hpcdist"], o["median_step_s"]["baseline"]
    mh, mb = o["mean_step_s"]["hpcdist"], o["mean_step_s"]["baseline"]
    oh, ob = o["median_optimizer_s"]["hpcdist"], o["median_optimizer_s"]["baseline"]
    fh, fb = o["fastest_step_s"]["hpcdist"], o["fastest_step_s"]["baseline"]
    pr = sorted(o["pair_ratios"])
    fl, gn = o["final_loss"], o["final_grad_norm"]
    head = (
        f"[1] trainer overhead: preset {s['preset']} ({o['params'] / 1e6:.2f}M params), DDP {o['world_size']} ranks x "
        f"{o['threads_per_rank']} thread (gloo), seq {s['seq_len']}, global batch {s['global_batch']}, "
        f"micro {s['micro_batch']} (accum {o['grad_accum']}), {len(o['pair_ratios'])} pairs (AB BA AB ...), "
        f"{s['steps']} timed steps after {s['warmup']} warm-up"
    )
    rows = [
        ("quantity", "hpcdist", "baseline", "hpcdist/baseline"),
        ("step time, median of run medians (ms)", f"{h * 1e3:.2f}", f"{b * 1e3:.2f}", f"{h / b:.4f}"),
        ("step time, mean of run means (ms)", f"{mh * 1e3:.2f}", f"{mb * 1e3:.2f}", f"{mh / mb:.4f}"),
        ("step time, fastest step of all runs (ms)", f"{fh * 1e3:.2f}", f"{fb * 1e3:.2f}", f"{fh / fb:.4f}"),
        ("  of which optimizer phase, median (ms)", f"{oh * 1e3:.2f}", f"{ob * 1e3:.2f}", f"{oh / ob:.4f}"),
        ("tokens/s (all ranks)", f"{o['tokens_per_s']['hpcdist']:.0f}", f"{o['tokens_per_s']['baseline']:.0f}", ""),
        ("metrics.jsonl step_time_s, median (ms)", f"{o['metrics_step_time_s'] * 1e3:.2f}", "", ""),
        ("pair ratios min / median / max", "", "", f"{pr[0]:.4f} / {statistics.median(pr):.4f} / {pr[-1]:.4f}"),
        ("final loss (last run)", f"{fl['hpcdist']:.6f}", f"{fl['baseline']:.6f}", f"rel diff {fl['rel_diff']:.1e}"),
        (
            "final grad norm (last run)",
            f"{gn['hpcdist']:.6f}",
            f"{gn['baseline']:.6f}",
            f"rel diff {gn['rel_diff']:.1e}",
        ),
    ]
    verdict = (
        f"{load_line(o)}\n"
        f"ratio {o['ratio']:.4f} (goal <= {o['goal_ratio_max']}): {'PASS' if o['pass'] else 'FAIL'}; "
        f"same work (loss rtol {LOSS_RTOL:g}, grad norm rtol {GRAD_NORM_RTOL:g}): {'yes' if o['same_work'] else 'NO'}"
    )
    return "\n".join([head, table(rows), verdict])


def mfu_table(m: dict[str, Any]) -> str:
    s, st = m["spec"], m["step"]
    pk = [p / 1e9 for p in m["peaks_flops"]]
    head = (
        f"[2] single-process CPU MFU: preset {s['preset']} ({m['params'] / 1e6:.1f}M params), 1 process x "
        f"{m['threads']} threads, seq {s['seq_len']}, micro = global batch {s['global_batch']}, "
        f"{s['steps']} timed steps after {s['warmup']} warm-up; CPU peak re-measured between steps"
    )
    rows = [
        ("quantity", "value"),
        (
            "CPU peak, fp32 2048^3 matmul: min / median / max of the run (GFLOP/s)",
            f"{min(pk):.1f} / {statistics.median(pk):.1f} / {max(pk):.1f}",
        ),
        ("step time median / min / max (s)", f"{st['median_s']:.3f} / {st['min_s']:.3f} / {st['max_s']:.3f}"),
        (
            "  of which optimizer phase (clip + AdamW + zero_grad), median (s)",
            f"{m['optimizer_median_s']:.3f} ({m['optimizer_median_s'] / st['median_s'] * 100:.0f}%)",
        ),
        ("tokens/s (median step)", f"{m['tokens_per_s']:.1f}"),
        ("model FLOPs per token (GFLOP)", f"{m['flops_per_token'] / 1e9:.4f}"),
        ("achieved model FLOP/s (GFLOP/s)", f"{m['achieved_flops'] / 1e9:.1f}"),
        (
            "MFU per timed step (vs the peak measured next to it)",
            " / ".join(f"{v * 100:.1f}%" for v in m["mfu_per_step"]),
        ),
        ("MFU, median of those", f"{m['mfu'] * 100:.1f}%"),
        ("MFU, median step vs the run's highest peak (lower bound)", f"{m['mfu_vs_max_peak'] * 100:.1f}%"),
        ("peak RSS (GiB)", f"{m['peak_rss_gib']:.2f}"),
    ]
    goal = f"(goal >= {m['goal_mfu_min'] * 100:.0f}%): {'PASS' if m['pass'] else 'FAIL'}"
    if m.get("other_processes_cores", 0.0) > 0.25:
        goal += " -- not conclusive on a busy machine: rerun when it is idle"
    verdict = f"{load_line(m)}\nMFU {m['mfu'] * 100:.1f}% {goal}"
    return "\n".join([head, table(rows), verdict])


def machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


# ------------------------------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    a = p.parse_args(argv)
    for name in (
        "seq_len",
        "global_batch",
        "micro_batch",
        "world_size",
        "steps",
        "repeats",
        "mfu_seq_len",
        "mfu_micro_batch",
        "mfu_steps",
    ):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.warmup < 0 or a.mfu_warmup < 0:
        p.error("--warmup and --mfu-warmup must be >= 0")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    t0 = time.perf_counter()
    started = datetime.datetime.now().astimezone()
    info = machine()
    print(
        f"hpcdist trainer benchmark, {started:%Y-%m-%d %H:%M %Z}: {info['cpu_count']} x {info['cpu']}, "
        f"torch {info['torch']}, python {info['python']}",
        flush=True,
    )
    report: dict[str, Any] = {"date": started.isoformat(timespec="seconds"), "machine": info, "args": vars(a)}
    tables: list[str] = []
    try:
        if not a.skip_overhead:
            print("[1] overhead runs:", flush=True)
            with CpuShare() as share:
                report["overhead"] = bench_overhead(a)
            report["overhead"]["other_processes_cores"] = share.others
            tables.append(overhead_table(report["overhead"]))
        if not a.skip_mfu:
            print("[2] MFU run ...", flush=True)
            with CpuShare() as share:
                report["mfu"] = bench_mfu(a)
            report["mfu"]["other_processes_cores"] = share.others
            tables.append(mfu_table(report["mfu"]))
    except config_mod.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report["wall_s"] = time.perf_counter() - t0
    print()
    print("\n\n".join(tables))
    print(f"\ntotal wall time {report['wall_s']:.0f} s")
    path = Path(a.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    # goals are reported, not enforced (timings are not pass/fail on a shared machine); different work is a bug
    return 1 if "overhead" in report and not report["overhead"]["same_work"] else 0


if __name__ == "__main__":
    sys.exit(main())
