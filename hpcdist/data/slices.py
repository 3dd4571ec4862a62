"""Deterministic slices of a corpus, for a prepare spread over a SLURM job array.

The inputs are laid end to end in a weight space (their sizes in bytes); slice i of N takes what starts in
``[i*W//N, (i+1)*W//N)``:

* ``jsonl``: split anywhere, by byte range: a slice reads the lines whose first byte lies in its range (a reader
  starting inside a line skips to the next one; one that reaches its end finishes the line it is in);
* ``jsonl.gz`` with several gzip members (``cat a.gz b.gz``, ``pigz --independent``-style, BGZF): split at member
  boundaries, found by one inflating pass over the file (only files larger than half a slice are scanned; a file of
  one member is one unit);
* ``parquet``: split at row groups (weighted by their compressed size);
* anything else (a text file, a ``datasets`` directory): one unit, in the slice where it starts.

Every document belongs to exactly one slice and the slices are in input order, so the slices' token streams,
concatenated, are the one-machine prepare's stream, whatever N (the tokenizers encode each document alone).
"""

from __future__ import annotations

import gzip
import io
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hpcdist.data import corpora
from hpcdist.data.corpora import MAX_LINE_BYTES, CorpusError

__all__ = ["Piece", "gzip_members", "iter_piece", "plan_slices"]

# A gzip file is scanned for member boundaries only when it is larger than this share of a slice: a small file is
# one unit anyway, and the scan inflates the whole file once.
SCAN_SHARE = 0.5
_READ = 1 << 20


@dataclass(frozen=True)
class Piece:
    """A part of one input: ``kind`` jsonl (bytes [start, end)), jsonl.gz (the members starting in bytes
    [start, end)), parquet (row groups [start, end)), or whole (the input itself; start = end = 0)."""

    path: str
    kind: str
    start: int = 0
    end: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Any) -> Piece:
        """A piece from a plan file (our own, but in a directory others may write: validated)."""
        if not isinstance(d, dict) or set(d) != {"path", "kind", "start", "end"}:
            raise ValueError(f"not a piece: {str(d)[:200]}")
        ok = isinstance(d["path"], str) and d["kind"] in ("jsonl", "jsonl.gz", "parquet", "whole")
        ok = ok and all(isinstance(d[k], int) and not isinstance(d[k], bool) and d[k] >= 0 for k in ("start", "end"))
        if not ok or d["end"] < d["start"]:
            raise ValueError(f"not a piece: {str(d)[:200]}")
        return cls(d["path"], d["kind"], d["start"], d["end"])


def gzip_members(path: Path) -> list[int]:
    """The byte offsets at which the gzip members of ``path`` start (one inflating pass; memory bounded by the read
    size). CorpusError for a damaged or truncated file."""
    starts = [0]
    base = 0  # file offset of buf[0]
    d = zlib.decompressobj(31)
    buf = b""
    started = False
    with open(path, "rb") as fh:
        while True:
            if not buf:
                buf = fh.read(_READ)
                if not buf:
                    break
            try:
                d.decompress(buf, _READ)  # the text is thrown away: only the member ends matter
            except zlib.error as e:
                raise CorpusError(f"{path}: a damaged gzip file ({e}); compress it again") from None
            started = True
            rest = len(d.unconsumed_tail) + (len(d.unused_data) if d.eof else 0)
            base += len(buf) - rest
            buf = buf[len(buf) - rest :]
            if d.eof:
                if not buf:
                    buf = fh.read(_READ)
                if not buf.strip(b"\0"):  # the end, or zero padding (which gzip accepts) up to it
                    while buf and not buf.strip(b"\0"):
                        buf = fh.read(_READ)
                    if not buf:
                        return starts
                    raise CorpusError(f"{path}: zero bytes between gzip members; compress it again")
                starts.append(base)  # another member follows
                d = zlib.decompressobj(31)
                started = False
    if started and not d.eof:
        raise CorpusError(f"{path}: a truncated gzip file; compress it again")
    return starts


def _units(path: Path, scan: bool) -> list[tuple[Piece, int, bool]]:
    """(piece, weight, splittable-by-bytes) in file order; the weights add up to about the file's size."""
    kind = corpora.input_kind(path)
    size = sum(f.stat().st_size for f in corpora.input_files(path))
    p = str(path)
    if kind == "jsonl":
        return [(Piece(p, "jsonl", 0, size), size, True)]
    if kind == "jsonl.gz" and scan:
        starts = gzip_members(path)
        ends = [*starts[1:], size]
        return [(Piece(p, "jsonl.gz", s, e), e - s, False) for s, e in zip(starts, ends, strict=True)]
    if kind == "parquet" and scan:
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise CorpusError(f"{path}: reading parquet needs pyarrow: {corpora.EXTRA}") from e
        md = pq.ParquetFile(path).metadata
        out = []
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            w = sum(rg.column(c).total_compressed_size for c in range(rg.num_columns))
            out.append((Piece(p, "parquet", g, g + 1), max(1, w), False))
        return out
    return [(Piece(p, "whole"), size, False)]


def plan_slices(inputs: Sequence[Path], n: int) -> list[list[Piece]]:
    """The ``n`` slices of ``inputs`` (module doc): a pure function of the inputs' contents and ``n``. A slice may
    be empty (fewer units than slices)."""
    if n < 1:
        raise ValueError(f"--tasks must be >= 1, got {n}")
    paths = [Path(f) for f in inputs]
    total0 = sum(sum(f.stat().st_size for f in corpora.input_files(p)) for p in paths)
    units: list[tuple[Piece, int, bool]] = []
    for p in paths:
        big = sum(f.stat().st_size for f in corpora.input_files(p)) > SCAN_SHARE * total0 / n
        units += _units(p, scan=big and n > 1)
    total = sum(w for _, w, _ in units)
    cuts = [i * total // n for i in range(n)] + [total + 1]
    slices: list[list[Piece]] = [[] for _ in range(n)]
    at = 0
    for piece, w, splittable in units:
        if splittable:
            for i in range(n):
                lo, hi = max(cuts[i], at), min(cuts[i + 1], at + w)
                if lo < hi:
                    slices[i].append(Piece(piece.path, piece.kind, lo - at, hi - at))
        else:
            i = max(k for k in range(n) if cuts[k] <= at)
            last = slices[i][-1] if slices[i] else None
            if last is not None and last.path == piece.path and last.kind == piece.kind and last.end == piece.start:
                slices[i][-1] = Piece(piece.path, piece.kind, last.start, piece.end)  # adjacent members / row groups
            else:
                slices[i].append(piece)
        at += w
    return slices


class _ByteRange(io.RawIOBase):
    """Bytes [start, end) of an open file, as a file (gzip reads members through it and stops at ``end``)."""

    def __init__(self, fh: Any, start: int, end: int) -> None:
        fh.seek(start)
        self.fh, self.left = fh, end - start

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = min(len(b), self.left)
        data = self.fh.read(n) if n else b""
        b[: len(data)] = data
        self.left -= len(data)
        return len(data)


def _jsonl_lines(path: Path, fh: Any, start: int, end: int) -> Iterator[bytes]:
    """The lines whose first byte lies in [start, end), each read with the bound of corpora."""
    if start > 0:
        fh.seek(start - 1)
        while (part := fh.readline(MAX_LINE_BYTES)) and not part.endswith(b"\n"):
            pass  # the rest of the line that byte start - 1 is in: the previous slice's
    pos = fh.tell()
    while pos < end:
        line = fh.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if len(line) > MAX_LINE_BYTES:
            raise CorpusError(
                f"{path} (byte {pos}): a line longer than {MAX_LINE_BYTES >> 20} MiB (one document per "
                "line): split the document, or is this not a JSON-lines file?"
            )
        pos += len(line)
        yield line


def iter_piece(piece: Piece, *, text_field: str = "text") -> Iterator[tuple[str | bytes, int]]:
    """Every document of ``piece``, in file order, with its size in input bytes (as corpora.iter_documents)."""
    path = Path(piece.path)
    if piece.kind == "whole":
        yield from corpora.iter_documents(path, text_field=text_field)
    elif piece.kind == "jsonl":
        with open(path, "rb") as fh:
            yield from corpora._json_lines(path, _jsonl_lines(path, fh, piece.start, piece.end), text_field)
    elif piece.kind == "jsonl.gz":
        try:
            with open(path, "rb") as raw, gzip.GzipFile(fileobj=_ByteRange(raw, piece.start, piece.end)) as fh:
                yield from corpora._json_lines(path, corpora._lines(path, fh), text_field)
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise CorpusError(f"{path}: a damaged or truncated gzip file ({e}); compress it again") from None
    elif piece.kind == "parquet":
        yield from corpora._parquet(path, text_field, row_groups=range(piece.start, piece.end))
    else:
        raise ValueError(f"unknown piece kind {piece.kind!r}")
