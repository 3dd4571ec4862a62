"""NaN triage on 2 ddp ranks (issue 30.3): every rank reaches the same verdict and leaves the triage together.
Data: a bad sample on rank 1's slice is named (each row re-run alone) and skipped by both ranks. Hardware: a one-off
NaN in rank 1's gradients after the reduce (its replica alone is bad, rank 0's norm is finite) blames rank 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpcdist.config import JobConfig
from hpcdist.data import make_sampler
from hpcdist.data.build import build_datasets
from hpcdist.env import DistEnv
from hpcdist.fault.failures import read_failures
from hpcdist.fault.triage import HardwareFault
from hpcdist.trainer import Trainer
from tests.dist.harness import run_ranks
from tests.unit.test_triage import TRIAGE, _poison

pytestmark = pytest.mark.dist


def _both(env: DistEnv, data_cfg: JobConfig, hw_cfg: JobConfig, tokens: torch.Tensor) -> tuple[int, int, str]:
    trainer = Trainer(data_cfg, env)
    _poison(trainer, tokens)
    step = trainer.train().step
    skipped = trainer.nonfinite.skipped_total

    trainer = Trainer(hw_cfg, env)
    real, calls = trainer.strategy.forward_backward, []

    def flaky(batch: torch.Tensor) -> torch.Tensor:
        loss = real(batch)
        calls.append(1)
        if env.rank == 1 and len(calls) == 2:  # step 2, after DDP's reduce: only this replica goes bad
            grad = next(p for p in trainer.strategy.module.parameters() if p.grad is not None).grad
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("nan")  # fsdp: own shard
        return loss

    trainer.strategy.forward_backward = flaky
    try:
        trainer.train()
        stopped = ""
    except HardwareFault as e:
        stopped = str(e)
    return step, skipped, stopped


def test_two_ranks_agree_on_data_and_on_hardware(small_cfg, tmp_path: Path) -> None:
    data_cfg = small_cfg(
        *TRIAGE, "train.steps=3", "train.nonfinite=skip", "train.micro_batch_size=2", run_dir=tmp_path / "data"
    )
    hw_cfg = small_cfg(*TRIAGE, "train.steps=3", "train.micro_batch_size=2", run_dir=tmp_path / "hw")
    train_ds, _ = build_datasets(data_cfg, is_main=True)
    sampler = make_sampler(train_ds, seed=data_cfg.run.seed, shuffle=data_cfg.data.shuffle)
    sampler.next_indices(4)
    bad = sampler.next_indices(4)[3]  # step 2, rank 1's second row
    tokens = torch.from_numpy(train_ds[bad][:-1])

    results = run_ranks(2, _both, data_cfg, hw_cfg, tokens, timeout=120)
    assert [r[:2] for r in results] == [(3, 1), (3, 1)]  # both ranks skipped the one step and went on
    assert json.loads((tmp_path / "data" / "skipped_samples.json").read_text())["ids"] == [bad]  # narrowed to it
    assert all(r[2].startswith("step 2: ") and "hardware (rank 1 on " in r[2] for r in results), results
    records = [r for r in read_failures(tmp_path / "hw") if r["kind"] == "hardware"]
    assert len(records) == 1 and [b["rank"] for b in records[0]["blame"]] == [1]
