"""The shared tier's load path: one checkpoint restored into a :class:`Checkpointable` (its records through the
:class:`~hpcdist.checkpoint.storage.Storage`, the DCP shards hashed while they are read), the retries of a read
that failed for a reason that says nothing about the files, and the weights-only load of ``checkpoint.init_from``.
Every function is collective: every rank calls it, and every rank gets the same verdict."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from hpcdist import agree
from hpcdist.base.logging_utils import get_logger
from hpcdist.checkpoint.codec import HashingReader, read_metadata, single_process_dcp
from hpcdist.checkpoint.errors import (
    READ_DAMAGE,
    READ_MISMATCH,
    READ_OK,
    READ_TRANSIENT,
    CheckpointMismatch,
    CheckpointTainted,
    CheckpointUnavailable,
    ShardsDamaged,
    describe_error,
    error_of,
    read_kind,
)
from hpcdist.checkpoint.manifest import is_shard, read_manifest, shard_owners, shard_verdict, tensor_encoding
from hpcdist.checkpoint.names import DAMAGED
from hpcdist.checkpoint.ranks import Ranks
from hpcdist.checkpoint.state import RANK_DIR, STATE_FILE, Checkpointable, set_rng_state
from hpcdist.checkpoint.storage import Storage, read_step_record
from hpcdist.checkpoint.verify import check_model_shapes, model_diff

READ_RETRY_DELAYS_S = (0.5, 1.0, 2.0)  # a transient read error is tried again after each of these, then refused
log = get_logger(__name__)


def load_checkpoint(
    path: Path, state: Checkpointable, storage: Storage, ranks: Ranks, *, checksum: bool, tainted: set[str]
) -> dict[str, Any]:
    """Restore ``path`` into ``state``; the trainer state as saved (see ``CheckpointManager.load``). ``tainted``:
    the state parts a load wrote into from a checkpoint that did not verify, updated here."""
    trainer_state = json.loads(read_step_record(storage, path, STATE_FILE))
    if not isinstance(trainer_state, dict):
        raise ValueError(f"{STATE_FILE} holds {type(trainer_state).__name__}, not the trainer's state")
    # absent when resuming on more ranks than saved: those ranks keep their seeded RNG
    rng = _load_tensors(storage, path, f"rng/rank-{ranks.rank:05d}.pt")
    # a rank's own state (PowerSGD's error feedback) belongs to that rank of that world: on another world size
    # every rank starts it fresh
    same_world = trainer_state.get("world_size") == ranks.world_size
    own = (_load_tensors(storage, path, f"{RANK_DIR}/rank-{ranks.rank:05d}.pt") if same_world else None) or {}
    dest = state.dcp_state()
    metadata = read_metadata(path)
    saved = {key.split(".", 1)[0] for key in metadata.state_dict_metadata}
    for part in [k for k in dest if k not in saved]:  # e.g. a weights-only checkpoint has no "optim"
        if part in tainted:
            raise CheckpointTainted(
                f"{path} holds no {part!r} state, and this process's {part!r} state holds values read from a "
                "checkpoint found damaged after the load read it: start the run again (the damaged one is "
                f"marked {DAMAGED} now, so the new process resumes from {path.name} with a fresh {part!r} state)",
                path=path,
            )
        log.warning("%s holds no %r state: it is not restored (starts fresh)", path, part)
        del dest[part]
    check_model_shapes(path, metadata, dest.get("model", {}), ranks)
    tainted |= set(dest)  # DCP writes into the live tensors: until the verdict, not trusted
    load_shards(path, dest, ranks, storage, checksum=checksum)
    state.load_dcp_state(dest)
    state.load_trainer_state(trainer_state)
    state.load_rank_state(own)
    if rng is not None:
        set_rng_state(rng)
    tainted -= set(dest)  # every part this checkpoint holds replaced what a damaged one left
    return trainer_state


def _load_tensors(storage: Storage, path: Path, rel: str) -> Any:
    """A per-rank file of plain tensors (loadable with weights_only=True); None when the step has none."""
    if not storage.has(path, rel):
        return None
    with storage.open_reader(path, rel) as f:
        return torch.load(f, weights_only=True)


def load_matching_weights(path: Path, state: Checkpointable, storage: Storage, ranks: Ranks) -> dict[str, list[str]]:
    """The model weights of the verified checkpoint ``path`` that match this model by name and shape, loaded into
    ``state``; what did not match (missing / unexpected / shape)."""
    model = state.dcp_state()["model"]  # this model's initialized weights, every key: loaded into in place
    metadata = read_metadata(path)
    diff = model_diff(metadata, model, ranks)
    skip = set(diff["missing"]) | set(diff["shape"])
    matching = {k: v for k, v in model.items() if k not in skip}
    # verified whole by the caller: read without hashing, in the encoding its manifest records
    encoding = tensor_encoding(path, storage)
    reader = HashingReader(str(path), hash_files=set(), threads=ranks.threads, encoding=encoding)
    with single_process_dcp():
        dcp.load({"model": matching}, storage_reader=reader)
    state.load_dcp_state({"model": model})
    return diff


def read_step_files(
    path: Path, ranks: Ranks, verify: Callable[[], list[str]], load: Callable[[], dict[str, Any]], saved: dict[str, Any]
) -> tuple[int, list[str]]:
    """``verify`` (the shards by size) and ``load`` ``path`` (its trainer state into ``saved``), tried again after
    each of READ_RETRY_DELAYS_S while the error says nothing about the files. Returns (READ_OK, []) or
    (READ_DAMAGE, [phase ("verify" / "load"), what is wrong...]), agreed by every rank; raises the mismatch (every
    rank alike) and, once a transient error outlasted the retries, CheckpointUnavailable."""
    problems: list[str] = []
    for delay in (*READ_RETRY_DELAYS_S, None):
        problems.clear()
        # the shards' sha256 is taken while the load reads them (each byte read once): here their sizes, and
        # every other file whole (small; .metadata is unpickled by the load)
        err = error_of(lambda: problems.extend(verify()))
        phase = "verify"
        kind = agree.worst(read_kind(err) if err is not None else READ_DAMAGE if problems else READ_OK, ranks.group)
        if kind == READ_OK:
            phase = "load"
            err = error_of(lambda: saved.update(load()))
            if isinstance(err, ShardsDamaged):  # the shards' verdict, agreed by every rank inside load()
                phase = "verify"
                problems.extend(err.problems)
            kind = agree.worst(read_kind(err) if err is not None else READ_OK, ranks.group)
        why = describe_error(err) if err is not None else f"{phase} failed on another rank: see its log"
        if kind == READ_MISMATCH:
            if isinstance(err, CheckpointMismatch) and err.path is None:  # the trainer's state knows no path
                raise CheckpointMismatch(f"{path}: {err}", path=path, what=err.what) from None
            if isinstance(err, CheckpointMismatch):
                raise err
            raise CheckpointMismatch(f"{path} does not fit this run (another rank: see its log)", path=path)
        if kind != READ_TRANSIENT:
            return kind, ([phase, *problems] if problems else [phase, why]) if kind == READ_DAMAGE else []
        if delay is None:
            raise CheckpointUnavailable(
                f"checkpoint {path} could not be read ({why}) after {len(READ_RETRY_DELAYS_S)} retries: a storage "
                "or memory problem, not a damaged checkpoint, so it is not marked damaged and nothing was "
                "changed; run again once the file system (or the node's memory) is healthy",
                path=path,
            )
        log.warning("reading checkpoint %s failed (%s): trying again in %.1f s", path, why, delay)
        time.sleep(delay)
    raise AssertionError("unreachable")


def load_shards(path: Path, dest: dict[str, Any], ranks: Ranks, storage: Storage, *, checksum: bool) -> None:
    """DCP's load of ``dest`` (in place) through a :class:`HashingReader`, then the verdict of the shards this rank
    owns (``file_owner``: as ``verify`` spreads them), agreed by every rank."""
    manifest = read_manifest(path, checksum=True, storage=storage) if checksum else {}
    owners = shard_owners([rel for rel in manifest if is_shard(rel)], ranks.world_size)
    mine = sorted(rel for rel, rank in owners.items() if rank == ranks.rank)
    reader = HashingReader(str(path), hash_files=set(mine), threads=ranks.threads)
    planner = DefaultLoadPlanner()

    def load() -> None:
        reader.encoding = tensor_encoding(path, storage)  # alike on every rank: a bad value fails every rank's load
        dcp.load(dest, storage_reader=reader, planner=planner)

    with single_process_dcp():
        failed = error_of(load)
    # a load that failed is judged too: damage that broke a record (a MemoryError from a garbled size) is
    # damage, not a transient error to retry; dcp.load fails on every rank alike, so all reach the agreement
    problems: list[str] = []
    verdict_err: BaseException | None = None
    try:
        problems = shard_verdict(path, manifest, mine, reader.digests)
    except (OSError, MemoryError) as e:
        verdict_err = e
    kind = agree.worst(
        READ_DAMAGE if problems else read_kind(verdict_err) if verdict_err is not None else READ_OK, ranks.group
    )
    if kind == READ_DAMAGE:
        raise ShardsDamaged(problems or ["a shard differs from the manifest (found by another rank: see its log)"])
    if kind != READ_OK:
        raise verdict_err or CheckpointUnavailable(f"verifying {path} failed on another rank: see its log", path)
    if failed is not None:
        raise failed
    reader.apply_deferred(planner)  # the pickled entries, now that their files verified
