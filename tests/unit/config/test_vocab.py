"""model.vocab_size: auto and the start-up vocabulary check (hpcdist.config.vocab), before any process group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcdist import config as config_mod
from hpcdist.data import ByteTokenizer
from tests.unit.harness import hpcdist


def _dataset(root: Path, vocab_size: int) -> Path:
    """A prepared directory as meta.json describes it (the check reads only meta.json)."""
    root.mkdir(parents=True)
    (root / "shard-00000.bin").write_bytes(b"\0\0" * 64)
    shard = {"name": "shard-00000.bin", "tokens": 64}
    meta = {
        "format": 1,
        "dtype": "uint16",
        "vocab_size": vocab_size,
        "eos_id": 0,
        "num_tokens": 64,
        "num_documents": 1,
        "shards": [shard],
        "tokenizer": {"kind": "hf"},
    }
    (root / "meta.json").write_text(json.dumps(meta))
    return root


def test_the_torch_free_copies_agree_with_hpcdist_data() -> None:
    assert ByteTokenizer.vocab_size == config_mod.BYTE_VOCAB


@pytest.mark.parametrize(("data_vocab", "auto"), [(258, 320), (320, 320), (321, 384), (32000, 32000), (50257, 50304)])
def test_auto_rounds_the_data_vocabulary_up_to_64(tmp_path: Path, data_vocab: int, auto: int) -> None:
    ds = _dataset(tmp_path / "ds", data_vocab)
    cfg = config_mod.load(None, ["data.source=files", f"data.path={ds}", "model.vocab_size=auto"])
    assert cfg.model.vocab_size == auto and auto % config_mod.VOCAB_MULTIPLE == 0
    assert cfg.model_args().vocab_size == auto
    assert config_mod.check_data(cfg) == []


def test_auto_on_the_embedded_corpus_and_numbers_given_as_text() -> None:
    assert config_mod.load("configs/demo.yaml", ["model.vocab_size=auto"]).model.vocab_size == 320
    assert config_mod.load("configs/demo.yaml", ["model.vocab_size=512"]).model.vocab_size == 512


def test_auto_without_data_and_garbage_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(config_mod.ConfigError) as err:
        config_mod.load(None, ["data.source=files", f"data.path={tmp_path / 'none'}", "model.vocab_size=auto"])
    assert err.value.problems == [
        f"model.vocab_size: auto reads the vocabulary of the prepared data, but data.path={tmp_path / 'none'} holds no "
        f"prepared dataset; make it with `hpcdist prepare INPUT... --tokenizer SPEC --out {tmp_path / 'none'}`, or "
        "give a number"
    ]
    with pytest.raises(config_mod.ConfigError, match="give a number"):
        config_mod.load(None, ["data.source=synthetic", "model.vocab_size=auto"])
    with pytest.raises(config_mod.ConfigError) as err:
        config_mod.load(None, ["model.vocab_size=big"])
    assert err.value.problems == ["model.vocab_size: must be a positive integer or auto, got 'big'"]


def test_data_vocab_larger_than_the_model_is_one_line(tmp_path: Path) -> None:
    ds = _dataset(tmp_path / "ds", 32000)
    cfg = config_mod.load(None, ["data.source=files", f"data.path={ds}", "model.vocab_size=258"])
    with pytest.raises(config_mod.DataError) as err:
        config_mod.check_data(cfg)
    assert str(err.value) == (
        f"model.vocab_size=258 is smaller than the 32000 tokens of the hf tokenizer of data.path={ds}: ids up to "
        "31999 would index past the embedding table; set model.vocab_size: auto (32000) or >= 32000"
    )
    byte = config_mod.load("configs/demo.yaml", ["model.vocab_size=100"])
    with pytest.raises(config_mod.DataError, match="smaller than the 258 tokens of the byte tokenizer"):
        config_mod.check_data(byte)
    assert config_mod.load(None, ["model.vocab_size=100", "data.source=synthetic"]).model.vocab_size == 100


def test_cli_vocab_mismatch_exits_with_one_line_before_any_rank(tmp_path: Path) -> None:
    ds = _dataset(tmp_path / "ds", 1000)
    run = tmp_path / "run"
    proc = hpcdist("train", "configs/demo.yaml", "data.source=files", f"data.path={ds}", f"run.dir={run}")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"hpcdist: model.vocab_size=258 is smaller than the 1000 tokens of the hf tokenizer of data.path={ds}: ids "
        "up to 999 would index past the embedding table; set model.vocab_size: auto (1024) or >= 1000"
    ]
    assert not run.exists()  # nothing started: no run directory, no process group


def test_cli_missing_data_refuses_to_train_but_dry_runs_warn(tmp_path: Path) -> None:
    missing = tmp_path / "not-prepared"
    over = ("data.source=files", f"data.path={missing}", f"run.dir={tmp_path / 'run'}")
    line = (
        f"data.path {missing}: no prepared dataset there (no complete meta.json); make it with "
        f"`hpcdist prepare INPUT... --tokenizer SPEC --out {missing}`"
    )
    proc = hpcdist("train", "configs/demo.yaml", *over)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [f"hpcdist: {line}"]
    dry = hpcdist("train", "configs/demo.yaml", *over, "--dry-run", "--world-size", "2")
    assert dry.returncode == 0, dry.stderr
    assert f"hpcdist: warning: {line}" in dry.stderr
    sub = hpcdist("submit", "configs/demo.yaml", *over, "--cluster", "a100_ib", "--dry-run")
    assert sub.returncode == 0, sub.stderr
    assert f"hpcdist: warning: {line}" in sub.stderr and "#SBATCH" in sub.stdout


def test_flagship_config_names_prepared_data_and_refuses_to_start_without_it(tmp_path: Path) -> None:
    cfg = config_mod.load("configs/train_13b.yaml")
    assert (cfg.data.source, cfg.data.path, cfg.model.vocab_size) == ("files", "data/llama2-corpus", 32000)
    proc = hpcdist("train", "configs/train_13b.yaml", f"run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "hpcdist: data.path data/llama2-corpus: no prepared dataset there (no complete meta.json); make it with "
        "`hpcdist prepare INPUT... --tokenizer SPEC --out data/llama2-corpus`"
    ]


def test_a_vocab_size_of_thousands_of_digits_is_one_config_error() -> None:
    """model.vocab_size given as text with more digits than int() converts (4300 by default) is a ConfigError naming
    the key and its maximum, not a ValueError from int() (hypothesis found it in test_hostile_input)."""
    with pytest.raises(config_mod.ConfigError, match=r"model\.vocab_size.*at most 2147483647"):
        config_mod.load(None, ["model.vocab_size=" + "9" * 4301])
