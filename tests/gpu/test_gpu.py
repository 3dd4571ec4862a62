"""One GPU: bf16 training under each strategy that fits one device, DCP with CUDA tensors (sync and async),
the CUDA paths of the metrics, and nccl_check's device health and NCCL version lookup."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hpcdist.config import JobConfig
from hpcdist.env import destroy_process_group, from_environ, init_process_group
from hpcdist.rundir import RunDir
from hpcdist.trainer import Trainer
from tests.dist.harness import free_port

GPU_SMALL = (
    "train.dtype=bf16",
    "logging.peak_flops=null",
    "logging.every_steps=1",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "checkpoint.save_final=false",
)


def _one_gpu(fn, *args):
    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        TORCHELASTIC_RUN_ID="gpu",
    )
    env = from_environ(cuda_available=True)
    assert env.device.startswith("cuda")
    init_process_group(env, timeout_s=300)
    try:
        return fn(env, *args)
    finally:
        destroy_process_group()


def _train(env, cfg: JobConfig, until: int | None = None) -> dict:
    trainer = Trainer(cfg, env)
    result = trainer.train(until=until)
    return {"losses": result.losses, "step": result.step, "scaler": trainer.strategy.scaler_state()}


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in RunDir(run_dir).metrics.read_text().splitlines()]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero"])
def test_bf16_training_on_one_gpu(small_cfg, tmp_path: Path, strategy: str) -> None:
    """Each strategy trains in bf16 on one GPU: the loss falls, memory and MFU (vs the bf16 peak) are reported."""
    cfg = small_cfg(*GPU_SMALL, "train.steps=20", f"parallel.strategy={strategy}", run_dir=tmp_path)
    out = _one_gpu(_train, cfg)
    losses = [out["losses"][s] for s in sorted(out["losses"])]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    last = _metrics(tmp_path)[-1]
    assert last["mem_alloc_gib"] > 0 and 0 < last["mem_pct"] <= 100
    assert 0 < last["mfu"] < 1  # against the device's bf16 peak (hpcdist.metrics.throughput.GPU_PEAK_FLOPS)


@pytest.mark.parametrize("async_save", [False, True])
def test_exact_resume_with_cuda_checkpoints(small_cfg, tmp_path: Path, async_save: bool) -> None:
    """DCP writes the CUDA tensors (sync and async) and reads them back: the resumed run's losses match an
    uninterrupted one (to bf16 round-off: GPU kernels may reorder reductions between runs)."""
    over = (*GPU_SMALL, "train.steps=6", "checkpoint.every_steps=3", f"checkpoint.async_save={str(async_save).lower()}")
    straight = _one_gpu(_train, small_cfg(*over, run_dir=tmp_path / "a"))
    cfg = small_cfg(*over, run_dir=tmp_path / "b")
    _one_gpu(_train, cfg, 3)
    resumed = _one_gpu(_train, cfg)
    ref = [straight["losses"][s] for s in (4, 5, 6)]
    torch.testing.assert_close([resumed["losses"][s] for s in (4, 5, 6)], ref, rtol=2e-2, atol=0)


def test_dcp_round_trip_of_cuda_tensors(tmp_path: Path) -> None:
    state = {"w": torch.randn(64, 32, device="cuda"), "b": torch.arange(7, device="cuda", dtype=torch.bfloat16)}
    dcp.save(state, checkpoint_id=str(tmp_path / "sync"))
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(dest, checkpoint_id=str(tmp_path / "sync"))
    assert all(dest[k].is_cuda and torch.equal(dest[k], state[k]) for k in state)
    dcp.async_save(state, checkpoint_id=str(tmp_path / "async")).result()
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(dest, checkpoint_id=str(tmp_path / "async"))
    assert all(torch.equal(dest[k], state[k]) for k in state)


def test_cuda_metrics() -> None:
    from hpcdist.metrics.throughput import gpu_peak_flops, memory_stats, peak_flops

    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    stats = memory_stats("cuda")
    assert stats["mem_alloc_gib"] >= 64 / 1024 and stats["mem_reserved_gib"] >= stats["mem_alloc_gib"]
    del x
    name = torch.cuda.get_device_name(0)
    table = gpu_peak_flops(name)
    peak = peak_flops(torch.device("cuda"))
    assert peak > 1e12  # the table's bf16 peak, or measured when the device is not in it
    if table is not None:
        assert peak == table


def test_nccl_check_device_health_and_nccl_version() -> None:
    from hpcdist.diagnostics.audit import _nccl_version
    from hpcdist.diagnostics.health import device_health

    health = device_health("cuda:0")
    assert health["ok"], health
    assert health["name"] == torch.cuda.get_device_name(0) and health["max_rel_err"] < 1e-2
    version = _nccl_version()
    assert version is not None and version[0].isdigit(), version


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero"])
def test_fp16_loss_scaling_on_one_gpu(small_cfg, tmp_path: Path, strategy: str) -> None:
    """train.dtype=fp16 trains on a GPU under each strategy (zero: DeepSpeed's fp16 mode, which has no CPU form),
    the loss falls, the scaler's skips and scale are in the metrics, and a resume continues the loss curve with the
    loss scaler exactly where the straight run's is (zero: DeepSpeed's scale, step counter, last overflow and
    hysteresis, which restarted at 2**16 and step 0 before they were saved)."""
    over = (
        *GPU_SMALL,
        "train.dtype=fp16",
        "train.steps=12",
        "checkpoint.every_steps=6",
        f"parallel.strategy={strategy}",
    )
    straight = _one_gpu(_train, small_cfg(*over, run_dir=tmp_path / "a"))
    losses = [straight["losses"][s] for s in sorted(straight["losses"])]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    last = _metrics(tmp_path / "a")[-1]
    assert last["scaler_skips"] >= 0 and last["loss_scale"] > 0
    cfg = small_cfg(*over, run_dir=tmp_path / "b")
    _one_gpu(_train, cfg, 6)
    resumed = _one_gpu(_train, cfg)
    ref = [straight["losses"][s] for s in range(7, 13)]
    torch.testing.assert_close([resumed["losses"][s] for s in range(7, 13)], ref, rtol=2e-2, atol=0)
    assert resumed["scaler"] == straight["scaler"]


def test_comm_hook_timing_is_gpu_time_under_nccl() -> None:
    """A DDP bucket's communication under NCCL is timed on the GPU: a hook whose all-reduce waits behind a known
    stretch of GPU work reads at least that long (the host's clock would read the enqueueing, about 0)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from hpcdist.parallel.comm_hooks import CommMeter, timed

    torch.cuda.set_device(0)
    cycles = 50_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    sleep_s = start.elapsed_time(end) / 1e3

    def slow_allreduce(state, bucket):  # the collective is queued behind the sleep on the hook's stream
        torch.cuda._sleep(cycles)
        return default_hooks.allreduce_hook(state, bucket)

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        meter = CommMeter(dist.group.WORLD)
        hook = timed(slow_allreduce, meter)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64).cuda(), device_ids=[0])
        model.register_comm_hook(None, lambda state, bucket: hook(dist.group.WORLD, bucket))
        t0 = time.perf_counter()
        model(torch.randn(8, 64, device="cuda")).sum().backward()
        host_s = time.perf_counter() - t0
        torch.cuda.synchronize()
        _, busy = meter.take()
    finally:
        dist.destroy_process_group()
    print(f"comm busy {busy * 1e3:.2f} ms, GPU sleep {sleep_s * 1e3:.2f} ms, host backward {host_s * 1e3:.2f} ms")
    assert busy >= 0.9 * sleep_s > 0
