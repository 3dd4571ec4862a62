"""One run per run directory: an exclusive ``flock`` on ``<run.dir>/run.lock``, held by rank 0 while it trains.

Two jobs on one run.dir (a resubmitted job while the first is still queued-then-running, a copy-pasted sbatch
line) would each prune the other's checkpoints and interleave metrics.jsonl. The second one is refused at start-up,
before it resumes or writes anything, naming the holder (job id, host, pid) and the fixes.

Why flock: the kernel drops it when the holding process dies, SIGKILL and node reboots included, so a lock is
never stale by itself; nothing has to clean up after a crash. A requeue of the *same* job may start while the old
step's processes still exit (KillWait): then the holder names our own job id and we wait for it a while. A file
system without flock support (Lustre mounted without ``-o flock``) gets a warning and no lock, not a refusal.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from hpcdist.base.logging_utils import get_logger
from hpcdist.base.rundir import RunDir
from hpcdist.config.loader import ConfigError
from hpcdist.schedulers import job_facts

__all__ = ["RunDirInUse", "RunDirLock"]

log = get_logger(__name__)

SAME_JOB_WAIT_S = 90.0  # a requeued job's old step is gone after SLURM's KillWait (30 s by default) + slack
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}

# locks this process holds, by path: a second Trainer of the same run in one process (the Python API, tests)
# shares it instead of being refused by its own first one
_held: dict[Path, int] = {}


class RunDirInUse(ConfigError):
    """Another live process (another job) holds the run directory."""


class RunDirLock:
    def __init__(self, run_dir: str | os.PathLike[str], *, job_id: str | None = None):
        self.path = RunDir(Path(run_dir).absolute()).lock
        self.job_id = job_id if job_id is not None else job_facts().job_id

    @property
    def held(self) -> bool:
        return self.path in _held

    def acquire(self, *, same_job_wait_s: float = SAME_JOB_WAIT_S) -> None:
        """Take the lock or raise :class:`RunDirInUse`; idempotent within one process."""
        if self.held:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + same_job_wait_s
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    holder = _read_holder(fd)
                    same_job = self.job_id is not None and str(holder.get("job_id")) == str(self.job_id)
                    if not same_job or time.monotonic() >= deadline:
                        raise RunDirInUse([self._in_use(holder)]) from None
                    time.sleep(1.0)  # our own job's previous attempt is still exiting
                except OSError as e:
                    if e.errno not in _UNSUPPORTED:
                        raise
                    log.warning(
                        "run.dir lock: %s does not support flock (%s): two runs on this run.dir are not prevented",
                        self.path.parent,
                        e.strerror,
                    )
                    os.close(fd)
                    return
        except BaseException:
            os.close(fd)
            raise
        me = {"job_id": self.job_id, "host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        _held[self.path] = fd

    def release(self) -> None:
        """Drop the lock (the file stays: removing it would race with a waiter that opened it already)."""
        fd = _held.pop(self.path, None)
        if fd is not None:
            os.close(fd)  # closing the descriptor releases the flock

    def _in_use(self, holder: dict[str, Any]) -> str:
        job, host, pid = holder.get("job_id"), holder.get("host", "?"), holder.get("pid", "?")
        who = f"SLURM job {job} (pid {pid} on {host})" if job else f"pid {pid} on {host}"
        since = time.strftime("%Y-%m-%d %H:%M", time.localtime(holder["since"])) if "since" in holder else "?"
        fix = f"wait for it to end (or `scancel {job}`)" if job else "wait for it to end (or stop it)"
        return (
            f"run.dir: {str(self.path.parent)!r} is in use by {who}, running since {since}: two runs on one "
            f"run.dir would prune each other's checkpoints; {fix}, or choose another run.dir"
        )


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
