"""Corpora -> token shards (the format of docs/DATA.md), in parallel processes, resumable.

::

    inputs --corpora.iter_documents--> documents --batches of ~1 MB--> worker processes: encode_batch,
    [BOS] doc EOS per document --in batch order--> the main process fills shard-00000.bin, shard-00001.bin ...
    (each written whole through atomic_write) and, after each, progress.json; meta.json is written last.

The token stream does not depend on the number of workers (batches are cut from the documents alone and written in
order). A killed run continues: progress.json names the complete shards and the (batch, token) position after
them; a rerun with the same fingerprint keeps those shards, re-reads the inputs before that position without
re-tokenizing them, and goes on. A changed input or option starts over. Single writer per directory.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from hpcdist.atomic import atomic_write
from hpcdist.data import corpora
from hpcdist.data.shards import DTYPES, FORMAT_VERSION, META_NAME, SHARD_PATTERN, is_complete, read_meta
from hpcdist.data.tokenizers import ByteTokenizer, Tokenizer, copy_files, describe

__all__ = ["PrepareResult", "prepare_corpus", "prepare_shards"]

PROGRESS_NAME = "progress.json"
BATCH_BYTES = 1 << 20  # documents per task: large enough to amortize the pipe, small enough to keep workers busy
BATCH_DOCS = 4096


@dataclass
class PrepareResult:
    """What a prepare did: the directory, counts, input bytes read and tokenized this time, and the time taken."""

    path: Path
    num_inputs: int
    num_documents: int
    num_tokens: int
    bytes_read: int = 0
    seconds: float = 0.0
    kept_shards: int = 0
    up_to_date: bool = False

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.bytes_read / 1e6 / self.seconds if self.seconds > 0 else 0.0


def _fingerprint(inputs: Sequence[Path], header: dict[str, Any]) -> str:
    """Hash of what determines the output: input paths, sizes, mtimes, the options and the tokenizer files."""
    h = hashlib.sha256()
    h.update(json.dumps({"format": FORMAT_VERSION, **header}, sort_keys=True).encode())
    for item in inputs:
        for f in corpora.input_files(item):
            st = os.stat(f)
            h.update(f"\0{os.fspath(f)}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()


# The worker processes' tokenizer: set once per process by the pool initializer (fork: inherited, not pickled).
_WORKER_TOK: Tokenizer | None = None


def _init_worker(tok: Tokenizer) -> None:
    global _WORKER_TOK
    # one thread per worker process: the processes are the parallelism (Rust's thread pool would oversubscribe)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    _WORKER_TOK = tok


def _encode(tok: Tokenizer, docs: list[str | bytes]) -> tuple[np.ndarray, np.ndarray]:
    """([BOS] ids EOS of every document, concatenated; each document's length in that stream)."""
    encoded = tok.encode_batch(docs)
    bos = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    lengths = np.array([len(e) + len(bos) + 1 for e in encoded], dtype=np.int64)
    parts: list[Any] = []
    for e in encoded:
        parts += [bos, e, [tok.eos_id]]
    stream = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]) if parts else np.empty(0, np.int64)
    return stream, lengths


def _encode_in_worker(docs: list[str | bytes]) -> tuple[np.ndarray, np.ndarray]:
    assert _WORKER_TOK is not None, "worker started without its tokenizer"
    return _encode(_WORKER_TOK, docs)


def _batches(inputs: Sequence[Path], text_field: str) -> Iterator[tuple[list[str | bytes], int]]:
    """(documents, input bytes) batches, cut from the documents alone so they are the same on every run."""
    docs: list[str | bytes] = []
    size = 0
    for item in inputs:
        for doc, n in corpora.iter_documents(item, text_field=text_field):
            docs.append(doc)
            size += n
            if size >= BATCH_BYTES or len(docs) >= BATCH_DOCS:
                yield docs, size
                docs, size = [], 0
    if docs:
        yield docs, size


class _Progress:
    """One status line on stderr: redrawn in place on a terminal, every 10 s into a log file."""

    def __init__(self, stream: TextIO | None, total_inputs: int) -> None:
        self.stream, self.total = stream, total_inputs
        self.tty = bool(stream is not None and stream.isatty())
        self.t0 = time.perf_counter()
        self.last = self.t0

    def update(self, *, tokens: int, nbytes: int, shards: int, final: bool = False) -> None:
        if self.stream is None:
            return
        now = time.perf_counter()
        if not final and now - self.last < (0.5 if self.tty else 10.0):
            return
        self.last = now
        dt = max(now - self.t0, 1e-9)
        line = (f"prepare: {nbytes / 1e6:,.1f} MB -> {tokens:,} tokens in {shards} shards  "
                f"{tokens / dt:,.0f} tokens/s  {nbytes / 1e6 / dt:,.2f} MB/s")  # fmt: skip
        end = "\n" if final or not self.tty else ""
        self.stream.write(("\r" if self.tty else "") + line + end)
        self.stream.flush()


def prepare_corpus(
    inputs: Sequence[Path],
    out_dir: Path,
    *,
    tokenizer: Tokenizer | None = None,
    text_field: str = "text",
    shard_tokens: int = 2**24,
    dtype: str = "auto",
    max_tokens: int | None = None,
    workers: int = 1,
    progress: TextIO | None = None,
) -> PrepareResult:
    """Tokenize every document of `inputs` (files or ``datasets`` directories, see :mod:`hpcdist.data.corpora`)
    into ``out_dir``: shards of `shard_tokens` tokens, [BOS] doc EOS per document, plus meta.json (last).

    ``dtype="auto"`` picks uint16 when the vocabulary fits, else uint32. `max_tokens` caps the total (the last
    document is cut). `workers` > 1 tokenizes in that many forked processes; the output is the same. Idempotent
    (returns at once when out_dir holds a complete dataset with the same fingerprint) and resumable (see module)."""
    tok: Tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    inputs = [Path(f) for f in inputs]
    out_dir = Path(out_dir)
    if dtype == "auto":
        dtype = "uint16" if tok.vocab_size <= 2**16 else "uint32"
    problems = []
    if dtype not in DTYPES:
        problems.append(f"dtype={dtype!r} is not supported; use one of {sorted(DTYPES)}")
    elif tok.vocab_size > np.iinfo(DTYPES[dtype]).max + 1:
        problems.append(f"dtype={dtype} cannot hold vocab_size={tok.vocab_size}; use uint32")
    if shard_tokens < 1:
        problems.append(f"shard_tokens must be >= 1, got {shard_tokens}")
    if max_tokens is not None and max_tokens < 1:
        problems.append(f"max_tokens must be >= 1 or None, got {max_tokens}")
    if workers < 1:
        problems.append(f"workers must be >= 1, got {workers}")
    if not inputs:
        problems.append("no input files given")
    if problems:
        raise ValueError("prepare: " + "; ".join(problems))

    tok_info = describe(tok)
    header = {"dtype": dtype, "max_tokens": max_tokens, "shard_tokens": shard_tokens, "text_field": text_field,
              "tokenizer": tok_info}  # fmt: skip
    fingerprint = _fingerprint(inputs, header)
    meta = read_meta(out_dir)
    if meta is not None and meta.get("fingerprint") == fingerprint and is_complete(out_dir, meta):
        return PrepareResult(out_dir, len(inputs), int(meta["num_documents"]), int(meta["num_tokens"]),
                             up_to_date=True)  # fmt: skip

    out_dir.mkdir(parents=True, exist_ok=True)
    # Remove the old meta.json FIRST: from here on the directory must not look complete until we finish.
    (out_dir / META_NAME).unlink(missing_ok=True)
    np_dtype = DTYPES[dtype]
    shards, resume_at = _resumable_shards(out_dir, fingerprint, np_dtype.itemsize)
    keep = {s["name"] for s in shards}
    for stale in {*out_dir.glob("shard-*.bin*"), *out_dir.glob("*.tmp.*")}:
        if stale.name not in keep:
            stale.unlink(missing_ok=True)
    if not shards:
        (out_dir / PROGRESS_NAME).unlink(missing_ok=True)
    copy_files(tok, out_dir)

    t0 = time.perf_counter()
    bar = _Progress(progress, len(inputs))
    buf = np.empty(shard_tokens, dtype=np_dtype)
    fill = 0
    total = sum(int(s["tokens"]) for s in shards)
    num_docs = 0
    bytes_read = 0
    position = [0, 0]  # (batch, tokens of that batch) up to which the token stream is in complete shards

    def flush() -> None:
        nonlocal fill
        name = SHARD_PATTERN.format(len(shards))
        atomic_write(out_dir / name, memoryview(buf[:fill]).cast("B"))
        shards.append({"name": name, "tokens": fill})
        fill = 0
        state = {"fingerprint": fingerprint, "shards": shards, "batch": position[0], "offset": position[1]}
        atomic_write(out_dir / PROGRESS_NAME, json.dumps(state) + "\n")

    def results() -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """(batch index, stream, lengths) in order; batches wholly inside kept shards are counted, not encoded."""
        nonlocal num_docs, bytes_read
        todo = ((b, docs, n) for b, (docs, n) in enumerate(_batches(inputs, text_field)))
        if workers == 1:
            for b, docs, n in todo:
                if b < resume_at[0]:
                    num_docs += len(docs)
                    continue
                bytes_read += n
                yield (b, *_encode(tok, docs))
            return
        # a bounded window of batches in flight: Pool.imap would read the whole corpus ahead into memory
        with multiprocessing.get_context("fork").Pool(workers, initializer=_init_worker, initargs=(tok,)) as pool:
            pending: deque[tuple[int, Any]] = deque()
            for b, docs, n in todo:
                if b < resume_at[0]:
                    num_docs += len(docs)
                    continue
                bytes_read += n
                pending.append((b, pool.apply_async(_encode_in_worker, (docs,))))
                if len(pending) >= 2 * workers:
                    b0, res = pending.popleft()
                    yield (b0, *res.get())
            while pending:
                b0, res = pending.popleft()
                yield (b0, *res.get())

    for b, stream, lengths in results():
        start = resume_at[1] if b == resume_at[0] else 0  # these tokens of the batch are in kept shards
        if max_tokens is not None and len(stream) - start > max_tokens - total:
            cut = start + max_tokens - total
            stream = stream[:cut]
            # the documents that start before the cut contribute (the last one is cut short)
            num_docs += int(np.searchsorted(np.cumsum(lengths), cut, side="left")) + 1
        else:
            num_docs += len(lengths)
        pos = start
        while pos < len(stream):
            take = min(len(stream) - pos, shard_tokens - fill)
            buf[fill : fill + take] = stream[pos : pos + take]
            fill += take
            pos += take
            total += take
            if fill == shard_tokens:
                position[:] = [b, pos] if pos < len(stream) else [b + 1, 0]
                flush()
        bar.update(tokens=total, nbytes=bytes_read, shards=len(shards))
        if max_tokens is not None and total >= max_tokens:
            break
    if fill:
        flush()
    bar.update(tokens=total, nbytes=bytes_read, shards=len(shards), final=True)

    meta = {
        "format": FORMAT_VERSION,
        "dtype": dtype,
        "vocab_size": int(tok.vocab_size),
        "bos_id": tok.bos_id,
        "eos_id": int(tok.eos_id),
        "shard_tokens": shard_tokens,
        "max_tokens": max_tokens,
        "num_tokens": total,
        "num_documents": num_docs,
        "shards": shards,
        "tokenizer": tok_info,
        "text_field": text_field,
        "fingerprint": fingerprint,
    }
    atomic_write(out_dir / META_NAME, (json.dumps(meta, indent=2) + "\n").encode())
    (out_dir / PROGRESS_NAME).unlink(missing_ok=True)
    return PrepareResult(out_dir, len(inputs), num_docs, total, bytes_read=bytes_read,
                         seconds=time.perf_counter() - t0, kept_shards=len(keep))  # fmt: skip


def _resumable_shards(out_dir: Path, fingerprint: str, itemsize: int) -> tuple[list[dict[str, Any]], tuple[int, int]]:
    """The complete shards of an interrupted run with this fingerprint, and the (batch, offset) after them."""
    try:
        state = json.loads((out_dir / PROGRESS_NAME).read_text(encoding="utf-8"))
        if state.get("fingerprint") != fingerprint:
            return [], (0, 0)
        shards = [{"name": str(s["name"]), "tokens": int(s["tokens"])} for s in state["shards"]]
        if not all(os.path.getsize(out_dir / s["name"]) == s["tokens"] * itemsize for s in shards):
            return [], (0, 0)
        return shards, (int(state["batch"]), int(state["offset"]))
    except (OSError, ValueError, KeyError, TypeError):  # none, torn or foreign: start over
        return [], (0, 0)


def prepare_shards(
    files: Sequence[Path],
    out_dir: Path,
    *,
    shard_tokens: int = 2**24,
    dtype: str = "uint16",
    max_tokens: int | None = None,
    tokenizer: Tokenizer | None = None,
) -> Path:
    """Tokenize `files` (one document each, EOS after each; byte-level by default) into shards + meta.json.

    The embedded corpus's entry point: :func:`prepare_corpus` in one process, returning the directory."""
    return prepare_corpus(files, out_dir, tokenizer=tokenizer, shard_tokens=shard_tokens, dtype=dtype,
                   max_tokens=max_tokens).path  # fmt: skip
