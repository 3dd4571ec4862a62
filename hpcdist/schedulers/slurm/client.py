"""SLURM's command-line tools (sbatch's controller check, srun, scontrol, sinfo, squeue, sacct, scancel), all run
through one helper, :func:`call`: every call has a timeout and reports failures as :class:`SlurmError` with the
tool's own message, so the CLI prints one line instead of a traceback. Nothing here imports torch or submitit.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from hpcdist.base.logging_utils import get_logger
from hpcdist.base.rundir import RunDir
from hpcdist.schedulers.base import SchedulerError

__all__ = [
    "TERMINAL_STATES",
    "SlurmError",
    "ToolMissing",
    "ToolTimeout",
    "call",
    "cancel",
    "check_job_id",
    "client_installed",
    "job_info",
    "job_state",
    "log_path",
    "run",
    "scontrol_requeue",
    "sinfo_usable_nodes",
    "slurm_reachable",
    "srun_once_per_node",
    "status_text",
    "tool_installed",
]

log = get_logger(__name__)

TIMEOUT_S = 10.0
# scontrol requeue / update: the controller may be busy, but a requeue that never returns would hold the job.
REQUEUE_TIMEOUT_S = 60.0
# sinfo for node exclusion: without an answer the exclusion goes ahead without the partition check.
SINFO_TIMEOUT_S = 30.0
# Seconds the controller has to answer `scontrol ping` / `sinfo` before submit gives up with an error (never a
# fallback to local processes: sbatch is installed, so this is a login node). A site with a slow controller raises
# it with HPCDIST_SLURM_PING_TIMEOUT.
PING_TIMEOUT_S = 5.0
PING_TIMEOUT_ENV = "HPCDIST_SLURM_PING_TIMEOUT"
# States after which a job never runs again. PREEMPTED is not among them: with --requeue the job returns.
TERMINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
)
_JOB_ID = re.compile(r"\d+(?:_\d+)?")


class SlurmError(SchedulerError):
    """A SLURM tool is missing, timed out, or refused the request."""


class ToolMissing(SlurmError):
    """The tool is not on PATH (not a SLURM machine, or not a login/compute node)."""


class ToolTimeout(SlurmError):
    """The tool did not answer in time; ``stdout`` holds what it printed until then."""

    def __init__(self, message: str, stdout: str = "") -> None:
        super().__init__(message)
        self.stdout = stdout


def call(
    args: Sequence[str], *, timeout: float = TIMEOUT_S, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run SLURM tool ``args[0]`` (looked up on ``env``'s PATH) with ``args[1:]``; its exit status is the caller's.
    :class:`ToolMissing`, :class:`ToolTimeout`, or :class:`SlurmError` when it could not be started."""
    exe = shutil.which(args[0], path=(env or os.environ).get("PATH"))
    if exe is None:
        raise ToolMissing(f"{args[0]} is not on PATH: is this a SLURM login node?")
    try:
        return subprocess.run([exe, *args[1:]], capture_output=True, text=True, timeout=timeout, check=False, env=env)
    except subprocess.TimeoutExpired as e:
        raw = e.stdout or b""
        out = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        raise ToolTimeout(f"{' '.join(args)} did not answer within {timeout:g} s", out) from None
    except OSError as e:
        raise SlurmError(f"{' '.join(args)} failed: {e.strerror}") from None


def run(args: Sequence[str], *, timeout: float = TIMEOUT_S, env: Mapping[str, str] | None = None) -> str:
    """:func:`call`, and its stdout; :class:`SlurmError` with the tool's last line when it exits non-zero."""
    proc = call(args, timeout=timeout, env=env)
    if proc.returncode != 0:
        message = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        raise SlurmError(f"{' '.join(args)}: {message[-1] if message else f'exit status {proc.returncode}'}")
    return proc.stdout


def check_job_id(job_id: str) -> str:
    """Accept ``123`` or ``123_4`` (array task); refuse anything else before it reaches a command line."""
    text = str(job_id).strip()
    if not _JOB_ID.fullmatch(text):
        raise SlurmError(f"{job_id!r} is not a job id (digits, or 123_4 for an array task)")
    return text


def tool_installed(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether SLURM tool ``name`` is on ``environ``'s PATH."""
    return shutil.which(name, path=(os.environ if environ is None else environ).get("PATH")) is not None


def client_installed(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a SLURM client is installed here (sbatch on PATH): submitit's own test for a SLURM machine."""
    return tool_installed("sbatch", environ)


def ping_timeout(environ: Mapping[str, str] | None = None) -> float:
    """PING_TIMEOUT_S, or HPCDIST_SLURM_PING_TIMEOUT (seconds > 0) when set."""
    text = (os.environ if environ is None else environ).get(PING_TIMEOUT_ENV, "").strip()
    if not text:
        return PING_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise SlurmError(f"{PING_TIMEOUT_ENV}={text!r}: must be a number of seconds > 0, e.g. 30")
    return value


def slurm_reachable(environ: Mapping[str, str] | None = None, *, timeout: float | None = None) -> tuple[bool, str]:
    """(True, how) when sbatch is on PATH and a controller answers within ``timeout`` (default
    :func:`ping_timeout`); else (False, why).

    submitit's AutoExecutor picks SLURM whenever sbatch exists, even on a machine whose controller is down or
    absent ("Could not establish a configuration source"): ask the controller itself.
    """
    env = dict(os.environ if environ is None else environ)
    timeout = ping_timeout(env) if timeout is None else timeout
    if shutil.which("sbatch", path=env.get("PATH")) is None:
        return False, "sbatch is not on PATH"
    reasons = []
    try:
        out = run(["scontrol", "ping"], timeout=timeout, env=env)
        if re.search(r"\bUP\b", out):
            return True, out.strip().splitlines()[0]
        reasons.append(f"scontrol ping: {out.strip() or 'no controller UP'}")
    except SlurmError as e:
        reasons.append(str(e))
    try:
        run(["sinfo", "-h", "-o", "%P"], timeout=timeout, env=env)
        return True, "sinfo answered"
    except SlurmError as e:
        reasons.append(str(e))
    return False, "; ".join(reasons)


def job_info(job_id: str) -> dict[str, str]:
    """``scontrol show job -o`` as a dict (JobState, Reason, StdOut, NodeList, ...); {} when SLURM forgot the job."""
    job_id = check_job_id(job_id)
    try:
        out = run(["scontrol", "show", "job", "-o", job_id])
    except SlurmError as e:
        if "Invalid job id" in str(e):
            return {}  # finished longer than MinJobAge ago
        raise
    info: dict[str, str] = {}
    first = out.strip().splitlines()[0] if out.strip() else ""
    # values may contain spaces (Command=..., JobName=...): split only before the next Key= token
    for match in re.finditer(r"(\w[\w:/]*)=(.*?)(?=\s+\w[\w:/]*=|$)", first):
        info.setdefault(match.group(1), match.group(2))
    return info


def _sacct_state(job_id: str) -> str | None:
    try:
        out = run(["sacct", "-n", "-X", "-P", "-o", "State", "-j", job_id])
    except SlurmError:
        return None  # accounting disabled or unreachable
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    return lines[-1].split()[0] if lines else None  # "CANCELLED by 1000" -> CANCELLED


def job_state(job_id: str) -> str | None:
    """JobState from the controller, else from accounting; None when neither knows the job."""
    job_id = check_job_id(job_id)
    info = job_info(job_id)
    if info.get("JobState"):
        return info["JobState"]
    return _sacct_state(job_id)


def cancel(job_id: str, wait_s: float = 120.0, poll_s: float = 1.0) -> str:
    """scancel the job (all its steps and tasks) and wait until SLURM says it has ended: its final state.

    scancel returns once the request is queued; the tasks get SIGTERM, then SIGKILL after KillWait (30 s by default),
    and the job passes through COMPLETING. SlurmError when it has not ended after ``wait_s``: "cancelled" is said only
    of a job that has ended."""
    job_id = check_job_id(job_id)
    run(["scancel", job_id])
    deadline = time.monotonic() + wait_s
    while True:
        try:
            state = job_state(job_id)
        except SlurmError:
            state = "UNKNOWN (the controller did not answer)"
        if state is None:
            return "ended (SLURM no longer knows it)"
        base = state.split()[0].rstrip("+")
        if base in TERMINAL_STATES:
            return base
        if time.monotonic() >= deadline:
            raise SlurmError(
                f"scancel {job_id} was sent, but the job is still {state} after {wait_s:g} s; "
                f"see `hpcdist status {job_id}`"
            )
        time.sleep(poll_s)


def status_text(job_id: str | None = None) -> str:
    """One job's summary (scontrol, else sacct), or this user's queue (squeue)."""
    if job_id is None:
        user = os.environ.get("USER") or os.environ.get("LOGNAME") or ""
        args = ["squeue", "-o", "%.12i %.10P %.24j %.9T %.10M %.10l %.5D %R"]
        return run([*args, "-u", user] if user else args).rstrip()
    job_id = check_job_id(job_id)
    info = job_info(job_id)
    if info:
        keys = (
            "JobId",
            "JobName",
            "JobState",
            "Reason",
            "RunTime",
            "TimeLimit",
            "NumNodes",
            "NumTasks",
            "NodeList",
            "Restarts",
            "StdOut",
            "StdErr",
        )
        return "\n".join(f"{k:>10}: {info[k]}" for k in keys if k in info)
    out = run(["sacct", "-X", "-j", job_id, "-o", "JobID,JobName%24,State,Elapsed,NNodes,NodeList,ExitCode"])
    return out.rstrip()


def log_path(job_id: str, *, rank: int = 0, err: bool = False, run_dir: str | os.PathLike[str] | None = None) -> Path:
    """Path of a rank's log: ``<folder>/<jobid>_<rank>_log.out`` (submitit's layout).

    The folder comes from the job's StdOut (while SLURM remembers the job), else from ``run_dir``: its
    ``slurm/`` subfolder (the default log_dir) or ``run_dir`` itself when the logs are there.
    """
    job_id = check_job_id(job_id)
    name = f"{job_id}_{rank}_log.{'err' if err else 'out'}"
    candidates: list[Path] = []
    if run_dir is not None:
        candidates += [RunDir(run_dir).slurm_logs, Path(run_dir)]
    else:
        try:
            stdout = job_info(job_id).get("StdOut")
        except SlurmError as e:
            raise SlurmError(f"{e}; pass --run-dir to find the logs without SLURM") from None
        if stdout:
            candidates.append(Path(stdout).parent)
    for folder in candidates:
        if (folder / name).is_file():
            return folder / name
    where = ", ".join(str(c) for c in candidates) or "nowhere (SLURM no longer knows the job)"
    raise SlurmError(f"no log {name} in {where}; pass --run-dir (the run.dir or log_dir of the job)")


# ----------------------------------------------------------------------------------------- the job's side


def scontrol_requeue(job_id: str, *, exclude: Iterable[str] = ()) -> int:
    """``scontrol requeue`` ``job_id``, then keep it off ``exclude`` (ExcNodeList) while it is pending. 0 when
    requeued, else 4 (said why)."""
    fallback = (
        f"resubmit a follow-up that starts when this one ends: sbatch --dependency=afterany:{job_id} <same script>; "
        "it resumes from the checkpoint just written"
    )
    try:
        p = call(["scontrol", "requeue", job_id], timeout=REQUEUE_TIMEOUT_S)
    except ToolMissing:
        log.error("cannot requeue job %s: scontrol is not on PATH; %s", job_id, fallback)
        return 4
    except ToolTimeout:
        log.error("scontrol requeue %s timed out; %s", job_id, fallback)
        return 4
    if p.returncode != 0:
        log.error("scontrol requeue %s failed (%s); %s", job_id, (p.stderr or p.stdout).strip(), fallback)
        return 4
    log.info("requeued job %s; the next run resumes from the checkpoint just written", job_id)
    exclude = sorted(set(exclude))
    if exclude:
        # ExcNodeList can only change while the job is pending, i.e. now; SLURM holds a requeued job for a while
        # (BeginTime) before it may start again, so the update lands before the next start
        arg = f"ExcNodeList={','.join(exclude)}"
        try:
            p = call(["scontrol", "update", f"jobid={job_id}", arg], timeout=REQUEUE_TIMEOUT_S)
            ok, why = p.returncode == 0, (p.stderr or p.stdout).strip()
        except ToolTimeout:
            ok, why = False, "timed out"
        if ok:
            log.info("job %s will avoid %s", job_id, ",".join(exclude))
        else:
            log.warning(
                "scontrol update jobid=%s %s failed (%s); the job may run on those nodes again", job_id, arg, why
            )
    return 0


def sinfo_usable_nodes(partition: str | None) -> list[str] | None:
    """Nodes of the partition that can run jobs (not down, drained, failed or unresponsive); None if unknown."""
    try:
        p = call(
            ["sinfo", "-h", "-N", "-o", "%N %t"] + (["-p", partition] if partition else []), timeout=SINFO_TIMEOUT_S
        )
    except SlurmError:
        return None
    if p.returncode != 0:
        return None
    nodes = []
    for line in p.stdout.splitlines():
        name, _, state = line.strip().partition(" ")
        bad = state.endswith("*") or state.startswith(("down", "drain", "drng", "fail", "maint", "inval"))
        if name and not bad and name not in nodes:
            nodes.append(name)
    return nodes


def srun_once_per_node(nodes: Sequence[str], argv: Sequence[str], *, timeout: float) -> tuple[str, int | None] | None:
    """``argv`` once on each of ``nodes`` (one srun step, one task per node, a failing task ends nothing): (its
    stdout, its exit status or None when it ran past ``timeout``); None where srun is not installed."""
    cmd = [
        "srun",
        f"--nodes={len(nodes)}",
        f"--ntasks={len(nodes)}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(nodes)}",
        "--kill-on-bad-exit=0",
        "--cpus-per-task=1",
        *argv,
    ]
    try:
        p = call(cmd, timeout=timeout)
    except ToolMissing:
        return None
    except ToolTimeout as e:
        return e.stdout, None
    return p.stdout, p.returncode
