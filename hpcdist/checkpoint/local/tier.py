"""The node-local checkpoint tier with peer copies (``checkpoint.local``; docs/FAULTS.md).

Shared-file-system checkpoints cannot be taken every few minutes by every job; a node's own disk (``/dev/shm``, a
local NVMe) can. Each rank saves its own state there at the tier's cadence (the one cadence owner,
``CheckpointManager.local_save_due``); then, on a background thread while training goes on, every node's files are
copied to the next node (node i -> node i+1 mod n) over the job's own ranks (a gloo group of the copy's own;
point-to-point messages of at most ``CHUNK`` bytes: memory stays bounded, no ssh). The loop waits for the copy
(``LocalTier.wait``) only before the next local save, a restore and the run's end. A restart (a new run, an
in-job restart, a requeue onto the same nodes) takes the newest step that is intact for every rank counting
those copies (a damaged directory is set aside and the next copy or step tried), when it is at least as new as the
newest shared checkpoint; a rank whose own files are gone gets them from the rank holding its copy. Otherwise the
shared tier resumes.

Layout on each node, under the expanded ``checkpoint.local.dir`` (mode 0700, yours, reached through no link), in
the run's own ``run-<key>/`` (``run_key``: another run sharing the directory never touches these):

    rank-00003/step-00000120/       rank 3's own save of step 120, restorable on its own:
        __0_0.distcp, .metadata     its DCP state (what this rank holds of model + optimizer), a one-process DCP
                                    checkpoint (so loading it needs no other rank's files)
        trainer_state.json rng.pt   its trainer state and RNG; rank.pt: its own state (PowerSGD), when it has some
        MANIFEST.json               size + sha256 of every file above (hashed while written)
        COMPLETE                    written last
    replica-of-rank-00001/step-00000120/   the same files of rank 1 (on the previous node), copied here; their
                                    COMPLETE is written here once every byte matched the manifest
    *.partial                       a save or a copy in progress: never trusted, removed by the next save
    step-N.damaged-<time>           a step that failed its checks at a restore: kept, never tried again

The directory may have been another job's on a shared node: nothing in it is trusted before it passed the checks
of the shared tier (owner, permissions, no link leading out: tree_trust_problems; sizes and sha256 against the
manifest) and every read is bounded. Pruning deletes only ``step-N`` / ``step-N.partial`` directories in the run's
own ``rank-*`` and ``replica-of-rank-*`` directories; a damaged step is set aside, never deleted.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import json
import os
import re
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from hpcdist.atomic import atomic_write, file_sha256
from hpcdist.checkpoint.codec import HashingReader, HashingWriter, single_process_dcp
from hpcdist.checkpoint.errors import describe_error, error_of
from hpcdist.checkpoint.manifest import MANIFEST, TENSOR_ENCODING, read_record, tensor_encoding
from hpcdist.checkpoint.names import MARKER, STEP_PATTERN, STEP_RE, step_name
from hpcdist.checkpoint.staging import size_text
from hpcdist.checkpoint.state import STATE_FILE, Checkpointable, rng_state, set_rng_state
from hpcdist.config.loader import ConfigError
from hpcdist.logging_utils import get_logger
from hpcdist.owners import user_name, writer_problem

log = get_logger(__name__)

CHUNK = 16 << 20  # bytes per point-to-point message: one send and one receive buffer per rank at a time
HEADER_MAX = 1 << 20  # a copy's file list, JSON
MAX_FILES = 10_000
RNG_FILE, OWN_FILE = "rng.pt", "rank.pt"
# after an error, how long the trainer waits for a peer copy in flight before it exits (its peers' copy threads run
# on, so it usually ends: the 13B flagship's ~13 s per node at the a100_ib profile); then it is left (daemon thread)
EXIT_WAIT_S = 120.0
RECORD = "local_checkpoints.json"  # in run.dir (rank 0): what `hpcdist status` and the report show of the tier
# file systems that are not a node's own disk: the tier on them is a slower shared tier that every job loads
SHARED_FS = frozenset({"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "ceph", "glusterfs", "fuse.sshfs"})
_DAMAGED_NAME = re.compile(rf"^{STEP_PATTERN}\.damaged-")  # a step set aside by a restore
_TIER_DIR = re.compile(r"^(rank|replica-of-rank)-(\d{5})$")
# a restore's outcome for one agreed step, worst last (every rank takes the largest)
_LOADED, _DAMAGED_SET_ASIDE, _GIVE_UP, _ELSEWHERE = 0, 1, 2, 3
_FILE = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.-]{0,254}$")


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


def _make_room(path: Path) -> None:
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


def _listing(path: Path) -> dict[str, int]:
    """{name: size} of a step directory's regular files; ValueError for anything else in it (a link, a FIFO, a
    directory, a foreign name): the tier's step directories hold flat regular files only."""
    out: dict[str, int] = {}
    with os.scandir(path) as entries:
        for e in entries:
            st = e.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or not _FILE.match(e.name):
                raise ValueError(f"{e.name}: not a regular file of the tier")
            out[e.name] = st.st_size
            if len(out) > MAX_FILES:
                raise ValueError(f"more than {MAX_FILES} files")
    return out


def _complete_marker(path: Path, origin: int, step: int, world_size: int) -> bool:
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
        problems = [f"{n}: {why}" for n, why in _trust(path)]
        if problems:
            return problems
        have = _listing(path)
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
    return problems


def _trust(path: Path) -> list[tuple[str, str]]:
    from hpcdist.config.dirs import tree_trust_problems

    return tree_trust_problems(path, {os.getuid()})


# ------------------------------------------------------------------------------------------ state
def _localize(obj: Any) -> Any:
    """The state dict with every DTensor replaced by its local shard (a view: loading into it fills the DTensor):
    each rank's save is a one-process DCP checkpoint of what it holds."""
    if hasattr(obj, "to_local") and isinstance(obj, torch.Tensor):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: _localize(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_localize(v) for v in obj]
    return obj


def _merge_back(dest: Any, loaded: Any) -> Any:
    """``dest`` with what DCP loaded into its localized copy: tensors were filled in place (the same objects, or
    views of a DTensor's shard); other values (param groups, Python numbers) are taken from ``loaded``."""
    if isinstance(dest, dict) and isinstance(loaded, dict):
        for k in dest:
            if k in loaded:
                dest[k] = _merge_back(dest[k], loaded[k])
        return dest
    if isinstance(dest, list) and isinstance(loaded, list) and len(dest) == len(loaded):
        return [_merge_back(a, b) for a, b in zip(dest, loaded, strict=True)]
    if isinstance(dest, torch.Tensor):
        if not hasattr(dest, "to_local") and loaded is not dest:
            dest.copy_(loaded)
        return dest
    return loaded


def _same_run(saved: Any, now: dict[str, Any]) -> str | None:
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


# ------------------------------------------------------------------------------------------ the tier
class LocalTier:
    """One rank's side of the tier; ``save`` and ``restore`` are collective (every rank calls them)."""

    def __init__(
        self,
        root: Path,
        *,
        rank: int,
        world_size: int,
        hosts: Sequence[str],
        keep: int,
        record: Path | None = None,
        template: str = "",
        shared_dir: str = "",
        timeout_s: float | None = None,
    ):
        self.root, self.rank, self.world_size, self.keep = root, rank, world_size, keep
        self.peer = peers(hosts)
        self.hosts = list(hosts)
        # rank 0 writes the record after each save (`hpcdist status`, the report: the login node cannot look here)
        self.record, self.template, self.shared_dir = record, template, shared_dir
        self.last_step: int | None = None  # the newest complete local step (this rank's and its copy)
        self.bytes_per_node = 0
        self.foreign = False  # restore found another run's step here (another run.dir / model sharing the directory)
        self.load_failed = False  # a restore's load failed part-way: the state holds part of it until loaded again
        self._pg = dist.new_group(backend="gloo") if dist.is_initialized() else None
        # the peer copy runs on a thread of its own (``save``), over a group of its own: two threads sharing one
        # group deadlock. Its collectives give up after ``timeout_s`` (the job's collective timeout; None: torch's
        # default, 30 min): a peer that died or froze mid-copy ends the copy (logged), never holds the run
        self.timeout_s = timeout_s
        self._copy_pg = (
            dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s) if timeout_s else None)
            if dist.is_initialized()
            else None
        )
        self._copy: threading.Thread | None = None  # the last save's copy, until wait() joins it
        self._copied = True  # whether that copy made every peer copy
        if all(p < 0 for p in self.peer):
            log.warning(
                "checkpoint.local: every rank runs on one node: no peer copies (a lost node loses the tier's steps; "
                "the shared checkpoint stays the fallback)"
            )

    # ---------------------------------------------------------------------------------- collectives
    # ``group``: the loop's (None: ``_pg``) or the background copy's (``_copy_pg``); never one from two threads
    def _all_ok(self, err: BaseException | None, what: str, group: Any = None) -> bool:
        if err is not None:
            log.error("rank %d: checkpoint.local: %s failed: %s", self.rank, what, describe_error(err))
        g = self._pg if group is None else group
        if g is None:
            return err is None
        flag = torch.tensor([0 if err is None else 1])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=g)
        return int(flag) == 0

    def _gather(self, obj: Any, group: Any = None) -> list[Any]:
        g = self._pg if group is None else group
        if g is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=g)  # the job's own ranks: no file is unpickled
        return out

    # ---------------------------------------------------------------------------------- save
    def save(self, step: int, state: Checkpointable) -> bool:
        """Collective: this rank's files of ``step`` on its node and every rank's agreement that they are there
        (what the loop waits for: a node's own disk is fast), after the previous save's copy has ended (``wait``).
        Then, on a background thread, every node's files to its peer, the prune and the record (the copy crosses
        the inter-node links: the slow part). False when the local save failed on any rank (the step is dropped
        everywhere, training goes on); a failed copy leaves the step without a copy (logged): it still counts
        where every rank's own files are there."""
        self.wait()
        t0 = time.perf_counter()
        final = own_dir(self.root, self.rank) / step_name(step)
        partial = final.with_name(final.name + ".partial")
        written: list[int] = []

        def write() -> None:
            _make_room(final)  # saved again: the old files go first, so a failed save leaves no step of two lines
            written.append(self._write(partial, step, state))
            partial.rename(final)

        err = error_of(write)
        if not self._all_ok(err, f"saving step {step}"):
            shutil.rmtree(partial, ignore_errors=True)
            shutil.rmtree(final, ignore_errors=True)  # complete here, failed on another rank: not a step
            return False
        self.last_step = step  # every rank's own files are there: a step to resume from, with or without copies
        loop_s = time.perf_counter() - t0
        nbytes = written[0] if written else 0
        if all(p < 0 for p in self.peer):  # nothing to copy (one node): the prune and the record, here
            self._finish(step, nbytes, loop_s, t0, None)
        else:  # every rank starts its thread after the same agreement: the copy's collectives pair up in order
            self._copied = False
            self._copy = threading.Thread(
                target=self._finish,
                args=(step, nbytes, loop_s, t0, self._copy_pg),
                name=f"hpcdist-local-copy-{step}",
                daemon=True,  # a copy left running (wait's bound, the exception path) never holds the exit
            )
            self._copy.start()
        return True

    def _finish(self, step: int, nbytes: int, loop_s: float, t0: float, group: Any) -> None:
        """After the local save: the peer copies, the prune, the size gather and rank 0's record, on the background
        thread (``group``: its own) or, with no copy to make, in the loop (``group`` None: the loop's). Every rank
        runs the same collectives in the same order. A collective that fails or times out (a peer gone) ends the
        copy: logged once, the step has no copy."""
        copied = False
        try:
            copied = self._replicate(step, group)
        except Exception as e:  # a collective failed or timed out (a peer gone): the group is of no more use
            log.warning(
                "rank %d: checkpoint.local: the peer copies of step %d failed (%s): the step has no copy",
                self.rank,
                step,
                describe_error(e),
            )
        else:
            # after the copy, whatever its outcome: its own failures are said as what they are, not as the copy's
            err = error_of(self._prune)
            if err is not None:
                log.warning(
                    "rank %d: checkpoint.local: pruning after step %d failed (%s): older steps stay until the next "
                    "save",
                    self.rank,
                    step,
                    describe_error(err),
                )
            try:  # every rank reaches this collective, whatever its prune did
                sizes = self._gather(nbytes, group)
                node_bytes: dict[str, int] = {}
                for r, n in enumerate(sizes):
                    node_bytes[self.hosts[r]] = node_bytes.get(self.hosts[r], 0) + n
                self.bytes_per_node = max(node_bytes.values()) * (2 if copied else 1)
            except Exception as e:
                log.warning(
                    "rank %d: checkpoint.local: gathering the sizes after step %d failed (%s): the record shows the "
                    "previous size",
                    self.rank,
                    step,
                    describe_error(e),
                )
        self._copied = copied or all(p < 0 for p in self.peer)
        seconds = time.perf_counter() - t0
        if self.rank == 0:
            log.info(
                "node-local checkpoint step %d complete%s (%.2fs in the loop, %.2fs in all, %s per node)",
                step,
                " with peer copies" if copied else "",
                loop_s,
                seconds,
                size_text(self.bytes_per_node),
            )
            self._write_record(step, copied, seconds)  # peer_copies: true only now, the copy complete

    def wait(self, timeout_s: float | None = None) -> bool:
        """Collective-free: join the last save's background copy (it ends by itself: its collectives time out
        at ``timeout_s`` of the tier). True when it made every peer copy (or none was running); False when it
        failed (logged by the thread) or still runs after ``timeout_s`` (None: no bound)."""
        copy = self._copy
        if copy is None:
            return self._copied
        copy.join(timeout_s)
        if copy.is_alive():
            log.warning(
                "checkpoint.local: the peer copy (%s) still runs after %.0f s: not waiting for it (its step has "
                "no complete copy; a .partial copy is never trusted)",
                copy.name,
                timeout_s or 0,
            )
            return False
        self._copy = None
        return self._copied

    def _write(self, path: Path, step: int, state: Checkpointable) -> int:
        """This rank's files of ``step`` into ``path`` (a fresh directory), manifest and marker last; bytes."""
        _make_room(path)  # a crashed save's leftover, in our own directory
        path.mkdir(mode=0o700, parents=True)
        writer = HashingWriter(str(path), thread_count=1)
        with single_process_dcp():
            dcp.save(_localize(state.dcp_state()), storage_writer=writer, no_dist=True)
        torch.save(rng_state(), path / RNG_FILE)
        own = state.rank_state()
        if own:
            torch.save(own, path / OWN_FILE)
        atomic_write(path / STATE_FILE, json.dumps(state.trainer_state()), durable=False)
        digests = writer.digests()
        files = {}
        for name in _listing(path):
            files[name] = digests.get(name) or {
                "size": (path / name).stat().st_size,
                "sha256": file_sha256(path / name),
            }
        atomic_write(
            path / MANIFEST,
            json.dumps({"files": files, "step": step, "rank": self.rank, TENSOR_ENCODING: HashingWriter.ENCODING}),
            durable=False,
        )
        atomic_write(path / MARKER, json.dumps({"step": step, "rank": self.rank, "world_size": self.world_size}))
        return sum(e["size"] for e in files.values())

    def _replicate(self, step: int, group: Any = None) -> bool:
        """Collective (over ``group``): every rank's files of ``step`` to its peer (replica-of-rank-<r>/ there).
        True when every copy arrived intact."""
        if all(p < 0 for p in self.peer):
            return False
        pairs = [(r, self.peer[r]) for r in range(self.world_size) if self.peer[r] >= 0]
        ok = self._transfer(
            pairs,
            step,
            lambda origin: own_dir(self.root, origin) / step_name(step),
            lambda origin: replica_dir(self.root, origin),
            restore=False,
            group=group,
        )
        if not ok:
            log.warning("checkpoint.local: the peer copies of step %d are incomplete (see the errors above)", step)
        return ok

    def _transfer(
        self,
        pairs: Sequence[tuple[int, int]],
        step: int,
        source: Callable[[int], Path],
        dest: Callable[[int], Path],
        *,
        restore: bool,
        group: Any = None,
    ) -> bool:
        """Collective (over ``group``, None: the loop's): for each (sender, receiver), the sender's
        ``source(origin)`` step directory lands in the receiver's ``dest(origin)``; ``origin``, the rank whose files
        they are, is the sender when replicating and the receiver when a restore fetches its files back (it travels
        in the header)."""
        err: BaseException | None = None
        for batch in rounds(pairs):
            send = next(((s, d) for s, d in batch if s == self.rank), None)
            recv = next(((s, d) for s, d in batch if d == self.rank), None)
            try:
                origin = (send[1] if restore else send[0]) if send is not None else -1
                self._exchange(step, send, recv, origin, source, dest, restore=restore, group=group)
            except Exception as e:
                err = err or e
        return self._all_ok(err, f"copying step {step} between nodes", group)

    def _exchange(
        self,
        step: int,
        send: tuple[int, int] | None,
        recv: tuple[int, int] | None,
        origin: int,
        source: Callable[[int], Path],
        dest: Callable[[int], Path],
        *,
        restore: bool,
        group: Any = None,
    ) -> None:
        """One round: send one step directory and/or receive one, in chunks. The sender posts every message
        before waiting for it; the receiver always drains what the sender announced, even after a problem, so the
        next round's messages stay in step."""
        g = self._pg if group is None else group
        header, files, src_dir, error = b"", [], None, None
        if send is not None:
            try:
                src_dir = source(origin)
                files = [(n, s) for n, s in sorted(_listing(src_dir).items()) if n != MARKER]
                header = json.dumps({"origin": origin, "step": step, "files": files}).encode()
                if len(header) > HEADER_MAX:
                    raise ValueError(f"a file list of {len(header)} bytes")
            except (OSError, ValueError) as e:  # announce nothing: the receiver expects nothing more
                error, header, files = e, b"", []
        sizes = torch.tensor([len(header), sum(s for _, s in files)], dtype=torch.int64)
        got = torch.zeros(2, dtype=torch.int64)
        self._round(g, send, recv, sizes, got)
        hdr = torch.frombuffer(bytearray(header), dtype=torch.uint8) if header else torch.zeros(0, dtype=torch.uint8)
        announced = int(got[0]) if recv is not None else 0
        if recv is not None and not 0 < announced <= HEADER_MAX:  # our own sender never announces more
            error = error or ValueError(f"rank {recv[0]} sent no file list (its log says why)")
            announced, recv = 0, None
        rhdr = torch.zeros(announced, dtype=torch.uint8)
        self._round(g, send, recv, hdr, rhdr)
        total = int(got[1]) if recv is not None else 0
        sink = None
        if recv is not None:  # whose files may come: the sender's own (a copy), or ours back (a restore)
            expect = self.rank if restore else recv[0]
            sink = _Sink(dest, rhdr.numpy().tobytes(), total, step, self.world_size, expect)
        sent_total = int(sizes[1])
        sent_chunks = _chunks(src_dir, files) if files else iter(())
        n_send = -(-sent_total // CHUNK) if send is not None else 0
        n_recv = -(-total // CHUNK)
        rbuf: torch.Tensor | None = None
        for i in range(max(n_send, n_recv)):
            work = None
            if send is not None and i < n_send:
                try:
                    out = next(sent_chunks)
                except (OSError, StopIteration) as e:  # a file shrank: zeros keep the receiver in step; its
                    error = error or e  # manifest check rejects the copy
                    out = torch.zeros(min(CHUNK, sent_total - i * CHUNK), dtype=torch.uint8)
                work = dist.isend(out, send[1], group=g)
            if sink is not None and recv is not None and i < n_recv:
                if rbuf is None:
                    rbuf = torch.empty(min(CHUNK, total), dtype=torch.uint8)  # one buffer, reused
                part = rbuf[: min(CHUNK, total - i * CHUNK)]
                dist.recv(part, recv[0], group=g)
                sink.write(part.numpy())
            if work is not None:
                work.wait()
        if sink is not None:
            sink.finish()  # raises what went wrong on the receiving side
        if error is not None:
            raise error

    @staticmethod
    def _round(
        g: Any, send: tuple[int, int] | None, recv: tuple[int, int] | None, out: torch.Tensor, into: torch.Tensor
    ) -> None:
        work = dist.isend(out, send[1], group=g) if send is not None and out.numel() else None
        if recv is not None and into.numel():
            dist.recv(into, recv[0], group=g)
        if work is not None:
            work.wait()

    def _prune(self) -> None:
        """Keep the ``keep`` newest complete steps of this rank's own directory and of the copy it keeps; remove
        older ones and every leftover ``.partial`` but the newest complete step's. Only the tier's own names."""
        mine = [own_dir(self.root, self.rank)]
        held = [o for o in range(self.world_size) if self.peer[o] == self.rank]
        mine += [replica_dir(self.root, o) for o in held]
        for d in mine:
            with contextlib.suppress(OSError):
                if not stat.S_ISDIR(os.lstat(d).st_mode):
                    continue
                names = sorted(e.name for e in os.scandir(d))
                complete = [n for n in names if STEP_RE.match(n) and (d / n / MARKER).is_file()]
                for n in names:
                    base = n.removesuffix(".partial")
                    if not STEP_RE.match(base):
                        continue  # not the tier's: never deleted
                    if n.endswith(".partial") or n not in complete[-self.keep :]:
                        p = d / n
                        if stat.S_ISDIR(os.lstat(p).st_mode):
                            shutil.rmtree(p, ignore_errors=True)

    def discard_newer(self, step: int) -> None:
        """After a resume at ``step`` (0: a fresh start): this node's steps of the tier newer than it are of the line
        the run turned back from; removed (own and copy directories, the tier's names only), so no later resume can
        take them together with the new line's files of the same step."""
        self.wait()  # no copy still writing into what is removed here
        with contextlib.suppress(OSError):
            for e in list(os.scandir(self.root)):
                if not _TIER_DIR.match(e.name) or not e.is_dir(follow_symlinks=False):
                    continue
                for s in list(os.scandir(e.path)):
                    m = STEP_RE.match(s.name.removesuffix(".partial"))
                    if m and int(m.group(1)) > step and s.is_dir(follow_symlinks=False):
                        shutil.rmtree(s.path, ignore_errors=True)

    def _write_record(self, step: int, copied: bool, seconds: float) -> None:
        if self.record is None:
            return
        with contextlib.suppress(OSError):
            atomic_write(
                self.record,
                json.dumps(
                    {
                        "step": step,
                        "peer_copies": copied,
                        "dir": self.template,
                        "time": time.time(),
                        "seconds": round(seconds, 3),
                        "shared_dir": self.shared_dir,
                        "bytes_per_node": self.bytes_per_node,
                    }
                ),
                durable=False,
            )

    # ---------------------------------------------------------------------------------- restore
    def inventory(self) -> dict[int, dict[int, Path]]:
        """{rank: {step: directory}} of the complete steps this node's directory holds: own files first, copies
        second. Anything that is not the tier's (a link, another name, another world size) is ignored."""
        out: dict[int, dict[int, Path]] = {}
        with contextlib.suppress(OSError):
            entries = sorted(os.scandir(self.root), key=lambda e: (e.name.startswith("replica"), e.name))
            for e in entries:
                m = _TIER_DIR.match(e.name)
                if not m or not e.is_dir(follow_symlinks=False):
                    continue
                origin = int(m.group(2))
                if origin >= self.world_size:
                    continue
                with contextlib.suppress(OSError):
                    for s in os.scandir(e.path):
                        sm = STEP_RE.match(s.name)
                        if sm and _complete_marker(Path(s.path), origin, int(sm.group(1)), self.world_size):
                            out.setdefault(origin, {}).setdefault(int(sm.group(1)), Path(s.path))
        return out

    def damaged_steps(self) -> list[int]:
        """The steps of this node's directory that a restore set aside as damaged (``step-N.damaged-<time>``)."""
        out: set[int] = set()
        with contextlib.suppress(OSError):
            for e in os.scandir(self.root):
                if _TIER_DIR.match(e.name) and e.is_dir(follow_symlinks=False):
                    with contextlib.suppress(OSError):
                        out.update(int(m.group(1)) for s in os.scandir(e.path) if (m := _DAMAGED_NAME.match(s.name)))
        return sorted(out)

    def _worst(self, code: int) -> int:
        """Collective: the largest of every rank's outcome code."""
        if self._pg is None:
            return code
        flag = torch.tensor([code])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._pg)
        return int(flag)

    def restore(self, state: Checkpointable, shared_step: int | None) -> Path | None:
        """Collective: load the newest step intact on every rank (counting peer copies), then the next, while it is
        at least as new as ``shared_step`` (rank 0's newest shared checkpoint); None: resume from the shared tier
        (why is logged). Every rank checks the files it holds of the step (its own, and the copies it hands to a
        rank whose own files are gone) against their manifest; a directory that fails is set aside
        (``step-N.damaged-<time>``, never deleted) and the step is agreed again without it: another copy of the same
        files, or the next older step. With no shared checkpoint to fall back to and only damaged local steps, the
        run is refused (ConfigError) rather than started from step 0."""
        self.wait()  # a copy in flight is not counted half-done: it ends (complete or not) before the inventory
        given_up: set[int] = set()  # steps whose fetch between nodes failed: not agreed on again here
        while True:
            inv = self.inventory()
            offer = {o: sorted(set(s) - given_up) for o, s in inv.items()}
            gathered = self._gather((offer, shared_step, self.damaged_steps()))
            shared = gathered[0][1]
            plan = agree_step([g[0] for g in gathered], self.world_size, shared)
            if plan.step is None:
                damaged = sorted({s for g in gathered for s in g[2]})
                if shared is None and damaged:
                    raise ConfigError(
                        [
                            f"checkpoint.resume=auto: no intact node-local step in {self.root} and no shared "
                            f"checkpoint, only damaged local steps ({', '.join(map(str, damaged[:8]))}, set aside as "
                            "step-N.damaged-<time>; the warnings above say which file); nothing was deleted. Set "
                            "checkpoint.resume=none to start from step 0 anyway (they are kept)"
                        ]
                    )
                log.info("checkpoint.local: not resuming from %s: %s", self.root, plan.why)
                return None
            outcome, path = self._try_step(plan, inv, state, shared)
            if outcome == _LOADED:
                return path
            if outcome == _ELSEWHERE:
                return None
            if outcome == _GIVE_UP:
                given_up.add(plan.step)
            # _DAMAGED_SET_ASIDE: a directory was set aside; the step is agreed again without it

    def _try_step(
        self, plan: LocalPlan, inv: dict[int, dict[int, Path]], state: Checkpointable, shared: int | None
    ) -> tuple[int, Path | None]:
        """Collective: check, fetch and load the agreed step; (outcome, the loaded path)."""
        step = plan.step
        assert step is not None
        served = [r for r, src in plan.sources.items() if src == self.rank]
        code = _LOADED
        for r in served:  # what this rank holds of the step, checked before anything of it travels or loads
            err = error_of(lambda d=inv[r][step]: self._check_or_set_aside(d))
            if err is not None:
                log.error(
                    "rank %d: checkpoint.local: checking step %d failed: %s", self.rank, step, describe_error(err)
                )
            code = max(code, _GIVE_UP if err is not None else _LOADED)
            if err is None and not os.path.lexists(inv[r][step]):
                code = max(code, _DAMAGED_SET_ASIDE)
        code = self._worst(code)
        if code != _LOADED:
            return code, None
        pairs = sorted((src, r) for r, src in plan.sources.items() if src != r)
        for src, r in pairs:
            if self.rank == 0:
                log.info("checkpoint.local: rank %d's files of step %d come from rank %d's node", r, step, src)
        ok = self._transfer(
            pairs, step, lambda origin: inv[origin][step], lambda origin: own_dir(self.root, origin), restore=True
        )
        if not ok:
            log.warning("checkpoint.local: fetching step %d from the peers failed: trying an older step", step)
            return _GIVE_UP, None
        path = (
            own_dir(self.root, self.rank) / step_name(step)
            if plan.sources[self.rank] != self.rank
            else inv[self.rank][step]
        )
        code = _LOADED
        if plan.sources[self.rank] != self.rank:  # fetched: checked again where it landed; its source verified,
            # so a failure here is the transfer's: the step is given up (another fetch would fare no better)
            err = error_of(lambda: self._check_or_set_aside(path))
            code = _GIVE_UP if err is not None or not os.path.lexists(path) else _LOADED
        if code == _LOADED:
            whys: list[str | None] = []
            err = error_of(
                lambda: whys.append(_same_run(json.loads(read_record(path / STATE_FILE)), state.trainer_state()))
            )
            why = whys[0] if whys else None
            if err is not None:
                log.error("rank %d: checkpoint.local: reading %s failed: %s", self.rank, path, describe_error(err))
                code = _GIVE_UP
            elif why:
                log.error("rank %d: checkpoint.local: %s is another run's (%s)", self.rank, path, why)
                self.foreign = True  # then nothing here is discarded (discard_newer): it is not ours to drop
                code = _ELSEWHERE
        code = self._worst(code)
        if code != _LOADED:
            if code == _ELSEWHERE:
                self.foreign = True
                log.warning(
                    "checkpoint.local: step %d is not this run's on every rank: resuming from the shared tier", step
                )
            return code, None
        err = error_of(lambda: self._load(path, state))
        if not self._all_ok(err, f"loading step {step}"):
            if shared is None:
                raise RuntimeError(
                    f"checkpoint.local: loading step {step} failed after it verified (see the errors above) and "
                    "there is no shared checkpoint to fall back to; move the node-local directory aside to start "
                    "from step 0"
                )
            log.warning("checkpoint.local: loading step %d failed: resuming from the shared tier", step)
            self.load_failed = True
            return _ELSEWHERE, None
        self.last_step = step
        return _LOADED, path

    def _check_or_set_aside(self, path: Path) -> None:
        """A step directory that fails its checks is set aside (kept to inspect) with a warning naming the file."""
        problems = verify_step_dir(path)
        if problems:
            aside = set_aside(path, "damaged")
            log.warning(
                "rank %d: checkpoint.local: %s is damaged (%s): set aside as %s, trying the next copy or step",
                self.rank,
                path,
                "; ".join(problems[:3]),
                aside.name,
            )

    def _load(self, path: Path, state: Checkpointable) -> None:
        trainer_state = json.loads(read_record(path / STATE_FILE))
        rng = torch.load(path / RNG_FILE, weights_only=True)
        own = torch.load(path / OWN_FILE, weights_only=True) if (path / OWN_FILE).is_file() else {}
        dest = state.dcp_state()
        local = _localize(dest)
        with single_process_dcp():
            # every file was checked against the manifest before: nothing to hash on the way
            reader, planner = (
                HashingReader(str(path), hash_files=set(), encoding=tensor_encoding(path)),
                DefaultLoadPlanner(),
            )
            dcp.load(local, storage_reader=reader, planner=planner, no_dist=True)
            reader.apply_deferred(planner)
        state.load_dcp_state(_merge_back(dest, local))
        state.load_trainer_state(trainer_state)
        state.load_rank_state(own)
        set_rng_state(rng)


def _chunks(src: Path | None, files: Sequence[tuple[str, int]]) -> Any:
    """The files' bytes, concatenated, as views of one uint8 tensor of CHUNK bytes (the last one shorter), read
    straight into it: the caller sends each view and waits for the send before asking for the next. A file that
    shrank since it was listed raises OSError (the caller sends zeros in its place; the copy fails its manifest)."""
    assert src is not None
    buf = torch.empty(CHUNK, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    fill = 0
    for name, size in files:
        with open(src / name, "rb", buffering=0) as f:
            left = size
            while left:
                n = f.readinto(view[fill : fill + min(CHUNK - fill, left)])
                if not n:
                    raise OSError(f"{name}: shorter than listed")
                fill += n
                left -= n
                if fill == CHUNK:
                    yield buf
                    fill = 0
    if fill:
        yield buf[:fill]


class _Sink:
    """The receiving side of one copy: checks the header, writes the announced files into ``<dest>/step-N.partial``
    (new files, no links followed), hashes them, and at ``finish`` checks them against the manifest that came
    with them, writes COMPLETE and renames the directory. After a problem it still takes every announced byte
    (the channel stays in step) and raises at ``finish``."""

    def __init__(self, dest: Callable[[int], Path], header: bytes, total: int, step: int, world_size: int, origin: int):
        self.error: BaseException | None = None
        self.files: list[tuple[str, int]] = []
        self.hashes: dict[str, Any] = {}
        self._fd: int | None = None
        self._idx, self._left = 0, 0
        self.step, self.world_size = step, world_size
        try:
            h = json.loads(header)
            files, want = h["files"], origin
            origin = h["origin"]
            if h.get("step") != step or origin != want or not 0 <= origin < world_size:
                raise ValueError("a header for another step or rank")
            if not isinstance(files, list) or len(files) > MAX_FILES:
                raise ValueError("no file list")
            for name, size in files:
                if not isinstance(name, str) or not _FILE.match(name) or name in (MARKER, ".", ".."):
                    raise ValueError(f"a file name {name!r} the tier never writes")
                if not isinstance(size, int) or size < 0:
                    raise ValueError(f"{name}: size {size!r}")
                self.files.append((name, size))
            if sum(s for _, s in self.files) != total:
                raise ValueError("the announced sizes do not add up")
            self.origin = origin
            self.final = dest(origin) / step_name(step)
            self.partial = self.final.with_name(self.final.name + ".partial")
            parent = self.final.parent
            parent.mkdir(mode=0o700, exist_ok=True)
            if not stat.S_ISDIR(os.lstat(parent).st_mode) or writer_problem(os.lstat(parent), {os.getuid()}):
                raise ValueError(f"{parent} is not a directory of yours alone")
            free = shutil.disk_usage(parent).free
            if total > free:
                raise OSError(f"{size_text(total)} to copy, {size_text(free)} free in {parent}")
            for old in (self.partial, self.final):  # an older copy of this step is never left beside a failed one
                _make_room(old)
            self.partial.mkdir(mode=0o700)
            self._next_file()
        except (OSError, ValueError, KeyError, TypeError) as e:
            self.error = e

    def _next_file(self) -> None:
        while self._idx < len(self.files):
            name, size = self.files[self._idx]
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
            self._fd = os.open(self.partial / name, flags, 0o600)
            self.hashes[name] = hashlib.sha256()
            self._left = size
            if size:
                return
            os.close(self._fd)
            self._fd = None
            self._idx += 1

    def write(self, data: Any) -> None:
        if self.error is not None:
            return
        view = memoryview(data).cast("B")
        try:
            while len(view):
                assert self._fd is not None
                n = min(self._left, len(view))
                os.write(self._fd, view[:n])  # regular files on a local disk: a short write raises ENOSPC
                self.hashes[self.files[self._idx][0]].update(view[:n])
                view, self._left = view[n:], self._left - n
                if self._left == 0:
                    os.close(self._fd)
                    self._fd = None
                    self._idx += 1
                    self._next_file()
        except (OSError, AssertionError) as e:
            self.error = e

    def finish(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        if self.error is None:
            try:
                self._check()
            except (OSError, ValueError, KeyError, TypeError) as e:
                self.error = e
        if self.error is not None:
            if hasattr(self, "partial"):
                shutil.rmtree(self.partial, ignore_errors=True)
            raise self.error

    def _check(self) -> None:
        manifest = json.loads(read_record(self.partial / MANIFEST))
        files = manifest["files"]
        names = {n for n, _ in self.files} - {MANIFEST}
        if set(files) != names:
            raise ValueError("the files copied are not the manifest's")
        for name, size in self.files:
            if name == MANIFEST:
                continue
            if files[name].get("size") != size or files[name].get("sha256") != self.hashes[name].hexdigest():
                raise ValueError(f"{name}: the copy does not match the manifest")
        marker = {"step": self.step, "rank": self.origin, "world_size": self.world_size}
        atomic_write(self.partial / MARKER, json.dumps(marker), durable=False)
        self.partial.rename(self.final)
