"""Straggler detection: every N steps the ranks compare what each of them does on its own.

Inside a step the ranks synchronize (gradient all-reduce or reduce-scatter), so every rank's step wall time is the
same: a slow rank's cost shows up as everybody's step time, and as the others' waiting inside the collective where
no timer of ours can see it. Only work a rank does without the others can single it out. Per rank, all-gathered
every ``every`` steps:

- ``data_s``: mean seconds per step spent loading this rank's batch (no collective: a slow file system, a starved
  host CPU), measured on the real loop;
- ``compute_s``: a fixed compute probe, timed now: a matmul of fixed size on the rank's device, synchronized, best
  of 3 (a throttled or degraded GPU, a CPU shared with a noisy neighbour);
- ``wait_s``: how long the rank then waited for the slowest rank to arrive at the check (the straggler waits least);
- ``step_s``: mean step wall time over the window (for scale);
- ``mem_gib``: the rank's memory now (CUDA reserved, else resident set size): the report's memory-per-rank bars.

A rank is a straggler when its ``data_s`` or ``compute_s`` exceeds ``factor`` x the lower median over ranks (with two
ranks: the faster one) by enough to matter (data: at least 5% of the mean step time; probe: 1 ms), at CONFIRM_CHECKS
consecutive checks: one slow probe is often just a neighbour process taking the core for a few milliseconds (seen
at 1.6x on the shared 2-core test machine), a straggler stays slow. The metrics show every check's raw ratios.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Straggler", "StragglerMonitor", "StragglerReport", "compute_probe_s", "find_stragglers"]

MIN_DATA_SHARE = 0.05  # of a step: less slow data loading than that is not worth a warning
MIN_PROBE_EXCESS_S = 1e-3
CONFIRM_CHECKS = 2


@dataclass(frozen=True)
class Straggler:
    rank: int
    host: str
    measure: str  # "data" | "compute"
    value_s: float
    reference_s: float

    @property
    def ratio(self) -> float:
        return self.value_s / self.reference_s if self.reference_s > 0 else float("inf")

    def describe(self) -> str:
        what = "data loading per step" if self.measure == "data" else "compute probe"
        return (
            f"rank {self.rank} on {self.host} is a straggler: {what} {self.value_s * 1e3:.1f} ms = "
            f"{self.ratio:.2f}x the median rank's {self.reference_s * 1e3:.1f} ms"
        )


@dataclass(frozen=True)
class StragglerReport:
    table: list[dict[str, float]]
    """Per rank (index = rank): data_s, compute_s, wait_s, step_s, mem_gib."""
    stragglers: list[Straggler]

    def metrics(self) -> dict[str, float | list[float]]:
        """For metrics.jsonl / TensorBoard: count, worst ratio to the median per measure, slowest values, and the
        per-rank memory list (JSON only: TensorBoard takes the numbers)."""
        out: dict[str, float | list[float]] = {"count": float(len(self.stragglers))}
        for key in ("data_s", "compute_s"):
            values = [r[key] for r in self.table]
            ref = statistics.median_low(values)
            out[f"{key.removesuffix('_s')}_ratio"] = max(values) / ref if ref > 0 else 1.0
            out[f"{key}_max"] = max(values)
        out["wait_s_max"] = max(r["wait_s"] for r in self.table)
        out["mem_gib_per_rank"] = [round(r["mem_gib"], 4) for r in self.table]
        return out


def _memory_gib(device: torch.device) -> float:
    """This rank's memory now, without resetting the peaks metrics.memory_stats reads: CUDA reserved, else RSS."""
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device) / 2**30
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError, IndexError):
        return 0.0


def find_stragglers(values: Sequence[float], *, factor: float, min_excess: float) -> list[int]:
    """Indices whose value exceeds ``factor`` x the lower median and the median by more than ``min_excess``."""
    if len(values) < 2:
        return []
    ref = statistics.median_low(values)
    return [i for i, v in enumerate(values) if v > factor * ref and v - ref > min_excess]


def compute_probe_s(device: torch.device) -> float:
    """Best-of-3 seconds of a fixed matmul on ``device`` (same work on every rank; ~5 ms on a CPU core)."""
    cuda = device.type == "cuda"
    n, reps, dtype = (4096, 10, torch.bfloat16) if cuda else (512, 1, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(3):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        if cuda:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


class StragglerMonitor:
    """Collects per-step times; ``check()`` (a collective: every rank, same steps) gathers and judges them."""

    def __init__(self, *, every: int, factor: float, device: torch.device) -> None:
        self.every, self.factor, self.device = every, factor, device
        self._data = self._steps = 0.0
        self._n = 0
        self._group: dist.ProcessGroup | None = None
        self._group_made = False
        self._slow_since: dict[tuple[int, str], int] = {}  # (rank, measure) -> consecutive slow checks

    def add(self, *, data_s: float, step_s: float) -> None:
        self._data += data_s
        self._steps += step_s
        self._n += 1

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0 and dist.is_initialized() and dist.get_world_size() > 1

    def check(self, hosts: Sequence[str]) -> StragglerReport:
        """Every rank (a collective): per-rank measurements and the stragglers among them. Resets the window."""
        n = max(1, self._n)
        data_s, step_s = self._data / n, self._steps / n
        self._data = self._steps = 0.0
        self._n = 0
        probe = compute_probe_s(self.device)
        if not self._group_made:
            # CPU tensors over gloo (a side group once, on NCCL jobs): no device sync beyond the probe's own
            self._group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
            self._group_made = True
        group = self._group
        arrive = torch.zeros(1)
        t0 = time.perf_counter()
        dist.all_reduce(arrive, group=group)  # everyone arrives: the time in here is waiting for the slowest
        wait = time.perf_counter() - t0
        mine = torch.tensor([data_s, probe, wait, step_s, _memory_gib(self.device)], dtype=torch.float64)
        rows = [torch.zeros(5, dtype=torch.float64) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine, group=group)
        names = ("data_s", "compute_s", "wait_s", "step_s", "mem_gib")
        table = [dict(zip(names, map(float, r.tolist()), strict=True)) for r in rows]
        mean_step = statistics.fmean(r["step_s"] for r in table)
        out = []
        floors = {"data": MIN_DATA_SHARE * mean_step, "compute": MIN_PROBE_EXCESS_S}
        slow_now: dict[tuple[int, str], int] = {}
        for measure, floor in floors.items():
            key = f"{measure}_s"
            values = [r[key] for r in table]
            ref = statistics.median_low(values)
            for rank in find_stragglers(values, factor=self.factor, min_excess=floor):
                slow_now[(rank, measure)] = self._slow_since.get((rank, measure), 0) + 1
                if slow_now[(rank, measure)] >= CONFIRM_CHECKS:
                    host = hosts[rank] if rank < len(hosts) else "?"
                    out.append(Straggler(rank, host, measure, values[rank], ref))
        self._slow_since = slow_now  # a rank back to normal starts over
        return StragglerReport(table, out)
