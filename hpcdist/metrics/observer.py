"""The training loop's one observability collaborator: ``Observer.step(record)`` once per step.

Each step's record fans out from here to what measures and reports it: throughput and MFU, the log line,
metrics.jsonl / TensorBoard / the trackers, Prometheus, the profiler's window, the hang watchdog's step time,
evaluation, the straggler check, goodput, and at the end the goodput line and the run summary. Each of them still
says when it is due (``MetricsLogger.due``, ``Evaluator.due``, ``StragglerMonitor.due``); this class only calls
them in the loop's order, so every rank runs the same collectives (the loss all-reduce of a log step, evaluation,
the straggler all-gather) after the same step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hpcdist.base.logging_utils import get_logger
from hpcdist.base.rundir import RunDir
from hpcdist.fault import failures
from hpcdist.fault.goodput import RECOVERY_PARTS
from hpcdist.fault.stragglers import StragglerMonitor
from hpcdist.metrics.logger import MetricsLogger, format_line
from hpcdist.metrics.profiling import StepProfiler
from hpcdist.metrics.prometheus import PrometheusExporter
from hpcdist.metrics.summary import format_summary, previous_best_eval, write_summary
from hpcdist.metrics.throughput import (
    Throughput,
    memory_stats,
    mfu,
    peak_flops,
    peak_is_measured,
    remeasure_peak_flops,
)
from hpcdist.metrics.trackers import Trackers
from hpcdist.parallel.replicas import check_replicas

if TYPE_CHECKING:
    from hpcdist.config import JobConfig
    from hpcdist.env import DistEnv
    from hpcdist.evaluate import Evaluator
    from hpcdist.fault.goodput import Goodput
    from hpcdist.fault.hang import HangWatchdog
    from hpcdist.fault.nonfinite import NonFiniteGuard
    from hpcdist.parallel.base import Strategy

__all__ = ["Observer", "StepRecord", "StepReport"]

log = get_logger(__name__)


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step, as the loop hands it over."""

    step: int
    """The step just done (1-based)."""
    last: int
    """The last step of this train() call (a log line is due there)."""
    loss: torch.Tensor
    """This rank's loss (not synchronized: read on log steps only)."""
    grad_norm: torch.Tensor
    data_s: float
    """Seconds this rank waited for its batch (no collective: its own speed, for straggler detection)."""
    step_s: float
    """Seconds of the step: data, forward/backward, optimizer step."""
    tokens_seen: int
    checkpoint_wait_s: float = 0.0
    """Seconds the step waited, before its optimizer step, for an async save's copy of the state (goodput books
    them as checkpoint time)."""


@dataclass(frozen=True)
class StepReport:
    """What a step produced for the caller's result: the global mean loss on a log step, the eval loss when due."""

    loss: float | None = None
    eval_loss: float | None = None


@dataclass
class _Window:
    """Since the last log line: the data-wait and step seconds and the steps (the data-wait and comm shares)."""

    data_s: float = 0.0
    step_s: float = 0.0
    steps: int = 0

    def add(self, data_s: float, step_s: float) -> None:
        self.data_s += data_s
        self.step_s += step_s
        self.steps += 1


@dataclass
class _Timing:
    """The step in flight: its start (``begin_step``) and its data wait (``step``), for ``end_step``."""

    t0: float = 0.0
    data_s: float = 0.0
    window: _Window = field(default_factory=_Window)


class Observer:
    """Built once per Trainer on every rank (sinks are rank 0's or each node's local rank 0's, no-ops elsewhere)."""

    def __init__(
        self,
        cfg: JobConfig,
        env: DistEnv,
        *,
        strategy: Strategy,
        evaluator: Evaluator,
        goodput: Goodput,
        watchdog: HangWatchdog,
        nonfinite: NonFiniteGuard,
        hosts: list[str],
        flops_per_token: float,
        resumed_step: int | None,
        restarts: int,
    ) -> None:
        """``resumed_step``: the step a resumed run starts from (TensorBoard hides the old run's events after it);
        ``restarts``: the job's restart count (a Prometheus label)."""
        self.cfg, self.env, self.run_dir = cfg, env, Path(cfg.run.dir)
        self.strategy, self.evaluator, self.goodput = strategy, evaluator, goodput
        self.watchdog, self.nonfinite, self.hosts = watchdog, nonfinite, hosts
        self.tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
        self.flops_per_token = flops_per_token
        # measured where it is reported, at the first log line: a CPU's peak is about a second of matmuls, which
        # a rank whose MFU no sink shows would spend for nothing (and, beside its node's peers, measure too low)
        self._peak: float | None = None
        self._peak_measured = peak_is_measured(env.torch_device(), configured=cfg.logging.peak_flops)
        self._peak_remeasured = False
        self.throughput = Throughput(env.world_size)
        self._timing = _Timing()
        self.first_step_s: float | None = None  # this attempt's first step (compile and warm-up included)
        # each node's local rank 0 exports Prometheus metrics (logging.prometheus); a no-op otherwise
        self.prom = PrometheusExporter(
            cfg, enabled=env.local_rank == 0, node=env.node_rank, job=env.job_id or cfg.run.name, restarts=restarts
        )
        self._reports_mfu = env.is_main or self.prom.active  # the log line and metrics.jsonl, a node's gauge
        self._node_memory: list[float] = []  # GiB per local rank, from the last straggler check
        self.stragglers = StragglerMonitor(
            every=cfg.logging.straggler_every_steps, factor=cfg.logging.straggler_factor, device=env.torch_device()
        )
        prof = cfg.logging.profile
        self.profiler = StepProfiler(
            self.run_dir,
            rank=env.rank,
            device=env.torch_device(),
            start_step=prof.start_step,
            steps=prof.steps,
            memory=prof.memory,
        )
        # a resumed run redoes the steps after its checkpoint: TensorBoard hides the old run's events from there
        self.metrics = MetricsLogger(
            self.run_dir,
            enabled=env.is_main,
            tensorboard=cfg.logging.tensorboard,
            purge_step=resumed_step + 1 if resumed_step is not None else None,
            every_steps=cfg.logging.every_steps,
            trackers=Trackers(cfg, self.run_dir, enabled=env.is_main, config=cfg.to_dict()),
        )

    # ------------------------------------------------------------------------------------------ per step
    def begin_step(self, step: int) -> float:
        """Before step ``step`` (1-based) runs: the profiler's window; returns the step's start time."""
        self.profiler.before_step(step)
        self._timing.t0 = time.perf_counter()
        return self._timing.t0

    def step(self, r: StepRecord) -> StepReport:
        """The one per-step entry point, right after the optimizer step: every rank, every step."""
        self.profiler.after_step(r.step)
        self._timing.data_s = r.data_s
        self._timing.window.add(r.data_s, r.step_s)
        self.throughput.update(self.tokens_per_step, r.step_s)
        self.prom.step(r.step_s, samples=self.cfg.train.global_batch_size, tokens=self.tokens_per_step)
        self.watchdog.step_time(r.step_s)
        if r.checkpoint_wait_s:
            self.goodput.add("checkpoint_save", r.checkpoint_wait_s)
        if self.first_step_s is None:
            self._first_step(r.step_s)
        loss = eval_loss = None
        if self.metrics.due(r.step, last=r.last):
            with self.watchdog.phase(r.step, "logging (loss all-reduce)"):
                loss = self._log(r)
            self.nonfinite.check()  # the log line synchronized already: stop at once, not at the next save
        if self.evaluator.due(r.step):
            eval_loss = self.evaluate(r.step)
        if self.stragglers.due(r.step):
            self._check_stragglers(r.step)
        return StepReport(loss=loss, eval_loss=eval_loss)

    def _first_step(self, seconds: float) -> None:
        """Say once what the attempt's first step cost: with train.compile it holds the block's torch.compile, which
        the watchdog allows up to its slow-phase allowance (later steps get STEP_FACTOR x the slowest later one)."""
        self.first_step_s = seconds
        if self.env.is_main:
            what = "torch.compile of the transformer block and warm-up" if self.cfg.train.compile else "warm-up"
            log.info(
                "first step of this attempt: %.1f s (%s; the watchdog allows up to %.0f s for it: "
                "fault.watchdog_slow_phase_s)",
                seconds,
                what,
                self.watchdog.slow_phase_s,
            )

    def end_step(self, step: int) -> None:
        """After the step's checkpoint decision: the straggler window and goodput get the whole iteration's time
        (goodput minus the save / evaluation inside it)."""
        seconds = time.perf_counter() - self._timing.t0
        self.stragglers.add(data_s=self._timing.data_s, step_s=seconds)
        self.goodput.step(step, seconds)

    def evaluate(self, step: int) -> float:
        """Mean loss over the first eval_batches global batches of the validation split (same each time)."""
        t0 = time.perf_counter()
        with self.watchdog.phase(step, "evaluation", slow=True):
            value = self.evaluator.loss(self.strategy)
        self.goodput.add("eval", time.perf_counter() - t0)
        self.metrics.log(step, {"loss": value}, prefix="eval")
        log.info("eval step %d | loss %.4f", step, value)
        return value

    @property
    def peak(self) -> float:
        """The device's peak FLOP/s for MFU: stated (a datasheet GPU, logging.peak_flops) or measured once."""
        if self._peak is None:
            self._peak = peak_flops(self.env.torch_device(), configured=self.cfg.logging.peak_flops)
        return self._peak

    def _mfu(self, tps_dev: float) -> float:
        """MFU against the peak (0.0 on a rank that reports none). A measured peak that the run beats was taken under
        load (other work on the machine): it is measured again once (the higher one kept); if the run still beats it,
        one warning, and MFU is capped at 1.0 (never "126%"). A stated peak (datasheet GPU, logging.peak_flops) is
        never second-guessed."""
        if not self._reports_mfu:
            return 0.0
        ratio = mfu(tps_dev, self.flops_per_token, self.peak)
        if not self._peak_measured or ratio <= 1.0:
            return ratio
        if not self._peak_remeasured:
            self._peak_remeasured = True
            self._peak = remeasure_peak_flops(self.env.torch_device())
            ratio = mfu(tps_dev, self.flops_per_token, self.peak)
            if ratio > 1.0:
                log.warning(
                    "MFU %.0f%% of the measured peak %.3g FLOP/s (measured twice): capped at 100%%; set "
                    "logging.peak_flops to this device's real peak for a meaningful MFU",
                    100 * ratio,
                    self.peak,
                )
        return min(ratio, 1.0)

    def _log(self, r: StepRecord) -> float:
        # .item() synchronizes with the device: done only on log steps
        cfg, w = self.cfg, self._timing.window
        tps_dev = self.throughput.tokens_per_s_per_device
        m = {
            "loss": self.strategy.global_mean(r.loss).item(),
            "lr": self.strategy.lr,
            "grad_norm": r.grad_norm.item(),
            "tokens_per_s": self.throughput.tokens_per_s,
            "tokens_per_s_per_device": tps_dev,
            "mfu": self._mfu(tps_dev),
            "step_time_s": self.throughput.step_time,
            "tokens_seen": float(r.tokens_seen),
            "eta_s": (cfg.train.steps - r.step) * self.throughput.step_time,
            # the share of step time this rank waited for its batch (since the last log line): ~0 with prefetching
            # unless building batches is slower than computing on them
            "data_wait_share": w.data_s / w.step_s if w.step_s else 0.0,
            **memory_stats(self.env.torch_device()),
        }
        comm = self.strategy.comm_stats()
        if comm is not None and w.steps:
            # rank 0's gradient traffic, measured by the DDP comm hook: bytes handed to all-reduce per step, and the
            # share of step time a gradient bucket was in flight (overlapped with backward or not)
            m["comm_bytes_per_step"] = comm[0] / w.steps
            m["comm_share"] = comm[1] / w.step_s if w.step_s else 0.0
        if cfg.train.nonfinite == "skip":
            m["nonfinite_skips"] = float(self.nonfinite.skipped_total)
        # the loss scaler's skipped (overflow) steps, in the whole run: wherever the run trains in fp16, set or the
        # choice of train.dtype=auto on a GPU without bf16 (the strategy holds a scaler exactly then)
        if (scale := self.strategy.loss_scale()) is not None:
            m["scaler_skips"] = float(self.strategy.overflow_steps)
            m["loss_scale"] = scale
        every = cfg.logging.replica_check_every_steps
        if every and r.step % every == 0 and self.strategy.has_replicas():
            m["replica_divergence"] = check_replicas(self.strategy, step=r.step, rank=self.env.rank)
        self._timing.window = _Window()
        self.metrics.log(r.step, m)
        own = m.get("mem_reserved_gib", m.get("mem_rss_gib"))
        self.prom.log(
            m,
            samples_per_token=1 / cfg.data.seq_len,
            local_memory=self._node_memory or ([own] if own is not None else []),
        )
        log.info(format_line(r.step, cfg.train.steps, m))
        return m["loss"]

    def _check_stragglers(self, step: int) -> None:
        """All ranks: gather per-rank data-loading and compute-probe times; rank 0 reports the slow ranks."""
        with self.watchdog.phase(step, "straggler check (all-gather)"):
            report = self.stragglers.check(self.hosts)
        # this node's ranks in local-rank order (ranks are numbered node by node) for the Prometheus memory gauges
        self._node_memory = [
            row["mem_gib"]
            for rank, row in enumerate(report.table)
            if rank < len(self.hosts) and self.hosts[rank] == self.env.hostname
        ]
        if not self.env.is_main:
            return
        self.metrics.log(step, report.metrics(), prefix="straggler")
        for s in report.stragglers:
            log.warning("step %d: %s", step, s.describe())
            failures.record(
                self.run_dir,
                kind="straggler",
                cause=s.describe(),
                rank=s.rank,
                host=s.host,
                blame=[{"rank": s.rank, "host": s.host}],
                step=step,
                measure=s.measure,
                ratio=round(s.ratio, 3),
                per_rank=report.table,
            )

    # ------------------------------------------------------------------------------------------ end of attempt
    def finish(
        self,
        *,
        step: int,
        tokens_seen: int,
        stop_reason: str | None,
        losses: dict[int, float],
        eval_losses: dict[int, float],
        save_failed: int | None,
    ) -> None:
        """End of this train() call (finished or stopped by a signal): the profile, the goodput line, the summary
        block and run_summary.json, then the sinks are closed."""
        self.profiler.close()  # stopped inside its window: the steps recorded so far are written
        self._report_goodput(step)
        if self.env.is_main:
            self._report_summary(step, tokens_seen, stop_reason, losses, eval_losses, save_failed)
        self.metrics.close()
        self.prom.close()

    def abort(self) -> None:
        """The training raised: the sinks are closed (metrics.jsonl's handle, TensorBoard's writer thread, the
        trackers, which record a failed run) without the end-of-run reports. Left open, the file and the thread
        outlived the Trainer in the process that goes on (a test session, an in-process caller), and a later fork
        copied that thread (Python >= 3.12 warns at such a fork). Prometheus stops serving likewise."""
        self.metrics.close(failed=True)
        self.prom.close()

    def close(self) -> None:
        """End without a report: nothing was trained (a rerun of a finished run), so goodput.json and
        run_summary.json keep the run's own."""
        self.profiler.close()
        self.metrics.close()

    def _report_goodput(self, step: int) -> None:
        """The effective-training-time ratio of the run."""
        self.goodput.flush(clean=True)
        if not self.env.is_main:
            return
        g = self.goodput.summary()
        parts = ", ".join(
            f"{k.replace('_', ' ')} {g[k]:.1f}s"
            for k in ("train", "checkpoint_save", "restore", "startup", "lost", "queue_wait", "other")
        )
        log.info(
            "goodput %.1f%% of %.1fs over %d attempt(s): %s", 100 * g["goodput"], g["total_s"], g["attempts"], parts
        )
        self.metrics.log(step, g, prefix="goodput")
        for r in self.goodput.recoveries():
            split = ", ".join(f"{k.replace('_', ' ')} {r[k]:.1f}s" for k in RECOVERY_PARTS if k in r)
            log.info(
                "recovery of attempt %s (%s): %.1fs from the failure to its first step: %s",
                r.get("restart"),
                r.get("path"),
                r["total"],
                split,
            )

    def _report_summary(
        self,
        step: int,
        tokens_seen: int,
        stop_reason: str | None,
        losses: dict[int, float],
        eval_losses: dict[int, float],
        save_failed: int | None,
    ) -> None:
        """Rank 0: the summary block in the log and <run.dir>/run_summary.json."""
        g, rd = self.goodput.summary(), RunDir(self.run_dir)
        evals = [v for v in eval_losses.values() if math.isfinite(v)]
        best = [v for v in (previous_best_eval(self.run_dir), min(evals, default=None)) if v is not None]
        attempt = self.goodput.attempt_seconds()
        summary: dict[str, Any] = {
            "step": step,
            "total_steps": self.cfg.train.steps,
            "tokens_seen": tokens_seen,
            "stop_reason": stop_reason,
            "wall_time_s": g["total_s"] or attempt,
            "attempt_s": attempt,
            "attempts": int(g["attempts"]) or 1,
            "goodput": g["goodput"],
            "tokens_per_s": self.throughput.run_tokens_per_s,  # the attempt's average, not the last window's
            "last_loss": losses[max(losses)] if losses else None,
            "best_eval_loss": min(best) if best else None,
            "checkpoint": self.nonfinite.last_checkpoint,
            "save_failed": save_failed,
            "run_dir": str(self.run_dir),
            "report": str(rd.report),
            "summary_file": str(rd.summary),
        }
        try:
            write_summary(self.run_dir, summary)
        except OSError as e:  # a full disk must not turn a finished run into a failed one
            log.warning("could not write %s: %s", rd.summary, e)
        log.info("\n%s", format_summary(summary))
