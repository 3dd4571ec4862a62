"""Signal names as users write them (``USR2``, ``SIGUSR2``, ``usr2``, ``12``), parsed in one place; the early hold
of the stop signals; the exit code of a stop and of an abort.

Names: used by the config rules (``fault.requeue_signal``), cluster profiles (``cluster.signal``), the stop flag,
the NCCL-profile check (``NCCL_PROXY_DUMP_SIGNAL``) and nccl_check's audit.

The early hold: ``hpcdist train`` spends seconds importing torch and numpy, reading the config and checking the data
before the trainer's handlers (hpcdist.fault.stop) exist. A signal then used to take its default action: USR2 killed
the rank (the node blamed under SLURM), a Ctrl-C raised KeyboardInterrupt inside numpy's import (``module 'numpy'
has no attribute 'intp'`` later). So the entry point calls :func:`hold` before anything else: a signal is only
remembered; the stop flag takes the remembered ones over (:func:`release` with the signals it handles) and acts
on them as if they had just arrived, and every other command gets them back with their normal action. A second
Ctrl-C is the user's way out, held or not: one line and exit 130 at once (:func:`abort`).

Standard library only: imported by the entry point before anything heavy.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Collection
from types import FrameType
from typing import Any

__all__ = ["ABORT_EXIT_CODE", "HELD", "abort", "hold", "parse_signal", "previous_handler", "release", "stop_exit_code"]

ABORT_EXIT_CODE = 128 + signal.SIGINT  # 130: what the shell reports for a process Ctrl-C ended
HELD = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)  # stop signals and every requeue signal used

_originals: dict[int, Any] = {}  # the handlers hold() replaced, by signal (empty: not holding)
_arrived: list[int] = []  # signals that arrived while held, in order


def parse_signal(text: str | int, *, numbers: bool = True) -> signal.Signals | None:
    """``"USR2"`` / ``"SIGUSR2"`` / ``" usr2 "`` (and ``"12"`` / ``12`` unless ``numbers=False``) -> SIGUSR2.

    None when the text names no signal of this platform. Config keys pass ``numbers=False``: a number means
    different signals on different architectures, so a job file names signals.
    """
    name = str(text).strip().upper()
    if name.isdigit():
        if not numbers:
            return None
        try:
            return signal.Signals(int(name))
        except ValueError:
            return None
    return signal.Signals.__members__.get(name if name.startswith("SIG") else f"SIG{name}")


def stop_exit_code(signum: int) -> int:
    """The exit code of a run that a signal stopped before its last step, outside any scheduler that made the stop
    part of its plan (a SLURM requeue): the shell's convention for a process ended by that signal, 128 + its number
    (SIGINT 130, SIGTERM 143, USR2 140 on Linux). Never 0: a wrapper script must not take a partial run for a
    finished one."""
    return 128 + int(signum)


def abort(rank: int | None = None) -> None:
    """A second Ctrl-C: the user wants out now. One line (rank 0 only; ``None``: as the environment says), exit 130
    at once without a checkpoint. Nothing half-written can be resumed from: a checkpoint counts only once its
    COMPLETE marker exists, and that is written (atomically) after everything else. Safe in a signal handler:
    os.write and os._exit only (an exception here could be caught and reported as a bug, or print a traceback)."""
    if rank is None:  # before DistEnv exists (hpcdist.env, which imports torch): torchrun's RANK if any
        rank = 0 if (os.environ.get("RANK") or "0").strip() == "0" else 1
    if rank == 0:
        os.write(
            2, b"\nhpcdist: Ctrl-C again: aborted without a checkpoint (the last complete one stays the resume point)\n"
        )
    os._exit(ABORT_EXIT_CODE)


def _remember(signum: int, frame: FrameType | None) -> None:
    if signum == signal.SIGINT and signal.SIGINT in _arrived:
        abort()  # a second Ctrl-C while still starting: out now, not after the imports
    _arrived.append(signum)


def hold(signals: Collection[int] = HELD) -> None:
    """The entry point's first line: until :func:`release`, ``signals`` are only remembered. A signal the process
    ignores (nohup, a parent's SIG_IGN) stays ignored; outside the main thread (where no handler can be set) this
    does nothing."""
    if _originals:
        return
    for sig in signals:
        try:
            if signal.getsignal(sig) is signal.SIG_IGN:
                continue
            _originals[sig] = signal.signal(sig, _remember)
        except ValueError:  # not the main thread
            return


def previous_handler(sig: int, replaced: Any) -> Any:
    """The handler to restore after one that replaced ``replaced``: the held signal's own original, not the hold."""
    return _originals.get(sig, replaced) if replaced is _remember else replaced


def release(taken: Collection[int] = ()) -> list[int]:
    """End the hold. ``taken``: the signals the caller has just installed its own handlers for; returns those of
    them that arrived while held, in order, for the caller to act on. Every other held signal gets its original
    handler back, and one that arrived is raised again now, with its normal action (KeyboardInterrupt for SIGINT,
    the default action for the others). A no-op without :func:`hold`."""
    for sig, handler in _originals.items():
        if signal.getsignal(sig) is _remember:
            signal.signal(sig, handler)
    # read only now: no handler is _remember any more, so nothing can arrive in between unseen
    arrived = list(_arrived)
    _originals.clear()
    _arrived.clear()
    ours = [s for s in arrived if s in taken]
    for sig in dict.fromkeys(s for s in arrived if s not in taken):
        signal.raise_signal(sig)
    return ours
