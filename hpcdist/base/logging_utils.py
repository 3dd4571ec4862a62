"""Rank-aware logging: one stdout handler on the ``hpcdist`` logger, rank 0 speaks, every rank can warn.

With 8 ranks per node and N nodes, letting every rank log INFO makes the job log unreadable; silencing
the other ranks entirely hides a warning that only one of them hits (a slow disk, a NaN on one shard).
So rank 0 logs at the requested level and every other rank logs WARNING and above.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

__all__ = ["get_logger", "log0", "setup_logging"]

_ROOT_NAME = "hpcdist"
_DATEFMT = "%Y-%m-%dT%H:%M:%S"  # ISO 8601 local time: a 44-day job's lines need their date
# Set by setup_logging; log0 checks it so a forgotten setup_logging call still cannot make every rank speak
# at INFO once somebody lowers the level by hand.
_rank: int = 0


class _StdoutHandler(logging.StreamHandler):
    """StreamHandler that looks up ``sys.stdout`` at every emit instead of binding it once.

    Test runners and tools that swap ``sys.stdout`` (pytest's capture, submitit's redirection) then get
    the output, and a handler installed early never writes into a stream that has since been closed.
    """

    _hpcdist_owned = True  # marks handlers this module installed, so setup_logging replaces only its own

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stdout

    @stream.setter
    def stream(self, value: TextIO) -> None:
        # StreamHandler.__init__ assigns self.stream; ignore it, the getter always follows sys.stdout.
        pass


def get_logger(name: str = _ROOT_NAME) -> logging.Logger:
    """Return a logger; use ``hpcdist`` or a child (``hpcdist.trainer``) so setup_logging's handler applies."""
    return logging.getLogger(name)


def _parse_level(level: str) -> int:
    value = logging.getLevelName(level.upper())
    if not isinstance(value, int):
        valid = ", ".join(["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
        raise ValueError(f"unknown log level {level!r}; use one of {valid}")
    return value


def setup_logging(rank: int, *, level: str = "INFO") -> None:
    """Install one stdout handler on the ``hpcdist`` logger; ranks other than 0 log only WARNING and above.

    Idempotent: calling it again (a second Trainer in one process, a test) replaces the handler rather
    than adding another, so lines are never printed twice.
    """
    global _rank
    requested = _parse_level(level)
    _rank = rank

    logger = get_logger()
    for handler in list(logger.handlers):
        if getattr(handler, "_hpcdist_owned", False):
            logger.removeHandler(handler)

    handler = _StdoutHandler()
    # [hpcdist 2026-11-25T19:30:01 INFO r0] ...: date, level and rank on every line, as torchtitan's and
    # Megatron's logs; grep "WARNING r" finds every rank's warnings in a merged job log
    fmt = f"[hpcdist %(asctime)s %(levelname)s r{rank}] %(message)s"
    handler.setFormatter(logging.Formatter(fmt, datefmt=_DATEFMT))
    logger.addHandler(handler)
    logger.setLevel(requested if rank == 0 else max(requested, logging.WARNING))
    # Our handler is the one that prints; propagating as well would print each line again wherever the
    # root logger has a handler (DeepSpeed and some launchers configure one).
    logger.propagate = False


def log0(msg: str, *args: object) -> None:
    """Log ``msg % args`` at INFO on rank 0 only."""
    if _rank == 0:
        # stacklevel=2 attributes the record to the caller, not to this helper.
        get_logger().info(msg, *args, stacklevel=2)
