"""Blends (data.sources): proportions, every sample once per epoch of each source, exact resume across dp sizes."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from hpcdist import config as config_mod
from hpcdist.data import BatchLoader, BlendedDataset, BlendSampler, make_sampler, prepare_corpus
from hpcdist.data.tokenizers import ByteTokenizer


class Tagged:
    """Sample i of source k is [k, i]: what was read is visible in the batch itself."""

    def __init__(self, k: int, n: int) -> None:
        self.k, self.n = k, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        assert 0 <= i < self.n
        return np.array([self.k, i], dtype=np.int64)


SIZES, WEIGHTS = [97, 1000, 13], [0.5, 0.3, 0.2]


def _blend(seed: int = 5) -> BlendedDataset:
    return BlendedDataset([Tagged(k, n) for k, n in enumerate(SIZES)], WEIGHTS, seed=seed)


def test_proportions_within_one_percent_over_10k_samples() -> None:
    blend = _blend()
    counts = Counter(blend.locate(g)[0] for g in range(10_000))
    for k, w in enumerate(WEIGHTS):
        assert abs(counts[k] / 10_000 - w) < 0.01, counts
    odd = BlendedDataset([Tagged(0, 5), Tagged(1, 5)], [1, 2])  # weights need not sum to 1
    share = Counter(odd.locate(g)[0] for g in range(10_000))[1] / 10_000
    assert abs(share - 2 / 3) < 0.01


def test_every_sample_once_per_epoch_of_each_source() -> None:
    blend = _blend()
    reads: dict[int, list[int]] = {k: [] for k in range(len(SIZES))}
    for g in range(20_000):
        k, i = blend.locate(g)
        reads[k].append(i)
    for k, n in enumerate(SIZES):
        epochs = [reads[k][e * n : (e + 1) * n] for e in range(len(reads[k]) // n)]
        assert len(epochs) >= 2, (k, len(reads[k]))
        for epoch in epochs:
            assert sorted(epoch) == list(range(n)), f"source {k}: an epoch is not a permutation"
        assert epochs[0] != epochs[1]  # a new order every epoch
    # a fresh blend (another process, no cached permutations) maps every position the same way
    again = _blend()
    assert [again.locate(g) for g in range(19_999, -1, -997)] == [blend.locate(g) for g in range(19_999, -1, -997)]


def _read(loaders: list[BatchLoader], steps: int) -> list[list[tuple[int, int]]]:
    """Per step, the (source, sample) pairs of the global batch, ranks' slices concatenated in rank order."""
    out = []
    for _ in range(steps):
        rows = [tuple(r) for ld in loaders for r in ld.next_batch().tolist()]
        out.append(rows)
    return out


def _loaders(dp: int, state: dict | None = None) -> list[BatchLoader]:
    out = []
    for r in range(dp):
        blend = _blend()
        sampler = make_sampler(blend, seed=5, shuffle=True)
        assert isinstance(sampler, BlendSampler)
        if state is not None:
            sampler.load_state_dict(state)
        out.append(BatchLoader(blend, sampler, global_batch_size=8, dp_rank=r, dp_size=dp))
    return out


def test_resume_across_dp_sizes_reads_each_sample_once() -> None:
    straight = _read(_loaders(1), 300)  # 2400 samples: several epochs of the small sources
    first_dp = _loaders(2)
    first = _read(first_dp, 120)
    state = first_dp[0].state_dict()
    assert state == first_dp[1].state_dict()
    resumed = _read(_loaders(4, state), 180)
    assert first + resumed == straight
    # and the resumed stream still reads each source in whole epochs
    reads = [pair for step in first + resumed for pair in step]
    small = [i for k, i in reads if k == 2]
    for e in range(len(small) // 13):
        assert sorted(small[e * 13 : (e + 1) * 13]) == list(range(13))


def test_config_sources_train_split_and_checks(tmp_path: Path) -> None:
    dirs = []
    for k, text in enumerate(["aaaa " * 400, "bbbb " * 300]):
        (tmp_path / f"{k}.txt").write_text(text)
        dirs.append(prepare_corpus([tmp_path / f"{k}.txt"], tmp_path / f"ds{k}", tokenizer=ByteTokenizer()).path)
    over = ["data.source=files", f"data.sources=[{{path: {dirs[0]}, weight: 3}}, {{path: {dirs[1]}, weight: 1}}]"]
    cfg = config_mod.load(None, [*over, "model.vocab_size=auto"])
    assert [(s.path, s.weight) for s in cfg.data.sources] == [(str(dirs[0]), 3.0), (str(dirs[1]), 1.0)]
    assert cfg.model.vocab_size == 320 and config_mod.check_data(cfg) == []
    assert config_mod.dump(cfg).count("weight:") == 2  # saved with the run like every key

    with pytest.raises(config_mod.ConfigError) as err:
        config_mod.load(None, ["data.source=files", f"data.path={dirs[0]}", "data.sources=[{path: '', weight: -1}]"])
    assert err.value.problems == [
        "data.sources and data.path: give one (a blend, or one prepared directory)",
        "data.sources[0].path: must name a directory made by `hpcdist prepare`",
        "data.sources[0].weight: must be a finite number > 0, got -1.0",
    ]
    with pytest.raises(config_mod.ConfigError, match=r"data\.sources: must be a list of mappings with keys path"):
        config_mod.load(None, ["data.source=files", "data.sources=oops"])
    # sources prepared with different tokenizers: one id, two meanings
    meta = json.loads((dirs[1] / "meta.json").read_text())
    meta["tokenizer"]["kind"] = "hf"
    (dirs[1] / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(config_mod.DataError, match="prepared with different tokenizers"):
        config_mod.check_data(config_mod.load(None, over))
    missing = config_mod.load(None, ["data.source=files", f"data.sources=[{{path: {tmp_path / 'nope'}}}]"])
    with pytest.raises(config_mod.DataError, match=r"data\.sources\[0\]\.path .*nope: no prepared dataset"):
        config_mod.check_data(missing)
