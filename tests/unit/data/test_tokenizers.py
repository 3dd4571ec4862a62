"""hpcdist.data.tokenizers: every kind behind one interface, from local files only, and `hpcdist tokenizer train`."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFCoreTokenizer

from hpcdist.data import ByteTokenizer, TokenizerError, load_tokenizer, prepare_corpus, train_bpe
from hpcdist.data.tokenizers import TOKENIZER_KINDS, HFTokenizer, SentencePieceTokenizer, TiktokenTokenizer
from hpcdist.hf.tokenizer import export_tokenizer
from tests.unit.harness import hpcdist

TEXTS = ["def f(x):\n    return x + 1\n", "café ☃ naïve résumé 🚀", "", "  leading and trailing  \n\n"]


def _corpus(path: Path, n: int = 200) -> Path:
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "the",
        "lazy",
        "dog",
        "café",
        "☃",
        "def",
        "return",
        "class",
        "import",
        "self",
    ]
    lines = [" ".join(words[(i * 7 + k) % len(words)] for k in range(3 + i % 11)) for i in range(n)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bpe")
    train_bpe([_corpus(root / "corpus.txt")], vocab_size=300, out_dir=root / "tok")
    return root / "tok"


def _roundtrip(tok, texts=TEXTS) -> None:
    encoded = tok.encode_batch(texts)
    assert len(encoded) == len(texts)
    for text, ids in zip(texts, encoded, strict=True):
        assert ids.dtype == np.int64
        assert ids.size == 0 or (ids.min() >= 0 and ids.max() < tok.vocab_size)
        assert tok.decode(ids) == text


def test_byte_tokenizer_interface() -> None:
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id, tok.add_bos) == (258, 256, 257, None, False)
    _roundtrip(tok)
    assert load_tokenizer("byte").kind == "byte"


def test_trained_bpe_roundtrips_and_names_eos(bpe_dir: Path) -> None:
    tok = load_tokenizer(bpe_dir)
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == 300
    assert tok.eos_id == 0 and tok.pad_id == 0 and tok.bos_id is None and not tok.add_bos
    _roundtrip(tok)  # byte-level: lossless even on characters never seen in training
    # the merges compress: fewer tokens than bytes on text like the training corpus
    ids = tok.encode_batch(["the quick brown fox jumps over the lazy dog"])[0]
    assert len(ids) < len("the quick brown fox jumps over the lazy dog") / 2
    same = load_tokenizer(bpe_dir / "tokenizer.json")
    np.testing.assert_array_equal(same.encode_batch(TEXTS[:1])[0], tok.encode_batch(TEXTS[:1])[0])


def test_hf_tokenizer_special_tokens_without_config(bpe_dir: Path, tmp_path: Path) -> None:
    # a bare tokenizer.json (no tokenizer_config.json): EOS found by its usual name
    (tmp_path / "tokenizer.json").write_bytes((bpe_dir / "tokenizer.json").read_bytes())
    tok = load_tokenizer(tmp_path)
    assert tok.eos_id == 0 and tok.pad_id is None
    # no end-of-text token at all: one error saying what to add
    data = json.loads((bpe_dir / "tokenizer.json").read_text())
    data["added_tokens"] = []
    del data["model"]["vocab"]["<|endoftext|>"]
    (tmp_path / "noeos.json").write_text(json.dumps(data))
    with pytest.raises(TokenizerError, match="no end-of-text token"):
        load_tokenizer(tmp_path / "noeos.json")


def test_sentencepiece_model(tmp_path: Path) -> None:
    spm = pytest.importorskip("sentencepiece")
    corpus = _corpus(tmp_path / "corpus.txt", n=400)
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=300,
        byte_fallback=True,
        character_coverage=1.0,
        minloglevel=2,
    )
    tok = load_tokenizer(tmp_path / "sp.model")
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.bos_id, tok.eos_id) == (1, 2) and tok.add_bos and tok.vocab_size == 300
    _roundtrip(tok, ["the quick brown fox", "café ☃ 🚀"])


def _tiktoken_file(path: Path) -> Path:
    ranks = [bytes([b]) for b in range(256)] + [b"th", b"the", b" the", b"qu", b"ick"]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
    return path


def test_tiktoken_local_bpe_file(tmp_path: Path) -> None:
    pytest.importorskip("tiktoken")
    path = _tiktoken_file(tmp_path / "tiny.tiktoken")
    for spec in (path, f"tiktoken:{path}"):
        tok = load_tokenizer(spec)
        assert isinstance(tok, TiktokenTokenizer)
        assert (tok.vocab_size, tok.eos_id, tok.bos_id) == (262, 261, None)
        _roundtrip(tok)
    assert list(tok.encode_batch(["the"])[0]) == [257]


def test_bad_specs_are_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="no such file"):
        load_tokenizer(tmp_path / "missing.json")
    with pytest.raises(TokenizerError, match=r"without tokenizer\.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "garbage.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"not a Hugging Face tokenizer\.json"):
        load_tokenizer(tmp_path / "garbage.json")
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe([tmp_path / "garbage.json"], vocab_size=100, out_dir=tmp_path / "x")


def test_cli_tokenizer_train(tmp_path: Path) -> None:
    corpus = tmp_path / "in"
    corpus.mkdir()
    _corpus(corpus / "a.txt")
    (corpus / "b.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in TEXTS))
    proc = hpcdist(
        "tokenizer", "train", corpus, "--vocab-size", "280", "--out", tmp_path / "tok", "--text-field", "body"
    )
    assert proc.returncode == 0, proc.stderr
    assert "trained a byte-level BPE of 280 tokens on 2 files" in proc.stdout
    _roundtrip(load_tokenizer(tmp_path / "tok"))
    bad = hpcdist("tokenizer", "train", corpus, "--vocab-size", "280", "--out", tmp_path / "t2")
    assert bad.returncode != 0 and "no field 'text'" in bad.stderr and "--text-field" in bad.stderr


# ---------------------------------------------------------------- the registry: every kind round-trips
def _spec_byte(tmp_path: Path) -> str:
    return "byte"


def _spec_hf(tmp_path: Path) -> str:
    train_bpe([_corpus(tmp_path / "corpus.txt")], vocab_size=300, out_dir=tmp_path / "tok")
    return str(tmp_path / "tok")


def _spec_sentencepiece(tmp_path: Path) -> str:
    spm = pytest.importorskip("sentencepiece")
    corpus = str(_corpus(tmp_path / "corpus.txt", n=400))
    spm.SentencePieceTrainer.train(
        input=corpus,
        model_prefix=str(tmp_path / "sp"),
        vocab_size=300,
        byte_fallback=True,
        character_coverage=1.0,
        minloglevel=2,
    )
    return str(tmp_path / "sp.model")


def _spec_tiktoken(tmp_path: Path) -> str:
    pytest.importorskip("tiktoken")
    return f"tiktoken:{_tiktoken_file(tmp_path / 'ranks.bpe')}"  # no .tiktoken suffix: the copy is loaded by kind


SPECS = {"byte": _spec_byte, "hf": _spec_hf, "sentencepiece": _spec_sentencepiece, "tiktoken": _spec_tiktoken}


def test_every_registered_kind_has_a_round_trip_sample() -> None:
    assert set(SPECS) == set(TOKENIZER_KINDS)  # a new kind in the registry needs a sample here


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_kind_round_trips_through_a_prepared_dataset_and_its_export(name: str, tmp_path: Path) -> None:
    """recognise -> load -> recorded by prepare -> loaded from the recorded copy -> exported where supported."""
    spec = SPECS[name](tmp_path)
    kind = TOKENIZER_KINDS[name]
    files = kind.recognise(spec)
    assert files is not None and next(k for k in TOKENIZER_KINDS.values() if k.recognise(spec) is not None) is kind
    tok = load_tokenizer(spec)
    assert tok.kind == name
    text = tmp_path / "doc.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    ds = prepare_corpus([text], tmp_path / "ds", tokenizer=tok).path
    assert json.loads((ds / "meta.json").read_text())["tokenizer"]["kind"] == name
    again = load_tokenizer(ds)  # from the dataset's own copies, recognised by meta.json's kind
    assert type(again) is type(tok) and again.kind == name
    assert all(f.parent == ds / "tokenizer" for f in again.files()) and bool(again.files()) == kind.has_files
    assert (again.vocab_size, again.bos_id, again.eos_id) == (tok.vocab_size, tok.bos_id, tok.eos_id)
    ids = tok.encode_batch(TEXTS)
    for a, b in zip(ids, again.encode_batch(TEXTS), strict=True):
        np.testing.assert_array_equal(a, b)
    out = tmp_path / "hf"
    out.mkdir()
    if kind.export_hf is None:
        with pytest.raises(TokenizerError, match="no Hugging Face form"):
            export_tokenizer(again, out, max_len=64)
        return
    written = export_tokenizer(again, out, max_len=64)
    assert "tokenizer_config.json" in written and "special_tokens_map.json" in written
    if (out / "tokenizer.json").is_file():  # the fast form: the same ids from the exported file
        core = HFCoreTokenizer.from_file(str(out / "tokenizer.json"))
        for text_, want in zip(TEXTS, ids, strict=True):
            assert core.encode(text_, add_special_tokens=False).ids == list(want)
    else:  # SentencePiece: the model itself, byte for byte
        assert (out / "tokenizer.model").read_bytes() == Path(files[0]).read_bytes()
