"""The end-of-attempt summary: a block in the log and <run.dir>/run_summary.json (rank 0).

Someone who comes back to a job after days reads the last lines of its log, or one small JSON file, and learns how
far it got, how fast, how much of the wall time was training, the best evaluation loss, and where the checkpoint
and the report are. Standard library only (the trainer writes it; `hpcdist report` reads it).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from typing import Any

from hpcdist.base.atomic import atomic_write
from hpcdist.base.rundir import RunDir
from hpcdist.base.untrusted import DamagedRecord, read_json

__all__ = ["format_summary", "previous_best_eval", "write_summary"]

_MAX_BYTES = 1 << 20  # run_summary.json: a few hundred bytes


def previous_best_eval(run_dir: str | os.PathLike[str]) -> float | None:
    """The best eval loss an earlier attempt recorded (a resumed run keeps the best over all attempts)."""
    try:  # a record anyone could have written: never a FIFO's hang, a link's target or a crash at the end
        doc = read_json(RunDir(run_dir).summary, _MAX_BYTES)
    except DamagedRecord:
        return None
    value = doc.get("best_eval_loss") if isinstance(doc, dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def write_summary(run_dir: str | os.PathLike[str], summary: Mapping[str, Any]) -> None:
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in summary.items()}
    atomic_write(RunDir(run_dir).summary, json.dumps({**clean, "time": time.time()}, indent=1, allow_nan=False))


def _duration(seconds: float) -> str:
    hours, rest = divmod(round(seconds), 3600)
    return f"{hours}h{rest // 60:02d}m{rest % 60:02d}s" if hours else f"{rest // 60}m{rest % 60:02d}s"


def format_summary(s: Mapping[str, Any]) -> str:
    """The log block, one fact per line."""
    best = s.get("best_eval_loss")
    lines = [
        "=" * 24 + " run summary " + "=" * 24,
        f"steps        {s['step']:,} of {s['total_steps']:,}"
        + (f" (stopped: {s['stop_reason']})" if s.get("stop_reason") else ""),
        f"tokens       {s['tokens_seen']:,}",
        f"wall time    {_duration(s['wall_time_s'])} over {s['attempts']} attempt(s); this attempt "
        f"{_duration(s['attempt_s'])}",
        f"goodput      {100 * s['goodput']:.1f}% (time spent on kept training steps)",
        f"throughput   tps {s['tokens_per_s']:,.0f}" if s.get("tokens_per_s") else "throughput   -",
        f"last loss    {s['last_loss']:.4f}" if isinstance(s.get("last_loss"), float) else "last loss    -",
        f"best eval    {best:.4f}" if isinstance(best, float) else "best eval    - (no evaluation)",
        f"checkpoint   {s.get('checkpoint') or '- (none saved)'}"
        + (f" (the save at step {s['save_failed']} FAILED: this is the resume point)" if s.get("save_failed") else ""),
        f"report       hpcdist report {s['run_dir']}  (writes {s['report']})",
        f"summary      {s['summary_file']}",
    ]
    return "\n".join(lines)
