"""A checkpoint's MANIFEST.json: size and sha256 of every file, each hashed by the rank that wrote it, and the
bounded reads of it and of the other JSON records; which rank verifies which shard at a load."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

from hpcdist.agree import gather
from hpcdist.base.atomic import atomic_write, file_sha256
from hpcdist.checkpoint.errors import READ_DAMAGE, read_kind
from hpcdist.checkpoint.names import DAMAGED, MARKER
from hpcdist.checkpoint.ranks import Ranks
from hpcdist.checkpoint.storage import RECORD_MAX, PosixStorage, Storage, read_step_record

MANIFEST = "MANIFEST.json"


PARTS_DIR = ".manifest"  # async save: each rank's part of the manifest, merged by rank 0, then removed


ASYNC_PARTS_TIMEOUT_S = 3600.0


# how the shards' tensor items are encoded, recorded in MANIFEST.json (never guessed from the bytes): "raw" (each
# tensor's bytes, its dtype and shape in DCP's .metadata: HashingWriter writes it) or "torch_save" (DCP's own
# FileSystemWriter: a torch.save record per tensor; checkpoints written before the field, and plain DCP checkpoints
# without our manifest). Both are read by HashingReader; any other value is damage
TENSOR_ENCODING = "tensor_encoding"


RAW, TORCH_SAVE = "raw", "torch_save"


ENCODINGS = (RAW, TORCH_SAVE)


def is_shard(rel: str) -> bool:
    return rel.endswith(".distcp")


def shard_verdict(path: Path, manifest: dict[str, dict[str, Any]], mine: list[str], read: dict[str, Any]) -> list[str]:
    """What is wrong with this rank's shards (``mine``) against the manifest: the digests the load took while
    reading (``read``), a shard it did not read whole hashed now (a resharded load). OSError other than a missing
    file, and MemoryError, are raised (nothing said about the file)."""
    problems = []
    for rel in mine:
        got = read.get(rel)
        if got is None:
            try:
                got = digest(path / rel, checksum=True)
            except OSError as e:
                if read_kind(e) != READ_DAMAGE:
                    raise
                problems.append(f"{rel}: missing")
                continue
        want = manifest[rel]
        if got["size"] != want["size"]:
            problems.append(f"{rel}: {got['size']} bytes, the manifest says {want['size']} (truncated or altered)")
        elif got["sha256"] != want["sha256"]:
            problems.append(f"{rel}: sha256 differs from the manifest (altered)")
    return problems


def read_manifest(step: Path, *, checksum: bool, storage: Storage | None = None) -> dict[str, dict[str, Any]]:
    """{relative path: {"size", "sha256"}} of the step at ``step`` (its manifest read through ``storage``; None: the
    directory by path); ValueError naming the first malformed part (a flipped byte in a key must demote the
    checkpoint, not crash the resume)."""
    data = json.loads(read_step_record(storage or PosixStorage(step.parent), step, MANIFEST))
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict):
        raise ValueError('no "files" mapping')
    encoding_of(data)
    for rel, entry in files.items():
        size = entry.get("size") if isinstance(entry, dict) else None
        digest = entry.get("sha256") if isinstance(entry, dict) else None
        if not isinstance(size, int) or size < 0 or (checksum and not re.fullmatch(r"[0-9a-f]{64}", str(digest))):
            raise ValueError(f"malformed entry for {rel!r}: {entry!r}")
    return files


def tensor_encoding(step: Path, storage: Storage | None = None) -> str:
    """How the shards of the checkpoint at ``step`` encode their tensors, as its manifest (read through ``storage``;
    None: the directory by path) records it (``TENSOR_ENCODING``). No field (a checkpoint written before it) or no
    manifest at all (a plain DCP checkpoint, which our saves never leave) means DCP's own torch_save. ValueError
    (damage) for any other value."""
    try:
        data = json.loads(read_step_record(storage or PosixStorage(step.parent), step, MANIFEST))
    except FileNotFoundError:
        return TORCH_SAVE
    try:
        return encoding_of(data)
    except ValueError as e:
        raise ValueError(f"{MANIFEST}: {e}") from None


def read_record(file: Path, limit: int = RECORD_MAX) -> bytes:
    """A checkpoint's JSON record by its path (a POSIX directory: the manifest, a node-local step's records): see
    :func:`hpcdist.checkpoint.storage.read_step_record`."""
    return read_step_record(PosixStorage(file.parent), file.parent, file.name, limit)


def encoding_of(manifest: Any) -> str:
    """The manifest's TENSOR_ENCODING (absent: TORCH_SAVE); ValueError for any other value (the one check of it)."""
    encoding = manifest.get(TENSOR_ENCODING, TORCH_SAVE) if isinstance(manifest, dict) else None
    if encoding not in ENCODINGS:
        raise ValueError(f"{TENSOR_ENCODING} {encoding!r} is none of {', '.join(ENCODINGS)}")
    return encoding


def files_of(path: Path) -> list[str]:
    """Every file of a checkpoint but the marker, the manifest and its parts, as sorted relative paths."""
    skip = {MARKER, MANIFEST, DAMAGED}
    return sorted(
        rel
        for f in path.rglob("*")
        if f.is_file() and f.name not in skip and not (rel := str(f.relative_to(path))).startswith(f"{PARTS_DIR}/")
    )


_OWNER = re.compile(r"^__(\d+)_|rank[-_](\d+)")


def file_owner(rel: str, world_size: int) -> int:
    """The rank that wrote a checkpoint file, by its name: DCP's ``__<rank>_<n>.distcp``, ``rng/rank-<rank>.pt``;
    anything else (``.metadata``, ``trainer_state.json``) is rank 0's."""
    m = _OWNER.search(Path(rel).name)
    rank = int(m.group(1) or m.group(2)) if m else 0
    return rank if rank < world_size else 0


def shard_owners(shards: list[str], world_size: int) -> dict[str, int]:
    """The rank of ``world_size`` that verifies each DCP shard at a load: its writer's rank mapped contiguously onto
    this world (writer w of W -> w * world_size // W). On the same world size a rank verifies its own files; on
    another one, the files holding the part of the model a rank loads (FSDP and ZeRO shard contiguously), so a
    resharded load still hashes most bytes while reading them, and every rank gets a share."""
    writers = {rel: file_owner(rel, 1 << 30) for rel in shards}
    saved_world = max(writers.values(), default=0) + 1
    return {rel: w * world_size // saved_world for rel, w in writers.items()}


def digest(file: Path, checksum: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"size": file.stat().st_size}
    if checksum:
        entry["sha256"] = file_sha256(file)
    return entry


def own_digests(path: Path, ranks: Ranks, written: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Size and sha256 of the files this rank wrote (``file_owner``), the work spread over the ranks as the writing
    was: the shards' from ``written`` (hashed while DCP wrote them, :class:`HashingWriter`), the few small
    others read back while they are still in this node's page cache."""
    return {
        rel: written[rel] if rel in written else digest(path / rel, checksum=True)
        for rel in files_of(path)
        if file_owner(rel, ranks.world_size) == ranks.rank
    }


def write_manifest(
    path: Path, ranks: Ranks, written: dict[str, dict[str, Any]], *, distributed: bool, storage: Storage | None = None
) -> None:
    """MANIFEST.json: size and sha256 of every file, each hashed by the rank that wrote it, written by rank 0
    through ``storage`` (None: the directory by path).
    ``distributed``: the ranks' parts are gathered by a collective (sync save); else (async save, in the
    background thread where no collective may run) rank 0 reads the part each rank wrote into .manifest/."""
    if distributed:
        parts: list[dict[str, Any]] = gather(own_digests(path, ranks, written), ranks.group, ranks.world_size)
    else:
        parts = collect_parts(path, ranks.world_size)
    if ranks.rank != 0:
        return
    entries = {rel: e for part in parts for rel, e in part.items()}
    hashed_by = {str(r): sum(e["size"] for e in part.values()) for r, part in enumerate(parts)}
    for rel in sorted(set(files_of(path)) - set(entries)):  # a file no naming rule gave a rank: hash it here
        entries[rel] = digest(path / rel, checksum=True)
        hashed_by["0"] += entries[rel]["size"]
    manifest = {"files": entries, "hashed_by": hashed_by, TENSOR_ENCODING: RAW}
    with (storage or PosixStorage(path.parent)).open_writer(path, MANIFEST) as f:
        f.write(json.dumps(manifest, indent=0, sort_keys=True).encode())
    shutil.rmtree(path / PARTS_DIR, ignore_errors=True)


def write_part(
    path: Path, ranks: Ranks, written: dict[str, dict[str, Any]], failed: BaseException | None = None
) -> None:
    """Async save, every rank, in the background thread: this rank's digests (or its failure) for rank 0."""
    name = f"rank-{ranks.rank:05d}.{'failed' if failed is not None else 'json'}"
    text = f"{type(failed).__name__}: {failed}" if failed is not None else json.dumps(own_digests(path, ranks, written))
    atomic_write(path / PARTS_DIR / name, text)


def collect_parts(path: Path, world_size: int) -> list[dict[str, Any]]:
    """Rank 0, async save: wait for every rank's part (a rank's background thread may finish after ours)."""
    parts = [path / PARTS_DIR / f"rank-{r:05d}.json" for r in range(world_size)]
    deadline = time.monotonic() + ASYNC_PARTS_TIMEOUT_S
    while not all(p.is_file() for p in parts):
        failed = sorted(p.name for p in (path / PARTS_DIR).glob("*.failed"))
        if failed:
            raise RuntimeError(f"rank(s) failed to finish their part of the save: {', '.join(failed)}")
        if time.monotonic() > deadline:
            missing = [p.name for p in parts if not p.is_file()]
            raise TimeoutError(f"no part from {', '.join(missing)} after {ASYNC_PARTS_TIMEOUT_S:.0f} s")
        time.sleep(0.05)
    return [json.loads(read_record(p)) for p in parts]
