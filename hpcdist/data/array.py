"""``hpcdist prepare ... --cluster PROFILE --tasks N``: a preparation as one SLURM job array and a merge job
(docs/DATA.md).

::

    submit: plan_slices(inputs, N) --> OUT/parts/plan.json (the slices, the options, the fingerprint)
    array task i (PrepareTask): prepare_corpus(slice i) --> OUT/parts/i/  (shards, progress.jsonl, meta.json)
    merge job (MergeTask, afterok:<array>): every part's meta.json --> OUT/meta.json (written last), listing the
        parts' shards in place (parts/<i>/shard-*.bin): no token byte is copied

Each part is an ordinary prepare output, so a task run again (a SLURM requeue after preemption or a node failure,
or after its tokenizing process was killed: the task requeues itself) keeps its finished shards and continues.
The slices concatenated are the corpus in input order (hpcdist.data.slices), so the merged dataset's shards,
concatenated, are byte for byte the one-machine prepare's stream, and its meta.json is the one-machine one but for
the shard list (the same fingerprint, counts, tokenizer and options).

This module is what the jobs do, scheduler-free; submitting them and the tasks' SLURM side (requeue) are
:mod:`hpcdist.launch.prepare_array`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from hpcdist.base.atomic import atomic_write
from hpcdist.base.untrusted import DamagedRecord, one_line, read_jsonl_prefix
from hpcdist.config.dataset_meta import (
    META_NAME,
    DataError,
    check_shard_files,
    load_meta,
    open_regular,
    read_meta_json,
    write_meta,
)
from hpcdist.data.slices import Piece, plan_slices

__all__ = [
    "JOBS_NAME",
    "claim_plan",
    "merge_parts",
    "plan_prepare",
    "prepare_part",
    "prepare_status",
    "read_jobs",
    "read_plan",
    "run_part",
    "write_plan",
]

PARTS = "parts"
PLAN_NAME = "plan.json"
JOBS_NAME = "jobs.json"  # the array's and the merge's job ids (hpcdist status JOB finds the prepare by them)
MAX_PLAN_BYTES = 64 << 20
# The test hook of the SLURM acceptance test: "I" kills part I's tokenizing process (SIGKILL) right after its first
# shard, on the task's first run only (SLURM_RESTART_COUNT 0): a deterministic "killed mid-way".
KILL_ENV = "HPCDIST_TEST_KILL_PART"
# A task whose tokenizing process is killed requeues itself at most this many times (then it fails: look at why).
MAX_REQUEUES = 3


class PlanError(DataError):
    def __init__(self, message: str) -> None:
        super().__init__([message])


def _header(tok: Any, *, dtype: str, shard_tokens: int, text_field: str) -> tuple[str, dict[str, Any]]:
    from hpcdist.data.tokenizers import describe

    if dtype == "auto":
        dtype = "uint16" if tok.vocab_size <= 2**16 else "uint32"
    return dtype, {
        "dtype": dtype,
        "max_tokens": None,
        "shard_tokens": shard_tokens,
        "text_field": text_field,
        "tokenizer": describe(tok),
    }


def plan_prepare(
    inputs: Sequence[Path],
    out: Path,
    *,
    tokenizer: str = "byte",
    tasks: int,
    text_field: str = "text",
    shard_tokens: int = 2**24,
    dtype: str = "auto",
) -> dict[str, Any]:
    """The plan of a cluster prepare (written to OUT/parts/plan.json by :func:`submit_prepare`): the slices of
    ``inputs`` for ``tasks`` array tasks, the options, and the one-machine prepare's fingerprint."""
    from hpcdist.data.prepare import _fingerprint
    from hpcdist.data.tokenizers import load_tokenizer

    if tasks < 1:
        raise PlanError(f"--tasks must be >= 1, got {tasks}")
    if shard_tokens < 1:
        raise PlanError(f"--shard-tokens must be >= 1, got {shard_tokens}")
    files = [Path(f).expanduser().absolute() for f in inputs]
    if not files:
        raise PlanError("prepare: no input files given")
    spec = str(tokenizer)
    if spec != "byte" and ":" not in spec and Path(spec).expanduser().exists():
        spec = str(Path(spec).expanduser().absolute())  # the tasks start in another working directory
    tok = load_tokenizer(spec)
    dtype, header = _header(tok, dtype=dtype, shard_tokens=shard_tokens, text_field=text_field)
    slices = plan_slices(files, tasks)
    return {
        "fingerprint": _fingerprint(files, header),
        "tokenizer": spec,
        "dtype": dtype,
        "shard_tokens": shard_tokens,
        "text_field": text_field,
        "inputs": [str(f) for f in files],
        "slices": [[p.to_json() for p in s] for s in slices],
    }


def write_plan(out: Path, plan: dict[str, Any]) -> Path:
    """OUT/parts/plan.json (atomically): what every array task and the merge read."""
    parts = Path(out) / PARTS
    parts.mkdir(parents=True, exist_ok=True)
    atomic_write(parts / PLAN_NAME, json.dumps(plan, indent=1) + "\n")
    return parts / PLAN_NAME


def read_plan(out: Path) -> dict[str, Any]:
    """OUT/parts/plan.json, bounded and validated (a directory others may write). PlanError naming what is wrong."""
    path = Path(out) / PARTS / PLAN_NAME
    try:
        fd = open_regular(path)
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(MAX_PLAN_BYTES + 1)
        if len(data) > MAX_PLAN_BYTES:
            raise ValueError(f"larger than {MAX_PLAN_BYTES >> 20} MiB")
        plan = json.loads(data)
        ok = isinstance(plan, dict) and isinstance(plan.get("slices"), list) and isinstance(plan.get("tokenizer"), str)
        ok = ok and plan.get("dtype") in ("uint16", "uint32") and isinstance(plan.get("fingerprint"), str)
        ok = ok and isinstance(plan.get("shard_tokens"), int) and isinstance(plan.get("text_field"), str)
        if not ok:
            raise ValueError("not a prepare plan")
        plan["slices"] = [[Piece.from_json(p) for p in s] for s in plan["slices"]]
    except (OSError, ValueError, RecursionError, TypeError) as e:
        raise PlanError(
            f"{path}: {getattr(e, 'strerror', None) or e}: not a cluster prepare's plan; submit the prepare again"
        ) from None
    return plan


def _part_dir(out: Path, i: int) -> Path:
    return Path(out) / PARTS / str(i)


def prepare_part(out: Path, index: int, *, workers: int = 1, progress: TextIO | None = None) -> Any:
    """Prepare slice ``index`` of OUT's plan into OUT/parts/<index>/ (resumable, as any prepare); the
    PrepareResult."""
    from hpcdist.data.prepare import PrepareResult, _fingerprint, prepare_corpus
    from hpcdist.data.tokenizers import load_tokenizer

    plan = read_plan(out)
    if not 0 <= index < len(plan["slices"]):
        raise PlanError(f"part {index}: the plan has {len(plan['slices'])} slices")
    pieces: list[Piece] = plan["slices"][index]
    tok = load_tokenizer(plan["tokenizer"])
    part = _part_dir(out, index)
    if not pieces:  # more tasks than pieces of input: an empty part (no shard)
        part.mkdir(parents=True, exist_ok=True)
        _, header = _header(tok, dtype=plan["dtype"], shard_tokens=plan["shard_tokens"], text_field=plan["text_field"])
        write_meta(part, {**_meta_fields(tok, plan, 0, 0, []), "fingerprint": _fingerprint([], header)})
        return PrepareResult(part, 0, 0, 0)
    return prepare_corpus(
        pieces,
        part,
        tokenizer=tok,
        text_field=plan["text_field"],
        shard_tokens=plan["shard_tokens"],
        dtype=plan["dtype"],
        workers=workers,
        progress=progress,
    )


def _meta_fields(tok: Any, plan: dict[str, Any], tokens: int, docs: int, shards: list[dict[str, Any]]) -> dict:
    from hpcdist.data.tokenizers import describe

    return {
        "dtype": plan["dtype"],
        "vocab_size": int(tok.vocab_size),
        "bos_id": tok.bos_id,
        "eos_id": int(tok.eos_id),
        "shard_tokens": plan["shard_tokens"],
        "max_tokens": None,
        "num_tokens": tokens,
        "num_documents": docs,
        "max_id": max((int(s["max_id"]) for s in shards), default=0),
        "shards": shards,
        "tokenizer": describe(tok),
        "text_field": plan["text_field"],
    }


def merge_parts(out: Path) -> Any:
    """OUT/meta.json from every part's meta.json (the parts' shards listed in place, in slice order), written last;
    the DatasetMeta. DataError naming a missing or unfinished part."""
    from hpcdist.data.prepare import _fingerprint
    from hpcdist.data.tokenizers import copy_files, load_tokenizer

    out = Path(out)
    plan = read_plan(out)
    tok = load_tokenizer(plan["tokenizer"])
    _, header = _header(tok, dtype=plan["dtype"], shard_tokens=plan["shard_tokens"], text_field=plan["text_field"])
    shards: list[dict[str, Any]] = []
    tokens = docs = 0
    for i, pieces in enumerate(plan["slices"]):
        part = _part_dir(out, i)
        meta = load_meta(part, key=f"part {i}")  # missing: the task has not finished
        check_shard_files(meta, key=f"part {i}")
        if meta.fingerprint != _fingerprint(pieces, header):
            raise PlanError(f"part {i} ({part}) was prepared from another plan; submit the prepare again")
        for s in meta.shards:
            shards.append({"name": f"{PARTS}/{i}/{s.name}", "tokens": s.tokens, "sha256": s.sha256, "max_id": s.max_id})
        tokens += meta.num_tokens
        docs += int(meta.raw.get("num_documents", 0))
    copy_files(tok, out)
    return write_meta(out, {**_meta_fields(tok, plan, tokens, docs, shards), "fingerprint": plan["fingerprint"]})


def prepare_status(out: Path) -> str:
    """A table of a cluster prepare's tasks: state (done / running / waiting), shards and tokens so far, from the
    parts' progress.jsonl and meta.json (nothing asked of SLURM)."""
    out = Path(out)
    plan = read_plan(out)
    jobs = read_jobs(out)
    merged = read_meta_json(out)[0]
    head = f"cluster prepare {out}: {len(plan['slices'])} task(s)"
    if jobs:  # a directory others may write: its values printed as one printable line each
        head += f", array job {one_line(jobs.get('array'), 40)}, merge job {one_line(jobs.get('merge'), 40)}"
    rows = [head, f"{'task':>6} {'state':<9} {'shards':>7} {'tokens':>14} {'input MB':>9}"]
    for i, pieces in enumerate(plan["slices"]):
        part = _part_dir(out, i)
        size = sum(_piece_bytes(p) for p in pieces)
        meta = read_meta_json(part)[0]
        if meta is not None:
            listed = meta.get("shards")
            state, shards, tokens = (
                "done",
                len(listed) if isinstance(listed, list) else 0,
                _token_count(meta.get("num_tokens")),
            )
        else:
            shards, tokens = _progress(part)
            state = "running" if shards or (part / "progress.jsonl").exists() else "waiting"
        rows.append(f"{i:>6} {state:<9} {shards:>7} {tokens:>14,} {size / 1e6:>9.1f}")
    if merged is not None and merged.get("fingerprint") == plan["fingerprint"]:
        rows.append(f"merged: {out / META_NAME} ({_token_count(merged.get('num_tokens')):,} tokens)")
    else:
        rows.append("merged: not yet (the merge job writes meta.json when every task is done)")
    return "\n".join(rows)


def _piece_bytes(p: Piece) -> int:
    if p.kind in ("jsonl", "jsonl.gz"):
        return p.end - p.start
    try:
        return os.stat(p.path).st_size if p.kind == "whole" else 0
    except OSError:
        return 0


def _progress(part: Path) -> tuple[int, int]:
    try:
        records = read_jsonl_prefix(part / "progress.jsonl", 64 << 20)[1:]  # after the fingerprint's line
    except DamagedRecord:
        return 0, 0
    shards = tokens = 0
    for rec, _ in records:
        if not isinstance(rec.get("tokens"), int) or isinstance(rec["tokens"], bool):
            break
        tokens += _token_count(rec["tokens"])
        shards += 1
    return shards, tokens


def _token_count(value: object) -> int:
    """A count a part's record gives (tokens), or 0 for anything that is not one (a damaged record)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62 else 0


def read_jobs(out: Path) -> dict[str, Any]:
    try:
        fd = open_regular(Path(out) / PARTS / JOBS_NAME)
        with os.fdopen(fd, "rb") as fh:
            doc = json.loads(fh.read(1 << 16))
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError, RecursionError):
        return {}


# ------------------------------------------------------------------------------------------------ a task's part


def run_part(out: str, index: int, workers: int, *, kill_after_first_shard: bool = False) -> None:
    """The tokenizing process of an array task (hpcdist.launch.prepare_array.PrepareTask forks it): part ``index``,
    one line on success, exit status 2 with one line on bad input. ``kill_after_first_shard``: the SLURM test's hook
    (KILL_ENV), a SIGKILL right after the first shard is recorded."""
    from hpcdist.data import prepare as prepare_mod

    if kill_after_first_shard:
        prepare_mod.AFTER_SHARD = lambda n: os.kill(os.getpid(), signal.SIGKILL)
    try:
        res = prepare_part(Path(out), index, workers=workers, progress=sys.stderr)
    except (ValueError, OSError) as e:  # bad input, a refused directory: one line, the task fails
        print(f"hpcdist: prepare part {index}: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    kept = f", {res.kept_shards} shards kept from an earlier run" if res.kept_shards else ""
    print(f"hpcdist: prepare part {index}: {res.num_tokens:,} tokens{kept}", flush=True)


def claim_plan(out: Path, plan: dict[str, Any], overwrite: bool) -> bool:
    """May this cluster prepare write OUT? True when OUT already holds its finished result. PrepareRefused for a
    directory holding anything else (unless ``overwrite``: then prepare's own files there go)."""
    from hpcdist.data.prepare import PrepareRefused, own_files

    if not out.exists():
        return False
    if not out.is_dir():
        raise PrepareRefused(f"--out {out} is not a directory")
    meta = read_meta_json(out)[0]
    if meta is not None and meta.get("fingerprint") == plan["fingerprint"]:
        return True
    try:
        old = read_plan(out)
    except DataError:
        old = None
    same = old is not None and old["fingerprint"] == plan["fingerprint"] and len(old["slices"]) == len(plan["slices"])
    entries = [p.name for p in out.iterdir() if p.name != "tokenizer"]
    if same or not entries:
        return False
    if not overwrite:
        raise PrepareRefused(
            f"--out {out} is not empty: it holds {', '.join(sorted(entries)[:3])}; prepare would replace it. Give a "
            "new --out, or add --overwrite (only prepare's own files go: shards, meta.json, progress, parts/)"
        )
    for f in own_files(out):
        f.unlink(missing_ok=True)
    parts = out / PARTS
    if parts.is_dir() and not parts.is_symlink():
        shutil.rmtree(parts)
    return False
