"""data.document_mask under every strategy: ddp, fsdp, zero-3 and 3d (pp2 x tp2, the pipeline passing document ids to
its later stage) train and evaluate exactly as one process with the mask, on data packed with many short documents."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch

from hpcdist import cli
from hpcdist import config as config_mod
from hpcdist.config import JobConfig
from hpcdist.data import ByteTokenizer, TokenDataset, prepare_corpus
from hpcdist.inference import dataset_loss, load_for_inference
from hpcdist.trainer import Trainer, TrainResult
from tests.conftest import SMALL
from tests.dist.harness import run_ranks, single
from tests.training import train

pytestmark = pytest.mark.dist

STEPS = 3
RTOL = 1e-5  # fp32 on CPU: a layout differs from one process only in summation order (as tests/dist/test_3d.py)
# 4 layers for pp=2; eval at step 2 (pipelines evaluate through the schedule's forward-only step)
BASE = (
    f"train.steps={STEPS}",
    "model.n_layers=4",
    "train.global_batch_size=8",
    "data.val_fraction=0.05",
    "train.eval_every_steps=2",
    "train.eval_batches=1",
    "checkpoint.resume=none",
)
MASK = "data.document_mask=true"


@pytest.fixture(scope="module")
def docs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Short documents (5-60 bytes): a 33-token sample holds several EOS, so the mask matters in every row."""
    root = tmp_path_factory.mktemp("short_docs")
    rng = torch.Generator().manual_seed(0)
    words = Path(json.__file__).read_text(encoding="utf-8").split()
    with open(root / "docs.jsonl", "w", encoding="utf-8") as fh:
        for _ in range(3000):
            n = int(torch.randint(1, 10, (), generator=rng))
            start = int(torch.randint(0, len(words) - n, (), generator=rng))
            fh.write(json.dumps({"text": " ".join(words[start : start + n])[:60]}) + "\n")
    return prepare_corpus([root / "docs.jsonl"], root / "ds", tokenizer=ByteTokenizer()).path


def _cfg(run_dir: Path, data: Path, *over: str) -> JobConfig:
    base = [*SMALL, f"run.dir={run_dir}", "data.source=files", f"data.path={data}"]
    return config_mod.load(None, [*base, *BASE, *over])


def _mask_facts(trainer: Trainer, result: TrainResult) -> dict:
    return {
        "losses": [result.losses[s] for s in sorted(result.losses)],
        "eos": trainer.strategy.module.document_eos if hasattr(trainer.strategy.module, "document_eos") else "shell",
    }


_train_masked = partial(train, after=_mask_facts)  # losses in step order, the model's document_eos


@pytest.fixture(scope="module")
def reference(docs_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One process, the global batch in one micro-batch, with the mask: the ground truth (trained once)."""
    run_dir = tmp_path_factory.mktemp("mask_ref")
    out = single(_train_masked, _cfg(run_dir, docs_dir, MASK, "train.micro_batch_size=8", "checkpoint.save_final=true"))
    return {**out, "dir": run_dir}


def test_the_mask_changes_training(reference: dict, docs_dir: Path, tmp_path: Path) -> None:
    off = single(_train_masked, _cfg(tmp_path, docs_dir, "train.micro_batch_size=8"))
    assert reference["eos"] == ByteTokenizer.eos_id and off["eos"] is None
    # the same batches and init: only the mask differs, and it changes every loss (train and eval)
    assert all(abs(a - b) > 1e-4 for a, b in zip(reference["losses"], off["losses"], strict=True))
    assert all(abs(a - b) > 1e-4 for a, b in zip(reference["eval"].values(), off["eval"].values(), strict=True))


def test_hpcdist_eval_honours_the_run_s_mask(reference: dict, docs_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval.json"
    argv = ["eval", str(reference["dir"]), "--data", str(docs_dir), "--batches", "2", "--batch-size", "4"]
    assert cli.main([*argv, "--json", str(out)]) == 0
    model, _, _ = load_for_inference(reference["dir"])
    ds = TokenDataset(docs_dir, 32, key="--data")
    with torch.no_grad():
        plain = dataset_loss(model, ds, batches=2, batch_size=4).loss
        model.document_eos = ByteTokenizer.eos_id
        masked = dataset_loss(model, ds, batches=2, batch_size=4).loss
    assert abs(masked - plain) > 1e-4
    assert json.loads(out.read_text())["loss"] == pytest.approx(masked, rel=1e-6)


LAYOUTS = {
    "ddp2-accum2": (2, ("parallel.strategy=ddp", "train.micro_batch_size=2")),
    "fsdp2": (2, ("parallel.strategy=fsdp", "train.micro_batch_size=4")),
    "zero3": (2, ("parallel.strategy=zero", "parallel.zero.stage=3", "train.micro_batch_size=4")),
    # interleaved: two stages per rank, the second one's input from the other rank, doc_ids to both
    "pp2-interleaved": (
        2,
        ("parallel.strategy=3d", "parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B", "train.micro_batch_size=2"),
    ),
    "pp2-tp2-1f1b": (
        4,
        (
            "parallel.strategy=3d",
            "parallel.pp=2",
            "parallel.dp=1",
            "parallel.tp=2",
            "parallel.pp_schedule=1F1B",
            "train.micro_batch_size=4",
        ),
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_single_process_with_the_mask(reference: dict, docs_dir: Path, tmp_path: Path, layout: str) -> None:
    world, over = LAYOUTS[layout]
    outs = run_ranks(world, _train_masked, _cfg(tmp_path, docs_dir, MASK, *over))
    assert len(reference["losses"]) == STEPS and reference["eval"]
    for out in outs:  # every rank (every stage, every tp peer) reports the job's loss
        torch.testing.assert_close(out["losses"], reference["losses"], rtol=RTOL, atol=0)
        torch.testing.assert_close(out["eval"], reference["eval"], rtol=RTOL, atol=0)
