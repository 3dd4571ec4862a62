"""Import of Megatron-LM indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``, the "MMIDIDX" mmap format) as shards.

The ``.bin`` is the token stream already (Megatron's preprocessing appends EOS per document with ``--append-eod``),
so importing is a chunked copy into ``shard-*.bin`` (converted to uint16 / uint32) plus meta.json; no tokenization.
``.idx``: the magic ``MMIDIDX\\0\\0``, version (u64 = 1), dtype code (u8), sequence count (u64), document count (u64),
then int32 sequence lengths, int64 byte pointers and int64 document starts (sequence indices, first 0).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from pathlib import Path

import numpy as np

from hpcdist.base.atomic import atomic_write
from hpcdist.config.dataset_meta import FORMAT_VERSION, read_meta_json, withdraw_meta, write_meta
from hpcdist.data.prepare import PrepareResult, claim_output, is_intact, own_files
from hpcdist.data.shards import DTYPES, SHARD_PATTERN
from hpcdist.data.tokenizers import Tokenizer, copy_files, describe

__all__ = ["import_megatron", "read_index"]

MAGIC = b"MMIDIDX\x00\x00"
_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}


def read_index(idx: Path) -> tuple[np.dtype, np.ndarray, np.ndarray]:
    """(token dtype, tokens per sequence, document starts) of a Megatron ``.idx`` file; ValueError if it is not one."""
    with open(idx, "rb") as fh:
        head = fh.read(len(MAGIC) + 8 + 1 + 8 + 8)
        if len(head) < len(MAGIC) + 25 or head[: len(MAGIC)] != MAGIC:
            raise ValueError(f"{idx}: not a Megatron index (no {MAGIC!r} header)")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[len(MAGIC) :])
        if version != 1 or code not in _CODES:
            raise ValueError(f"{idx}: unsupported Megatron index version {version} / dtype code {code}")
        sizes = np.fromfile(fh, dtype="<i4", count=n_seq)
        fh.seek(8 * n_seq, os.SEEK_CUR)  # byte pointers: implied by the sizes
        docs = np.fromfile(fh, dtype="<i8", count=n_doc)
    if len(sizes) != n_seq or len(docs) != n_doc:
        raise ValueError(f"{idx}: truncated ({len(sizes)} of {n_seq} sizes, {len(docs)} of {n_doc} document starts)")
    return np.dtype(_CODES[code]).newbyteorder("<"), sizes, docs


def import_megatron(
    prefix: Path,
    out_dir: Path,
    *,
    tokenizer: Tokenizer,
    shard_tokens: int = 2**24,
    dtype: str = "auto",
    overwrite: bool = False,
) -> PrepareResult:
    """``PREFIX.bin`` / ``PREFIX.idx`` -> ``out_dir`` shards + meta.json recording `tokenizer` (the one that made the
    ids: it is checked that every id is below its vocabulary). Idempotent like :func:`prepare_corpus`, and like it
    refuses a non-empty out_dir holding anything else unless `overwrite`."""
    prefix, out_dir = Path(prefix), Path(out_dir)
    bin_path, idx_path = prefix.with_name(prefix.name + ".bin"), prefix.with_name(prefix.name + ".idx")
    for p in (bin_path, idx_path):
        if not p.is_file():
            raise ValueError(f"Megatron dataset {prefix}: {p} does not exist")
    src, sizes, docs = read_index(idx_path)
    if src.kind == "f":
        raise ValueError(f"{idx_path}: float tokens ({src}) are not token ids")
    if dtype == "auto":
        dtype = "uint16" if tokenizer.vocab_size <= 2**16 else "uint32"
    if dtype not in DTYPES or tokenizer.vocab_size > np.iinfo(DTYPES[dtype]).max + 1:
        raise ValueError(f"dtype={dtype!r} cannot hold vocab_size={tokenizer.vocab_size}; use uint32")
    tok_info = describe(tokenizer)
    header = {
        "format": FORMAT_VERSION,
        "megatron": True,
        "dtype": dtype,
        "shard_tokens": shard_tokens,
        "tokenizer": tok_info,
    }
    h = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    for p in (bin_path, idx_path):
        st = os.stat(p)
        h.update(f"\0{os.fspath(p)}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    fingerprint = h.hexdigest()
    if claim_output(out_dir, fingerprint, overwrite) and is_intact(out_dir):
        meta = read_meta_json(out_dir)[0] or {}
        return PrepareResult(out_dir, 1, int(meta["num_documents"]), int(meta["num_tokens"]), up_to_date=True)

    tokens = np.memmap(bin_path, dtype=src, mode="r")
    if len(tokens) != int(sizes.sum(dtype=np.int64)):
        raise ValueError(f"{bin_path}: {len(tokens)} tokens, but {idx_path} counts {int(sizes.sum())}")
    out_dir.mkdir(parents=True, exist_ok=True)
    withdraw_meta(out_dir)  # not complete until the new meta.json
    for stale in own_files(out_dir):
        stale.unlink(missing_ok=True)
    copy_files(tokenizer, out_dir)
    t0 = time.perf_counter()
    shards = []
    for start in range(0, len(tokens), shard_tokens):
        chunk = np.asarray(tokens[start : start + shard_tokens])
        low, high = int(chunk.min()), int(chunk.max())
        if low < 0 or high >= tokenizer.vocab_size:
            bad = high if high >= tokenizer.vocab_size else low
            raise ValueError(
                f"{bin_path}: token id {bad} is outside the {tokenizer.kind} tokenizer's vocabulary "
                f"[0, {tokenizer.vocab_size}): is it the tokenizer that made this dataset?"
            )
        name = SHARD_PATTERN.format(len(shards))
        data = chunk.astype(DTYPES[dtype]).tobytes()
        atomic_write(out_dir / name, data)
        shards.append({"name": name, "tokens": len(chunk), "sha256": hashlib.sha256(data).hexdigest(), "max_id": high})
    meta = {
        "dtype": dtype,
        "vocab_size": int(tokenizer.vocab_size),
        "bos_id": tokenizer.bos_id,
        "eos_id": int(tokenizer.eos_id),
        "shard_tokens": shard_tokens,
        "max_tokens": None,
        "num_tokens": len(tokens),
        "num_documents": max(0, len(docs) - 1),
        "shards": shards,
        "tokenizer": tok_info,
        "imported_from": {"megatron": os.fspath(prefix), "dtype": str(src)},
        "fingerprint": fingerprint,
    }
    write_meta(out_dir, meta)
    return PrepareResult(
        out_dir,
        1,
        meta["num_documents"],
        len(tokens),
        bytes_read=os.path.getsize(bin_path),
        seconds=time.perf_counter() - t0,
    )
