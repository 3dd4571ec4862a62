"""Import of a Megatron-LM indexed dataset (PREFIX.bin + PREFIX.idx) as prepared shards."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from hpcdist.data import ByteTokenizer, TokenDataset
from hpcdist.data.megatron import import_megatron, read_index
from tests.unit.harness import hpcdist

DOCS = [[104, 105, 257], [1, 2, 3, 4, 257], [200, 257]]  # byte ids, EOS-terminated as --append-eod writes them


def _write_megatron(prefix: Path, docs: list[list[int]], code: int = 4, dtype: str = "<i4") -> None:
    """The MMIDIDX layout: header, int32 sizes, int64 byte pointers, int64 document starts (n_docs + 1)."""
    tokens = np.concatenate([np.asarray(d) for d in docs]).astype(dtype)
    tokens.tofile(prefix.with_name(prefix.name + ".bin"))
    sizes = np.array([len(d) for d in docs], dtype="<i4")
    pointers = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype("<i8") * np.dtype(dtype).itemsize
    doc_idx = np.arange(len(docs) + 1, dtype="<i8")
    with open(prefix.with_name(prefix.name + ".idx"), "wb") as fh:
        fh.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(sizes), len(doc_idx)))
        fh.write(sizes.tobytes() + pointers.tobytes() + doc_idx.tobytes())


def test_import_copies_the_stream_and_records_the_tokenizer(tmp_path: Path) -> None:
    _write_megatron(tmp_path / "corpus_text_document", DOCS)
    dtype, sizes, docs = read_index(tmp_path / "corpus_text_document.idx")
    assert dtype == np.dtype("<i4") and list(sizes) == [3, 5, 2] and len(docs) == 4
    res = import_megatron(tmp_path / "corpus_text_document", tmp_path / "ds", tokenizer=ByteTokenizer(), shard_tokens=4)
    meta = json.loads((res.path / "meta.json").read_text())
    stream = np.concatenate([np.fromfile(res.path / s["name"], dtype="<u2") for s in meta["shards"]])
    assert stream.tolist() == [t for d in DOCS for t in d]
    assert (meta["num_tokens"], meta["num_documents"], meta["dtype"], meta["vocab_size"]) == (10, 3, "uint16", 258)
    assert meta["tokenizer"]["kind"] == "byte" and meta["imported_from"]["dtype"] == "int32"
    assert TokenDataset(res.path, seq_len=3)[0].tolist() == [104, 105, 257, 1]
    again = import_megatron(
        tmp_path / "corpus_text_document", tmp_path / "ds", tokenizer=ByteTokenizer(), shard_tokens=4
    )
    assert again.up_to_date
    # another Megatron dataset into the same directory: refused, unless --overwrite
    _write_megatron(tmp_path / "other", [[7, 8, 9]])
    with pytest.raises(ValueError, match="is not empty: it holds a prepared dataset"):
        import_megatron(tmp_path / "other", tmp_path / "ds", tokenizer=ByteTokenizer(), shard_tokens=4)
    assert json.loads((res.path / "meta.json").read_text())["num_tokens"] == 10
    res = import_megatron(tmp_path / "other", res.path, tokenizer=ByteTokenizer(), shard_tokens=4, overwrite=True)
    assert json.loads((res.path / "meta.json").read_text())["num_tokens"] == 3


def test_ids_beyond_the_tokenizer_and_bad_files_are_refused(tmp_path: Path) -> None:
    _write_megatron(tmp_path / "big", [[1, 2, 5000]], code=8, dtype="<u2")
    with pytest.raises(ValueError, match=r"token id 5000 is outside the byte tokenizer's vocabulary \[0, 258\)"):
        import_megatron(tmp_path / "big", tmp_path / "ds", tokenizer=ByteTokenizer())
    assert not (tmp_path / "ds" / "meta.json").exists()
    (tmp_path / "junk.idx").write_bytes(b"not an index at all, really not")
    (tmp_path / "junk.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a Megatron index"):
        import_megatron(tmp_path / "junk", tmp_path / "ds2", tokenizer=ByteTokenizer())
    with pytest.raises(ValueError, match=r"missing\.bin does not exist"):
        import_megatron(tmp_path / "missing", tmp_path / "ds3", tokenizer=ByteTokenizer())


def test_cli_prepare_megatron(tmp_path: Path) -> None:
    _write_megatron(tmp_path / "c", DOCS)
    proc = hpcdist("prepare", "--megatron", tmp_path / "c", "--tokenizer", "byte", "--out", tmp_path / "ds")
    assert proc.returncode == 0, proc.stderr
    assert (
        "imported Megatron dataset" in proc.stdout
        and "3 documents, 10 tokens (tokenizer byte, vocab 258)" in proc.stdout
    )
