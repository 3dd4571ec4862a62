"""Corpora -> token shards (the format of docs/DATA.md), in parallel processes, resumable.

::

    inputs --corpora.iter_documents--> documents --batches of ~1 MB--> worker processes: encode_batch,
    [BOS] doc EOS per document --in batch order--> the main process fills shard-00000.bin, shard-00001.bin ...
    (each written whole through atomic_write) and, after each, a line of progress.jsonl; meta.json is written last,
    recording each shard's token count, sha256 and largest id (what readers check before training).

The token stream does not depend on the number of workers (batches are cut from the documents alone and written in
order). A killed run continues: progress.jsonl names the complete shards (with their sha256) and the (batch, token)
position after them; a rerun with the same fingerprint keeps the shards that still match, re-reads the inputs before
that position without re-tokenizing them, and goes on. An output directory holding anything else (another dataset,
another unfinished preparation, other files) is refused unless ``overwrite``: prepare never deletes a dataset the
user did not name. Single writer per directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from hpcdist.base.atomic import atomic_write
from hpcdist.base.untrusted import DamagedRecord, read_jsonl_prefix
from hpcdist.config.dataset_meta import (
    FORMAT_VERSION,
    META_NAME,
    DataError,
    check_shard_files,
    load_meta,
    open_regular,
    read_meta_json,
    withdraw_meta,
    write_meta,
)
from hpcdist.data import corpora
from hpcdist.data.shards import DTYPES, SHARD_PATTERN, verify_shard
from hpcdist.data.slices import Piece, iter_piece
from hpcdist.data.tokenizers import TOKENIZER_DIR, ByteTokenizer, Tokenizer, copy_files, describe

__all__ = ["PrepareRefused", "PrepareResult", "prepare_corpus", "prepare_shards"]


class PrepareRefused(DataError):
    """The output directory holds something prepare would have to delete: one line naming it and the options (a
    ConfigError, so ``hpcdist train`` preparing data.source=stdlib into a user's data.path prints it as one)."""

    def __init__(self, message: str) -> None:
        super().__init__([message])


PROGRESS_NAME = "progress.jsonl"
LEGACY_PROGRESS = "progress.json"  # older, still read: rewritten whole after every shard (quadratic)
_FINGERPRINT_BYTES = 1 << 16  # the progress log's first line: the fingerprint and options, never near this
# what a resume reads of progress.jsonl: ~150 bytes a shard, so ~400,000 shards; the shards after it are made again
_PROGRESS_MAX_BYTES = 64 << 20
# Shards smaller than this are written without an fsync each (thousands of tiny shards would spend minutes in
# fsync): the sha256 recorded for every shard tells a torn one apart, on resume and in every reader.
DURABLE_SHARD_BYTES = 1 << 20
# How long an early stop waits for the worker tasks still in flight before it gives up on them (a worker killed by the
# OOM killer never returns its task).
DRAIN_TIMEOUT_S = 300.0
BATCH_BYTES = 1 << 20  # documents per task: large enough to amortize the pipe, small enough to keep workers busy
BATCH_DOCS = 4096
# Called with the number of complete shards after each one is recorded (the cluster prepare's kill test hook: a task
# killed right after its first shard); None in normal runs.
AFTER_SHARD: Callable[[int], None] | None = None


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


def _fingerprint(inputs: Sequence[Path | Piece], header: dict[str, Any]) -> str:
    """Hash of what determines the output: input paths, sizes, mtimes, the options and the tokenizer files."""
    h = hashlib.sha256()
    h.update(json.dumps({"format": FORMAT_VERSION, **header}, sort_keys=True).encode())
    for item in inputs:
        if isinstance(item, Piece):  # a slice of an input (a cluster prepare's part): which part of it too
            h.update(f"\0{item.kind}\0{item.start}\0{item.end}".encode())
        for f in corpora.input_files(Path(item.path) if isinstance(item, Piece) else item):
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
    """([BOS] ids EOS of every document, concatenated, as uint32 (half the memory and pipe traffic of int64); each
    document's length in that stream)."""
    if isinstance(tok, ByteTokenizer):  # uint16 bytes straight from the buffer: no int64 copy of a 100 MB document
        encoded: list[np.ndarray] = [tok.encode(d, eos=False) for d in docs]
    else:
        encoded = tok.encode_batch(docs)
    nb = 1 if tok.add_bos and tok.bos_id is not None else 0
    lengths = np.fromiter((len(e) + nb + 1 for e in encoded), dtype=np.int64, count=len(encoded))
    stream = np.empty(int(lengths.sum()), dtype=np.uint32)
    pos = 0
    for e, n in zip(encoded, lengths.tolist(), strict=True):
        if nb:
            stream[pos] = tok.bos_id
        stream[pos + nb : pos + n - 1] = e
        stream[pos + n - 1] = tok.eos_id
        pos += n
    return stream, lengths


def _encode_in_worker(docs: list[str | bytes]) -> tuple[np.ndarray, np.ndarray]:
    assert _WORKER_TOK is not None, "worker started without its tokenizer"
    return _encode(_WORKER_TOK, docs)


def _batches(inputs: Sequence[Path | Piece], text_field: str) -> Iterator[tuple[list[str | bytes], int]]:
    """(documents, input bytes) batches, cut from the documents alone so they are the same on every run."""
    docs: list[str | bytes] = []
    size = 0
    for item in inputs:
        documents = (
            iter_piece(item, text_field=text_field)
            if isinstance(item, Piece)
            else corpora.iter_documents(item, text_field=text_field)
        )
        for doc, n in documents:
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
        line = (
            f"prepare: {nbytes / 1e6:,.1f} MB -> {tokens:,} tokens in {shards} shards  "
            f"{tokens / dt:,.0f} tokens/s  {nbytes / 1e6 / dt:,.2f} MB/s"
        )
        end = "\n" if final or not self.tty else ""
        self.stream.write(("\r" if self.tty else "") + line + end)
        self.stream.flush()


def prepare_corpus(
    inputs: Sequence[Path | Piece],
    out_dir: Path,
    *,
    tokenizer: Tokenizer | None = None,
    text_field: str = "text",
    shard_tokens: int = 2**24,
    dtype: str = "auto",
    max_tokens: int | None = None,
    workers: int = 1,
    progress: TextIO | None = None,
    overwrite: bool = False,
) -> PrepareResult:
    """Tokenize every document of `inputs` (files or ``datasets`` directories, see :mod:`hpcdist.data.corpora`)
    into ``out_dir``: shards of `shard_tokens` tokens, [BOS] doc EOS per document, plus meta.json (last).

    ``dtype="auto"`` picks uint16 when the vocabulary fits, else uint32. `max_tokens` caps the total (the last
    document is cut). `workers` > 1 tokenizes in that many forked processes; the output is the same. Idempotent
    (returns at once when out_dir holds a complete, intact dataset with the same fingerprint) and resumable (see
    module). A non-empty out_dir holding anything else raises :class:`PrepareRefused` unless `overwrite` (which
    replaces prepare's own files there: shards, meta.json, progress, and nothing else)."""
    tok: Tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    inputs = [f if isinstance(f, Piece) else Path(f) for f in inputs]
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
    header = {
        "dtype": dtype,
        "max_tokens": max_tokens,
        "shard_tokens": shard_tokens,
        "text_field": text_field,
        "tokenizer": tok_info,
    }
    fingerprint = _fingerprint(inputs, header)
    if claim_output(out_dir, fingerprint, overwrite) and is_intact(out_dir):
        meta = read_meta_json(out_dir)[0] or {}
        return PrepareResult(out_dir, len(inputs), int(meta["num_documents"]), int(meta["num_tokens"]), up_to_date=True)

    out_dir.mkdir(parents=True, exist_ok=True)
    # Remove the old meta.json FIRST: from here on the directory must not look complete until we finish.
    withdraw_meta(out_dir)
    np_dtype = DTYPES[dtype]
    shards, resume_at, good_bytes = _resumable_shards(out_dir, fingerprint, dtype)
    kept = len(shards)
    keep = {s["name"] for s in shards} | ({PROGRESS_NAME} if shards else set())
    for stale in own_files(out_dir):
        if stale.name not in keep:
            stale.unlink(missing_ok=True)
    copy_files(tok, out_dir)
    durable = shard_tokens * np_dtype.itemsize >= DURABLE_SHARD_BYTES
    # Append-only: one line per shard (rewriting the whole list after every shard was quadratic in the shard count).
    log_fd = os.open(out_dir / PROGRESS_NAME, os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)
    os.ftruncate(log_fd, good_bytes)  # a resume continues after the last good line (a torn one is dropped)
    os.lseek(log_fd, good_bytes, os.SEEK_SET)
    progress_log = os.fdopen(log_fd, "w", encoding="utf-8")
    if not shards:
        progress_log.write(json.dumps({"fingerprint": fingerprint}) + "\n")
        progress_log.flush()

    t0 = time.perf_counter()
    bar = _Progress(progress, len(inputs))
    buf = np.empty(shard_tokens, dtype=np_dtype)
    fill = 0
    total = sum(int(s["tokens"]) for s in shards)
    num_docs = 0
    bytes_read = 0
    position = [0, 0]  # (batch, tokens of that batch) up to which the token stream is in complete shards

    def flush(chunk: np.ndarray) -> None:
        nonlocal fill
        name = SHARD_PATTERN.format(len(shards))
        data = memoryview(buf[:fill]).cast("B")
        top = int(chunk.max()) if len(chunk) else 0
        atomic_write(out_dir / name, data, durable=durable)
        entry = {"name": name, "tokens": fill, "sha256": hashlib.sha256(data).hexdigest(), "max_id": top}
        shards.append(entry)
        fill = 0
        progress_log.write(json.dumps({**entry, "batch": position[0], "offset": position[1]}) + "\n")
        progress_log.flush()
        if AFTER_SHARD is not None:
            AFTER_SHARD(len(shards))

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
        pool = multiprocessing.get_context("fork").Pool(workers, initializer=_init_worker, initargs=(tok,))
        pending: deque[tuple[int, Any]] = deque()
        try:
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
        finally:
            _shutdown(pool, pending)

    try:
        with contextlib.closing(results()) as stream_of_batches:  # closed at once on --max-tokens' early stop
            for b, stream, lengths in stream_of_batches:
                start = resume_at[1] if b == resume_at[0] else 0  # these tokens of the batch are in kept shards
                top = int(stream.max()) if len(stream) else 0
                if top >= tok.vocab_size:  # a tokenizer breaking its contract: never write (or wrap) an id past it
                    raise ValueError(
                        f"the {tok.kind} tokenizer produced token id {top}, past its vocab_size={tok.vocab_size}"
                    )
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
                        flush(buf[:fill])
                bar.update(tokens=total, nbytes=bytes_read, shards=len(shards))
                if max_tokens is not None and total >= max_tokens:
                    break
        if fill:
            flush(buf[:fill])
    finally:
        progress_log.close()
    bar.update(tokens=total, nbytes=bytes_read, shards=len(shards), final=True)

    meta = {
        "dtype": dtype,
        "vocab_size": int(tok.vocab_size),
        "bos_id": tok.bos_id,
        "eos_id": int(tok.eos_id),
        "shard_tokens": shard_tokens,
        "max_tokens": max_tokens,
        "num_tokens": total,
        "num_documents": num_docs,
        "max_id": max((int(s["max_id"]) for s in shards), default=0),
        "shards": shards,
        "tokenizer": tok_info,
        "text_field": text_field,
        "fingerprint": fingerprint,
    }
    write_meta(out_dir, meta)
    (out_dir / PROGRESS_NAME).unlink(missing_ok=True)
    return PrepareResult(
        out_dir, len(inputs), num_docs, total, bytes_read=bytes_read, seconds=time.perf_counter() - t0, kept_shards=kept
    )


def _shutdown(pool: Any, pending: deque[tuple[int, Any]]) -> None:
    """Stop the worker pool without Pool.terminate() while tasks are in flight: terminate's _help_stuff_finish takes
    the task queue's read lock and drains the pipe while the task handler may still be writing a batch (~1 MB, more
    than the pipe holds) into it, and then waits for that thread forever (1 run in 6 hung when
    --max-tokens stopped the reading early). So the few tasks in flight (at most 2 per worker) finish, and the
    workers leave on close()'s sentinels."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    for _, res in pending:
        res.wait(max(0.0, deadline - time.monotonic()))
    if all(res.ready() for _, res in pending):
        pool.close()
        pool.join()
    else:  # a worker died with its task (the OOM killer): nothing is in flight any more, terminate is the only way
        pool.terminate()


def own_files(out_dir: Path) -> list[Path]:
    """The files prepare writes in a dataset directory (shards, meta.json, progress, atomic_write's temporary files):
    the only ones it ever deletes."""
    names = [META_NAME, PROGRESS_NAME, LEGACY_PROGRESS]
    found = [out_dir / n for n in names if (out_dir / n).is_file() or (out_dir / n).is_symlink()]
    found += [p for p in out_dir.glob("shard-*.bin") if len(p.name) == len(SHARD_PATTERN.format(0))]
    found += [*out_dir.glob(".shard-*.bin.*.tmp"), *out_dir.glob(f".{META_NAME}.*.tmp")]
    return found


def _progress_fingerprint(out_dir: Path) -> str | None:
    """The fingerprint of an unfinished preparation in out_dir (progress.jsonl's first line, or an older
    progress.json), or None."""
    for name in (PROGRESS_NAME, LEGACY_PROGRESS):  # the older one is a single line too
        try:
            head = read_jsonl_prefix(out_dir / name, _FINGERPRINT_BYTES)
        except DamagedRecord:
            continue
        if head and isinstance(head[0][0].get("fingerprint"), str):
            return head[0][0]["fingerprint"]
    return None


def claim_output(out_dir: Path, fingerprint: str, overwrite: bool) -> bool:
    """May this preparation write into out_dir? True when out_dir holds a dataset with this very fingerprint
    (possibly up to date). PrepareRefused when out_dir holds anything that is not this preparation's, unless
    `overwrite` (a different input must never delete the dataset there, silently)."""
    if not out_dir.exists():
        return False
    if not out_dir.is_dir():
        raise PrepareRefused(f"--out {out_dir} is not a directory")
    meta = read_meta_json(out_dir)[0]
    if meta is not None and meta.get("fingerprint") == fingerprint:
        return True
    if _progress_fingerprint(out_dir) == fingerprint or overwrite:
        return False
    # what a preparation leaves before its first progress line (the copied tokenizer, a temporary file) is no one's
    leftover = {TOKENIZER_DIR} | {p.name for p in own_files(out_dir) if p.name.endswith(".tmp")}
    entries = sorted(p.name for p in out_dir.iterdir() if p.name not in leftover)
    if not entries:
        return False
    if meta is not None:
        what = f"a prepared dataset ({meta.get('num_tokens', '?')} tokens) made from other inputs, options or tokenizer"
    elif _progress_fingerprint(out_dir) is not None:
        what = "an unfinished preparation of other inputs, options or tokenizer"
    else:
        shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
        what = f"files prepare did not write ({shown})"
    raise PrepareRefused(
        f"--out {out_dir} is not empty: it holds {what}; prepare would replace it. Give a new "
        "--out, or add --overwrite to replace the dataset there (only prepare's own files: "
        "shards, meta.json, progress)"
    )


def is_intact(out_dir: Path) -> bool:
    """out_dir's dataset is complete and every shard matches its recorded sha256 and ids (one read: still far less
    than tokenizing again); a dataset without checksums is prepared again to record them."""
    try:
        meta = load_meta(out_dir)
        check_shard_files(meta)
        if not meta.checksummed:
            return False
        for k in range(len(meta.shards)):
            verify_shard(meta, k)
    except DataError:
        return False
    return True


def _resumable_shards(out_dir: Path, fingerprint: str, dtype: str) -> tuple[list[dict[str, Any]], tuple[int, int], int]:
    """The complete, intact shards of an interrupted run with this fingerprint, the (batch, offset) after them, and
    the bytes of progress.jsonl that describe them. A torn line or a shard that no longer matches its sha256 (a crash
    before it reached the disk) ends the list there."""
    try:
        records = read_jsonl_prefix(out_dir / PROGRESS_NAME, _PROGRESS_MAX_BYTES)
    except DamagedRecord:
        return [], (0, 0), 0
    if not records or records[0][0].get("fingerprint") != fingerprint:
        return [], (0, 0), 0
    itemsize = DTYPES[dtype].itemsize
    shards: list[dict[str, Any]] = []
    at, good = (0, 0), records[0][1]
    for rec, end in records[1:]:
        try:
            entry = {
                "name": str(rec["name"]),
                "tokens": int(rec["tokens"]),
                "sha256": str(rec["sha256"]),
                "max_id": int(rec["max_id"]),
            }
            step = (int(rec["batch"]), int(rec["offset"]))
        except (ValueError, KeyError, TypeError):
            break
        if entry["name"] != SHARD_PATTERN.format(len(shards)) or not _shard_matches(out_dir, entry, itemsize):
            break
        shards.append(entry)
        at, good = step, end
    return (shards, at, good) if shards else ([], (0, 0), 0)


def _shard_matches(out_dir: Path, entry: dict[str, Any], itemsize: int) -> bool:
    try:
        fd = open_regular(out_dir / entry["name"])
    except OSError:
        return False
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(entry["tokens"] * itemsize + 1)
    return len(data) == entry["tokens"] * itemsize and hashlib.sha256(data).hexdigest() == entry["sha256"]


def prepare_shards(
    files: Sequence[Path],
    out_dir: Path,
    *,
    shard_tokens: int = 2**24,
    dtype: str = "uint16",
    max_tokens: int | None = None,
    tokenizer: Tokenizer | None = None,
    overwrite: bool = False,
) -> Path:
    """Tokenize `files` (one document each, EOS after each; byte-level by default) into shards + meta.json.

    The embedded corpus's entry point: :func:`prepare_corpus` in one process, returning the directory."""
    return prepare_corpus(
        files,
        out_dir,
        tokenizer=tokenizer,
        shard_tokens=shard_tokens,
        dtype=dtype,
        max_tokens=max_tokens,
        overwrite=overwrite,
    ).path
