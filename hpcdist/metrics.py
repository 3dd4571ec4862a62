"""Training metrics: throughput, MFU, memory, and their sinks (metrics.jsonl + TensorBoard).

MFU (model FLOPs utilisation) = achieved model FLOP/s per device / peak FLOP/s per device. The peak is the
dense bf16 tensor-core number from the datasheet on known GPUs, a measured matmul rate on CPU (so local
runs report a meaningful ratio instead of ~0%), or the ``peak_flops`` value from the YAML, which wins.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import torch

from hpcdist.atomic import open_append
from hpcdist.rundir import RunDir

__all__ = [
    "GPU_PEAK_FLOPS",
    "MetricsLogger",
    "Throughput",
    "format_eta",
    "format_line",
    "gpu_peak_flops",
    "measure_cpu_peak_flops",
    "memory_stats",
    "mfu",
    "peak_flops",
]

logger = logging.getLogger("hpcdist.metrics")

_GIB = float(2**30)

# Dense (no 2:4 sparsity) bf16 tensor-core peaks from NVIDIA datasheets, keyed by a substring of
# torch.cuda.get_device_name(). Variants with different clocks get their own, longer key
# ("H100 PCIe" vs the SXM "H100"); gpu_peak_flops tries longer keys first.
GPU_PEAK_FLOPS: dict[str, float] = {
    "A100": 312e12,  # SXM and PCIe share the bf16 peak
    "H100": 989e12,  # SXM5 ("NVIDIA H100 80GB HBM3")
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H200": 989e12,  # same compute as H100 SXM, more and faster memory; also matches "GH200"
    "A10G": 125e12,  # AWS variant of the A10, same datasheet tensor peak
    "A10": 125e12,
    "L40S": 362e12,
    "V100": 125e12,  # no bf16: fp16 tensor-core peak (SXM2)
}


def gpu_peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s for a CUDA device name (case-insensitive substring match), None if unknown.

    A key must end at a non-alphanumeric character or at the end of the name, so "A10" does not claim an
    "A100" and "A100" does not claim an "RTX A1000".
    """
    name = device_name.lower()
    for key in sorted(GPU_PEAK_FLOPS, key=len, reverse=True):
        if re.search(re.escape(key.lower()) + r"(?![0-9a-z])", name):
            return GPU_PEAK_FLOPS[key]
    return None


def _measure_matmul_flops(device: torch.device, *, n: int, repeats: int, dtype: torch.dtype) -> float:
    """Best-of-``repeats`` FLOP/s of an n x n x n matmul on ``device`` (2 n^3 FLOPs per product)."""
    if n < 1 or repeats < 1:
        raise ValueError(f"n and repeats must be >= 1, got n={n}, repeats={repeats}")

    def sync() -> None:
        # CUDA kernels are asynchronous: without a sync the timer measures the launch, not the matmul.
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    out = torch.empty(n, n, dtype=dtype, device=device)
    torch.mm(a, b, out=out)  # warm-up: thread pool start, BLAS/cuBLAS kernel selection
    sync()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        sync()
        best = min(best, time.perf_counter() - t0)
    # The best run is the closest to what the hardware can do; the others include noise from neighbours.
    return 2.0 * n**3 / max(best, 1e-9)


def measure_cpu_peak_flops(*, n: int = 2048, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """Best-of-repeats n x n x n matmul FLOP/s on CPU with the current torch thread count (the CPU "peak")."""
    return _measure_matmul_flops(torch.device("cpu"), n=n, repeats=repeats, dtype=dtype)


# Measuring takes ~1 s; once per process per (device, thread count) is enough.
_measured_peaks: dict[str, float] = {}


def peak_flops(device: torch.device | str, *, configured: float | None = None) -> float:
    """Peak FLOP/s of one device for MFU: ``configured`` if given, else datasheet (GPU) or measured (CPU)."""
    if configured is not None:
        if not configured > 0:
            raise ValueError(f"configured peak_flops must be > 0, got {configured}")
        return float(configured)

    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        known = gpu_peak_flops(name)
        if known is not None:
            return known
        key = f"cuda:{name}"
        if key not in _measured_peaks:
            logger.warning(
                "unknown GPU %r: measuring a bf16 matmul for the MFU peak; set peak_flops in the config "
                "to the datasheet dense bf16 value for a comparable MFU",
                name,
            )
            _measured_peaks[key] = _measure_matmul_flops(device, n=8192, repeats=5, dtype=torch.bfloat16)
        return _measured_peaks[key]
    if device.type == "cpu":
        key = f"cpu:{torch.get_num_threads()}"
        if key not in _measured_peaks:
            _measured_peaks[key] = measure_cpu_peak_flops()
        return _measured_peaks[key]
    raise ValueError(f"no peak FLOP/s known for device type {device.type!r}; set peak_flops in the config")


def mfu(tokens_per_s_per_device: float, flops_per_token: float, peak_flops_per_device: float) -> float:
    """Model FLOPs utilisation as a fraction (0.41 = 41%)."""
    if not peak_flops_per_device > 0:
        raise ValueError(f"peak_flops_per_device must be > 0, got {peak_flops_per_device}")
    return tokens_per_s_per_device * flops_per_token / peak_flops_per_device


class Throughput:
    """Tokens/s over the last ``window`` optimizer steps, for the whole job and per device.

    A window (not a running mean since start) so the first steps' compile and warm-up time wash out, and
    a sum-of-tokens / sum-of-seconds ratio (not a mean of per-step rates) so slow steps weigh what they cost.
    """

    def __init__(self, world_size: int, window: int = 20) -> None:
        if world_size < 1 or window < 1:
            raise ValueError(f"world_size and window must be >= 1, got world_size={world_size}, window={window}")
        self.world_size = world_size
        self.window = window
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)

    def update(self, tokens: int, seconds: float) -> None:
        """Record one optimizer step: global tokens (all ranks) and its wall time."""
        if tokens < 0 or not seconds >= 0:
            raise ValueError(f"tokens and seconds must be >= 0, got tokens={tokens}, seconds={seconds}")
        self._steps.append((tokens, seconds))

    @property
    def tokens_per_s(self) -> float:
        """Job-wide tokens/s over the window; 0.0 before the first step."""
        seconds = sum(s for _, s in self._steps)
        return sum(t for t, _ in self._steps) / seconds if seconds > 0 else 0.0

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens_per_s / self.world_size

    @property
    def step_time(self) -> float:
        """Mean seconds per step over the window; 0.0 before the first step."""
        return sum(s for _, s in self._steps) / len(self._steps) if self._steps else 0.0


def _rss_gib() -> float:
    """Current resident set size; peak RSS where /proc is missing (macOS)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024 / _GIB  # reported in kB
    except OSError:
        pass
    import resource  # not on Windows; only reached where /proc is missing

    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is kilobytes on Linux but bytes on macOS.
    return maxrss / _GIB if sys.platform == "darwin" else maxrss * 1024 / _GIB


def memory_stats(device: torch.device | str) -> dict[str, float]:
    """Memory since the previous call: peak allocated/reserved GiB and % of total on CUDA, RSS GiB on CPU.

    CUDA peaks are reset after reading, so each call reports the peak of its own logging interval.
    """
    device = torch.device(device)
    if device.type == "cuda":
        reserved = torch.cuda.max_memory_reserved(device)
        stats = {
            "mem_alloc_gib": torch.cuda.max_memory_allocated(device) / _GIB,
            "mem_reserved_gib": reserved / _GIB,
            "mem_pct": reserved / torch.cuda.get_device_properties(device).total_memory * 100.0,
        }
        torch.cuda.reset_peak_memory_stats(device)
        return stats
    if device.type == "cpu":
        return {"mem_rss_gib": _rss_gib()}
    return {}


def format_eta(seconds: float) -> str:
    """Compact duration: "1h02m", "3m05s", "12s"; "?" when unknown (NaN or infinite)."""
    if not math.isfinite(seconds):
        return "?"
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def format_line(step: int, total_steps: int, m: Mapping[str, float]) -> str:
    """One compact log line from whichever of the known metrics are present; missing ones are left out.

    "step 120/200 | loss 2.3456 | lr 2.95e-04 | gnorm 0.87 | tps 12,345 | mfu 41.2% | mem 1.2GiB | eta 3m05s"
    """
    parts = [f"step {step}/{total_steps}"]
    if "loss" in m:
        parts.append(f"loss {m['loss']:.4f}")
    if "lr" in m:
        parts.append(f"lr {m['lr']:.2e}")
    if "grad_norm" in m:
        parts.append(f"gnorm {m['grad_norm']:.3g}")
    if "tokens_per_s" in m:
        # torchtitan's convention: integer tokens/s with thousands separators; per device when the job has several
        tps = f"tps {m['tokens_per_s']:,.0f}"
        per_dev = m.get("tokens_per_s_per_device")
        if per_dev is not None and round(per_dev) != round(m["tokens_per_s"]):
            tps += f" ({per_dev:,.0f}/dev)"
        parts.append(tps)
    if "mfu" in m:
        parts.append(f"mfu {m['mfu'] * 100:.1f}%")
    # Reserved is what decides an OOM on GPU; RSS is the only number on CPU.
    for key in ("mem_reserved_gib", "mem_alloc_gib", "mem_rss_gib"):
        if key in m:
            mem = f"mem {m[key]:.1f}GiB"
            if "mem_pct" in m:
                mem += f" ({m['mem_pct']:.0f}%)"
            parts.append(mem)
            break
    if "eta_s" in m:
        parts.append(f"eta {format_eta(m['eta_s'])}")
    return " | ".join(parts)


def _plain(value: Any) -> Any:
    """Tensors and numpy scalars to Python numbers; anything else unchanged."""
    return value.item() if hasattr(value, "item") and callable(value.item) else value


def _json_value(value: Any) -> Any:
    """NaN/inf to None (null): json.dumps would write the bare token NaN, which strict JSON readers reject."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


class MetricsLogger:
    """Writes metrics.jsonl and TensorBoard scalars on rank 0; a no-op everywhere else.

    Every rank builds one (``enabled=(rank == 0)``) so the trainer calls it unconditionally. metrics.jsonl
    is opened in append mode: a resumed (requeued) run continues the same file, and steps re-run after the
    last checkpoint appear twice; readers keep the last line per step. Pass ``purge_step`` (the step the
    run resumes from) and TensorBoard hides the earlier run's events at or after it, so re-run steps are
    not drawn twice.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        tensorboard: bool = True,
        purge_step: int | None = None,
        every_steps: int = 1,
        trackers: Any = None,
    ) -> None:
        """``trackers``: a hpcdist.trackers.Trackers (W&B / MLflow) that gets every logged line too."""
        self.enabled, self.every_steps = enabled, max(1, every_steps)
        self._trackers = trackers
        self.path = RunDir(run_dir).metrics
        self._file: IO[str] | None = None
        self._tb: Any = None  # torch.utils.tensorboard.SummaryWriter, imported lazily (~1.5 s, rank 0 only)
        if not enabled:
            return
        # never through a link, never into a FIFO or another user's file (hpcdist.atomic.open_append)
        self._file = os.fdopen(open_append(self.path), "a", encoding="utf-8")  # lives until close()
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # tensorboard missing: keep the JSONL record, say why TB is absent
                logger.warning("TensorBoard disabled: %s", e)
            else:
                # flush_secs=30: a killed job loses at most 30 s of TB scalars (metrics.jsonl loses none).
                self._tb = SummaryWriter(log_dir=str(RunDir(run_dir).tensorboard), flush_secs=30, purge_step=purge_step)

    def due(self, step: int, *, last: int) -> bool:
        """A training line at every ``every_steps`` steps, at step 1 (where the loss starts) and at ``last``. Every
        rank answers alike: logging all-reduces the loss."""
        return step % self.every_steps == 0 or step in (1, last)

    def log(self, step: int, metrics: Mapping[str, float], *, prefix: str = "train") -> None:
        """Append one JSON line and the TB scalars ``{prefix}/{key}`` for ``step``."""
        if self._file is None:
            # Disabled (rank != 0) or closed: silently nothing, so all ranks behave alike and none raises
            # where the others would go on into a collective and hang.
            return
        record: dict[str, Any] = {"step": step, "time": time.time()}
        if prefix != "train":
            record["split"] = prefix
        values = {key: _plain(value) for key, value in metrics.items()}
        record.update((key, _json_value(value)) for key, value in values.items())
        # allow_nan=False guarantees the line is strict JSON (NaN was already mapped to null above).
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        # Flush to the OS per line so a killed (preempted, OOM) job keeps every metric it logged; no fsync,
        # which would cost a round trip per step on a network file system.
        self._file.flush()
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):  # TB draws NaN as a gap
                    self._tb.add_scalar(f"{prefix}/{key}", value, step)
        if self._trackers is not None:
            self._trackers.log(step, values, prefix)

    def close(self) -> None:
        """Flush and close both sinks; safe to call more than once."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()  # close() flushes
            self._tb = None
        if self._trackers is not None:
            self._trackers.close()
            self._trackers = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
