"""Throughput, MFU and memory of a training step (the numbers the log line and metrics.jsonl carry).

MFU (model FLOPs utilisation) = achieved model FLOP/s per device / peak FLOP/s per device. The peak is the
dense bf16 tensor-core number from the datasheet on known GPUs, a measured matmul rate on CPU (so local
runs report a meaningful ratio instead of ~0%), or the ``peak_flops`` value from the YAML, which wins.
"""

from __future__ import annotations

import logging
import math
import re
import sys
import time
from collections import deque

import torch

__all__ = [
    "GPU_PEAK_FLOPS",
    "Throughput",
    "gpu_peak_flops",
    "measure_cpu_peak_flops",
    "memory_stats",
    "mfu",
    "peak_flops",
    "peak_is_measured",
    "remeasure_peak_flops",
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
    "H200 NVL": 835e12,  # the PCIe card ("NVIDIA H200 NVL"): the H100 NVL's clocks and power
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


def peak_is_measured(device: torch.device | str, *, configured: float | None = None) -> bool:
    """True when :func:`peak_flops` measures the peak (a CPU, an unknown GPU) instead of taking a stated one."""
    device = torch.device(device)
    if configured is not None:
        return False
    return device.type == "cpu" or (
        device.type == "cuda" and gpu_peak_flops(torch.cuda.get_device_name(device)) is None
    )


def remeasure_peak_flops(device: torch.device | str) -> float:
    """Measure a measured peak again and keep the higher one: a peak taken once, while other work loaded the machine,
    is too low for the rest of the run (MFU above 100% when the load went away)."""
    device = torch.device(device)
    key = f"cuda:{torch.cuda.get_device_name(device)}" if device.type == "cuda" else f"cpu:{torch.get_num_threads()}"
    old = _measured_peaks.pop(key, 0.0)
    _measured_peaks[key] = max(old, peak_flops(device))
    return _measured_peaks[key]


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
        self._total_tokens, self._total_s = 0, 0.0

    def update(self, tokens: int, seconds: float) -> None:
        """Record one optimizer step: global tokens (all ranks) and its wall time."""
        if tokens < 0 or not seconds >= 0:
            raise ValueError(f"tokens and seconds must be >= 0, got tokens={tokens}, seconds={seconds}")
        self._steps.append((tokens, seconds))
        self._total_tokens += tokens
        self._total_s += seconds

    @property
    def run_tokens_per_s(self) -> float:
        """Job-wide tokens/s over every step recorded (this process's part of the run): the end-of-run number."""
        return self._total_tokens / self._total_s if self._total_s > 0 else 0.0

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
