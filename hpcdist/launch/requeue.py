"""Requeue a batch job through its scheduler, and keep it off excluded nodes while it is pending.

Called by rank 0 after a time-limit stop (hpcdist.launch.restarts.after_stop) and by the batch script's failure
path (hpcdist.launch.restarts after-step). The trainer never requeues: it returns why it stopped.
"""

from __future__ import annotations

from collections.abc import Iterable

from hpcdist.schedulers import launcher

__all__ = ["requeue"]


def requeue(job_id: str, *, exclude: Iterable[str] = ()) -> int:
    """Requeue ``job_id``, then exclude ``exclude`` from its next start. 0 when requeued, else 4 (said why)."""
    return launcher().requeue(job_id, exclude=exclude)
