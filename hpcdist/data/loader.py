"""This data-parallel rank's slice of each global batch, built in the training thread or prefetched in another."""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from hpcdist.data.sampler import ResumableSampler
from hpcdist.data.shards import SampleDataset

__all__ = ["BatchLoader", "PrefetchLoader"]


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

    def close(self) -> None:
        """Nothing to release (PrefetchLoader's counterpart stops its thread)."""

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.sampler.load_state_dict(state)


class PrefetchLoader:
    """A :class:`BatchLoader` whose next `depth` batches are built in a background thread (bounded queue).

    Building a batch (gathering windows from memory-mapped shards, ``np.stack``, pinning) then overlaps the previous
    step's compute instead of adding to it. For a CUDA ``device`` the batches are pinned so the strategy's
    ``batch.to(device, non_blocking=True)`` is an asynchronous copy (from pageable memory it is a synchronous one),
    and the thread makes ``device`` its current device first, as torch's DataLoader does in its pinning thread: a new
    thread starts on device 0, where a rank bound to another GPU has no business. The thread draws exactly the
    batches the wrapped loader would, in the same order, so the losses are bitwise those without prefetching.

    Exact resume: each queued batch carries the sampler state *after* it, and :meth:`state_dict` is the state after
    the last batch handed to the trainer: batches prefetched but not yet trained on are not counted as consumed, and a
    resumed run reads them again.
    """

    def __init__(self, loader: BatchLoader, *, depth: int = 2, device: torch.device | str = "cpu") -> None:
        """``device``: where the strategy copies each batch (the rank's device); batches are pinned for CUDA."""
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self.loader = loader
        self.depth = depth
        self.device = torch.device(device)
        self.pin_memory = self.device.type == "cuda"
        self._state = loader.state_dict()  # after the last batch handed out
        self._last: list[int] = []
        self._queue: queue.Queue[tuple[Any, ...]] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def local_batch_size(self) -> int:
        return self.loader.local_batch_size

    def _produce(self, q: queue.Queue[tuple[Any, ...]], stop: threading.Event) -> None:
        def put(item: tuple[Any, ...]) -> bool:
            while not stop.is_set():  # a bounded put that still notices close()
                try:
                    q.put(item, timeout=0.05)
                    return True
                except queue.Full:
                    continue
            return False

        try:
            if self.pin_memory:
                torch.cuda.set_device(self.device)
            while not stop.is_set():
                batch = self.loader.next_batch()
                if self.pin_memory:
                    batch = batch.pin_memory()
                if not put(("batch", batch, self.loader.last_indices(), self.loader.state_dict())):
                    return
        except BaseException as e:  # handed to the training thread, which raises it
            put(("error", e))

    def _start(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.depth)
        self._thread = threading.Thread(
            target=self._produce, args=(self._queue, self._stop), name="hpcdist-prefetch", daemon=True
        )
        self._thread.start()

    def next_batch(self) -> torch.Tensor:
        """The next batch, as BatchLoader.next_batch (pinned on CUDA)."""
        if self._thread is None:
            self._start()
        assert self._queue is not None
        item = self._queue.get()
        if item[0] == "error":
            self.close()
            raise item[1]
        _, batch, self._last, self._state = item
        return batch

    def last_indices(self) -> list[int]:
        return list(self._last)

    def state_dict(self) -> dict[str, int]:
        return dict(self._state)

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.close()
        self.loader.load_state_dict(state)
        self._state = self.loader.state_dict()

    def close(self) -> None:
        """Stop the thread and drop the prefetched batches; the wrapped loader is rewound to the consumed state."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = self._queue = None
        self.loader.load_state_dict(self._state)
