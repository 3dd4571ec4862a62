"""Data parallelism with torch DDP: every rank holds the whole model; gradients are all-reduced in buckets."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hpcdist.parallel.base import Strategy
from hpcdist.parallel.comm_hooks import CommHook, register


def apply_ddp(
    model: nn.Module,
    *,
    device: torch.device,
    bucket_cap_mb: int,
    comm_hook: CommHook | None = None,
    warmup_input: torch.Tensor | None = None,
) -> nn.Module:
    """Wrap a materialized model in DDP (no-op without a multi-rank process group); ``comm_hook``: a gradient
    communication hook (``warmup_input``: one batch of token ids for PowerSGD's bucket-layout warm-up)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return model
    ddp = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
        # every parameter gets a gradient each step; skipping the unused-parameter search saves a graph walk
        find_unused_parameters=False,
        gradient_as_bucket_view=True,
    )
    if comm_hook is not None:
        assert warmup_input is not None
        register(ddp, comm_hook, warmup_input.to(device))
    return ddp


class DDPStrategy(Strategy):
    def __init__(
        self,
        model: nn.Module,
        *,
        bucket_cap_mb: int,
        comm_hook: str = "none",
        powersgd: dict[str, Any] | None = None,
        seq_len: int = 8,
        **kwargs: Any,
    ):
        """``comm_hook``: parallel.ddp.comm_hook; ``powersgd``: its settings; ``seq_len``: tokens per sample (the
        PowerSGD warm-up batch)."""
        super().__init__(**kwargs)
        self.module = model
        replicas = dist.is_initialized() and dist.get_world_size() > 1
        self.comm_hook = CommHook(comm_hook, powersgd=powersgd) if replicas and comm_hook != "none" else None
        self.model = apply_ddp(
            model,
            device=self.device,
            bucket_cap_mb=bucket_cap_mb,
            comm_hook=self.comm_hook,
            warmup_input=torch.zeros(1, seq_len, dtype=torch.long),
        )
        self._attach_optimizer(self.model)

    def forward_backward(self, batch: torch.Tensor) -> torch.Tensor:
        if self.comm_hook is None:
            return super().forward_backward(batch)
        with self.comm_hook.counting():  # the hook's bytes are counted during this backward, and only then
            return super().forward_backward(batch)

    def comm_stats(self) -> tuple[int, float] | None:
        return self.comm_hook.meter.take() if self.comm_hook is not None else None

    def rank_state(self) -> dict[str, Any]:
        return {"comm_hook": self.comm_hook.state_dict()} if self.comm_hook is not None else {}

    def load_rank_state(self, state: dict[str, Any]) -> None:
        if self.comm_hook is not None:
            self.comm_hook.load_state_dict(state.get("comm_hook", {}), self.device)

    def _sync_context(self, is_last: bool) -> contextlib.AbstractContextManager[Any]:
        # gradient accumulation: all-reduce only on the last micro-batch of the step
        if isinstance(self.model, DDP) and not is_last:
            return self.model.no_sync()
        return contextlib.nullcontext()
