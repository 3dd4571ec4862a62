"""The strategy seam: what the train loop calls, whatever the parallelism underneath.

Each strategy (DDPStrategy for pure replication, MeshStrategy for every sharded ParallelDims layout: FSDP2, HSDP,
TP, pipelines; ZeroStrategy for DeepSpeed) is built whole: its constructor receives the wrapped model's pieces and
the optimizer builder, and returns with ``optimizer`` and ``scheduler`` set. It implements, once:

* the step: ``forward_backward(batch)``, ``optimizer_step(skip_nonfinite=)`` (and ``last_step_skipped``),
  ``global_mean(t)`` for the logged loss, ``eval_loss(batch)`` (hpcdist.evaluate), ``grad_accum``, ``device``,
  ``lr``;
* the checkpoint: ``dcp_state`` / ``load_dcp_state``, ``rank_state`` / ``load_rank_state``, ``scheduler_state``
  / ``load_scheduler_state``, and ``params_finite()`` before each save;
* what the loop measures: ``comm_stats()`` (DDP's comm hook), and for the replica check (hpcdist.parallel.replicas)
  ``has_replicas()`` / ``replica_group()``; ``model_state_bytes()`` (tools/bench/memory.py).

``optimizer`` / ``scheduler`` are read by hpcdist.optim's hyper-parameter functions on resume, ``module`` (the
unwrapped model) by tests and the checkpoint's FQNs. Adding a strategy never touches the loop.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict

from hpcdist.optim import OptimizerBuilder


def _overflow_injection() -> frozenset[int]:
    """Test-only (never on real jobs): HPCDIST_TEST_FP16_OVERFLOW_AT=2,5 sets one gradient to inf before the loss
    scaler unscales at this process's 2nd and 5th optimizer step, as an fp16 overflow would."""
    raw = os.environ.get("HPCDIST_TEST_FP16_OVERFLOW_AT", "")
    return frozenset(int(x) for x in raw.split(",") if x.strip().isdigit())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's local shard


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # logits (b, s, vocab) -> fp32 loss: bf16 logits lose too much precision in log-softmax
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class Strategy:
    """A torch-native strategy: gradient accumulation over micro-batches, clipping, AdamW step, DCP state.

    Subclasses set ``model`` (what forward is called on), ``module`` (the unwrapped model whose FQNs name the
    checkpoint entries), call ``_attach_optimizer`` before their constructor returns, and override
    ``_sync_context`` to skip gradient sync on non-final micro-batches.
    """

    model: nn.Module
    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler

    def __init__(
        self,
        *,
        device: torch.device,
        grad_accum: int,
        micro_batch_size: int,
        grad_clip: float,
        autocast_dtype: torch.dtype | None,
        dp_group: dist.ProcessGroup | None,
        build_optimizer: OptimizerBuilder,
        grad_scaler: Any = None,
    ):
        self.device, self.grad_accum, self.micro_batch_size = device, grad_accum, micro_batch_size
        self.grad_clip, self.autocast_dtype, self.dp_group = grad_clip, autocast_dtype, dp_group
        self._build_optimizer = build_optimizer
        self._params: list[torch.Tensor] | None = None
        self.last_step_skipped = False  # the last optimizer_step dropped a non-finite update
        self.last_local_grads_finite = True  # when it did: this rank's gradients were finite (hpcdist.fault.triage)
        # train.dtype=fp16: torch's (sharded) GradScaler (hpcdist.parallel.parallelize.grad_scaler); None otherwise
        self.scaler = grad_scaler
        self.last_step_overflow = False  # the scaler found inf/NaN gradients and skipped the last update
        self.overflow_steps = 0  # such steps in the whole run (resumed from the checkpoint)
        self._unscale_calls = 0
        self._inject_overflow = _overflow_injection()

    def _attach_optimizer(self, module: nn.Module) -> None:
        """Build the optimizer and LR schedule over ``module`` (the wrapped model, or what DeepSpeed will wrap);
        every subclass calls it once in its constructor, so a Strategy is never seen without them."""
        self.optimizer, self.scheduler = self._build_optimizer(module)

    # ------------------------------------------------------------------------------------------ train
    def _sync_context(self, is_last: bool) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _micro_batches(self, batch: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # (n, seq + 1) tokens -> (inputs, targets) pairs of micro_batch_size rows, targets shifted by one
        batch = batch.to(self.device, non_blocking=True)
        for mb in batch.split(self.micro_batch_size):
            yield mb[:, :-1], mb[:, 1:]

    def forward_backward(self, batch: torch.Tensor) -> torch.Tensor:
        """All micro-batches of this rank's share of one global batch. Returns this rank's mean loss (detached);
        ``global_mean`` turns it into the job's loss (done only on log steps: it is a blocking collective)."""
        if not self.model.training:
            self.model.train()
        total = torch.zeros((), device=self.device)
        for i, (inputs, targets) in enumerate(self._micro_batches(batch)):
            with self._sync_context(i == self.grad_accum - 1), self._autocast():
                loss = cross_entropy(self.model(inputs), targets) / self.grad_accum
            self._backward(loss)
            total += loss.detach()
        return total

    def _backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def _unscale(self) -> None:
        """fp16: divide the gradients by the loss scale before the norm and the clip (they see true gradients)."""
        if self.scaler is None:
            return
        self._unscale_calls += 1
        if self._unscale_calls in self._inject_overflow:  # test hook: one scaled gradient overflows
            grad = next(p.grad for p in self.model.parameters() if p.grad is not None)
            _local(grad).fill_(float("inf"))
        self.scaler.unscale_(self.optimizer)

    def optimizer_step(self, *, skip_nonfinite: bool = False) -> torch.Tensor:
        """Clip, step, advance the LR schedule, zero grads. Returns the pre-clip global gradient norm.

        ``skip_nonfinite``: when that norm is NaN/Inf on any rank, drop the update (grads zeroed, optimizer and LR
        schedule untouched) and set ``last_step_skipped``; costs one device sync and a one-element all-reduce, so
        every rank decides alike even where the norm is a replica's own (DDP)."""
        if self._params is None:  # built once: the parameter set never changes after wrapping
            self._params = [p for p in self.model.parameters() if p.requires_grad]
        self._unscale()
        # clip_grad_norm_ is these two calls; split so a skipped step can look at its gradients before clipping
        # (a NaN norm makes the clip coefficient NaN, which would spread to every gradient)
        norm = torch.nn.utils.get_total_norm([p.grad for p in self._params if p.grad is not None], foreach=True)
        norm = norm.detach().full_tensor() if hasattr(norm, "full_tensor") else norm.detach()
        self._update(norm, skip_nonfinite)
        return norm

    def _update(self, norm: torch.Tensor, skip_nonfinite: bool) -> None:
        """Clip with the global ``norm``, step the optimizer and the LR schedule, zero the gradients; a skipped step
        (``skip_nonfinite`` and a NaN/Inf norm) touches neither the parameters nor the optimizer or LR state: that is
        what lets the NaN triage re-run the step from the state before it (hpcdist.fault.triage)."""
        assert self._params is not None
        self.last_step_skipped = False
        if self.scaler is not None:
            self._scaler_update(norm)
            return
        if skip_nonfinite:
            # agreed by every rank: DDP's norm is each replica's own, and a replica that went bad after the reduce
            # (a bit flip) would otherwise skip alone: replicas diverge, and the NaN triage hangs in its re-run
            bad = (~torch.isfinite(norm)).to(torch.int32)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            self.last_step_skipped = bool(bad)
        if self.last_step_skipped:
            # this rank's own evidence, for the triage's blame (after the gradient reduce: DDP spreads a NaN)
            self.last_local_grads_finite = all(
                bool(torch.isfinite(_local(p.grad)).all()) for p in self._params if p.grad is not None
            )
        else:
            if self.grad_clip > 0:
                torch.nn.utils.clip_grads_with_norm_(self._params, self.grad_clip, norm, foreach=True)
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _scaler_update(self, norm: torch.Tensor) -> None:
        """fp16: inf/NaN gradients are an overflow of the loss scale, not a bad step: the scaler skips the update
        (optimizer and LR schedule untouched, as train.nonfinite=skip would) and halves the scale; otherwise clip,
        step, and the scale grows after its growth interval. Every rank finds the same (GradScaler: the reduced
        gradients; ShardedGradScaler: an all-reduced verdict)."""
        assert self.scaler is not None and self._params is not None
        found = self.scaler._found_inf_per_device(self.optimizer)  # what scaler.step decides on, synced once here
        self.last_step_overflow = bool(sum(float(v.item()) for v in found.values()))
        if not self.last_step_overflow:
            if self.grad_clip > 0:
                torch.nn.utils.clip_grads_with_norm_(self._params, self.grad_clip, norm, foreach=True)
            # the gradients are unscaled already and the verdict is known: scaler.step would only repeat both, and
            # hands the fused AdamW ShardedGradScaler's (1,)-shaped found_inf, which it refuses ("output with
            # shape [] doesn't match the broadcast shape [1]", torch 2.13)
            self.optimizer.step()
            self.scheduler.step()
        self.scaler.update()  # from the verdict unscale_ recorded
        self.overflow_steps += self.last_step_overflow
        self.optimizer.zero_grad(set_to_none=True)

    def scaler_state(self) -> dict[str, Any] | None:
        """fp16: the loss scale, the clean steps towards its next growth and the overflow count (the checkpoint's
        trainer_state.json); None without a scaler."""
        if self.scaler is None:
            return None
        return {
            "scale": float(self.scaler.get_scale()),
            "growth_tracker": int(self.scaler._get_growth_tracker()),
            "overflow_steps": self.overflow_steps,
        }

    def loss_scale(self) -> float | None:
        """fp16: the current loss scale (a device sync: log steps only); None without a scaler."""
        return float(self.scaler.get_scale()) if self.scaler is not None else None

    def load_scaler_state(self, state: dict[str, Any]) -> None:
        """``state``: from a checkpoint's trainer_state.json (another user's file): validated before use."""
        if self.scaler is None:
            return
        scale, tracker, skips = state.get("scale"), state.get("growth_tracker"), state.get("overflow_steps")
        if tracker is None and "iter" in state:
            # DeepSpeed's scaler saved it (a zero fp16 checkpoint, hpcdist.parallel.zero.loss_scaler_state): its
            # clean-step count is not torch's growth tracker, so the scale carries over and the interval starts afresh
            tracker = 0
        if not (isinstance(scale, float) and 0 < scale < float("inf")):
            raise ValueError(f"grad_scaler.scale must be a positive finite number, got {scale!r}")
        for key, v in (("growth_tracker", tracker), ("overflow_steps", skips)):
            if not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**62):
                raise ValueError(f"grad_scaler.{key} must be a non-negative integer, got {v!r}")
        self.scaler.load_state_dict({**self.scaler.state_dict(), "scale": scale, "_growth_tracker": tracker})
        self.overflow_steps = skips

    @torch.no_grad()
    def sample_losses(self, batch: torch.Tensor) -> torch.Tensor | None:
        """Each row's loss, one row at a time, for the NaN triage to name the bad sample; None where a strategy cannot
        (a pipeline). Called by every rank alike: here through this rank's whole model (no collective), sharded
        strategies run their forward in lock step."""
        losses = []
        for row in batch.to(self.device):
            with self._autocast():
                losses.append(cross_entropy(self.module(row[None, :-1]), row[None, 1:]).float())
        return torch.stack(losses)

    @torch.no_grad()
    def eval_loss(self, batch: torch.Tensor) -> torch.Tensor:
        self.model.eval()
        total = torch.zeros((), device=self.device)
        n = 0
        for inputs, targets in self._micro_batches(batch):
            with self._autocast():
                total += cross_entropy(self.model(inputs), targets)
            n += 1
        return self.global_mean(total / max(n, 1))

    def global_mean(self, t: torch.Tensor) -> torch.Tensor:
        """Mean of a per-rank scalar over the data-parallel ranks (collective: every dp rank calls it)."""
        if dist.is_initialized() and dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.dp_group)
            t /= dist.get_world_size(self.dp_group)
        return t

    # ------------------------------------------------------------------------------------------ replicas
    def replica_group(self) -> dist.ProcessGroup | None:
        """The ranks that must hold bitwise-identical local parameters (None = all ranks). Data parallel: all."""
        return None

    def has_replicas(self) -> bool:
        return dist.is_initialized() and dist.get_world_size(self.replica_group()) > 1

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------------------------------------ memory
    def local_params(self) -> list[torch.Tensor]:
        """This rank's own part of every parameter (a DTensor's local shard)."""
        return [_local(p) for p in self.module.parameters()]

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds for parameters, gradients and optimizer state (local shards only)."""
        params = self.local_params()
        grads = [_local(p.grad) for p in self.module.parameters() if p.grad is not None]
        optim = [_local(v) for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        return {"params": params, "grads": grads, "optimizer": optim}

    def params_finite(self) -> bool:
        """Collective: no parameter shard on any rank holds a NaN/Inf. One pass over the local shards and a
        one-element all-reduce; run before every checkpoint save, so a non-finite model is never saved."""
        bad = torch.zeros((), device=self.device)
        for t in self.local_params():
            if t.numel():
                bad = torch.maximum(bad, (~torch.isfinite(t.detach())).any().to(bad.dtype))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bool(bad)

    def model_state_bytes(self) -> dict[str, int]:
        """Measured bytes per category, each storage counted once (views such as DDP's gradient buckets and
        DeepSpeed's flat buffers share one), in the first category that holds it."""
        seen: set[int] = set()
        out: dict[str, int] = {}
        for category, tensors in self.model_state_tensors().items():
            total = 0
            for t in tensors:
                storage = t.untyped_storage()
                if t.device.type != "meta" and storage.data_ptr() not in seen and storage.nbytes():
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
            out[category] = total
        return out

    # ------------------------------------------------------------------------------------------ communication
    def comm_stats(self) -> tuple[int, float] | None:
        """(bytes sent, seconds in flight) by the gradient communication hook since the last call; None without
        one (only DDP with parallel.ddp.comm_hook has one)."""
        return None

    # ------------------------------------------------------------------------------------------ checkpoint
    def rank_state(self) -> dict[str, Any]:
        """This rank's own state that no other rank holds (PowerSGD's error feedback): plain tensors and numbers,
        saved in a per-rank file of the checkpoint. Empty: nothing to save."""
        return {}

    def load_rank_state(self, state: dict[str, Any]) -> None:
        """Restore what ``rank_state`` returned on this rank (an empty dict: none was saved for it)."""

    def dcp_state(self) -> dict[str, Any]:
        """Model + optimizer state keyed by the unwrapped model's FQNs (DDP/AC/compile prefixes stripped), so a
        checkpoint loads into any strategy and world size."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_dcp_state(self, state: dict[str, Any]) -> None:
        if "optim" not in state:  # weights-only checkpoint (a ZeRO run's portable part): moments start at zero
            set_model_state_dict(self.model, state["model"])
            return
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def scheduler_state(self) -> dict[str, Any]:
        return {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"}

    def load_scheduler_state(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict({**self.scheduler.state_dict(), **state})
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True):
            group["lr"] = lr
