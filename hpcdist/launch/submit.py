"""Submit a training run from a login node (or a laptop) with submitit: ``submit(config, cluster=...)``.

The job is the same trainer ``hpcdist train`` runs, one task (rank) per GPU through ``srun``:

    sbatch script (rendered by submitit's own _make_sbatch_string)
      #SBATCH --nodes, --ntasks-per-node=<gpus>, --gpus-per-node, --cpus-per-task, --requeue,
      #SBATCH --signal=USR2@<lead>, resources and site flags
      export HPCDIST_NCCL_PROFILE=<profile>       (applied inside every task: interface names differ per host)
      srun() { <python> -m hpcdist.launch.attempts --run-dir <run.dir> ... -- srun "$@"; }   (the attempt loop)
      srun ... --kill-on-bad-exit=1 <python> -u -m submitit.core._submit <folder>   -> TrainTask() per rank

Where no SLURM client is installed at all (no sbatch on PATH), ``executor: auto`` runs the same TrainTask under
submitit's LocalExecutor (one node); where sbatch exists, a controller that does not answer is an error, never a
reason to run the job on the login node (choose_executor).
Everything user-provided that reaches the script is validated to one line (hpcdist.config.cluster) and
shell-quoted (submitit quotes #SBATCH values and the srun line; the setup lines are quoted here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shlex
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpcdist import config as config_mod
from hpcdist.base.errors import LaunchError
from hpcdist.config import ConfigError
from hpcdist.config.cluster import ClusterConfig, _one_line, load_cluster
from hpcdist.launch.nccl import PROFILE_ENV
from hpcdist.launch.task import TrainTask
from hpcdist.schedulers import SchedulerError, launcher

__all__ = [
    "JobHandle",
    "LaunchError",
    "LogPaths",
    "choose_executor",
    "describe_executor",
    "render_job_script",
    "slurm_parameters",
    "submit",
]

log = logging.getLogger(__name__)

# submitit's default preemption signal (its SlurmJobEnvironment.USR_SIG unless SUBMITIT_PREEMPT_SIGNAL is set).
_SUBMITIT_DEFAULT_SIGNAL = "USR2"


@dataclasses.dataclass(frozen=True)
class LogPaths:
    """One rank's log files (submitit's layout: ``<folder>/<jobid>_<rank>_log.out`` / ``.err``)."""

    stdout: Path
    stderr: Path


def _signal_name(name: str) -> str:
    return name.strip().upper().removeprefix("SIG")


# --------------------------------------------------------------------------------------------- parameters


def _setup_lines(cluster: ClusterConfig) -> list[str]:
    """Shell lines run before the step: the profile's own setup lines (site commands, as written), then ours, whose
    values are quoted; nothing secret is exported."""
    lines = list(cluster.setup)
    if cluster.nccl_profile:
        lines.append(f"export {PROFILE_ENV}={shlex.quote(cluster.nccl_profile)}")
    # One intra-op thread pool per rank sized to its CPUs (torch would otherwise start one thread per core
    # of the node in each of the node's ranks); a value the user exported wins.
    lines.append(f"export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-{cluster.cpus_per_task}}}")
    sig = _signal_name(cluster.signal)
    if sig != _SUBMITIT_DEFAULT_SIGNAL:
        # submitit's own handler is active until the trainer installs its handlers: make it react to our signal
        lines.append(f"export SUBMITIT_PREEMPT_SIGNAL={shlex.quote(sig)}")
    return lines


def _snapshot_lines(snapshot: str | os.PathLike[str] | None) -> list[str]:
    """The code snapshot first on PYTHONPATH: every attempt, the supervisor and the failure policy import it.
    PYTHONSAFEPATH: ``python -m`` would otherwise put the working directory (where sbatch was run: often the
    checkout itself) before PYTHONPATH and import the edited checkout (Python >= 3.11; the sandbox test found it)."""
    if snapshot is None:
        return []
    return ["export PYTHONSAFEPATH=1", f"export PYTHONPATH={shlex.quote(str(snapshot))}${{PYTHONPATH:+:$PYTHONPATH}}"]


def _container_prefix(cluster: ClusterConfig) -> str:
    """What wraps each task's command for an apptainer or wrapper-command container ('' for none and for pyxis,
    which the scheduler's step launcher applies itself)."""
    k = cluster.container
    if k is None or k.runtime == "pyxis":
        return ""
    if k.runtime == "command":
        return f"{shlex.quote(k.wrapper or '')} "
    args = [k.executable, "exec"]
    for mount in k.mounts:
        args += ["--bind", mount]
    if k.workdir:
        args += ["--pwd", k.workdir]
    args.append(k.image or "")
    return shlex.join(args) + " "


def _supervised_python(cluster: ClusterConfig) -> str:
    """What the step starts for each rank: the interpreter under hpcdist.fault.supervise, which records a rank killed
    by a signal (OOM killer, segfault) before the step launcher notices; inside the container when the profile has
    one (the supervisor with it, so signal forwarding is unchanged). submitit appends ``-u -m submitit.core._submit
    <folder>``."""
    python = shlex.quote(cluster.interpreter)
    return f"{_container_prefix(cluster)}{python} -m hpcdist.fault.supervise -- {python}"


def slurm_parameters(
    cluster: ClusterConfig,
    *,
    job_name: str,
    run_dir: str | Sequence[str] | None = None,
    snapshot: str | os.PathLike[str] | None = None,
    fault: Any | None = None,
) -> dict[str, Any]:
    """The batch executor's parameters for ``cluster`` (the scheduler's :meth:`~hpcdist.schedulers.Launcher.
    job_parameters`); with ``run_dir``, the step runs under the attempt loop (in-job restarts, the failure policy);
    ``fault`` (the training config's fault section) adds its fault.spare_nodes to the nodes asked for."""
    # the loop needs hpcdist: inside the container where the tasks run in one (apptainer, wrapper); a container the
    # step launcher applies itself (pyxis) exists only inside the step, so there it runs with the host's python
    return launcher().job_parameters(
        cluster,
        job_name=job_name,
        signal=_signal_name(cluster.signal),
        setup=_setup_lines(cluster) + _snapshot_lines(snapshot),
        loop_python=_container_prefix(cluster) + shlex.quote(cluster.interpreter),
        run_dir=run_dir,
        fault=fault,
    )


def local_parameters(cluster: ClusterConfig) -> dict[str, Any]:
    """submitit LocalExecutor parameters: one node, tasks_per_node ranks, the same time limit and signal lead."""
    return {
        "tasks_per_node": cluster.ntasks_per_node,
        "gpus_per_node": cluster.gpus_per_node,  # 0 -> CUDA_VISIBLE_DEVICES="" (CPU ranks)
        "timeout_min": cluster.time_minutes,
        "signal_delay_s": cluster.signal_lead_s,
        "setup": _setup_lines(cluster),
    }


def _command(cluster: ClusterConfig, folder: Path, *, python: str | None = None) -> str:
    # the same string submitit's executors build (_submitit_command_str), with the interpreter quoted
    python = shlex.quote(cluster.interpreter) if python is None else python
    return " ".join([python, "-u -m submitit.core._submit", shlex.quote(str(folder))])


def render_job_script(
    cluster: ClusterConfig,
    *,
    job_name: str,
    folder: str | os.PathLike[str],
    run_dir: str | Sequence[str] | None = None,
    dependency: str | None = None,
    array: int | None = None,
    max_parallel: int | None = None,
    snapshot: str | os.PathLike[str] | None = None,
    fault: Any | None = None,
) -> str:
    """The exact batch script the executor writes for this job (deterministic: no ids, no temp names); ``array``
    tasks (a sweep) with at most ``max_parallel`` at once, their run dirs in ``run_dir``."""
    path = Path(folder).expanduser().absolute()
    params = slurm_parameters(cluster, job_name=job_name, run_dir=run_dir, snapshot=snapshot, fault=fault)
    return launcher().render_script(
        params,
        command=_command(cluster, path, python=_supervised_python(cluster)),
        folder=path,
        dependency=dependency,
        array=array,
        max_parallel=max_parallel,
    )


def _render_local(cluster: ClusterConfig, folder: Path) -> str:
    params = local_parameters(cluster)
    lines = [
        "# submitit LocalExecutor (no SLURM): one node",
        f"# {params['tasks_per_node']} task(s), gpus_per_node={params['gpus_per_node']}, "
        f"time limit {params['timeout_min']} min, {_signal_name(cluster.signal)} {cluster.signal_lead_s} s before",
        f"# logs: {folder}/<jobid>_<rank>_log.out|err",
        *params["setup"],
        _command(cluster, folder),
        "",
    ]
    return "\n".join(lines)


def choose_executor(cluster: ClusterConfig, environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(the scheduler's name, "slurm", | "local", why), or LaunchError naming the reason.

    ``auto`` runs local processes only where no SLURM client is installed at all (sbatch not on PATH, as submitit
    decides). Where sbatch exists this is a login node: a controller that is down, slow or misconfigured is an
    error, never a reason to run the job on the login node itself.
    """
    if cluster.executor == "local":
        return "local", "cluster.executor is local"
    batch = launcher()
    if not batch.installed(environ) and cluster.executor == "auto":
        if cluster.nodes > 1:
            raise LaunchError(
                f"no {batch.title} client is installed here ({batch.submit_command} is not on PATH) and the local "
                f"fallback runs one node, but nodes={cluster.nodes}; submit from a login node, or use --nodes 1 / "
                "--cluster local"
            )
        return "local", f"auto: no {batch.title} client installed: {batch.submit_command} is not on PATH"
    try:
        ok, why = batch.reachable(environ)
    except SchedulerError as e:
        raise LaunchError(str(e)) from None
    if ok:
        return batch.name, why
    hint = f"; raise {batch.timeout_env} (seconds) for a slow controller" if "did not answer" in why else ""
    raise LaunchError(
        f"cluster {cluster.name} (executor: {cluster.executor}) needs {batch.title}, but the controller is not usable: "
        f"{why}{hint}; nothing was started (to run on this machine on purpose: --cluster local, i.e. executor: local)"
    )


def describe_executor(cluster: ClusterConfig, environ: Mapping[str, str] | None = None) -> str:
    """One line for the dry run: which executor submit would use and why (it asks the controller, like submit)."""
    try:
        kind, why = choose_executor(cluster, environ)
    except LaunchError as e:
        return f"executor: none: submit would refuse: {e}"
    return f"executor: {kind} ({why})"


# --------------------------------------------------------------------------------------------- job handle


class JobHandle:
    """A submitted job: id, state, per-rank logs, wait, cancel, result.

    State names are SLURM's (PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, ...) for both executors;
    a requeued job goes back to PENDING and is not finished.
    """

    def __init__(
        self,
        job: Any,
        *,
        executor: str,
        folder: Path,
        num_tasks: int,
        snapshot: str | None = None,
        task: TrainTask | None = None,
        run_dir: str | None = None,
    ) -> None:
        self.job = job  # the submitit Job, for anything not wrapped here
        self.run_dir = run_dir
        """The run dir whose jobs.jsonl records the job (what status/logs/cancel of a local job need)."""
        self.executor = executor
        self.folder = folder
        self.num_tasks = num_tasks
        self.snapshot = snapshot
        """The code snapshot the job runs from (None: the installed code)."""
        self.task = task
        """What the job runs (its config path inside the snapshot, if any): kept here, never read back from
        submitit's submitted pickle (loading a pickle in a log folder runs whatever is there now)."""

    @property
    def job_id(self) -> str:
        return str(self.job.job_id)

    def _paths(self, rank: int) -> Any:
        from submitit.core.utils import JobPaths

        return JobPaths(self.folder, job_id=self.job_id, task_id=rank)

    @property
    def paths(self) -> list[LogPaths]:
        """stdout/stderr of every rank, index = rank."""
        return [LogPaths(p.stdout, p.stderr) for p in map(self._paths, range(self.num_tasks))]

    def _outcome(self, rank: int) -> tuple[str, Any] | None:
        """("success", value) / ("error", traceback) from a rank's result record; None if it wrote none. Never
        submitit's result pickle: the log folder may be shared, and loading a pickle runs its writer's code."""
        from hpcdist.launch.task import read_result

        return read_result(self.folder, self.job_id, rank)

    def _from_results(self, *, none: str) -> str:
        """COMPLETED when every rank succeeded, ``none`` when no rank left a result, else FAILED."""
        outcomes = [self._outcome(r) for r in range(self.num_tasks)]
        if all(o is not None and o[0] == "success" for o in outcomes):
            return "COMPLETED"
        return "FAILED" if any(o is not None for o in outcomes) else none

    def _poll(self) -> tuple[str, bool]:
        """(state, finished)."""
        if self.executor == "local":
            raw = self.job.get_info().get("jobState", "UNKNOWN")
            if raw == "RUNNING":
                return "RUNNING", False
            if raw == "INTERRUPTED":
                return "CANCELLED", True
            # FINISHED (a rank that died left no result: FAILED), or the process is not ours (handle unpickled)
            return self._from_results(none="FAILED" if raw == "FINISHED" else "UNKNOWN"), True
        try:
            state = launcher().job_state(self.job_id)
        except SchedulerError as e:
            log.debug("state of job %s unknown for now: %s", self.job_id, e)
            return "UNKNOWN", False  # the controller may be busy; ask again later
        if state is None:  # forgotten by the controller and no accounting: judge by the results
            return self._from_results(none="UNKNOWN"), True
        state = state.split()[0].rstrip("+")
        return state, state in launcher().terminal_states

    @property
    def state(self) -> str:
        return self._poll()[0]

    def done(self) -> bool:
        return self._poll()[1]

    def wait(self, timeout: float | None = None, *, poll_s: float = 2.0) -> str:
        """Block until the job has finished (through any requeues); returns its final state.

        Raises TimeoutError after ``timeout`` seconds (the job keeps running).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            state, finished = self._poll()
            if finished:
                return state
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {self.job_id} is still {state} after {timeout:g} s")
            time.sleep(poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic())))

    def cancel(self) -> None:
        """Cancel the job (its scheduler's cancel; on the LocalExecutor, stop its ranks and wait until they end)."""
        if self.executor == "local":
            from hpcdist.launch.records import end_local_job

            end_local_job(int(self.job_id))
        else:
            launcher().cancel(self.job_id)

    def results(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """Every rank's return value (TrainTask: step, loss, ...), after waiting for the job."""
        state = self.wait(timeout)
        values = []
        for rank in range(self.num_tasks):
            outcome = self._outcome(rank)
            log_file = self.paths[rank].stderr
            if outcome is None:
                raise LaunchError(f"job {self.job_id} ended {state} without a result from rank {rank}; see {log_file}")
            if outcome[0] != "success":
                raise LaunchError(f"job {self.job_id} rank {rank} failed ({state}); see {log_file}:\n{outcome[1]}")
            values.append(outcome[1])
        return values

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        """Rank 0's return value (all ranks report the same global loss)."""
        return self.results(timeout)[0]

    def __repr__(self) -> str:
        return f"JobHandle(job_id={self.job_id!r}, executor={self.executor!r}, tasks={self.num_tasks})"


# --------------------------------------------------------------------------------------------- submit


def _check_job(cfg: config_mod.JobConfig, cluster: ClusterConfig, job_name: str, folder: Path) -> list[str]:
    """Problems of this config on this cluster (the cluster alone was validated by load_cluster)."""
    problems: list[str] = []
    try:
        config_mod.check_world(cfg, cluster.world_size)
    except ConfigError as e:
        where = f"{cluster.nodes} node(s) x {cluster.ntasks_per_node} tasks = {cluster.world_size} ranks"
        problems += [f"{p} (on {where})" for p in e.problems]
    try:  # the login node usually sees the cluster's shared file system: refuse another user's or a read-only run
        config_mod.check_run_dir(cfg)
    except ConfigError as e:
        problems += e.problems
    fault = getattr(cfg, "fault", None)
    if fault is not None:
        problems += config_mod.shrink_problems(cfg, cluster.nodes, cluster.ntasks_per_node)
    wanted = getattr(fault, "requeue_signal", None)
    if wanted and _signal_name(wanted) != _signal_name(cluster.signal):
        problems.append(
            f"cluster.signal ({cluster.signal}) differs from fault.requeue_signal ({wanted}) of the training "
            "config: the job would send one signal and the trainer wait for the other; make them equal"
        )
    if cluster.job_name is None:
        problems += [
            p.replace("cluster.job_name", "run.name (the default job name)")
            for p in _one_line("cluster.job_name", job_name)
        ]
    if cluster.log_dir is None:
        hint = "; set the cluster's log_dir to another directory"
        problems += [f"{p}{hint}" for p in _one_line("run.dir (the default log_dir <run.dir>/slurm)", str(folder))]
        if "%" in str(folder):
            problems.append(f"run.dir: {str(folder)!r} contains '%', which SLURM expands in log paths{hint}")
    return problems


def _check_fit(cfg: config_mod.JobConfig, cluster: ClusterConfig, *, force: bool) -> list[str]:
    """The planner's fit check for the requested nodes: a problem unless forced (then a warning)."""
    from hpcdist.planning.fit import check_fit

    check = check_fit(cfg, cluster)
    if check is not None and check.tight:
        print(f"hpcdist: warning: {check.tight_note()}", file=sys.stderr, flush=True)
    if check is None or check.fits:
        return []
    if force:
        print(f"hpcdist: warning: --force: {check.refusal()}", file=sys.stderr, flush=True)
        return []
    return [check.refusal()]


@dataclasses.dataclass(frozen=True)
class Prepared:
    """One validated job: its cluster, resolved config, job name, log folder and absolute run dir."""

    cluster: ClusterConfig
    cfg: config_mod.JobConfig
    job_name: str
    folder: Path
    run_dir: str


def prepare(
    config: str | os.PathLike[str],
    overrides: Sequence[str],
    cluster: str | os.PathLike[str] | ClusterConfig,
    params: Mapping[str, Any],
    *,
    dry_run: bool,
    force: bool,
    data_later: bool = False,
) -> tuple[Prepared, list[str]]:
    """Load and check one job (cluster + config + memory); (prepared, data warnings). ConfigError lists every
    problem of both files at once. ``data_later``: the job waits for another (``--after``), which may make its
    prepared data (a cluster prepare's merge job): a dataset missing now is a warning, not a refusal."""
    problems: list[str] = []
    cluster_cfg = cfg = None
    try:
        cluster_cfg = load_cluster(cluster, **params)
    except ConfigError as e:
        problems += e.problems
    try:
        cfg = config_mod.load(config, overrides)
    except ConfigError as e:
        problems += e.problems
    if cluster_cfg is None or cfg is None:  # report both files' problems at once
        raise ConfigError(problems)
    job_name = cluster_cfg.job_name or cfg.run.name
    folder = cluster_cfg.folder(cfg.run.dir)
    run_dir = str(Path(cfg.run.dir).expanduser().absolute())  # the batch script's after-step reads it
    problems = _check_job(cfg, cluster_cfg, job_name, folder)
    if not problems:
        problems = _check_fit(cfg, cluster_cfg, force=force)
    # the data must exist before a job waits in the queue for it; a dry run only warns
    data_problems = config_mod.check_data(cfg, strict=False)
    refused = data_problems
    if data_later:
        from hpcdist.config.vocab import dataset_paths

        later = [f"{key} {path}: no prepared dataset there (no complete meta.json)" for key, path in dataset_paths(cfg)]
        refused = [p for p in data_problems if not any(p.startswith(m) for m in later)]
    if problems or (refused and not dry_run):
        raise ConfigError(problems + refused)
    return Prepared(cluster_cfg, cfg, job_name, folder, run_dir), data_problems


def dependency(after: str | None) -> str | None:
    """``JOB[:afterok|afterany|afternotok]`` (``--after``) -> sbatch's ``TYPE:JOB``; default afterany, as sbatch's
    own ``-d JOB``. ValueError naming the argument otherwise."""
    if after is None:
        return None
    job, _, kind = str(after).strip().partition(":")
    kind = kind or "afterany"
    if kind not in _DEPENDENCY_TYPES:
        raise ValueError(f"--after {after}: the dependency type must be one of {', '.join(_DEPENDENCY_TYPES)}")
    try:
        job = launcher().check_job_id(job)
    except SchedulerError as e:
        raise ValueError(f"--after {after}: {e}") from None
    return f"{kind}:{job}"


_DEPENDENCY_TYPES = ("afterany", "afterok", "afternotok")


@contextlib.contextmanager
def _detached_stdio(log_path: Path) -> Iterator[None]:
    """While submitit's LocalExecutor starts its controller: fds 0-2 of this process are /dev/null and ``log_path``.

    submitit starts the controller with the caller's stdin, stdout and stderr, and the ranks inherit them from it.
    A shell that captures ``hpcdist submit``'s output (``JOB=$(hpcdist submit ... --cluster local)``) reads until
    every writer has closed the pipe, so it waited for the whole job. The ranks write to their own log files; the
    controller's own output (a traceback, should it fail) goes to ``log_path``. The descriptors are back when the
    controller has started (Popen returns after the fork)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)  # the job's log folder (submitit makes it too)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved: list[int | None] = []
    for fd in (0, 1, 2):
        try:
            saved.append(os.dup(fd))  # not inheritable: the controller gets no copy of the caller's
        except OSError:
            saved.append(None)  # started with that descriptor closed
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
        try:
            os.dup2(null, 0)
            os.dup2(out, 1)
            os.dup2(out, 2)
        finally:
            os.close(null)
            os.close(out)
        yield
    finally:
        for fd, copy in zip((0, 1, 2), saved, strict=True):
            if copy is None:
                with contextlib.suppress(OSError):
                    os.close(fd)
            else:
                os.dup2(copy, fd)
                os.close(copy)


def launch(
    prep: Prepared,
    tasks: Sequence[TrainTask],
    *,
    run_dirs: Sequence[str] | None = None,
    after: str | None = None,
    max_parallel: int | None = None,
    snapshot: bool | str = False,
    attempt_loop: bool = True,
) -> list[JobHandle]:
    """Submit ``tasks`` with ``prep``'s cluster: one job, or (several tasks) one SLURM job array whose task i runs
    tasks[i] (its failure policy reads run_dirs[i]). ``after``: a dependency (``afterany:123``).
    ``snapshot``: copy the code into prep's run dir first and run the job from the copy (SLURM only); a string
    is an existing snapshot directory to run from (a chain's later jobs). ``attempt_loop=False``: the step runs once,
    without training's in-job restarts and failure policy (a cluster prepare's tasks, hpcdist.data.array)."""
    cluster = prep.cluster
    kind, why = choose_executor(cluster)
    if kind == "local" and (len(tasks) > 1 or after):
        raise LaunchError(f"{why}: job arrays and dependencies need SLURM; submit from a login node")
    code = None
    if kind != "local" and snapshot:
        from hpcdist.launch.snapshot import create_snapshot

        if isinstance(snapshot, str):
            code = snapshot
        else:
            snap = create_snapshot(prep.run_dir)
            code = str(snap.path)
            if sys.version_info < (3, 11) and (Path.cwd() / "hpcdist").is_dir():
                log.warning(
                    "Python < 3.11 ignores PYTHONSAFEPATH: the job's working directory %s holds an "
                    "hpcdist package that comes before the snapshot; submit from another directory",
                    Path.cwd(),
                )
            # a config inside the checkout is read from the copy too (it is read when the job starts)
            tasks = [
                dataclasses.replace(t, config_path=snap.map(t.config_path)) if hasattr(t, "config_path") else t
                for t in tasks
            ]
            log.info("code snapshot %s (git commit %s%s)", code, snap.git_commit, ", dirty" if snap.dirty else "")
    if kind == "local" and cluster.executor != "local":
        log.warning("%s: running the job with submitit's LocalExecutor on this machine", why)
    import submitit

    try:
        if kind != "local":
            dirs: str | Sequence[str] = run_dirs if run_dirs is not None and len(tasks) > 1 else prep.run_dir
            params = slurm_parameters(
                cluster,
                job_name=prep.job_name,
                run_dir=dirs if attempt_loop else None,
                snapshot=code,
                fault=getattr(prep.cfg, "fault", None),
            )
            if after:
                params["dependency"] = after
            if max_parallel:
                params["array_parallelism"] = max_parallel
            executor: Any = launcher().executor(prep.folder, python=_supervised_python(cluster), params=params)
        else:
            executor = submitit.LocalExecutor(folder=prep.folder, python=shlex.quote(cluster.interpreter))
            executor.update_parameters(**local_parameters(cluster))
        if len(tasks) == 1 and kind == "local":
            with _detached_stdio(prep.folder / "local-controller.log"):
                jobs = [executor.submit(tasks[0])]
        elif len(tasks) == 1:
            jobs = [executor.submit(tasks[0])]
        else:
            with executor.batch():
                delayed = [executor.submit(task) for task in tasks]
            jobs = list(delayed)
    except (OSError, RuntimeError, ValueError) as e:
        # the scheduler's refusal arrives as submitit's FailedJobError/CalledProcessError text: keep its last lines
        text = str(e).strip().splitlines()
        raise LaunchError(f"submission with the {kind} executor failed: {' | '.join(text[-3:])}") from e
    handles = [
        JobHandle(
            job,
            executor=kind,
            folder=prep.folder,
            num_tasks=cluster.world_size,
            snapshot=code,
            task=task,
            run_dir=prep.run_dir,
        )
        for job, task in zip(jobs, tasks, strict=True)
    ]
    from hpcdist.launch.records import record_job

    for h in handles:
        record_job(
            prep.run_dir,
            {
                "job_id": h.job_id,
                "executor": kind,
                "folder": str(prep.folder),
                "num_tasks": h.num_tasks,
                "snapshot": code,
            },
        )
    log.info("submitted job %s (%s, %s): logs in %s", handles[0].job_id, kind, why, prep.folder)
    return handles


def submit(
    config: str | os.PathLike[str],
    overrides: Sequence[str] = (),
    *,
    cluster: str | os.PathLike[str] | ClusterConfig = "a100_ib",
    dry_run: bool = False,
    force: bool = False,
    after: str | None = None,
    snapshot: bool = True,
    **params: Any,
) -> JobHandle | str:
    """Validate ``config`` + ``overrides`` for the cluster and submit one training job.

    ``cluster`` is a shipped profile name (``cluster_names()``), a YAML path, or a ClusterConfig; ``params``
    override its fields (``nodes=4, partition="gpu", extra_sbatch=["--mail-type=END"]``). Everything is validated
    before anything is submitted (ConfigError lists every problem). ``dry_run=True`` returns the batch script
    text instead (a description of the local run for executor ``local``). Returns a :class:`JobHandle`.

    A layout the planner predicts not to fit the cluster's GPUs (its hardware: block) is refused, naming the
    nearest layouts that fit; ``force=True`` submits it anyway. ``after="123"`` (or ``"123:afterok"``) starts the
    job only after job 123 ends (a dependency). ``snapshot``: run the job from a copy of the code made now
    (hpcdist.launch.snapshot), so edits after submission change neither the job nor its requeued attempts.
    """
    return submit_chain(
        config, overrides, 1, cluster=cluster, dry_run=dry_run, force=force, after=after, snapshot=snapshot, **params
    )[0]


def submit_chain(
    config: str | os.PathLike[str],
    overrides: Sequence[str] = (),
    n: int = 2,
    *,
    cluster: str | os.PathLike[str] | ClusterConfig = "a100_ib",
    dry_run: bool = False,
    force: bool = False,
    after: str | None = None,
    snapshot: bool = True,
    **params: Any,
) -> list[Any]:
    """``n`` jobs of the same run, each starting when the previous one ends (afterany), for clusters that cap the
    wall time and do not requeue: each job resumes from the checkpoint the previous one saved on the time-limit
    signal. With n > 1 the jobs run with fault.requeue=false (the next job continues instead). Returns the
    handles (a dry run: [the first job's script])."""
    if n < 1:
        raise ValueError(f"--chain: must be >= 1, got {n}")
    try:
        dep = dependency(after)
    except ValueError as e:
        raise ConfigError([str(e)]) from None
    overrides = [*overrides, "fault.requeue=false"] if n > 1 else list(overrides)
    prep, warnings = prepare(
        config, overrides, cluster, params, dry_run=dry_run, force=force, data_later=dep is not None
    )
    for problem in warnings:
        print(f"hpcdist: warning: {problem}", file=sys.stderr, flush=True)
    if dry_run:
        print(f"hpcdist: {describe_executor(prep.cluster)}", file=sys.stderr, flush=True)
        spares = config_mod.describe_spares(prep.cfg, prep.cluster.nodes)
        if spares:
            print(f"hpcdist: {spares}", file=sys.stderr, flush=True)
        if n > 1:
            print(
                f"hpcdist: --chain {n}: this script, then {n - 1} more job(s) of it, each with "
                "--dependency=afterany:<the previous job>",
                file=sys.stderr,
                flush=True,
            )
        if prep.cluster.executor == "local":
            return [_render_local(prep.cluster, prep.folder)]
        code = snapshot_placeholder(prep.run_dir) if snapshot else None
        return [
            render_job_script(
                prep.cluster,
                job_name=prep.job_name,
                folder=prep.folder,
                run_dir=prep.run_dir,
                dependency=dep,
                snapshot=code,
                fault=getattr(prep.cfg, "fault", None),
            )
        ]
    task = TrainTask(str(config), tuple(overrides))
    handles: list[JobHandle] = []
    code: bool | str = snapshot
    for _ in range(n):
        (handle,) = launch(prep, [task], after=dep, snapshot=code)
        handles.append(handle)
        dep = f"afterany:{handle.job_id}"
        code = handle.snapshot or code  # the chain's jobs share the first one's snapshot
        task = handle.task or task  # the config path inside the snapshot
    return handles


def snapshot_placeholder(run_dir: str) -> str:
    """What a dry run shows for the snapshot that submit would create (its name has the submission time)."""
    from hpcdist.base.rundir import RunDir

    return str(RunDir(run_dir).code_snapshot("<time>-<pid>"))
