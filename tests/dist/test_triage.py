"""NaN triage on 2 ddp ranks: every rank reaches the same verdict and leaves the triage together.
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
from hpcdist.fault.triage import HardwareFault, SkippedSamples
from hpcdist.trainer import Trainer
from tests.dist.harness import run_ranks
from tests.training import TRIAGE, poison, train

pytestmark = pytest.mark.dist


def _both(env: DistEnv, data_cfg: JobConfig, hw_cfg: JobConfig, tokens: torch.Tensor) -> tuple[int, int, str]:
    data = train(
        env,
        data_cfg,
        before=lambda trainer: poison(trainer, tokens),
        after=lambda trainer, _: {"skipped": trainer.nonfinite.skipped_total},
    )

    def flaky_hardware(trainer: Trainer) -> None:
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
        train(env, hw_cfg, before=flaky_hardware)
        stopped = ""
    except HardwareFault as e:
        stopped = str(e)
    return data["step"], data["skipped"], stopped


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


@pytest.mark.parametrize("mode", ["skip", "stop"])
def test_a_diverging_model_is_the_models_verdict_and_skips_no_sample(small_cfg, caplog, mode: str) -> None:
    """optim.lr=1e4: after the first update every sample's loss is non-finite, the same on every re-run. That is
    the model's state, not the data: no sample is named or skipped, the run stops saying so (train.nonfinite=skip
    too), and the run dir keeps no list of skipped samples for a later run to apply."""
    import logging

    from hpcdist.fault.nonfinite import NonFiniteError
    from tests.dist.harness import single

    cfg = small_cfg(*TRIAGE, "train.steps=4", f"train.nonfinite={mode}", "optim.lr=1e4", "optim.warmup_steps=0")

    def run(env, cfg):
        try:
            train(env, cfg)
        except NonFiniteError as e:
            return str(e)
        return ""

    with caplog.at_level(logging.ERROR, logger="hpcdist"):
        stopped = single(run, cfg)
    triage = [r.getMessage() for r in caplog.records if "NaN triage" in r.getMessage()]
    assert "NaN triage: model" in stopped and "optim.lr" in stopped and "bad data" not in stopped, (stopped, triage)
    assert not any("NaN triage: data" in t for t in triage), triage
    assert not (Path(cfg.run.dir) / "skipped_samples.json").exists()


def test_a_fresh_start_sets_the_old_lines_skipped_samples_aside(small_cfg, tmp_path: Path) -> None:
    """The list a NaN triage made belongs to its line of training: checkpoint.resume=none (a new line, its
    checkpoints set aside) trains on every sample again, the list kept aside; a resume of the same line skips."""
    from tests.dist.harness import single

    cfg = small_cfg(*TRIAGE, "train.steps=2", "train.nonfinite=skip")
    run_dir = Path(cfg.run.dir)
    SkippedSamples(run_dir).save(len(build_datasets(cfg, is_main=True)[0]), {3: "step 2: bad"})
    assert single(lambda env, c: Trainer(c, env).skipped, cfg) == {3: "step 2: bad"}  # the same line: skipped
    fresh = small_cfg(*TRIAGE, "train.steps=2", "train.nonfinite=skip", "checkpoint.resume=none")
    assert single(lambda env, c: Trainer(c, env).skipped, fresh) == {}
    assert not (run_dir / "skipped_samples.json").exists()
    (aside,) = run_dir.glob("skipped_samples.json.abandoned-*")
    assert json.loads(aside.read_text())["ids"] == [3]
