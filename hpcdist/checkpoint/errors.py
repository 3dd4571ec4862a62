"""What can go wrong with a checkpoint, and what each failure says about it: the exceptions a save or a resume
raises, and the classification the ranks agree on (an I/O error keeps training going; a read error is damage,
a mismatch or a transient storage fault)."""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from hpcdist.config.loader import ConfigError

# exit status of a run stopped by checkpoint storage: a read that kept failing (CheckpointUnavailable) or a final /
# stop save that failed (hpcdist.run); sysexits' EX_IOERR. The batch script's failure policy requeues it like any
# failure, blaming no node, and a full disk that stays full ends as a failure loop
EXIT_IO = 74


# a file of the checkpoint is not there (or not a file): the checkpoint is damaged; any other OSError (EIO, ESTALE,
# EACCES, ETIMEDOUT, ENOMEM) says nothing about its contents
_DAMAGE_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR})


# what reading a checkpoint found; the ranks agree on the MAX
READ_OK, READ_DAMAGE, READ_TRANSIENT, READ_MISMATCH = 0, 1, 2, 3


class CheckpointSaveError(RuntimeError):
    """A save failed with an error that is not I/O: a bug would otherwise disable checkpointing silently."""


class CheckpointMismatch(ValueError):
    """An intact checkpoint that does not fit this job (another model): resume stops with this
    message and the checkpoint is kept as it is (never demoted like a damaged one). ``path``: that checkpoint;
    ``what``: what differs, ``model`` or ``data`` (the sample order: the data.* settings or the prepared data)."""

    def __init__(self, message: str, path: Path | None = None, *, what: str = "model"):
        super().__init__(message)
        self.path, self.what = path, what


class CheckpointUnavailable(OSError):
    """A checkpoint that could not be read for a reason that says nothing about its contents (EIO or ESTALE on a
    network file system, a MemoryError), still failing after ``READ_RETRY_DELAYS_S``: the run stops rather than
    start from an older step or from 0, and nothing is renamed (a storage hiccup must not condemn a checkpoint).
    The CLI exits with ``EXIT_CODE``."""

    EXIT_CODE = 74  # EXIT_IO
    failure_kind = "checkpoint"  # failures.jsonl: storage, blamed on no node (a requeue may well find it healthy)

    def __init__(self, message: str, path: Path | None = None):
        super().__init__(message)
        self.path = path


class CheckpointTainted(CheckpointMismatch):
    """A fallback checkpoint lacks a part of the state (a weights-only one: no optimizer state) that a damaged
    checkpoint's load had already written into this process: that part cannot be made fresh here, so the resume
    stops (the fallback is kept as it is); a new process resumes from it cleanly, the damaged one being demoted."""

    def __init__(self, message: str, path: Path | None = None):
        super().__init__(message, path, what="tainted")


class ShardsDamaged(ValueError):
    """The shards read by a load differ from the manifest (``problems``: one line per file); raised on every rank
    alike (agreed), so ``_read`` demotes the checkpoint as it would after ``verify``."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


class UntrustedCheckpoint(ConfigError):
    """A checkpoint someone else could have written: refused before any of it is read, with the fix;
    a config problem (exit 2 at the CLI), never a damaged checkpoint to demote."""

    SHOWN = 3  # kinds of problem quoted; a foreign tree of thousands of files would otherwise fill a page

    def __init__(self, key: str, path: Path, problems: list[tuple[str, str]]):
        by_why: dict[str, list[str]] = {}
        for entry, why in problems:
            by_why.setdefault(why, []).append(entry)
        parts = [
            f"{why}: {entries[0]}{f' and {len(entries) - 1} more' if len(entries) > 1 else ''}"
            for why, entries in list(by_why.items())[: self.SHOWN]
        ]
        shown = "; ".join(parts) + ("; ..." if len(by_why) > self.SHOWN else "")
        fixes = []
        if any(why.startswith("belongs to ") for why in by_why):
            fixes.append(
                "if its owner is a user you trust and nobody else can write it, name them in "
                "checkpoint.trusted_owners (a list of user names); otherwise do not load it"
            )
        if any(why.startswith("is writable by ") for why in by_why):
            fixes.append(f"if it is yours, make it writable by you alone: chmod -R go-w {path}")
        if any(why.startswith("is a link leading out") for why in by_why):
            fixes.append("copy the linked files into the checkpoint instead of linking them")
        if any(why.startswith("cannot be listed") for why in by_why):
            fixes.append("make it readable to you")
        super().__init__(
            [
                f"{key}: {path} cannot be trusted: {shown}. Loading a checkpoint unpickles parts of it, which runs "
                f"any code its writer put there; {'; '.join(fixes)}. Nothing was read or changed"
            ]
        )
        self.path = path


def is_io_error(err: BaseException) -> bool:
    """Disk full, I/O error, quota, a vanished mount: the storage's fault, not the code's, so training goes on."""
    if isinstance(err, OSError):
        return True
    if isinstance(err, CheckpointException):  # DCP's wrapper of every rank's failure
        return bool(err.failures) and all(is_io_error(exc) for exc, _ in err.failures.values())
    # torch.save's zip writer (inline_container.cc) turns ENOSPC / EIO into RuntimeErrors: "PytorchStreamWriter
    # failed writing file ...: file write failed", or, on a full tmpfs, "unexpected pos 704 vs 598"
    if isinstance(err, RuntimeError) and any(s in str(err) for s in ("PytorchStreamWriter", "inline_container")):
        return True
    cause = err.__cause__ or err.__context__
    return cause is not None and is_io_error(cause)


def error_of(fn: Callable[[], Any]) -> BaseException | None:
    """Run one local phase of a save; return its error instead of raising (the ranks agree on it next)."""
    try:
        fn()
    except (Exception, CheckpointException) as e:  # OSError (ENOSPC, EIO, EDQUOT); DCP's wrapper of rank errors
        return e  # (CheckpointException is a BaseException: a bare `except Exception` would let it through)
    return None


def read_kind(err: BaseException) -> int:
    """What a failure to read a checkpoint says about it: READ_MISMATCH (intact, not this run's), READ_TRANSIENT
    (nothing about the file: retry, never demote) or READ_DAMAGE (a file missing, unparsable or unloadable)."""
    if isinstance(err, CheckpointMismatch):
        return READ_MISMATCH
    if isinstance(err, (CheckpointUnavailable, MemoryError)):
        return READ_TRANSIENT
    if isinstance(err, OSError):
        return READ_DAMAGE if err.errno in _DAMAGE_ERRNOS else READ_TRANSIENT
    if isinstance(err, CheckpointException):  # DCP's wrapper of every rank's failure: the worst of them
        return max((read_kind(exc) for exc, _ in err.failures.values()), default=READ_DAMAGE)
    cause = err.__cause__ or err.__context__  # torch / DCP wrap an OSError in a RuntimeError
    return READ_TRANSIENT if cause is not None and read_kind(cause) == READ_TRANSIENT else READ_DAMAGE


def describe_error(err: BaseException) -> str:
    """One line for an error: DCP's CheckpointException carries every rank's whole traceback in its text, so it is
    reduced to each failing rank's innermost error."""
    if isinstance(err, CheckpointException) and err.failures:
        parts = []
        for rank, (exc, _) in sorted(err.failures.items()):
            inner: BaseException = exc
            while isinstance(inner, CheckpointException) and inner.failures:
                inner = next(iter(inner.failures.values()))[0]
            parts.append(f"rank {rank}: {describe_error(inner)}")
        return "; ".join(parts[:4]) + (f"; ... ({len(parts)} ranks)" if len(parts) > 4 else "")
    text = " ".join(str(err).split())
    cause = err.__cause__ or err.__context__
    if isinstance(cause, OSError) and not isinstance(err, OSError):  # the storage error under torch's wrapper
        text += f" (caused by {type(cause).__name__}: {cause})"
    return f"{type(err).__name__}: {text[:500]}" if text else type(err).__name__
