"""The one reader and writer of a prepared dataset's ``meta.json`` (docs/DATA.md): bounded, validated, links never
followed.

A prepared directory is input another user (or a careless edit) may have written, so every value is checked before
anything is sized from it: ``dtype`` one of uint16/uint32 and able to hold ``vocab_size``; each shard a plain file
name with a non-negative token count, and the counts adding up to ``num_tokens``; the optional per-shard ``sha256``
and ``max_id`` (older datasets lack them) well formed, and ``max_id`` below ``vocab_size``.
:func:`check_shard_files` then looks at the files themselves, without reading them: each a regular file (not a link,
a FIFO or a directory) of exactly ``tokens * itemsize`` bytes. Reading the tokens (checksums, the largest id) is
:mod:`hpcdist.data.shards`' part; this module is torch- and numpy-free because config loading (``model.vocab_size:
auto``, the start-up check) uses it.

Every problem is one :class:`DataError` line naming the file, the key and the fix. :func:`write_meta` (prepare and
the Megatron import, as their last step) checks a document with the same rules before it writes it: a preparation
never leaves a meta.json its own readers would refuse.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcdist.base.atomic import atomic_write
from hpcdist.config.loader import ConfigError, echo

__all__ = [
    "DTYPE_SIZES",
    "FORMAT_VERSION",
    "META_NAME",
    "DataError",
    "DatasetMeta",
    "ShardInfo",
    "check_shard_files",
    "load_meta",
    "open_regular",
    "open_shard",
    "read_meta_json",
    "shard_file_problem",
    "shard_file_problems",
    "withdraw_meta",
    "write_meta",
]

META_NAME = "meta.json"
# Bumped whenever the on-disk layout changes, so an old directory is re-prepared rather than misread.
FORMAT_VERSION = 1
DTYPE_SIZES = {"uint16": 2, "uint32": 4}
# Bounds on what a meta.json may ask for: far above any real dataset (a 2**24-token shard per entry: 10**6 shards are
# 1.6e13 tokens), low enough that a hostile file cannot make a reader allocate or loop without end.
MAX_META_BYTES = 256 * 2**20
MAX_SHARDS = 1_000_000
MAX_SHARD_TOKENS = 2**40
MAX_VOCAB = 2**32
_SHA256 = re.compile(r"[0-9a-f]{64}")
# The one kind of shard name with a directory: a cluster prepare's part (hpcdist.data.array), listed in place by the
# merge (no copy of the token bytes). Nothing else may name a path.
PART_SHARD = re.compile(r"parts/(0|[1-9][0-9]{0,5})/shard-[0-9]{5,7}\.bin")


class DataError(ConfigError):
    """The data a config or a command names is missing, damaged or does not fit the model: one line."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__(problems)
        self.args = ("; ".join(self.problems),)


@dataclass(frozen=True)
class ShardInfo:
    """One ``shards`` entry: the file name, its token count, and (where recorded) its sha256 and largest id."""

    name: str
    tokens: int
    sha256: str | None = None
    max_id: int | None = None


@dataclass(frozen=True)
class DatasetMeta:
    """A validated ``meta.json``; ``raw`` is the parsed document (for the keys only some readers use)."""

    path: Path
    raw: dict[str, Any]
    dtype: str
    vocab_size: int
    num_tokens: int
    shards: tuple[ShardInfo, ...]
    tokenizer: dict[str, Any] | None
    fingerprint: str | None

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def checksummed(self) -> bool:
        """Every shard records its sha256 and largest id (datasets prepared before these were recorded do not)."""
        return all(s.sha256 is not None and s.max_id is not None for s in self.shards)

    @property
    def tokenizer_kind(self) -> str:
        """What made the ids; datasets from before tokenizers were recorded are byte-level."""
        return str((self.tokenizer or {}).get("kind", "byte"))

    @property
    def tokenizer_identity(self) -> dict[str, Any]:
        """What identifies the tokenizer that made the ids: kind, vocabulary and each file's sha256 (two datasets
        with the same identity mean the same text by the same id). Datasets from before tokenizers were recorded are
        byte-level."""
        tok = self.tokenizer or {"kind": "byte", "vocab_size": self.vocab_size}
        return {"kind": tok.get("kind", "byte"), "vocab_size": tok.get("vocab_size"), "files": tok.get("files") or {}}


def open_regular(path: Path) -> int:
    """A read-only descriptor of ``path`` if it is a regular file: a symbolic link is not followed (O_NOFOLLOW), a
    FIFO does not block the open (O_NONBLOCK) and is refused with a directory or a device. OSError otherwise (the
    message says which)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if os.path.islink(path):
            raise OSError(e.errno, "is a symbolic link (links inside a dataset are not followed; copy the file)") from e
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else "not a file"
        raise OSError(f"is {kind}, not a regular file")
    return fd


def read_meta_json(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(the parsed ``path/meta.json``, None) or (None, why not): missing, not a regular file, over the size bound,
    not JSON (deep nesting included), not an object."""
    file = Path(path) / META_NAME
    try:
        fd = open_regular(file)
    except FileNotFoundError:
        return None, "no meta.json"
    except OSError as e:
        return None, f"{META_NAME} {e.strerror or e}"
    if os.fstat(fd).st_size > MAX_META_BYTES:  # before reading a byte of it
        os.close(fd)
        return None, f"{META_NAME} is larger than {MAX_META_BYTES >> 20} MiB"
    try:
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(MAX_META_BYTES + 1)
    except OSError as e:
        return None, f"{META_NAME} is unreadable ({e.strerror or e})"
    if len(data) > MAX_META_BYTES:
        return None, f"{META_NAME} is larger than {MAX_META_BYTES >> 20} MiB"
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # torn, garbled, not UTF-8, or nested deeper than the parser goes
        return None, f"{META_NAME} is not valid JSON ({type(e).__name__})"
    if not isinstance(doc, dict):
        return None, f"{META_NAME} is a JSON {type(doc).__name__}, not an object"
    return doc, None


def _int(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _shard(entry: Any, k: int, vocab: int, problems: list[str]) -> ShardInfo | None:
    where = f"shards[{k}]"
    if not isinstance(entry, Mapping):
        problems.append(f"{where} is {echo(entry)}, not an object with name and tokens")
        return None
    name, tokens = entry.get("name"), entry.get("tokens")
    plain = isinstance(name, str) and "/" not in name
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or not (plain or PART_SHARD.fullmatch(name))
        or "\0" in name
        or len(name) > 255
    ):
        problems.append(f"{where}.name={echo(name)} is not a plain file name inside the dataset directory")
        return None
    if not _int(tokens, 0, MAX_SHARD_TOKENS):
        problems.append(f"{where}.tokens={echo(tokens)} is not an integer in [0, {MAX_SHARD_TOKENS}]")
        return None
    sha, top = entry.get("sha256"), entry.get("max_id")
    if sha is not None and not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
        problems.append(f"{where}.sha256={echo(sha)} is not 64 lowercase hex digits")
        return None
    if top is not None and not _int(top, 0, MAX_VOCAB):
        problems.append(f"{where}.max_id={echo(top)} is not an integer in [0, {MAX_VOCAB}]")
        return None
    if top is not None and top >= vocab:
        problems.append(f"{where} ({name}) records token ids up to {top}, past vocab_size={vocab}")
        return None
    return ShardInfo(name, tokens, sha, top)


def _validate(path: Path, doc: dict[str, Any]) -> tuple[DatasetMeta | None, list[str]]:
    problems: list[str] = []
    fmt = doc.get("format", FORMAT_VERSION)  # "bring your own tokens" metas may leave it out
    if fmt != FORMAT_VERSION or isinstance(fmt, bool):
        problems.append(f"format={echo(fmt)}: this hpcdist reads format {FORMAT_VERSION}")
    dtype, vocab = doc.get("dtype"), doc.get("vocab_size")
    if dtype not in DTYPE_SIZES:
        problems.append(f"dtype={echo(dtype)} is not one of {', '.join(DTYPE_SIZES)}")
    if not _int(vocab, 1, MAX_VOCAB):
        problems.append(f"vocab_size={echo(vocab)} is not an integer in [1, {MAX_VOCAB}]")
    elif dtype in DTYPE_SIZES and vocab > 2 ** (8 * DTYPE_SIZES[dtype]):
        problems.append(f"vocab_size={vocab} does not fit dtype={dtype}")
    for key in ("bos_id", "eos_id"):
        v = doc.get(key)
        if v is not None and not (_int(v, 0, MAX_VOCAB) and (not _int(vocab, 1, MAX_VOCAB) or v < vocab)):
            problems.append(f"{key}={echo(v)} is not an id below vocab_size")
    tok = doc.get("tokenizer")
    if tok is not None and not (
        isinstance(tok, dict)
        and isinstance(tok.get("kind", "byte"), str)
        and isinstance(tok.get("files", {}), dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in tok.get("files", {}).items())
    ):
        problems.append("tokenizer is not an object with a kind and files {name: sha256}")
    elif tok is not None:
        for key in ("bos_id", "eos_id"):  # two records of one id: which one a document mask splits at is unknowable
            mine, its = doc.get(key), tok.get(key)
            if mine is not None and its is not None and mine != its:
                problems.append(
                    f"{key}={echo(mine)} but the tokenizer record says {key}={echo(its)}: the ids were made by one "
                    "tokenizer; prepare the dataset again (or correct meta.json)"
                )
    fingerprint = doc.get("fingerprint")
    if fingerprint is not None and not isinstance(fingerprint, str):
        problems.append(f"fingerprint={echo(fingerprint)} is not text")
    entries = doc.get("shards")
    if not isinstance(entries, list):
        problems.append(f"shards={echo(entries)} is not a list of {{name, tokens}}")
        entries = []
    elif len(entries) > MAX_SHARDS:
        problems.append(f"shards lists {len(entries):,} files, more than {MAX_SHARDS:,}")
        entries = []
    shards = []
    for k, entry in enumerate(entries):
        info = _shard(entry, k, vocab if _int(vocab, 1, MAX_VOCAB) else MAX_VOCAB + 1, problems)
        if info is not None:
            shards.append(info)
        if len(problems) >= 5:  # a garbled list: the first problems say enough
            break
    if len({s.name for s in shards}) != len(shards):
        problems.append("shards names one file twice")
    # prepare's shards all hold shard_tokens but the last (a count edit shows here); a cluster prepare's, but the last
    # of each part
    per = doc.get("shard_tokens")
    groups: dict[str, list[ShardInfo]] = {}
    for s in shards:
        groups.setdefault(s.name.rpartition("/")[0], []).append(s)
    full = _int(per, 1, MAX_SHARD_TOKENS) and all(
        all(s.tokens == per for s in g[:-1]) and g[-1].tokens <= per for g in groups.values()
    )
    if _int(per, 1, MAX_SHARD_TOKENS) and shards and not full:
        problems.append(
            f"the shards' token counts do not match shard_tokens={per} (every shard holds that many but the last)"
        )
    num = doc.get("num_tokens")
    total = sum(s.tokens for s in shards)
    if not problems and num != total:
        problems.append(f"num_tokens={echo(num)} is not the sum of the shards' tokens ({total})")
    if problems:
        return None, problems
    return DatasetMeta(path, doc, dtype, vocab, total, tuple(shards), tok, fingerprint), []


def load_meta(path: str | os.PathLike[str], *, key: str = "data.path") -> DatasetMeta:
    """The validated meta.json of the prepared dataset ``path``, or one :class:`DataError` naming ``key``, the
    problem and the fix."""
    doc, why = read_meta_json(Path(path).expanduser())
    if doc is None:
        why = "no complete meta.json" if why == "no meta.json" else why
        raise DataError(
            [
                f"{key} {path}: no prepared dataset there ({why}); make it with `hpcdist prepare INPUT... "
                f"--tokenizer SPEC --out {path}`"
            ]
        )
    meta, problems = _validate(Path(path).expanduser(), doc)
    if meta is None:
        raise DataError(
            [
                f"{key} {path}: {META_NAME}: {'; '.join(problems)}: the file was edited or damaged; prepare "
                f"the dataset again (hpcdist prepare ... --overwrite --out {path})"
            ]
        )
    return meta


def shard_file_problems(meta: DatasetMeta, *, key: str = "data.path") -> list[str]:
    """One line per shard meta.json names that is not a regular file (a link, a FIFO, a directory, or reached through
    a linked part directory) of exactly tokens * itemsize bytes: one lstat per path component, nothing read."""
    return [p for s in meta.shards if (p := shard_file_problem(meta, s, key=key)) is not None]


def shard_file_problem(meta: DatasetMeta, s: ShardInfo, *, key: str = "data.path") -> str | None:
    """:func:`shard_file_problems` for one shard: the line, or None."""
    file = meta.path / s.name
    why = _lstat_problem(meta.path, s.name)
    if why is not None:
        return f"{key} {file}{' ' if why.startswith('is ') else ': '}{why}"
    size = os.lstat(file).st_size
    want = s.tokens * meta.itemsize
    if size != want:
        return (
            f"{key} {file} holds {size:,} bytes, but meta.json says {s.tokens:,} {meta.dtype} tokens "
            f"({want:,} bytes): the shard was truncated, grown or replaced; prepare the dataset again "
            f"(hpcdist prepare ... --out {meta.path})"
        )
    return None


def _lstat_problem(root: Path, name: str) -> str | None:
    """Why ``root/name`` is not a regular file reached through real directories, or None (lstat only)."""
    parts = name.split("/")
    at = root
    for k, part in enumerate(parts):
        at = at / part
        try:
            st = os.lstat(at)
        except OSError as e:
            return f"{e.strerror or e} (meta.json lists it); the dataset is incomplete: prepare it again"
        last = k == len(parts) - 1
        if stat.S_ISLNK(st.st_mode):
            return (
                "is a symbolic link: a shard (and its part directory) must lie in the dataset directory "
                "(links are not followed)"
            )
        if not last and not stat.S_ISDIR(st.st_mode):
            return f"{at} is not a directory"
        if last and not stat.S_ISREG(st.st_mode):
            mode = st.st_mode
            kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a file"
            return f"is {kind}: a shard must be a regular file in the dataset directory (links are not followed)"
    return None


def check_shard_files(meta: DatasetMeta, *, key: str = "data.path") -> None:
    """Each shard meta.json names is a regular file (no link, FIFO, directory) of exactly tokens * itemsize bytes:
    one lstat each, nothing read. DataError naming the first bad shard."""
    problems = shard_file_problems(meta, key=key)
    if problems:
        raise DataError(problems[:1])


def open_shard(root: Path, name: str) -> int:
    """A read-only descriptor of shard ``name`` of the dataset in ``root``: a plain name through
    :func:`open_regular`; a part's shard (``parts/<i>/shard-*.bin``, a cluster prepare's) through its directories
    opened one by one with O_NOFOLLOW | O_DIRECTORY, so neither a linked part directory nor a linked file is followed
    (no race between a check and the open)."""
    if "/" not in name:
        return open_regular(Path(root) / name)
    *dirs, last = name.split("/")
    dflags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(root, dflags)
    try:
        for d in dirs:
            try:
                nxt = os.open(d, dflags, dir_fd=fd)
            except OSError as e:
                if os.path.islink(Path(root) / d):
                    raise OSError(e.errno, f"{d} is a symbolic link (links inside a dataset are not followed)") from e
                raise
            os.close(fd)
            fd = nxt
        flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            out = os.open(last, flags, dir_fd=fd)
        except OSError as e:
            raise OSError(e.errno, f"{e.strerror} (a symbolic link is not followed)") from e
    finally:
        os.close(fd)
    st = os.fstat(out)
    if not stat.S_ISREG(st.st_mode):
        os.close(out)
        raise OSError("is not a regular file")
    return out


def withdraw_meta(out_dir: Path) -> None:
    """Remove ``out_dir/meta.json`` before a preparation rewrites the directory: until :func:`write_meta` runs again,
    no reader takes the directory for a complete dataset."""
    (Path(out_dir) / META_NAME).unlink(missing_ok=True)


def write_meta(out_dir: Path, fields: dict[str, Any]) -> DatasetMeta:
    """Write ``out_dir/meta.json`` (whole, atomically: the last step of a preparation) holding ``fields`` and this
    module's format version; the document is checked by the readers' rules first (ValueError: a writer's bug)."""
    doc = {"format": FORMAT_VERSION, **fields}
    meta, problems = _validate(Path(out_dir), doc)
    if meta is None:
        raise ValueError(f"refusing to write an invalid {META_NAME} in {out_dir}: {'; '.join(problems)}")
    atomic_write(Path(out_dir) / META_NAME, (json.dumps(doc, indent=2) + "\n").encode())
    return meta
