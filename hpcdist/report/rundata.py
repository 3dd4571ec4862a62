"""Everything a run directory records, read back for the report: torch-free and tolerant of partial files.

A report is asked for while a run trains (files are being appended to), after it finished, and after it crashed
(a truncated last JSON line, a goodput entry without an end, no restarts.json because it never ran under SLURM).
So every reader here returns what it could read and skips what it could not: an unreadable line is dropped, a
missing file is an empty record, and nothing here raises on the run's own files.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcdist.base.atomic import read_bounded
from hpcdist.base.rundir import RunDir
from hpcdist.base.untrusted import DamagedRecord, read_json, read_jsonl
from hpcdist.checkpoint.names import MARKER, parse_step
from hpcdist.fault.failures import read_failures
from hpcdist.fault.goodput import CATEGORIES, read_goodput, summarize

__all__ = ["Attempt", "RunData", "checkpoint_tiers", "read_ledger", "read_records"]


_JSONL_MAX_BYTES = 64 << 20  # the newest records of metrics.jsonl / failures.jsonl: hundreds of thousands of lines
_RECORD_MAX_BYTES = 16 << 20  # a JSON record (restarts.json, ranks.json, run_summary.json)
_CONFIG_MAX_BYTES = 1 << 20  # config.yaml: a few KiB


def read_records(path: Path, max_bytes: int = _JSONL_MAX_BYTES) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file's newest ``max_bytes``, in order, each line a record of plain values
    (:func:`_metrics_values`); [] when it is missing, a link, a FIFO or no regular file (hpcdist.base.untrusted)."""
    try:
        return [_metrics_values(r) for r in read_jsonl(path, max_bytes)]
    except DamagedRecord:
        return []


def _metrics_values(rec: dict[str, Any]) -> dict[str, Any]:
    """A metrics line as the figures read it: ``step`` an integer (else dropped), ``split`` a string, and every
    other field a number, a string, or a list of numbers (a per-rank value); anything else is dropped."""
    out: dict[str, Any] = {}
    for key, value in rec.items():
        if key == "step":
            ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62
        elif key == "split":
            ok = isinstance(value, str)
        elif isinstance(value, list):
            ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        else:
            ok = value is None or (isinstance(value, (int, float, str)) and not isinstance(value, bool))
        if ok:
            out[key] = value
    return out


def _read_json_or_none(path: Path) -> Any:
    try:
        return read_json(path, _RECORD_MAX_BYTES)
    except DamagedRecord:
        return None


def _series(records: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    """The records of one split, last line per step (a resumed run logs its re-run steps again), by step."""
    by_step: dict[int, dict[str, Any]] = {}
    for rec in records:
        if rec.get("split", "train") == split and isinstance(rec.get("step"), int):
            by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]


@dataclass
class Attempt:
    """One start of the run (goodput.json's entry): when, which steps, how it ended, where its time went."""

    number: int
    start: float
    end: float
    first_step: int
    last_step: int | None
    clean: bool
    ended: bool  # an end time was written (by the trainer, or by the batch script after a failed step)
    seconds: dict[str, float]
    recovery: dict[str, Any] | None = None  # after a failure or requeue: goodput.recovery's split (seconds, path)

    @property
    def outcome(self) -> str:
        if self.clean:
            return "stopped cleanly"
        return "failed" if self.ended else "running or crashed"


@dataclass
class RunData:
    """The run directory's records; see :meth:`load`."""

    root: Path
    config_text: str = ""
    train: list[dict[str, Any]] = field(default_factory=list)
    eval: list[dict[str, Any]] = field(default_factory=list)
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    goodput: dict[str, float] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)
    restarts: dict[str, Any] = field(default_factory=dict)
    hosts: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    checkpoints: dict[str, Any] = field(default_factory=dict)
    """Both checkpoint tiers' newest steps (checkpoint_tiers)."""
    saves: dict[str, float] = field(default_factory=dict)
    """Saves per checkpoint tier over all attempts (goodput.json): saves_shared, save_shared_s, saves_local, ..."""

    @classmethod
    def load(cls, root: str | os.PathLike[str]) -> RunData:
        rd = RunDir(root)
        records = read_records(rd.metrics)
        try:
            failures = read_failures(root)
        except DamagedRecord:
            failures = []
        data = cls(
            root=Path(root),
            train=_series(records, "train"),
            eval=_series(records, "eval"),
            stragglers=_series(records, "straggler"),
            failures=failures,
        )
        with contextlib.suppress(OSError):
            data.config_text = read_bounded(rd.config, _CONFIG_MAX_BYTES).decode("utf-8", errors="replace")
        data.restarts = read_ledger(root)
        ranks = _read_json_or_none(rd.ranks)
        if isinstance(ranks, dict) and isinstance(ranks.get("hosts"), list):
            data.hosts = [h for h in ranks["hosts"] if isinstance(h, str)]
        data.checkpoints = checkpoint_tiers(root)
        summary = _read_json_or_none(rd.summary)
        data.summary = summary if isinstance(summary, dict) else {}
        entries = read_goodput(root)
        data.goodput = summarize(entries) if entries else {}
        for e in entries:
            for key in ("saves_shared", "save_shared_s", "saves_local", "save_local_s"):
                if key in e:
                    data.saves[key] = data.saves.get(key, 0) + e[key]
        for i, e in enumerate(entries, 1):
            keys = [k for k in CATEGORIES if k != "queue_wait"]
            data.attempts.append(
                Attempt(
                    number=i,
                    start=float(e["start"]),
                    end=float(e.get("end") or e.get("last") or e["start"]),
                    first_step=int(e.get("first_step") or 0),
                    last_step=e.get("last_step"),
                    clean=bool(e.get("clean")),
                    ended=bool(e.get("end")),
                    seconds={k: float(e.get(f"{k}_s", 0.0)) for k in keys},
                    recovery=e["recovery"] if isinstance(e.get("recovery"), dict) else None,
                )
            )
        return data

    def ranks_by_host(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for rank, host in enumerate(self.hosts):
            out.setdefault(host, []).append(rank)
        return out

    @property
    def empty(self) -> bool:
        return not (self.train or self.attempts or self.failures or self.config_text)


def read_ledger(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The run's restarts.json as `hpcdist report` and `hpcdist status` show it (:func:`_ledger`)."""
    return _ledger(_read_json_or_none(RunDir(run_dir).restarts))


def _ledger(doc: Any) -> dict[str, Any]:
    """restarts.json as the page shows it, whichever job it is of: attempts keyed by their number (ASCII digits)
    with object values, the host lists lists of strings, ``stopped`` an object with a string reason; {} for no
    ledger. (The restart policy's own reading, which decides by it, is hpcdist.launch.restarts.load_ledger.)"""
    if not isinstance(doc, dict):
        return {}
    out = dict(doc)
    attempts = doc.get("attempts") if isinstance(doc.get("attempts"), dict) else {}
    out["attempts"] = {k: a for k, a in attempts.items() if re.fullmatch(r"[0-9]{1,9}", k) and isinstance(a, dict)}
    out["excluded"] = (
        [h for h in doc.get("excluded") or [] if isinstance(h, str)] if isinstance(doc.get("excluded"), list) else []
    )
    gate = doc.get("gate_failed") if isinstance(doc.get("gate_failed"), dict) else {}
    out["gate_failed"] = {h: r for h, r in gate.items() if isinstance(r, list)}
    stopped = doc.get("stopped")
    out["stopped"] = stopped if isinstance(stopped, dict) and isinstance(stopped.get("reason"), str) else None
    return out


def checkpoint_tiers(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The run's two checkpoint tiers as the run dir knows them: the newest complete shared checkpoint (a step-N
    directory holding COMPLETE, in the directory the node-local tier's record names, else run.dir/checkpoints) and
    the node-local tier's newest step (local_checkpoints.json, written by rank 0 after each local save: the login
    node cannot see the nodes' disks). Missing keys: nothing known. Only lstat and bounded reads."""
    rd, out = RunDir(run_dir), {}
    record = _read_json_or_none(rd.local_checkpoints)
    shared_dir = rd.checkpoints
    if isinstance(record, dict) and isinstance(record.get("step"), int) and not isinstance(record["step"], bool):
        out["local_step"] = record["step"]
        out["local_copies"] = bool(record.get("peer_copies"))
        for key in ("bytes_per_node", "time"):
            if isinstance(record.get(key), (int, float)):
                out[f"local_{key}"] = record[key]
        if isinstance(record.get("shared_dir"), str) and record["shared_dir"]:
            shared_dir = Path(record["shared_dir"])
    steps = []
    with contextlib.suppress(OSError), os.scandir(shared_dir) as entries:
        for i, e in enumerate(entries):
            if i > 100_000:
                break
            step = parse_step(e.name)
            if step is not None and e.is_dir(follow_symlinks=False) and os.path.isfile(os.path.join(e.path, MARKER)):
                steps.append(step)
    if steps:
        out["shared_step"] = max(steps)
    out["shared_dir"] = str(shared_dir)
    return out
