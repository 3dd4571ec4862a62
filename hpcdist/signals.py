"""Signal names as users write them (``USR2``, ``SIGUSR2``, ``usr2``, ``12``), parsed in one place.

Used by the config rules (``fault.requeue_signal``), cluster profiles (``cluster.signal``), the stop flag, the
NCCL-profile check (``NCCL_PROXY_DUMP_SIGNAL``) and nccl_check's audit. Standard library only.
"""

from __future__ import annotations

import signal

__all__ = ["parse_signal"]


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
