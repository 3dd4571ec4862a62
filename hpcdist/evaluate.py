"""Periodic evaluation on the validation split: when it is due and what it computes.

The same first ``train.eval_batches`` global batches every time (no shuffle, a fresh sampler per call), so the
values of one run are comparable step to step and a resumed run evaluates exactly what an uninterrupted one would.
"""

from __future__ import annotations

from typing import Any

import torch

from hpcdist.data import BatchLoader, ResumableSampler
from hpcdist.parallel.base import Strategy

__all__ = ["Evaluator"]


class Evaluator:
    """``due(step)`` every ``every_steps`` (0, or no validation split: never); ``loss(strategy)`` the mean loss over
    the first ``batches`` global batches. Collective: every rank calls both at the same steps."""

    def __init__(
        self,
        dataset: Any,
        *,
        every_steps: int,
        batches: int,
        global_batch_size: int,
        seed: int,
        dp_rank: int,
        dp_size: int,
    ) -> None:
        self.dataset, self.every_steps, self.batches = dataset, every_steps, batches
        self.global_batch_size, self.seed, self.dp_rank, self.dp_size = global_batch_size, seed, dp_rank, dp_size

    def due(self, step: int) -> bool:
        return (
            self.dataset is not None and len(self.dataset) > 0 and self.every_steps > 0 and step % self.every_steps == 0
        )

    def loss(self, strategy: Strategy) -> float:
        sampler = ResumableSampler(len(self.dataset), seed=self.seed, shuffle=False)
        loader = BatchLoader(
            self.dataset,
            sampler,
            global_batch_size=self.global_batch_size,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
        )
        losses = [strategy.eval_loss(loader.next_batch()) for _ in range(self.batches)]
        return float(torch.stack(losses).mean())
