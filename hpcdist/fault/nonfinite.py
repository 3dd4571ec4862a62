"""Non-finite (NaN/Inf) gradient norms: stop before any checkpoint holds that state, or skip the update.

``train.nonfinite: stop`` (default): the first bad step is recorded on the device every step (no sync) and read
where the loop synchronizes anyway (log steps) and before every checkpoint save, so a non-finite model is never
saved and never replaces a finite checkpoint through pruning; the run ends with :class:`NonFiniteError` naming
the step. ``skip``: the strategy drops the update when the global norm is not finite (one sync per step), the
skips are counted, and more than ``train.max_nonfinite_skips`` in a row stop the run the same way.

The skip decision is agreed by a one-element MAX all-reduce (Strategy._update): the norm is global over stages and
shards, but DDP's is each replica's own, and one replica going bad alone must not skip alone. With
``train.nonfinite_triage`` the skipped step is re-run to tell bad data from bad hardware (hpcdist.fault.triage).
"""

from __future__ import annotations

import torch

from hpcdist.base.logging_utils import get_logger

__all__ = ["NonFiniteError", "NonFiniteGuard"]

log = get_logger(__name__)

# fp16: loss-scaler overflows in a row after which the run stops: from torch's initial scale 2**16, 30 halvings reach
# 2**-14, fp16's smallest normal number: no scale makes such a loss representable
MAX_OVERFLOWS_IN_A_ROW = 30


class NonFiniteError(RuntimeError):
    """Training produced a non-finite gradient norm and stopped without saving that state."""

    failure_kind = "nonfinite"  # failures.jsonl: a numeric failure blames no host (the NaN triage's hardware does)


class NonFiniteGuard:
    def __init__(self, *, mode: str, max_skips: int, device: torch.device, last_checkpoint: str | None = None):
        self.mode, self.max_skips = mode, max_skips
        self.skipped_total, self.skipped_in_a_row = 0, 0
        self.overflows_total, self.overflows_in_a_row = 0, 0  # fp16 loss-scaler skips (this process)
        self.last_checkpoint = last_checkpoint
        self._first_bad = torch.zeros((), dtype=torch.int64, device=device)  # 0 = none yet (steps start at 1)

    def after_step(self, step: int, grad_norm: torch.Tensor, *, skipped: bool, overflow: bool = False) -> None:
        """Every step, after the optimizer step (``skipped``: the strategy dropped this update; ``overflow``: fp16's
        loss scaler found inf/NaN gradients, skipped the update and halved the scale)."""
        if overflow:
            self._overflow(step, grad_norm)
            return
        self.overflows_in_a_row = 0
        if self.mode == "skip":
            if skipped:
                self.skipped_total += 1
                self.skipped_in_a_row += 1
                log.warning(
                    "step %d: non-finite gradient norm (%s); update skipped (%d in a row, %d in all)",
                    step,
                    float(grad_norm),
                    self.skipped_in_a_row,
                    self.skipped_total,
                )
                if self.skipped_in_a_row > self.max_skips:
                    raise NonFiniteError(
                        self._message(
                            step,
                            f"{self.skipped_in_a_row} updates in a row were "
                            "non-finite and skipped (train.max_nonfinite_skips="
                            f"{self.max_skips})",
                        )
                    )
            else:
                self.skipped_in_a_row = 0
            return
        bad = ~torch.isfinite(grad_norm.detach().to(self._first_bad.device))
        self._first_bad = torch.where(
            bad & (self._first_bad == 0), torch.full_like(self._first_bad, step), self._first_bad
        )

    def _overflow(self, step: int, grad_norm: torch.Tensor) -> None:
        """Ordinary in fp16 training (a few per thousand steps); only a long run of them means the loss or the
        gradients are non-finite at any scale: then stop as train.nonfinite would."""
        self.overflows_total += 1
        self.overflows_in_a_row += 1
        log.info(
            "step %d: fp16 gradient overflow (norm %s): update skipped by the loss scaler (%d since start)",
            step,
            float(grad_norm),
            self.overflows_total,
        )
        if self.overflows_in_a_row > MAX_OVERFLOWS_IN_A_ROW:
            raise NonFiniteError(
                f"step {step}: {self.overflows_in_a_row} fp16 steps in a row overflowed (the loss scale halved "
                "each time): the loss or the gradients are non-finite at any scale; look for bad data or a too "
                "high optim.lr, or train with train.dtype=bf16 / fp32"
            )

    def check(self) -> None:
        """Where the loop syncs anyway (log steps) and before every save: raise if a step went bad."""
        first = int(self._first_bad.item()) if self.mode == "stop" else 0
        if first:
            raise NonFiniteError(self._message(first, "the gradient norm was NaN/Inf"))

    def check_params(self, step: int, finite: bool) -> None:
        """Before a save: ``finite`` from Strategy.params_finite (an update with a finite norm can still overflow
        the weights, e.g. a huge learning rate; a skipped update leaves them as they were)."""
        if not finite:
            raise NonFiniteError(self._message(step, "the model's parameters are NaN/Inf"))

    def _message(self, step: int, what: str) -> str:
        since = f"the last checkpoint, {self.last_checkpoint}, is finite" if self.last_checkpoint else "none saved"
        return (
            f"step {step}: {what}; training stopped before any checkpoint of that state was written ({since}). "
            "Lower optim.lr, set optim.grad_clip, check the data, or set train.nonfinite=skip"
        )
