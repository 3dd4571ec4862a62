"""DeepSpeed ZeRO on fake CUDA tensors: the engine DeepSpeed builds around hpcdist's optimizer, on the device hpcdist
chose, and a resume whose optimizer state sits where torch's fused AdamW kernel reads it.

DeepSpeed picks its accelerator once, from the real runtime (the CPU here); each test hands it DeepSpeed's own CUDA
accelerator while the fake runtime is installed. Stages 1 and 2 run; stage 3's partitioner allocates inside c10d's
C++ barrier, which no fake tensor reaches. Gradients are given by hand (no autograd under the harness) and the
optimizer DeepSpeed wraps is stepped directly: the fused kernel is what reads every state tensor as a device
pointer.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from hpcdist.config.schema import OptimConfig
from hpcdist.env import from_environ
from hpcdist.optim import optimizer_builder
from hpcdist.parallel.zero import ZeroStrategy, deepspeed_config, import_deepspeed
from tests.fakecuda.harness import FakeCuda, install


@pytest.fixture(scope="module", autouse=True)
def _deepspeed_chose_on_the_real_runtime() -> Iterator[None]:
    """DeepSpeed picks its accelerator when it is first imported and keeps it for the process. Imported first under
    the fake runtime it would pick CUDA, and every later DeepSpeed user in this worker (the dist tier's ZeRO ranks
    are forked from it) would call into a CUDA runtime that is not there; imported here, before any test installs the
    fake, it picks the real runtime's device (the CPU on a CPU-only torch), and each test hands it the CUDA
    accelerator only while the fake is installed."""
    from deepspeed.accelerator import get_accelerator

    import_deepspeed()
    chosen = get_accelerator().device_name()
    assert chosen == ("cuda" if torch.cuda.is_available() else "cpu"), chosen  # the real runtime's device
    yield
    assert get_accelerator().device_name() == chosen, "the module left DeepSpeed on another accelerator"


@contextlib.contextmanager
def _deepspeed_on(
    fc: FakeCuda, monkeypatch: pytest.MonkeyPatch, *, rank: int, world: int, backend: str = "nccl"
) -> Iterator[None]:
    """DeepSpeed's CUDA accelerator and a ``rank``-of-``world`` NCCL-only group (torch's fake one: no peers)."""
    import deepspeed.accelerator.real_accelerator as real_accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
    from deepspeed.utils import groups

    monkeypatch.setattr(real_accelerator, "ds_accelerator", CUDA_Accelerator())
    # DeepSpeed caches the groups it derives from the default group in module globals: fresh for this group
    for name, value in list(vars(groups).items()):
        if re.fullmatch(r"_[A-Z_]+", name) and (value is None or isinstance(value, dict)):
            monkeypatch.setattr(groups, name, None if value is None else {})
    fc.nccl_is_fake(monkeypatch)
    dist.init_process_group(backend, store=dist.HashStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _zero(stage: int, device: torch.device, *, world: int = 1, seed: int = 0) -> ZeroStrategy:
    """A ZeRO strategy over a two-layer model built on ``device`` (bf16: DeepSpeed's fp32 master partitions)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)).to(device)
    ds = deepspeed_config(
        stage=stage,
        micro_batch_size=1,
        grad_accum=1,
        dp_size=world,
        grad_clip=1.0,
        bf16=True,
        offload_optimizer=False,
        offload_params=False,
        overlap_comm=False,
        buckets=(1 << 20, 1 << 20),
    )
    return ZeroStrategy(
        model,
        stage=stage,
        ds_config=ds,
        device=device,
        grad_accum=1,
        micro_batch_size=1,
        grad_clip=1.0,
        autocast_dtype=None,
        dp_group=None,
        build_optimizer=optimizer_builder(OptimConfig(), total_steps=10),
    )


def _adamw_step(s: ZeroStrategy, scale: float) -> None:
    """One step of the torch AdamW DeepSpeed wraps, on its flat fp32 partitions, with given gradients."""
    for group in s.optimizer.param_groups:
        for flat in group["params"]:
            flat.grad = torch.linspace(-scale, scale, flat.numel(), device=flat.device)
    s.optimizer.step()


def _placement(s: ZeroStrategy) -> list[dict[str, Any]]:
    return [{k: (v.device, v.dtype) for k, v in st.items()} for st in s.optimizer.state.values()]


@pytest.mark.parametrize("stage", [1, 2])
def test_a_zero_resume_keeps_adamws_state_where_the_fused_kernel_reads_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, stage: int
) -> None:
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    device = torch.device("cuda", 0)
    # DCP's object collectives take gloo, as hpcdist's checkpoint groups do; DeepSpeed's CUDA tensors take NCCL
    with (
        install(FakeCuda(1), monkeypatch) as fc,
        _deepspeed_on(fc, monkeypatch, rank=0, world=1, backend="cpu:gloo,cuda:nccl"),
    ):
        straight = _zero(stage, device)
        assert all(g["fused"] for g in straight.optimizer.param_groups)  # hpcdist's AdamW on CUDA parameters
        _adamw_step(straight, 0.1)
        dcp.save(straight.dcp_state(), checkpoint_id=tmp_path / "ckpt")

        resumed = _zero(stage, device, seed=1)  # other weights: the checkpoint must replace them all
        state = resumed.dcp_state()
        dcp.load(state, checkpoint_id=tmp_path / "ckpt")
        resumed.load_dcp_state(state)
        # where torch keeps AdamW's state of a fused optimizer: every tensor, step included, on the parameter's
        # device (torch's Optimizer.load_state_dict, and AdamW's own first step, put it there)
        assert _placement(resumed) == _placement(straight)
        for flat, st in resumed.optimizer.state.items():
            assert {v.device for v in st.values()} == {flat.device} == {device}, _placement(resumed)
        # the next step (fused: it reads step as a device pointer) continues the uninterrupted run exactly
        _adamw_step(straight, 0.2)
        _adamw_step(resumed, 0.2)
        for a, b in zip(straight.optimizer.param_groups, resumed.optimizer.param_groups, strict=True):
            for p, q in zip(a["params"], b["params"], strict=True):
                assert torch.equal(p.cpu(), q.cpu())
        steps = [float(st["step"].cpu()) for st in resumed.optimizer.state.values()]
        assert steps == [2.0] * len(resumed.optimizer.state)


@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_uses_the_one_gpu_a_task_sees(monkeypatch: pytest.MonkeyPatch, stage: int) -> None:
    # srun --gpus-per-task=1: local rank 3 of a 4-task node sees only its own GPU, as cuda:0
    environ = {
        "TORCHELASTIC_RUN_ID": "none",
        "RANK": "3",
        "LOCAL_RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("HPCDIST_EXPORTED", raising=False)
    with install(FakeCuda(1), monkeypatch) as fc, _deepspeed_on(fc, monkeypatch, rank=3, world=4):
        env = from_environ()
        assert (env.local_rank, env.torch_device()) == (3, torch.device("cuda", 0))
        s = _zero(stage, env.torch_device(), world=4)
        assert s.engine.device == torch.device("cuda", 0)
        assert fc.devices_used() == {0}
        assert {p.device for g in s.optimizer.param_groups for p in g["params"]} == {torch.device("cuda", 0)}
        # what ZeRO-3's partitioner and trace checks allocate on (stage 3 itself does not run on fake tensors)
        from deepspeed.accelerator import get_accelerator

        assert get_accelerator().device_name(os.environ["LOCAL_RANK"]) == "cuda:0"
        # the launcher's local rank keeps its meaning for hpcdist and every other reader
        assert os.environ["LOCAL_RANK"] == "3" and from_environ().local_rank == 3
