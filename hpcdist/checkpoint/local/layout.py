"""The node-local tier's layout and the checks of what it finds on a node's disk: each rank's own and replica
directories, the run's key, the placement of the peer copies (node i -> node i+1), the step every rank can restore,
the directory's own checks (yours, mode 0700, no link, not a shared file system) and a step directory's (its
files against its manifest)."""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import json
import os
import re
import shutil
import stat
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hpcdist.base.atomic import file_sha256
from hpcdist.base.logging_utils import get_logger
from hpcdist.base.owners import user_name, writer_problem
from hpcdist.checkpoint.codec import read_metadata
from hpcdist.checkpoint.errors import describe_error
from hpcdist.checkpoint.manifest import MANIFEST, read_record
from hpcdist.checkpoint.names import MARKER, STEP_PATTERN
from hpcdist.checkpoint.state import STATE_FILE
from hpcdist.config.loader import ConfigError

RNG_FILE, OWN_FILE = "rng.pt", "rank.pt"

log = get_logger(__name__)
MAX_FILES = 10_000


# file systems that are not a node's own disk: the tier on them is a slower shared tier that every job loads
SHARED_FS = frozenset({"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "ceph", "glusterfs", "fuse.sshfs"})


DAMAGED_NAME = re.compile(rf"^{STEP_PATTERN}\.damaged-")  # a step set aside by a restore


TIER_DIR = re.compile(r"^(rank|replica-of-rank)-(\d{5})$")


FILE_NAME = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.-]{0,254}$")


def own_dir(root: Path, rank: int) -> Path:
    return root / f"rank-{rank:05d}"


def replica_dir(root: Path, origin: int) -> Path:
    return root / f"replica-of-rank-{origin:05d}"


def run_key(run_dir: Path) -> str:
    """The subdirectory of ``checkpoint.local.dir`` that holds one run's steps: named from its run dir (the resolved
    path and the directory's inode, so a run dir made again at the same path is another run on most file systems).
    Two runs sharing the tier's directory (the ``/dev/shm/hpcdist-{job_id}`` template outside SLURM) then never
    see, replace or prune each other's steps. Each node derives it alone: only its own disk is keyed by it."""
    real = os.path.realpath(run_dir)
    inode = 0
    with contextlib.suppress(OSError):
        inode = os.stat(real).st_ino
    return "run-" + hashlib.sha256(f"{real}\0{inode}".encode()).hexdigest()[:16]


def set_aside(path: Path, why: str) -> Path:
    """Rename ``path`` to ``<name>.<why>-<time>`` beside it (never deleted: a damaged step is evidence, and
    something the tier did not write is not its to remove); the new path. No tier name matches it again, so no
    restore, prune or discard touches it."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(1000):
        aside = path.with_name(f"{path.name}.{why}-{stamp}" + (f"-{i}" if i else ""))
        if not os.path.lexists(aside):
            os.rename(path, aside)
            return aside
    raise OSError(f"{path}: no free name to set it aside")


def make_room(path: Path) -> None:
    """Before this run writes ``path`` (a step-N or its .partial in its own directory): a directory of ours there
    is this run's own earlier files of that step, removed; anything else (a link, a file) is moved aside, never
    followed or deleted."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode) and not writer_problem(st, {os.getuid()}):
        shutil.rmtree(path)
    else:
        aside = set_aside(path, "moved")
        log.warning("checkpoint.local: %s was not a directory of the tier's: moved aside as %s", path, aside.name)


def expand_dir(template: str, *, host: str, job_id: str | None) -> Path:
    """checkpoint.local.dir with its placeholders filled (the rules allow only these three)."""
    return Path(
        template.replace("{job_id}", job_id or "nojob").replace("{user}", getpass.getuser()).replace("{host}", host)
    )


# ------------------------------------------------------------------------------------------ who holds what
def peers(hosts: Sequence[str]) -> list[int]:
    """peer[r]: the rank that keeps rank r's copy: the rank at r's position among its node's ranks on the next node
    (nodes in the order of their first rank; a node with fewer ranks: position modulo its count). All -1 on one
    node: a copy on the same node dies with it."""
    nodes: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        nodes.setdefault(host, []).append(rank)
    order = list(nodes.values())
    if len(order) < 2:
        return [-1] * len(hosts)
    out = [-1] * len(hosts)
    for i, ranks in enumerate(order):
        nxt = order[(i + 1) % len(order)]
        for j, rank in enumerate(ranks):
            out[rank] = nxt[j % len(nxt)]
    return out


@dataclass(frozen=True)
class LocalPlan:
    """What a resume takes from the local tier: ``step`` (None: the shared tier) and, per rank, the rank whose
    node holds that rank's files of it (itself, or the rank keeping its copy); ``why``: the reason, for the log."""

    step: int | None
    sources: dict[int, int] = field(default_factory=dict)
    why: str = ""


def agree_step(inventories: Sequence[Mapping[int, Iterable[int]]], world_size: int, shared: int | None) -> LocalPlan:
    """The newest step complete for every rank counting peer copies. ``inventories[s]``: {rank: complete steps of
    that rank's files} on rank s's node (its own files and the copies it keeps); ``shared``: the newest complete
    shared checkpoint's step (None: none). Each rank's files come from itself when it has them, else from the
    lowest rank holding them. A local step older than ``shared`` loses to it (the shared one is newer progress)."""
    holders: dict[tuple[int, int], list[int]] = {}
    for s, inv in enumerate(inventories):
        for origin, steps in inv.items():
            if 0 <= origin < world_size:
                for step in steps:
                    holders.setdefault((origin, step), []).append(s)
    candidates = sorted({step for _, step in holders}, reverse=True)
    for step in candidates:
        if all((r, step) in holders for r in range(world_size)):
            if shared is not None and step < shared:
                return LocalPlan(
                    None,
                    why=f"its newest step complete on every rank ({step}) is older than the "
                    f"shared checkpoint of step {shared}",
                )
            sources = {r: r if r in holders[(r, step)] else min(holders[(r, step)]) for r in range(world_size)}
            return LocalPlan(step, sources, why=f"step {step} is complete for every rank")
    if not candidates:
        return LocalPlan(None, why="it holds no complete step")
    newest = candidates[0]
    missing = [r for r in range(world_size) if (r, newest) not in holders]
    return LocalPlan(
        None,
        why=f"no step is complete for every rank (step {newest}: rank(s) "
        f"{', '.join(map(str, missing[:8]))} have neither their files nor a copy)",
    )


def rounds(pairs: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """(sender, receiver) pairs split into rounds in which a rank sends at most once and receives at most once:
    within a round every rank posts its send before it waits on its receive, so a ring cannot deadlock."""
    out: list[list[tuple[int, int]]] = []
    for src, dst in pairs:
        for r in out:
            if all(src != a and dst != b for a, b in r):
                r.append((src, dst))
                break
        else:
            out.append([(src, dst)])
    return out


# ------------------------------------------------------------------------------------------ the directory
def _fs_type(path: Path) -> str | None:
    """The file system type of the mount holding ``path`` (/proc/self/mounts, longest mount point), None if
    unknown."""
    best, kind = "", None
    with contextlib.suppress(OSError), open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
        for line in f.read(4 << 20).splitlines():
            parts = line.split()
            if len(parts) < 3:
                continue
            mount = parts[1].replace("\\040", " ")
            inside = str(path) == mount or str(path).startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best):
                best, kind = mount, parts[2]
    return kind


def open_local_dir(path: Path) -> Path:
    """Create (mode 0700) or check the tier's directory on this node; ConfigError (one line) when it cannot be
    ours: reached through a link, owned by another user, writable by others, on a shared file system."""
    key = "checkpoint.local.dir"
    for p in (path, *path.parents):  # no link anywhere on the way: the directory is what the path says
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise ConfigError([f"{key}: cannot look at {str(p)!r} ({e.strerror}); choose another directory"]) from None
        if stat.S_ISLNK(st.st_mode):
            raise ConfigError(
                [
                    f"{key}: {str(p)!r} is a link (to {os.path.realpath(p)!r}); the tier never follows links: give the "
                    "real directory"
                ]
            )
    for p in path.parents:  # who can rename the way to it: a writer of any directory above could move the tier
        try:  # away and put theirs in its place; a sticky directory of yours or root's (/dev/shm, /tmp) lets nobody
            st = os.lstat(p)  # rename another's entry
        except FileNotFoundError:
            continue
        except OSError:
            continue  # not readable here: the mkdir below says what is wrong
        if st.st_mode & stat.S_ISVTX and st.st_uid in (os.getuid(), 0):
            continue
        why = writer_problem(st, {os.getuid(), 0})
        if why:
            raise ConfigError(
                [
                    f"{key}: {str(p)!r}, above the tier's directory, {why} without the sticky bit: whoever can "
                    "write it can rename the tier away and put another in its place; choose a directory below ones "
                    "only you (or root) can write, e.g. /dev/shm/hpcdist-{user}-{job_id}"
                ]
            )
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        raise ConfigError(
            [f"{key}: cannot create {str(path)!r} ({e.strerror}); choose a writable node-local directory"]
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError([f"{key}: {str(path)!r} exists and is not a directory; choose another directory"])
    if st.st_uid != os.getuid():
        raise ConfigError(
            [
                f"{key}: {str(path)!r} belongs to {user_name(st.st_uid)}, not to you; another job's "
                "directory on this node: choose your own (e.g. with {job_id} or {user} in it)"
            ]
        )
    if stat.S_IMODE(st.st_mode) & 0o022:
        raise ConfigError(
            [
                f"{key}: {str(path)!r} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}); "
                f"chmod 700 it or choose another directory"
            ]
        )
    kind = _fs_type(path)
    if kind in SHARED_FS:
        raise ConfigError(
            [
                f"{key}: {str(path)!r} is on a shared file system ({kind}), not the node's own disk; "
                "use /dev/shm or a local disk (the shared tier is checkpoint.dir)"
            ]
        )
    return path


def listing(path: Path) -> dict[str, int]:
    """{name: size} of a step directory's regular files; ValueError for anything else in it (a link, a FIFO, a
    directory, a foreign name): the tier's step directories hold flat regular files only."""
    out: dict[str, int] = {}
    with os.scandir(path) as entries:
        for e in entries:
            st = e.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or not FILE_NAME.match(e.name):
                raise ValueError(f"{e.name}: not a regular file of the tier")
            out[e.name] = st.st_size
            if len(out) > MAX_FILES:
                raise ValueError(f"more than {MAX_FILES} files")
    return out


def complete_marker(path: Path, origin: int, step: int, world_size: int) -> bool:
    """A step directory whose COMPLETE marker (bounded read) names this rank, step and world size."""
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or writer_problem(st, {os.getuid()}):
            return False
        marker = json.loads(read_record(path / MARKER, 4096))
    except (OSError, ValueError, RecursionError):
        return False
    # type() is int: JSON's false and true equal 0 and 1 in Python, and are no rank or world size
    return isinstance(marker, dict) and all(
        type(marker.get(k)) is int and marker[k] == v
        for k, v in (("step", step), ("rank", origin), ("world_size", world_size))
    )


def verify_step_dir(path: Path) -> list[str]:
    """What is wrong with a step directory of the tier (empty: every file matches the manifest by size and sha256,
    nothing else is there, no link, everything yours and writable by you alone)."""
    try:
        problems = [f"{n}: {why}" for n, why in trust_problems(path)]
        if problems:
            return problems
        have = listing(path)
        manifest = json.loads(read_record(path / MANIFEST))
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(files, dict) or len(files) > MAX_FILES:
            return [f"{MANIFEST}: no files mapping"]
        # the trainer state is parsed by the restore: one that does not parse is as damaged as a wrong hash
        json.loads(read_record(path / STATE_FILE))
    except (OSError, ValueError, RecursionError) as e:
        return [describe_error(e)]
    problems = [f"{n}: not in the manifest" for n in sorted(set(have) - set(files) - {MANIFEST, MARKER})]
    for name, want in sorted(files.items()):
        if not isinstance(want, dict) or not isinstance(want.get("size"), int):
            problems.append(f"{name}: malformed manifest entry")
        elif name not in have:
            problems.append(f"{name}: missing")
        elif have[name] != want["size"]:
            problems.append(f"{name}: {have[name]} bytes, the manifest says {want['size']}")
        elif file_sha256(path / name) != want.get("sha256"):
            problems.append(f"{name}: sha256 differs from the manifest")
    if not problems and ".metadata" in files:  # the bytes are the manifest's: DCP's metadata must also parse
        try:
            read_metadata(path)
        except (OSError, ValueError) as e:
            problems.append(describe_error(e))
    return problems


def trust_problems(path: Path) -> list[tuple[str, str]]:
    from hpcdist.config.dirs import tree_trust_problems

    return tree_trust_problems(path, {os.getuid()})


# ------------------------------------------------------------------------------------------ state
def localize(obj: Any) -> Any:
    """The state dict with every DTensor replaced by its local shard (a view: loading into it fills the DTensor):
    each rank's save is a one-process DCP checkpoint of what it holds."""
    if hasattr(obj, "to_local") and isinstance(obj, torch.Tensor):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: localize(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [localize(v) for v in obj]
    return obj


def merge_back(dest: Any, loaded: Any) -> Any:
    """``dest`` with what DCP loaded into its localized copy: tensors were filled in place (the same objects, or
    views of a DTensor's shard); other values (param groups, Python numbers) are taken from ``loaded``."""
    if isinstance(dest, dict) and isinstance(loaded, dict):
        for k in dest:
            if k in loaded:
                dest[k] = merge_back(dest[k], loaded[k])
        return dest
    if isinstance(dest, list) and isinstance(loaded, list) and len(dest) == len(loaded):
        return [merge_back(a, b) for a, b in zip(dest, loaded, strict=True)]
    if isinstance(dest, torch.Tensor):
        if not hasattr(dest, "to_local") and loaded is not dest:
            dest.copy_(loaded)
        return dest
    return loaded


def same_run(saved: Any, now: dict[str, Any]) -> str | None:
    """Why a local step's trainer state is not this run's (another run.dir, model, data, layout or seed that
    left files in the same node-local directory); None when it is."""
    cfg, mine = saved.get("config") if isinstance(saved, dict) else None, now.get("config") or {}
    if not isinstance(cfg, dict):
        return "no config in its trainer state"
    for section, keys in (("run", ("dir", "seed")), ("model", None), ("data", None), ("parallel", None)):
        a, b = cfg.get(section), mine.get(section)
        if not isinstance(a, dict) or not isinstance(b, dict):
            return f"no {section} section"
        for k in keys or sorted(set(a) | set(b)):
            if json.dumps(a.get(k), sort_keys=True, default=str) != json.dumps(b.get(k), sort_keys=True, default=str):
                return f"saved with {section}.{k}={a.get(k)!r} (now {b.get(k)!r})"
    return None
