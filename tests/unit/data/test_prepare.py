"""hpcdist.data.prepare + corpora: text, jsonl, jsonl.gz, parquet and datasets inputs through a BPE tokenizer trained by
the tool; EOS between documents; parallel workers; resume after a kill; the tokenizer recorded with the data."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest

from hpcdist.data import ByteTokenizer, TokenDataset, load_tokenizer, prepare_corpus, train_bpe
from hpcdist.data import prepare as prepare_mod
from hpcdist.data.corpora import CorpusError
from tests.unit.harness import hpcdist

DOCS = [
    "def f(x):\n    return x + 1\n",
    "café ☃ naïve résumé 🚀 — unicode survives",
    "",
    "the quick brown fox jumps over the lazy dog " * 5,
    '{"json": "inside"}\nsecond line\n',
] + [f"document {i}: " + "lorem ipsum dolor sit amet " * (i % 7) for i in range(40)]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tok")
    (root / "train.txt").write_text("\n".join(DOCS), encoding="utf-8")
    train_bpe([root / "train.txt"], vocab_size=320, out_dir=root / "tok")
    return root / "tok"


def _write(fmt: str, root: Path, docs: list[str] = DOCS) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    if fmt == "text":
        paths = [root / f"doc-{k:03d}.txt" for k in range(len(docs))]
        for p, d in zip(paths, docs, strict=True):
            p.write_text(d, encoding="utf-8")
        return paths
    lines = "".join(json.dumps({"text": d, "id": k}) + "\n" for k, d in enumerate(docs))
    if fmt == "jsonl":
        (root / "a.jsonl").write_text(lines, encoding="utf-8")
        return [root / "a.jsonl"]
    if fmt == "jsonl.gz":
        with gzip.open(root / "a.jsonl.gz", "wt", encoding="utf-8") as fh:
            fh.write(lines)
        return [root / "a.jsonl.gz"]
    if fmt == "parquet":
        pa = pytest.importorskip("pyarrow")
        pq = pytest.importorskip("pyarrow.parquet")
        pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), root / "a.parquet", row_group_size=7)
        return [root / "a.parquet"]
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(root / "hf"))
    return [root / "hf"]


def _stream(out: Path) -> np.ndarray:
    meta = json.loads((out / "meta.json").read_text())
    dt = {"uint16": "<u2", "uint32": "<u4"}[meta["dtype"]]
    return np.concatenate([np.fromfile(out / s["name"], dtype=dt) for s in meta["shards"]]).astype(np.int64)


@pytest.mark.parametrize("fmt", ["text", "jsonl", "jsonl.gz", "parquet", "datasets"])
def test_every_format_roundtrips_with_eos_between_documents(fmt: str, tok_dir: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(tok_dir)
    res = prepare_corpus(_write(fmt, tmp_path / "in"), tmp_path / "ds", tokenizer=tok, shard_tokens=64)
    meta = json.loads((res.path / "meta.json").read_text())
    stream = _stream(res.path)
    # shard token counts add up to what the tokenizer itself gives: every document plus its EOS
    expected = sum(len(ids) + 1 for ids in tok.encode_batch(DOCS))
    assert sum(s["tokens"] for s in meta["shards"]) == meta["num_tokens"] == res.num_tokens == expected == len(stream)
    assert meta["num_documents"] == res.num_documents == len(DOCS)
    assert all(s["tokens"] == 64 for s in meta["shards"][:-1])
    # document boundaries are exactly where the EOS ids are, and each document decodes back to itself
    eos = np.flatnonzero(stream == tok.eos_id)
    assert len(eos) == len(DOCS) and eos[-1] == len(stream) - 1
    pieces = np.split(stream, eos + 1)[:-1]
    assert [tok.decode(p[:-1]) for p in pieces] == DOCS
    # the data names (and carries) its tokenizer: training and export load the same one from the directory
    assert meta["vocab_size"] == 320 and meta["eos_id"] == tok.eos_id and meta["tokenizer"]["kind"] == "hf"
    assert set(meta["tokenizer"]["files"]) == {"tokenizer.json", "tokenizer_config.json"}
    again = load_tokenizer(res.path)
    np.testing.assert_array_equal(again.encode_batch(DOCS[:2])[1], tok.encode_batch(DOCS[:2])[1])
    assert TokenDataset(res.path, seq_len=15).vocab_size == 320


def test_bos_starts_every_document_when_the_tokenizer_has_one(tmp_path: Path) -> None:
    class WithBos(ByteTokenizer):
        add_bos = True

    res = prepare_corpus(_write("jsonl", tmp_path / "in", DOCS[:3]), tmp_path / "ds", tokenizer=WithBos())
    stream = _stream(res.path)
    want = np.concatenate([[256, *d.encode(), 257] for d in DOCS[:3]])
    np.testing.assert_array_equal(stream, want)


def test_workers_write_the_same_shards(tok_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prepare_mod, "BATCH_DOCS", 4)  # many batches in flight at once
    inputs = _write("jsonl", tmp_path / "in")
    one = prepare_corpus(inputs, tmp_path / "one", tokenizer=load_tokenizer(tok_dir), shard_tokens=50)
    two = prepare_corpus(inputs, tmp_path / "two", tokenizer=load_tokenizer(tok_dir), shard_tokens=50, workers=2)
    np.testing.assert_array_equal(_stream(one.path), _stream(two.path))
    assert json.loads((one.path / "meta.json").read_text()) == json.loads((two.path / "meta.json").read_text())


def test_killed_prepare_resumes_keeping_complete_shards(
    tok_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prepare_mod, "BATCH_DOCS", 3)  # shards end mid-batch: the resume offset matters
    inputs = _write("jsonl", tmp_path / "in")
    tok = load_tokenizer(tok_dir)
    reference = _stream(prepare_corpus(inputs, tmp_path / "ref", tokenizer=tok, shard_tokens=37).path)

    real = prepare_mod.atomic_write
    shards_written: list[str] = []

    def killed_after_four_shards(path: Path, payload: object, **kw: object) -> Path:
        if Path(path).name.startswith("shard-"):
            if len(shards_written) == 4:
                raise KeyboardInterrupt("killed")
            shards_written.append(Path(path).name)
        return real(path, payload, **kw)

    monkeypatch.setattr(prepare_mod, "atomic_write", killed_after_four_shards)
    with pytest.raises(KeyboardInterrupt):
        prepare_corpus(inputs, tmp_path / "ds", tokenizer=tok, shard_tokens=37, workers=2)
    monkeypatch.setattr(prepare_mod, "atomic_write", real)
    out = tmp_path / "ds"
    assert not (out / "meta.json").exists()
    for name in shards_written:
        os.utime(out / name, ns=(10**9, 10**9))
    res = prepare_corpus(inputs, out, tokenizer=tok, shard_tokens=37)
    assert res.kept_shards == 4
    assert all((out / name).stat().st_mtime_ns == 10**9 for name in shards_written)  # kept, not rewritten
    np.testing.assert_array_equal(_stream(out), reference)
    assert not (out / "progress.json").exists()
    assert json.loads((out / "meta.json").read_text())["num_documents"] == len(DOCS)


def test_input_problems_name_the_file_and_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = _write("jsonl", tmp_path / "in", DOCS[:2])
    with pytest.raises(CorpusError, match=r"a\.jsonl:1: no field 'body' \(has: text, id\); choose one with --text-f"):
        prepare_corpus(inputs, tmp_path / "ds", text_field="body")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(CorpusError, match=r"bad\.jsonl:2: not a JSON line"):
        prepare_corpus([tmp_path / "bad.jsonl"], tmp_path / "ds2")
    monkeypatch.setitem(__import__("sys").modules, "pyarrow.parquet", None)  # as if the extra were not installed
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    with pytest.raises(CorpusError, match=r"needs pyarrow: pip install 'hpcdist\[data\]'"):
        prepare_corpus([tmp_path / "x.parquet"], tmp_path / "ds3")


def test_cli_prepare_jsonl_with_a_trained_tokenizer(tok_dir: Path, tmp_path: Path) -> None:
    _write("jsonl", tmp_path / "in")
    _write("text", tmp_path / "in" / "txt", DOCS[:2])
    proc = hpcdist("prepare", tmp_path / "in", "--tokenizer", tok_dir, "--out", tmp_path / "ds", "--workers", "2")
    assert proc.returncode == 0, proc.stderr
    assert f"prepared 3 files into {tmp_path / 'ds'}: {len(DOCS) + 2} documents" in proc.stdout
    assert "tokens/s" in proc.stdout and "MB/s" in proc.stdout and "tokenizer hf, vocab 320" in proc.stdout
    assert "tokens/s" in proc.stderr  # the progress line
    again = hpcdist("prepare", tmp_path / "in", "--tokenizer", tok_dir, "--out", tmp_path / "ds")
    assert again.returncode == 0 and "already up to date" in again.stdout
    bad = hpcdist("prepare", tmp_path / "in", "--tokenizer", tmp_path / "nope.json", "--out", tmp_path / "x")
    assert bad.returncode != 0 and bad.stderr.startswith("hpcdist: prepare: tokenizer") and "no such file" in bad.stderr
