"""The training loop's one checkpoint collaborator: the shared tier (:class:`CheckpointManager`) and the optional
node-local tier (:class:`LocalTier`) behind three per-step asks, the two-tier resume, and the end of training.

The loop asks three things each step: :meth:`Checkpointer.requests` (rank 0's timed save requests, sent through the
per-step stop agreement so every rank saves after the same step), :meth:`Checkpointer.fence` (before the optimizer
step: an async save's copy of the state is done) and :meth:`Checkpointer.after_step` (save the shared tier, the
local tier or nothing, then make the async save's staging buffers). ``train()`` calls :meth:`Checkpointer.start`
and :meth:`Checkpointer.finish` around the loop; ``__init__`` calls :meth:`Checkpointer.resume`. The cadence itself
stays the manager's (:class:`hpcdist.checkpoint.policy.SavePolicy`); this class holds the counters it reads and the
order the tiers are asked in.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from hpcdist import agree
from hpcdist.base.logging_utils import get_logger
from hpcdist.base.rundir import RunDir
from hpcdist.checkpoint.cadence import failure_facts
from hpcdist.checkpoint.errors import CheckpointMismatch
from hpcdist.checkpoint.local.layout import expand_dir, open_local_dir, run_key
from hpcdist.checkpoint.local.tier import LocalTier
from hpcdist.checkpoint.manager import CheckpointManager
from hpcdist.checkpoint.names import latest, step_of
from hpcdist.checkpoint.staging import check_staging_fits
from hpcdist.checkpoint.state import STATE_FILE, Checkpointable
from hpcdist.config.loader import ConfigError
from hpcdist.fault.hang import collective_timeout_s
from hpcdist.models.hf_config import is_hf_dir

if TYPE_CHECKING:
    import torch

    from hpcdist.config import JobConfig
    from hpcdist.env import DistEnv
    from hpcdist.fault.goodput import Goodput
    from hpcdist.fault.hang import HangWatchdog
    from hpcdist.fault.nonfinite import NonFiniteGuard

log = get_logger(__name__)

# the watchdog phase of the wait for the node-local tier's background peer copy (at the next local save, at the end)
LOCAL_COPY_PHASE = "node-local checkpoint: the last peer copy (background gloo send/recv)"


class SaveRequests(NamedTuple):
    """Rank 0's clocks asking for a save (checkpoint.every_minutes, checkpoint.local.every_minutes): sent through
    the stop agreement, so every rank reads them one step later and saves after the same step."""

    save: bool
    local_save: bool


class FinalSave(NamedTuple):
    """The end of training: ``save_failed`` the step whose final or stop checkpoint failed (None: complete, or none
    was due), ``resume_point`` the newest complete checkpoint then (None: the next run starts from step 0)."""

    save_failed: int | None
    resume_point: str | None


class Checkpointer:
    """Both tiers of one rank, and what a save needs besides them: the state, the step, the NaN guard (a non-finite
    model is never saved), the watchdog's phases and the goodput account. Every method is collective."""

    def __init__(
        self,
        cfg: JobConfig,
        manager: CheckpointManager,
        local: LocalTier | None,
        *,
        state: Checkpointable,
        step: Callable[[], int],
        params_finite: Callable[[], bool],
        watchdog: HangWatchdog,
        goodput: Goodput,
        nonfinite: NonFiniteGuard,
    ):
        """``step``: the trainer's step as a load leaves it; ``params_finite``: Strategy.params_finite."""
        self.cfg, self.manager, self.local = cfg, manager, local
        self.state, self._step, self._params_finite = state, step, params_finite
        self.watchdog, self.goodput, self.nonfinite = watchdog, goodput, nonfinite

    @classmethod
    def build(
        cls,
        cfg: JobConfig,
        env: DistEnv,
        *,
        hosts: Sequence[str],
        state: Checkpointable,
        step: Callable[[], int],
        model: torch.nn.Module,
        params_finite: Callable[[], bool],
        watchdog: HangWatchdog,
        goodput: Goodput,
        nonfinite: NonFiniteGuard,
    ) -> Checkpointer:
        """The run's checkpoint side from its config: the manager, the node-local tier when checkpoint.local.dir
        is set (its directory checked on every rank), and, for async saves, the start-up check that this node's
        staging buffers fit (allocated after the first step: refused now, not with an OOM kill hours into the run).
        ``model``: the strategy's module (the staging estimate)."""
        c = cfg.checkpoint
        manager = CheckpointManager(
            cfg.checkpoint_dir,
            rank=env.rank,
            world_size=env.world_size,
            keep_last=c.keep_last,
            async_save=c.async_save,
            verify=c.verify,
            trusted_owners=c.trusted_owners,
            write_threads=c.write_threads or auto_write_threads(env.local_world_size),
            every_steps=c.every_steps,
            every_minutes=c.every_minutes,
            save_final=c.save_final,
            total_steps=cfg.train.steps,
            # no tier, no local cadence: local_save_due is then always False
            local_every_steps=c.local.every_steps if c.local.dir else 0,
            local_every_minutes=c.local.every_minutes if c.local.dir else 0.0,
        )
        if c.every_minutes == "auto":  # the goodput model's interval: the job's failure rate
            manager.expect_failures(**failure_facts(cfg, env.num_nodes))
        local = _local_tier(cfg, env, hosts)
        if c.async_save:
            check_staging_fits(model, env.local_world_size)
        return cls(
            cfg,
            manager,
            local,
            state=state,
            step=step,
            params_finite=params_finite,
            watchdog=watchdog,
            goodput=goodput,
            nonfinite=nonfinite,
        )

    # ------------------------------------------------------------------------------------------ the loop's asks
    def requests(self, step: int) -> SaveRequests:
        """Ask 1, before the step's stop agreement: whether rank 0's clocks ask for a save of either tier."""
        return SaveRequests(self.manager.timed_save_due(step), self.manager.timed_local_save_due(step))

    def fence(self) -> float:
        """Ask 2, before the optimizer step (the first thing that changes the state an async save's copy or a
        node-local snapshot's copy reads): seconds waited for those copies (0: none in flight)."""
        waited = self.manager.staging_fence()
        if self.local is not None:  # the node-local snapshot's copy, the same way; a snapshot of every step is
            # complete before the next update, so a failure at any moment finds the step before it on every node
            waited += self.local.staging_fence(whole=self.manager.local_every_steps == 1)
        return waited

    def after_step(self, step: int, *, last_step: bool, stop: bool, timed: bool, local_timed: bool) -> bool:
        """Ask 3, after the step's stop agreement: save the shared tier (every N steps, the agreed timed request,
        the loop's last step, a stop; with ``checkpoint.local.every_steps: 1`` the node-local tier too), else the
        node-local tier at its own cadence, else nothing; then, unless the
        loop stops here, the async save's staging buffers start being made beside the next steps (once: the
        optimizer state exists after this process's first step). ``timed`` /
        ``local_timed``: the requests every rank agreed on (StopFlag.save_requested / local_save_requested).
        True when a save of either tier ran and succeeded (an async save's failure shows at ``finish``)."""
        if self.manager.should_save(step, last_step=last_step, stop_requested=stop, timed=timed):
            saved = self.save(step)
            if self.local is not None and self.manager.local_every_steps == 1:
                # a snapshot of every step: then a recovery (in-process, or onto a spare) never has to read the
                # shared tier, whose step would otherwise be the newest at a shared save's step
                saved = self.local_save(step) and saved
        elif self.manager.local_save_due(step, timed=local_timed):
            saved = self.local_save(step)
        else:
            saved = False
        if not stop:
            self.manager.prepare_staging(self.state.dcp_state)
        return saved

    # ------------------------------------------------------------------------------------------ saves
    def save(self, step: int) -> bool:
        """Save the shared tier at ``step``; False when it failed with a storage error (every rank alike; training
        may go on, the previous checkpoint stays the resume point). An async save's failure shows at ``finish``."""
        # a NaN model is never saved, so pruning never trades a finite checkpoint for it
        self.nonfinite.check()
        self.nonfinite.check_params(step, self._params_finite())
        t0 = time.perf_counter()
        with self.watchdog.phase(step, "checkpoint save", slow=True):
            path = self.manager.save(step, self.state)
        self.nonfinite.last_checkpoint = str(path) if path else self.nonfinite.last_checkpoint
        self.goodput.add("checkpoint_save", time.perf_counter() - t0, tier="shared")
        self.goodput.flush(saved=step if path is not None else None)
        return path is not None

    def local_save(self, step: int) -> bool:
        """Snapshot the node-local tier at ``step`` (LocalTier.save): waits for the previous snapshot's write and
        peer copy to end; this one's copy into host memory overlaps the next forward and backward (``fence``), its
        files and peer copy are written in the background. A failure is logged there; training goes on."""
        assert self.local is not None
        self.nonfinite.check()
        self.nonfinite.check_params(step, self._params_finite())
        self.manager.local_saved_step = step
        t0 = time.perf_counter()
        with self.watchdog.phase(step, LOCAL_COPY_PHASE, slow=True):
            self.local.wait()  # a hung copy is this phase's hang (the copy's collective timeout: the backstop)
        with self.watchdog.phase(step, "node-local snapshot (its copy starts)", slow=True):
            ok = self.local.save(step, self.state)
        self.goodput.add("checkpoint_save", time.perf_counter() - t0, tier="local")
        return ok

    # ------------------------------------------------------------------------------------------ around the loop
    def start(self) -> None:
        """The loop starts: checkpoint.every_minutes (both tiers) counts from here."""
        self.manager.restart_clock()

    def finish(self, step: int) -> FinalSave:
        """After the loop: the final save when none ran at ``step`` (train(until=0), resumed at the end), then every
        save of either tier complete (the caller may requeue at once). A failed final or stop checkpoint is the
        run's failure: its step and the resume point left are returned."""
        if self.manager.should_save(step, last_step=True):
            self.save(step)
        self.nonfinite.check()  # also when no final save follows
        with self.watchdog.phase(step, "checkpoint completion", slow=True):
            saved = self.manager.wait() and self.manager.last_ok
        outcome = FinalSave(None, None)
        if self.manager.final_save_due(step) and not saved:  # this step's checkpoint was the result / resume point
            resume = latest(self.manager.root, warn=False)
            outcome = FinalSave(step, str(resume) if resume else None)
            self.nonfinite.last_checkpoint = outcome.resume_point
        if self.local is not None:  # the last local save's peer copy is complete (or failed)
            with self.watchdog.phase(step, LOCAL_COPY_PHASE, slow=True):
                self.local.wait()
        return outcome

    def abort(self) -> None:
        """Training raised: the peers' copy threads run on (their loops wait elsewhere), so the wait is bounded."""
        if self.local is not None:
            self.local.close()

    # ------------------------------------------------------------------------------------------ resume
    def resume(self, *, import_hf: Callable[[str], None]) -> str | None:
        """Collective: checkpoint.resume across both tiers (the newest intact step of either), else
        checkpoint.init_from's weights (``import_hf`` loads a Hugging Face directory), else a fresh start; the
        path resumed from, or None. A checkpoint of another config raises CheckpointMismatch naming what changed."""
        t0 = time.perf_counter()
        resume = self.cfg.checkpoint.resume
        try:
            path = self._resume_local()
            if path is None:
                newest = latest(self.manager.root, warn=False)
                path = self.manager.restore(resume, self.state)
                if path is not None and self.local is not None and newest and self._step() < step_of(newest):
                    # newer shared checkpoints were damaged: a local step between them and this one is newer
                    path = self._resume_local(newer_than=self._step()) or path
                    if self.local.load_failed:  # that load left part of its state: the shared one again, whole
                        path = self.manager.restore(resume, self.state)
        except CheckpointMismatch as e:
            changes = config_changes(e.path, self.cfg)
            if not changes and e.what == "data":
                changes = (
                    f"; no data.* setting changed, so the prepared data in {self.cfg.data.path} did (prepared again?)"
                )
            raise CheckpointMismatch(f"{e}{changes}", path=e.path, what=e.what) from None
        if resume == "none":
            log.info("starting fresh (checkpoint.resume=none)")
        if path is None:
            init = self.cfg.checkpoint.init_from
            if init and is_hf_dir(init):  # a Hugging Face Llama directory (config.json + safetensors)
                import_hf(init)
                log.info("starting fresh from the Hugging Face weights of %s", init)
            elif init:  # only while the run has no checkpoint of its own: a requeue resumes its own progress
                diff = self.manager.init_weights(Path(init), self.state)
                log.info("starting fresh from the weights of %s (%s)", init, _describe_diff(diff))
            elif resume != "none":
                log.info("starting fresh (no complete checkpoint in %s)", self.cfg.checkpoint_dir)
            self._discard_newer_local_steps()
            return None
        self._discard_newer_local_steps()
        seconds = time.perf_counter() - t0
        self.goodput.add("restore", seconds)
        self.nonfinite.last_checkpoint = str(path)
        log.info("resumed from %s at step %d (%.2fs)", path, self._step(), seconds)
        return str(path)

    def _resume_local(self, newer_than: int | None = None) -> Path | None:
        """Collective: checkpoint.resume=auto with the node-local tier: its newest step intact on every rank
        (counting peer copies) when it is at least as new as the newest shared checkpoint, or newer than
        ``newer_than`` (the step the shared tier resumed once its newer checkpoints proved damaged); None: the
        shared tier."""
        if self.local is None or self.cfg.checkpoint.resume != "auto":
            return None
        shared = latest(self.manager.root, warn=False)
        floor = newer_than + 1 if newer_than is not None else step_of(shared) if shared else None
        path = self.local.restore(self.state, floor)
        if path is not None:  # neither tier saves this step again
            self.manager.saved_step = self.manager.local_saved_step = self._step()
        return path

    def _discard_newer_local_steps(self) -> None:
        """After any resume (either tier, or a fresh start): the node-local steps newer than the resumed one belong
        to the line the run turned back from (an incomplete set, or older than a newer shared checkpoint): dropped,
        so a later resume never mixes them with the new line's files of the same step."""
        if self.local is not None and not self.local.foreign:
            self.local.discard_newer(self._step())


def _local_tier(cfg: JobConfig, env: DistEnv, hosts: Sequence[str]) -> LocalTier | None:
    """checkpoint.local's directory on this node, checked on every rank; one ConfigError on every rank alike when
    any node's cannot be used (another user's, a link, a shared file system)."""
    loc = cfg.checkpoint.local
    if not loc.dir:
        return None
    run_dir = Path(cfg.run.dir)
    root = expand_dir(loc.dir, host=env.hostname, job_id=env.job.job_id)
    problems: list[str] = []
    try:  # this run's own subdirectory: another run sharing the directory never touches its steps
        root = open_local_dir(open_local_dir(root) / run_key(run_dir))
    except ConfigError as e:
        problems = [f"{p} (on {env.hostname})" for p in e.problems]
    every = agree.gather(problems, agree.world_group(), env.world_size)
    first = next((p for p in every if p), None)
    if first:
        raise ConfigError(first)
    return LocalTier(
        root,
        rank=env.rank,
        world_size=env.world_size,
        hosts=hosts,
        keep=loc.keep,
        record=RunDir(run_dir).local_checkpoints if env.is_main else None,
        template=loc.dir,
        shared_dir=str(cfg.checkpoint_dir),
        # the background peer copy's collectives end where the job's do (a dead peer ends the copy, not the run)
        timeout_s=collective_timeout_s(cfg.fault.watchdog_timeout_s, cfg.fault.watchdog_slow_phase_s),
    )


def auto_write_threads(local_world_size: int) -> int:
    """checkpoint.write_threads=0: the cores this rank may use, shared with the node's other ranks when they are
    not bound to their own (torchrun without binding: every rank sees every core), at most 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cores >= (os.cpu_count() or cores):  # unbound: the node's cores are everyone's
        cores //= max(1, local_world_size)
    return max(1, min(8, cores))


def config_changes(path: Path | None, cfg: JobConfig) -> str:
    """'; the checkpoint was saved with model.n_layers=4 (now 2), ...' from the config stored in its trainer state."""
    try:
        saved = json.loads((path / STATE_FILE).read_text())["config"] if path else None
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    if not isinstance(saved, dict):
        return ""
    now = dataclasses.asdict(cfg)
    keys = [(section, k) for section in ("model", "parallel", "data") for k in sorted(saved.get(section) or {})]
    keys.append(("run", "seed"))  # the sample order's seed
    changed = [
        f"{section}.{k}={saved[section][k]!r} (now {now[section].get(k)!r})"
        for section, k in keys
        if isinstance(saved.get(section), dict) and k in saved[section] and now[section].get(k) != saved[section][k]
    ]
    return f"; it was saved with {', '.join(changed)}" if changed else ""


def _describe_diff(diff: dict[str, list[str]]) -> str:
    kinds = (
        ("missing", "not in it, kept their initialization"),
        ("unexpected", "in it, not in this model, ignored"),
        ("shape", "of another shape, kept their initialization"),
    )
    parts = [
        f"{len(diff[k])} {what}: {', '.join(diff[k][:4])}{' ...' if len(diff[k]) > 4 else ''}"
        for k, what in kinds
        if diff[k]
    ]
    return "; ".join(parts) if parts else "every weight matched"
