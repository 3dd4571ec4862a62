"""Where this process sits in a distributed job: rank, node, rendezvous address, device.

This module (with ``hpcdist.launch``) is the only code that reads SLURM_* or torchrun variables. It turns
them into a plain, validated :class:`DistEnv`; everything downstream receives that object instead.

Detection order in :func:`from_environ`:

1. torchrun (``TORCHELASTIC_RUN_ID``, or all of ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``), even inside a
   SLURM allocation: torchrun's children carry the allocation's SLURM_* variables but their ranks are
   torchrun's.
2. a task of a SLURM job step (``srun``). A bare ``sbatch`` batch script also has ``SLURM_PROCID=0`` and
   ``SLURM_NTASKS=N``; treating it as rank 0 of N would wait forever for N-1 peers, so it needs step
   variables too.
3. a single local process.

Before the process group exists, :func:`init_process_group` exports the resolved DistEnv the way torchrun hands it to
every process (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``; :func:`export_environ`): libraries read those, not SLURM_* (DeepSpeed refuses to
start without ``LOCAL_RANK``, even in one process). The names it added or changed are recorded in
``HPCDIST_EXPORTED``; while they keep those values, :func:`from_environ` reads the environment as if they had never
been exported, so a later call in the same process (or in a child, even a task of a nested srun) resolves from its
launcher again instead of taking hpcdist's own export for torchrun's.
"""

import datetime
import itertools
import json
import logging
import math
import os
import re
import shutil
import socket
import subprocess
import time
import zlib
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "DistEnv",
    "SlurmJob",
    "destroy_process_group",
    "expand_nodelist",
    "export_environ",
    "from_environ",
    "hostnames",
    "init_process_group",
    "port_from_job_id",
]

log = logging.getLogger(__name__)

DEFAULT_MASTER_PORT = 29500
LAUNCHERS = ("slurm", "torchrun", "single")
# JSON {name: value} of the variables export_environ added or changed (see the module docstring).
EXPORTED_VAR = "HPCDIST_EXPORTED"

# `scontrol show hostnames` needs no controller, but it must read a config first: with SLURM_CONF naming a
# missing file, 22.05 retries for 60 s, and without any config it tries DNS SRV lookups.
SCONTROL_TIMEOUT_S = 5.0
# A typo such as "n[0-99999999]" should fail fast, not allocate a hundred million strings.
MAX_HOSTS = 1 << 20
# scontrol refuses a single range of more values than this ("Too many hosts in range"; SLURM's MAX_RANGE).
MAX_RANGE = 1 << 16
# What separates hosts in a list, as in scontrol: commas, blanks and tabs. A newline is not a separator there (it
# becomes part of a name, or makes the list invalid), so any control character is refused.
_SEPARATORS = (",", " ", "\t")
# SLURM's special step ids (batch script, extern, interactive, pending) are 0xFFFFFFFA..0xFFFFFFFD; some
# versions print them signed (-5), some unsigned. Real srun steps count up from 0.
_FIRST_SPECIAL_STEP_ID = 0xFFFFFFF0

# What each launcher reads, echoed in errors so a bad value is easy to trace to its variable.
_READS = {
    "torchrun": (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ),
    "slurm": (
        "SLURM_PROCID",
        "SLURM_LOCALID",
        "SLURM_NODEID",
        "SLURM_STEP_NUM_TASKS",
        "SLURM_NTASKS",
        "SLURM_STEP_TASKS_PER_NODE",
        "SLURM_TASKS_PER_NODE",
        "SLURM_STEP_NUM_NODES",
        "SLURM_JOB_NUM_NODES",
        "SLURM_NNODES",
        "MASTER_ADDR",
        "MASTER_PORT",
    ),
    "single": ("MASTER_PORT",),
}

_DIGITS = re.compile(r"[0-9]+")
_TASKS_PER_NODE_ITEM = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job; validated on construction."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    device: str
    backend: str
    launcher: str
    job_id: str | None
    hostname: str

    def __post_init__(self) -> None:
        problems = []
        if self.world_size < 1:
            problems.append(f"world_size={self.world_size} must be >= 1")
        if not 0 <= self.rank < max(self.world_size, 1):
            problems.append(f"rank={self.rank} must be in [0, world_size={self.world_size})")
        if not 1 <= self.local_world_size <= max(self.world_size, 1):
            problems.append(f"local_world_size={self.local_world_size} must be in [1, world_size={self.world_size}]")
        if not 0 <= self.local_rank < max(self.local_world_size, 1):
            problems.append(f"local_rank={self.local_rank} must be in [0, local_world_size={self.local_world_size})")
        if not 1 <= self.num_nodes <= max(self.world_size, 1):
            problems.append(f"num_nodes={self.num_nodes} must be in [1, world_size={self.world_size}]")
        if not 0 <= self.node_rank < max(self.num_nodes, 1):
            problems.append(f"node_rank={self.node_rank} must be in [0, num_nodes={self.num_nodes})")
        if not 1 <= self.master_port <= 65535:
            problems.append(f"master_port={self.master_port} must be in [1, 65535]")
        if not self.master_addr:
            problems.append("master_addr is empty")
        if self.launcher not in LAUNCHERS:
            problems.append(f"launcher={self.launcher!r} must be one of {LAUNCHERS}")
        if problems:
            raise ValueError("invalid DistEnv: " + "; ".join(problems))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def torch_device(self) -> torch.device:
        return torch.device(self.device)


# --------------------------------------------------------------------------------------------- nodelists


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM hostlist syntax in pure Python: ``"gpu[001-002,007],login2"`` -> 4 names, in order.

    Matches ``scontrol show hostnames`` (SLURM 22.05, compared in tests/unit/test_env.py): zero padding follows the
    low end of a range (``n[08-11]`` -> n08 n09 n10 n11); a name may not continue after its last bracket group
    (``a[1-3]b`` is invalid); with several groups the last one varies fastest, then the first, second, ... (scontrol
    expands the groups before the last from right to left: ``a[1-2]b[1-2]c[1-2]`` -> a1b1c1 a1b1c2 a2b1c1 ...). Raises
    ValueError on malformed input, including control characters and blanks inside brackets, which scontrol either
    refuses or turns into names no host has.
    """
    if not isinstance(nodelist, str):
        raise TypeError(f"nodelist must be a str, got {type(nodelist).__name__}")
    if not nodelist.strip():
        raise ValueError(f"empty nodelist {nodelist!r}: expected something like 'gpu[001-004],login2'")
    _refuse_control_characters(nodelist)
    hosts: list[str] = []
    for entry in _split_hosts(nodelist):
        hosts.extend(_expand_host(entry, nodelist))
        if len(hosts) > MAX_HOSTS:
            raise ValueError(f"nodelist {nodelist!r} expands to more than {MAX_HOSTS} hosts")
    return hosts


def _refuse_control_characters(nodelist: str) -> None:
    bad = next((pos for pos, char in enumerate(nodelist) if char not in "\t" and not char.isprintable()), None)
    if bad is not None:
        raise ValueError(
            f"control character {nodelist[bad]!r} at position {bad} in nodelist {nodelist!r}: separate hosts with "
            "commas or blanks, one list per line"
        )


def _split_hosts(nodelist: str) -> list[str]:
    """Split on the commas (or blanks) that separate hosts, not those inside brackets; check bracket balance.

    Empty entries ("a,,b") are skipped, as scontrol does.
    """
    entries: list[str] = []
    current: list[str] = []
    open_at = -1
    for pos, char in enumerate(nodelist):
        if char == "[":
            if open_at >= 0:
                raise ValueError(f"nested '[' at position {pos} in nodelist {nodelist!r}")
            open_at = pos
        elif char == "]":
            if open_at < 0:
                raise ValueError(f"unbalanced ']' at position {pos} in nodelist {nodelist!r}")
            open_at = -1
        elif open_at < 0 and char in _SEPARATORS:
            entries.append("".join(current))
            current = []
            continue
        current.append(char)
    if open_at >= 0:
        raise ValueError(f"unclosed '[' at position {open_at} in nodelist {nodelist!r}")
    entries.append("".join(current))
    entries = [entry for entry in entries if entry]
    if not entries:
        raise ValueError(f"no host names in nodelist {nodelist!r}")
    return entries


def _expand_host(entry: str, nodelist: str) -> list[str]:
    """One host entry (balanced, no nesting) -> its names, in scontrol's order (see :func:`expand_nodelist`)."""
    literals: list[str] = []  # literals[i] precedes groups[i]; literals[-1] follows the last group
    groups: list[list[str]] = []
    pos = 0
    while (start := entry.find("[", pos)) >= 0:
        end = entry.index("]", start)  # balance was checked by _split_hosts
        literals.append(entry[pos:start])
        groups.append(_expand_group(entry[start + 1 : end], entry, nodelist))
        pos = end + 1
    literals.append(entry[pos:])
    if groups and literals[-1]:
        raise ValueError(
            f"host {entry!r} continues after its last ']' (nodelist {nodelist!r}); scontrol refuses that: end the "
            "name with its bracket group, or list the names one by one"
        )
    count = math.prod(len(values) for values in groups)
    if count > MAX_HOSTS:
        raise ValueError(f"host entry {entry!r} expands to {count} hosts (more than {MAX_HOSTS})")
    # scontrol expands the last group innermost and the groups before it from right to left (outermost first)
    order = [*reversed(range(len(groups) - 1)), len(groups) - 1] if groups else []
    names = []
    for combo in itertools.product(*(groups[i] for i in order)):
        chosen = dict(zip(order, combo, strict=True))
        names.append("".join(literals[i] + chosen[i] for i in range(len(groups))) + literals[-1])
    return names


def _expand_group(body: str, entry: str, nodelist: str) -> list[str]:
    """Bracket contents such as ``001-004,007`` -> ["001", ..., "004", "007"]."""
    where = f"in [{body}] of host {entry!r} (nodelist {nodelist!r})"
    if not body:
        raise ValueError(f"empty brackets {where}")
    values: list[str] = []
    for item in body.split(","):
        low, sep, high = item.partition("-")
        if not _DIGITS.fullmatch(low) or (sep and not _DIGITS.fullmatch(high)):
            raise ValueError(f"bad item {item!r} {where}: expected a number or a range like 01-08, no blanks")
        if not sep:
            values.append(low)
            continue
        lo, hi = int(low), int(high)
        if lo > hi:
            raise ValueError(f"descending range {item!r} {where}: write {high}-{low}")
        if hi - lo + 1 > MAX_RANGE:
            raise ValueError(f"range {item!r} {where} has more than {MAX_RANGE} values (scontrol's limit)")
        width = len(low)  # SLURM pads every number in the range to the width of its low end
        values.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return values


def hostnames(nodelist: str) -> list[str]:
    """Expand a nodelist with ``scontrol show hostnames`` when that works, else with :func:`expand_nodelist`."""
    if not nodelist or not nodelist.strip():
        # Checked here, not left to scontrol: given no list it silently expands $SLURM_JOB_NODELIST instead.
        raise ValueError(f"empty nodelist {nodelist!r}: expected something like 'gpu[001-004],login2'")
    # scontrol keeps a newline inside a name ("a\nb" is one host), which its output then splits in two
    _refuse_control_characters(nodelist)
    exe = shutil.which("scontrol")
    if exe is not None:
        try:
            proc = subprocess.run(
                [exe, "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                timeout=SCONTROL_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.SubprocessError) as err:
            log.debug("scontrol show hostnames %s failed (%s); using the built-in parser", nodelist, err)
        else:
            names = proc.stdout.split()
            # Exit status alone is not enough: scontrol 22.05 exits 0 on "Invalid hostlist" (stdout empty,
            # message on stderr) and echoes garbage such as "a]" for "a[1-2".
            if proc.returncode == 0 and names and not any("[" in n or "]" in n for n in names):
                return names
            # Typical on login nodes of other clusters and in containers: no readable slurm.conf.
            log.debug(
                "scontrol show hostnames %s exited %d (%s); using the built-in parser",
                nodelist,
                proc.returncode,
                proc.stderr.strip(),
            )
    return expand_nodelist(nodelist)


# ------------------------------------------------------------------------------------------------- ports


def port_from_job_id(job_id: str | None, base: int = 20000, span: int = 12000) -> int:
    """Rendezvous port every node of a job computes alike, in ``[base, base + span)``; None -> 29500.

    The default range 20000-31999 stays below Linux's ephemeral ports (32768+), which outgoing connections
    may already hold.

    Uses the decimal digits of the id ("123_4" -> 1234), so jobs submitted one after another get
    different ports (two jobs sharing a node do not collide unless their ids differ by a multiple of span).
    """
    if base < 1 or span < 1 or base + span > 65536:
        raise ValueError(f"port range base={base}, span={span} must lie within [1, 65535]")
    if job_id is None or not str(job_id).strip():
        return DEFAULT_MASTER_PORT
    digits = "".join(_DIGITS.findall(str(job_id)))
    # A stable hash, not hash(): that is salted per process and would differ between nodes.
    value = int(digits) if digits else zlib.crc32(str(job_id).encode())
    return base + value % span


# ----------------------------------------------------------------------------------------------- job


@dataclass(frozen=True)
class SlurmJob:
    """The SLURM job facts restarts, requeues and failure records need (job id, restart count, partition, size).

    Read here, beside the rank layout, so no other module reads SLURM_* itself. ``job_id`` is None outside SLURM.
    """

    job_id: str | None
    restart_count: int
    partition: str | None = None
    """Where the job runs: node exclusion checks that the partition keeps enough usable nodes."""
    num_nodes: int | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "SlurmJob":
        environ = os.environ if environ is None else environ
        job_id = environ.get("SLURM_JOB_ID") or None
        # An array task is requeued by its array id (<array job>_<task>). Not DistEnv.job_id's rule (<job>_<task>,
        # only a rendezvous port seed): scontrol needs the array job's own id.
        if job_id and environ.get("SLURM_ARRAY_TASK_ID"):
            job_id = f"{environ['SLURM_ARRAY_JOB_ID']}_{environ['SLURM_ARRAY_TASK_ID']}"
        nodes = environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES")
        return cls(
            job_id=job_id, restart_count=int(environ.get("SLURM_RESTART_COUNT") or 0),
            partition=environ.get("SLURM_JOB_PARTITION") or None, num_nodes=int(nodes) if nodes else None,
        )  # fmt: skip


# ----------------------------------------------------------------------------------------- environment


class _Vars:
    """Reads integer variables and collects every problem, so one error lists them all."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.environ = environ
        self.problems: list[str] = []

    def get(self, name: str) -> str | None:
        # Shell scripts often export empty variables (`export MASTER_PORT=${MASTER_PORT:-}`): empty = unset.
        value = self.environ.get(name)
        return value.strip() if value is not None and value.strip() else None

    def has(self, name: str) -> bool:
        return self.get(name) is not None

    def first(self, *names: str) -> str | None:
        """Name of the first of `names` that is set."""
        return next((name for name in names if self.has(name)), None)

    def integer(self, name: str | None, *, default: int | None = None, minimum: int = 0, needed: str = "") -> int:
        raw = self.get(name) if name else None
        if raw is None:
            if default is None:
                self.problems.append(f"{needed or name} is not set")
                return minimum
            return default
        try:
            value = int(raw)
        except ValueError:
            self.problems.append(f"{name}={raw!r} is not an integer")
            return minimum
        if value < minimum:
            self.problems.append(f"{name}={raw!r} must be >= {minimum}")
            return minimum
        return value

    def check(self, what: str) -> None:
        if self.problems:
            raise ValueError(f"cannot read the {what} environment: " + "; ".join(self.problems))


def _in_slurm_step(v: _Vars) -> bool:
    """True for a task started by srun; False in a bare sbatch batch script, salloc shell, or outside SLURM."""
    if not v.has("SLURM_PROCID"):
        return False
    if v.has("SLURM_STEP_NUM_TASKS"):
        return True
    step = v.get("SLURM_STEP_ID")
    if step is None:
        return False
    try:
        step_id = int(step)
    except ValueError:
        raise ValueError(f"SLURM_STEP_ID={step!r} is not an integer") from None
    return 0 <= step_id < _FIRST_SPECIAL_STEP_ID


def _slurm_job_id(v: _Vars) -> str | None:
    job = v.get("SLURM_JOB_ID") or v.get("SLURM_JOBID")
    task = v.get("SLURM_ARRAY_TASK_ID")
    if job is not None and task is not None:
        return f"{job}_{task}"
    return job


def _tasks_per_node(value: str) -> list[int]:
    """Expand SLURM's compressed counts: ``"8(x4)"`` -> [8, 8, 8, 8]; ``"2(x2),1"`` -> [2, 2, 1]."""
    counts: list[int] = []
    for item in value.split(","):
        match = _TASKS_PER_NODE_ITEM.fullmatch(item.strip())
        if match is None:
            raise ValueError(f"bad tasks-per-node item {item!r} in {value!r}: expected forms like 8, 8(x4)")
        repeat = int(match.group(2) or 1)
        if repeat > MAX_HOSTS:
            raise ValueError(f"tasks-per-node {value!r} describes more than {MAX_HOSTS} nodes")
        counts.extend([int(match.group(1))] * repeat)
    return counts


def _cuda_index(local_rank: int, device_count: int | None) -> int:
    """GPU index for this local rank among the GPUs this process can see."""
    if device_count is None or local_rank < device_count:
        return local_rank
    if device_count == 1:
        # The launcher bound one GPU to each task (srun --gpus-per-task=1, torchrun's virtual local rank):
        # CUDA_VISIBLE_DEVICES shows only ours, as device 0.
        return 0
    raise ValueError(
        f"local_rank={local_rank} but only {device_count} GPUs are visible "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): start at most one task per GPU"
    )


def from_environ(environ: Mapping[str, str] | None = None, *, cuda_available: bool | None = None) -> DistEnv:
    """Build the :class:`DistEnv` of this process from torchrun, SLURM step or no variables (in that order).

    ``environ`` defaults to ``os.environ``; ``cuda_available=None`` asks torch (tests pass it explicitly).
    Missing or garbled integers raise ValueError naming the variable and its value.
    """
    env_map: Mapping[str, str] = _without_own_exports(os.environ if environ is None else environ)
    v = _Vars(env_map)
    device_count: int | None = None
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
        device_count = torch.cuda.device_count() if cuda_available else None

    fields: dict[str, Any]
    if v.has("TORCHELASTIC_RUN_ID") or all(v.has(n) for n in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        launcher = "torchrun"
        fields = _torchrun_fields(v)
    elif _in_slurm_step(v):
        launcher = "slurm"
        fields = _slurm_fields(v)
    else:
        launcher = "single"
        fields = dict(
            rank=0,
            local_rank=0,
            world_size=1,
            local_world_size=1,
            node_rank=0,
            num_nodes=1,
            master_addr="127.0.0.1",
            # No free-port search: with one process nobody else needs to find it, and init is skipped.
            master_port=v.integer("MASTER_PORT", default=DEFAULT_MASTER_PORT, minimum=1),
            job_id=_slurm_job_id(v),
        )
    v.check(launcher)

    if cuda_available:
        device, backend = f"cuda:{_cuda_index(fields['local_rank'], device_count)}", "nccl"
    else:
        device, backend = "cpu", "gloo"
    try:
        return DistEnv(**fields, device=device, backend=backend, launcher=launcher, hostname=socket.gethostname())
    except ValueError as err:
        seen = ", ".join(f"{name}={env_map[name]}" for name in _READS[launcher] if v.has(name))
        raise ValueError(f"inconsistent {launcher} environment ({seen or 'no variables set'}): {err}") from None


def _own_exports(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables a previous :func:`export_environ` added or changed that still hold its values; {} if none.

    Stale records count for nothing: a name changed since (a launcher such as DeepSpeed's or a test harness set
    its own ranks) invalidates the whole record, and under torchrun (``TORCHELASTIC_RUN_ID``) its variables are
    authoritative even where they happen to equal an inherited record.
    """
    raw = environ.get(EXPORTED_VAR)
    if not raw or environ.get("TORCHELASTIC_RUN_ID", "").strip():
        return {}
    try:
        record = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(record, dict) or not all(isinstance(k, str) and isinstance(x, str) for k, x in record.items()):
        return {}
    return record if all(environ.get(name) == value for name, value in record.items()) else {}


def _without_own_exports(environ: Mapping[str, str]) -> Mapping[str, str]:
    """``environ`` minus what hpcdist exported itself, so that export carries no weight in detection."""
    own = _own_exports(environ)
    if not own:
        return environ
    return {name: value for name, value in environ.items() if name not in own}


def _torchrun_fields(v: _Vars) -> dict[str, Any]:
    rank = v.integer("RANK")
    local_rank = v.integer("LOCAL_RANK")
    world_size = v.integer("WORLD_SIZE", minimum=1)
    # torchrun always sets these; other launchers that mimic it (RANK/LOCAL_RANK/WORLD_SIZE only) are taken
    # as one node.
    local_world_size = v.integer("LOCAL_WORLD_SIZE", default=world_size, minimum=1)
    return dict(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=v.integer("GROUP_RANK", default=rank // max(local_world_size, 1)),
        num_nodes=v.integer("GROUP_WORLD_SIZE", default=-(-world_size // max(local_world_size, 1)), minimum=1),
        master_addr=v.get("MASTER_ADDR") or "127.0.0.1",
        master_port=v.integer("MASTER_PORT", default=DEFAULT_MASTER_PORT, minimum=1),
        # torchrun's run id is a rendezvous name ("none" by default), not a job id; SLURM's is more useful.
        job_id=_slurm_job_id(v),
    )


def _slurm_fields(v: _Vars) -> dict[str, Any]:
    rank = v.integer("SLURM_PROCID")
    local_rank = v.integer("SLURM_LOCALID")
    node_rank = v.integer("SLURM_NODEID")
    world_size = v.integer(v.first("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"), minimum=1, needed="SLURM_NTASKS")
    tpn_name = v.first("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    tpn_value = v.get(tpn_name) if tpn_name else None
    counts: list[int] = []
    if tpn_name is not None and tpn_value is not None:
        try:
            counts = _tasks_per_node(tpn_value)
        except ValueError as err:
            v.problems.append(f"{tpn_name}: {err}")
    nodes_name = v.first("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
    num_nodes = v.integer(nodes_name, default=len(counts) or None, minimum=1, needed="SLURM_STEP_NUM_NODES")
    # Uneven layouts ("2(x3),1") give the last node fewer tasks: take this node's own count, not the first.
    if node_rank < len(counts):
        local_world_size = counts[node_rank]
    elif counts:
        v.problems.append(f"SLURM_NODEID={node_rank} but {tpn_name}={tpn_value!r} lists {len(counts)} nodes")
        local_world_size = 1
    elif num_nodes and world_size % num_nodes == 0:
        local_world_size = world_size // num_nodes
    else:
        v.problems.append("SLURM_STEP_TASKS_PER_NODE is not set and tasks do not divide evenly over nodes")
        local_world_size = 1

    job_id = _slurm_job_id(v)
    master_addr = v.get("MASTER_ADDR")
    if master_addr is None:
        # The step's list, not the job's: a step may run on a subset of the allocation, and rank 0 (which
        # hosts the rendezvous store) runs on the step's first node.
        nodelist_name = v.first("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        if nodelist_name is None:
            v.problems.append("SLURM_STEP_NODELIST is not set (and MASTER_ADDR is not given)")
            master_addr = "127.0.0.1"
        else:
            try:
                master_addr = hostnames(v.get(nodelist_name) or "")[0]
            except ValueError as err:
                v.problems.append(f"{nodelist_name}: {err}")
                master_addr = "127.0.0.1"
    master_port = v.integer("MASTER_PORT", default=port_from_job_id(job_id), minimum=1)
    return dict(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        num_nodes=num_nodes,
        master_addr=master_addr,
        master_port=master_port,
        job_id=job_id,
    )


# --------------------------------------------------------------------------------------- process group


def _torchrun_variables(env: DistEnv) -> dict[str, str]:
    """The variables torchrun would give this process (names and meanings as torchrun's)."""
    return {
        "RANK": str(env.rank),
        "LOCAL_RANK": str(env.local_rank),
        "WORLD_SIZE": str(env.world_size),
        "LOCAL_WORLD_SIZE": str(env.local_world_size),
        "GROUP_RANK": str(env.node_rank),
        "GROUP_WORLD_SIZE": str(env.num_nodes),
        "MASTER_ADDR": env.master_addr,
        "MASTER_PORT": str(env.master_port),
    }


def export_environ(env: DistEnv, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Put ``env`` into ``environ`` (default ``os.environ``) as torchrun's variables; return what it changed.

    srun and a plain ``python`` set none of them, but the process group's ``env://`` reads MASTER_ADDR/PORT and
    DeepSpeed asserts LOCAL_RANK (also with world size 1). The DistEnv is what every rank computed alike, so it wins
    over a different value already there, loudly; a value hpcdist exported itself earlier (this process, or a
    parent whose srun started this one) is replaced quietly. The names added or changed go to ``HPCDIST_EXPORTED``
    (merged with still valid earlier records), so that :func:`from_environ` keeps resolving to the same DistEnv.
    """
    target: MutableMapping[str, str] = os.environ if environ is None else environ
    own = _own_exports(target)
    record = dict(own)
    changed: dict[str, str] = {}
    for name, value in _torchrun_variables(env).items():
        current = target.get(name)
        if current == value:
            continue
        if current is not None and current.strip() and name not in own:
            log.warning(
                "%s=%s in the environment differs from DistEnv's %s (%s launcher); using %s",
                name, current, value, env.launcher, value,
            )  # fmt: skip
        target[name] = value
        record[name] = changed[name] = value
    if record:
        target[EXPORTED_VAR] = json.dumps(record, sort_keys=True)
    else:
        target.pop(EXPORTED_VAR, None)  # a stale record inherited from a parent means nothing here
    return changed


def init_process_group(env: DistEnv, *, timeout_s: float = 1800) -> None:
    """Export ``env`` as torchrun's variables (:func:`export_environ`), then join the default process group
    (``env://``) for world_size > 1; no process group for one process, nothing new if already joined."""
    # Also for one process: libraries (DeepSpeed) read LOCAL_RANK / RANK / WORLD_SIZE whatever the world size.
    export_environ(env)
    if not env.is_distributed:
        return
    if not torch.distributed.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    if torch.distributed.is_initialized():
        joined = torch.distributed.get_world_size()
        if joined != env.world_size:
            raise RuntimeError(f"a process group of {joined} ranks already exists, but env has {env.world_size}")
        return
    if env.device.startswith("cuda"):
        # Before init, so NCCL's communicator and any tensor created without a device land on our GPU.
        torch.cuda.set_device(env.torch_device())
    if env.rank != 0:
        _wait_for_master(env.master_addr, env.master_port, timeout_s)
    torch.distributed.init_process_group(
        backend=env.backend,
        init_method="env://",
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _wait_for_master(addr: str, port: int, timeout_s: float) -> None:
    """Poll until rank 0's TCPStore accepts connections. A client that reaches the port before the server listens
    backs off for timeout/10 (torch's TCPStore: 66 s with a 660 s timeout, 180 s with 30 min), so a rank that
    merely started first would stall the whole job; polling here costs at most 0.2 s after the server is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((addr, port), timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                return  # let init_process_group report the failure with its own message
            time.sleep(0.2)


def destroy_process_group() -> None:
    """Leave the default process group; safe when there is none."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
