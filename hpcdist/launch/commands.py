"""The launch commands of ``hpcdist``: ``train`` (hpcdist.run under this job's scheduler), ``submit``, ``status``,
``logs`` and ``cancel``. Each takes the parsed arguments and returns the exit status; a refusal is a
``CommandError`` that ``hpcdist.cli`` prints as one line. Imports stay inside the commands: ``train``'s torch
imports run while hpcdist.cli holds the stop signals, and ``status`` never loads torch."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from hpcdist.base.atomic import UntrustedFile
from hpcdist.base.errors import CommandError, PeerRankDied, refusing
from hpcdist.launch.submit import LaunchError
from hpcdist.schedulers import SchedulerError, launcher


def cmd_train(args: argparse.Namespace) -> int:
    given = [f"--{name.replace('_', '-')}" for name in ("world_size", "cluster", "ranks") if getattr(args, name)]
    if given:
        raise CommandError(
            f"train: {', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only with --dry-run "
            f"(a real run takes its ranks from torchrun or {launcher().step_tool})"
        )
    from hpcdist import config as config_mod  # torch-free

    # A config mistake is refused here, in a second, before torch and the trainer are imported (5-25 s on a busy
    # node); run.main loads the config again (milliseconds) and checks what needs the job and the data.
    try:
        cfg = config_mod.load(args.config, args.overrides)
        _check_before_torch(cfg)
    except config_mod.ConfigError as e:  # DataError included
        raise _once_per_job(e) from e
    from hpcdist.checkpoint.errors import CheckpointMismatch, CheckpointUnavailable
    from hpcdist.config import ConfigError
    from hpcdist.fault.nonfinite import NonFiniteError
    from hpcdist.hf.source import ConversionError
    from hpcdist.launch.job import SlurmEnvironment
    from hpcdist.run import main as run_main

    try:
        return run_main(args.config, args.overrides, job=SlurmEnvironment()).exit_code
    except (ConfigError, CheckpointMismatch, ConversionError) as e:  # one readable message, once per job
        raise _once_per_job(e) from e
    except CheckpointUnavailable as e:  # storage, not input: recorded in failures.jsonl, retried by the policy
        raise _once_per_job(e, code=e.EXIT_CODE) from e
    except NonFiniteError as e:  # every rank stops at the same step (the norm is global): say it once
        raise _once_per_job(e, code=1) from e
    except PeerRankDied as e:  # every survivor alike; rank 0 may be the dead one: the first rank of each node says it
        e.per_host = True  # type: ignore[attr-defined]
        raise _once_per_job(e, code=e.EXIT_CODE) from e


def _check_before_torch(cfg: Any) -> None:
    """run.main's torch-free start-up checks, run before torch is imported: this job's batch split on its ranks,
    run.dir / checkpoint.dir, the prepared data (each refusal used to wait 5-90 s for torch on a busy node). run.main
    runs them again (milliseconds), as an API caller needs them."""
    from hpcdist import config as config_mod
    from hpcdist.env import from_environ

    try:
        env = from_environ(cuda_available=False)  # ranks from torchrun / SLURM / one process: no CUDA, no torch
    except ValueError:
        return  # a garbled launcher environment: run.main says so in its own words
    if not config_mod.needs_planner(cfg.parallel.strategy):  # auto: the planner (torch) resolves the layout first
        config_mod.check_world(cfg, env.world_size, ranks_per_node=env.local_world_size)
    try:
        config_mod.check_run_dir(cfg)
    except config_mod.ConfigError as e:
        e.per_host = True  # type: ignore[attr-defined]  # as this host sees them: printed per node, as run.main does
        raise
    config_mod.check_data(cfg)


def _once_per_job(e: Exception, code: int = 2) -> CommandError:
    """An error every rank of ``hpcdist train`` has alike (config, checkpoint mismatch, non-finite step), printed
    once per job rather than by every rank: rank 0 prints it and the others exit with the same status silently.
    Problems with run.dir / checkpoint.dir depend on the host's mounts, so the first rank of every node prints
    those, naming its host."""
    from hpcdist.env import from_environ

    try:
        env = from_environ(cuda_available=False)  # rank, local rank and host only: no CUDA initialization
    except ValueError:  # a garbled launcher environment: print, as a single process would
        return CommandError(str(e), code=code)
    if env.rank == 0:
        return CommandError(str(e), code=code)
    if getattr(e, "per_host", False) and env.local_rank == 0:
        return CommandError(f"rank {env.rank} on {env.hostname}: {e}", code=code)
    return CommandError(None, code=code)  # every rank exits alike


@refusing("submit", LaunchError, SchedulerError)
def cmd_submit(args: argparse.Namespace) -> int:
    try:
        return _submit(args)
    except KeyboardInterrupt:
        raise CommandError("submit: stopped waiting; the job keeps running", code=130) from None


def _submit(args: argparse.Namespace) -> int:
    from hpcdist.config.loader import preset_shadows
    from hpcdist.launch import load_cluster
    from hpcdist.launch.submit import submit_chain

    shadows = preset_shadows(args.config)  # explicit model keys win: the job would not train the preset's shape
    if shadows:
        print(f"hpcdist: warning: {shadows}", file=sys.stderr, flush=True)
    names = ("nodes", "gpus_per_node", "time", "partition", "account", "qos", "constraint", "exclude", "job_name")
    params = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    params.update(launcher().flag_overrides(args, lambda: load_cluster(args.cluster)))
    common = dict(
        cluster=args.cluster, dry_run=args.dry_run, force=args.force, after=args.after, snapshot=args.snapshot, **params
    )
    sweep = bool(args.sweep or args.sweep_file)
    if sweep and args.chain > 1:
        raise CommandError("submit: --chain and --sweep do not combine; chain each task's run separately")
    if sweep:
        from hpcdist.launch.sweep import submit_sweep

        out: Any = submit_sweep(
            args.config,
            args.overrides,
            sweep=args.sweep,
            sweep_file=args.sweep_file,
            max_parallel=args.max_parallel,
            **common,
        )
    else:
        out = submit_chain(args.config, args.overrides, args.chain, **common)
        out = out[0] if args.dry_run else out
    if isinstance(out, str):
        print(out, end="" if out.endswith("\n") else "\n")  # the shell prompt then starts on a line of its own
        return 0
    first = out[0]
    logs = first.paths[0]
    if sweep:
        array = first.job_id.split("_")[0]
        print(
            f"submitted sweep as job array {array} ({len(out)} tasks, {first.num_tasks} ranks each)\n"
            f"  logs:   {first.folder}/{array}_<task>_<rank>_log.out|err\n"
            f"  follow: hpcdist status {array}",
            flush=True,
        )
    else:
        chained = f"; then {', '.join(h.job_id for h in out[1:])} (chained, afterany)" if len(out) > 1 else ""
        code = f"\n  code:   {first.snapshot}" if first.snapshot else ""
        # a local job is known only to its run dir's jobs.jsonl: without --run-dir, status asks SLURM and fails
        where = f" --run-dir {shlex.quote(first.run_dir)}" if first.executor == "local" and first.run_dir else ""
        print(
            f"submitted job {first.job_id} ({first.executor}, {first.num_tasks} ranks){chained}{code}\n"
            f"  logs:   {logs.stdout}\n          {logs.stderr}\n"
            f"  follow: hpcdist status {first.job_id}{where}; hpcdist logs {first.job_id}{where} --rank R",
            flush=True,
        )
    if not args.wait:
        return 0
    if not sweep:
        from hpcdist.launch.follow import follow

        # rank 0's log streams while the (first) job runs, through requeues; its end stops the stream
        print(f"--- {logs.stdout} (until the job ends; Ctrl-C stops waiting, not the job)", flush=True)
        follow(lambda: logs.stdout, first.done, sys.stdout, poll_s=2.0)
    states = [h.wait() for h in out]
    for handle, state in zip(out, states, strict=True):
        print(f"job {handle.job_id} finished: {state}")
    return 0 if all(state == "COMPLETED" for state in states) else 1


def _local_record(job: str | None, run_dir: Path | None) -> dict[str, Any] | None:
    """The run dir's record of a local-executor job (None: not local, or no --run-dir)."""
    if job is None or run_dir is None:
        return None
    from hpcdist.launch.records import find_job

    entry = find_job(job, run_dir)
    return entry if entry is not None and entry.get("executor") == "local" else None


@refusing("status", SchedulerError, UntrustedFile)  # UntrustedFile: another user's jobs.jsonl names pids and folders
def cmd_status(args: argparse.Namespace) -> int:
    from hpcdist.data.array import prepare_status
    from hpcdist.launch import records
    from hpcdist.launch.prepare_array import find_prepare
    from hpcdist.launch.sweep import sweep_status

    # a local job first: the cluster-prepare lookup below asks the scheduler, which on a machine without a
    # reachable controller waits out its timeouts (60 s in CI) before a local job's status is shown
    local = _local_record(args.job, args.run_dir)
    if local is not None:
        print(
            f"job {args.job} (local executor on {local.get('host')}, {local.get('num_tasks')} ranks): "
            f"{records.local_state(local)}\n{records.run_summary(args.run_dir)}\n"
            f"logs: {local.get('folder')}/{args.job}_<rank>_log.out|err"
        )
        return 0
    prepare_out = find_prepare(args.job, args.run_dir)
    if prepare_out is not None:  # a cluster prepare: its tasks' progress from the parts
        print(prepare_status(prepare_out))
        return 0
    table = sweep_status(args.job, args.run_dir) if args.job else None
    if table is not None:
        print(table)
        return 0
    try:
        print(launcher().status_text(args.job))
    except SchedulerError:
        if args.run_dir is None:
            raise
        # the scheduler forgot the job (or cannot answer): what the run dir knows, plain batch jobs included
        print(f"job {args.job}: {launcher().title} does not know it now; from the run dir:")
    if args.run_dir is not None:
        print(records.run_summary(args.run_dir, args.job))
    return 0


@refusing("logs", SchedulerError, UntrustedFile)
def cmd_logs(args: argparse.Namespace) -> int:
    import shutil

    try:
        if args.follow:
            return _follow_log(args)
        local = _local_record(args.job, args.run_dir)
        if local is not None:  # a local job's log folder is recorded in the run dir (it may be a log_dir)
            path = Path(local["folder"]) / f"{args.job}_{args.rank}_log.{'err' if args.err else 'out'}"
        else:
            path = launcher().log_path(args.job, rank=args.rank, err=args.err, run_dir=args.run_dir)
        with path.open(encoding="utf-8", errors="replace") as f:
            shutil.copyfileobj(f, sys.stdout)
    except (UntrustedFile, BrokenPipeError):
        raise  # UntrustedFile: its own message; a closed stdout: hpcdist.cli's
    except OSError as e:
        raise CommandError(f"logs: cannot read {e.filename}: {e.strerror}") from e
    return 0


def _follow_log(args: argparse.Namespace) -> int:
    """`logs --follow`: the log may not exist yet (the job is pending); the job's state ends the stream."""
    from hpcdist.launch.follow import follow

    launcher().check_job_id(args.job)

    def path() -> Path | None:
        try:
            return launcher().log_path(args.job, rank=args.rank, err=args.err, run_dir=args.run_dir)
        except SchedulerError:
            return None  # pending: no log yet

    def finished() -> bool:
        try:
            state = launcher().job_state(args.job)
        except SchedulerError:
            return False  # the controller is busy: ask again
        return state is None or state.split()[0].rstrip("+") in launcher().terminal_states

    try:
        follow(path, finished, sys.stdout, poll_s=2.0)
    except KeyboardInterrupt:
        return 130
    return 0


@refusing("cancel", SchedulerError, OSError)  # OSError: UntrustedFile, a record's process gone or not ours
def cmd_cancel(args: argparse.Namespace) -> int:
    from hpcdist.launch import records

    local = _local_record(args.job, args.run_dir)
    if local is not None:
        print(f"cancelled job {args.job}: {records.cancel_local(local, args.run_dir)}")
        return 0
    print(f"cancelled job {args.job}: {launcher().cancel(args.job)}")
    return 0
