"""The resumable, layout-independent global sample order."""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["ResumableSampler", "SamplerMismatch"]


class SamplerMismatch(ValueError):
    """A saved sampler state that is intact but was made for other data (another number of samples or seed): the
    config or the prepared data changed since the checkpoint. A refusal for the caller to explain, never damage.
    ``field``: what differs (``num_samples`` or ``seed``); ``saved`` / ``now``: its two values."""

    def __init__(self, message: str, *, field: str, saved: int, now: int):
        super().__init__(message)
        self.field, self.saved, self.now = field, saved, now


class ResumableSampler:
    """Global sample order: per epoch a permutation from torch.Generator(seed + epoch), or identity.

    `position` counts global samples consumed in the current epoch, independent of how many data-parallel ranks
    split them, so state saved at one dp size resumes exactly at another.

    ``skip(ids)``: sample ids never handed out again (the NaN triage's bad samples, hpcdist.fault.triage). They are
    passed over where the order reaches them and still count in ``position``, so the state stays layout-independent
    and a resume with the same skip set draws exactly the same batches.
    """

    ids_bounded = True
    """Sample ids lie in [0, num_samples) (a blend's are global positions, unbounded)."""

    def __init__(self, num_samples: int, *, seed: int = 0, shuffle: bool = True) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order: torch.Tensor | None = None
        self._order_epoch = -1
        self._skip: frozenset[int] = frozenset()

    @property
    def skipped(self) -> frozenset[int]:
        return self._skip

    def skip(self, ids: frozenset[int] | set[int]) -> None:
        """Never hand out these sample ids from now on (added to those already skipped)."""
        new = self._skip | {int(i) for i in ids}
        bad = [i for i in new if i < 0 or (self.ids_bounded and i >= self.num_samples)]
        if bad:
            raise ValueError(f"sample ids {sorted(bad)[:5]} lie outside [0, {self.num_samples})")
        if self.ids_bounded and len(new) >= self.num_samples:
            raise ValueError(f"all {self.num_samples} samples would be skipped: no data is left to train on")
        self._skip = frozenset(new)

    def _epoch_order(self) -> torch.Tensor:
        if self._order_epoch != self.epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + self.epoch)
                self._order = torch.randperm(self.num_samples, generator=g)
            else:
                self._order = torch.arange(self.num_samples)
            self._order_epoch = self.epoch
        assert self._order is not None
        return self._order

    def next_indices(self, n: int) -> list[int]:
        """The next `n` global sample ids; crosses into the next epoch (new permutation) when needed."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        out: list[int] = []
        while len(out) < n:
            take = min(n - len(out), self.num_samples - self.position)
            chunk = self._epoch_order()[self.position : self.position + take].tolist()
            out.extend([i for i in chunk if i not in self._skip] if self._skip else chunk)
            self.position += take
            # Roll over eagerly so a saved state is canonical: (epoch + 1, 0), never (epoch, num_samples).
            if self.position == self.num_samples:
                self.epoch += 1
                self.position = 0
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume from `state_dict()`; refuses a state saved for another dataset size or seed."""
        missing = {"epoch", "position", "seed", "num_samples"} - set(state)
        if missing:
            raise ValueError(f"sampler state lacks {sorted(missing)}")
        if int(state["num_samples"]) != self.num_samples:
            raise SamplerMismatch(
                f"sampler state is for {state['num_samples']} samples but the dataset has {self.num_samples}: "
                "the data (or seq_len / val_fraction) changed since the checkpoint",
                field="num_samples",
                saved=int(state["num_samples"]),
                now=self.num_samples,
            )
        if int(state["seed"]) != self.seed:
            raise SamplerMismatch(
                f"sampler state has seed {state['seed']} but this run uses seed {self.seed}",
                field="seed",
                saved=int(state["seed"]),
                now=self.seed,
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.num_samples:
            raise ValueError(f"bad sampler state: epoch={epoch}, position={position}, num_samples={self.num_samples}")
        self.epoch, self.position = (epoch + 1, 0) if position == self.num_samples else (epoch, position)
