"""PrefetchLoader: the same batches as BatchLoader, built in a background thread; the state counts only the batches
handed to the trainer, so a resume is exact whatever was prefetched."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from hpcdist.data import BatchLoader, PrefetchLoader, ResumableSampler, SyntheticDataset


def _loader(n: int = 37, batch: int = 6, rank: int = 1, dp: int = 2) -> BatchLoader:
    ds = SyntheticDataset(n, seq_len=5, vocab_size=50, seed=3)
    return BatchLoader(ds, ResumableSampler(n, seed=7), global_batch_size=batch, dp_rank=rank, dp_size=dp)


def test_same_batches_in_the_same_order_across_epochs() -> None:
    plain, pre = _loader(), PrefetchLoader(_loader(), depth=3)
    for _ in range(20):  # 20 x 6 samples > 3 epochs of 37
        a, b = plain.next_batch(), pre.next_batch()
        assert torch.equal(a, b) and a.dtype == b.dtype == torch.int64
        assert pre.last_indices() == plain.last_indices()
        assert pre.state_dict() == plain.state_dict()
    pre.close()


def test_prefetched_batches_are_not_consumed_and_resume_is_exact() -> None:
    pre = PrefetchLoader(_loader(), depth=4)
    seen = [pre.next_batch() for _ in range(3)]
    # let the thread fill its queue: the wrapped sampler runs ahead of what was handed out
    deadline = threading.Event()
    for _ in range(100):
        if pre._queue is not None and pre._queue.full():
            break
        deadline.wait(0.01)
    assert pre.loader.sampler.position != pre.state_dict()["position"]
    state = pre.state_dict()
    assert state == {"epoch": 0, "position": 18, "seed": 7, "num_samples": 37}  # 3 global batches of 6
    pre.close()
    assert pre.loader.state_dict() == state  # rewound to what was consumed

    straight = _loader()
    for want in seen:
        assert torch.equal(straight.next_batch(), want)
    resumed = PrefetchLoader(_loader(), depth=2)
    resumed.load_state_dict(state)
    for _ in range(10):
        assert torch.equal(resumed.next_batch(), straight.next_batch())
    # loading a state mid-stream drops what was prefetched from the old position
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    fresh = _loader()
    fresh.load_state_dict(state)
    assert torch.equal(resumed.next_batch(), fresh.next_batch())
    resumed.close()


def test_a_failing_batch_raises_in_the_training_thread() -> None:
    class Broken(SyntheticDataset):
        def __getitem__(self, i: int) -> np.ndarray:
            raise OSError("shard vanished")

    ds = Broken(12, seq_len=4, vocab_size=9)
    pre = PrefetchLoader(BatchLoader(ds, ResumableSampler(12), global_batch_size=4, dp_rank=0, dp_size=1))
    with pytest.raises(OSError, match="shard vanished"):
        pre.next_batch()
    assert pre._thread is None  # stopped
    with pytest.raises(ValueError, match="depth"):
        PrefetchLoader(_loader(), depth=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_batches_are_pinned_on_cuda() -> None:
    pre = PrefetchLoader(_loader(), device="cuda")
    assert pre.next_batch().is_pinned()
    pre.close()
