"""The training log line and the metrics sinks of rank 0: metrics.jsonl, TensorBoard and the trackers."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from hpcdist.base.atomic import open_append
from hpcdist.base.rundir import RunDir

__all__ = ["MetricsLogger", "format_eta", "format_line"]

logger = logging.getLogger("hpcdist.metrics")


def format_eta(seconds: float) -> str:
    """Compact duration: "1h02m", "3m05s", "12s"; "?" when unknown (NaN or infinite)."""
    if not math.isfinite(seconds):
        return "?"
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def format_line(step: int, total_steps: int, m: Mapping[str, float]) -> str:
    """One compact log line from whichever of the known metrics are present; missing ones are left out.

    "step 120/200 | loss 2.3456 | lr 2.95e-04 | gnorm 0.87 | tps 12,345 | mfu 41.2% | mem 1.2GiB | eta 3m05s"
    """
    parts = [f"step {step}/{total_steps}"]
    if "loss" in m:
        parts.append(f"loss {m['loss']:.4f}")
    if "lr" in m:
        parts.append(f"lr {m['lr']:.2e}")
    if "grad_norm" in m:
        parts.append(f"gnorm {m['grad_norm']:.3g}")
    if "scaler_skips" in m:  # fp16: updates the loss scaler skipped (overflow), and the scale now
        scale = f" (scale {m['loss_scale']:.3g})" if "loss_scale" in m else ""
        parts.append(f"skips {m['scaler_skips']:.0f}{scale}")
    if "tokens_per_s" in m:
        # torchtitan's convention: integer tokens/s with thousands separators; per device when the job has several
        tps = f"tps {m['tokens_per_s']:,.0f}"
        per_dev = m.get("tokens_per_s_per_device")
        if per_dev is not None and round(per_dev) != round(m["tokens_per_s"]):
            tps += f" ({per_dev:,.0f}/dev)"
        parts.append(tps)
    if "mfu" in m:
        parts.append(f"mfu {m['mfu'] * 100:.1f}%")
    # Reserved is what decides an OOM on GPU; RSS is the only number on CPU.
    for key in ("mem_reserved_gib", "mem_alloc_gib", "mem_rss_gib"):
        if key in m:
            mem = f"mem {m[key]:.1f}GiB"
            if "mem_pct" in m:
                mem += f" ({m['mem_pct']:.0f}%)"
            parts.append(mem)
            break
    if "eta_s" in m:
        parts.append(f"eta {format_eta(m['eta_s'])}")
    return " | ".join(parts)


def _plain(value: Any) -> Any:
    """Tensors and numpy scalars to Python numbers; anything else unchanged."""
    return value.item() if hasattr(value, "item") and callable(value.item) else value


def _json_value(value: Any) -> Any:
    """NaN/inf to None (null): json.dumps would write the bare token NaN, which strict JSON readers reject."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


class MetricsLogger:
    """Writes metrics.jsonl and TensorBoard scalars on rank 0; a no-op everywhere else.

    Every rank builds one (``enabled=(rank == 0)``) so the trainer calls it unconditionally. metrics.jsonl
    is opened in append mode: a resumed (requeued) run continues the same file, and steps re-run after the
    last checkpoint appear twice; readers keep the last line per step. Pass ``purge_step`` (the step the
    run resumes from) and TensorBoard hides the earlier run's events at or after it, so re-run steps are
    not drawn twice.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        tensorboard: bool = True,
        purge_step: int | None = None,
        every_steps: int = 1,
        trackers: Any = None,
    ) -> None:
        """``trackers``: a hpcdist.metrics.trackers.Trackers (W&B / MLflow) that gets every logged line too."""
        self.enabled, self.every_steps = enabled, max(1, every_steps)
        self._trackers = trackers
        self.path = RunDir(run_dir).metrics
        self._file: IO[str] | None = None
        self._tb: Any = None  # torch.utils.tensorboard.SummaryWriter, imported lazily (~1.5 s, rank 0 only)
        if not enabled:
            return
        # never through a link, never into a FIFO or another user's file (hpcdist.base.atomic.open_append)
        self._file = os.fdopen(open_append(self.path), "a", encoding="utf-8")  # lives until close()
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # tensorboard missing: keep the JSONL record, say why TB is absent
                logger.warning("TensorBoard disabled: %s", e)
            else:
                # flush_secs=30: a killed job loses at most 30 s of TB scalars (metrics.jsonl loses none).
                self._tb = SummaryWriter(log_dir=str(RunDir(run_dir).tensorboard), flush_secs=30, purge_step=purge_step)

    def due(self, step: int, *, last: int) -> bool:
        """A training line at every ``every_steps`` steps, at step 1 (where the loss starts) and at ``last``. Every
        rank answers alike: logging all-reduces the loss."""
        return step % self.every_steps == 0 or step in (1, last)

    def log(self, step: int, metrics: Mapping[str, float], *, prefix: str = "train") -> None:
        """Append one JSON line and the TB scalars ``{prefix}/{key}`` for ``step``."""
        if self._file is None:
            # Disabled (rank != 0) or closed: silently nothing, so all ranks behave alike and none raises
            # where the others would go on into a collective and hang.
            return
        record: dict[str, Any] = {"step": step, "time": time.time()}
        if prefix != "train":
            record["split"] = prefix
        values = {key: _plain(value) for key, value in metrics.items()}
        record.update((key, _json_value(value)) for key, value in values.items())
        # allow_nan=False guarantees the line is strict JSON (NaN was already mapped to null above).
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        # Flush to the OS per line so a killed (preempted, OOM) job keeps every metric it logged; no fsync,
        # which would cost a round trip per step on a network file system.
        self._file.flush()
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):  # TB draws NaN as a gap
                    self._tb.add_scalar(f"{prefix}/{key}", value, step)
        if self._trackers is not None:
            self._trackers.log(step, values, prefix)

    def close(self, *, failed: bool = False) -> None:
        """Flush and close the sinks; safe to call more than once. ``failed``: the training raised (the trackers
        record a failed run)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()  # close() flushes
            self._tb = None
        if self._trackers is not None:
            self._trackers.close(failed=failed)
            self._trackers = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(failed=exc_type is not None)
