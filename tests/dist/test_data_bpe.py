"""Real data end to end on real gloo ranks: a jsonl corpus through a BPE tokenizer trained by the tool, trained by
2-rank DDP with model.vocab_size: auto; stopping and resuming is exact."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch

from hpcdist import config as config_mod
from hpcdist.config import JobConfig
from hpcdist.trainer import TrainResult
from tests.conftest import SMALL
from tests.dist.harness import run_ranks
from tests.training import train

pytestmark = pytest.mark.dist


def _losses_in_order(_: object, result: TrainResult) -> dict:
    return {"losses": [result.losses[s] for s in sorted(result.losses)]}


_train_bpe = partial(train, params=True, after=_losses_in_order)


def test_two_rank_ddp_trains_on_bpe_data_with_auto_vocab_and_resumes_exactly(
    bpe_corpus_dir: Path, tmp_path: Path
) -> None:
    meta = json.loads((bpe_corpus_dir / "meta.json").read_text())
    assert meta["vocab_size"] == 400 and meta["tokenizer"]["kind"] == "hf"

    def cfg(run: str) -> JobConfig:
        over = [
            *SMALL,
            f"run.dir={tmp_path / run}",
            "data.source=files",
            f"data.path={bpe_corpus_dir}",
            "model.vocab_size=auto",
            "train.steps=8",
            "train.global_batch_size=8",
            "train.micro_batch_size=2",
        ]
        c = config_mod.load(None, over)
        assert config_mod.check_data(c) == []
        return c

    straight = cfg("straight")
    assert straight.model.vocab_size == 448  # 400 rounded up to a multiple of 64
    ref = run_ranks(2, _train_bpe, straight)[0]
    assert ref["params"]["tok_embeddings.weight"].shape[0] == 448
    assert ref["losses"][-1] < ref["losses"][0]

    split = cfg("split")
    first = run_ranks(2, _train_bpe, split, 4)[0]
    second = run_ranks(2, _train_bpe, split)[0]
    assert first["losses"] + second["losses"] == ref["losses"]  # bitwise
    for name, p in ref["params"].items():
        assert torch.equal(second["params"][name], p), name


def test_prefetching_changes_no_loss_and_resumes_exactly(bpe_corpus_dir: Path, tmp_path: Path) -> None:
    def cfg(run: str, prefetch: int) -> JobConfig:
        over = [
            *SMALL,
            f"run.dir={tmp_path / run}",
            "data.source=files",
            f"data.path={bpe_corpus_dir}",
            "model.vocab_size=auto",
            "train.steps=6",
            "train.global_batch_size=8",
            "train.micro_batch_size=4",
            f"data.prefetch={prefetch}",
        ]
        return config_mod.load(None, over)

    off = run_ranks(2, _train_bpe, cfg("off", 0))[0]
    on = run_ranks(2, _train_bpe, cfg("on", 3))[0]
    assert on["losses"] == off["losses"]  # bitwise: the same batches in the same order
    # stop at step 2 with up to 3 batches prefetched, resume without prefetching: nothing skipped or repeated
    first = run_ranks(2, _train_bpe, cfg("split", 3), 2)[0]
    second = run_ranks(2, _train_bpe, cfg("split", 0))[0]
    assert first["losses"] + second["losses"] == off["losses"]


def test_blend_trains_on_two_ranks_and_resumes_exactly(bpe_corpus_dir: Path, tmp_path: Path) -> None:
    # two sources of one tokenizer: the BPE corpus twice over (weights 3:1), through the trainer's own blend path
    sources = f"data.sources=[{{path: {bpe_corpus_dir}, weight: 3}}, {{path: {bpe_corpus_dir}, weight: 1}}]"

    def cfg(run: str) -> JobConfig:
        over = [
            *SMALL,
            f"run.dir={tmp_path / run}",
            "data.source=files",
            sources,
            "model.vocab_size=auto",
            "train.steps=6",
            "train.global_batch_size=8",
            "train.micro_batch_size=4",
        ]
        return config_mod.load(None, over)

    straight = run_ranks(2, _train_bpe, cfg("straight"))[0]
    first = run_ranks(2, _train_bpe, cfg("split"), 3)[0]
    second = run_ranks(2, _train_bpe, cfg("split"))[0]
    assert first["losses"] + second["losses"] == straight["losses"]
