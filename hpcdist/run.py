"""The one per-rank main: ``hpcdist train`` and every task of ``hpcdist submit`` run :func:`main`.

    config -> DistEnv -> the rank's facts, once (checks, parallel.strategy=auto planned, ParallelDims: plan_rank)
    -> the job environment's start (NCCL profile, restart ledger) -> process group -> Trainer(cfg, env, facts=...)
    .train() -> after-stop decision (requeue or exit) -> close

The trainer returns why it stopped and never requeues. What a stop means for the job is the scheduler's, and it is
passed in as a :class:`JobEnvironment` (hpcdist.launch.job.SlurmEnvironment for ``hpcdist train`` and submitted
tasks), the way submitit keeps requeueing in its job environment rather than in the user's function: this module
imports nothing from hpcdist.launch, so launch's task may call it without an import cycle.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import resource
import sys
from collections.abc import Sequence
from typing import Protocol

import torch
from torch.distributed.checkpoint.api import CheckpointException

from hpcdist import config as config_mod
from hpcdist.base.errors import PeerRankDied
from hpcdist.base.logging_utils import get_logger, setup_logging
from hpcdist.base.rundir import RunDir
from hpcdist.checkpoint.errors import EXIT_IO
from hpcdist.checkpoint.names import MARKER, step_dir
from hpcdist.config import JobConfig
from hpcdist.env import DistEnv, destroy_process_group, from_environ, init_process_group
from hpcdist.fault import failures, inprocess
from hpcdist.fault.goodput import InProcessRecovery
from hpcdist.fault.hang import collective_timeout_s, configure_collectives
from hpcdist.fault.rundir_lock import RunDirInUse
from hpcdist.fault.stop import StopFlag, StopReason
from hpcdist.models import Transformer
from hpcdist.parallel.parallelize import warm_up
from hpcdist.planning import layouts as planner
from hpcdist.rankfacts import RankFacts, rank_facts
from hpcdist.trainer import Trainer, TrainResult

__all__ = ["JobEnvironment", "main", "plan_rank", "process_group_env", "train"]

log = get_logger(__name__)


class JobEnvironment(Protocol):
    """The scheduler's side of one rank, around training."""

    def before_start(self, cfg: JobConfig, env: DistEnv) -> str | None:
        """Every rank, before the process group: prepare the job's environment; a reason not to train, or None."""
        ...

    def after_stop(self, cfg: JobConfig, env: DistEnv, reason: StopReason) -> int:
        """Every rank, once the stop checkpoint is complete: requeue (or not); returns the exit code."""
        ...


def _plan_layout(cfg: JobConfig, env: DistEnv) -> JobConfig:
    """``parallel.strategy=auto`` -> the planner's top layout for this world size (rank_facts' ``plan_layout``).

    Every rank plans the same layout (the planner is deterministic), so no collective is needed to agree on it."""
    cfg, reason = planner.resolve_auto(cfg, env.world_size, cfg.parallel.auto_cluster)
    log.info("parallel.strategy=auto: %s", reason)
    return cfg


def process_group_env(cfg: JobConfig, env: DistEnv) -> DistEnv:
    """``env`` with the process-group backend ``cfg`` needs.

    NCCL takes CUDA tensors only. With ``parallel.fsdp.cpu_offload`` the sharded parameters and gradients are CPU
    DTensors, so the gradient norm's all-reduce and the non-finite skip's agreement run on CPU tensors, on the
    default group and the mesh's groups alike: those need a CPU backend beside NCCL. torch's per-device backend
    string gives the default group (and every group made from it without a backend) both, as torchtitan does for
    its CPU offload; without offload NCCL alone, so no run pays for a second set of connections it never uses."""
    if env.backend == "nccl" and cfg.parallel.fsdp.cpu_offload:
        return dataclasses.replace(env, backend="cuda:nccl,cpu:gloo")
    return env


def plan_rank(cfg: JobConfig, env: DistEnv) -> RankFacts:
    """This rank's facts, checked and built once (auto resolved by the planner): what main() hands down, and what
    :func:`train` builds when called without them."""
    return rank_facts(cfg, env, plan_layout=_plan_layout)


def train(
    cfg: JobConfig,
    env: DistEnv,
    *,
    job: JobEnvironment | None = None,
    stop_flag: StopFlag | None = None,
    facts: RankFacts | None = None,
    in_process: InProcessRecovery | None = None,
    model: Transformer | None = None,
) -> TrainResult:
    """One rank's training once the process group exists (or there is one rank): Trainer -> train -> after-stop.

    ``facts``: :func:`plan_rank` of ``cfg`` and ``env``, when the caller (main) built them already; else built here.
    ``job`` decides what a stop means (requeue or exit); without one the run simply ends after its checkpoint. An
    exception is recorded in <run.dir>/failures.jsonl (who failed, where, why: the batch script's failure policy,
    hpcdist.launch.restarts, reads it) and raised again. ``model``: the Trainer's, built ahead on the meta device.
    """
    setup_logging(env.rank, level=cfg.run.log_level)
    raise_open_file_limit()
    if facts is None:
        facts = plan_rank(cfg, env)
    elif facts.env is not env:
        raise ValueError("train(cfg, env, facts=...): the facts were built for another DistEnv")
    cfg = facts.cfg  # auto resolved
    if env.device == "cpu" and env.local_world_size > 1:
        # several CPU ranks on one node would each start one thread per core and thrash
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))
    trainer = None
    try:
        trainer = Trainer(cfg, env, stop_flag=stop_flag, facts=facts, in_process=in_process, model=model)
        result = trainer.train()
        if result.save_failed is not None:
            # the last checkpoint (or the stop checkpoint a requeue relies on) is not there: never a success, never
            # a time-limit requeue that would resume from a step the log does not expect; the batch script's
            # failure policy decides, blaming no node (a full disk is no node's fault)
            _save_failed(cfg, env, result)
        elif result.stop_reason != StopReason.NONE:
            # the checkpoint is complete (train() waited for it): requeueing or exiting now loses no step
            if job is not None:
                result.exit_code = job.after_stop(cfg, env, result.stop_reason)
            else:  # no scheduler to continue the run: 128 + the signal, never 0 (a wrapper would take it for done)
                result.exit_code = result.stop_reason.exit_code(cfg.fault.requeue_signal)
                log.info(
                    "stopped (%s) after a complete checkpoint; rerun with checkpoint.resume=auto to continue",
                    result.stop_reason.name,
                )
        return result
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        if stop_flag is not None:
            stop_flag.uninstall()
        if not isinstance(e, RunDirInUse):  # that run.dir is another run's: its failure log is not ours to write
            failures.record_exception(
                cfg.run.dir, e, rank=env.rank, host=env.hostname, step=trainer.step if trainer else None
            )
        if trainer is not None:
            trainer.goodput.flush()
        # the peer's death, not this rank's error (the record's own precedence: an error's kind, else its words);
        # the CLI names the rank and host where it is not rank 0 (hpcdist.launch.commands)
        if (getattr(e, "failure_kind", None) or failures.classify_exception(e)) == "collective":
            step = f" after step {trainer.step}" if trainer is not None else " during start-up"
            raise PeerRankDied(
                f"a peer rank died or stopped answering{step} "
                f"({' '.join(str(e).split())[:200]}); this rank is fine: the attempt failed and a restart resumes "
                f"from the last checkpoint (the dead rank's log, or {RunDir(cfg.run.dir).failures}, says which)"
            ) from e
        raise


def raise_open_file_limit() -> tuple[int, int]:
    """Raise this process's soft limit of open files (RLIMIT_NOFILE) to its hard limit; returns (before, after).

    A job inherits the login shell's soft limit, often 1024, and a rank holds many descriptors at once: its
    dataset's memory-mapped shards, sockets to every peer of its process groups, the shared memory its checkpoint
    process maps, the checkpoint's files while they are written. The hard limit is what the site allows; going up
    to it needs no privilege."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:  # a container may refuse: the soft limit stays, said once
            log.warning("could not raise the open-file limit (ulimit -n %d, hard %d): %s", soft, hard, e)
            return soft, soft
        log.info("open-file limit raised to the hard limit: ulimit -n %d -> %d", soft, target)
        return soft, target
    return soft, soft


def _save_failed(cfg: JobConfig, env: DistEnv, result: TrainResult) -> None:
    """Every rank: the final or stop checkpoint failed (every rank knows: the save's agreement). Exit EXIT_IO;
    rank 0 says where the next run resumes and records it for the restart policy."""
    result.exit_code = EXIT_IO
    if not env.is_main:
        return
    resume = result.resume_point or "none: the next run starts from step 0"
    cause = (
        f"the checkpoint at step {result.save_failed} failed (see the errors above; disk full?): the resume point "
        f"is {resume}"
    )
    log.error("%s; free space in %s and run again to continue from there", cause, cfg.checkpoint_dir)
    try:
        failures.record(
            cfg.run.dir, kind="checkpoint", cause=cause, rank=env.rank, host=env.hostname, step=result.save_failed
        )
    except OSError as e:  # the same full disk, most likely
        log.error("could not record the failure in %s: %s", cfg.run.dir, e)


def _train_recovering(
    cfg: JobConfig,
    env: DistEnv,
    rdv: inprocess.Rendezvous,
    *,
    job: JobEnvironment | None,
    stop_flag: StopFlag,
    facts: RankFacts,
    timeout_s: float,
) -> TrainResult:
    """:func:`train` under in-process recovery (hpcdist.fault.inprocess): a peer's death rebuilds the group in
    this process and trains on from the node-local snapshot; a warm spare's facts are its adopted rank's, and what
    it can build before it has a rank (its model on meta, the strategy's libraries) is built while it waits."""
    ahead = [warm_up(cfg, facts.dims)] if rdv.spare else []

    def once(env_now: DistEnv, recovered: InProcessRecovery | None) -> TrainResult:
        if env_now is not facts.env:  # a spare that took a rank: its supervisor records deaths as that rank's
            failures.announce_task(cfg.run.dir, rank=env_now.rank, host=env_now.hostname, job=env_now.job)
        result = train(
            cfg,
            env_now,
            job=job,
            stop_flag=stop_flag,
            facts=facts if env_now is facts.env else plan_rank(cfg, env_now),
            in_process=recovered,
            model=ahead.pop() if ahead else None,
        )
        result.rank = env_now.rank
        return result

    f = cfg.fault
    return inprocess.train_in_process(
        rdv,
        env,
        once,
        settle_s=f.regroup_settle_s,
        timeout_s=f.regroup_timeout_s,
        collective_timeout_s=timeout_s,
        max_recoveries=f.max_failures,
        rejoin=stop_flag.rejoin,
        exit_code=lambda result: result.exit_code,
    )


def main(
    config_path: str | os.PathLike[str], overrides: Sequence[str] = (), *, job: JobEnvironment | None = None
) -> TrainResult:
    """What ``hpcdist train`` runs in one process (rank); also the body of every task of ``hpcdist submit``.

    Configuration errors raise ConfigError before any process group exists (the CLI prints them once per job)."""
    # What the imports made (torch's, sympy's, DeepSpeed's objects: ~10^6) lives until the process ends: frozen, the
    # collector stops walking it in every full collection and at exit, where that walk took 0.4-0.8 s of CPU per
    # rank (measured on 2 cores). Nothing is skipped: objects made from here on are collected as before, and the
    # frozen ones are torn down with the interpreter as before.
    gc.freeze()
    cfg = config_mod.load(config_path, overrides)
    env = process_group_env(cfg, from_environ())
    rdv = inprocess.Rendezvous.from_environ(os.environ)  # a malformed one refuses before any group exists
    if rdv is not None and rdv.spare:  # checked against the layout it will join, as its last rank until it has one
        world = rdv.world_size or env.world_size
        env = inprocess.adopt(env, world - 1, world)
    setup_logging(env.rank, level=cfg.run.log_level)
    # the job's size, the prepared data and auto, checked and resolved once, before any process group; handed down
    facts = plan_rank(cfg, env)
    cfg = facts.cfg
    try:
        config_mod.check_run_dir(cfg)  # every rank: one failing alone would leave the others at the rendezvous
    except config_mod.ConfigError as e:
        e.per_host = True  # type: ignore[attr-defined]  # as this host sees them: the CLI prints it per node
        raise
    # the scheduler's part (NCCL profile, restart ledger) before the process group: NCCL and gloo read the
    # environment at init
    refused = job.before_start(cfg, env) if job is not None else None
    if refused:
        print(f"hpcdist: {refused}", file=sys.stderr, flush=True)
        return TrainResult(step=0, exit_code=3)
    # tell this rank's supervisor who it is; make a failed NCCL collective end the process (fault.*)
    if rdv is None or not rdv.spare:  # a spare is no rank until it takes one
        failures.announce_task(cfg.run.dir, rank=env.rank, host=env.hostname, job=env.job)
    for warning in configure_collectives(os.environ, cfg.run.dir):
        log.warning("%s", warning)
    # from here on a signal is remembered, not fatal: start-up (process group, data, model, resume) can take
    # minutes, and USR2's default action would kill the rank and have the node blamed for it
    stop_flag = StopFlag(
        rank=env.rank, device=env.torch_device(), requeue_signal=cfg.fault.requeue_signal, job=env.job
    ).install()
    # collectives time out a minute after the hang watchdog, which reports first (with stacks and suspects)
    timeout_s = collective_timeout_s(cfg.fault.watchdog_timeout_s, cfg.fault.watchdog_slow_phase_s)
    try:
        if rdv is None:
            init_process_group(env, timeout_s=timeout_s)
            try:
                result = train(cfg, env, job=job, stop_flag=stop_flag, facts=facts)
                result.rank = env.rank
            finally:
                destroy_process_group()
        else:
            result = _train_recovering(cfg, env, rdv, job=job, stop_flag=stop_flag, facts=facts, timeout_s=timeout_s)
    except inprocess.SpareNotNeeded as e:
        print(f"warm spare on {env.hostname}: {e}", flush=True)
        return TrainResult(step=0)
    finally:
        stop_flag.uninstall()
    if env.is_main and result.save_failed is not None:
        print(
            f"hpcdist: step {result.step} of {cfg.train.steps} trained, but its checkpoint FAILED (see the errors "
            f"above): the resume point is {result.resume_point or 'none (step 0)'}; free space in "
            f"{cfg.checkpoint_dir} and run the same command again (exit {EXIT_IO})",
            file=sys.stderr,
            flush=True,
        )
    elif env.is_main and result.already_finished:
        print(
            f"already finished at step {result.step} (train.steps={cfg.train.steps}); "
            f"train.steps={2 * result.step} to continue, or run.dir=DIR to start another run"
        )
    elif env.is_main and result.stop_reason != StopReason.NONE and result.step < cfg.train.steps:
        ckpt = step_dir(cfg.checkpoint_dir, result.step)
        saved = "complete" if (ckpt / MARKER).is_file() else "NOT saved (see the errors above)"
        print(
            f"stopped early by {result.stop_reason.signal_name}: step {result.step} of {cfg.train.steps}, "
            f"checkpoint {ckpt} {saved}; run the same command again to continue"
        )
    elif env.is_main and result.losses:
        first, last = min(result.losses), max(result.losses)
        print(
            f"done: step {result.step}, loss {result.losses[first]:.4f} (step {first}) -> "
            f"{result.losses[last]:.4f} (step {last}); run dir {cfg.run.dir}"
        )
    return result
