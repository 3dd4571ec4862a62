"""``hpcdist generate`` / ``hpcdist eval`` / ``train.eval_data`` on one real short training run (BPE tokenizer, vocab
auto = padded past the tokenizer's), reused by every test of this module."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

from hpcdist import cli
from hpcdist import config as config_mod
from hpcdist.checkpoint.codec import HashingReader, single_process_dcp
from hpcdist.checkpoint.manifest import tensor_encoding
from hpcdist.config import ConfigError
from hpcdist.data import TokenDataset, load_tokenizer, prepare_corpus, stdlib_corpus
from hpcdist.hf.source import ConversionError, find_checkpoint
from hpcdist.inference import load_for_inference
from hpcdist.models import build_model
from tests.conftest import SMALL
from tests.dist.harness import single
from tests.training import train

STEPS, EVAL_BATCHES, BATCH = 8, 2, 8


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, bpe_corpus_dir: Path) -> dict:
    """8 steps on the BPE corpus, validating every 4 steps on a held-out dataset (other stdlib files, the same
    tokenizer) through train.eval_data; the final checkpoint is step 8."""
    root = tmp_path_factory.mktemp("inference")
    docs = root / "heldout.jsonl"
    with open(docs, "w", encoding="utf-8") as fh:
        for path in stdlib_corpus()[200:230]:
            fh.write(json.dumps({"text": path.read_text(encoding="utf-8", errors="replace")}) + "\n")
    heldout = prepare_corpus([docs], root / "heldout", tokenizer=load_tokenizer(bpe_corpus_dir)).path
    cfg = config_mod.load(
        None,
        [
            *SMALL,
            f"run.dir={root / 'run'}",
            "data.source=files",
            f"data.path={bpe_corpus_dir}",
            "model.vocab_size=auto",
            f"train.steps={STEPS}",
            f"train.global_batch_size={BATCH}",
            "train.micro_batch_size=4",
            "train.eval_every_steps=4",
            f"train.eval_batches={EVAL_BATCHES}",
            f"train.eval_data={heldout}",
            "checkpoint.save_final=true",
        ],
    )
    single(train, cfg)
    return {"dir": Path(cfg.run.dir), "cfg": cfg, "heldout": heldout, "data": bpe_corpus_dir}


def main(*argv: object) -> int:
    try:
        return cli.main([str(a) for a in argv])
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1


def test_resolves_a_run_its_checkpoints_or_a_step(run: dict, tmp_path: Path) -> None:
    step = run["dir"] / "checkpoints" / f"step-{STEPS:08d}"
    for given in (run["dir"], run["dir"] / "checkpoints", step):
        assert find_checkpoint(given) == step
    with pytest.raises(ConversionError, match="holds no complete hpcdist checkpoint"):
        find_checkpoint(tmp_path)


def test_generate_prints_text(run: dict, capsys: pytest.CaptureFixture[str]) -> None:
    """stdout: the prompt, then the continuation; stderr: how many new tokens and why it stopped. (Whitespace-only or
    EOS-first continuations are valid for a model trained 8 steps: on another torch build the greedy text was all
    newlines, so the count is checked, not the stripped text's length.)"""
    assert main("generate", run["dir"], "--prompt", "def main(", "--max-new-tokens", "24") == 0
    out, err = capsys.readouterr()
    m = re.search(r"(\d+) new tokens in .*stopped at (\w+)", err)
    assert m is not None and out.startswith("def main("), (out, err)
    n, stop = int(m.group(1)), m.group(2)
    assert (stop == "max_new_tokens" and n == 24) or (stop == "eos" and n < 24), (n, stop)


def _json_generate(run: dict, capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    assert main("generate", run["dir"], "--prompt", "import os\n", "--max-new-tokens", "16", "--json", *extra) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_greedy_with_and_without_cache_and_seeded_sampling(
    run: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    cached, uncached = _json_generate(run, capsys), _json_generate(run, capsys, "--no-cache")
    assert cached["new_ids"] == uncached["new_ids"] and cached["new_ids"]
    tok = load_tokenizer(run["data"])
    assert all(i < tok.vocab_size for i in cached["new_ids"])  # the padding rows of vocab auto are never produced
    assert cached["text"] == tok.decode(cached["new_ids"])
    hot = ("--temperature", "1.0", "--top-p", "0.95")
    a, b = _json_generate(run, capsys, *hot, "--seed", "3"), _json_generate(run, capsys, *hot, "--seed", "3")
    c = _json_generate(run, capsys, *hot, "--seed", "4")
    assert a["new_ids"] == b["new_ids"] != c["new_ids"]


def test_generate_refuses_a_prompt_longer_than_the_context(run: dict, capsys: pytest.CaptureFixture[str]) -> None:
    assert main("generate", run["dir"], "--prompt", "x = 1\n" * 200) == 2
    _, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and "model.max_seq_len=" in err and "shorten it" in err


def _reference_loss(run: dict, seq_len: int, batches: int, batch_size: int) -> float:
    """Weights read with dcp.load directly (through hpcdist's storage reader: tensors are raw bytes,
    which DCP's stock FileSystemReader cannot read), windows taken in order, mean of per-batch mean cross-entropies."""
    cfg = run["cfg"]
    model = build_model(cfg.model_args(), device="cpu")
    sd = model.state_dict()
    step = run["dir"] / "checkpoints" / f"step-{STEPS:08d}"
    with single_process_dcp():  # one process, no process group: on purpose
        dcp.load(
            {"model": sd}, storage_reader=HashingReader(str(step), hash_files=set(), encoding=tensor_encoding(step))
        )
    ds = TokenDataset(run["heldout"], seq_len)
    losses = []
    with torch.no_grad():
        for b in range(batches):
            batch = torch.stack([torch.from_numpy(ds[i]) for i in range(b * batch_size, (b + 1) * batch_size)])
            logits = model.eval()(batch[:, :-1])
            losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)))
    return float(torch.stack(losses).mean())


def test_eval_loss_equals_a_reference_loop(run: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "eval.json"
    args = ("--batches", "3", "--seq-len", "24", "--batch-size", "4", "--json", out)
    assert main("eval", run["dir"], "--data", run["heldout"], *args) == 0
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["batches"] == 3 and res["tokens"] == 3 * 4 * 24 and res["seq_len"] == 24
    assert res["loss"] == pytest.approx(_reference_loss(run, 24, 3, 4), rel=1e-6)
    assert res["perplexity"] == pytest.approx(math.exp(res["loss"]), rel=1e-12)
    assert f"loss {res['loss']:.4f}" in printed


def test_in_training_eval_reads_train_eval_data(run: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The eval loss logged at the last step is `hpcdist eval` of that step's checkpoint on the same batches (the
    run's defaults), and not the loss on the training data's own windows."""
    lines = [json.loads(x) for x in (run["dir"] / "metrics.jsonl").read_text().splitlines()]
    logged = {x["step"]: x["loss"] for x in lines if x.get("split") == "eval"}
    assert sorted(logged) == [4, STEPS]
    out = tmp_path / "eval.json"
    assert main("eval", run["dir"], "--data", run["heldout"], "--json", out) == 0
    res = json.loads(out.read_text())
    assert res["batches"] == EVAL_BATCHES and res["tokens"] == EVAL_BATCHES * BATCH * 32
    assert logged[STEPS] == pytest.approx(res["loss"], rel=1e-5)
    assert main("eval", run["dir"], "--data", run["data"], "--json", out) == 0  # the training data: another value
    assert json.loads(out.read_text())["loss"] != pytest.approx(res["loss"], rel=1e-3)


def test_eval_refuses_data_of_another_tokenizer(
    run: dict, corpus_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main("eval", run["dir"], "--data", corpus_dir) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert "the byte tokenizer" in err and "the hf tokenizer" in err and str(corpus_dir) in err


def test_train_eval_data_is_checked_at_start_up(run: dict, corpus_dir: Path, tmp_path: Path) -> None:
    base = [*SMALL, f"run.dir={tmp_path}", "data.source=files", f"data.path={run['data']}", "model.vocab_size=auto"]
    cfg = config_mod.load(None, [*base, f"train.eval_data={corpus_dir}"])  # loads: dry runs plan without data
    with pytest.raises(config_mod.DataError) as e:
        config_mod.check_data(cfg)
    assert "train.eval_data" in str(e.value) and "the byte tokenizer" in str(e.value) and "\n" not in str(e.value)
    missing = config_mod.load(None, [*base, f"train.eval_data={tmp_path / 'nope'}"])
    with pytest.raises(config_mod.DataError, match=r"train\.eval_data: .*nope: no prepared dataset there"):
        config_mod.check_data(missing)
    # held-out data of its own needs no val split of the training data
    no_split = [*base, "data.val_fraction=0", "train.eval_every_steps=5"]
    config_mod.load(None, [*no_split, f"train.eval_data={run['heldout']}"])
    with pytest.raises(ConfigError, match=r"or train\.eval_data"):
        config_mod.load(None, no_split)


def test_load_for_inference_reads_the_model_the_checkpoint_records(run: dict, tmp_path: Path) -> None:
    """The model's shape comes from the config recorded in the checkpoint, not from a config.yaml edited since (here
    one describing 3 layers beside a 2-layer checkpoint); a checkpoint holding another model than its record says is
    refused naming the parameters."""
    from hpcdist.checkpoint.errors import CheckpointMismatch
    from hpcdist.inference import load_weights
    from hpcdist.models import build_model as build

    fake = tmp_path / "run"
    (fake / "checkpoints").mkdir(parents=True)
    step = run["dir"] / "checkpoints" / f"step-{STEPS:08d}"
    (fake / "checkpoints" / step.name).symlink_to(step)
    cfg = run["cfg"]
    cfg2 = config_mod.load(
        None,
        [
            *SMALL,
            f"run.dir={fake}",
            "data.source=files",
            f"data.path={run['data']}",
            "model.vocab_size=auto",
            "model.n_layers=3",
        ],
    )
    config_mod.save(cfg2, fake / "config.yaml")
    model, tok, loaded = load_for_inference(fake)
    assert loaded.config is not None and loaded.config.model.n_layers == cfg.model.n_layers == len(model.layers)
    assert tok is not None and tok.kind == "hf" and not model.training
    with pytest.raises(CheckpointMismatch, match=r"layers\.2\..*not in the checkpoint"):
        load_weights(build(cfg2.model_args(), device="cpu"), step)
