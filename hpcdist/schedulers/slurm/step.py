"""SLURM's job steps: the allocation a batch script holds (its nodes, tasks per node, GPUs per node) and the srun
line of a step restricted to some of those nodes. Standard library only.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence

from hpcdist.schedulers.base import Allocation
from hpcdist.schedulers.slurm.facts import expand_nodelist

__all__ = ["allocation", "gpus_per_node", "step_command"]


def gpus_per_node(environ: Mapping[str, str]) -> int | None:
    """The GPUs per node this job asked SLURM for, from the batch step's environment: SLURM_GPUS_ON_NODE (set for
    --gres=gpu:N and --gpus-per-node), SLURM_GPUS_PER_NODE (``8`` or ``a100:8``, comma-separated types summed),
    else the indices in SLURM_JOB_GPUS. None when the job asked for no GPU or a value cannot be read: the gate
    then counts nothing, and a node without an NVIDIA driver skips its device checks rather than failing."""
    on_node = environ.get("SLURM_GPUS_ON_NODE", "").strip()
    if on_node.isdigit():
        return int(on_node) or None
    per_node = environ.get("SLURM_GPUS_PER_NODE", "").strip()
    if per_node:
        counts = [part.rsplit(":", 1)[-1].strip() for part in per_node.split(",")]
        if all(c.isdigit() for c in counts):
            return sum(map(int, counts)) or None
        return None
    job_gpus = [g for g in environ.get("SLURM_JOB_GPUS", "").split(",") if g.strip()]
    return len(job_gpus) or None


def allocation(environ: Mapping[str, str]) -> Allocation | str:
    """The nodes, tasks per node and GPUs per node of this job's allocation, or why they cannot be read."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        return "no SLURM node list"
    nodes = expand_nodelist(nodelist)
    tpn_raw = environ.get("SLURM_NTASKS_PER_NODE") or (environ.get("SLURM_TASKS_PER_NODE") or "").split("(")[0]
    try:
        tpn = int(tpn_raw.split(",")[0])
    except ValueError:
        return f"tasks per node unknown (SLURM_NTASKS_PER_NODE={tpn_raw!r})"
    return Allocation(nodes, tpn, gpus_per_node(environ))


# srun options that take their value as the next argument in the step lines hpcdist runs (submitit's writes
# ``--output PATH --error PATH``; hpcdist's own use ``--opt=value``): the program starts after them
_SEPARATE_VALUE = frozenset({"--output", "-o", "--error", "-e", "--nodes", "-N", "--ntasks", "-n", "--nodelist", "-w"})
_KILL_ON_BAD_EXIT = re.compile(r"--kill-on-bad-exit(=\d+)?|-K\d?")


def step_command(
    cmd: Sequence[str],
    nodes: Sequence[str],
    tasks_per_node: int,
    *,
    keep_survivors: bool = False,
    spares: bool = False,
) -> list[str]:
    """``cmd`` (an srun command line) restricted to ``nodes``; any other command unchanged. ``keep_survivors``:
    one task's death does not end the others (``--kill-on-bad-exit=0`` in place of the line's own setting), for
    in-process recovery, where the survivors rebuild their group and a spare takes the dead task's place.
    ``spares``: the warm spares' step; its tasks are numbered from 0 like the training step's, so per-task output
    files the line names (submitit's ``--output DIR/%j_%t_log.out``) get a ``spare-`` prefix instead of being
    opened over the ranks' logs."""
    cmd = list(cmd)
    if not cmd or os.path.basename(cmd[0]) != "srun":
        return cmd
    n = len(nodes)
    args = cmd[1:]
    if keep_survivors or spares:
        end = 0
        while end < len(args) and args[end].startswith("-"):
            end += 2 if args[end] in _SEPARATE_VALUE else 1
        end = min(end, len(args))
        options = args[:end]
        if keep_survivors:
            options = ["--kill-on-bad-exit=0", *(a for a in options if not _KILL_ON_BAD_EXIT.fullmatch(a))]
        if spares:
            options = _spare_outputs(options)
        args = [*options, *args[end:]]
    return [cmd[0], f"--nodes={n}", f"--ntasks={n * tasks_per_node}", f"--nodelist={','.join(nodes)}", *args]


_OUTPUT_OPTIONS = frozenset({"--output", "-o", "--error", "-e"})


def _spare_outputs(options: list[str]) -> list[str]:
    """srun's output and error file patterns with ``spare-`` before each file name (its directory unchanged)."""

    def renamed(path: str) -> str:
        head, sep, name = path.rpartition("/")
        return path if name in ("", "none") else f"{head}{sep}spare-{name}"

    out: list[str] = []
    i = 0
    while i < len(options):
        name, eq, value = options[i].partition("=")
        if eq and name in _OUTPUT_OPTIONS:
            out.append(f"{name}={renamed(value)}")
        elif options[i] in _OUTPUT_OPTIONS and i + 1 < len(options):
            out += [options[i], renamed(options[i + 1])]
            i += 1
        else:
            out.append(options[i])
        i += 1
    return out
