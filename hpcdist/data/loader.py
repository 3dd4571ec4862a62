"""This data-parallel rank's slice of each global batch."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from hpcdist.data.sampler import ResumableSampler
from hpcdist.data.shards import SampleDataset

__all__ = ["BatchLoader"]


class BatchLoader:
    """This data-parallel rank's contiguous slice of each global batch drawn from a ResumableSampler.

    Every rank draws the whole global batch from its own sampler copy (cheap: ids only) and loads only its
    slice, so all ranks stay in lock step without communication and the state is the same on every rank.
    """

    def __init__(
        self,
        dataset: SampleDataset,
        sampler: ResumableSampler,
        *,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
    ) -> None:
        problems = []
        if dp_size < 1:
            problems.append(f"dp_size must be >= 1, got {dp_size}")
        elif not 0 <= dp_rank < dp_size:
            problems.append(f"dp_rank must lie in [0, {dp_size}), got {dp_rank}")
        if global_batch_size < 1:
            problems.append(f"global_batch_size must be >= 1, got {global_batch_size}")
        elif dp_size >= 1 and global_batch_size % dp_size:
            problems.append(
                f"global_batch_size={global_batch_size} is not divisible by dp_size={dp_size}; "
                "pick a multiple of the data-parallel size"
            )
        if sampler.num_samples != len(dataset):
            problems.append(f"sampler covers {sampler.num_samples} samples but the dataset has {len(dataset)}")
        if problems:
            raise ValueError("BatchLoader: " + "; ".join(problems))
        self.dataset = dataset
        self.sampler = sampler
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.local_batch_size = global_batch_size // dp_size
        self._last: list[int] = []

    def next_batch(self) -> torch.Tensor:
        """(global_batch_size // dp_size, seq_len + 1) int64 CPU tensor for this rank."""
        ids = self.sampler.next_indices(self.global_batch_size)
        lo = self.dp_rank * self.local_batch_size
        self._last = ids[lo : lo + self.local_batch_size]
        return torch.from_numpy(np.stack([self.dataset[i] for i in self._last]))

    def last_indices(self) -> list[int]:
        """Global sample ids of this rank's most recent batch."""
        return list(self._last)

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.sampler.load_state_dict(state)
