"""NaN triage: a non-finite step is re-run once on the same inputs. Reproducible = data (the sample is
named, skipped with train.nonfinite=skip, and skipped again on resume); not reproducible = hardware (a "hardware"
failure blaming the host in failures.jsonl, and the run stops). Injected through test hooks on the real model."""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path

import pytest
import torch

from hpcdist.config import ConfigError
from hpcdist.data import make_sampler
from hpcdist.data.blend import BlendedDataset, BlendSampler
from hpcdist.data.build import build_datasets
from hpcdist.data.sampler import ResumableSampler
from hpcdist.data.shards import SyntheticDataset
from hpcdist.fault.failures import primary_failure, read_failures
from hpcdist.fault.triage import HardwareFault, SkippedSamples
from hpcdist.trainer import Trainer
from tests.dist.harness import single
from tests.training import TRIAGE, poison


def _drawn(cfg, steps: int) -> list[list[int]]:
    train_ds, _ = build_datasets(cfg, is_main=True)
    sampler = make_sampler(train_ds, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
    return [sampler.next_indices(cfg.train.global_batch_size) for _ in range(steps)]


def test_a_bad_sample_is_data_named_skipped_and_skipped_on_resume(small_cfg, caplog) -> None:
    cfg = small_cfg(*TRIAGE, "train.steps=3", "train.nonfinite=skip", "checkpoint.every_steps=1")
    batches = _drawn(cfg, 3)
    bad = batches[1][2]  # drawn at step 2
    train_ds, _ = build_datasets(cfg, is_main=True)
    tokens = torch.from_numpy(train_ds[bad][:-1])

    def run(env, cfg, *, until: int | None = None):
        trainer = Trainer(cfg, env)
        poison(trainer, tokens)
        result = trainer.train(until=until)
        return result, trainer

    with caplog.at_level(logging.ERROR, logger="hpcdist"):
        result, trainer = single(run, cfg)
    line = [r.getMessage() for r in caplog.records if "NaN triage" in r.getMessage()]
    assert len(line) == 1 and f"step 2: NaN triage: data, sample(s) {bad} (" in line[0], line
    assert "token" in line[0]  # its shard and offset
    doc = json.loads((Path(cfg.run.dir) / "skipped_samples.json").read_text())
    assert doc["ids"] == [bad] and doc["num_samples"] == len(train_ds)
    assert trainer.nonfinite.skipped_total == 1 and result.step == 3
    assert trainer.strategy.params_finite()
    # resume from step 1, before the bad sample: step 2 draws its batch without it, deterministically
    resumed = small_cfg(
        *TRIAGE, "train.steps=2", "train.nonfinite=skip", f"checkpoint.resume={cfg.checkpoint_dir}/step-00000001"
    )
    result, trainer = single(run, resumed)
    assert trainer.nonfinite.skipped_total == 0 and result.step == 2  # no NaN: the bad sample never came back
    expected = [i for i in batches[1] + batches[2] if i != bad][:4]
    assert trainer.loader.last_indices() == expected


def test_a_one_off_nonfinite_gradient_is_hardware_and_blames_the_host(small_cfg) -> None:
    cfg = small_cfg(*TRIAGE, "train.steps=3")

    def run(env, cfg):
        trainer = Trainer(cfg, env)
        real, calls = trainer.strategy.forward_backward, []

        def flaky(batch: torch.Tensor) -> torch.Tensor:  # one bit flip in step 2's backward, never again
            loss = real(batch)
            calls.append(1)
            if len(calls) == 2:
                next(trainer.strategy.module.parameters()).grad.view(-1)[0] = float("nan")
            return loss

        trainer.strategy.forward_backward = flaky
        trainer.train()

    with pytest.raises(HardwareFault, match=r"^step 2: .*did not reproduce: hardware \(rank 0 on "):
        single(run, cfg)
    records = [r for r in read_failures(cfg.run.dir) if r["kind"] == "hardware"]
    assert len(records) == 1 and records[0]["step"] == 2
    assert records[0]["blame"] == [{"rank": 0, "host": socket.gethostname()}]
    assert primary_failure(read_failures(cfg.run.dir)) == records[0]  # what the restart policy excludes


def test_the_skip_file_is_validated(tmp_path: Path, small_cfg) -> None:
    path = tmp_path / "skipped_samples.json"
    files = SkippedSamples(tmp_path)
    assert files.load(10) == {}
    files.save(10, {3: "why"})
    assert files.load(10) == {3: "why"}
    with pytest.raises(ValueError, match=r"dataset of 10 samples, this run.s has 11.*remove it"):
        files.load(11)
    for bad in ('{"num_samples": 10, "ids": [-1]}', '{"num_samples": 10, "ids": ["x"]}', "[]", "{"):
        path.write_text(bad)
        with pytest.raises(ValueError, match=r"skipped_samples\.json"):
            files.load(10)
    path.unlink()
    os.symlink(tmp_path / "elsewhere", path)
    with pytest.raises(ValueError, match="is a link"):
        files.load(10)
    # at start-up: one line naming the key and the fix, and ids past the dataset are refused by the sampler
    cfg = small_cfg(*TRIAGE)
    Path(cfg.run.dir).mkdir(parents=True)
    Path(cfg.run.dir, "skipped_samples.json").write_text('{"num_samples": 3, "ids": [1]}')
    with pytest.raises(ConfigError, match=r"train\.nonfinite: .*the data changed since"):
        single(lambda env, cfg: Trainer(cfg, env), cfg)


def test_triage_is_refused_with_zero(small_cfg) -> None:
    with pytest.raises(ConfigError, match=r"train\.nonfinite_triage: DeepSpeed applies the update"):
        small_cfg("parallel.strategy=zero", "train.nonfinite_triage=true")


def test_the_sampler_passes_over_skipped_ids_and_resumes_alike() -> None:
    plain = ResumableSampler(10, seed=1)
    order = plain.next_indices(10)
    a = ResumableSampler(10, seed=1)
    a.skip({order[1], order[5]})
    first = a.next_indices(3)
    state = a.state_dict()
    assert first == [order[0], order[2], order[3]] and state["position"] == 4  # positions count the skipped ones
    b = ResumableSampler(10, seed=1)
    b.skip({order[1], order[5]})
    b.load_state_dict(state)
    assert b.next_indices(4) == a.next_indices(4) == [order[4], *order[6:9]]
    with pytest.raises(ValueError, match=r"outside \[0, 10\)"):
        a.skip({10})
    with pytest.raises(ValueError, match="all 10 samples would be skipped"):
        a.skip(set(range(10)))
    blend = BlendSampler(4)  # a blend's ids are global positions: past len(), never repeated
    blend.skip({5})
    assert blend.next_indices(6) == [0, 1, 2, 3, 4, 6]
    ds = BlendedDataset([SyntheticDataset(4, 8, 32), SyntheticDataset(4, 8, 32)], [1, 1])
    assert ds.where(5).startswith("source ") and "sample " in ds.where(5)
