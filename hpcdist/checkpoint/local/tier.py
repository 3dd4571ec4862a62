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
import json
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from hpcdist.agree import all_ok, gather, worst
from hpcdist.base.atomic import atomic_write, file_sha256
from hpcdist.base.logging_utils import get_logger
from hpcdist.base.units import size_text
from hpcdist.checkpoint.codec import HashingReader, HashingWriter, single_process_dcp
from hpcdist.checkpoint.errors import describe_error, error_of
from hpcdist.checkpoint.local.layout import (
    DAMAGED_NAME,
    OWN_FILE,
    RNG_FILE,
    TIER_DIR,
    LocalPlan,
    agree_step,
    complete_marker,
    listing,
    localize,
    make_room,
    merge_back,
    own_dir,
    peers,
    replica_dir,
    rounds,
    same_run,
    set_aside,
    verify_step_dir,
)
from hpcdist.checkpoint.local.transport import PeerTransport
from hpcdist.checkpoint.manifest import MANIFEST, TENSOR_ENCODING, read_record, tensor_encoding
from hpcdist.checkpoint.names import MARKER, STEP_RE, step_name
from hpcdist.checkpoint.staging import Staging
from hpcdist.checkpoint.state import STATE_FILE, Checkpointable, rng_state, set_rng_state
from hpcdist.config.loader import ConfigError

log = get_logger(__name__)

# after an error, how long the trainer waits for a peer copy in flight before it exits (its peers' copy threads run
# on, so it usually ends: the 13B flagship's ~13 s per node at the a100_ib profile); then it is left (daemon thread)
EXIT_WAIT_S = 120.0
RECORD = "local_checkpoints.json"  # in run.dir (rank 0): what `hpcdist status` and the report show of the tier
# a restore's outcome for one agreed step, worst last (every rank takes the largest)
_LOADED, _DAMAGED_SET_ASIDE, _GIVE_UP, _ELSEWHERE = 0, 1, 2, 3


@dataclass(frozen=True)
class _Snapshot:
    """What a snapshot takes in the loop besides the model and optimizer tensors (those are staged)."""

    step: int
    trainer_state: str  # JSON
    rng: dict[str, Any]
    own: dict[str, Any]


def _cloned(obj: Any) -> Any:
    """``obj`` with every tensor copied: the next steps change the originals while the snapshot is written."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _cloned(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cloned(v) for v in obj)
    return obj


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
        self.transport = PeerTransport(rank, world_size, self._pg)
        # the peer copy runs on a thread of its own (``save``), over a group of its own: two threads sharing one
        # group deadlock. Its collectives give up after ``timeout_s`` (the job's collective timeout; None: torch's
        # default, 30 min): a peer that died or froze mid-copy ends the copy (logged), never holds the run
        self.timeout_s = timeout_s
        self._copy_pg = (
            dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s) if timeout_s else None)
            if dist.is_initialized()
            else None
        )
        self._copy: threading.Thread | None = None  # the last snapshot's write and copy, until wait() joins it
        # this tier's own host copy of the state (the shared tier's async save has its own: both may be in flight)
        self._stager = Staging(threads=2)
        self._staged: Future[dict[str, Any]] | None = None  # the last snapshot's copy into it, until the fence
        self._copied = True  # whether that copy made every peer copy
        if all(p < 0 for p in self.peer):
            log.warning(
                "checkpoint.local: every rank runs on one node: no peer copies (a lost node loses the tier's steps; "
                "the shared checkpoint stays the fallback)"
            )

    # ---------------------------------------------------------------------------------- collectives
    # ``group``: the loop's (None: ``_pg``) or the background copy's (``_copy_pg``); never one from two threads
    def _all_ok(self, err: BaseException | None, what: str, group: Any = None) -> bool:
        """Collective: this rank's failure of ``what`` logged here, then whether it worked on every rank."""
        if err is not None:
            log.error("rank %d: checkpoint.local: %s failed: %s", self.rank, what, describe_error(err))
        return all_ok(err is None, self._pg if group is None else group)

    # ---------------------------------------------------------------------------------- save
    def save(self, step: int, state: Checkpointable) -> bool:
        """Start the snapshot of ``step``, after the previous one has ended (``wait``): what is not a model or
        optimizer tensor (trainer state, RNG, the rank's own state: small) is taken here; the tensors are copied
        into this tier's staging buffers beside the next step's forward and backward, which change none of them
        (``staging_fence``, before the optimizer step, waits for that copy). Then, on a background thread: this
        rank's files on its node, every rank's agreement that they are there (a step to resume from), every node's
        files to its peer, the prune and the record. A snapshot costs the loop the copy it did not overlap, never
        the write or the copy between nodes. Returns True: the snapshot started; a failure shows at ``wait`` and in
        the log (the step is dropped everywhere, training goes on)."""
        self.wait()
        t0 = time.perf_counter()
        snap = _Snapshot(
            step=step,
            trainer_state=json.dumps(state.trainer_state()),
            rng=rng_state(),
            own=_cloned(state.rank_state()),
        )
        staged = self._staged = self._stager.stage_async(localize(state.dcp_state()))
        self._copied = False
        self._copy = threading.Thread(
            target=self._write_and_copy,
            args=(snap, staged, t0, time.perf_counter() - t0),
            name=f"hpcdist-local-snapshot-{step}",
            daemon=True,  # a copy left running (wait's bound, the exception path) never holds the exit
        )
        self._copy.start()
        return True

    def staging_fence(self, *, whole: bool = False) -> float:
        """Wait until the last snapshot's copy into the staging buffers is done: seconds waited (0: none in flight).
        Called before every optimizer step, the first thing that changes what the copy reads; a failed copy fails
        that snapshot (its thread says so), not this call. ``whole``: until the snapshot is complete, files and peer
        copy too, so that when a step ends the snapshot of the step before it is there on every node (a snapshot
        every step then loses at most one step to a failure, whenever it strikes)."""
        staged, self._staged = self._staged, None
        t0 = time.perf_counter()
        if whole:
            self.wait()
        elif staged is not None:
            futures.wait([staged])
        return time.perf_counter() - t0

    def _write_and_copy(self, snap: _Snapshot, staged: Future[dict[str, Any]], t0: float, loop_s: float) -> None:
        """The snapshot's background part, over the copy's own group (every rank runs the same collectives in the
        same order): the files, the agreement, then the peer copy (``_finish``)."""
        step = snap.step
        final = own_dir(self.root, self.rank) / step_name(step)
        partial = final.with_name(final.name + ".partial")
        written: list[int] = []

        def write() -> None:
            tensors = staged.result()
            make_room(final)  # saved again: the old files go first, so a failed save leaves no step of two lines
            written.append(self._write(partial, snap, tensors))
            partial.rename(final)

        err = error_of(write)
        try:
            ok = self._all_ok(err, f"saving step {step}", self._copy_pg)
        except Exception as e:  # the agreement itself failed (a peer gone): nothing to agree with
            log.warning("rank %d: checkpoint.local: step %d dropped: %s", self.rank, step, describe_error(e))
            ok = False
        if not ok:
            shutil.rmtree(partial, ignore_errors=True)
            shutil.rmtree(final, ignore_errors=True)  # complete here, failed on another rank: not a step
            self._copied = False
            return
        self.last_step = step  # every rank's own files are there: a step to resume from, with or without copies
        self._finish(step, written[0] if written else 0, loop_s, t0, self._copy_pg)

    def close(self) -> None:
        """The run ends or fails: the snapshot in flight ends within its bound, the staging buffers go."""
        self.wait(timeout_s=EXIT_WAIT_S)
        self._stager.close()

    def _finish(self, step: int, nbytes: int, loop_s: float, t0: float, group: Any) -> None:
        """After the local save: the peer copies, the prune, the size gather and rank 0's record, on the background
        thread (``group``: its own; None without a process group). Every rank
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
                sizes = gather(nbytes, self._pg if group is None else group, self.world_size)
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

    def _write(self, path: Path, snap: _Snapshot, tensors: dict[str, Any]) -> int:
        """This rank's files of the snapshot into ``path`` (a fresh directory), manifest and marker last; bytes."""
        step = snap.step
        make_room(path)  # a crashed save's leftover, in our own directory
        path.mkdir(mode=0o700, parents=True)
        writer = HashingWriter(str(path), thread_count=1)
        with single_process_dcp():
            dcp.save(tensors, storage_writer=writer, no_dist=True)
        torch.save(snap.rng, path / RNG_FILE)
        if snap.own:
            torch.save(snap.own, path / OWN_FILE)
        atomic_write(path / STATE_FILE, snap.trainer_state, durable=False)
        digests = writer.digests()
        files = {}
        for name in listing(path):
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
                self.transport.exchange(step, send, recv, origin, source, dest, restore=restore, group=group)
            except Exception as e:
                err = err or e
        return self._all_ok(err, f"copying step {step} between nodes", group)

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
                if not TIER_DIR.match(e.name) or not e.is_dir(follow_symlinks=False):
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
                m = TIER_DIR.match(e.name)
                if not m or not e.is_dir(follow_symlinks=False):
                    continue
                origin = int(m.group(2))
                if origin >= self.world_size:
                    continue
                with contextlib.suppress(OSError):
                    for s in os.scandir(e.path):
                        sm = STEP_RE.match(s.name)
                        if sm and complete_marker(Path(s.path), origin, int(sm.group(1)), self.world_size):
                            out.setdefault(origin, {}).setdefault(int(sm.group(1)), Path(s.path))
        return out

    def damaged_steps(self) -> list[int]:
        """The steps of this node's directory that a restore set aside as damaged (``step-N.damaged-<time>``)."""
        out: set[int] = set()
        with contextlib.suppress(OSError):
            for e in os.scandir(self.root):
                if TIER_DIR.match(e.name) and e.is_dir(follow_symlinks=False):
                    with contextlib.suppress(OSError):
                        out.update(int(m.group(1)) for s in os.scandir(e.path) if (m := DAMAGED_NAME.match(s.name)))
        return sorted(out)

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
            gathered = gather((offer, shared_step, self.damaged_steps()), self._pg, self.world_size)
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
        code = worst(code, self._pg)
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
                lambda: whys.append(same_run(json.loads(read_record(path / STATE_FILE)), state.trainer_state()))
            )
            why = whys[0] if whys else None
            if err is not None:
                log.error("rank %d: checkpoint.local: reading %s failed: %s", self.rank, path, describe_error(err))
                code = _GIVE_UP
            elif why:
                log.error("rank %d: checkpoint.local: %s is another run's (%s)", self.rank, path, why)
                self.foreign = True  # then nothing here is discarded (discard_newer): it is not ours to drop
                code = _ELSEWHERE
        code = worst(code, self._pg)
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
        local = localize(dest)
        with single_process_dcp():
            # every file was checked against the manifest before: nothing to hash on the way
            reader, planner = (
                HashingReader(str(path), hash_files=set(), encoding=tensor_encoding(path)),
                DefaultLoadPlanner(),
            )
            dcp.load(local, storage_reader=reader, planner=planner, no_dist=True)
            reader.apply_deferred(planner)
        state.load_dcp_state(merge_back(dest, local))
        state.load_trainer_state(trainer_state)
        state.load_rank_state(own)
        set_rng_state(rng)
