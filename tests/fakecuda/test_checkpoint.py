"""Checkpoints of CUDA state through the project's own writer and reader, staging included, on fake CUDA tensors:
the bytes written are the tensors' values, a resume into CUDA tensors is exact, and the staging copy keeps to its
rank's device and to a few host buffers."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from hpcdist import checkpoint
from hpcdist.checkpoint import Checkpointable, CheckpointManager
from tests.fakecuda.harness import CudaLike, FakeCuda


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
    assert path is not None and (path / checkpoint.MARKER).exists()
    into_cuda = _zeros_like(saved)
    assert CheckpointManager(tmp_path, rank=0, world_size=1).restore("auto", _state(into_cuda)) == path
    assert all(isinstance(v, CudaLike) for v in into_cuda["model"].values())
    _assert_equal(into_cuda, saved)
    into_cpu = {part: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in d.items()}
                for part, d in _zeros_like(saved).items()}
    CheckpointManager(tmp_path, rank=0, world_size=1).restore("auto", _state(into_cpu))
    _assert_equal(into_cpu, saved)
