"""The prefetch loader on a GPU rank: its batches are pinned (the strategy's non-blocking copy is then asynchronous)
and its thread works on the rank's device, never on device 0."""

from __future__ import annotations

import dataclasses

import torch

from hpcdist.env import from_environ
from hpcdist.trainer import Trainer
from tests.fakecuda.harness import FakeCuda


def test_the_trainer_prefetches_pinned_batches_on_its_gpu(small_cfg, fake_cuda: FakeCuda) -> None:
    env = dataclasses.replace(from_environ({}), device="cuda:3")  # one process bound to GPU 3
    torch.cuda.set_device(3)
    trainer = Trainer(small_cfg("data.prefetch=2"), env)
    try:
        batch = trainer.loader.next_batch()
        assert batch.device.type == "cpu" and batch.is_pinned()
        on_device = trainer.strategy.model.tok_embeddings.weight.new_empty(0)  # any tensor of the rank's device
        assert on_device.device == torch.device("cuda", 3)
        assert batch.to(on_device.device, non_blocking=True).device == torch.device("cuda", 3)
    finally:
        trainer.loader.close()
        trainer.run_lock.release()
    assert fake_cuda.contexts["hpcdist-prefetch"] == {3}, dict(fake_cuda.contexts)  # the thread's device: the rank's
    assert fake_cuda.devices_used() == {3}
