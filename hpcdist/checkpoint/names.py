"""The names of a checkpoint directory, for every tier and every reader: ``step-00001234/``, its ``COMPLETE``
marker (written last: a directory without one is a crashed or in-flight save), the ``DAMAGED`` marker a failed
verification leaves in its place, and the listing that finds the newest complete step.

Standard library only, and no hpcdist import beyond the logger: config's rules, the run report and ``hpcdist
status`` read these names without loading torch or the checkpoint code.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from hpcdist.base.logging_utils import get_logger

MARKER = "COMPLETE"
DAMAGED = "DAMAGED"  # a COMPLETE marker renamed after the checkpoint failed verification
STEP_PATTERN = r"step-(\d{8})"  # the step number is group 1; other names build on it (a set-aside step-N.damaged-...)
STEP_RE = re.compile(rf"^{STEP_PATTERN}$")
log = get_logger(__name__)


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def step_dir(root: Path, step: int) -> Path:
    return root / step_name(step)


def parse_step(name: str) -> int | None:
    """The step of a ``step-N`` name, None for any other name."""
    m = STEP_RE.match(name)
    return int(m.group(1)) if m else None


def step_of(path: Path) -> int:
    """The step of a ``step-N`` directory; ValueError for another path."""
    step = parse_step(path.name)
    if step is None:
        raise ValueError(f"{path} is not a step-N checkpoint directory")
    return step


def list_checkpoints(root: Path) -> tuple[list[tuple[int, Path]], list[Path]]:
    """(complete checkpoints sorted by step, incomplete directories)."""
    complete, incomplete = [], []
    if not root.is_dir():
        return [], []
    for d in root.iterdir():
        step = parse_step(d.name)
        if step is None or not d.is_dir():
            continue
        if (d / MARKER).is_file():
            complete.append((step, d))
        else:
            incomplete.append(d)
    return sorted(complete), sorted(incomplete)


def latest(root: Path, *, warn: bool = True) -> Path | None:
    """Newest complete checkpoint under ``root``; incomplete ones newer than it are reported and skipped."""
    complete, incomplete = list_checkpoints(root)
    if warn:
        warn_skipped(complete, incomplete, lambda d: (d / DAMAGED).is_file())
    return complete[-1][1] if complete else None


def warn_skipped(complete: list[tuple[int, Path]], incomplete: list[Path], is_damaged: Callable[[Path], bool]) -> None:
    """Say which step directories newer than the newest complete one a resume skips, and why (a listing: see
    :func:`list_checkpoints`)."""
    newest = complete[-1][0] if complete else -1
    for d in incomplete:
        if step_of(d) > newest:
            if is_damaged(d):  # demoted by an earlier resume: say so, it was no interrupted save
                log.warning(
                    "ignoring %s: demoted as damaged earlier (%s marker); it will not be resumed from", d, DAMAGED
                )
            else:
                log.warning("ignoring %s: no %s marker (an interrupted save); it will not be resumed from", d, MARKER)
