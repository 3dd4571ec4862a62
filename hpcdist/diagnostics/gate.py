"""The health gate: can this node take part in the next attempt?

Run once per node before an attempt (``srun --ntasks-per-node=1 hpcdist health --json ...``, the in-job restart
loop) or by hand on a node. Every check runs in its own thread under a deadline: the fast checks under
``timeout_s`` (30 s by default), the device checks (gpus, matmul) under ``device_timeout_s`` (120 s), since they
first import torch and start CUDA, which from a shared file system read by every node at once can take a minute.
The two run side by side, so the gate ends within the larger of the two. A wedged GPU, a hung ``nvidia-smi`` or a
hung file system makes its check fail with "did not finish", never the gate hang. Each check answers ``ok``,
``fail: <why>`` or ``skipped: <why>`` (it cannot run here: no ``nvidia-smi``, no InfiniBand expected); only a
``fail`` makes the node unhealthy.

    gpus        visible CUDA devices >= the GPUs the job asked for on this node (``gpus``; the attempt loop passes the
                GPUs per node the job asked the scheduler for). A node with no NVIDIA driver loaded, given
                ``gpus``: fails at once when it has NVIDIA device files (/dev/nvidia0...: a GPU node whose driver
                is down, which an A100 user must not train on), is skipped when it has none either (the
                scheduler's GPUs there are count-only or stand-ins, as on a CPU test cluster); without ``gpus``
                both device checks are skipped
    matmul      the diagnostics' device check (hpcdist.diagnostics.health) on every visible GPU, on the CPU when
                there is none
                Both import torch (seconds of every attempt's start on every node), so they run only where there
                is a GPU to test: a node with an NVIDIA driver (/proc/driver/nvidia/gpus). A node without a driver
                and a job that asked for no GPU (a CPU partition) skips them, saying so.
    nvidia_smi  uncorrectable ECC errors (volatile), pending page retirement, pending row remapping and row
                remapping failures, from ``nvidia-smi --query-gpu`` / ``--query-remapped-rows``
    xid         hardware Xid errors (GPU fell off the bus, double-bit ECC, NVLink, ...) of the last
                ``xid_window_s`` in the kernel log (``dmesg``): the driver reports Xids only there, nvidia-smi has
                no query for them
    infiniband  every InfiniBand port under /sys/class/infiniband ACTIVE, when the NCCL profile relies on IB
    run_dir     the run dir (or its nearest existing parent) writable, with ``min_free_gb`` free
    shm         /dev/shm with ``min_shm_gb`` free (NCCL's intra-node buffers, data-loader workers)

Tool output is untrusted text: each command runs with a timeout in its own session (killed with its children),
its output is capped at _OUTPUT_CAP bytes, and every field is validated; output that cannot be read is a failure
with the offending text quoted (shortened), never a traceback.

A failing node is recorded in failures.jsonl (:func:`record_unhealthy`, kind ``health``, blaming the host: the
restart policy excludes it; ``hpcdist status`` shows the reason).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcdist.base.errors import CommandError
from hpcdist.base.untrusted import one_line
from hpcdist.fault.health import DEFAULT_DEVICE_TIMEOUT_S, DEFAULT_TIMEOUT_S, record_unhealthy

__all__ = ["CHECKS", "NodeHealth", "check_node", "cmd_health"]

CHECKS = ("gpus", "matmul", "nvidia_smi", "xid", "infiniband", "run_dir", "shm")
DEFAULT_MIN_FREE_GB = 1.0
DEFAULT_MIN_SHM_GB = 1.0

_OUTPUT_CAP = 256 << 10  # bytes a tool may print: 8 GPUs x a CSV line is < 1 KiB; a kernel log is larger
_DMESG_CAP = 4 << 20  # the kernel ring buffer is 256 KiB - a few MiB
_MAX_GPUS = 64  # lines of nvidia-smi output accepted (a node has 8, at most 16)
_SHOWN = 80  # characters of untrusted text quoted in a reason

# Xids that mean the GPU (or its memory / NVLink) is broken until a reset or a repair, after NVIDIA's Xid
# catalogue: 48 double-bit ECC, 61/62 internal micro-controller halt, 64 row-remapping failure, 74 NVLink error,
# 79 fell off the bus, 95 uncontained ECC error, 119/120 GSP error. Left out: application faults (13, 31, 43,
# 45: a bad kernel, an illegal address, a killed context say nothing about the node), and 63/92/94 (a row remap
# recorded, a high corrected-error rate, a contained ECC error): the pending row remapping they lead to is
# nvidia_smi's check, and it clears with the reset that repairs it, while the kernel log keeps the Xid until reboot.
HARDWARE_XIDS = frozenset({48, 61, 62, 64, 74, 79, 95, 119, 120})
DEFAULT_XID_WINDOW_S = 24 * 3600.0  # "recent": an Xid older than this is taken as dealt with (reset, drained, back)
# "[ 1234.567890] NVRM: Xid (PCI:0000:3b:00): 79, pid=..., ...": the bracket is seconds since boot (dmesg's default)
# The location is text on the Xid's own line (a newline inside the parentheses is no location), printed through
# hpcdist.base.untrusted.one_line (an escape in it is shown, not sent to the terminal); a reason lists at most
# _MAX_XID_LINES GPU/Xid pairs: 20,000 distinct Xids are one short reason.
_XID_LINE = re.compile(r"^(?:\[\s*(\d{1,10})(?:\.\d+)?\])?.*?NVRM: Xid \(([^)\n]{1,64})\): (\d{1,5})\b", re.MULTILINE)
_MAX_XID_LINES = 16

_NA = {"[N/A]", "N/A", "[Not Supported]", "Not Supported", "[Unknown Error]"}
_YES = {"yes", "1", "true"}
_NO = {"no", "0", "false"}


# ------------------------------------------------------------------------------------------------ result


@dataclass
class NodeHealth:
    """The gate's verdict on one node: each check's ``ok`` / ``fail: ..`` / ``skipped: ..``."""

    host: str
    checks: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.reasons

    @property
    def reasons(self) -> list[str]:
        """One line per failed check: ``<check>: <why>``."""
        return [f"{name}: {text[len('fail: ') :]}" for name, text in self.checks.items() if text.startswith("fail")]

    def as_json(self) -> dict[str, Any]:
        """The one JSON line of ``hpcdist health --json`` (the in-job restart loop parses it)."""
        return {
            "host": self.host,
            "ok": self.ok,
            "reasons": self.reasons,
            "checks": dict(self.checks),
            "seconds": round(self.seconds, 3),
        }

    def lines(self) -> list[str]:
        """Human form: one line per check, then the verdict."""
        width = max(map(len, self.checks), default=0)
        out = [f"{name:<{width}}  {text}" for name, text in self.checks.items()]
        verdict = "healthy" if self.ok else f"UNHEALTHY ({len(self.reasons)} check(s) failed)"
        out.append(f"{self.host}: {verdict} in {self.seconds:.1f} s")
        return out


class _Fail(Exception):
    """A check's failure: its message is the reason."""


class _Skip(Exception):
    """A check that cannot run here: its message says why."""


def _quoted_untrusted(text: str | bytes) -> str:
    """Untrusted text quoted in a reason: one line, printable, at most _SHOWN characters."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    text = text.strip()
    return repr(text[:_SHOWN] + ("..." if len(text) > _SHOWN else ""))


# ------------------------------------------------------------------------------------------------ tools


def run_tool(
    argv: Sequence[str], *, timeout_s: float, cap: int = _OUTPUT_CAP, environ: Mapping[str, str] | None = None
) -> tuple[int, bytes]:
    """(exit status, stdout + stderr) of a command, bounded: killed with its children (its own session) after
    ``timeout_s`` (_Fail "did not answer") or once it printed more than ``cap`` bytes (_Fail "printed more").
    Never waits on a grandchild that kept the pipe open."""
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # one killpg ends the tool and whatever it started
            env={**(os.environ if environ is None else environ), "LC_ALL": "C"},  # the format the parsers expect
        )
    except OSError as e:
        raise _Fail(f"cannot run {argv[0]}: {e.strerror or e}") from None
    deadline = time.monotonic() + max(timeout_s, 0.0)
    chunks: list[bytes] = []
    size = 0
    why = ""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                why = f"did not answer within {timeout_s:.1f} s"
                break
            if not sel.select(timeout=left):
                continue
            data = os.read(proc.stdout.fileno(), 65536)
            if not data:
                break  # EOF: the tool (and every child holding the pipe) is done
            chunks.append(data)
            size += len(data)
            if size > cap:
                why = f"printed more than {cap >> 10} KiB"
                break
    if why:
        _kill_tool_session(proc)
        raise _Fail(f"{Path(argv[0]).name} {why}")
    try:
        rc = proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:  # closed its output but does not exit
        _kill_tool_session(proc)
        raise _Fail(f"{Path(argv[0]).name} did not exit within {timeout_s:.1f} s") from None
    finally:
        proc.stdout.close()
    with contextlib.suppress(ProcessLookupError, PermissionError):  # what it left behind in its session
        os.killpg(proc.pid, signal.SIGKILL)
    return rc, b"".join(chunks)


def _kill_tool_session(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.stdout is not None:  # a child that left the session (setsid) and still holds the pipe
        _kill_pipe_holders(proc.stdout.fileno())
    with contextlib.suppress(subprocess.TimeoutExpired):  # unkillable (D state): left to the kernel, the gate goes on
        proc.wait(timeout=5)
    if proc.stdout is not None:
        proc.stdout.close()


def _kill_pipe_holders(fd: int, proc_root: str = "/proc") -> int:
    """SIGKILL every other process of ours holding the other end of the pipe ``fd`` reads: a tool's grandchild that
    started its own session (setsid) is out of the tool's process group, and would run on, holding the pipe, after
    the tool was killed. Found by the pipe's inode in /proc/<pid>/fd (Linux; nothing found elsewhere). How many."""
    try:
        target = f"pipe:[{os.fstat(fd).st_ino}]"
        pids = [p for p in os.listdir(proc_root) if p.isdigit() and int(p) != os.getpid()]
    except OSError:
        return 0
    killed = 0
    for pid in pids:
        try:
            fds = os.listdir(f"{proc_root}/{pid}/fd")  # another user's: PermissionError, not ours to kill anyway
            holds = any(os.readlink(f"{proc_root}/{pid}/fd/{n}") == target for n in fds)
        except OSError:
            continue
        if holds:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(pid), signal.SIGKILL)
                killed += 1
    return killed


def _csv_rows(text: bytes, what: str, columns: int) -> list[list[str]]:
    """``--format=csv,noheader`` output as rows of ``columns`` stripped fields; _Fail naming the first bad line."""
    try:
        decoded = text.decode("ascii")
    except UnicodeDecodeError:
        raise _Fail(f"{what}: output is not text: {_quoted_untrusted(text)}") from None
    rows = []
    for n, line in enumerate(decoded.splitlines(), 1):
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != columns:
            raise _Fail(f"{what} line {n}: {columns} fields expected, got {len(fields)}: {_quoted_untrusted(line)}")
        rows.append(fields)
        if len(rows) > _MAX_GPUS:
            raise _Fail(f"{what}: more than {_MAX_GPUS} lines (one per GPU expected)")
    return rows


def _count(value: str, what: str) -> int | None:
    """A non-negative counter; None when the GPU does not support it ([N/A])."""
    if value in _NA:
        return None
    if not re.fullmatch(r"\d{1,12}", value):
        raise _Fail(f"{what}: not a count: {_quoted_untrusted(value)}")
    return int(value)


def _flag(value: str, what: str) -> bool | None:
    """Yes/No (or 1/0); None when not supported."""
    if value in _NA:
        return None
    low = value.lower()
    if low in _YES:
        return True
    if low in _NO:
        return False
    raise _Fail(f"{what}: not Yes/No: {_quoted_untrusted(value)}")


_GPU_QUERY = "index,pci.bus_id,ecc.errors.uncorrected.volatile.total,retired_pages.pending"
_REMAP_QUERY = "gpu_bus_id,remapped_rows.pending,remapped_rows.failure"


def parse_gpu_query(text: bytes) -> list[str]:
    """Problems in ``nvidia-smi --query-gpu=<_GPU_QUERY> --format=csv,noheader`` output (one line per GPU)."""
    rows = _csv_rows(text, "nvidia-smi --query-gpu", 4)
    if not rows:
        raise _Fail("nvidia-smi --query-gpu listed no GPU")
    problems = []
    for index, bus, ecc, pending in rows:
        gpu = f"GPU {index} ({bus})" if re.fullmatch(r"[\w:.]{1,32}", bus) else f"GPU {index}"
        if not re.fullmatch(r"\d{1,3}", index):
            raise _Fail(f"nvidia-smi --query-gpu: not a GPU index: {_quoted_untrusted(index)}")
        errors = _count(ecc, f"{gpu} ecc.errors.uncorrected.volatile.total")
        if errors:
            problems.append(f"{gpu}: {errors} uncorrectable ECC error(s) since the driver loaded")
        if _flag(pending, f"{gpu} retired_pages.pending"):
            problems.append(f"{gpu}: a retired memory page is pending (needs a GPU reset)")
    return problems


def parse_remapped_rows(text: bytes) -> list[str]:
    """Problems in ``nvidia-smi --query-remapped-rows=<_REMAP_QUERY> --format=csv,noheader`` (A100 and newer)."""
    problems = []
    for bus, pending, failure in _csv_rows(text, "nvidia-smi --query-remapped-rows", 3):
        gpu = f"GPU {bus}" if re.fullmatch(r"[\w:.]{1,32}", bus) else "a GPU"
        if _flag(pending, f"{gpu} remapped_rows.pending"):
            problems.append(f"{gpu}: a row remapping is pending (needs a GPU reset)")
        if _flag(failure, f"{gpu} remapped_rows.failure"):
            problems.append(f"{gpu}: row remapping failed (the memory cannot be repaired)")
    return problems


def parse_xids(text: bytes, *, uptime_s: float | None = None, window_s: float = DEFAULT_XID_WINDOW_S) -> list[str]:
    """Hardware Xid errors in kernel log text, one line per GPU and Xid: those logged in the last ``window_s``
    seconds when the line has dmesg's seconds-since-boot stamp and ``uptime_s`` is known, else all of them."""
    seen: dict[tuple[str, int], int] = {}
    for match in _XID_LINE.finditer(text.decode("utf-8", "replace")):
        stamp, where, xid = match.group(1), match.group(2), int(match.group(3))
        if xid not in HARDWARE_XIDS:
            continue
        if stamp is not None and uptime_s is not None and uptime_s - int(stamp) > window_s:
            continue  # logged long ago: the GPU was reset or repaired since, or the other checks see it
        seen[(where, xid)] = seen.get((where, xid), 0) + 1
    hours = f"{window_s / 3600:g} h"
    found = sorted(seen.items())
    out = [
        f"Xid {xid} on {one_line(where, 64)} ({n} time(s) in the kernel log's last {hours})"
        for (where, xid), n in found
    ]
    if len(out) > _MAX_XID_LINES:
        out = [*out[:_MAX_XID_LINES], f"and {len(out) - _MAX_XID_LINES} more GPU/Xid pair(s) in the kernel log"]
    return out


def _uptime_s(proc_root: str | os.PathLike[str] = "/proc") -> float | None:
    """Seconds since boot (/proc/uptime's first field), None when unreadable."""
    try:
        with open(Path(proc_root) / "uptime", "rb") as f:
            return float(f.read(64).split()[0])
    except (OSError, ValueError, IndexError):
        return None


# ------------------------------------------------------------------------------------------------ checks


def _check_nvidia_smi(exe: str | None, budget: Callable[[], float], environ: Mapping[str, str]) -> str:
    if exe is None:
        raise _Skip("nvidia-smi is not on PATH")
    query = [exe, f"--query-gpu={_GPU_QUERY}", "--format=csv,noheader"]
    rc, out = run_tool(query, timeout_s=budget(), environ=environ)
    if rc != 0:  # "Unable to determine the device handle for GPU ...: Unknown Error": a GPU off the bus
        raise _Fail(f"nvidia-smi --query-gpu failed (exit {rc}): {_quoted_untrusted(out)}")
    problems = parse_gpu_query(out)
    query = [exe, f"--query-remapped-rows={_REMAP_QUERY}", "--format=csv,noheader"]
    rc, out = run_tool(query, timeout_s=budget(), environ=environ)
    if rc == 0:  # older GPUs (V100) and drivers have no row remapping: that query fails, retired pages cover them
        problems += parse_remapped_rows(out)
    if problems:
        raise _Fail("; ".join(problems))
    return "ok"


def _check_xid(exe: str | None, budget: Callable[[], float], environ: Mapping[str, str], window_s: float) -> str:
    if exe is None:
        raise _Skip("dmesg is not on PATH (Xids are reported only in the kernel log)")
    rc, out = run_tool([exe], timeout_s=budget(), cap=_DMESG_CAP, environ=environ)
    if rc != 0:  # dmesg_restrict: the kernel log is root's on many clusters
        raise _Skip(f"the kernel log is not readable here (dmesg exit {rc}: {_quoted_untrusted(out)})")
    problems = parse_xids(out, uptime_s=_uptime_s(), window_s=window_s)
    if problems:
        raise _Fail("; ".join(problems))
    return "ok"


DEV = Path("/dev")  # where a GPU node has its nvidia0, nvidia1, ... device files


def _check_infiniband(nccl_profile: str | None, sysfs_root: str | os.PathLike[str], environ: Mapping[str, str]) -> str:
    from hpcdist.config.nccl_profiles import expects_infiniband, load_profile
    from hpcdist.launch.nccl import ib_ports

    if not nccl_profile:
        raise _Skip("no NCCL profile named (--nccl-profile or HPCDIST_NCCL_PROFILE): InfiniBand not expected")
    if not expects_infiniband(load_profile(nccl_profile), environ):
        raise _Skip(f"the NCCL profile {nccl_profile} does not use InfiniBand")
    where = Path(sysfs_root) / "class" / "infiniband"
    ports = [p for p in ib_ports(sysfs_root) if p.infiniband]
    if not ports and not nvidia_device_files(DEV):
        # no GPU device here: ranks talk gloo over TCP, NCCL (and the profile's InfiniBand) is never used
        raise _Skip(f"no InfiniBand port and no GPU device ({DEV}/nvidia*): NCCL does not run on this node")
    if not ports:
        raise _Fail(f"the NCCL profile {nccl_profile} expects InfiniBand but {where} lists no InfiniBand port")
    down = [f"{p.hca} port {p.port}: {p.state or 'state unreadable'}" for p in ports if p.port and not p.active]
    if down:
        raise _Fail(f"InfiniBand port(s) not ACTIVE: {'; '.join(down)}")
    return "ok"


def _free_gb(path: Path) -> float:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize / 2**30


def _check_run_dir(run_dir: str | os.PathLike[str] | None, min_free_gb: float) -> str:
    if run_dir is None:
        raise _Skip("no run dir given (--run-dir)")
    path = Path(run_dir).absolute()
    probe = path
    while not probe.exists() and probe != probe.parent:  # the first attempt creates it: its parent must allow that
        probe = probe.parent
    if not probe.is_dir():
        raise _Fail(f"{probe} is not a directory")
    try:
        fd, name = tempfile.mkstemp(prefix=".hpcdist-health-", dir=probe)  # our own file, removed at once
        try:
            os.write(fd, b"health\n")
        finally:
            os.close(fd)
            os.unlink(name)
    except OSError as e:
        raise _Fail(f"{probe}: cannot create a file there: {e.strerror or e}") from None
    free = _free_gb(probe)
    if free < min_free_gb:
        raise _Fail(f"{probe} has {free:.2f} GiB free, less than {min_free_gb:g} GiB (--min-free-gb)")
    return "ok" if probe == path else f"ok (does not exist yet; {probe} is writable)"


def _check_shm(shm_dir: str | os.PathLike[str], min_gb: float) -> str:
    path = Path(shm_dir)
    if not path.is_dir():
        raise _Skip(f"no {path} here")
    free = _free_gb(path)
    if free < min_gb:
        raise _Fail(f"{path} has {free:.2f} GiB free, less than {min_gb:g} GiB (--min-shm-gb)")
    return "ok"


def nvidia_driver_gpus(proc_root: str | os.PathLike[str] = "/proc") -> int | None:
    """How many GPUs the NVIDIA kernel driver lists (one directory per PCI address under driver/nvidia/gpus),
    without CUDA or torch; None without the driver (a CPU node). Inside a container the host's driver shows too."""
    try:
        return sum(1 for _ in os.scandir(Path(proc_root) / "driver" / "nvidia" / "gpus"))
    except OSError:
        return None


def nvidia_device_files(dev_root: str | os.PathLike[str]) -> int:
    """How many NVIDIA GPU device files (``nvidia0``, ``nvidia1``, ...) ``dev_root`` holds. A GPU node has them
    even when its driver failed to load (SLURM's gres.conf names them, containers bind them); a CPU node, or one
    whose scheduler declares stand-in GPUs elsewhere (the SLURM sandbox's live in its own directory), has none."""
    try:
        return sum(1 for p in Path(dev_root).glob("nvidia[0-9]*") if p.name[len("nvidia") :].isdigit())
    except OSError:
        return 0


def _check_devices(gpus: int | None, results: dict[str, str], *, matmul: bool = True) -> None:
    """gpus and matmul together: both need torch (imported here, inside the deadline: seconds on a busy node)."""
    import torch

    from hpcdist.diagnostics.health import device_health

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus is None:
        results["gpus"] = f"skipped: no --gpus given ({count} visible)"
    elif count < gpus:
        results["gpus"] = f"fail: {count} GPU(s) visible, {gpus} requested"
    else:
        results["gpus"] = f"ok ({count} visible)"
    if not matmul:
        return
    devices = [f"cuda:{i}" for i in range(count)] or ["cpu"]
    bad = []
    for device in devices:
        out = device_health(device)
        if not out["ok"]:
            bad.append(f"{device}: {out['error']}")
    results["matmul"] = f"fail: {'; '.join(bad)}" if bad else f"ok ({', '.join(devices)})"


# ------------------------------------------------------------------------------------------------ the gate


def check_node(
    *,
    gpus: int | None = None,
    run_dir: str | os.PathLike[str] | None = None,
    min_free_gb: float = DEFAULT_MIN_FREE_GB,
    min_shm_gb: float = DEFAULT_MIN_SHM_GB,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    device_timeout_s: float = DEFAULT_DEVICE_TIMEOUT_S,
    nccl_profile: str | None = None,
    xid_window_s: float = DEFAULT_XID_WINDOW_S,
    skip: Sequence[str] = (),
    sysfs_root: str | os.PathLike[str] = "/sys",
    shm_dir: str | os.PathLike[str] = "/dev/shm",
    proc_root: str | os.PathLike[str] = "/proc",
    dev_root: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    host: str | None = None,
) -> NodeHealth:
    """Run every check of CHECKS on this node at once: the fast ones within ``timeout_s`` seconds, gpus and matmul
    within ``device_timeout_s`` (torch import and CUDA start-up included); never raises for a broken node (its
    checks fail). ``skip`` names checks not to run (``skipped: not asked``). ``nccl_profile``:
    the job's NCCL profile (HPCDIST_NCCL_PROFILE when None); tools are looked up on ``environ``'s PATH.

    Raises hpcdist.config.ConfigError for a profile name that does not exist (a usage error, not a sick node)."""
    from hpcdist.config.nccl_profiles import load_profile
    from hpcdist.launch.nccl import PROFILE_ENV

    start = time.monotonic()
    env = dict(os.environ if environ is None else environ)
    profile = nccl_profile if nccl_profile is not None else env.get(PROFILE_ENV) or None
    if profile:
        load_profile(profile)  # a typo is the caller's mistake: refused before any check runs
    unknown = sorted(set(skip) - set(CHECKS))
    if unknown:
        raise ValueError(f"unknown check(s) {', '.join(unknown)}; the checks are {', '.join(CHECKS)}")
    path = env.get("PATH", os.defpath)
    deadline = start + timeout_s
    device_deadline = start + device_timeout_s

    def tool_budget() -> float:
        return max(deadline - time.monotonic() - 0.5, 0.1)  # the tools end before the gate's own deadline

    results: dict[str, str] = {}
    jobs: dict[tuple[str, ...], Callable[[], None]] = {}
    device_checks = ("gpus", "matmul")

    def single(name: str, fn: Callable[[], str]) -> None:
        jobs[(name,)] = lambda: results.__setitem__(name, fn())

    single("nvidia_smi", lambda: _check_nvidia_smi(shutil.which("nvidia-smi", path=path), tool_budget, env))
    single("xid", lambda: _check_xid(shutil.which("dmesg", path=path), tool_budget, env, xid_window_s))
    single("infiniband", lambda: _check_infiniband(profile, sysfs_root, env))
    single("run_dir", lambda: _check_run_dir(run_dir, min_free_gb))
    single("shm", lambda: _check_shm(shm_dir, min_shm_gb))
    driver = nvidia_driver_gpus(proc_root)
    dev_root = DEV if dev_root is None else dev_root
    if driver is None and not gpus:  # a CPU node and a job that asked for no GPU: nothing to test, no torch import
        results["gpus"] = "skipped: no --gpus given and no NVIDIA driver on this node"
        results["matmul"] = "skipped: no GPU on this node to test (no NVIDIA driver, no --gpus)"
    elif driver is None and nvidia_device_files(dev_root):  # a GPU node whose driver is not loaded: no torch needed
        results["gpus"] = (
            f"fail: {dev_root}/nvidia* exist but no NVIDIA driver is loaded (no driver/nvidia/gpus), "
            f"{gpus} GPU(s) requested"
        )
        results["matmul"] = "skipped: no GPU to test (no NVIDIA driver on this node)"
    elif driver is None:  # the scheduler's "GPUs" here are not NVIDIA GPUs (count-only or stand-in gres)
        results["gpus"] = (
            f"skipped: no NVIDIA driver and no {dev_root}/nvidia* device on this node ({gpus} GPU(s) requested: "
            "the scheduler's GPUs here are not NVIDIA devices)"
        )
        results["matmul"] = "skipped: no GPU on this node to test (no NVIDIA driver)"
    else:
        jobs[device_checks] = lambda: _check_devices(gpus, results, matmul="matmul" not in skip)

    threads = []
    for names, job in jobs.items():
        if all(n in skip for n in names):
            continue
        thread = threading.Thread(target=_guarded, args=(names, job, results), name=f"health-{names[0]}", daemon=True)
        thread.start()  # daemon: a check stuck in the kernel (a wedged GPU, a hung NFS) never holds the exit
        threads.append((names, thread))
    for names, thread in threads:  # each against its own deadline: a finished check costs no wait
        thread.join(max((device_deadline if names == device_checks else deadline) - time.monotonic(), 0.0))
    done = dict(results)  # a check set its answer when it finished (gpus before the matmul that follows it)
    checks: dict[str, str] = {}
    for name in CHECKS:
        if name in skip:
            checks[name] = "skipped: not asked (--skip)"
        elif name in done:
            checks[name] = done[name]
        elif name in device_checks:
            checks[name] = (
                f"fail: did not finish within {device_timeout_s:g} s (--device-timeout: torch import, CUDA start-up)"
            )
        else:
            checks[name] = f"fail: did not finish within {timeout_s:g} s (the fast checks' --timeout)"
    return NodeHealth(host or socket.gethostname(), checks, time.monotonic() - start)


def _guarded(names: tuple[str, ...], job: Callable[[], None], results: dict[str, str]) -> None:
    """Run a check; its _Fail/_Skip, or anything it raised (a broken driver raises anything), becomes its answer."""
    try:
        job()
        return
    except _Skip as e:
        answer = f"skipped: {e}"
    except _Fail as e:
        answer = f"fail: {e}"
    except Exception as e:  # a check that crashed says why; the others still count
        text = str(e).splitlines()[0] if str(e) else ""
        answer = f"fail: {type(e).__name__}: {text[:300]}"
    for name in names:
        results.setdefault(name, answer)


# ------------------------------------------------------------------------------------------------ command


def cmd_health(args: argparse.Namespace) -> int:
    """``hpcdist health``: exit 0 healthy, 1 unhealthy (2, a usage error, is hpcdist.cli's)."""
    from hpcdist.config import ConfigError

    if args.record and args.run_dir is None:
        raise CommandError("health: --record needs --run-dir (the run dir whose failures.jsonl gets the verdict)")
    skip = [s.strip() for part in args.skip for s in part.split(",") if s.strip()]
    try:
        health = check_node(
            gpus=args.gpus,
            run_dir=args.run_dir,
            min_free_gb=args.min_free_gb,
            min_shm_gb=args.min_shm_gb,
            timeout_s=args.timeout,
            device_timeout_s=DEFAULT_DEVICE_TIMEOUT_S if args.device_timeout is None else args.device_timeout,
            nccl_profile=args.nccl_profile,
            xid_window_s=args.xid_hours * 3600,
            skip=skip,
        )
    except ConfigError as e:  # before ValueError: a ConfigError is one
        raise CommandError(f"health: --nccl-profile: {'; '.join(e.problems)}") from e
    except ValueError as e:
        raise CommandError(f"health: --skip: {e}") from e
    if args.json:
        print(json.dumps(health.as_json()), flush=True)
    else:
        print("\n".join(health.lines()), flush=True)
    if not health.ok and args.record:
        try:
            record_unhealthy(args.run_dir, health.host, health.reasons)
        except OSError as e:  # the run dir may be what is broken: the verdict is printed, the exit status says it
            print(f"hpcdist: health: could not record the verdict in {args.run_dir}: {e}", file=sys.stderr)
    code = 0 if health.ok else 1
    if any(t.name.startswith("health-") and t.is_alive() for t in threading.enumerate()):
        # a check is stuck in the kernel (a wedged GPU): interpreter shutdown (CUDA's exit handlers) could hang
        # on it; the verdict is printed, so leave now
        sys.stderr.flush()
        os._exit(code)
    return code
