"""Data parallelism with torch DDP: every rank holds the whole model; gradients are all-reduced in buckets."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hpcdist.parallel.base import Strategy


def apply_ddp(model: nn.Module, *, device: torch.device, bucket_cap_mb: int) -> nn.Module:
    """Wrap a materialized model in DDP (no-op without a multi-rank process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return model
    return DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
        # every parameter gets a gradient each step; skipping the unused-parameter search saves a graph walk
        find_unused_parameters=False,
        gradient_as_bucket_view=True,
    )


class DDPStrategy(Strategy):
    def __init__(self, model: nn.Module, *, bucket_cap_mb: int, **kwargs: Any):
        super().__init__(**kwargs)
        self.module = model
        self.model = apply_ddp(model, device=self.device, bucket_cap_mb=bucket_cap_mb)

    def _sync_context(self, is_last: bool) -> contextlib.AbstractContextManager[Any]:
        # gradient accumulation: all-reduce only on the last micro-batch of the step
        if isinstance(self.model, DDP) and not is_last:
            return self.model.no_sync()
        return contextlib.nullcontext()
