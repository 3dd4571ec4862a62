"""Hyper-parameter sweeps as one SLURM job array: ``hpcdist submit CONFIG --sweep optim.lr=1e-4,3e-4 ...``.

The sweep is a grid of ``--sweep key=v1,v2,...`` (or an explicit list of override mappings from ``--sweep-file``).
Each point becomes one array task running ``hpcdist train CONFIG OVERRIDES POINT run.dir=<run.dir>/<name>``, its
name made of the point's overrides. Every task is validated (config, cluster, memory) before anything is
submitted; the array is one submission (submitit's batch), ``--array=0-N%M`` with ``--max-parallel M``. Each task
requeues itself alone (JobFacts.job_id: <array job>_<task>). ``<run.dir>/sweep.json`` records the tasks, for
``hpcdist status JOB``.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpcdist.base.atomic import atomic_write
from hpcdist.base.rundir import RunDir
from hpcdist.base.untrusted import DamagedRecord, one_line, read_json
from hpcdist.config import ConfigError
from hpcdist.config.cluster import ClusterConfig
from hpcdist.config.loader import config_file
from hpcdist.launch.records import last_step
from hpcdist.launch.submit import JobHandle, describe_executor, launch, prepare, render_job_script, snapshot_placeholder
from hpcdist.launch.task import TrainTask
from hpcdist.schedulers import SchedulerError, launcher

__all__ = ["expand_sweep", "submit_sweep", "sweep_status", "task_name"]

_RECORD_MAX_BYTES = 16 << 20  # sweep.json: one short entry per task, tens of thousands of tasks
_TASK_ID = re.compile(r"[0-9]{1,12}(_[0-9]{1,9})?")  # a job id as check_job_id takes it
_UNSAFE = re.compile(r"[^A-Za-z0-9._=+-]")


def _value_text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def expand_sweep(sweeps: Sequence[str] = (), sweep_file: str | os.PathLike[str] | None = None) -> list[list[str]]:
    """The sweep's points, each a list of ``key=value`` overrides: the grid of ``sweeps`` (``key=v1,v2``; the first
    key varies slowest), times the points of ``sweep_file`` (a YAML list of ``{key: value}`` mappings).
    ConfigError names a malformed argument."""
    problems: list[str] = []
    axes: list[list[str]] = []
    for text in sweeps:
        key, sep, values = text.partition("=")
        items = [v.strip() for v in values.split(",")]
        if not sep or not key.strip() or not all(items):
            problems.append(f"--sweep {text!r}: write key=value1,value2,... (e.g. optim.lr=1e-4,3e-4)")
            continue
        if key.strip() == "run.dir":
            problems.append("--sweep run.dir: each task's run.dir is <run.dir>/<its overrides>; sweep other keys")
            continue
        axes.append([f"{key.strip()}={v}" for v in items])
    listed: list[list[str]] = [[]]
    if sweep_file is not None:
        listed = _read_sweep_file(Path(sweep_file), problems)
    if problems:
        raise ConfigError(problems)
    points = [[*listed_point, *combo] for listed_point in listed for combo in itertools.product(*axes)]
    if len(points) < 1 or points == [[]]:
        raise ConfigError(["--sweep / --sweep-file: no points to run"])
    return points


def _read_sweep_file(path: Path, problems: list[str]) -> list[list[str]]:
    from hpcdist.base import safe_yaml

    try:
        data = safe_yaml.load_file(path)
    except (OSError, ValueError) as e:
        problems.append(f"--sweep-file {path}: {e}")
        return [[]]
    if not isinstance(data, list) or not data or not all(isinstance(p, Mapping) and p for p in data):
        problems.append(f"--sweep-file {path}: must be a YAML list of mappings like - {{optim.lr: 3.0e-4}}")
        return [[]]
    out = []
    for i, point in enumerate(data):
        if "run.dir" in point:
            problems.append(f"--sweep-file {path}: entry {i} sets run.dir; each task's run.dir is <run.dir>/<name>")
        out.append([f"{k}={_value_text(v)}" for k, v in point.items()])
    return out


def task_name(point: Sequence[str]) -> str:
    """The run directory name of a point: its overrides, joined by ``,`` (characters a path or SLURM would
    misread replaced by ``_``)."""
    return _UNSAFE.sub("_", ",".join(point))[:200]


def submit_sweep(
    config: str | os.PathLike[str],
    overrides: Sequence[str] = (),
    *,
    sweep: Sequence[str] = (),
    sweep_file: str | os.PathLike[str] | None = None,
    max_parallel: int | None = None,
    cluster: str | os.PathLike[str] | ClusterConfig = "a100_ib",
    dry_run: bool = False,
    force: bool = False,
    after: str | None = None,
    snapshot: bool = True,
    **params: Any,
) -> list[JobHandle] | str:
    """Submit the sweep as one job array; one :class:`JobHandle` per task (``job_id`` ``<array>_<i>``), in the
    order of :func:`expand_sweep`. ``dry_run=True`` returns the array's batch script. Every task is validated
    first: one bad value refuses the whole sweep (ConfigError naming the task), nothing is submitted."""
    from hpcdist.launch.submit import dependency

    if max_parallel is not None and max_parallel < 1:
        raise ConfigError([f"--max-parallel: must be >= 1, got {max_parallel}"])
    points = expand_sweep(sweep, sweep_file)
    names = [task_name(p) for p in points]
    if len(set(names)) != len(names):
        raise ConfigError([f"--sweep: two points have the same name {n!r}" for n in names if names.count(n) > 1][:1])
    base, warnings = prepare(config, overrides, cluster, params, dry_run=True, force=force)
    problems: list[str] = []
    preps, tasks = [], []
    for name, point in zip(names, points, strict=True):
        task_overrides = [*overrides, *point, f"run.dir={Path(base.run_dir) / name}"]
        try:
            prep, task_warnings = prepare(config, task_overrides, cluster, params, dry_run=dry_run, force=force)
        except ConfigError as e:
            problems += [f"sweep task {name}: {p}" for p in e.problems]
            continue
        warnings += task_warnings
        preps.append(prep)
        tasks.append(TrainTask(str(config), tuple(task_overrides)))
    try:
        dep = dependency(after)
    except ValueError as e:
        problems.append(str(e))
    if problems:
        raise ConfigError(problems)
    for problem in dict.fromkeys(warnings):
        print(f"hpcdist: warning: {problem}", file=sys.stderr, flush=True)
    # one array: the base's cluster, log folder (<run.dir>/slurm) and job name; each task its own run dir
    run_dirs = [p.run_dir for p in preps]
    if dry_run:
        print(f"hpcdist: {describe_executor(base.cluster)}", file=sys.stderr, flush=True)
        for i, run_dir in enumerate(run_dirs):
            print(f"hpcdist: sweep task {i}: {run_dir}", file=sys.stderr, flush=True)
        return render_job_script(
            base.cluster,
            job_name=base.job_name,
            folder=base.folder,
            run_dir=run_dirs,
            dependency=dep,
            array=len(tasks),
            max_parallel=max_parallel,
            snapshot=snapshot_placeholder(base.run_dir) if snapshot else None,
            fault=getattr(base.cfg, "fault", None),
        )
    # one code snapshot for the whole array, in the sweep's base run dir
    handles = launch(base, tasks, run_dirs=run_dirs, after=dep, max_parallel=max_parallel, snapshot=snapshot)
    record = {
        "job_id": handles[0].job_id.split("_")[0],
        "config": str(config_file(config).absolute()),
        "overrides": list(overrides),
        "snapshot": handles[0].snapshot,
        "tasks": [
            {"index": i, "job_id": h.job_id, "name": n, "overrides": p, "run_dir": d}
            for i, (h, n, p, d) in enumerate(zip(handles, names, points, run_dirs, strict=True))
        ],
    }
    atomic_write(RunDir(base.run_dir).sweep, json.dumps(record, indent=1) + "\n")
    return handles


# --------------------------------------------------------------------------------------------- status


def _find_record(job_id: str, run_dir: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    """The sweep.json of array job ``job_id``: in ``run_dir``, else beside the folder of its StdOut."""
    candidates = []
    if run_dir is not None:
        candidates.append(RunDir(run_dir).sweep)
    else:
        folder = launcher().job_log_dir(job_id)
        if folder is not None:
            candidates += [RunDir(folder.parent).sweep, RunDir(folder).sweep]
    for path in candidates:
        try:  # a run dir's record anyone there could have written: bounded, no FIFO, no link (hpcdist.base.untrusted)
            record = read_json(path, _RECORD_MAX_BYTES)
        except DamagedRecord:
            continue
        if not isinstance(record, dict) or str(record.get("job_id")) != job_id.split("_")[0]:
            continue
        tasks = record.get("tasks") if isinstance(record.get("tasks"), list) else []
        record["tasks"] = [
            t
            for t in tasks
            if isinstance(t, dict)
            and isinstance(t.get("job_id"), str)
            and _TASK_ID.fullmatch(t["job_id"])
            and isinstance(t.get("run_dir"), str)
        ]
        return record
    return None


def sweep_status(job_id: str, run_dir: str | os.PathLike[str] | None = None) -> str | None:
    """A table of the array's tasks (state, restarts, step, loss, run dir); None when ``job_id`` is no sweep."""
    job_id = launcher().check_job_id(job_id)
    record = _find_record(job_id, run_dir)
    if record is None:
        return None
    rows = [
        one_line(f"sweep job {record['job_id']}: {len(record['tasks'])} task(s) of {record.get('config')}", 1000),
        f"{'task':>6} {'state':<11} {'restarts':>8} {'step':>7} {'loss':>9}  run dir",
    ]
    for task in record["tasks"]:
        try:
            known = launcher().state_and_restarts(task["job_id"])
            state, restarts = known if known is not None else ("?", "?")
        except SchedulerError:
            state, restarts, known = "?", "?", None
        if known is None:
            try:
                state = launcher().job_state(task["job_id"]) or "UNKNOWN"
            except SchedulerError:  # the scheduler cannot answer: the run dir's progress is still shown
                state = "?"
        step, loss = last_step(task["run_dir"])
        loss_text = "-" if loss is None else f"{loss:.4f}"
        rows.append(
            one_line(
                f"{task['job_id']:>6} {state:<11} {restarts:>8} {step if step is not None else '-':>7} "
                f"{loss_text:>9}  {task['run_dir']}",
                2000,
            )
        )
    return "\n".join(rows)
