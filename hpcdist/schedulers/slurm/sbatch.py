"""The sbatch script of ``hpcdist submit``: submitit's SlurmExecutor parameters for a cluster profile, the setup
lines that route submitit's srun line through the attempt loop, pyxis's srun options, and the rendered script.

hpcdist.launch.submit hands over what is the same for every scheduler (the setup lines, the snapshot's lines, the
interpreter each task runs, the attempt loop's interpreter); everything SLURM adds is here. submitit is imported
only when a script is rendered or a job submitted.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpcdist.config.cluster import ClusterConfig

__all__ = ["attempt_loop_lines", "container_step_args", "executor", "parameters", "render"]


def _extra_flags(cluster: ClusterConfig) -> dict[str, Any]:
    flags: dict[str, Any] = {}
    for flag in cluster.extra_sbatch:
        name, sep, value = flag.removeprefix("--").partition("=")
        flags[name] = value if sep else True  # submitit writes True as a bare "#SBATCH --flag"
    return flags


def attempt_loop_lines(python: str, run_dir: str | Sequence[str], fault: Any | None) -> list[str]:
    """Setup lines that route submitit's srun line through the attempt loop (hpcdist.launch.attempts): a shell
    function ``srun`` runs ``python -m hpcdist.launch.attempts ... -- srun <submitit's arguments>``; the loop calls
    the real srun (a program on PATH: functions are the shell's own). The loop gates the nodes, chooses them, and
    after a failed step restarts it in the allocation, requeues the job (bad hosts excluded) or ends it with the
    reason, as for ``sbatch sbatch/train.sh``. A job array (a sweep) passes one run dir per array task: the task
    picks its own by SLURM_ARRAY_TASK_ID. ``python``: the loop's interpreter, shell-quoted, with its container."""
    lines = []
    if isinstance(run_dir, str):
        where = shlex.quote(run_dir)
    else:
        lines.append(f"hpcdist_run_dirs=({' '.join(shlex.quote(d) for d in run_dir)})")
        where = '"${hpcdist_run_dirs[$SLURM_ARRAY_TASK_ID]}"'
    opts = ""
    if fault is not None:
        opts = (
            f" --spare-nodes {int(fault.spare_nodes)} --min-nodes {int(fault.min_nodes)}"
            f" --restart-backoff-s {float(fault.restart_backoff_s)!r}"
            + (" --in-process" if getattr(fault, "in_process", False) else "")
        )
    lines.append(f'srun() {{ {python} -m hpcdist.launch.attempts --run-dir {where}{opts} -- srun "$@"; }}')
    return lines


def container_step_args(cluster: ClusterConfig) -> list[str]:
    """pyxis's srun options (quoted by submitit with the rest of the srun line)."""
    k = cluster.container
    if k is None or k.runtime != "pyxis":
        return []
    args = [f"--container-image={k.image}"]
    if k.mounts:
        args.append(f"--container-mounts={','.join(k.mounts)}")
    if k.workdir:
        args.append(f"--container-workdir={k.workdir}")
    return args


def parameters(
    cluster: ClusterConfig,
    *,
    job_name: str,
    signal: str,
    setup: list[str],
    loop_python: str,
    run_dir: str | Sequence[str] | None = None,
    fault: Any | None = None,
) -> dict[str, Any]:
    """submitit SlurmExecutor parameters (the keyword arguments of its _make_sbatch_string) for ``cluster``:
    ``signal`` the requeue signal's name (USR2), ``setup`` the shell lines before the step; with ``run_dir``, the
    step runs under the attempt loop (in-job restarts, the failure policy) started by ``loop_python``; ``fault``
    (the training config's fault section) adds its fault.spare_nodes to the nodes asked for."""
    spares = int(getattr(fault, "spare_nodes", 0) or 0)
    additional: dict[str, Any] = {"requeue": True, **_extra_flags(cluster)}
    from submitit.slurm.slurm import SlurmJobEnvironment

    if signal != SlurmJobEnvironment.USR_SIG:
        # submitit always writes --signal=<its USR_SIG>@<delay>; additional_parameters replace it
        additional["signal"] = f"{signal}@{cluster.signal_lead_s}"
    params: dict[str, Any] = {
        "job_name": job_name,
        "nodes": cluster.nodes + spares,  # the spares idle until a training node fails
        "ntasks_per_node": cluster.ntasks_per_node,
        "cpus_per_task": cluster.cpus_per_task,
        "gpus_per_node": cluster.gpus_per_node or None,  # no --gpus-per-node on CPU partitions
        # whole minutes: submitit also uses this number as its timeout (a "HH:MM:SS" string would break it)
        "time": cluster.time_minutes,
        "mem": cluster.mem,
        "partition": cluster.partition,
        "account": cluster.account,
        "qos": cluster.qos,
        "constraint": cluster.constraint,
        "exclude": cluster.exclude,
        "exclusive": True if cluster.exclusive else None,
        "signal_delay_s": cluster.signal_lead_s,
        "setup": setup + (attempt_loop_lines(loop_python, run_dir, fault) if run_dir is not None else []),
        # --kill-on-bad-exit: one dead rank ends the step instead of leaving the others in a collective forever.
        # --cpus-per-task: srun of SLURM 22.05 no longer inherits it from sbatch.
        "srun_args": [
            "--kill-on-bad-exit=1",
            f"--cpus-per-task={cluster.cpus_per_task}",
            *container_step_args(cluster),
        ],
        "additional_parameters": additional,
    }
    return {k: v for k, v in params.items() if v is not None}


def render(
    params: dict[str, Any],
    *,
    command: str,
    folder: Path,
    dependency: str | None = None,
    array: int | None = None,
    max_parallel: int | None = None,
) -> str:
    """The exact sbatch script submitit writes for a job of ``params`` running ``command`` (deterministic: no ids,
    no temp names); ``array`` tasks with at most ``max_parallel`` at once; ``dependency`` like ``afterany:123``."""
    from submitit.slurm.slurm import _make_sbatch_string

    params = dict(params)
    if dependency:
        params["dependency"] = dependency
    if array is not None:
        params["map_count"] = array
        if max_parallel:
            params["array_parallelism"] = max_parallel
    return _make_sbatch_string(command=command, folder=folder, **params)


def executor(folder: Path, *, python: str, params: dict[str, Any]) -> Any:
    """submitit's SlurmExecutor in ``folder`` starting each task with ``python``, set to ``params``."""
    import submitit

    ex = submitit.SlurmExecutor(folder=folder, python=python)
    ex.update_parameters(**params)
    return ex
