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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hpcdist import agree
from hpcdist import config as config_mod
from hpcdist.base.logging_utils import get_logger, setup_logging
from hpcdist.base.rundir import RunDir
from hpcdist.checkpoint.checkpointer import Checkpointer
from hpcdist.checkpoint.errors import CheckpointMismatch
from hpcdist.checkpoint.state import Checkpointable
from hpcdist.config import JobConfig
from hpcdist.config.loader import ConfigError
from hpcdist.data import BatchLoader, PrefetchLoader, make_sampler
from hpcdist.data.build import build_datasets, document_eos
from hpcdist.data.sampler import SamplerMismatch
from hpcdist.env import DistEnv
from hpcdist.evaluate import Evaluator
from hpcdist.fault import inprocess
from hpcdist.fault.goodput import Goodput, InProcessRecovery
from hpcdist.fault.hang import HangWatchdog
from hpcdist.fault.nonfinite import NonFiniteError, NonFiniteGuard
from hpcdist.fault.rundir_lock import RunDirInUse, RunDirLock
from hpcdist.fault.stop import StopFlag, StopReason
from hpcdist.fault.triage import HardwareFault, ModelDiverged, SkippedSamples, Triage
from hpcdist.metrics.observer import Observer, StepRecord
from hpcdist.models import Transformer, build_model, flops_per_token, num_params
from hpcdist.optim import apply_optim_config
from hpcdist.parallel.dims import describe_layout
from hpcdist.parallel.parallelize import build_strategy
from hpcdist.rankfacts import RankFacts, rank_facts

log = get_logger(__name__)


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
    rank: int | None = None
    """The rank this process trained as: its launch's, or the one a warm spare took; None for a warm spare that
    took none (hpcdist.run sets it)."""

    def record(self, step: int, loss: float | None, eval_loss: float | None) -> None:
        """A step's logged loss and evaluation loss, where it had them."""
        if loss is not None:
            self.losses[step] = loss
        if eval_loss is not None:
            self.eval_losses[step] = eval_loss


class Trainer:
    def __init__(
        self,
        cfg: JobConfig,
        env: DistEnv,
        *,
        stop_flag: StopFlag | None = None,
        facts: RankFacts | None = None,
        in_process: InProcessRecovery | None = None,
        model: Transformer | None = None,
    ):
        """``stop_flag``: one already installed by the caller (hpcdist.run installs it before the start-up, so a
        signal during data preparation, model build or resume is remembered); else one is made here.

        ``facts``: this rank's checked config and layout, built once by the caller (hpcdist.run, before the process
        group) from this ``cfg`` and ``env``; a Trainer built directly (the Python API) builds them here with the
        same function, :func:`hpcdist.rankfacts.rank_facts`, which refuses ``parallel.strategy=auto`` (the planner
        runs in hpcdist.run; the trainer imports none): a Trainer builds exactly the layout it is given.

        ``in_process``: this Trainer is a generation after an in-process recovery (hpcdist.fault.inprocess): its
        goodput attempt starts at the peer's death.

        ``model``: this config's model built ahead on the meta device (a warm spare's,
        hpcdist.parallel.parallelize.warm_up); taken once, in place of the build here."""
        setup_logging(env.rank, level=cfg.run.log_level)
        if model is not None and (model.args != cfg.model_args() or any(not p.is_meta for p in model.parameters())):
            raise ValueError("Trainer(model=...): expected this config's model on the meta device")
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
        if model is None:
            model = build_model(args, device="meta")
        if cfg.data.document_mask:  # before parallelize: every stage copy and wrapper carries it
            model.document_eos = document_eos(cfg, train_ds)
        self.strategy = build_strategy(cfg, env, model, self.dims)
        self.tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
        self.flops_per_token = flops_per_token(args, cfg.data.seq_len)
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
            self.run_dir,
            enabled=env.is_main,
            restart=env.job.restart_count if env.job.job_id else None,
            in_process=in_process,
        )
        f = cfg.fault
        self.watchdog = HangWatchdog(
            rank=env.rank,
            world_size=env.world_size,
            host=env.hostname,
            run_dir=self.run_dir,
            timeout_s=f.watchdog_timeout_s,
            slow_phase_s=f.watchdog_slow_phase_s,
            on_fire=self.goodput.flush,
            supervised=inprocess.active(os.environ),  # a frozen rank is killed: its peers recover in-process
        )
        # the resume sets its last_checkpoint: where a NaN stop tells the user to resume from
        self.nonfinite = NonFiniteGuard(
            mode=cfg.train.nonfinite, max_skips=cfg.train.max_nonfinite_skips, device=env.torch_device()
        )
        try:  # both checkpoint tiers; a refused tier directory or resume (another model) is not a run: the
            # directory is free again
            self.ckpt = Checkpointer.build(
                cfg,
                env,
                hosts=self.hosts,
                state=self.checkpointable(),
                step=lambda: self.step,
                model=self.strategy.model,
                params_finite=self.strategy.params_finite,
                watchdog=self.watchdog,
                goodput=self.goodput,
                nonfinite=self.nonfinite,
            )
            self.resumed_from = self.ckpt.resume(import_hf=self._import_hf)
        except BaseException:
            self.run_lock.release()
            raise
        if env.is_main:  # after the resume was accepted: a refused one leaves the saved run's config.yaml as it was
            config_mod.save(cfg, RunDir(self.run_dir).config)
        self.stop_flag = stop_flag or StopFlag(
            rank=env.rank, device=env.torch_device(), requeue_signal=f.requeue_signal, job=env.job
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
        hosts: list[str] = agree.gather(self.env.hostname, agree.world_group(), self.env.world_size)
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
        optimizer, scheduler = self.strategy.optimizer, self.strategy.scheduler
        apply_optim_config(optimizer, scheduler, self.cfg.optim, state.get("config"), next_step=self.step + 1)

    def _import_hf(self, path: str) -> None:
        """checkpoint.init_from naming a Hugging Face Llama directory (config.json + safetensors): its weights."""
        from hpcdist.hf.import_ import load_into  # safetensors: only when a run starts from HF weights

        load_into(path, self.checkpointable(), self.cfg.model)

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

    def save(self) -> bool:
        """Save the shared tier at this step (Checkpointer.save): False when it failed with a storage error."""
        return self.ckpt.save(self.step)

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
        self.ckpt.start()  # checkpoint.every_minutes counts from here
        self.goodput.begin(self.step if self.resumed_from else None)
        self.watchdog.start(self.step)
        try:
            self._loop(end, result)
            # every checkpoint of either tier is complete (or failed) before train() returns: the caller may requeue
            result.save_failed, result.resume_point = self.ckpt.finish(self.step)
        except BaseException:
            self.loader.close()
            self.watchdog.stop()
            self.stop_flag.uninstall()  # no waiting on the agreement in flight: other ranks may be gone
            self.ckpt.abort()
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
                waited = self.ckpt.fence()
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
                asks = self.ckpt.requests(self.step)
                stop = self.stop_flag.agreed(request_save=asks.save, request_local_save=asks.local_save)
            if stop:
                log.info("stop requested (%s) at step %d: saving a checkpoint", stop.name, self.step)
            # shared save, node-local save or none (one decision), then the async save's staging buffers, once
            self.ckpt.after_step(
                self.step,
                last_step=self.step >= end,
                stop=bool(stop),
                timed=self.stop_flag.save_requested,
                local_timed=self.stop_flag.local_save_requested,
            )
            obs.end_step(self.step)
            if stop:
                result.stop_reason = stop
                break
