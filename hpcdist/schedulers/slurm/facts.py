"""SLURM's job facts: its variables and its node-list grammar.

:func:`read_job_facts` turns the variables into the scheduler-neutral :class:`~hpcdist.schedulers.base.JobFacts`,
and :func:`read_step_layout` reads a task's place in an ``srun`` job step for ``hpcdist.env``. Standard library only.

A bare ``sbatch`` batch script also has ``SLURM_PROCID=0`` and ``SLURM_NTASKS=N``; treating it as rank 0 of N would
wait forever for N-1 peers, so a step needs step variables too (:func:`in_step`).
"""

from __future__ import annotations

import itertools
import logging
import math
import re
from collections.abc import Mapping
from typing import Any

from hpcdist.schedulers.base import ATTEMPT_ENV, EnvReader, JobFacts
from hpcdist.schedulers.slurm import client

__all__ = ["ATTEMPT_ENV", "READS", "expand_nodelist", "hostnames", "in_step", "read_job_facts", "read_step_layout"]

log = logging.getLogger(__name__)

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

# What read_step_layout reads, echoed in errors so a bad value is easy to trace to its variable.
READS = (
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
)

_DIGITS = re.compile(r"[0-9]+")
_TASKS_PER_NODE_ITEM = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")


# ----------------------------------------------------------------------------------------------- job


def read_job_facts(environ: Mapping[str, str]) -> JobFacts | None:
    """The SLURM job of this process (batch script, srun task, torchrun worker inside an allocation); None outside
    SLURM. A garbled count raises ValueError naming the variable."""
    v = EnvReader(environ)
    instance = v.get("SLURM_JOB_ID") or v.get("SLURM_JOBID")
    if instance is None:
        return None
    job_id = v.get("SLURM_JOB_ID")
    array_job, task = v.get("SLURM_ARRAY_JOB_ID"), v.get("SLURM_ARRAY_TASK_ID")
    if task is not None:
        instance = f"{instance}_{task}"
        # An array task is requeued by its array id (<array job>_<task>); scontrol needs the array job's own id.
        if job_id is not None and array_job is not None:
            job_id = f"{array_job}_{task}"
    # The attempt loop (hpcdist.launch.attempts) numbers every attempt of the job, in-job restarts included, and
    # hands the number to the step: SLURM_RESTART_COUNT counts only the requeues.
    restart_count = v.integer(v.first(ATTEMPT_ENV, "SLURM_RESTART_COUNT"), default=0)
    nodes_name = v.first("SLURM_JOB_NUM_NODES", "SLURM_NNODES")
    num_nodes = v.integer(nodes_name, minimum=1) if nodes_name else None
    v.check("SLURM job")
    return JobFacts(
        job_id,
        restart_count,
        scheduler="slurm",
        instance_id=instance,
        array_job_id=array_job,
        array_task_id=task,
        partition=v.get("SLURM_JOB_PARTITION"),
        num_nodes=num_nodes,
        node_list=v.get("SLURM_JOB_NODELIST") or v.get("SLURM_NODELIST"),
    )


# --------------------------------------------------------------------------------------------- job step


def in_step(v: EnvReader) -> bool:
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


def read_step_layout(v: EnvReader) -> dict[str, Any] | None:
    """This task's place in its ``srun`` job step (see :class:`~hpcdist.schedulers.base.Scheduler`); None when srun
    did not start it. The rendezvous port is hpcdist.env's (MASTER_PORT, else derived from the job)."""
    if not in_step(v):
        return None
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
    return dict(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        num_nodes=num_nodes,
        master_addr=master_addr,
    )


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
    try:
        proc = client.call(["scontrol", "show", "hostnames", nodelist], timeout=SCONTROL_TIMEOUT_S)
    except client.SlurmError as err:
        if not isinstance(err, client.ToolMissing):
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
