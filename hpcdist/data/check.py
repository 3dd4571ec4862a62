"""``hpcdist data check DIR [--full]``: is a prepared dataset what its meta.json says it is?

Without ``--full`` the check is what training does at start-up before any process group (cheap: meta.json and one
lstat per shard): meta.json valid (every shard's recorded ``max_id`` below ``vocab_size`` included), every shard a
regular file of exactly ``tokens x itemsize`` bytes. ``--full`` also reads every shard once (mapped: a read never
goes past the size meta.json gives, and nothing is read from a link, a FIFO or a directory), in a few threads
(sha256 and numpy's max release the GIL): its sha256 and largest id against the recorded ones and ``vocab_size``.

Every problem is one line naming the shard; the command's exit status is 1 when there is any. A dataset prepared
before checksums were recorded is checked for sizes and ids only, with a warning saying so.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from hpcdist.config.dataset_meta import DataError, DatasetMeta, load_meta, shard_file_problem

__all__ = ["CheckReport", "check_dataset"]


@dataclass
class CheckReport:
    """What :func:`check_dataset` found: one line per problem, warnings, and what was read."""

    path: Path
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    shards: int = 0
    bytes_read: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems


def check_dataset(
    path: str | os.PathLike[str], *, full: bool = False, workers: int = 4, progress: TextIO | None = None
) -> CheckReport:
    """Check the prepared dataset ``path`` against its meta.json (module doc). Never raises for a bad dataset: every
    problem is a line of the report."""
    root = Path(path).expanduser()
    report = CheckReport(root)
    t0 = time.perf_counter()
    try:
        meta = load_meta(root, key="data check")
    except DataError as e:
        report.problems += e.problems
        return report
    report.shards = len(meta.shards)
    if not meta.checksummed:
        report.warnings.append(
            f"{root} was prepared before hpcdist recorded shard checksums: only sizes and token ids are checked, "
            "not the contents; prepare it again to record them"
        )
    todo = []
    for k, s in enumerate(meta.shards):
        line = shard_file_problem(meta, s, key="data check")
        if line is None:
            todo.append(k)  # a shard of the wrong size or kind is not read
        else:
            report.problems.append(line)
    if full:
        for k, problems, nbytes in _read_all(meta, todo, workers, progress, t0):
            report.bytes_read += nbytes
            report.problems += [f"data check {root / meta.shards[k].name}: {p}" for p in problems]
    report.seconds = time.perf_counter() - t0
    return report


def _one(meta: DatasetMeta, k: int) -> tuple[int, list[str], int]:
    from hpcdist.data.shards import read_shard_problems

    try:
        return k, read_shard_problems(meta, k), meta.shards[k].tokens * meta.itemsize
    except OSError as e:  # replaced by a link or a FIFO since the lstat
        return k, [str(e.strerror or e)], 0


def _read_all(
    meta: DatasetMeta, todo: list[int], workers: int, progress: TextIO | None, t0: float
) -> Iterator[tuple[int, list[str], int]]:
    """(shard, problems, bytes) for every shard in ``todo``, in shard order, read by ``workers`` threads; a progress
    line on ``progress`` (redrawn on a terminal, every 10 s into a file)."""
    total = sum(meta.shards[k].tokens for k in todo) * meta.itemsize
    done = 0
    last = t0
    tty = bool(progress is not None and progress.isatty())
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for n, (k, problems, nbytes) in enumerate(pool.map(lambda k: _one(meta, k), todo), 1):
            done += nbytes
            now = time.perf_counter()
            if progress is not None and (n == len(todo) or now - last >= (0.5 if tty else 10.0)):
                last = now
                rate = done / 1e6 / max(now - t0, 1e-9)
                line = f"data check: {n}/{len(todo)} shards, {done / 1e6:,.1f}/{total / 1e6:,.1f} MB, {rate:,.0f} MB/s"
                progress.write(("\r" if tty else "") + line + ("\n" if n == len(todo) or not tty else ""))
                progress.flush()
            yield k, problems, nbytes


def cmd_data(args: object) -> int:
    """``hpcdist data check DIR [--full] [--workers N]``: one line per problem on stdout, exit 1 if any."""
    report = check_dataset(
        args.path,  # type: ignore[attr-defined]
        full=args.full,  # type: ignore[attr-defined]
        workers=args.workers,  # type: ignore[attr-defined]
        progress=sys.stderr,
    )
    for w in report.warnings:
        print(f"hpcdist: warning: {w}", file=sys.stderr)
    for p in report.problems:
        print(p)
    what = "sizes, checksums and ids" if args.full else "meta.json and sizes (add --full to read every shard)"  # type: ignore[attr-defined]
    if report.problems:
        print(f"data check {report.path}: {len(report.problems)} problem(s) in {report.shards} shards ({what})")
        return 1
    print(
        f"data check {report.path}: {report.shards} shards intact ({what}); "
        f"{report.bytes_read / 1e6:,.1f} MB read in {report.seconds:.2f} s"
    )
    return 0
