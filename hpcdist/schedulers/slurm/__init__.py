"""SLURM, both of its sides: the job's facts (:mod:`.facts`: its variables and node lists), its tools run through one
helper with timeouts (:mod:`.client`: srun, scontrol, sinfo, squeue, sacct, scancel), the allocation and the step
command of a batch script (:mod:`.step`), the sbatch script ``hpcdist submit`` renders (:mod:`.sbatch`), and its row
of the scheduler table (:data:`SCHEDULER`, whose ``launcher`` is :data:`LAUNCHER`).

The only package that names SLURM's tools or reads its variables. A bare ``sbatch`` batch script also has
``SLURM_PROCID=0`` and ``SLURM_NTASKS=N``; treating it as rank 0 of N would wait forever for N-1 peers, so a step
needs step variables too (:func:`~.facts.in_step`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpcdist.schedulers.base import Allocation, Launcher, Scheduler
from hpcdist.schedulers.slurm import client, step
from hpcdist.schedulers.slurm.facts import (
    ATTEMPT_ENV,
    READS,
    SCONTROL_TIMEOUT_S,
    expand_nodelist,
    hostnames,
    in_step,
    read_job_facts,
    read_step_layout,
)

__all__ = [
    "ATTEMPT_ENV",
    "LAUNCHER",
    "SCHEDULER",
    "SCONTROL_TIMEOUT_S",
    "SlurmLauncher",
    "expand_nodelist",
    "hostnames",
    "in_step",
    "read_job_facts",
    "read_step_layout",
]


class SlurmLauncher:
    """SLURM's :class:`~hpcdist.schedulers.base.Launcher`: each method is one of :mod:`.client` or :mod:`.step`."""

    name = "slurm"
    title = "SLURM"
    submit_command = "sbatch"
    step_tool = "srun"
    terminal_states = client.TERMINAL_STATES
    timeout_env = client.PING_TIMEOUT_ENV

    def installed(self, environ: Mapping[str, str] | None = None) -> bool:
        return client.client_installed(environ)

    def reachable(self, environ: Mapping[str, str] | None = None) -> tuple[bool, str]:
        ok, why = client.slurm_reachable(environ)
        # the job's steps are srun's: a login node with sbatch but without srun cannot run them
        if ok and not client.tool_installed("srun", environ):
            ok, why = False, "srun is not on PATH"
        return ok, why

    def check_job_id(self, job_id: str) -> str:
        return client.check_job_id(job_id)

    def job_info(self, job_id: str) -> dict[str, str]:
        return client.job_info(job_id)

    def job_state(self, job_id: str) -> str | None:
        return client.job_state(job_id)

    def state_and_restarts(self, job_id: str) -> tuple[str, str] | None:
        info = client.job_info(job_id)
        return (info.get("JobState", "?"), info.get("Restarts", "?")) if info else None

    def job_log_dir(self, job_id: str) -> Path | None:
        try:
            stdout = client.job_info(job_id).get("StdOut")
        except client.SlurmError:
            return None
        return Path(stdout).parent if stdout else None

    def cancel(self, job_id: str) -> str:
        return client.cancel(job_id)

    def status_text(self, job_id: str | None = None) -> str:
        return client.status_text(job_id)

    def log_path(
        self, job_id: str, *, rank: int = 0, err: bool = False, run_dir: str | os.PathLike[str] | None = None
    ) -> Path:
        return client.log_path(job_id, rank=rank, err=err, run_dir=run_dir)

    def requeue(self, job_id: str, *, exclude: Iterable[str] = ()) -> int:
        return client.scontrol_requeue(job_id, exclude=exclude)

    def usable_nodes(self, partition: str | None) -> list[str] | None:
        return client.sinfo_usable_nodes(partition)

    def expand_nodes(self, nodelist: str) -> list[str]:
        return expand_nodelist(nodelist)

    def allocation(self, environ: Mapping[str, str]) -> Allocation | str:
        return step.allocation(environ)

    def run_gate(self, nodes: Sequence[str], argv: Sequence[str], *, timeout: float) -> tuple[str, int | None] | None:
        return client.srun_once_per_node(nodes, argv, timeout=timeout)

    def step_command(
        self,
        cmd: Sequence[str],
        nodes: Sequence[str],
        tasks_per_node: int,
        *,
        keep_survivors: bool = False,
        spares: bool = False,
    ) -> list[str]:
        return step.step_command(cmd, nodes, tasks_per_node, keep_survivors=keep_survivors, spares=spares)

    def batch_host(self, environ: Mapping[str, str]) -> str | None:
        # the batch script runs on the allocation's first node; slurmd names it in the job's environment
        return environ.get("SLURMD_NODENAME") or None

    # The sbatch side imports the cluster profile's schema: loaded on a login node only, never by a rank's start-up.
    def job_parameters(
        self,
        cluster: Any,
        *,
        job_name: str,
        signal: str,
        setup: list[str],
        loop_python: str,
        run_dir: str | Sequence[str] | None = None,
        fault: Any | None = None,
    ) -> dict[str, Any]:
        from hpcdist.schedulers.slurm import sbatch

        return sbatch.parameters(
            cluster,
            job_name=job_name,
            signal=signal,
            setup=setup,
            loop_python=loop_python,
            run_dir=run_dir,
            fault=fault,
        )

    def render_script(
        self,
        params: dict[str, Any],
        *,
        command: str,
        folder: Path,
        dependency: str | None = None,
        array: int | None = None,
        max_parallel: int | None = None,
    ) -> str:
        from hpcdist.schedulers.slurm import sbatch

        return sbatch.render(
            params, command=command, folder=folder, dependency=dependency, array=array, max_parallel=max_parallel
        )

    def flag_overrides(self, args: Any, profile: Callable[[], Any]) -> dict[str, Any]:
        extra = getattr(args, "sbatch_args", None)  # --sbatch-arg
        return {"extra_sbatch": [*profile().extra_sbatch, *extra]} if extra else {}

    def executor(self, folder: Path, *, python: str, params: dict[str, Any]) -> Any:
        from hpcdist.schedulers.slurm import sbatch

        return sbatch.executor(folder, python=python, params=params)


LAUNCHER: Launcher = SlurmLauncher()

SCHEDULER = Scheduler(
    name="slurm",
    job_facts=read_job_facts,
    step_layout=read_step_layout,
    reads=READS,
    variable_prefix="SLURM_",
    launcher=LAUNCHER,
)
