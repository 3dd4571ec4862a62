"""tools/bench/gpu.py's two readings on a CUDA device: the peak memory of the steps it times (the trainer's
logging resets the allocator's peak after each logged step, hpcdist.metrics.throughput.memory_stats) and the
device's bf16 peak FLOP/s, looked up by the device's name."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest
import torch

from hpcdist.metrics.throughput import gpu_peak_flops, memory_stats, peak_flops
from tests.fakecuda.harness import FakeCuda, install

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench" / "gpu.py"


def _bench() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_bench_reports_the_peak_of_its_steps_not_what_stays_resident(fake_cuda) -> None:
    """A step holds 64 MiB of activations on top of 4 MiB of weights and frees them; the trainer's logging
    (memory_stats, every step here) reads and resets the peak right after the step, as in hpcdist.trainer. The
    bench must report the 68 MiB the steps needed, not the 4 MiB left after the last reset."""
    bench = _bench()
    weights = torch.empty(1 << 20, device="cuda")  # 4 MiB resident
    mib = 1 << 20

    class Strategy:
        def optimizer_step(self, **kw: bool) -> float:
            activations = torch.empty(16 * mib, device="cuda")  # 64 MiB, freed when the step returns
            del activations
            return 0.0

    strategy = Strategy()

    def train() -> None:
        for _ in range(4):
            strategy.optimizer_step(skip_nonfinite=False)
            memory_stats(torch.device("cuda", 0))  # the trainer's logging: reads, then resets the peak

    step_s, peak = bench.timed_run(train, strategy, warmup=1)
    assert step_s >= 0
    assert peak == 68 * mib, f"{peak / mib:.1f} MiB"
    assert torch.cuda.memory_allocated() == weights.numel() * 4


@pytest.mark.parametrize(
    "name, tflops",
    [
        ("NVIDIA H200", 989),
        ("NVIDIA H200 NVL", 835),  # the PCIe card: lower clocks and power than the SXM H200
        ("NVIDIA GH200 480GB", 989),  # Grace Hopper: the SXM H100/H200 compute
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA A10", 125),
    ],
)
def test_the_device_peak_is_looked_up_by_the_devices_full_name(name: str, tflops: int, monkeypatch) -> None:
    assert gpu_peak_flops(name) == tflops * 1e12
    with install(FakeCuda(1, capability=(9, 0), name=name), monkeypatch):  # as the bench asks for it
        assert peak_flops(torch.device("cuda")) == tflops * 1e12
