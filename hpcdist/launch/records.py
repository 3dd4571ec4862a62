"""What ``hpcdist status|logs|cancel`` read when SLURM cannot answer: the run directory's own records.

``submit`` appends one line per job to ``<run.dir>/jobs.jsonl`` (id, executor, log folder, ranks, host, snapshot);
a local-executor job's id is its controller's pid on that host. For any job (plain batch scripts included) the run's
metrics and restart ledger give its progress. Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

from hpcdist.base.atomic import UntrustedFile, append_line, read_trusted
from hpcdist.base.rundir import RunDir
from hpcdist.base.untrusted import one_line, parse_jsonl
from hpcdist.fault.failures import unhealthy_hosts
from hpcdist.report.rundata import checkpoint_tiers, read_ledger, read_records

__all__ = [
    "UntrustedFile",
    "cancel_local",
    "end_local_job",
    "find_job",
    "last_step",
    "local_state",
    "record_job",
    "run_summary",
]

_JOBS_MAX_BYTES = 64 << 20  # one short line per submission: hundreds of thousands of jobs
_TAIL_BYTES = 16 << 20  # the newest lines of metrics.jsonl: thousands of steps, the last one among them
_CONTROLLER = "submitit.local._local"  # in the command line of submitit's local controller (and of its /bin/sh)


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
    found: dict[str, Any] | None = None
    for entry in parse_jsonl(data or b""):
        if str(entry.get("job_id")) == str(job_id):
            found = {**(found or {}), **entry}
    return found


def _alive(pid: int) -> bool:
    """The process exists and has not ended (a zombie has: only its parent has not collected its status yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    state = _proc_table([pid]).get(pid)
    return state is None or state[1] != "Z"  # None: no /proc here, or it ended just now (then the next poll sees it)


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


def _proc_table(only: list[int] | None = None) -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) of every process now, or of ``only`` (Linux /proc; empty elsewhere)."""
    table: dict[int, tuple[int, str]] = {}
    try:
        entries = [str(p) for p in only] if only is not None else os.listdir("/proc")
    except OSError:
        return table
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:  # a kernel file: small, never a FIFO
                fields = f.read(4096).decode("ascii", errors="replace").rpartition(")")[2].split()
            table[int(name)] = (int(fields[1]), fields[0])
        except (OSError, ValueError, IndexError):
            continue  # it ended while we looked
    return table


def _tree(root: int, table: dict[int, tuple[int, str]] | None = None) -> list[int]:
    """``root`` and every live descendant (zombies have ended: only their parent has not collected them)."""
    table = _proc_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in table and table[pid][1] != "Z":
            found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read(1 << 16).replace(b"\0", b" ").decode("utf-8", errors="replace")
    except OSError:
        return ""


def cancel_local(entry: dict[str, Any], run_dir: str | os.PathLike[str], grace_s: float = 60.0) -> str:
    """End a local-executor job recorded in the run dir and wait until it has ended: what ended (OSError: not ours,
    already gone, or still running after SIGKILL)."""
    if entry.get("host") != socket.gethostname():
        raise OSError(f"job {entry['job_id']} runs on {entry.get('host')}; cancel it there")
    pid = int(entry["job_id"])
    if not _alive(pid):
        raise OSError(f"job {pid} has already ended")
    if os.path.isdir("/proc") and _CONTROLLER not in _cmdline(pid):  # the job ended and its pid went to another
        raise OSError(f"job {pid} has already ended (pid {pid} now belongs to another program)")
    record_job(run_dir, {"job_id": entry["job_id"], "cancelled": True})  # first: status then says why it ended
    return end_local_job(pid, grace_s)


def end_local_job(pid: int, grace_s: float = 60.0, kill_wait_s: float = 10.0) -> str:
    """Stop the local-executor job whose controller (or the controller's ``/bin/sh`` wrapper) is ``pid``; wait until
    every process of it has ended; return what ended, or raise OSError naming what still runs after SIGKILL.

    A signal to the recorded pid is not enough: with setup lines it is a ``/bin/sh -c`` that passes nothing on, and
    the ranks trained on. So the ranks (the controller's children) get SIGINT, the trainer's "checkpoint and stop";
    not the controller: it SIGKILLs its ranks one second after its own SIGINT, mid-save. The controller leaves when
    they have. A process that ignores SIGINT (a job started from ``nohup`` or a background shell, still starting:
    the trainer installs its handler after its imports) gets it once it no longer ignores it: sent before, it would be
    lost. What still lives after ``grace_s`` gets SIGKILL, as the scheduler does when cancelling."""
    table = _proc_table()
    processes = _tree(pid, table) or [pid]
    controllers = {p for p in processes if _CONTROLLER in _cmdline(p)}
    # the controller runs under its own /bin/sh wrapper (setup lines): both match, and the controller, a child of the
    # wrapper, is no rank. A SIGINT to it would make it interrupt the ranks a second time (abort, no stop checkpoint)
    ranks = [p for p in processes if p not in controllers and table.get(p, (0, ""))[0] in controllers]
    unsent = list(ranks or [pid])  # no rank yet (or no /proc): the controller, as submitit's LocalJob.cancel does

    def interrupt() -> None:
        for p in list(unsent):
            if not _ignores(p, signal.SIGINT):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGINT)
                unsent.remove(p)

    interrupt()
    how = f"SIGINT to {len(ranks)} rank(s)" if ranks else f"SIGINT to {pid}"
    left = _wait_gone(pid, processes, grace_s, poll=interrupt)
    if unsent:
        how += f" ({len(unsent)} ignored SIGINT throughout)"
    if left:
        for p in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        how += f", SIGKILL to {len(left)} still running after {grace_s:g} s"
        left = _wait_gone(pid, left, kill_wait_s)
        if left:
            raise OSError(f"job {pid}: process(es) {', '.join(map(str, left))} still run after SIGKILL ({how})")
    return f"{len(processes)} process(es) ended ({how})"


def _ignores(pid: int, sig: int) -> bool:
    """``pid`` ignores ``sig`` now (the SigIgn mask of /proc/<pid>/status; False where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:  # a kernel file: small, never a FIFO
            text = f.read(1 << 16).decode("ascii", errors="replace")
    except OSError:
        return False
    found = re.search(r"^SigIgn:\s*([0-9a-fA-F]+)$", text, re.MULTILINE)
    return found is not None and bool(int(found.group(1), 16) >> (sig - 1) & 1)


def _wait_gone(root: int, pids: list[int], timeout_s: float, poll: Callable[[], None] = lambda: None) -> list[int]:
    """Poll until none of ``pids`` (nor a new descendant of ``root``) lives, calling ``poll`` each time; those still
    alive at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        poll()
        table = _proc_table()
        left = sorted({p for p in pids if p in table and table[p][1] != "Z"} | set(_tree(root, table)))
        if not table:  # no /proc: the root's liveness is all we can see
            left = [root] if _alive(root) else []
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def last_step(run_dir: str | os.PathLike[str]) -> tuple[int | None, float | None]:
    """(step, loss) of the last training line in the run's metrics.jsonl (its newest lines, read as records anyone
    could have written: hpcdist.report.rundata.read_records)."""
    step = loss = None
    for m in read_records(RunDir(run_dir).metrics, _TAIL_BYTES):
        value = m.get("loss")
        if "split" not in m and isinstance(m.get("step"), int) and isinstance(value, (int, float)):
            step, loss = m["step"], value
    return step, loss


def run_summary(run_dir: str | os.PathLike[str], job_id: str | None = None) -> str:
    """Progress of the run (any job that trained in it, plain batch scripts included): last step and loss, and the
    restart ledger's attempts of ``job_id``. Every value from the run dir is printed as one printable line."""
    rd = RunDir(run_dir)
    step, loss = last_step(run_dir)
    lines = [
        f"run dir {rd.root}: "
        + (f"step {step}, loss {loss:.4f}" if step is not None and loss is not None else "no training step logged yet")
    ]
    ledger = read_ledger(run_dir)
    if ledger and (job_id is None or str(ledger.get("job_id")) == str(job_id)):
        attempts, stopped = ledger["attempts"], ledger["stopped"]
        in_job = sum(1 for a in attempts.values() if a.get("restarted") == "in-job")
        lines.append(
            one_line(
                f"restart ledger of job {ledger.get('job_id')}: {len(attempts)} attempt(s)"
                + (f" ({in_job} restarted in the job)" if in_job else "")
                + (f", stopped: {stopped['reason']}" if stopped else ""),
                1000,
            )
        )
        lines += _excluded_lines(ledger, attempts)
    for host, cause in unhealthy_hosts(run_dir, job_id=job_id).items():  # the gate kept these hosts out
        lines.append(f"unhealthy node {one_line(host, 80)}: {one_line(cause, 500)}")
    tiers = checkpoint_tiers_text(run_dir)
    if tiers:
        lines.append(tiers)
    return "\n".join(lines)


def checkpoint_tiers_text(run_dir: str | os.PathLike[str]) -> str:
    """One line for `hpcdist status`: both tiers' newest steps ("" when the run has neither)."""
    t = checkpoint_tiers(run_dir)
    if "shared_step" not in t and "local_step" not in t:
        return ""
    shared = f"shared step {t['shared_step']} ({t['shared_dir']})" if "shared_step" in t else "no shared checkpoint"
    local = ""
    if "local_step" in t:
        size = t.get("local_bytes_per_node")
        ago = time.time() - t["local_time"] if "local_time" in t else None
        local = (
            f"; node-local step {t['local_step']} ("
            + ("with peer copies" if t["local_copies"] else "no peer copies")
            + (f", {size / 1e6:,.1f} MB per node" if size is not None else "")
            + (f", saved {ago:.0f} s ago" if ago is not None else "")
            + ")"
        )
    return one_line(f"checkpoints: {shared}{local}", 1000)


def _excluded_lines(ledger: dict[str, Any], attempts: dict[str, Any]) -> list[str]:
    """Nodes this job stopped using (why a node failed the health gate is failures.jsonl's: unhealthy_hosts)."""
    out = []
    excluded: set[str] = set()
    for a in attempts.values():
        if isinstance(a.get("excluded"), list):
            excluded |= {one_line(h, 80) for h in a["excluded"][:100]}
    excluded |= {one_line(h, 80) for h in ledger["excluded"][:100]}
    if excluded:
        out.append(f"  not used by this job: {', '.join(sorted(excluded)[:50])}")
    return out
