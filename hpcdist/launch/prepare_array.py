"""The SLURM side of a cluster prepare (``hpcdist prepare ... --cluster PROFILE --tasks N``): submit
the job array and the merge job through the training submit path, the tasks they run, and finding a prepare from a
job id for ``hpcdist status``. What the tasks do (the plan, a part, the merge) is :mod:`hpcdist.data.array`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcdist.base.atomic import atomic_write
from hpcdist.data.array import (
    JOBS_NAME,
    KILL_ENV,
    MAX_REQUEUES,
    PARTS,
    PLAN_NAME,
    claim_plan,
    merge_parts,
    plan_prepare,
    read_jobs,
    run_part,
    write_plan,
)
from hpcdist.schedulers import job_facts

__all__ = ["MergeTask", "PrepareTask", "cmd_prepare_cluster", "find_prepare", "submit_prepare"]


def find_prepare(job_id: str | None, run_dir: Path | None) -> Path | None:
    """The OUT of a cluster prepare: ``run_dir`` itself when it holds a plan, else the one whose parts/jobs.json
    records ``job_id`` (found beside the job's StdOut, OUT/parts/slurm)."""
    if run_dir is not None and (Path(run_dir) / PARTS / PLAN_NAME).is_file():
        return Path(run_dir)
    if job_id is None:
        return None
    from hpcdist.schedulers import launcher

    logs = launcher().job_log_dir(job_id)
    if logs is None:
        return None
    out = logs.parent.parent  # OUT/parts/slurm/<file>
    jobs = read_jobs(out)
    base = str(job_id).split("_")[0]
    return out if base in (str(jobs.get("array")), str(jobs.get("merge"))) else None


@dataclass(frozen=True)
class PrepareTask:
    """Array task ``index`` of a cluster prepare (submitit pickles it by reference to this module). The tokenizing
    runs in a child process: when it is killed (the OOM killer, a test's SIGKILL), the task requeues itself alone
    (its array id, <array>_<index>) and the next run keeps the finished shards; preemption and node failures
    requeue it through SLURM (--requeue)."""

    out: str
    index: int
    workers: int = 1

    def __call__(self) -> dict[str, Any]:
        import multiprocessing

        # the SLURM test's hook: this task's process dies after its first shard, on the task's first run only
        job = job_facts()
        restarts = job.restart_count
        kill = os.environ.get(KILL_ENV) == str(self.index) and restarts == 0
        proc = multiprocessing.get_context("fork").Process(
            target=run_part, args=(self.out, self.index, self.workers), kwargs={"kill_after_first_shard": kill}
        )
        proc.start()
        proc.join()
        code = proc.exitcode
        if code == 0:
            return {"part": self.index}
        array, task = job.array_job_id, job.array_task_id
        if code is not None and code < 0 and array and task and restarts < MAX_REQUEUES:
            from hpcdist.launch.requeue import requeue

            name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
            print(
                f"hpcdist: prepare part {self.index}: its process was killed ({name}); requeueing the task", flush=True
            )
            if requeue(f"{array}_{task}") == 0:
                time.sleep(60)  # SLURM ends this run now; never return a result for it
                raise SystemExit(1)
        raise RuntimeError(f"prepare part {self.index} failed (exit code {code}); see this task's log")


@dataclass(frozen=True)
class MergeTask:
    """The merge job (afterok the array): OUT/meta.json from the parts."""

    out: str

    def __call__(self) -> dict[str, Any]:
        meta = merge_parts(Path(self.out))
        print(f"hpcdist: merged {len(meta.shards)} shards, {meta.num_tokens:,} tokens into {self.out}", flush=True)
        return {"num_tokens": meta.num_tokens, "shards": len(meta.shards)}


def submit_prepare(
    inputs: Sequence[Path],
    out: str | os.PathLike[str],
    *,
    tokenizer: str = "byte",
    tasks: int,
    cluster: Any = "a100_ib",
    text_field: str = "text",
    shard_tokens: int = 2**24,
    dtype: str = "auto",
    dry_run: bool = False,
    overwrite: bool = False,
    after: str | None = None,
    snapshot: bool = True,
    **params: Any,
) -> dict[str, Any]:
    """Submit a cluster prepare: one job array of ``tasks`` tasks (one node, one task each; the profile's
    cpus_per_task tokenizer processes) and a merge job after it (afterok), through the training submit path
    (profile, setup lines, container, code snapshot). Returns {"array": [JobHandle...], "merge": JobHandle}, or
    with ``dry_run`` {"array": script text, "merge": script text, "plan": plan} (nothing written)."""
    from hpcdist.config.cluster import load_cluster
    from hpcdist.launch.submit import Prepared, dependency, launch, render_job_script, snapshot_placeholder

    out_dir = Path(out).expanduser().absolute()
    plan = plan_prepare(
        inputs,
        out_dir,
        tokenizer=tokenizer,
        tasks=tasks,
        text_field=text_field,
        shard_tokens=shard_tokens,
        dtype=dtype,
    )
    cfg = load_cluster(cluster, **{"nodes": 1, "gpus_per_node": 0, "tasks_per_node": 1, **params})
    dep = dependency(after)
    parts = out_dir / PARTS
    name = cfg.job_name or "prepare"
    folder = cfg.folder(parts)
    workers = max(1, cfg.cpus_per_task)
    if dry_run:
        code = snapshot_placeholder(str(parts)) if snapshot else None
        array = render_job_script(cfg, job_name=name, folder=folder, dependency=dep, array=tasks, snapshot=code)
        merge = render_job_script(
            cfg, job_name=f"{name}-merge", folder=folder, dependency="afterok:<array job>", snapshot=code
        )
        return {"array": array, "merge": merge, "plan": plan}
    if claim_plan(out_dir, plan, overwrite):
        return {"array": [], "merge": None, "plan": plan, "up_to_date": True}
    write_plan(out_dir, plan)
    prep = Prepared(cfg, None, name, folder, str(parts))  # type: ignore[arg-type]
    todo = [PrepareTask(str(out_dir), i, workers) for i in range(tasks)]
    handles = launch(prep, todo, after=dep, snapshot=snapshot, attempt_loop=False)  # type: ignore[arg-type]
    array_id = handles[0].job_id.split("_")[0]
    merge_prep = Prepared(cfg, None, f"{name}-merge", folder, str(parts))  # type: ignore[arg-type]
    (merge,) = launch(
        merge_prep,
        [MergeTask(str(out_dir))],  # type: ignore[list-item]
        after=f"afterok:{array_id}",
        snapshot=handles[0].snapshot or False,
        attempt_loop=False,
    )
    atomic_write(parts / JOBS_NAME, json.dumps({"array": array_id, "merge": merge.job_id, "tasks": tasks}) + "\n")
    return {"array": handles, "merge": merge, "plan": plan}


def cmd_prepare_cluster(args: argparse.Namespace) -> int:
    """``hpcdist prepare INPUTS --out DIR --cluster PROFILE --tasks N [--dry-run] [--after JOB]`` (hpcdist.cli sends
    ``prepare --cluster`` here: the SLURM side lives in hpcdist.launch)."""
    from hpcdist.base.errors import CommandError, LaunchError, refusing
    from hpcdist.config import ConfigError
    from hpcdist.data.command import check_prepare_args, prepare_inputs

    @refusing("prepare", ValueError, OSError)
    def run() -> int:
        files = prepare_inputs(args)
        if args.tasks is None:
            raise CommandError("prepare --cluster: give --tasks N (the array's tasks: slices of the inputs)")
        if args.max_tokens is not None:
            raise CommandError(
                "prepare --cluster: --max-tokens is a one-machine option (slices are cut before tokenizing)"
            )
        if args.megatron is not None:
            raise CommandError("prepare: --megatron imports on this machine; give no --cluster")
        try:
            res = submit_prepare(
                files,
                args.out,
                tokenizer=args.tokenizer,
                tasks=args.tasks,
                cluster=args.cluster,
                text_field=args.text_field,
                shard_tokens=args.shard_tokens,
                dtype=args.dtype,
                dry_run=args.dry_run,
                overwrite=args.overwrite,
                after=args.after,
            )
        except ConfigError as e:
            raise CommandError("prepare --cluster: " + "; ".join(e.problems)) from None
        except LaunchError as e:
            raise CommandError(f"prepare --cluster: {e}") from None
        plan = res["plan"]
        if args.dry_run:
            for i, pieces in enumerate(plan["slices"]):
                what = ", ".join(f"{Path(p['path']).name}[{p['kind']} {p['start']}:{p['end']}]" for p in pieces[:4])
                more = f" and {len(pieces) - 4} more" if len(pieces) > 4 else ""
                print(f"# task {i}: {len(pieces)} piece(s): {what or 'nothing (an empty part)'}{more}", file=sys.stderr)
            print(f"# the array ({args.tasks} tasks), each into {args.out}/parts/<task>/:")
            print(res["array"])
            print("# the merge job (afterok the array), writing meta.json last:")
            print(res["merge"])
            return 0
        if res.get("up_to_date"):
            print(f"prepared {len(files)} files into {args.out}: already up to date")
            return 0
        merge, array = res["merge"].job_id, res["array"][0].job_id.split("_")[0]
        print(
            f"submitted the prepare of {len(files)} files into {args.out}: array job {array} "
            f"({args.tasks} tasks), merge job {merge} (afterok); follow it with hpcdist status --run-dir {args.out}; "
            f"train after it with hpcdist submit ... --after {merge}:afterok"
        )
        return 0

    check_prepare_args(args)
    return run()
