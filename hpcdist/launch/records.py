"""What ``hpcdist status|logs|cancel`` read when SLURM cannot answer: the run directory's own records.

``submit`` appends one line per job to ``<run.dir>/jobs.jsonl`` (id, executor, log folder, ranks, host, snapshot);
a local-executor job's id is its controller's pid on that host. For any job (plain ``sbatch`` included) the run's
metrics and restart ledger give its progress. Standard library only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from typing import Any

from hpcdist.atomic import UntrustedFile, append_line, read_tail, read_trusted
from hpcdist.fault.failures import unhealthy_hosts
from hpcdist.rundir import RunDir

__all__ = ["UntrustedFile", "cancel_local", "find_job", "last_step", "local_state", "record_job", "run_summary"]

_JOBS_MAX_BYTES = 64 << 20  # one short line per submission: hundreds of thousands of jobs
_TAIL_BYTES = 16 << 20  # the newest lines of metrics.jsonl: thousands of steps


def record_job(run_dir: str | os.PathLike[str], entry: dict[str, Any]) -> None:
    """Append one submitted job (or an event such as a cancel) to the run's jobs.jsonl."""
    line = json.dumps({**entry, "time": time.time(), "host": socket.gethostname()}) + "\n"
    append_line(RunDir(run_dir).jobs, line)  # one short line per write: appends do not interleave


def find_job(job_id: str, run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The newest record of ``job_id`` in the run dir (later lines, e.g. a cancel, update earlier ones).

    A record decides which pid ``cancel`` signals and which folder ``status`` reads: UntrustedFile when someone
    else could have written jobs.jsonl (another user's run dir, a link, a file others can write)."""
    try:
        data = read_trusted(RunDir(run_dir).jobs, _JOBS_MAX_BYTES)
    except UntrustedFile:
        raise
    except OSError:
        return None
    lines = (data or b"").decode("utf-8", errors="replace").splitlines()
    found: dict[str, Any] | None = None
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and str(entry.get("job_id")) == str(job_id):
            found = {**(found or {}), **entry}
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def local_state(entry: dict[str, Any]) -> str:
    """A local-executor job's state: RUNNING while its controller lives (on this host), else from the ranks'
    result records: COMPLETED when every rank left a success, CANCELLED after ``hpcdist cancel``, else FAILED."""
    if entry.get("host") != socket.gethostname():
        return f"UNKNOWN (it runs on {entry.get('host')}; ask there)"
    if _alive(int(entry["job_id"])):
        return "RUNNING"
    from hpcdist.launch.task import read_result  # each rank's result record, as JobHandle reads it (no pickle)

    outcomes = [read_result(entry["folder"], str(entry["job_id"]), rank) for rank in range(int(entry["num_tasks"]))]
    if all(o is not None and o[0] == "success" for o in outcomes):
        return "COMPLETED"
    return "CANCELLED" if entry.get("cancelled") else "FAILED"


def cancel_local(entry: dict[str, Any], run_dir: str | os.PathLike[str]) -> None:
    """Interrupt a local job's controller (what submitit's LocalJob.cancel sends); OSError when it is not ours."""
    if entry.get("host") != socket.gethostname():
        raise OSError(f"job {entry['job_id']} runs on {entry.get('host')}; cancel it there")
    pid = int(entry["job_id"])
    if not _alive(pid):
        raise OSError(f"job {pid} has already ended")
    os.kill(pid, signal.SIGINT)
    record_job(run_dir, {"job_id": entry["job_id"], "cancelled": True})


def last_step(run_dir: str | os.PathLike[str]) -> tuple[int | None, float | None]:
    """(step, loss) of the last training line in the run's metrics.jsonl."""
    step = loss = None
    try:  # the run dir may be anyone's: no FIFO (a hang), no reading a huge file whole
        lines = read_tail(RunDir(run_dir).metrics, _TAIL_BYTES).decode("utf-8", errors="replace").splitlines()
    except OSError:
        return None, None
    for line in lines:
        try:
            m = json.loads(line)
        except ValueError:
            continue  # a line being written
        if "split" not in m and "loss" in m:
            step, loss = m.get("step"), m.get("loss")
    return step, loss


def run_summary(run_dir: str | os.PathLike[str], job_id: str | None = None) -> str:
    """Progress of the run (any job that trained in it, plain sbatch included): last step and loss, and the
    restart ledger's attempts of ``job_id``."""
    rd = RunDir(run_dir)
    step, loss = last_step(run_dir)
    lines = [
        f"run dir {rd.root}: "
        + (f"step {step}, loss {loss:.4f}" if step is not None and loss is not None else "no training step logged yet")
    ]
    try:
        ledger = json.loads(read_tail(rd.restarts, _TAIL_BYTES))
    except (OSError, ValueError):  # a ledger cut at _TAIL_BYTES is no ledger (it is a few KiB)
        ledger = None
    if isinstance(ledger, dict) and (job_id is None or str(ledger.get("job_id")) == str(job_id)):
        attempts, stopped = ledger.get("attempts") or {}, ledger.get("stopped")
        attempts = attempts if isinstance(attempts, dict) else {}
        in_job = sum(1 for a in attempts.values() if isinstance(a, dict) and a.get("restarted") == "in-job")
        lines.append(
            f"restart ledger of job {ledger.get('job_id')}: {len(attempts)} attempt(s)"
            + (f" ({in_job} restarted in the job)" if in_job else "")
            + (f", stopped: {stopped}" if stopped else "")
        )
        lines += _excluded_lines(ledger, attempts)
    for host, cause in unhealthy_hosts(run_dir, job_id=job_id).items():  # the gate kept these hosts out
        lines.append(f"unhealthy node {host}: {cause}")
    return "\n".join(lines)


def _short(value: Any, limit: int = 200) -> str:
    text = " ".join(str(value).split())  # one line, whatever the file holds
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _excluded_lines(ledger: dict[str, Any], attempts: dict[str, Any]) -> list[str]:
    """Nodes this job stopped using (why a node failed the health gate is failures.jsonl's: unhealthy_hosts)."""
    out = []
    excluded: set[str] = set()
    for a in attempts.values():
        if isinstance(a, dict) and isinstance(a.get("excluded"), list):
            excluded |= {_short(h, 80) for h in a["excluded"][:100]}
    if isinstance(ledger.get("excluded"), list):
        excluded |= {_short(h, 80) for h in ledger["excluded"][:100]}
    if excluded:
        out.append(f"  not used by this job: {', '.join(sorted(excluded)[:50])}")
    return out
