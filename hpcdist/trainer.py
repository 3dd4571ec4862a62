"""The trainer core every task runs: ``Trainer(cfg, env).train()``.

``__init__`` builds everything (data, model on the meta device, strategy, optimizer, checkpoints, metrics) and
resumes; ``train()`` is the loop and holds no strategy branches. It returns why it stopped and knows no scheduler:
what follows a stop (requeue or exit) is decided by its caller, hpcdist.run, which also resolves
``parallel.strategy=auto`` before building a Trainer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hpcdist import config as config_mod
from hpcdist.checkpoint.cadence import failure_facts
from hpcdist.checkpoint.errors import CheckpointMismatch
from hpcdist.checkpoint.local.layout import expand_dir, open_local_dir, run_key
from hpcdist.checkpoint.local.tier import EXIT_WAIT_S, LocalTier
from hpcdist.checkpoint.manager import CheckpointManager
from hpcdist.checkpoint.names import latest, step_of
from hpcdist.checkpoint.staging import check_staging_memory, staging_estimate
from hpcdist.checkpoint.state import STATE_FILE, Checkpointable
from hpcdist.config import JobConfig
from hpcdist.config.loader import ConfigError
from hpcdist.config.vocab import data_eos
from hpcdist.data import BatchLoader, PrefetchLoader, make_sampler
from hpcdist.data.build import build_datasets
from hpcdist.data.sampler import SamplerMismatch
from hpcdist.data.shards import EOS_PROBE_TOKENS, SampleDataset, eos_count
from hpcdist.env import DistEnv
from hpcdist.evaluate import Evaluator
from hpcdist.fault.goodput import Goodput
from hpcdist.fault.hang import HangWatchdog, collective_timeout_s
from hpcdist.fault.nonfinite import NonFiniteError, NonFiniteGuard
from hpcdist.fault.rundir_lock import RunDirInUse, RunDirLock
from hpcdist.fault.stop import StopFlag, StopReason
from hpcdist.fault.triage import HardwareFault, ModelDiverged, SkippedSamples, Triage
from hpcdist.logging_utils import get_logger, setup_logging
from hpcdist.metrics.observer import Observer, StepRecord
from hpcdist.models import build_model, flops_per_token, num_params
from hpcdist.models.hf_config import is_hf_dir
from hpcdist.models.hf_directory import available_memory
from hpcdist.optim import optim_hparams, set_optim_hparams
from hpcdist.parallel.dims import describe_layout
from hpcdist.parallel.parallelize import build_strategy
from hpcdist.rankfacts import RankFacts, rank_facts
from hpcdist.rundir import RunDir

log = get_logger(__name__)

# the watchdog phase of the wait for the node-local tier's background peer copy (at the next local save, at the end)
LOCAL_COPY_PHASE = "node-local checkpoint: the last peer copy (background gloo send/recv)"


@dataclass
class TrainResult:
    step: int
    losses: dict[int, float] = field(default_factory=dict)
    """Global mean loss of each logged step (every step when logging.every_steps=1)."""
    resumed_from: str | None = None
    eval_losses: dict[int, float] = field(default_factory=dict)
    stop_reason: StopReason = StopReason.NONE
    """Why training stopped before train.steps (a signal), NONE when it finished."""
    exit_code: int = 0
    """The process's exit status: set by hpcdist.run's after-stop decision (the trainer leaves it 0)."""
    save_failed: int | None = None
    """The step whose final or stop checkpoint failed (disk full, every rank alike); None when it is complete or
    none was due. hpcdist.run then exits non-zero instead of reporting success or requeueing."""
    resume_point: str | None = None
    """The newest complete checkpoint when ``save_failed``: where the next run resumes (None: from step 0)."""
    already_finished: bool = False
    """Resumed at train.steps or beyond: nothing trained, nothing recorded (a rerun of a finished run)."""

    def record(self, step: int, loss: float | None, eval_loss: float | None) -> None:
        """A step's logged loss and evaluation loss, where it had them."""
        if loss is not None:
            self.losses[step] = loss
        if eval_loss is not None:
            self.eval_losses[step] = eval_loss


class Trainer:
    def __init__(
        self, cfg: JobConfig, env: DistEnv, *, stop_flag: StopFlag | None = None, facts: RankFacts | None = None
    ):
        """``stop_flag``: one already installed by the caller (hpcdist.run installs it before the start-up, so a
        signal during data preparation, model build or resume is remembered); else one is made here.

        ``facts``: this rank's checked config and layout, built once by the caller (hpcdist.run, before the process
        group) from this ``cfg`` and ``env``; a Trainer built directly (the Python API) builds them here with the
        same function, :func:`hpcdist.rankfacts.rank_facts`, which refuses ``parallel.strategy=auto`` (the planner
        runs in hpcdist.run; the trainer imports none): a Trainer builds exactly the layout it is given."""
        setup_logging(env.rank, level=cfg.run.log_level)
        if facts is None:
            facts = rank_facts(cfg, env)
        elif facts.cfg is not cfg or facts.env is not env:
            raise ValueError("Trainer(cfg, env, facts=...): the facts were built from another config or DistEnv")
        self.cfg, self.env = cfg, env
        # the rank's one ParallelDims: the data loader's coordinate, the strategy, the layout line
        self.dims = facts.dims
        self.dp_rank = self.dims.dp_rank(env.rank)
        self.run_dir = Path(cfg.run.dir)
        if env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.run_lock = RunDirLock(self.run_dir, job_id=env.job.job_id)
        self._lock_run_dir()  # before anything is written there: a second run is refused, not interleaved
        self._record_layout()
        self.step, self.tokens_seen = 0, 0

        train_ds, self.val_ds = build_datasets(cfg, is_main=env.is_main)
        self.sampler = make_sampler(train_ds, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
        self.train_ds = train_ds
        # samples an earlier attempt's NaN triage found bad (train.nonfinite=skip): skipped again, the same way
        self.skipped_samples = SkippedSamples(self.run_dir)
        try:
            if cfg.checkpoint.resume == "none":  # a new line of training: the old line's list goes aside, as its
                self.skipped_samples.set_aside(is_main=env.is_main)  # checkpoints do at the resume
            self.skipped = self.skipped_samples.load(len(train_ds))
            self.sampler.skip(set(self.skipped))
        except ValueError as e:
            self.run_lock.release()
            raise ConfigError([f"train.nonfinite: {e}"]) from None
        if self.skipped:
            log.info("skipping %d sample(s) listed in %s", len(self.skipped), self.skipped_samples.path)
        loader = BatchLoader(
            train_ds,
            self.sampler,
            global_batch_size=cfg.train.global_batch_size,
            dp_rank=self.dp_rank,
            dp_size=self.dims.dp,
        )
        # the next batches are built while this step computes (pinned on a GPU: the strategy's copy is non-blocking)
        self.loader: BatchLoader | PrefetchLoader = (
            PrefetchLoader(loader, depth=cfg.data.prefetch, device=env.torch_device()) if cfg.data.prefetch else loader
        )

        args = cfg.model_args()
        model = build_model(args, device="meta")
        if cfg.data.document_mask:  # before parallelize: every stage copy and wrapper carries it
            model.document_eos = self.document_eos(cfg, train_ds)
        self.strategy = build_strategy(cfg, env, model, self.dims)
        self.tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
        self.flops_per_token = flops_per_token(args, cfg.data.seq_len)
        self.ckpt = CheckpointManager(
            cfg.checkpoint_dir,
            rank=env.rank,
            world_size=env.world_size,
            keep_last=cfg.checkpoint.keep_last,
            async_save=cfg.checkpoint.async_save,
            verify=cfg.checkpoint.verify,
            trusted_owners=cfg.checkpoint.trusted_owners,
            write_threads=cfg.checkpoint.write_threads or _auto_write_threads(env.local_world_size),
            every_steps=cfg.checkpoint.every_steps,
            every_minutes=cfg.checkpoint.every_minutes,
            save_final=cfg.checkpoint.save_final,
            total_steps=cfg.train.steps,
            # no tier, no local cadence: local_save_due is then always False
            local_every_steps=cfg.checkpoint.local.every_steps if cfg.checkpoint.local.dir else 0,
            local_every_minutes=cfg.checkpoint.local.every_minutes if cfg.checkpoint.local.dir else 0.0,
        )
        if cfg.checkpoint.every_minutes == "auto":  # the goodput model's interval: the job's failure rate
            self.ckpt.expect_failures(**failure_facts(cfg, env.num_nodes))
        self.local = self._local_tier()  # the node-local tier with peer copies (checkpoint.local), or None
        if cfg.checkpoint.async_save:  # the staging buffers are allocated after the first step: refuse now if they
            # cannot fit, not with an OOM kill hours into the run
            shm = Path("/dev/shm")
            check_staging_memory(
                staging_estimate(self.strategy.model),
                env.local_world_size,
                available_memory(),
                shutil.disk_usage(shm).free if shm.is_dir() else None,
            )
        self.evaluator = Evaluator(
            self.val_ds,
            every_steps=cfg.train.eval_every_steps,
            batches=cfg.train.eval_batches,
            global_batch_size=cfg.train.global_batch_size,
            seed=cfg.run.seed,
            dp_rank=self.dp_rank,
            dp_size=self.dims.dp,
        )
        log.info(
            "model %s params (%.1fM), %s on %d rank(s), grad accum %d, %.3g FLOPs/token",
            f"{num_params(args):,}",
            num_params(args) / 1e6,
            cfg.parallel.strategy,
            env.world_size,
            self.strategy.grad_accum,
            self.flops_per_token,
        )
        log.info("layout: %s", describe_layout(cfg, self.dims))
        # rank 0 accounts the run's wall time (training, checkpoints, restarts) across attempts in goodput.json
        self.goodput = Goodput(
            self.run_dir, enabled=env.is_main, restart=env.job.restart_count if env.job.job_id else None
        )
        try:
            self.resumed_from = self._resume()
        except BaseException:
            self.run_lock.release()  # a refused resume (another model) is not a run: the directory is free again
            raise
        if env.is_main:  # after the resume was accepted: a refused one leaves the saved run's config.yaml as it was
            config_mod.save(cfg, RunDir(self.run_dir).config)
        f = cfg.fault
        self.stop_flag = stop_flag or StopFlag(
            rank=env.rank, device=env.torch_device(), requeue_signal=f.requeue_signal, job=env.job
        )
        self.watchdog = HangWatchdog(
            rank=env.rank,
            world_size=env.world_size,
            host=env.hostname,
            run_dir=self.run_dir,
            timeout_s=f.watchdog_timeout_s,
            slow_phase_s=f.watchdog_slow_phase_s,
            on_fire=self.goodput.flush,
        )
        self.triage = (
            Triage(
                strategy=self.strategy,
                rank=env.rank,
                world_size=env.world_size,
                dp_rank=self.dp_rank,
                global_batch_size=cfg.train.global_batch_size,
                hosts=self.hosts,
                device=env.torch_device(),
                run_dir=self.run_dir,
            )
            if cfg.train.nonfinite_triage
            else None
        )
        self.nonfinite = NonFiniteGuard(
            mode=cfg.train.nonfinite,
            max_skips=cfg.train.max_nonfinite_skips,
            device=env.torch_device(),
            last_checkpoint=self.resumed_from,
        )
        # the loop's one observability collaborator: log line, sinks, Prometheus, profiler, evaluation, stragglers,
        # goodput and the run summary
        self.observer = Observer(
            cfg,
            env,
            strategy=self.strategy,
            evaluator=self.evaluator,
            goodput=self.goodput,
            watchdog=self.watchdog,
            nonfinite=self.nonfinite,
            hosts=self.hosts,
            flops_per_token=self.flops_per_token,
            resumed_step=self.step if self.resumed_from else None,
            restarts=env.job.restart_count,
        )

    @staticmethod
    def document_eos(cfg: JobConfig, train_ds: SampleDataset) -> int:
        """The id data.document_mask splits samples at; a warning when the first samples never hold it (a mask that
        splits nothing: the wrong eos_id in meta.json, or data prepared without document ends)."""
        eos, why = data_eos(cfg)
        if eos is None:  # check_data refused it already at start-up; a Trainer given other data meets it here
            raise ConfigError([f"data.document_mask: {why}: documents are found by their EOS; set it false"])
        log.info("data: document mask on: attention and RoPE positions restart after each EOS (id %d)", eos)
        if not eos_count(train_ds, eos):
            log.warning(
                "data.document_mask: the first %s tokens of the data never hold the EOS id %d, so each sample "
                "trains as one document; check the data's meta.json eos_id against its tokenizer",
                f"{EOS_PROBE_TOKENS:,}",
                eos,
            )
        return eos

    def _triage(self, batch: Any, loss: Any) -> Any:
        """A skipped (non-finite) step re-run once by hpcdist.fault.triage; acts on its verdict. Returns the grad norm
        the loop goes on with (the re-run's: non-finite, its update skipped, for data; never returns for hardware)."""
        assert self.triage is not None
        step = self.step + 1
        verdict, grad_norm = self.triage.rerun(step, batch, self.loader.last_indices(), loss)
        if verdict.kind == "model":
            log.error("step %d: NaN triage: model: %s", step, verdict.why)
            last = self.nonfinite.last_checkpoint
            raise ModelDiverged(
                f"step {step}: non-finite loss/gradient reproduced on re-run: NaN triage: model: {verdict.why}; no "
                "sample was skipped (the data is not at fault). Lower optim.lr, set optim.grad_clip, and resume from "
                + (f"the last finite checkpoint, {last}" if last else "step 0 (no checkpoint was saved)")
            )
        if verdict.kind == "hardware":
            self.triage.record_hardware(step, verdict)
            hosts = ", ".join(f"rank {r} on {self.hosts[r]}" for r in verdict.blamed) or "no rank in particular"
            log.error("step %d: NaN triage: hardware (%s): %s", step, hosts, verdict.why)
            raise HardwareFault(
                f"step {step}: a non-finite gradient norm that a re-run on the same inputs did not reproduce: "
                f"hardware ({hosts}); recorded in {RunDir(self.run_dir).failures} so a restart excludes the host"
            )
        where = getattr(self.train_ds, "where", None)
        named = ", ".join(f"{i} ({where(i)})" if where else str(i) for i in verdict.ids)
        log.error("step %d: NaN triage: data, sample(s) %s: %s", step, named, verdict.why)
        if self.cfg.train.nonfinite != "skip":
            raise NonFiniteError(
                f"step {step}: non-finite loss/gradient reproduced on re-run: bad data, sample(s) {named}; "
                "set train.nonfinite=skip to skip them (listed in the run dir so a resume skips them too)"
            )
        for i in verdict.ids:
            self.skipped[i] = f"step {step}: {verdict.why}"
        # prefetched batches may hold them: dropped (the loader rewinds to the consumed state) before the set grows
        self.loader.close()
        self.sampler.skip(set(verdict.ids))
        if self.env.is_main:
            self.skipped_samples.save(len(self.train_ds), self.skipped)
        return grad_norm

    def _record_layout(self) -> None:
        """Which host runs which rank, logged once and kept in <run.dir>/ranks.json (debugging slow or dead nodes)."""
        hosts: list[str] = [self.env.hostname]
        if dist.is_initialized():
            hosts = [""] * self.env.world_size
            dist.all_gather_object(hosts, self.env.hostname)
        self.hosts = hosts
        if self.env.is_main:
            by_host: dict[str, list[int]] = {}
            for rank, host in enumerate(hosts):
                by_host.setdefault(host, []).append(rank)
            log.info("ranks by host: %s", "; ".join(f"{h}: {r[0]}-{r[-1]}" for h, r in by_host.items()))
            RunDir(self.run_dir).ranks.write_text(json.dumps({"hosts": hosts}))

    # ------------------------------------------------------------------------------------------ state
    def checkpointable(self) -> Checkpointable:
        return Checkpointable(
            dcp_state=self.strategy.dcp_state,
            load_dcp_state=self.strategy.load_dcp_state,
            trainer_state=self.trainer_state,
            load_trainer_state=self.load_trainer_state,
            rank_state=self.strategy.rank_state,
            load_rank_state=self.strategy.load_rank_state,
        )

    def trainer_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "sampler": self.loader.state_dict(),
            "scheduler": self.strategy.scheduler_state(),
            **({"grad_scaler": scaler} if (scaler := self.strategy.scaler_state()) is not None else {}),
            "world_size": self.env.world_size,
            "config": dataclasses.asdict(self.cfg),  # what trained it: a resume names what changed since
        }

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        # a checkpoint made by `hpcdist import` holds weights only: its data position and schedule start fresh
        if "sampler" in state:
            try:
                self.loader.load_state_dict(state["sampler"])
            except SamplerMismatch as e:  # an intact checkpoint of other data: a refusal, never damage
                raise CheckpointMismatch(
                    f"made for other data ({e}): the data.* settings, run.seed and the prepared data must match the "
                    "run that saved it. Restore the old values, or start this data from step 0 in a new run.dir (or "
                    "checkpoint.resume=none here: the checkpoints are set aside, kept), or set "
                    "checkpoint.init_from=<this checkpoint> in a new run.dir to start from its weights",
                    what="data",
                ) from None
        if "scheduler" in state:
            self.strategy.load_scheduler_state(state["scheduler"])
        # fp16's loss scale and growth progress (exact resume); absent (another dtype saved it): the scaler starts
        # fresh, as it would for a run switched to fp16
        if isinstance(state.get("grad_scaler"), dict):
            try:
                self.strategy.load_scaler_state(state["grad_scaler"])
            except ValueError as e:
                raise CheckpointMismatch(f"holds a bad trainer_state.json: {e}", what="grad_scaler") from None
        self._apply_optim_config(state.get("config"))

    def _apply_optim_config(self, saved: dict[str, Any] | None) -> None:
        """The optimizer state loaded from a checkpoint carries the old run's lr, betas, eps and weight decay; the
        config's apply instead (a lower optim.lr after a loss spike is why people restart), said once."""
        o = self.cfg.optim
        want = {
            "optim.lr": o.lr,
            "optim.beta1": o.beta1,
            "optim.beta2": o.beta2,
            "optim.eps": o.eps,
            "optim.weight_decay": o.weight_decay,
        }
        have = optim_hparams(self.strategy.optimizer, self.strategy.scheduler)
        if all(have[k] == float(v) for k, v in want.items()):
            return
        set_optim_hparams(
            self.strategy.optimizer,
            self.strategy.scheduler,
            lr=o.lr,
            beta1=o.beta1,
            beta2=o.beta2,
            eps=o.eps,
            weight_decay=o.weight_decay,
        )
        old = {k: _dotted(saved, k) for k in want} if saved else have
        changed = [f"{k} {old[k]:g} -> {float(v):g}" for k, v in want.items() if old.get(k) != float(v)]
        log.warning(
            "resumed with a changed optimizer: %s (the config's values apply from step %d; the checkpoint's "
            "Adam moments are kept)",
            ", ".join(changed) or "hyper-parameters",
            self.step + 1,
        )

    def _lock_run_dir(self) -> None:
        """Rank 0 takes run.dir's lock; every rank raises the same RunDirInUse when another run holds it."""
        problems: list[list[str] | None] = [None]
        if self.env.is_main:
            try:
                self.run_lock.acquire()
            except RunDirInUse as e:
                problems = [e.problems]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(problems, src=0)
        if problems[0]:
            raise RunDirInUse(problems[0])

    def _local_tier(self) -> LocalTier | None:
        """checkpoint.local's directory on this node, checked on every rank; one ConfigError on every rank alike
        when any node's cannot be used (another user's, a link, a shared file system)."""
        loc = self.cfg.checkpoint.local
        if not loc.dir:
            return None
        root = expand_dir(loc.dir, host=self.env.hostname, job_id=self.env.job.job_id)
        problems: list[str] = []
        try:  # this run's own subdirectory: another run sharing the directory never touches its steps
            root = open_local_dir(open_local_dir(root) / run_key(self.run_dir))
        except ConfigError as e:
            problems = [f"{p} (on {self.env.hostname})" for p in e.problems]
        every = [problems]
        if dist.is_initialized() and dist.get_world_size() > 1:
            every = [[] for _ in range(self.env.world_size)]
            dist.all_gather_object(every, problems)
        first = next((p for p in every if p), None)
        if first:
            self.run_lock.release()
            raise ConfigError(first)
        return LocalTier(
            root,
            rank=self.env.rank,
            world_size=self.env.world_size,
            hosts=self.hosts,
            keep=loc.keep,
            record=RunDir(self.run_dir).local_checkpoints if self.env.is_main else None,
            template=loc.dir,
            shared_dir=str(self.cfg.checkpoint_dir),
            # the background peer copy's collectives end where the job's do (a dead peer ends the copy, not the run)
            timeout_s=collective_timeout_s(self.cfg.fault.watchdog_timeout_s, self.cfg.fault.watchdog_slow_phase_s),
        )

    def _resume_local(self, newer_than: int | None = None) -> Path | None:
        """Collective: checkpoint.resume=auto with the node-local tier: its newest step intact on every rank
        (counting peer copies) when it is at least as new as the newest shared checkpoint, or newer than
        ``newer_than`` (the step the shared tier resumed once its newer checkpoints proved damaged); None: the
        shared tier."""
        if self.local is None or self.cfg.checkpoint.resume != "auto":
            return None
        shared = latest(self.ckpt.root, warn=False)
        floor = newer_than + 1 if newer_than is not None else step_of(shared) if shared else None
        path = self.local.restore(self.checkpointable(), floor)
        if path is not None:
            self.ckpt.saved_step = self.ckpt.local_saved_step = self.step  # neither tier saves this step again
        return path

    def _discard_newer_local_steps(self) -> None:
        """After any resume (either tier, or a fresh start): the node-local steps newer than the resumed one belong
        to the line the run turned back from (an incomplete set, or older than a newer shared checkpoint): dropped,
        so a later resume never mixes them with the new line's files of the same step."""
        if self.local is not None and not self.local.foreign:
            self.local.discard_newer(self.step)

    def _resume(self) -> str | None:
        t0 = time.perf_counter()
        try:
            path = self._resume_local()
            if path is None:
                newest = latest(self.ckpt.root, warn=False)
                path = self.ckpt.restore(self.cfg.checkpoint.resume, self.checkpointable())
                if path is not None and self.local is not None and newest and self.step < step_of(newest):
                    # newer shared checkpoints were damaged: a local step between them and this one is newer
                    path = self._resume_local(newer_than=self.step) or path
                    if self.local.load_failed:  # that load left part of its state: the shared one again, whole
                        path = self.ckpt.restore(self.cfg.checkpoint.resume, self.checkpointable())
        except CheckpointMismatch as e:
            changes = _config_changes(e.path, self.cfg)
            if not changes and e.what == "data":
                changes = (
                    f"; no data.* setting changed, so the prepared data in {self.cfg.data.path} did (prepared again?)"
                )
            raise CheckpointMismatch(f"{e}{changes}", path=e.path, what=e.what) from None
        if self.cfg.checkpoint.resume == "none":
            log.info("starting fresh (checkpoint.resume=none)")
        if path is None:
            init = self.cfg.checkpoint.init_from
            if init and is_hf_dir(init):  # a Hugging Face Llama directory (config.json + safetensors)
                from hpcdist.hf.import_ import load_into  # safetensors: only when a run starts from HF weights

                load_into(init, self.checkpointable(), self.cfg.model)
                log.info("starting fresh from the Hugging Face weights of %s", init)
            elif init:  # only while the run has no checkpoint of its own: a requeue resumes its own progress
                diff = self.ckpt.init_weights(Path(init), self.checkpointable())
                log.info("starting fresh from the weights of %s (%s)", init, _describe_diff(diff))
            elif self.cfg.checkpoint.resume != "none":
                log.info("starting fresh (no complete checkpoint in %s)", self.cfg.checkpoint_dir)
            self._discard_newer_local_steps()
            return None
        self._discard_newer_local_steps()
        seconds = time.perf_counter() - t0
        self.goodput.add("restore", seconds)
        log.info("resumed from %s at step %d (%.2fs)", path, self.step, seconds)
        return str(path)

    def save(self) -> bool:
        """Save a checkpoint of this step; False when it failed with a storage error (every rank alike; training may
        go on, the previous checkpoint stays the resume point). An async save's failure shows at ``ckpt.wait()``."""
        # a NaN model is never saved, so pruning never trades a finite checkpoint for it
        self.nonfinite.check()
        self.nonfinite.check_params(self.step, self.strategy.params_finite())
        t0 = time.perf_counter()
        with self.watchdog.phase(self.step, "checkpoint save", slow=True):
            path = self.ckpt.save(self.step, self.checkpointable())
        self.nonfinite.last_checkpoint = str(path) if path else self.nonfinite.last_checkpoint
        self.goodput.add("checkpoint_save", time.perf_counter() - t0, tier="shared")
        self.goodput.flush()
        return path is not None

    def local_save(self) -> bool:
        """Save the node-local tier at this step (every rank); False when it failed (every rank alike: training
        goes on, the tier's previous step and the shared checkpoint stay). The loop waits for the previous save's
        peer copy to end and for this rank's own files; this step's copy runs in the background."""
        assert self.local is not None
        self.nonfinite.check()
        self.nonfinite.check_params(self.step, self.strategy.params_finite())
        self.ckpt.local_saved_step = self.step
        t0 = time.perf_counter()
        with self.watchdog.phase(self.step, LOCAL_COPY_PHASE, slow=True):
            self.local.wait()  # a hung copy is this phase's hang (the copy's collective timeout: the backstop)
        with self.watchdog.phase(self.step, "node-local checkpoint save (agreement all-reduce)", slow=True):
            ok = self.local.save(self.step, self.checkpointable())
        self.goodput.add("checkpoint_save", time.perf_counter() - t0, tier="local")
        return ok

    # ------------------------------------------------------------------------------------------ loop
    def train(self, *, until: int | None = None) -> TrainResult:
        """Train to ``train.steps``; ``until`` stops earlier (an interruption: a checkpoint is saved there)."""
        cfg, result = self.cfg, TrainResult(step=self.step, resumed_from=self.resumed_from)
        end = min(cfg.train.steps, until) if until is not None else cfg.train.steps
        if self.resumed_from and self.step >= cfg.train.steps:
            # the run was finished already: no attempt to account (the time since it ended is no queue wait) and no
            # summary to replace (its losses are the run's, this call has none); the caller says so
            result.already_finished = True
            self.observer.close()
            self.run_lock.release()
            return result
        self._lock_run_dir()  # held already unless an earlier train() returned
        self.stop_flag.install()  # if the caller has not; close() restores the previous handlers
        self.ckpt.restart_clock()  # checkpoint.every_minutes counts from here
        self.goodput.begin(self.step if self.resumed_from else None)
        self.watchdog.start(self.step)
        try:
            self._loop(end, result)
            if self.local is not None:  # the last local save's peer copy is complete (or failed) before we return
                with self.watchdog.phase(self.step, LOCAL_COPY_PHASE, slow=True):
                    self.local.wait()
        except BaseException:
            self.loader.close()
            self.watchdog.stop()
            self.stop_flag.uninstall()  # no waiting on the agreement in flight: other ranks may be gone
            if self.local is not None:  # the peers' copy threads run on (their loops wait elsewhere): bounded
                self.local.wait(timeout_s=EXIT_WAIT_S)
            self.observer.abort()
            self.run_lock.release()
            raise
        self.loader.close()  # prefetched batches are dropped: the saved sampler state never counted them
        with self.watchdog.phase(self.step, "stop agreement (last MAX all-reduce)"):
            self.stop_flag.close()
        self.watchdog.stop()
        self.observer.finish(
            step=self.step,
            tokens_seen=self.tokens_seen,
            losses=result.losses,
            eval_losses=result.eval_losses,
            stop_reason=result.stop_reason.name if result.stop_reason else None,
            save_failed=result.save_failed,
        )
        self.run_lock.release()  # after the last checkpoint is complete (the loop waited for it)
        result.step = self.step
        return result

    def _loop(self, end: int, result: TrainResult) -> None:
        cfg, obs, phase = self.cfg, self.observer, self.watchdog.phase  # a phase names the collective it waits in
        while self.step < end:
            t0 = obs.begin_step(self.step + 1)
            with phase(self.step, "data + forward/backward (gradient all-reduce)"):
                batch = self.loader.next_batch()
                data_s = time.perf_counter() - t0
                loss = self.strategy.forward_backward(batch)
            with phase(self.step, "optimizer step (grad-norm all-reduce)"):
                # an async save's copy of the state ran beside this step's forward and backward, which change none of
                # it; the optimizer step does
                waited = self.ckpt.staging_fence()
                # the triage re-runs a non-finite step from the state before it: that step's update is dropped
                skip = cfg.train.nonfinite == "skip" or cfg.train.nonfinite_triage
                grad_norm = self.strategy.optimizer_step(skip_nonfinite=skip)
            if cfg.train.nonfinite_triage and self.strategy.last_step_skipped:
                with phase(self.step, "NaN triage: the step re-run on the same inputs", slow=True):
                    grad_norm = self._triage(batch, loss)
            self.step += 1
            self.nonfinite.after_step(  # an fp16 overflow is the loss scaler's skip, not a non-finite step
                self.step, grad_norm, skipped=self.strategy.last_step_skipped, overflow=self.strategy.last_step_overflow
            )
            self.tokens_seen += self.tokens_per_step
            seen = obs.step(
                StepRecord(
                    step=self.step,
                    last=end,
                    loss=loss,
                    grad_norm=grad_norm,
                    data_s=data_s,
                    step_s=time.perf_counter() - t0,
                    tokens_seen=self.tokens_seen,
                    checkpoint_wait_s=waited,
                )
            )
            result.record(self.step, seen.loss, seen.eval_loss)
            with phase(self.step, "stop agreement (MAX all-reduce)"):
                # async two-int all-reduce: every rank leaves after the same step, and saves after the same step
                # when rank 0's clock asked one step ago (checkpoint.every_minutes)
                stop = self.stop_flag.agreed(
                    request_save=self.ckpt.timed_save_due(self.step),
                    request_local_save=self.ckpt.timed_local_save_due(self.step),
                )
            if stop:
                log.info("stop requested (%s) at step %d: saving a checkpoint", stop.name, self.step)
            if self.ckpt.should_save(
                self.step, last_step=self.step >= end, stop_requested=bool(stop), timed=self.stop_flag.save_requested
            ):
                self.save()
            elif self.ckpt.local_save_due(self.step, timed=self.stop_flag.local_save_requested):
                self.local_save()
            obs.end_step(self.step)
            if stop:
                result.stop_reason = stop
                break
            # async saves: the staging buffers, allocated once the optimizer state exists (after this process's
            # first step) and outside any save, so no save blocks the loop for the allocation (a one-off, logged)
            self.ckpt.prepare_staging(self.strategy.dcp_state)

        if self.ckpt.should_save(self.step, last_step=True):  # no step ran: train(until=0), resumed at the end
            self.save()
        self.nonfinite.check()  # also when no final save follows
        with phase(self.step, "checkpoint completion", slow=True):
            # the checkpoint is complete before train() returns: the caller may requeue at once
            saved = self.ckpt.wait() and self.ckpt.last_ok
        final = self.ckpt.final_save_due(self.step)  # this step's checkpoint is the run's result / resume point
        if final and not saved:  # the last save (or the stop save before a requeue) failed: not a success
            resume = latest(self.ckpt.root, warn=False)
            result.save_failed, result.resume_point = self.step, str(resume) if resume else None
            self.nonfinite.last_checkpoint = result.resume_point


def _dotted(tree: dict[str, Any], key: str) -> Any:
    section, name = key.split(".", 1)
    value = tree.get(section, {}).get(name)
    return float(value) if isinstance(value, (int, float)) else value


def _config_changes(path: Path | None, cfg: JobConfig) -> str:
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


def _auto_write_threads(local_world_size: int) -> int:
    """checkpoint.write_threads=0: the cores this rank may use, shared with the node's other ranks when they are
    not bound to their own (torchrun without binding: every rank sees every core), at most 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cores >= (os.cpu_count() or cores):  # unbound: the node's cores are everyone's
        cores //= max(1, local_world_size)
    return max(1, min(8, cores))
