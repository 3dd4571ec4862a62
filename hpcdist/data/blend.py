"""Blends: prepared datasets mixed by weight, with the same global-position, layout-independent, resumable sampling.

Global sample ``g`` (the sampler's position, counted over all data-parallel ranks) maps to a source and a sample of
it without any state, so every rank and every layout computes the same mapping, and a resume at another dp size
continues it exactly::

    g --(block of B slots: source k has n_k = round(B * w_k) of them, spread evenly)--> source k, its j-th draw
    j --(source k's own epochs: a permutation of its samples per epoch, seeded by (seed, k, epoch))--> sample i

So each source is read in its own epochs (every sample once per epoch), in the weights' proportion (exact per block
up to rounding of B * w_k), whatever the other sources' sizes; a small source simply cycles through more epochs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hpcdist.data.sampler import ResumableSampler
from hpcdist.data.shards import SampleDataset

__all__ = ["BlendSampler", "BlendedDataset", "make_sampler"]

BLOCK = 1000  # slots per schedule block: proportions are exact to 1 / BLOCK per block
_SOURCE_STRIDE = 1_000_003  # separates the sources' permutation seeds


def _apportion(weights: Sequence[float], block: int) -> list[int]:
    """Slots per source in one block: largest-remainder rounding of block * share, at least one each."""
    total = float(sum(weights))
    exact = [block * w / total for w in weights]
    counts = [max(1, int(e)) for e in exact]
    order = sorted(range(len(weights)), key=lambda k: exact[k] - int(exact[k]), reverse=True)
    for k in order[: max(0, block - sum(counts))]:
        counts[k] += 1
    return counts


def _schedule(counts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(source of each slot, its draw number within the block), the sources spread evenly over the block: slot o
    goes to the source furthest behind its share (ties: the lowest index), a deterministic smooth interleaving."""
    block = sum(counts)
    taken = np.zeros(len(counts), dtype=np.int64)
    share = np.asarray(counts, dtype=np.float64) / block
    source = np.empty(block, dtype=np.int64)
    draw = np.empty(block, dtype=np.int64)
    for o in range(block):
        k = int(np.argmax(share * (o + 1) - taken))
        source[o], draw[o] = k, taken[k]
        taken[k] += 1
    return source, draw


class BlendedDataset:
    """Samples of several datasets mixed by weight; ``blend[g]`` is defined for every global position g >= 0.

    ``len()`` is the sum of the sources' lengths: one nominal epoch, which is what the sampler counts in."""

    def __init__(
        self, datasets: Sequence[SampleDataset], weights: Sequence[float], *, seed: int = 0, shuffle: bool = True
    ) -> None:
        problems = []
        if not datasets or len(datasets) != len(weights):
            problems.append(f"need one weight per dataset and at least one: {len(datasets)} datasets, {len(weights)}")
        if any(not w > 0 for w in weights):
            problems.append(f"weights must be > 0, got {list(weights)}")
        if any(len(d) < 1 for d in datasets):
            problems.append("every dataset needs at least one sample")
        if problems:
            raise ValueError("BlendedDataset: " + "; ".join(problems))
        self.datasets = list(datasets)
        self.weights = [float(w) for w in weights]
        self.seed, self.shuffle = seed, shuffle
        self.counts = _apportion(self.weights, BLOCK)
        self.block = sum(self.counts)
        self._source, self._draw = _schedule(self.counts)
        self._sizes = [len(d) for d in self.datasets]
        self._perms: dict[int, tuple[int, torch.Tensor]] = {}  # source -> (epoch, its permutation)

    def __len__(self) -> int:
        return sum(self._sizes)

    def locate(self, g: int) -> tuple[int, int]:
        """(source, sample of that source) read at global position g."""
        if g < 0:
            raise IndexError(f"global sample position must be >= 0, got {g}")
        b, o = divmod(int(g), self.block)
        k = int(self._source[o])
        epoch, pos = divmod(b * self.counts[k] + int(self._draw[o]), self._sizes[k])
        if not self.shuffle:
            return k, pos
        cached = self._perms.get(k)
        if cached is None or cached[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed + _SOURCE_STRIDE * (k + 1) + epoch)
            cached = (epoch, torch.randperm(self._sizes[k], generator=gen))
            self._perms[k] = cached
        return k, int(cached[1][pos])

    def where(self, g: int) -> str:
        """Where global position g's sample lives, for messages (the NaN triage names a bad sample)."""
        k, i = self.locate(g)
        inner = getattr(self.datasets[k], "where", None)
        return f"source {k}, " + (inner(i) if inner else f"sample {i}")

    def __getitem__(self, g: int) -> np.ndarray:
        k, i = self.locate(g)
        return self.datasets[k][i]

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_perms": {}}


class BlendSampler(ResumableSampler):
    """Consecutive global positions (epoch * len + position): the blend does the shuffling, per source, so the
    position only counts. Same state and resume rules as :class:`ResumableSampler`."""

    ids_bounded = False  # a sample id is a global position, epoch * len + position

    def __init__(self, num_samples: int, *, seed: int = 0) -> None:
        super().__init__(num_samples, seed=seed, shuffle=False)

    def _epoch_order(self) -> torch.Tensor:
        start = self.epoch * self.num_samples
        return torch.arange(start, start + self.num_samples)


def make_sampler(dataset: SampleDataset, *, seed: int, shuffle: bool) -> ResumableSampler:
    """The sampler a dataset needs: a blend counts positions, anything else is permuted per epoch."""
    if isinstance(dataset, BlendedDataset):
        return BlendSampler(len(dataset), seed=seed)
    return ResumableSampler(len(dataset), seed=seed, shuffle=shuffle)
