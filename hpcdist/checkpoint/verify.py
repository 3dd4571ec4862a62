"""Is a checkpoint intact, and does it fit this model: its files against the manifest (the work spread over the
ranks, each hashing its share once) and its model's names and global shapes against this one's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hpcdist.agree import gather
from hpcdist.checkpoint import manifest as manifest_io
from hpcdist.checkpoint.errors import READ_DAMAGE, CheckpointMismatch, CheckpointUnavailable, describe_error, read_kind
from hpcdist.checkpoint.manifest import MANIFEST, files_of, is_shard, read_manifest
from hpcdist.checkpoint.ranks import Ranks
from hpcdist.checkpoint.storage import PosixStorage, Storage


def verify_checkpoint(
    path: Path, mode: str, *, shards: bool, ranks: Ranks, storage: Storage | None = None
) -> list[str]:
    """Collective: what is wrong with ``path`` against its manifest (empty = intact). ``mode``: checksum,
    size or none. ``shards=False``: the DCP shards (``*.distcp``) are checked by size
    only; their sha256 is taken while the load reads them (:class:`HashingReader`, ``shard_verdict``)."""
    if mode == "none":
        return []
    if not (storage or PosixStorage(path.parent)).has(path, MANIFEST):  # every save writes one before the marker
        return [f"{MANIFEST}: missing, so nothing in it can be verified (set checkpoint.verify=none to trust it)"]
    # a read error that says nothing about the file (EIO, MemoryError) is raised as CheckpointUnavailable, after
    # this rank has taken its part in the collective below (the caller's agreement then stops every rank alike)
    transient: list[str] = []
    try:
        manifest = read_manifest(path, checksum=mode == "checksum", storage=storage)
    except ValueError as e:
        return [f"{MANIFEST}: unparsable ({e})"]
    except (OSError, MemoryError) as e:
        if read_kind(e) == READ_DAMAGE:
            return [f"{MANIFEST}: unreadable ({e})"]
        manifest, transient = {}, [f"{MANIFEST}: {describe_error(e)}"]

    def digest(rel: str) -> dict[str, Any]:
        try:
            checksum = mode == "checksum" and (shards or not is_shard(rel))
            # a file of another size than the manifest's is damaged whatever its bytes, and may be any size at
            # all (a sparse terabyte): not hashed
            checksum = checksum and (path / rel).stat().st_size == manifest[rel]["size"]
            return manifest_io.digest(path / rel, checksum)
        except (OSError, MemoryError) as e:
            return {"missing": True} if read_kind(e) == READ_DAMAGE else {"transient": describe_error(e)}

    present = set(files_of(path))
    problems = [f"{rel}: missing" for rel in sorted(set(manifest) - present)]
    found = ranks.spread(sorted(set(manifest) & present), digest)
    transient += [f"{rel}: {got['transient']}" for rel, got in sorted(found.items()) if "transient" in got]
    if transient:
        raise CheckpointUnavailable(f"reading {path} failed: {'; '.join(transient[:3])}", path=path)
    for rel, got in sorted(found.items()):
        want = manifest[rel]
        if "missing" in got:
            problems.append(f"{rel}: missing")
        elif got["size"] != want["size"]:
            problems.append(f"{rel}: {got['size']} bytes, the manifest says {want['size']} (truncated or altered)")
        elif mode == "checksum" and "sha256" in got and got["sha256"] != want["sha256"]:
            problems.append(f"{rel}: sha256 differs from the manifest (altered)")
    return problems


def model_diff(metadata: Any, model: dict[str, Any], ranks: Ranks) -> dict[str, list[str]]:
    """Collective: this model's weights against the checkpoint's, by name and global shape. ``missing``: here,
    not saved; ``unexpected``: saved, on no rank here (keys gathered: a pipeline stage holds only its own
    layers); ``shape``: both, different shapes (DTensor shapes are global, so layouts do not matter), and
    ``shape_detail`` says how."""
    saved = {
        key[len("model.") :]: tuple(meta.size)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and hasattr(meta, "size")
    }
    mine = {
        k: tuple(v.shape) if isinstance(v, torch.Tensor) else tuple(v)
        for k, v in model.items()
        if isinstance(v, (torch.Tensor, tuple))
    }
    wanted = {k for part in gather(sorted(mine), ranks.group, ranks.world_size) for k in part}
    return {
        "missing": sorted(set(mine) - set(saved)),
        "unexpected": sorted(set(saved) - wanted),
        "shape": (shape := [k for k, s in sorted(mine.items()) if k in saved and saved[k] != s]),
        "shape_detail": [f"{k}: checkpoint {list(saved[k])}, this model {list(mine[k])}" for k in shape],
    }


def check_model_shapes(path: Path, metadata: Any, model: dict[str, Any], ranks: Ranks) -> None:
    """Collective: CheckpointMismatch naming the parameters when the checkpoint's model is not this model.

    Without it a smaller model loaded a bigger one's checkpoint silently (DCP loads only the keys asked for)
    and a bigger one failed inside DCP with a message that hid the cause."""
    diff = model_diff(metadata, model, ranks)
    problems = [f"{k}: not in the checkpoint" for k in diff["missing"]]
    problems += [f"{k}: in the checkpoint, not in this model" for k in diff["unexpected"]]
    problems += diff["shape_detail"]
    if problems:
        shown = "; ".join(problems[:3]) + (f"; ... ({len(problems)} in all)" if len(problems) > 3 else "")
        raise CheckpointMismatch(
            f"{path} holds a different model ({shown}): model.* must match the run that saved it; use a new "
            "run.dir (or checkpoint.resume=none) to train this model from scratch, or checkpoint.init_from="
            f"{path} in a new run.dir to start from its weights",
            path=path,
        )
