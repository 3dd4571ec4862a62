"""Checkpoints of CUDA state through the project's own writer and reader, staging included, on fake CUDA tensors:
the bytes written are the tensors' values, a resume into CUDA tensors is exact, and the staging copy keeps to its
rank's device and to a few host buffers."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

from hpcdist.checkpoint import names as ckpt_names
from hpcdist.checkpoint import staging as ckpt_staging
from hpcdist.checkpoint.manager import CheckpointManager
from hpcdist.checkpoint.state import Checkpointable
from tests.fakecuda.harness import CudaLike, FakeCuda, install


def _state(tensors: dict[str, Any], step: int = 0) -> Checkpointable:
    return Checkpointable(
        dcp_state=lambda: tensors,
        load_dcp_state=lambda s: None,
        trainer_state=lambda: {"step": step},
        load_trainer_state=lambda s: None,
    )


def _cuda_state(seed: int) -> dict[str, Any]:
    """Model and optimizer state as a GPU run holds it: fp32 and bf16 weights, a flat fp32 partition with views of it
    (ZeRO's fragments), AdamW's 0-dim step on the device (fused), a plain number."""
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(3000, generator=g).cuda()
    return {
        "model": {
            "w": torch.randn(64, 32, generator=g).cuda(),
            "h": torch.randn(7, 5, generator=g).to(torch.bfloat16).cuda(),
            "a": flat[:1000].view(10, 100),
            "b": flat[1000:3000],
        },
        "optim": {"step": torch.tensor(float(seed)).cuda(), "m": torch.randn(4096, generator=g).cuda(), "lr": 0.5},
    }


def _zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {
        part: {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0.0 for k, v in d.items()}
        for part, d in state.items()
    }


def _assert_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    for part, d in want.items():
        for k, v in d.items():
            if isinstance(v, torch.Tensor):
                g = got[part][k]
                assert g.dtype == v.dtype and torch.equal(g.cpu(), v.cpu()), (part, k)
            else:
                assert got[part][k] == v, (part, k)


@pytest.mark.parametrize("threads", [1, 2], ids=["one-writer-thread", "two-writer-threads"])
def test_a_synchronous_save_of_cuda_tensors_writes_their_values_and_resumes_exactly(
    fake_cuda: FakeCuda, tmp_path: Path, threads: int
) -> None:
    saved = _cuda_state(1)
    path = CheckpointManager(tmp_path, rank=0, world_size=1, write_threads=threads).save(1, _state(saved, 1))
    assert path is not None and (path / ckpt_names.MARKER).exists()
    into_cuda = _zeros_like(saved)
    assert CheckpointManager(tmp_path, rank=0, world_size=1).restore("auto", _state(into_cuda)) == path
    assert all(isinstance(v, CudaLike) for v in into_cuda["model"].values())
    _assert_equal(into_cuda, saved)
    into_cpu = {
        part: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in d.items()}
        for part, d in _zeros_like(saved).items()
    }
    CheckpointManager(tmp_path, rank=0, world_size=1).restore("auto", _state(into_cpu))
    _assert_equal(into_cpu, saved)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@contextlib.contextmanager
def _rank_on_device_3(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeCuda, ckpt_staging.Staging]]:
    """A rank of an 8-GPU node bound to cuda:3 (an NCCL job: cuda on nccl, the CPU on gloo), with a stager."""
    with install(FakeCuda(8), monkeypatch) as fc:
        fc.nccl_is_fake(monkeypatch)
        dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1)
        stager = ckpt_staging.Staging(threads=3)
        try:
            torch.cuda.set_device(3)
            yield fc, stager
        finally:
            stager.close()
            dist.destroy_process_group()


def _many_tensors(n: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {f"w{i}": torch.randn(4, 3, generator=g).cuda() for i in range(n)},
        "optim": {f"m{i}": torch.randn(5, generator=g).to(torch.bfloat16).cuda() for i in range(n)},
    }


def test_async_staging_holds_one_pinned_host_buffer_per_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """600 tensors staged: two shared-memory buffers (fp32, bf16), pinned, not a file descriptor per tensor (a 13B
    ZeRO-3 shard has over a thousand tensors, past the soft ulimit -n of 1024 a job inherits); values exact."""
    with _rank_on_device_3(monkeypatch) as (fc, stager):
        state = _many_tensors(300)
        fds = _open_fds()
        staged = stager.stage(state)
        assert _open_fds() - fds <= 3, "one shared-memory buffer per dtype, not one per tensor"
        host = [t for part in staged.values() for t in part.values()]
        assert all(t.device.type == "cpu" and fc.is_pinned(t) for t in host)
        assert len({t.untyped_storage().data_ptr() for t in host}) == 2
        _assert_equal(staged, state)
    assert not fc.registered, "the buffers stay pinned after close"


def test_async_staging_of_zero_shards_allocates_nothing_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """ZeRO's ShardedTensors (whose device reads as cpu) staged without a copy on the GPU; a refill is exact."""
    with _rank_on_device_3(monkeypatch) as (fc, stager):
        flat = torch.randn(64 * 8, generator=torch.Generator().manual_seed(1)).cuda()
        # built as hpcdist.parallel.zero builds them: local shards and a gathered layout, no device of its own
        shard = Shard.from_tensor_and_offsets(flat.view(64, 8), [0, 0], 0)
        layout = [ShardMetadata([0, 0], [64, 8], "rank:0/cuda:3")]
        meta = ShardedTensorMetadata(layout, torch.Size([64, 8]), TensorProperties(dtype=torch.float32))
        zero = ShardedTensor._init_from_local_shards_and_global_metadata([shard], meta)
        state = {"zero": {"flat": zero}, "step": 7}
        device_bytes = fc.allocated(3)
        fc.reset_peak(3)
        staged = stager.stage(state)
        assert fc.peak(3) == device_bytes, "the staging copy allocated on the device"
        local = staged["zero"]["flat"].local_shards()[0].tensor
        assert local.device.type == "cpu" and torch.equal(local, flat.view(64, 8).cpu()) and staged["step"] == 7
        flat.add_(1)
        again = stager.stage(state)["zero"]["flat"].local_shards()[0].tensor
        assert again.data_ptr() == local.data_ptr() and torch.equal(again, flat.view(64, 8).cpu())


def test_async_staging_threads_keep_to_the_ranks_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """No staging thread makes another device current: a context on device 0 costs every other rank of the node
    memory (torch.cuda.stream's exit makes current the device that was current at its entry, 0 in a new thread)."""
    with _rank_on_device_3(monkeypatch) as (fc, stager):
        state = _many_tensors(8)
        stager.stage(state)
        stager.stage(state)  # the refill path too
        threads = {n: d for n, d in fc.contexts.items() if n.startswith("hpcdist-stage")}
        assert threads and all(d == {3} for d in threads.values()), dict(fc.contexts)


def test_the_node_local_tier_saves_and_restores_cuda_state(fake_cuda: FakeCuda, tmp_path: Path) -> None:
    """The node-local tier saves synchronously through the same writer: a GPU run's state goes to the node's disk
    and comes back exact, RNG states included."""
    from hpcdist.checkpoint.local.layout import open_local_dir
    from hpcdist.checkpoint.local.tier import LocalTier

    cfg = {"run": {"dir": str(tmp_path / "run"), "seed": 0}, "model": {"dim": 8}, "data": {}, "parallel": {}}

    def holder(w: torch.nn.Linear, step: list[int]) -> Checkpointable:
        return Checkpointable(
            dcp_state=lambda: {"model": w.state_dict()},
            load_dcp_state=lambda d: w.load_state_dict(d["model"]),
            trainer_state=lambda: {"step": step[0], "config": cfg},
            load_trainer_state=lambda s: step.__setitem__(0, s["step"]),
        )

    tier = LocalTier(open_local_dir(tmp_path / "local"), rank=0, world_size=1, hosts=["a"], keep=2)
    saved = torch.nn.Linear(8, 4).to("cuda")
    assert tier.save(2, holder(saved, [2])) and tier.wait()
    fresh, step = torch.nn.Linear(8, 4).to("cuda"), [0]
    assert tier.restore(holder(fresh, step), shared_step=None) is not None and step == [2]
    assert fresh.weight.is_cuda and torch.equal(fresh.weight.cpu(), saved.weight.cpu())
    assert torch.equal(fresh.bias.cpu(), saved.bias.cpu())
