"""Sharded checkpoints with torch.distributed.checkpoint (DCP).

Layout of one checkpoint, ``<dir>/step-00001234/``:

    *.distcp, .metadata     model + optimizer shards, written by every rank through DCP
    trainer_state.json      step, tokens seen, data sampler, LR scheduler (rank 0)
    rng/rank-00003.pt       each rank's RNG states (plain tensors: loadable with weights_only=True)
    rank/rank-00003.pt      each rank's own state no other rank holds, when it has some (PowerSGD's error
                            feedback and P/Q memories); plain tensors too
    MANIFEST.json           size and sha256 of every file above, each hashed by the rank that wrote it (while the
                            pages are in its node's cache), written by rank 0; "hashed_by": bytes per rank.
                            Sync save: the parts are gathered by a collective; async save: each rank leaves its
                            part in .manifest/ from the background thread, rank 0 merges them
    COMPLETE                written last, by rank 0, after every rank's shards and the manifest are on disk

A directory without ``COMPLETE`` is a crashed or in-flight save: resume ignores it (with a warning) and
pruning never deletes a complete checkpoint before a newer one is complete. Resume verifies the newest complete
checkpoint against its manifest (the shards while the load reads them, :class:`HashingReader`); a damaged one
(missing, truncated or altered file) is demoted (``COMPLETE`` renamed ``DAMAGED``) with a warning naming the file,
and the previous one is loaded whole. Damaged directories are never
deleted: pruning skips them, a new save of the same step moves the old one aside (``step-N.damaged-<time>``), and
when every checkpoint is damaged resume refuses to start from step 0 unless ``checkpoint.resume=none`` says so.
Resuming an explicitly named step sets the run's newer checkpoints aside (``step-N.abandoned-<time>``, kept), so a
later ``auto`` continues from the step the user chose rather than the line they turned back from; ``resume=none``
(start from step 0) sets every complete checkpoint aside the same way: two lines of training never share the
``step-N`` names, so a save never replaces and pruning never counts a checkpoint of the other line.
Only verified damage demotes: a manifest size or hash mismatch, a missing, unparsable or unloadable file. A
checkpoint that does not fit the config (another model, other data: :class:`CheckpointMismatch`) is refused and
kept as it is; a read error that says nothing about the file (EIO, ESTALE, a MemoryError) is retried
(``READ_RETRY_DELAYS_S``) and then refused (:class:`CheckpointUnavailable`), nothing renamed.
A save that fails (disk full) on any rank is abandoned by all ranks together: its directory is removed and
training continues. DCP's writer threads' errors are collected (not printed as thread tracebacks) and fail the save.

Loading unpickles parts of a checkpoint (DCP's ``.metadata``), which runs
any code their writer put there, and the manifest vouches for nothing (whoever plants the files writes it too).
So before anything of a checkpoint is read, the whole tree is checked (lstat only): every entry owned by this
user, root or a user in ``checkpoint.trusted_owners``, none writable by others, no link leading out. A checkpoint
that fails is refused with one message (:class:`UntrustedCheckpoint`), never demoted or skipped: it is not ours.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import hashlib
import io
import json
import logging
import math
import multiprocessing as mp
import os
import queue
import re
import shutil
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.cuda._pin_memory_utils as pin_memory_utils
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed.checkpoint import _async_process_executor as ape  # process-based async save
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, _OverlappingCpuLoader, _SerialCpuLoader, _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.elastic.utils.distributed import get_free_port

from hpcdist.atomic import UntrustedFile, atomic_write, file_sha256, read_bounded
from hpcdist.checkpoint import directio
from hpcdist.checkpoint.names import DAMAGED, MARKER, latest, list_checkpoints, step_dir, step_name, step_of
from hpcdist.config.dirs import tree_trust_problems, trusted_uids
from hpcdist.config.loader import ConfigError
from hpcdist.fault.supervise import _die_with_parent
from hpcdist.logging_utils import get_logger

MANIFEST = "MANIFEST.json"
PARTS_DIR = ".manifest"  # async save: each rank's part of the manifest, merged by rank 0, then removed
ASYNC_PARTS_TIMEOUT_S = 3600.0
KILL_ENV = "HPCDIST_TEST_KILL_IN_SAVE"  # test-only fault injection, see _test_kill_point
KILL_WRITER_ENV = "HPCDIST_TEST_KILL_WRITER"  # test-only: the checkpoint process dies writing that step (_PartSpec)
STATE_FILE = "trainer_state.json"
# the most a checkpoint's JSON record (MANIFEST.json, trainer_state.json, a rank's manifest part) is read of: a manifest
# holds ~150 bytes per file (a 1024-rank checkpoint with 8 writer threads each: ~1.3 MB); a larger one is damage
RECORD_MAX = 64 << 20
RANK_DIR = "rank"  # rank/rank-<r>.pt: each rank's own state (Checkpointable.rank_state)
# how the shards' tensor items are encoded, recorded in MANIFEST.json (never guessed from the bytes): "raw" (each
# tensor's bytes, its dtype and shape in DCP's .metadata: HashingWriter writes it) or "torch_save" (DCP's own
# FileSystemWriter: a torch.save record per tensor; checkpoints written before the field, and plain DCP checkpoints
# without our manifest). Both are read by HashingReader; any other value is damage
TENSOR_ENCODING = "tensor_encoding"
RAW, TORCH_SAVE = "raw", "torch_save"
ENCODINGS = (RAW, TORCH_SAVE)
# exit status of a run stopped by checkpoint storage: a read that kept failing (CheckpointUnavailable) or a final /
# stop save that failed (hpcdist.run); sysexits' EX_IOERR. The batch script's failure policy requeues it like any
# failure, blaming no node, and a full disk that stays full ends as a failure loop
EXIT_IO = 74
READ_RETRY_DELAYS_S = (0.5, 1.0, 2.0)  # a transient read error is tried again after each of these, then refused
# a file of the checkpoint is not there (or not a file): the checkpoint is damaged; any other OSError (EIO, ESTALE,
# EACCES, ETIMEDOUT, ENOMEM) says nothing about its contents
_DAMAGE_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR})
_OK, _DAMAGE, _TRANSIENT, _MISMATCH = 0, 1, 2, 3  # what reading a checkpoint found; the ranks agree on the MAX
log = get_logger(__name__)


class CheckpointSaveError(RuntimeError):
    """A save failed with an error that is not I/O: a bug would otherwise disable checkpointing silently."""


class CheckpointMismatch(ValueError):
    """An intact checkpoint that does not fit this job (another model): resume stops with this
    message and the checkpoint is kept as it is (never demoted like a damaged one). ``path``: that checkpoint;
    ``what``: what differs, ``model`` or ``data`` (the sample order: the data.* settings or the prepared data)."""

    def __init__(self, message: str, path: Path | None = None, *, what: str = "model"):
        super().__init__(message)
        self.path, self.what = path, what


class CheckpointUnavailable(OSError):
    """A checkpoint that could not be read for a reason that says nothing about its contents (EIO or ESTALE on a
    network file system, a MemoryError), still failing after ``READ_RETRY_DELAYS_S``: the run stops rather than
    start from an older step or from 0, and nothing is renamed (a storage hiccup must not condemn a checkpoint).
    The CLI exits with ``EXIT_CODE``."""

    EXIT_CODE = 74  # EXIT_IO
    failure_kind = "checkpoint"  # failures.jsonl: storage, blamed on no node (a requeue may well find it healthy)

    def __init__(self, message: str, path: Path | None = None):
        super().__init__(message)
        self.path = path


class CheckpointTainted(CheckpointMismatch):
    """A fallback checkpoint lacks a part of the state (a weights-only one: no optimizer state) that a damaged
    checkpoint's load had already written into this process: that part cannot be made fresh here, so the resume
    stops (the fallback is kept as it is); a new process resumes from it cleanly, the damaged one being demoted."""

    def __init__(self, message: str, path: Path | None = None):
        super().__init__(message, path, what="tainted")


class _ShardsDamaged(ValueError):
    """The shards read by a load differ from the manifest (``problems``: one line per file); raised on every rank
    alike (agreed), so ``_read`` demotes the checkpoint as it would after ``verify``."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


class UntrustedCheckpoint(ConfigError):
    """A checkpoint someone else could have written: refused before any of it is read, with the fix;
    a config problem (exit 2 at the CLI), never a damaged checkpoint to demote."""

    SHOWN = 3  # kinds of problem quoted; a foreign tree of thousands of files would otherwise fill a page

    def __init__(self, key: str, path: Path, problems: list[tuple[str, str]]):
        by_why: dict[str, list[str]] = {}
        for entry, why in problems:
            by_why.setdefault(why, []).append(entry)
        parts = [
            f"{why}: {entries[0]}{f' and {len(entries) - 1} more' if len(entries) > 1 else ''}"
            for why, entries in list(by_why.items())[: self.SHOWN]
        ]
        shown = "; ".join(parts) + ("; ..." if len(by_why) > self.SHOWN else "")
        fixes = []
        if any(why.startswith("belongs to ") for why in by_why):
            fixes.append(
                "if its owner is a user you trust and nobody else can write it, name them in "
                "checkpoint.trusted_owners (a list of user names); otherwise do not load it"
            )
        if any(why.startswith("is writable by ") for why in by_why):
            fixes.append(f"if it is yours, make it writable by you alone: chmod -R go-w {path}")
        if any(why.startswith("is a link leading out") for why in by_why):
            fixes.append("copy the linked files into the checkpoint instead of linking them")
        if any(why.startswith("cannot be listed") for why in by_why):
            fixes.append("make it readable to you")
        super().__init__(
            [
                f"{key}: {path} cannot be trusted: {shown}. Loading a checkpoint unpickles parts of it, which runs "
                f"any code its writer put there; {'; '.join(fixes)}. Nothing was read or changed"
            ]
        )
        self.path = path


@dataclass
class Checkpointable:
    """What a checkpoint holds, as callables so the manager never knows the strategy's types. (Not torch's
    ``Stateful`` protocol: DCP's state_dict/load_state_dict pair covers only the first two of these.)"""

    dcp_state: Callable[[], dict[str, Any]]
    """Sharded state (model + optimizer) for DCP; also the destination tensors on load."""
    load_dcp_state: Callable[[dict[str, Any]], None]
    trainer_state: Callable[[], dict[str, Any]]
    load_trainer_state: Callable[[dict[str, Any]], None]
    save_planner: Any = None
    """A DCP SavePlanner for ``dcp_state`` (None: DCP's default). ``hpcdist import`` passes one that reads each
    tensor from the Hugging Face files only when it is written (hpcdist.hf.import_.HFSavePlanner)."""
    rank_state: Callable[[], dict[str, Any]] = dict
    """This rank's own state (differs per rank, e.g. PowerSGD error feedback): rank/rank-<r>.pt when not empty."""
    load_rank_state: Callable[[dict[str, Any]], None] = lambda _: None
    """Called with the saved dict, or an empty one when this rank has none (more ranks than saved)."""


class CheckpointManager:
    """Saves and resumes step-N checkpoints collectively; every rank calls every method."""

    def __init__(
        self,
        root: Path,
        *,
        rank: int,
        world_size: int,
        keep_last: int = 3,
        async_save: bool = False,
        verify: str = "checksum",
        write_threads: int = 1,
        every_steps: int = 0,
        every_minutes: float = 0.0,
        save_final: bool = True,
        total_steps: int | None = None,
        trusted_owners: Sequence[str] = (),
        local_every_steps: int = 0,
        local_every_minutes: float = 0.0,
    ):
        """The cadence (``should_save``): ``every_steps`` / ``every_minutes`` (0: never), ``save_final`` at
        ``total_steps`` (train.steps; None: every last step is the run's end)."""
        self.root, self.rank, self.world_size = Path(root), rank, world_size
        self.every_steps, self.every_minutes = every_steps, every_minutes
        self.save_final, self.total_steps = save_final, total_steps
        # the node-local tier's cadence (checkpoint.local, hpcdist.checkpoint.local): decided here too, one owner
        self.local_every_steps, self.local_every_minutes = local_every_steps, local_every_minutes
        self.local_saved_step = -1
        self._local_clock = time.perf_counter()
        self.saved_step = -1  # the step of the last save (or failed save) or of the resumed checkpoint
        self.last_ok = True  # the last save succeeded, as far as the save itself knows (an async one: see wait())
        self._clock = time.perf_counter()  # every_minutes counts from the last save (or restart_clock())
        self.trusted = trusted_uids(trusted_owners)  # besides this user and root
        self.keep_last, self.async_save, self.verify_mode = keep_last, async_save, verify
        self.write_threads = max(1, write_threads)
        self._pending: Future[bool] | None = None  # an async save's completion: marker written (True) or failed
        self._pending_path: Path | None = None  # that save's directory
        self._last_writer: HashingWriter | None = None  # the last sync save's writer: its files' digests
        self._stager: _Staging | None = None  # async save: staging buffers, allocated once, reused
        self._staged: Future[dict[str, Any]] | None = None  # an async save's copy into them, until staging_fence
        self._process: _CheckpointProcess | None = None  # async save: the process that writes them
        self._process_failed = False  # the last async save failed in the checkpoint process (wait() restarts it)
        self._not_io = False  # the last agreement saw an error that is not I/O (save() raises)
        self._tainted: set[str] = set()  # state parts a load wrote into from a checkpoint that did not verify
        self._pg = self._async_pg = None
        if dist.is_initialized():
            # CPU groups of their own: agreement flags and manifest gathers work on NCCL jobs too; async DCP runs
            # its collectives in a background thread, and two threads sharing one group deadlock
            self._pg = dist.new_group(backend="gloo")
            if async_save:
                self._async_pg = dist.new_group(backend="gloo")

    # ------------------------------------------------------------------------------------------ save
    # the one cadence rule (torchtitan's CheckpointManager._should_save): the loop asks once per step
    def should_save(self, step: int, *, last_step: bool, stop_requested: bool = False, timed: bool = False) -> bool:
        """Save after ``step``? ``last_step``: the loop ends after it (train.steps or train(until=...));
        ``stop_requested``: a stop every rank agreed on (a signal); ``timed``: the every-M-minutes request every rank
        agreed on (rank 0 asks, ``timed_save_due``). The loop's last step saves when it is a resume point (stopped
        or interrupted before train.steps) or checkpoint.save_final; a step is never saved twice. Every rank
        answers alike from agreed inputs: a save is collective."""
        if step == self.saved_step:
            return False
        if (last_step or stop_requested) and self.final_save_due(step):
            return True
        # a stop decides its step's save alone (at train.steps: checkpoint.save_final); every_steps always saves
        return (self.every_steps > 0 and step % self.every_steps == 0) or (timed and not stop_requested)

    def final_save_due(self, step: int) -> bool:
        """The loop's last step is saved: a stop or interruption before train.steps (the resume point), or
        checkpoint.save_final. A failure of this save is the run's failure (the trainer reports ``save_failed``)."""
        return self.save_final or (self.total_steps is not None and step < self.total_steps)

    def timed_save_due(self, step: int) -> bool:
        """Rank 0's clock: checkpoint.every_minutes has passed since the last save (or ``restart_clock``). True once
        per interval; the caller sends it through the per-step stop agreement, so every rank saves after the same
        step (``should_save(timed=...)`` one step later). A step that saves by every_steps restarts the clock."""
        if not (self.every_minutes and self.rank == 0):
            return False
        if self.every_steps > 0 and step % self.every_steps == 0:
            self._clock = time.perf_counter()
            return False
        if time.perf_counter() - self._clock < self.every_minutes * 60:
            return False
        self._clock = time.perf_counter()  # asked: the save itself restarts it again one step later
        return True

    def restart_clock(self) -> None:
        """checkpoint.every_minutes counts from now (the start of the training loop)."""
        self._clock = self._local_clock = time.perf_counter()

    def local_save_due(self, step: int, *, timed: bool = False) -> bool:
        """Save the node-local tier after ``step``? Asked when ``should_save`` said no (a shared save of the step
        makes a local one pointless); ``timed``: checkpoint.local.every_minutes's request every rank agreed on
        (``timed_local_save_due``). Agreed inputs only: the save is collective."""
        if step in (self.saved_step, self.local_saved_step):
            return False
        return (self.local_every_steps > 0 and step % self.local_every_steps == 0) or timed

    def timed_local_save_due(self, step: int) -> bool:
        """Rank 0's clock for checkpoint.local.every_minutes, like ``timed_save_due``."""
        if not (self.local_every_minutes and self.rank == 0):
            return False
        if self.local_every_steps > 0 and step % self.local_every_steps == 0:
            self._local_clock = time.perf_counter()
            return False
        if time.perf_counter() - self._local_clock < self.local_every_minutes * 60:
            return False
        self._local_clock = time.perf_counter()
        return True

    def save(self, step: int, state: Checkpointable) -> Path | None:
        """Write step-N collectively; None when it failed with an I/O error (disk full, EIO, quota): then the partial
        directory is removed, every rank logs why, and the previous complete checkpoint stays the resume point.
        Any other error (a bug: training on would silently never checkpoint again) raises CheckpointSaveError on
        every rank, after the same clean-up."""
        self._clock = time.perf_counter()  # checkpoint.every_minutes counts from the start of the last save
        self.saved_step, self.last_ok = step, False  # a failed save is not retried at the same step
        self.wait()  # one save in flight at a time; also makes the previous checkpoint complete
        path = step_dir(self.root, step)
        t0 = time.perf_counter()
        errors: list[BaseException] = []

        def phase(fn: Callable[[], Any]) -> bool:
            err = error_of(fn)
            if err is not None:
                errors.append(err)
            return self._all_ok(err)

        # every phase ends in an agreement: a rank whose local write failed must not leave the others waiting in
        # the next collective, and no rank may go on to write a marker for a checkpoint another rank failed
        ok = phase(lambda: self._prepare(path))
        ok = ok and phase(lambda: self._write_local(path, state))
        ok = ok and phase(lambda: self._write_shards(path, state, step, t0))
        if self.async_save and ok:
            self.last_ok = True  # so far: its failure shows at wait()
            return path  # the future's callback writes the manifest and the marker
        ok = ok and phase(lambda: self._write_manifest(path, distributed=True))
        ok = ok and phase(lambda: self._complete(path, step, t0))
        if not ok:
            self._abandon(path, step)
            if self._not_io:
                raise CheckpointSaveError(
                    f"checkpoint at step {step} failed with an error that is not I/O ("
                    + (describe_error(errors[0]) if errors else "on another rank: see its log")
                    + "): stopping rather than training on without checkpoints"
                ) from (errors[0] if errors else None)
            return None
        self.last_ok = True
        return path

    def _prepare(self, path: Path) -> None:
        if self.rank == 0:
            if (path / DAMAGED).is_file():  # a demoted checkpoint is evidence: moved aside, never deleted
                aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
                path.rename(aside)
                log.warning("kept the damaged %s as %s (saving step %s again)", path.name, aside.name, step_of(path))
            elif (path / MARKER).is_file():  # a complete checkpoint is never deleted to make room for a save
                aside = path.with_name(f"{path.name}.abandoned-{time.strftime('%Y%m%d-%H%M%S')}")
                path.rename(aside)
                log.warning("kept the complete %s as %s (saving step %s again)", path.name, aside.name, step_of(path))
            elif path.exists():  # leftover of a crashed save at the same step: never mix old and new shards
                shutil.rmtree(path)
            (path / "rng").mkdir(parents=True)
            if self.async_save:
                (path / PARTS_DIR).mkdir()

    def _write_local(self, path: Path, state: Checkpointable) -> None:
        torch.save(_rng_state(), path / "rng" / f"rank-{self.rank:05d}.pt")
        own = state.rank_state()
        if own:  # inside the step directory: it counts only once COMPLETE is written after every rank's files
            (path / RANK_DIR).mkdir(exist_ok=True)
            torch.save(own, path / RANK_DIR / f"rank-{self.rank:05d}.pt")
        if self.rank == 0:
            atomic_write(path / STATE_FILE, json.dumps(state.trainer_state(), indent=1))

    def _write_shards(self, path: Path, state: Checkpointable, step: int, t0: float) -> None:
        if self.async_save:
            # wait() must mean "complete", not "shards written": CPython wakes a future's result() waiters before its
            # done-callbacks run, so waiting on DCP's future would return while the callback still hashes and writes
            # the marker. The callback resolves a future of our own once it is done, whatever happened.
            done: Future[bool] = Future()

            def shards_written(fut: Future[Any]) -> None:
                ok = False
                # the checkpoint process's save itself failed (not the staging copy, which ran here)
                self._process_failed = fut.exception() is not None and staged.exception() is None
                try:
                    ok = self._finish_async(fut, path, step, t0)
                finally:
                    done.set_result(ok)

            # staged into buffers allocated once and reused (shared memory, pinned on CUDA) in the background, while
            # the next step's forward and backward run; the loop waits for the copy only before its optimizer step
            # (staging_fence). The checkpoint process serialises, hashes and writes from the buffers once it is done
            staged = self._staged = self._staging().stage_async(state.dcp_state())
            if self._process is None:
                self._process = _checkpoint_process(self._async_pg)
            writer = self._writer(path)
            kill = os.environ.get(KILL_WRITER_ENV) == str(step)
            writer.part = _PartSpec(self.rank, self.world_size, step if kill else -1, os.getpid())
            self._pending, self._pending_path = done, path
            self._process.submit(staged, writer).add_done_callback(shards_written)
            return
        with single_process_dcp(), _writer_thread_errors() as thread_errors:
            dcp.save(state.dcp_state(), storage_writer=self._writer(path), planner=state.save_planner)
        if thread_errors:  # DCP drops a writer thread's failure: its files are missing from the checkpoint
            raise thread_errors[0]
        _test_kill_point(step)

    def _staging(self) -> _Staging:
        if self._stager is None:
            # copy threads: the node's cores shared by its ranks, as the write threads are (at least 2: the copies
            # wait on memory more than on a core)
            self._stager = _Staging(threads=max(2, self.write_threads))
        return self._stager

    def staging_fence(self) -> float:
        """Wait until an async save's copy of the state into the staging buffers is done: seconds waited (0: none in
        flight). The trainer calls it before every optimizer step, the first thing that changes the state the copy
        reads; every method that reads or writes the state here calls it too. A failed copy fails that save (it
        shows at ``wait``), not this call."""
        staged, self._staged = self._staged, None
        if staged is None:
            return 0.0
        t0 = time.perf_counter()
        wait_futures([staged])
        return time.perf_counter() - t0

    def prepare_staging(self, dcp_state: Callable[[], dict[str, Any]]) -> float:
        """Async save: allocate and fill the staging buffers now (after the first optimizer step, when the optimizer
        state exists), so no save pays for it; seconds taken (0: already there, or no async save). Logged: a
        one-off cost of the run, not of a save. ``dcp_state``: what a save writes (Checkpointable.dcp_state),
        called only when the buffers are made."""
        if not self.async_save or (self._stager is not None and self._stager.ready):
            return 0.0
        self.staging_fence()
        stager = self._staging()
        seconds = stager.prepare(dcp_state())
        need = stager.bytes()
        log.info("checkpoint.async_save: %s of staging buffers allocated in %.2f s (once)", size_text(need), seconds)
        return seconds

    def _own_digests(self, path: Path, written: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
        """Size and sha256 of the files this rank wrote (``_owner``), the work spread over the ranks as the writing
        was: the shards' from ``written`` (hashed while DCP wrote them, :class:`HashingWriter`), the few small
        others read back while they are still in this node's page cache."""
        written = written if written is not None else self._last_writer.digests() if self._last_writer else {}
        return {
            rel: written[rel] if rel in written else _digest(path / rel, checksum=True)
            for rel in _files(path)
            if _owner(rel, self.world_size) == self.rank
        }

    def _writer(self, path: Path) -> HashingWriter:
        # DCP serializes and writes with one thread by default: 0.29 GB/s here against dd's 1.07 for a 1.5 GB
        # state; two threads halve the save (tools/bench/checkpoint.py). The writer hashes what it writes, so the
        # manifest needs no second pass over the shards (docs/CHECKPOINTS.md: that pass was ~20% of a save)
        self._last_writer = HashingWriter(str(path), thread_count=self.write_threads)
        return self._last_writer

    def _write_manifest(self, path: Path, *, distributed: bool) -> None:
        """MANIFEST.json: size and sha256 of every file, each hashed by the rank that wrote it, written by rank 0.
        ``distributed``: the ranks' parts are gathered by a collective (sync save); else (async save, in the
        background thread where no collective may run) rank 0 reads the part each rank wrote into .manifest/."""
        if distributed:
            mine = self._own_digests(path)
            parts: list[dict[str, Any]] = [mine]
            if self._pg is not None:
                parts = [{} for _ in range(self.world_size)]
                dist.all_gather_object(parts, mine, group=self._pg)
        else:
            parts = self._collect_parts(path)
        if self.rank != 0:
            return
        entries = {rel: e for part in parts for rel, e in part.items()}
        hashed_by = {str(r): sum(e["size"] for e in part.values()) for r, part in enumerate(parts)}
        for rel in sorted(set(_files(path)) - set(entries)):  # a file no naming rule gave a rank: hash it here
            entries[rel] = _digest(path / rel, checksum=True)
            hashed_by["0"] += entries[rel]["size"]
        manifest = {"files": entries, "hashed_by": hashed_by, TENSOR_ENCODING: HashingWriter.ENCODING}
        atomic_write(path / MANIFEST, json.dumps(manifest, indent=0, sort_keys=True))
        shutil.rmtree(path / PARTS_DIR, ignore_errors=True)

    def _write_part(self, path: Path, failed: BaseException | None = None) -> None:
        """Async save, every rank, in the background thread: this rank's digests (or its failure) for rank 0."""
        name = f"rank-{self.rank:05d}.{'failed' if failed is not None else 'json'}"
        text = f"{type(failed).__name__}: {failed}" if failed is not None else json.dumps(self._own_digests(path))
        atomic_write(path / PARTS_DIR / name, text)

    def _collect_parts(self, path: Path) -> list[dict[str, Any]]:
        """Rank 0, async save: wait for every rank's part (a rank's background thread may finish after ours)."""
        parts = [path / PARTS_DIR / f"rank-{r:05d}.json" for r in range(self.world_size)]
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

    def _complete(self, path: Path, step: int, t0: float) -> None:
        if self.rank == 0:
            seconds = time.perf_counter() - t0
            marker = {"step": step, "world_size": self.world_size, "time": time.time(), "save_seconds": seconds}
            atomic_write(path / MARKER, json.dumps(marker))
            log.info("checkpoint %s complete (%.2fs)", path, seconds)
            self._prune()

    def _finish_async(self, fut: Future[Any], path: Path, step: int, t0: float) -> bool:
        """True when this rank's part of an async save is done (rank 0: manifest and marker written)."""
        # runs in DCP's background thread on every rank once its shards are written (rank 0: and .metadata): each
        # rank hashes its own files and leaves its part in .manifest/ (no collectives off the main thread); rank 0
        # merges the parts into MANIFEST.json and writes the marker
        err = fut.exception()
        # the checkpoint process writes this rank's part; else hash here. MANIFEST.json there means rank 0 has merged
        # every part (ours included) and removed .manifest/: writing it again would put the directory back
        written = (path / PARTS_DIR / f"rank-{self.rank:05d}.json").is_file() or (path / MANIFEST).is_file()
        if err is None and not written:
            err = error_of(lambda: self._write_part(path))
        if err is not None:
            log.error(
                "async checkpoint %s failed on rank %d: %s; it stays incomplete", path, self.rank, describe_error(err)
            )
            with contextlib.suppress(OSError):
                self._write_part(path, failed=err)  # rank 0 stops waiting for this rank's part
            return False
        if self.rank == 0:
            err = error_of(lambda: (self._write_manifest(path, distributed=False), self._complete(path, step, t0)))
            if err is not None:
                log.error("async checkpoint %s failed: %s; it stays incomplete", path, describe_error(err))
                return False
        return True

    def _abandon(self, path: Path, step: int) -> None:
        previous = latest(self.root, warn=False)
        free = shutil.disk_usage(self.root).free if self.root.exists() else 0
        log.error(
            "checkpoint at step %d failed (see the error above; %.1f MB free in %s): the resume point stays %s",
            step,
            free / 1e6,
            self.root,
            previous or "none (no complete checkpoint)",
        )
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)  # frees the space; it never had a marker
        _barrier(self._pg)

    def wait(self) -> bool:
        """Block until an async save in flight is complete (manifest and marker on disk) or has failed (logged; its
        directory is removed, as a failed sync save's is: it never had a marker, and a full disk needs the space).
        Call before exit, before a requeue and before the next save. Collective: False on every rank if it failed on
        any; after it every rank sees rank 0's marker."""
        ok, path = True, None
        self.staging_fence()
        if self._pending is not None:
            ok, path = self._pending.result(), self._pending_path
            self._pending = None
        restart, self._process_failed = self._process_failed, False
        if self._pg is not None:  # agreed, so every rank reports the same outcome (a failed final save's exit status)
            flag = torch.tensor([0 if ok else 1, int(restart)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._pg)
            ok, restart = int(flag[0]) == 0, bool(flag[1])
        else:
            _barrier()
        if restart and self._process is not None:
            # a failed background write may have killed a checkpoint process or broken their group: every rank
            # starts new ones at the next save (a fresh port), so that save works
            self._process.close()
            if self._process is _SOLO.get("process"):
                del _SOLO["process"]
            self._process = None
        if not ok and path is not None and self.rank == 0 and not (path / MARKER).exists():
            shutil.rmtree(path, ignore_errors=True)
        return ok

    def close(self) -> None:
        """Collective: wait for an async save in flight, then stop the checkpoint process and free the staging
        buffers. The manager can still save afterwards (they are made again)."""
        self.wait()
        if self._process is not None:
            if self._process is not _SOLO.get("process"):  # a one-process run's is shared: it stays for the next
                self._process.close()
            self._process = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _prune(self) -> None:
        complete, incomplete = list_checkpoints(self.root)
        for _, d in complete[: -self.keep_last]:
            shutil.rmtree(d, ignore_errors=True)
        newest = complete[-1][0] if complete else -1
        for d in incomplete:  # crashed saves older than a complete checkpoint are garbage; damaged ones are kept
            if step_of(d) < newest and not (d / DAMAGED).exists():
                shutil.rmtree(d, ignore_errors=True)

    # ------------------------------------------------------------------------------------------ collectives
    def _all_ok(self, err: BaseException | None, *, log_error: bool = True) -> bool:
        """Collective: True iff no rank failed; each failure is logged by the rank that had it (unless the caller
        reports it itself)."""
        if err is not None and log_error:
            log.error("rank %d: checkpoint I/O failed: %s", self.rank, describe_error(err))
        level = 0 if err is None else 1 if _is_io_error(err) or self._disk_nearly_full() else 2
        if self._pg is not None:
            flag = torch.tensor([level])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._pg)
            level = int(flag)
        self._not_io = level == 2  # some rank's error was not I/O: save() raises on every rank alike
        return level == 0

    def _disk_nearly_full(self) -> bool:
        """Whatever the error said, a full checkpoint disk makes it a storage problem (< 64 MiB free: a percentage
        means nothing on a petabyte file system)."""
        try:
            usage = shutil.disk_usage(self.root if self.root.exists() else self.root.parent)
        except OSError:
            return True  # the storage itself is failing
        return usage.free < 64 << 20

    def _spread(self, items: list[str], fn: Callable[[str], Any]) -> dict[str, Any]:
        """{item: fn(item)}, the work split over the ranks (each reads its share once) and gathered to all. A rank
        runs its share on ``write_threads`` threads: one sha256 thread reads a cold file at ~0.5 of the disk's
        speed here (hashlib and reads release the GIL, so threads overlap the reading with the hashing)."""
        share = items[self.rank :: self.world_size]
        if self.write_threads > 1 and len(share) > 1:
            with ThreadPoolExecutor(max_workers=min(self.write_threads, len(share))) as pool:
                mine = dict(zip(share, pool.map(fn, share), strict=True))
        else:
            mine = {item: fn(item) for item in share}
        if self._pg is None:
            return mine
        parts: list[dict[str, Any]] = [{} for _ in range(self.world_size)]
        dist.all_gather_object(parts, mine, group=self._pg)
        return {k: v for part in parts for k, v in part.items()}

    # ------------------------------------------------------------------------------------------ load
    def verify(self, path: Path, mode: str | None = None, *, shards: bool = True) -> list[str]:
        """Collective: what is wrong with ``path`` against its manifest (empty = intact). ``mode``: checksum,
        size or none (default: the manager's). ``shards=False``: the DCP shards (``*.distcp``) are checked by size
        only; their sha256 is taken while the load reads them (:class:`HashingReader`, ``_shard_verdict``)."""
        mode = mode or self.verify_mode
        if mode == "none":
            return []
        if not (path / MANIFEST).is_file():  # every save writes one before the marker: it was removed
            return [f"{MANIFEST}: missing, so nothing in it can be verified (set checkpoint.verify=none to trust it)"]
        # a read error that says nothing about the file (EIO, MemoryError) is raised as CheckpointUnavailable, after
        # this rank has taken its part in the collective below (the caller's agreement then stops every rank alike)
        transient: list[str] = []
        try:
            manifest = _read_manifest(path / MANIFEST, checksum=mode == "checksum")
        except ValueError as e:
            return [f"{MANIFEST}: unparsable ({e})"]
        except (OSError, MemoryError) as e:
            if _read_kind(e) == _DAMAGE:
                return [f"{MANIFEST}: unreadable ({e})"]
            manifest, transient = {}, [f"{MANIFEST}: {describe_error(e)}"]

        def digest(rel: str) -> dict[str, Any]:
            try:
                checksum = mode == "checksum" and (shards or not _is_shard(rel))
                # a file of another size than the manifest's is damaged whatever its bytes, and may be any size at
                # all (a sparse terabyte): not hashed
                checksum = checksum and (path / rel).stat().st_size == manifest[rel]["size"]
                return _digest(path / rel, checksum)
            except (OSError, MemoryError) as e:
                return {"missing": True} if _read_kind(e) == _DAMAGE else {"transient": describe_error(e)}

        present = set(_files(path))
        problems = [f"{rel}: missing" for rel in sorted(set(manifest) - present)]
        found = self._spread(sorted(set(manifest) & present), digest)
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

    def resolve(self, resume: str) -> Path | None:
        """``auto`` -> newest complete checkpoint that verifies (damaged ones are skipped, with a warning, for the
        previous one) or None; ``none`` -> None; else that directory (must be complete and intact)."""
        if resume == "none":
            return None
        if resume == "auto":
            latest(self.root)  # warns about interrupted saves
            for _, found in reversed(list_checkpoints(self.root)[0]):
                path = self._trusted(found, "checkpoint.resume=auto")  # someone else's step dir in ours: stop
                problems = self.verify(path)
                if not problems:
                    return path
                self._demote(path, problems)
            self._refuse_if_only_damaged()
            return None
        return self._named(Path(resume), "checkpoint.resume")

    def _trusted(self, path: Path, key: str) -> Path:
        """Collective: ``path`` with links resolved (what is loaded is what was checked), once nobody but this user,
        root or a trusted owner can have written anything in it; UntrustedCheckpoint (the same on every rank)
        otherwise. Rank 0 walks the tree alone (stat only) and tells the others: one walk per job, not per rank."""
        real = path.resolve()
        if not real.is_dir():
            return path  # nothing to load from; the caller says what is missing
        problems = [tree_trust_problems(real, self.trusted) if self.rank == 0 else []]
        if self._pg is not None:
            dist.broadcast_object_list(problems, src=0, group=self._pg)
        if problems[0]:
            raise UntrustedCheckpoint(key, path, problems[0])
        return real

    def named(self, path: Path, key: str) -> Path:
        """Collective: ``path`` (links resolved) once it is a trusted, complete and intact checkpoint; ConfigError
        (UntrustedCheckpoint) naming ``key`` otherwise. For readers outside the trainer (``hpcdist export``)."""
        return self._named(path, key)

    def _named(self, path: Path, key: str) -> Path:
        """Collective: a checkpoint the config names (``key``) must be trusted, complete and intact: ConfigError
        otherwise (the user's value is wrong, not the program: one message, exit 2; UntrustedCheckpoint when someone
        else could have written it)."""
        path = self._trusted(path, key)
        if not (path / MARKER).is_file():
            raise ConfigError(
                [
                    f"{key}: {path} has no {MARKER} marker: it is not a checkpoint, or an incomplete one "
                    "that cannot be trusted; name a step-XXXXXXXX directory holding COMPLETE"
                ]
            )
        problems = self.verify(path)
        if problems:
            raise ConfigError([f"{key}: {path} is damaged: {'; '.join(problems)}"])
        return path

    def _model_diff(self, metadata: Any, model: dict[str, Any]) -> dict[str, list[str]]:
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
        wanted = set(mine)
        if self._pg is not None:
            parts: list[list[str]] = [[] for _ in range(self.world_size)]
            dist.all_gather_object(parts, sorted(mine), group=self._pg)
            wanted = {k for part in parts for k in part}
        return {
            "missing": sorted(set(mine) - set(saved)),
            "unexpected": sorted(set(saved) - wanted),
            "shape": (shape := [k for k, s in sorted(mine.items()) if k in saved and saved[k] != s]),
            "shape_detail": [f"{k}: checkpoint {list(saved[k])}, this model {list(mine[k])}" for k in shape],
        }

    def _check_model_shapes(self, path: Path, metadata: Any, model: dict[str, Any]) -> None:
        """Collective: CheckpointMismatch naming the parameters when the checkpoint's model is not this model.

        Without it a smaller model loaded a bigger one's checkpoint silently (DCP loads only the keys asked for)
        and a bigger one failed inside DCP with a message that hid the cause."""
        diff = self._model_diff(metadata, model)
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

    def init_weights(self, path: Path, state: Checkpointable) -> dict[str, list[str]]:
        """Collective: ``checkpoint.init_from``. The model weights of the complete, intact checkpoint ``path`` that
        match this model by name and shape are loaded; everything else keeps its initialization (optimizer,
        schedule, data position and step start fresh). Returns what did not match (missing / unexpected / shape)."""
        self.staging_fence()
        path = self._named(path, "checkpoint.init_from")
        model = state.dcp_state()["model"]  # this model's initialized weights, every key: loaded into in place
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
        diff = self._model_diff(metadata, model)
        skip = set(diff["missing"]) | set(diff["shape"])
        matching = {k: v for k, v in model.items() if k not in skip}
        # verified whole by _named: read without hashing, in the encoding its manifest records
        reader = HashingReader(str(path), hash_files=set(), threads=self.write_threads, encoding=tensor_encoding(path))
        with single_process_dcp():
            dcp.load({"model": matching}, storage_reader=reader)
        state.load_dcp_state({"model": model})
        return diff

    def restore(self, resume: str, state: Checkpointable) -> Path | None:
        """Collective: the checkpoint ``resume`` names (``auto``: the newest that verifies and loads) restored into
        ``state``, or None (start fresh). Only verified damage (manifest mismatch, a missing, unparsable or
        unloadable file) demotes a checkpoint under ``auto`` and the previous one is tried; an explicitly named one
        that is damaged raises ConfigError. A mismatch with the config raises CheckpointMismatch, a read error that
        persists through the retries CheckpointUnavailable: both leave every checkpoint as it is. ``none`` sets the
        run's complete checkpoints aside (kept) and starts fresh."""
        self.staging_fence()  # an async save's copy reads the state this writes into
        if resume == "none":
            self._set_aside_newer(-1, "none")  # step 0: every complete checkpoint is of another line of training
            return None
        saved: dict[str, Any] = {}  # the trainer state of the checkpoint loaded
        if resume != "auto":
            path = self._trusted(Path(resume), "checkpoint.resume")
            if not (path / MARKER).is_file():
                raise ConfigError(
                    [
                        f"checkpoint.resume: {path} has no {MARKER} marker: it is not a checkpoint, or an "
                        "incomplete one that cannot be trusted; name a step-XXXXXXXX directory holding "
                        f"{MARKER}"
                    ]
                )
            kind, problems = self._read(path, state, saved)
            if kind == _DAMAGE:
                raise ConfigError(
                    [
                        f"checkpoint.resume: {path} "
                        + ("is damaged: " if problems[0] != "load" else "cannot be loaded: ")
                        + "; ".join(problems[1:])
                    ]
                )
            self._set_aside_newer(int(saved["step"]), path)
            self.saved_step = int(saved["step"])
            return path
        latest(self.root)  # warns about interrupted saves
        for _, found in reversed(list_checkpoints(self.root)[0]):
            path = self._trusted(found, "checkpoint.resume=auto")  # someone else's step dir in ours: stop
            kind, problems = self._read(path, state, saved)
            if kind == _OK:
                self.saved_step = int(saved["step"])
                return path
            self._demote(path, problems[1:] if problems[0] == "verify" else [f"loading failed: {problems[1]}"])
        self._refuse_if_only_damaged()
        return None

    def _refuse_if_only_damaged(self) -> None:
        """resume=auto found no intact checkpoint: refuse while damaged ones exist, since starting from step 0 would
        silently drop the progress they hold (none is ever deleted)."""
        damaged = [d for d in list_checkpoints(self.root)[1] if (d / DAMAGED).is_file()]
        if damaged:
            raise ConfigError(
                [
                    f"checkpoint.resume=auto: no intact checkpoint in {self.root}, only damaged ones ("
                    f"{', '.join(d.name for d in damaged)}; the warnings above say which file); nothing was deleted. "
                    "Set checkpoint.resume=none to start from step 0 anyway (they are kept), or repair one, rename "
                    f"its {DAMAGED} file back to {MARKER} and set checkpoint.resume=<its path>"
                ]
            )

    def _read(self, path: Path, state: Checkpointable, saved: dict[str, Any]) -> tuple[int, list[str]]:
        """Collective: verify ``path`` and load it into ``state`` (its trainer state into ``saved``). Returns (_OK,
        []) or (_DAMAGE, [phase ("verify" / "load"), what is wrong...]), agreed by every rank; raises the mismatch
        (every rank alike) and, once a transient error outlasted the retries, CheckpointUnavailable."""
        problems: list[str] = []
        for delay in (*READ_RETRY_DELAYS_S, None):
            problems.clear()
            # the shards' sha256 is taken while the load reads them (each byte read once): here their sizes, and
            # every other file whole (small; .metadata is unpickled by the load)
            err = error_of(lambda: problems.extend(self.verify(path, shards=False)))
            phase = "verify"
            kind = self._agree(_read_kind(err) if err is not None else _DAMAGE if problems else _OK)
            if kind == _OK:
                phase = "load"
                err = error_of(lambda: saved.update(self.load(path, state)))
                if isinstance(err, _ShardsDamaged):  # the shards' verdict, agreed by every rank inside load()
                    phase = "verify"
                    problems.extend(err.problems)
                kind = self._agree(_read_kind(err) if err is not None else _OK)
            why = describe_error(err) if err is not None else f"{phase} failed on another rank: see its log"
            if kind == _MISMATCH:
                if isinstance(err, CheckpointMismatch) and err.path is None:  # the trainer's state knows no path
                    raise CheckpointMismatch(f"{path}: {err}", path=path, what=err.what) from None
                if isinstance(err, CheckpointMismatch):
                    raise err
                raise CheckpointMismatch(f"{path} does not fit this run (another rank: see its log)", path=path)
            if kind != _TRANSIENT:
                return kind, ([phase, *problems] if problems else [phase, why]) if kind == _DAMAGE else []
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

    def _agree(self, kind: int) -> int:
        """Collective: the worst of every rank's read outcome (_OK < _DAMAGE < _TRANSIENT < _MISMATCH)."""
        if self._pg is None:
            return kind
        flag = torch.tensor([kind])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._pg)
        return int(flag)

    def _set_aside_newer(self, step: int, resumed: Path | str) -> None:
        """Collective. Resuming an explicitly named step turns back from every newer checkpoint of this run: left as
        they are, the next ``checkpoint.resume=auto`` (a requeue, a rerun) would jump back to that abandoned line.
        They are renamed ``step-N.abandoned-<time>``: kept, never resumed or pruned, and said."""

        def move() -> None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for newer_step, d in list_checkpoints(self.root)[0]:
                if newer_step > step:
                    aside = d.with_name(f"{d.name}.abandoned-{stamp}")
                    d.rename(aside)
                    what = "starts from step 0" if step < 0 else f"turned back from step {newer_step}"
                    log.warning(
                        "checkpoint.resume=%s %s: the %s %s is set aside as %s (kept, never resumed or "
                        "pruned; rename it back to resume that line)",
                        resumed,
                        what,
                        "earlier run's" if step < 0 else "newer",
                        d.name,
                        aside.name,
                    )

        _barrier(self._pg)  # every rank has finished reading before rank 0 renames
        err = error_of(move) if self.rank == 0 else None
        if not self._all_ok(err):
            raise RuntimeError(f"could not set aside the checkpoints newer than step {step} in {self.root}")

    def _demote(self, path: Path, problems: list[str]) -> None:
        """A damaged checkpoint is never a resume candidate again: its marker is renamed (files kept to inspect)."""
        log.warning("checkpoint %s is damaged, using the previous complete one: %s", path, "; ".join(problems))
        _barrier(self._pg)  # every rank has read the marker before it goes
        if self.rank == 0:
            with contextlib.suppress(OSError):
                (path / MARKER).rename(path / DAMAGED)
        _barrier(self._pg)

    def load(self, path: Path, state: Checkpointable) -> dict[str, Any]:
        """Collective: restore ``path`` into ``state``; the trainer state as saved. Raises on any problem; the
        per-rank files are read first, so a rank that fails there fails before the collective part.

        With ``verify=checksum`` the shards are hashed while DCP reads them (:class:`HashingReader`: each byte read
        once) and their verdict is agreed by every rank after DCP's read and before anything is applied: the
        trainer state, the RNG, a rank's own state and the pickled (non-tensor) entries of the optimizer state are
        taken only from a checkpoint that verified. Damage raises :class:`_ShardsDamaged` on every rank; the DCP
        tensors of ``state`` then hold values of the damaged checkpoint, so the caller loads another checkpoint
        whole (a part it lacks refuses, :class:`CheckpointTainted`) or stops."""
        self.staging_fence()
        trainer_state = json.loads(read_record(path / STATE_FILE))
        if not isinstance(trainer_state, dict):
            raise ValueError(f"{STATE_FILE} holds {type(trainer_state).__name__}, not the trainer's state")
        rng_file = path / "rng" / f"rank-{self.rank:05d}.pt"
        # absent when resuming on more ranks than saved: those ranks keep their seeded RNG
        rng = torch.load(rng_file, weights_only=True) if rng_file.is_file() else None
        own_file = path / RANK_DIR / f"rank-{self.rank:05d}.pt"
        # a rank's own state (PowerSGD's error feedback) belongs to that rank of that world: on another world size
        # every rank starts it fresh
        same_world = trainer_state.get("world_size") == self.world_size
        own = torch.load(own_file, weights_only=True) if same_world and own_file.is_file() else {}
        dest = state.dcp_state()
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
        saved = {key.split(".", 1)[0] for key in metadata.state_dict_metadata}
        for part in [k for k in dest if k not in saved]:  # e.g. a weights-only checkpoint has no "optim"
            if part in self._tainted:
                raise CheckpointTainted(
                    f"{path} holds no {part!r} state, and this process's {part!r} state holds values read from a "
                    "checkpoint found damaged after the load read it: start the run again (the damaged one is "
                    f"marked {DAMAGED} now, so the new process resumes from {path.name} with a fresh {part!r} state)",
                    path=path,
                )
            log.warning("%s holds no %r state: it is not restored (starts fresh)", path, part)
            del dest[part]
        self._check_model_shapes(path, metadata, dest.get("model", {}))
        self._load_shards(path, dest)
        state.load_dcp_state(dest)
        state.load_trainer_state(trainer_state)
        state.load_rank_state(own)
        if rng is not None:
            _set_rng_state(rng)
        self._tainted -= set(dest)  # every part this checkpoint holds replaced what a damaged one left
        return trainer_state

    def _load_shards(self, path: Path, dest: dict[str, Any]) -> None:
        """Collective: DCP's load of ``dest`` (in place) through a :class:`HashingReader`, then the verdict of the
        shards this rank owns (``_owner``: as ``verify`` spreads them), agreed by every rank."""
        checksum = self.verify_mode == "checksum"
        manifest = _read_manifest(path / MANIFEST, checksum=True) if checksum else {}
        owners = _shard_owners([rel for rel in manifest if _is_shard(rel)], self.world_size)
        mine = sorted(rel for rel, rank in owners.items() if rank == self.rank)
        reader = HashingReader(str(path), hash_files=set(mine), threads=self.write_threads)
        planner = DefaultLoadPlanner()
        self._tainted |= set(dest)  # DCP writes into the live tensors: until the verdict, not trusted

        def load() -> None:
            reader.encoding = tensor_encoding(path)  # alike on every rank: a bad value fails every rank's load
            dcp.load(dest, storage_reader=reader, planner=planner)

        with single_process_dcp():
            failed = error_of(load)
        # a load that failed is judged too: damage that broke a record (a MemoryError from a garbled size) is
        # damage, not a transient error to retry; dcp.load fails on every rank alike, so all reach the agreement
        problems: list[str] = []
        verdict_err: BaseException | None = None
        try:
            problems = _shard_verdict(path, manifest, mine, reader.digests)
        except (OSError, MemoryError) as e:
            verdict_err = e
        kind = self._agree(_DAMAGE if problems else _read_kind(verdict_err) if verdict_err is not None else _OK)
        if kind == _DAMAGE:
            raise _ShardsDamaged(problems or ["a shard differs from the manifest (found by another rank: see its log)"])
        if kind != _OK:
            raise verdict_err or CheckpointUnavailable(f"verifying {path} failed on another rank: see its log", path)
        if failed is not None:
            raise failed
        reader.apply_deferred(planner)  # the pickled entries, now that their files verified


@contextlib.contextmanager
def single_process_dcp() -> Iterator[None]:
    """Around a ``dcp.save`` / ``dcp.load`` that runs without a process group on purpose (a one-process run, a
    conversion, ``init_from`` of a Hugging Face directory): DCP warns "assuming the intent is to ... in a single
    process" on every such call, even with ``no_dist=True``. The one place that says so. (An async save without a
    process group warns from DCP's worker thread, after this would have returned: nothing here can scope that.)"""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield


def _barrier(group: Any = None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _is_io_error(err: BaseException) -> bool:
    """Disk full, I/O error, quota, a vanished mount: the storage's fault, not the code's, so training goes on."""
    if isinstance(err, OSError):
        return True
    if isinstance(err, CheckpointException):  # DCP's wrapper of every rank's failure
        return bool(err.failures) and all(_is_io_error(exc) for exc, _ in err.failures.values())
    # torch.save's zip writer (inline_container.cc) turns ENOSPC / EIO into RuntimeErrors: "PytorchStreamWriter
    # failed writing file ...: file write failed", or, on a full tmpfs, "unexpected pos 704 vs 598"
    if isinstance(err, RuntimeError) and any(s in str(err) for s in ("PytorchStreamWriter", "inline_container")):
        return True
    cause = err.__cause__ or err.__context__
    return cause is not None and _is_io_error(cause)


def error_of(fn: Callable[[], Any]) -> BaseException | None:
    """Run one local phase of a save; return its error instead of raising (the ranks agree on it next)."""
    try:
        fn()
    except (Exception, CheckpointException) as e:  # OSError (ENOSPC, EIO, EDQUOT); DCP's wrapper of rank errors
        return e  # (CheckpointException is a BaseException: a bare `except Exception` would let it through)
    return None


def _read_kind(err: BaseException) -> int:
    """What a failure to read a checkpoint says about it: _MISMATCH (intact, not this run's), _TRANSIENT (nothing
    about the file: retry, never demote) or _DAMAGE (a file missing, unparsable or unloadable)."""
    if isinstance(err, CheckpointMismatch):
        return _MISMATCH
    if isinstance(err, (CheckpointUnavailable, MemoryError)):
        return _TRANSIENT
    if isinstance(err, OSError):
        return _DAMAGE if err.errno in _DAMAGE_ERRNOS else _TRANSIENT
    if isinstance(err, CheckpointException):  # DCP's wrapper of every rank's failure: the worst of them
        return max((_read_kind(exc) for exc, _ in err.failures.values()), default=_DAMAGE)
    cause = err.__cause__ or err.__context__  # torch / DCP wrap an OSError in a RuntimeError
    return _TRANSIENT if cause is not None and _read_kind(cause) == _TRANSIENT else _DAMAGE


def describe_error(err: BaseException) -> str:
    """One line for an error: DCP's CheckpointException carries every rank's whole traceback in its text, so it is
    reduced to each failing rank's innermost error."""
    if isinstance(err, CheckpointException) and err.failures:
        parts = []
        for rank, (exc, _) in sorted(err.failures.items()):
            inner: BaseException = exc
            while isinstance(inner, CheckpointException) and inner.failures:
                inner = next(iter(inner.failures.values()))[0]
            parts.append(f"rank {rank}: {describe_error(inner)}")
        return "; ".join(parts[:4]) + (f"; ... ({len(parts)} ranks)" if len(parts) > 4 else "")
    text = " ".join(str(err).split())
    cause = err.__cause__ or err.__context__
    if isinstance(cause, OSError) and not isinstance(err, OSError):  # the storage error under torch's wrapper
        text += f" (caused by {type(cause).__name__}: {cause})"
    return f"{type(err).__name__}: {text[:500]}" if text else type(err).__name__


_DCP_WRITER = "_write_files_from_queue"  # the target of DCP's extra writer threads (FileSystemWriter.thread_count)
_thread_errors: list[BaseException] = []
_thread_lock = threading.Lock()
_hook_installed = False


def _install_thread_hook() -> None:
    """Collect the errors of DCP's writer threads instead of printing their tracebacks: DCP neither joins their
    failures nor reports them (a thread that died of ENOSPC leaves its files short), so the save checks them."""
    global _hook_installed
    with _thread_lock:
        if _hook_installed:
            return
        previous = threading.excepthook

        def hook(args: threading.ExceptHookArgs) -> None:
            if args.thread is not None and _DCP_WRITER in args.thread.name and args.exc_value is not None:
                with _thread_lock:
                    _thread_errors.append(args.exc_value)
                return
            previous(args)

        threading.excepthook = hook
        _hook_installed = True


def _take_thread_error() -> BaseException | None:
    """The first DCP writer-thread error since the last call (and forget the others)."""
    with _thread_lock:
        first = _thread_errors[0] if _thread_errors else None
        _thread_errors.clear()
    return first


@contextlib.contextmanager
def _writer_thread_errors() -> Iterator[list[BaseException]]:
    """The DCP writer-thread errors raised while the block ran (a sync save: its threads are joined inside)."""
    _install_thread_hook()
    _take_thread_error()
    errors: list[BaseException] = []
    try:
        yield errors
    finally:
        if (err := _take_thread_error()) is not None:
            errors.append(err)


class _HashingFile:
    """A file DCP writes through: every byte written goes into a sha256 as well, so the manifest's digest costs no
    read-back (the hash runs on DCP's writer thread while the kernel is busy flushing the previous write)."""

    _INLINE = 1 << 20  # smaller writes are hashed on the writer's thread (their buffer may be reused at once)

    def __init__(self, raw: Any):
        self._raw, self._hash, self.size = raw, hashlib.sha256(), 0
        self._hasher: _Hasher | None = None  # big writes: hashed on a thread of its own while the next is written

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self._raw.write(view)
        if len(view) < self._INLINE and self._hasher is None:
            self._hash.update(view)
        else:  # a tensor's own bytes (HashingWriter): unchanged until the save ends, so hashed behind the write
            if self._hasher is None:
                self._hasher = _Hasher(self._hash)
            # a small write after a big one keeps the order, on a copy (torch.save's header buffers are transient)
            self._hasher.update(view if len(view) >= self._INLINE else memoryview(bytes(view)))
        self.size += len(view)
        return written

    def hexdigest(self) -> str:
        if self._hasher is not None:
            self._hasher.wait()
        return self._hash.hexdigest()

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def stop_hashing(self) -> None:
        """Wait for the hash thread to take in every write, and end it."""
        if self._hasher is not None:
            self._hasher.close()

    def close(self) -> None:
        try:
            self._raw.close()
        finally:
            self.stop_hashing()

    def __enter__(self) -> _HashingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _HashingFileSystem(FileSystem):
    """DCP's local file system, its written files' sizes and sha256 recorded by path ({path: {size, sha256}})."""

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[str, dict[str, Any]] = {}  # DCP's writer threads add to it: dict item set is atomic

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str, *, size: int | None = None) -> Iterator[Any]:
        """``size``: a shard of about that many bytes, streamed past the page cache when big enough
        (:func:`hpcdist.checkpoint.directio.open_write`; flush before fdatasync). DCP's own files (``.metadata``,
        fsync'd by DCP through ``fileno``) go through a buffered file."""
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with directio.open_write(path, size) if size is not None else open(path, mode) as raw:
            stream = _HashingFile(raw)
            try:
                yield stream
            finally:
                stream.stop_hashing()
        # only a file whose writing finished has a digest (an error above leaves none)
        self.written[os.fspath(path)] = {"size": stream.size, "sha256": stream.hexdigest()}

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)  # DCP writes .metadata.tmp, then renames it
        if (entry := self.written.pop(os.fspath(path), None)) is not None:
            self.written[os.fspath(new_path)] = entry


class _Staging:
    """An async save's host copy of the state: allocated once (``prepare``, after the first optimizer step, outside
    any save; else by the first save) in shared memory, so the checkpoint process maps it without a copy (pinned on
    CUDA, for fast device-to-host copies), and refilled by every later save. The allocation is ours
    (:func:`_host_buffers`: one buffer per dtype, DTensors and ZeRO's ShardedTensors kept, nothing touched on the
    device), and so is the refill: the tensors' pairs copied in chunks on ``threads`` threads (torch's copy_ releases
    the GIL; DCP's _copy_state_dict copies one tensor after another on the calling thread: ~1 s per GB here).

    The refill runs in the background (``stage_async``): the training step after a save reads the state (forward,
    backward) but changes none of it until its optimizer step, so the copy overlaps that step's compute, as
    torchtitan's staging does (``maybe_wait_for_staging`` before ``optimizers.step``). On CUDA the copies go on a
    side stream that first waits for the work that made the state, so the device-to-host copy runs beside the
    forward's kernels."""

    CHUNK = 16 << 20  # bytes per copy task: a big tensor is split so every thread gets a share

    def __init__(self, threads: int = 4) -> None:
        self._cache: dict[str, Any] | None = None
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="hpcdist-stage")
        # runs one refill at a time and waits for its copies (never one of the pool's own threads: they copy)
        self._driver = ThreadPoolExecutor(1, thread_name_prefix="hpcdist-stage-driver")
        self._stream: Any = None  # CUDA: the side stream the copies run on, made by the first CUDA refill
        self.threads = max(1, threads)
        self.allocate_seconds = 0.0  # the one-off allocation (and first fill) of the buffers
        self._flats: list[torch.Tensor] = []  # the buffers themselves, one per dtype (pinned on CUDA until closed)
        self._pinned = False

    @property
    def ready(self) -> bool:
        """The buffers exist (a save refills them)."""
        return self._cache is not None

    def bytes(self) -> int:
        """Host memory the buffers hold."""
        return staging_bytes(self._cache) if self._cache is not None else 0

    def prepare(self, state: dict[str, Any]) -> float:
        """Allocate the buffers now and fill them once (every page touched): seconds taken, 0 if they exist."""
        if self._cache is not None:
            return 0.0
        t0 = time.perf_counter()
        self.stage(state)
        return time.perf_counter() - t0

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state`` into the buffers and return the staged state."""
        return self.stage_async(state).result()

    def stage_async(self, state: dict[str, Any]) -> Future[dict[str, Any]]:
        """Start copying ``state`` into the buffers; the future gives the staged state once every byte is copied.
        Until then the state's tensors must not change (the trainer: ``CheckpointManager.staging_fence`` before its
        optimizer step) and no other refill may start (the caller waits for this one first). The pairing of source
        and buffer, and so every value that is not a tensor, is taken here, before returning."""
        staged, tasks = None, None
        if self._cache is not None:
            try:
                staged, tasks = self._plan(state)
            except (KeyError, ValueError, RuntimeError, AssertionError):  # another structure (a state part added)
                self._cache = None
        if staged is None or tasks is None:
            t0 = time.perf_counter()
            self._release()
            self._pinned = torch.cuda.is_available()  # for fast device-to-host copies
            self._cache, self._flats = _host_buffers(state, pin=self._pinned)
            staged, tasks = self._plan(state)
            fut = self._driver.submit(self._copy, tasks, staged, self._side_stream(tasks))
            fut.result()
            self.allocate_seconds = time.perf_counter() - t0
            return fut
        return self._driver.submit(self._copy, tasks, staged, self._side_stream(tasks))

    def _plan(self, state: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[torch.Tensor, torch.Tensor]]]:
        """The staged state and the copies that fill it: (source, buffer) pairs, big tensors cut into chunks."""
        assert self._cache is not None
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        staged = _pair_tensors(state, self._cache, pairs)
        tasks: list[tuple[torch.Tensor, torch.Tensor]] = []
        for src, dst in pairs:
            if src.shape != dst.shape or src.dtype != dst.dtype:
                raise ValueError(f"staging: {tuple(src.shape)} {src.dtype} into {tuple(dst.shape)} {dst.dtype}")
            n = src.numel()
            step = max(1, self.CHUNK // max(1, src.element_size()))
            if n > step and src.is_contiguous() and dst.is_contiguous():
                flat_src, flat_dst = src.view(-1), dst.view(-1)
                tasks += [(flat_src[i : i + step], flat_dst[i : i + step]) for i in range(0, n, step)]
            elif n:
                tasks.append((src, dst))
        return staged, tasks

    def _side_stream(self, tasks: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """CUDA: the copy stream, made to wait (here, on the caller's thread) for the work queued so far on the
        current stream, the optimizer step that made the state; None on CPU."""
        device = next((src.device for src, _ in tasks if src.is_cuda), None)
        if device is None:
            return None
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device=device)
        self._stream.wait_stream(torch.cuda.current_stream(device))
        return self._stream

    def _copy(self, tasks: list[tuple[torch.Tensor, torch.Tensor]], staged: dict[str, Any], stream: Any) -> Any:
        if self.threads == 1 or len(tasks) < 2:
            _copy_all(tasks, stream)
        else:
            shares = [tasks[i :: self.threads] for i in range(self.threads)]
            for fut in [self._pool.submit(_copy_all, share, stream) for share in shares if share]:
                fut.result()
        if stream is not None:
            stream.synchronize()  # the buffers hold the bytes before the checkpoint process reads them
        return staged

    def _release(self) -> None:
        """Drop the buffers (unpinned first: a later allocation may reuse the pages)."""
        if self._pinned:
            for flat in self._flats:
                pin_memory_utils.unpin_memory(flat.data_ptr())
        self._flats, self._cache, self._pinned = [], None, False

    def close(self) -> None:
        self._driver.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        self._release()


def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]], stream: Any) -> None:
    if stream is not None:
        # this thread's own current device first: torch.cuda.stream's exit makes the device current that was current
        # at its entry, device 0 in a new thread, and a context there costs every rank but rank 0 of a node memory
        torch.cuda.set_device(stream.device)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for src, dst in pairs:
            dst.copy_(src, non_blocking=stream is not None)


_ALIGN = 64  # bytes: each staged tensor starts on a cache line of its buffer


def _host_buffers(state: dict[str, Any], *, pin: bool) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The staging copy's host memory for ``state``: one shared-memory buffer per dtype, pinned once when ``pin``,
    and ``state``'s structure with each tensor's local data a view into it; returns (structure, buffers).

    A few buffers, not one per tensor: each shared-memory buffer holds a file descriptor for its life, and a 13B
    ZeRO-3 shard has over a thousand tensors, past the soft ``ulimit -n`` of 1024 a job inherits. Nothing is read
    from or allocated on the device here (DCP's own ``_create_cpu_state_dict`` deep-copies a ShardedTensor whose
    device reads as cpu, its GPU shards with it). DTensors and ShardedTensors keep their layout, on the host."""
    sizes: dict[torch.dtype, int] = {}

    def reserve(t: torch.Tensor) -> tuple[torch.dtype, int, torch.Size]:
        align = max(1, _ALIGN // t.element_size())
        start = -(-sizes.get(t.dtype, 0) // align) * align
        sizes[t.dtype] = start + t.numel()
        return t.dtype, start, t.size()

    plan = _walk_local(state, reserve)
    flats: dict[torch.dtype, torch.Tensor] = {}
    for dtype, n in sizes.items():
        flat = torch.empty(max(1, n), dtype=dtype).share_memory_()
        if pin:
            pin_memory_utils.pin_memory(flat.data_ptr(), flat.numel() * flat.element_size())
        flats[dtype] = flat

    def view(slot: tuple[torch.dtype, int, torch.Size]) -> torch.Tensor:
        dtype, start, shape = slot
        return flats[dtype][start : start + math.prod(shape)].view(shape)

    return _rebuild(state, plan, view), list(flats.values())


def _walk_local(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj``'s structure with ``fn`` applied to each tensor's local data (a ShardedTensor's shards, a DTensor's
    local tensor, a plain tensor); other values as they are."""
    if hasattr(obj, "local_shards"):
        return [fn(shard.tensor) for shard in obj.local_shards()]
    if isinstance(obj, torch.Tensor):
        return fn(obj.to_local() if hasattr(obj, "to_local") else obj)
    if isinstance(obj, dict):
        return {k: _walk_local(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_walk_local(v, fn) for v in obj]
    return None


def _rebuild(obj: Any, plan: Any, view: Callable[[Any], torch.Tensor]) -> Any:
    """``obj`` with each tensor's local data replaced by ``view(slot)`` (``plan``: ``_walk_local``'s slots)."""
    if hasattr(obj, "local_shards"):
        if not obj.local_shards():
            return obj
        shards = []
        for shard, slot in zip(obj.local_shards(), plan, strict=True):
            meta = copy.deepcopy(shard.metadata)
            if meta.placement is not None:
                meta.placement._device = torch.device("cpu")
            shards.append(Shard(view(slot), meta))
        global_meta = copy.deepcopy(obj.metadata())
        global_meta.tensor_properties.pin_memory = bool(shards) and shards[0].tensor.is_pinned()
        for meta in global_meta.shards_metadata:
            if meta.placement is not None:
                meta.placement._device = torch.device("cpu")
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, sharded_tensor_metadata=global_meta, process_group=obj._process_group
        )
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "to_local"):
            return type(obj)(view(plan), obj._spec, requires_grad=False)  # a DTensor: same mesh and placements
        return view(plan)
    if isinstance(obj, dict):
        return {k: _rebuild(v, plan[k], view) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [_rebuild(v, p, view) for v, p in zip(obj, plan, strict=True)]
        return tuple(out) if isinstance(obj, tuple) else out
    return obj


def _pair_tensors(src: Any, dst: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """Walk ``src`` (a DCP state dict) and its staging copy ``dst`` (same structure) together: each tensor's local
    data with its buffer goes into ``pairs``; returns the staged state (``dst``'s tensors, ``src``'s other values), as
    DCP's _copy_state_dict does. ValueError when the structures differ (the caller allocates anew)."""
    if hasattr(src, "local_shards"):  # ZeRO's ShardedTensor: its local shards
        mine, theirs = src.local_shards(), dst.local_shards() if hasattr(dst, "local_shards") else None
        if theirs is None or len(mine) != len(theirs):
            raise ValueError("staging: the sharded tensor's shards changed")
        pairs += [(a.tensor, b.tensor) for a, b in zip(mine, theirs, strict=True)]
        return dst
    if isinstance(src, torch.Tensor):
        if not isinstance(dst, torch.Tensor) or hasattr(src, "to_local") != hasattr(dst, "to_local"):
            raise ValueError("staging: a tensor's kind changed")
        pairs.append((src.to_local(), dst.to_local()) if hasattr(src, "to_local") else (src.detach(), dst))
        return dst
    if isinstance(src, dict):
        if not isinstance(dst, dict) or set(src) != set(dst):
            raise ValueError("staging: the state's keys changed")
        return {k: _pair_tensors(v, dst[k], pairs) for k, v in src.items()}
    if isinstance(src, (list, tuple)):
        if not isinstance(dst, (list, tuple)) or len(src) != len(dst):
            raise ValueError("staging: a list's length changed")
        out = [_pair_tensors(a, b, pairs) for a, b in zip(src, dst, strict=True)]
        return tuple(out) if isinstance(src, tuple) else out
    return src


@dataclass
class _PartSpec:
    """What the checkpoint process needs to leave this rank's part of the manifest (async save)."""

    rank: int
    world_size: int
    kill_step: int = -1  # tests: SIGKILL the checkpoint process after its shards of this step (KILL_WRITER_ENV)
    trainer_pid: int = 0  # the training process: the checkpoint process dies with it


class HashingWriter(dcp.FileSystemWriter):
    """DCP's FileSystemWriter (same plans, same files, same .metadata) that writes each tensor item as its raw bytes
    (``ENCODING``: no torch.save record, so a load reads it straight into the model's tensor, :class:`HashingReader`)
    and hashes every file while writing it: ``digests()`` gives the manifest entries of the files this rank wrote.
    (A pickled copy, e.g. in a checkpoint process, records its own.)"""

    ENCODING = RAW  # the manifest records it (TENSOR_ENCODING)

    def __init__(self, path: str, **kwargs: Any):
        super().__init__(path, **kwargs)
        self.fs = _HashingFileSystem()

        self.part: _PartSpec | None = None  # async save: write this rank's manifest part after the shards

    def digests(self) -> dict[str, dict[str, Any]]:
        """{path relative to the checkpoint: {size, sha256}} of every file this writer finished."""
        root = Path(self.path)
        return {os.path.relpath(p, root): e for p, e in list(self.fs.written.items())}

    def _write_data(self, planner: Any, file_queue: queue.Queue) -> Any:
        """DCP's file queue (one file per writer thread, items balanced by size), each file written by
        :func:`_write_raw_file`: tensors as raw bytes (``TENSOR_ENCODING``), pickled items as DCP writes them."""
        results: queue.Queue = queue.Queue()
        errors: list[BaseException] = []  # a thread's failure fails the save (DCP's own threads dropped it)
        copy = {"copy_ahead": self.per_thread_copy_ahead if self.thread_count == 1 else 0}

        def drain() -> None:
            try:
                while not errors:
                    path, key, items = file_queue.get_nowait()
                    results.put(_write_raw_file(self.fs, path, key, items, planner, sync=self.sync_files, **copy))
            except queue.Empty:
                pass
            except Exception as e:  # ENOSPC, EIO: the caller raises it once every thread stopped
                errors.append(e)

        threads = [threading.Thread(target=drain, name="hpcdist-save") for _ in range(1, self.thread_count)]
        for t in threads:
            t.start()
        drain()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        done: list[Any] = []
        with contextlib.suppress(queue.Empty):
            while True:
                done += results.get_nowait()
        fut: torch.futures.Future[list[Any]] = torch.futures.Future()
        fut.set_result(done)
        return fut

    def write_data(self, plan: Any, planner: Any) -> Any:
        if self.part is not None and os.getpid() != self.part.trainer_pid:  # in the checkpoint process
            _die_with_trainer(self.part.trainer_pid)
        with _writer_thread_errors() as thread_errors:  # DCP drops a writer thread's failure: its files are missing
            fut = super().write_data(plan, planner)
        if thread_errors:
            raise thread_errors[0]
        if self.part is not None:  # (DCP's writer joined its threads: the future is done)
            if self.part.kill_step >= 0 and Path(self.path).name == step_name(self.part.kill_step):
                os.kill(os.getpid(), signal.SIGKILL)
            # this rank's part of the manifest: its shards' digests from the writing, its small files read here
            root, written = Path(self.path), self.digests()
            part = dict(written)
            for rel in _files(root):
                if rel.startswith(("rng/", f"{RANK_DIR}/")) and _owner(rel, self.part.world_size) == self.part.rank:
                    part[rel] = _digest(root / rel, checksum=True)
            atomic_write(root / PARTS_DIR / f"rank-{self.part.rank:05d}.json", json.dumps(part))
        return fut


def _write_raw_file(
    fs: Any, path: Any, key: str, items: list[Any], planner: Any, *, sync: bool, copy_ahead: int = 0
) -> list[Any]:
    """One shard file: the pickled (``BYTE_IO``) items as DCP writes them, then each tensor item as its raw bytes
    in row-major order (``TENSOR_ENCODING``: its dtype and shape are DCP's metadata's; no torch.save record around
    it, so a load reads it straight into the model's tensor); fdatasync at the end. Returns DCP's WriteResults.

    Device tensors (a GPU run's state saved synchronously) reach the file through a host copy, as in DCP's own
    writer: with ``copy_ahead`` bytes, copied on a side stream ahead of the writing (DCP's overlapping loader, which
    it too uses with one writer thread only); else one after another."""
    results = []
    tensors = [i.tensor_data for i in items if i.type != WriteItemType.BYTE_IO]
    size = sum(math.prod(t.chunk.sizes) * t.properties.dtype.itemsize for t in tensors)
    with fs.create_stream(path, "wb", size=size) as stream:
        for item in [i for i in items if i.type == WriteItemType.BYTE_IO]:
            offset, data = stream.tell(), planner.resolve_data(item).getbuffer()
            stream.write(data)
            results.append(WriteResult(item.index, len(data), _StorageInfo(key, offset, len(data))))
        for item, tensor in _host_tensors([i for i in items if i.type != WriteItemType.BYTE_IO], planner, copy_ahead):
            props = item.tensor_data  # this rank's chunk of the tensor: the metadata's shape of these bytes
            if list(tensor.size()) != list(props.chunk.sizes):
                raise ValueError(f"{item.index.fqn}: {list(tensor.size())}, planned {props.chunk}")
            # the bytes must be the metadata's dtype: a load reads them as that (torch.save recorded its own)
            tensor = tensor.to(props.properties.dtype).contiguous()
            offset = stream.tell()
            data = _byte_view(tensor)
            stream.write(data)
            results.append(WriteResult(item.index, len(data), _StorageInfo(key, offset, len(data))))
        stream.flush()
        if sync:
            os.fdatasync(stream.fileno())
    return results


def _host_tensors(items: list[Any], planner: Any, copy_ahead: int) -> Iterator[tuple[Any, torch.Tensor]]:
    """(item, its tensor on the host) for each tensor item: host tensors as they are (no copy), device tensors
    through DCP's own loaders, which bound what is copied ahead; the device ones come after the host ones."""
    on_device: list[tuple[Any, torch.Tensor]] = []
    for item in items:
        tensor = planner.resolve_data(item).detach()
        if tensor.device.type == "cpu":
            yield item, tensor
        else:
            on_device.append((item, tensor))
    if not on_device:
        return
    resolve = lambda pair: pair[1]  # noqa: E731  # the loaders' resolve function: tensors resolved above
    loader = (
        _OverlappingCpuLoader(resolve, inflight_threshhold=copy_ahead)
        if copy_ahead > 0 and torch.cuda.is_available()
        else _SerialCpuLoader(resolve)
    )
    for pair in on_device:
        loader.add(pair[1].numel() * pair[1].element_size(), pair)
    loader.start_loading()
    for host, (item, _) in loader.values():
        yield item, host


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, shared with it (any dtype: numpy knows no bfloat16, uint8 it does)."""
    if tensor.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


class _Hasher:
    """sha256 of a file on a thread of its own, fed in order with views of bytes already read: the read of the next
    chunk and the hashing of this one overlap (hashlib releases the GIL for big buffers). A view handed over must
    stay unchanged until ``wait`` (the model's own tensor does; a reused buffer waits first)."""

    def __init__(self, hasher: Any = None) -> None:
        self._hash = hasher if hasher is not None else hashlib.sha256()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hpcdist-hash")
        self._last: Future[Any] | None = None
        self.size = 0

    def update(self, view: memoryview) -> None:
        self.size += len(view)
        self._last = self._pool.submit(self._hash.update, view)

    def wait(self) -> None:
        if self._last is not None:
            self._last.result()

    def hexdigest(self) -> str:
        self.wait()
        return self._hash.hexdigest()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class HashingReader(dcp.FileSystemReader):
    """DCP's storage reader for the files :class:`HashingWriter` writes (same plans, same results), that reads each
    file it loads from once, in order, and hashes the files named in ``hash_files`` on the way, the load's mirror of
    :class:`HashingWriter`: ``digests`` holds {relative path: {size, sha256}} of each such file, so the manifest's
    verdict needs no second pass.

    A file's items are sorted by offset and read whole. ``encoding`` (the manifest's ``TENSOR_ENCODING``, never
    guessed from the bytes) says how a tensor item was written: ``raw`` items are read with ``readinto`` straight into
    the model's tensor when it is contiguous, of the saved dtype and takes the item whole (else into one reused
    buffer, then the narrowed region is copied); each item's byte count is checked against the dtype and shape in
    DCP's metadata before anything is read (a mismatch is damage). ``torch_save`` items (checkpoints written before)
    go through torch.load from bytes already read. Bytes no item here needs (another rank's tensors, on a resharded
    load) are read and hashed too when the file is hashed (else skipped), and so is the rest of the file after its
    last item. Files are read on ``threads`` threads, each hashed on a thread of its own (:class:`_Hasher`). The
    pickled (``BYTE_IO``) items are kept as bytes until ``apply_deferred``: nothing from a file is unpickled before
    its verdict."""

    _CHUNK = 16 << 20
    # the kernel is asked to read this far ahead of the item being loaded (posix_fadvise WILLNEED): the disk reads
    # on while this thread hashes and deserialises, so a load takes the longer of the two, not their sum
    READ_AHEAD = 128 << 20

    def __init__(self, path: str, *, hash_files: set[str], threads: int = 1, encoding: str = TORCH_SAVE):
        super().__init__(path)
        self.hash_files, self.threads, self.encoding = hash_files, max(1, threads), encoding
        self.digests: dict[str, dict[str, Any]] = {}  # reader threads add to it: dict item set is atomic
        self.deferred: list[tuple[Any, bytes]] = []  # (ReadItem, bytes) of the pickled items, list append is atomic
        self._tensors: dict[str, Any] = {}

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.encoding not in ENCODINGS:
            raise ValueError(f"{MANIFEST}: {TENSOR_ENCODING} {self.encoding!r} is none of {', '.join(ENCODINGS)}")
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._tensors = metadata.state_dict_metadata  # a raw item's dtype and shape

    def read_data(self, plan: Any, planner: Any) -> Any:
        per_file: dict[str, list[tuple[Any, Any]]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            per_file.setdefault(info.relative_path, []).append((info, item))
        jobs = [(rel, sorted(items, key=lambda x: x[0].offset)) for rel, items in sorted(per_file.items())]
        if self.threads > 1 and len(jobs) > 1:
            with ThreadPoolExecutor(min(self.threads, len(jobs)), thread_name_prefix="hpcdist-load") as pool:
                for fut in [pool.submit(self._read_file, rel, items, planner) for rel, items in jobs]:
                    fut.result()
        else:
            for rel, items in jobs:
                self._read_file(rel, items, planner)
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    def _read_file(self, rel: str, items: list[tuple[Any, Any]], planner: Any) -> None:
        if not isinstance(rel, str) or os.path.basename(rel) != rel or rel in ("", ".", ".."):
            raise ValueError(f"{rel!r}: .metadata names a file outside the checkpoint")
        hasher = _Hasher() if rel in self.hash_files else None
        try:
            with directio.open_read(os.path.join(self.path, rel)) as f:
                self._read_items(f, rel, items, planner, hasher)
        finally:
            if hasher is not None:
                hasher.close()

    def _read_items(self, f: Any, rel: str, items: list[tuple[Any, Any]], planner: Any, hasher: _Hasher | None) -> None:
        size = os.fstat(f.fileno()).st_size
        pos = ahead = 0
        record = bytearray()  # one buffer per file, as big as its biggest item read through it: no page faults per item
        for info, item in items:
            offset, length = info.offset, info.length
            # values from a file: checked before anything is allocated for them or read into the model
            if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset <= offset + length <= size):
                raise ValueError(f"{rel}: .metadata names bytes {offset}+{length} of a {size}-byte file")
            ahead = _read_ahead(f, max(ahead, offset), offset + length + self.READ_AHEAD, size)
            raw = self.encoding == RAW and item.type != LoadItemType.BYTE_IO
            target = direct = None
            if raw:
                target, direct = self._raw_target(rel, info, item, planner)
            if direct is not None:
                data = direct
            else:
                if hasher is not None:
                    hasher.wait()  # the reused buffer may still be being hashed
                if len(record) < length:
                    record = bytearray(length)
                data = memoryview(record)[:length]
            if offset < pos:  # overlaps what was read already (hashed once): read it again
                f.seek(offset)
                _read_into(f, data, rel)
                f.seek(pos)
            else:
                pos = self._skip(f, hasher, pos, offset, rel)
                ahead = self._read_hashed(f, data, rel, hasher, pos, ahead, size)
                pos = offset + length
            if direct is not None:
                planner.commit_tensor(item, target)
            elif raw:
                self._load_raw(item, data, target, planner)
            else:
                self._load_item(item, info, data, planner)
        if hasher is not None:  # the rest of the file, to its end (a file longer than its records is damage too)
            hasher.wait()
            buf = bytearray(self._CHUNK)
            while n := f.readinto(buf):
                pos += n
                ahead = _read_ahead(f, ahead, pos + self.READ_AHEAD, size)
                hasher.update(memoryview(buf)[:n])
                hasher.wait()  # buf is reused
            self.digests[rel] = {"size": hasher.size, "sha256": hasher.hexdigest()}

    def _read_hashed(
        self, f: Any, data: memoryview, rel: str, hasher: _Hasher | None, pos: int, ahead: int, size: int
    ) -> int:
        """Fill ``data`` from the file at ``pos``, a chunk at a time, each chunk handed to the hasher once read;
        returns how far the read-ahead was asked for."""
        if hasher is None:
            _read_into(f, data, rel)
            return ahead
        for start in range(0, len(data), self._CHUNK):
            chunk = data[start : start + self._CHUNK]
            _read_into(f, chunk, rel)
            ahead = _read_ahead(f, ahead, pos + start + len(chunk) + self.READ_AHEAD, size)
            hasher.update(chunk)
        return ahead

    def _skip(self, f: Any, hasher: _Hasher | None, pos: int, offset: int, rel: str) -> int:
        """Move from ``pos`` to ``offset``: read and hash the bytes between when the file is hashed, else seek."""
        n = offset - pos
        if hasher is None or n == 0:
            f.seek(n, os.SEEK_CUR)
            return offset
        buf = bytearray(min(n, self._CHUNK))
        left = n
        while left:
            chunk = memoryview(buf)[: min(left, len(buf))]
            hasher.wait()  # buf is reused
            _read_into(f, chunk, rel)
            hasher.update(chunk)
            left -= len(chunk)
        hasher.wait()
        return offset

    def _raw_target(self, rel: str, info: Any, item: Any, planner: Any) -> tuple[torch.Tensor, memoryview | None]:
        """The model's tensor for a raw item, after checking the item's bytes against its saved dtype and shape
        (DCP's metadata) and the region the plan reads (all from the file: damage when they disagree); and the
        tensor's own bytes when the item can be read straight into them (else None)."""
        dtype, sizes = self._saved_chunk(rel, item)
        want = math.prod(sizes) * dtype.itemsize
        if info.length != want:
            raise ValueError(
                f"{rel}: {item.storage_index.fqn} is {info.length} bytes, its metadata says {list(sizes)} of {dtype} "
                f"({want} bytes): damaged"
            )
        lengths, offsets = list(item.lengths), list(item.storage_offsets)
        if len(lengths) != len(sizes) or any(
            o < 0 or o + n > s for o, n, s in zip(offsets, lengths, sizes, strict=True)
        ):
            raise ValueError(f"{rel}: {item.storage_index.fqn}: the plan reads {offsets}+{lengths} of {list(sizes)}")
        target = planner.resolve_tensor(item).detach()
        if list(target.size()) != lengths:
            raise ValueError(f"{rel}: {item.storage_index.fqn} holds {lengths}, the model {list(target.size())}")
        whole = lengths == list(sizes)
        if whole and target.dtype == dtype and target.device.type == "cpu" and target.is_contiguous():
            return target, _byte_view(target)
        return target, None

    def _saved_chunk(self, rel: str, item: Any) -> tuple[torch.dtype, list[int]]:
        """dtype and shape of the saved chunk a read item comes from (DCP's metadata, values from a file)."""
        index = item.storage_index
        md = self._tensors.get(index.fqn)
        chunks = getattr(md, "chunks", None)
        dtype = getattr(getattr(md, "properties", None), "dtype", None)
        if not isinstance(chunks, list) or not isinstance(dtype, torch.dtype):
            raise ValueError(f"{rel}: {index.fqn}: no tensor metadata for a tensor item")
        found = [c for c in chunks if list(getattr(c, "offsets", ())) == list(index.offset)]
        if index.index is not None and 0 <= index.index < len(chunks) and chunks[index.index] in found:
            found = [chunks[index.index]]
        if not found:
            raise ValueError(f"{rel}: {index.fqn}: no saved chunk at {list(index.offset)}")
        sizes = list(getattr(found[0], "sizes", None) or [])
        if not all(isinstance(n, int) and n >= 0 for n in sizes):
            raise ValueError(f"{rel}: {index.fqn}: a saved chunk of shape {sizes}")
        return dtype, sizes

    def _load_raw(self, item: Any, data: memoryview, target: torch.Tensor, planner: Any) -> None:
        """A raw item read into the reused buffer: the region the plan reads copied into the model's tensor."""
        dtype, sizes = self._saved_chunk("", item)
        if target.numel():
            saved = torch.frombuffer(data, dtype=dtype).view(sizes)
            target.copy_(narrow_tensor_by_index(saved, item.storage_offsets, item.lengths))
        planner.commit_tensor(item, target)

    def _load_item(self, item: Any, info: Any, data: memoryview, planner: Any) -> None:
        # a torch.save'd item (a checkpoint written before TENSOR_ENCODING), as DCP's FileSystemReader.read_data
        # does with each item, from bytes read already instead of a file view
        stream = self.transforms.transform_load_stream(item, info.transform_descriptors or (), _ViewStream(data))
        if item.type == LoadItemType.BYTE_IO:
            self.deferred.append((item, bytes(stream.read(-1))))  # a copy: the buffer is reused
            return
        seekable = stream if stream.seekable() else io.BytesIO(stream.read(-1))
        tensor = torch.load(seekable, map_location="cpu", weights_only=True)
        tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise ValueError(
                f"{info.relative_path}: {item.storage_index} holds {tuple(tensor.size())}, the model "
                f"{tuple(target.size())}"
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)

    def apply_deferred(self, planner: Any) -> None:
        """The pickled items (e.g. the optimizer's param_groups) into the state, once their files verified."""
        for item, data in self.deferred:
            planner.load_bytes(item, io.BytesIO(data))
        self.deferred.clear()


def _read_ahead(f: Any, start: int, end: int, size: int) -> int:
    """Ask the kernel to start reading ``[start, end)`` of ``f`` (clipped to ``size``) into the page cache, in
    16 MiB requests, without waiting for it; returns where the requested range now ends. A direct file reads ahead
    on its own (into its buffers: pages the kernel read for it would be read twice)."""
    end = min(end, size)
    if getattr(f, "direct", False):
        return max(start, end)
    while start < end:
        with contextlib.suppress(OSError, AttributeError):  # a file system without fadvise: plain reads
            os.posix_fadvise(f.fileno(), start, min(16 << 20, end - start), os.POSIX_FADV_WILLNEED)
        start += 16 << 20
    return max(start, end)


class _ViewStream(io.RawIOBase):
    """A read-only, seekable file over a memoryview (io.BytesIO would copy it)."""

    def __init__(self, view: memoryview):
        super().__init__()
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), len(self._view) - self._pos))
        memoryview(b).cast("B")[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


def _read_into(f: Any, view: memoryview, rel: str) -> None:
    """Fill ``view`` from an unbuffered file, or ValueError (damage: the file ends early)."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise ValueError(f"{rel}: ends {len(view) - got} bytes early (truncated)")
        got += n


def _read_exact(f: Any, n: int, rel: str) -> bytes:
    """``n`` bytes from an unbuffered file, or ValueError (damage: the file ends early)."""
    data = f.read(n)
    if len(data) == n:
        return data
    parts, got = [data], len(data)
    while got < n and (more := f.read(n - got)):
        parts.append(more)
        got += len(more)
    if got < n:
        raise ValueError(f"{rel}: ends {n - got} bytes early (truncated)")
    return b"".join(parts)


def _is_shard(rel: str) -> bool:
    return rel.endswith(".distcp")


def _shard_verdict(path: Path, manifest: dict[str, dict[str, Any]], mine: list[str], read: dict[str, Any]) -> list[str]:
    """What is wrong with this rank's shards (``mine``) against the manifest: the digests the load took while
    reading (``read``), a shard it did not read whole hashed now (a resharded load). OSError other than a missing
    file, and MemoryError, are raised (nothing said about the file)."""
    problems = []
    for rel in mine:
        got = read.get(rel)
        if got is None:
            try:
                got = _digest(path / rel, checksum=True)
            except OSError as e:
                if _read_kind(e) != _DAMAGE:
                    raise
                problems.append(f"{rel}: missing")
                continue
        want = manifest[rel]
        if got["size"] != want["size"]:
            problems.append(f"{rel}: {got['size']} bytes, the manifest says {want['size']} (truncated or altered)")
        elif got["sha256"] != want["sha256"]:
            problems.append(f"{rel}: sha256 differs from the manifest (altered)")
    return problems


class _CheckpointProcess:
    """This training process's checkpoint process: DCP's process-based async checkpointer (a spawned daemon in a
    gloo group of its own over the job's ranks) that serialises, hashes and writes a staged state while training
    goes on, so the training process keeps its CPU and its GIL. Started in the background by the first save
    (spawning and joining the group take seconds); ``close`` stops it."""

    def __init__(self, group: Any):
        self._ape, self._group = ape, group
        # a daemonic process (a test harness's rank) may not start one: DCP's thread-based way, same writer
        self.in_thread = mp.current_process().daemon
        if self.in_thread:
            log.warning(
                "checkpoint.async_save: this daemonic process cannot start a checkpoint process; writing "
                "from a background thread instead"
            )
        elif dist.is_initialized():
            self._info = ape._ProcessGroupInitInfo(group)  # collective: rank 0 picks the group's port for everyone
        else:  # one process without a process group: its checkpoint process makes a group of one
            info = ape._ProcessGroupInitInfo.__new__(ape._ProcessGroupInitInfo)
            info.local_rank = info.global_rank = 0
            info.world_size = 1
            info.tcp_store_master_addr, info.tcp_store_master_port = "127.0.0.1", get_free_port()
            info.use_prefix_store = info.disable_automatic_gc = info.disable_manual_gc = False
            self._info = info
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpcdist-checkpoint")
        self._proc: Any = None

    def submit(self, staging: Future[dict[str, Any]], writer: HashingWriter) -> Future[Any]:
        """Save the staged state once ``staging`` (the copy into the buffers) is done."""
        return self._pool.submit(self._save, staging, writer)

    def _save(self, staging: Future[dict[str, Any]], writer: HashingWriter) -> Any:
        staged = staging.result()  # a failed copy fails this save
        if self.in_thread:
            with single_process_dcp():
                return dcp.save(staged, storage_writer=writer, process_group=self._group)
        if self._proc is None:
            self._proc = _QuietCheckpointProcess(self._info)
        return self._proc.save(staged, storage_writer=writer)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        proc, self._proc = self._proc, None
        if proc is None:
            return
        child = proc._save_process
        with contextlib.suppress(Exception):
            if child.is_alive():
                proc._send(self._ape._CheckpointSaveProcessControlOpts.TERMINATE)
                child.join(5)
        if child.is_alive():
            child.kill()
            child.join(5)


_SOLO: dict[str, _CheckpointProcess] = {}  # a process without a process group: one checkpoint process for all


def _checkpoint_process(group: Any) -> _CheckpointProcess:
    """The checkpoint process for a manager's saves: per manager in a job (its group is the manager's), one per
    training process without a process group (a second manager in it, ``hpcdist import`` or the tests, reuses it
    instead of spawning and importing torch again)."""
    if dist.is_initialized():
        return _CheckpointProcess(group)
    if "process" not in _SOLO:
        _SOLO["process"] = _CheckpointProcess(group)
    return _SOLO["process"]


class _QuietCheckpointProcess(ape._AsyncCheckpointProcess):
    """DCP's checkpoint process without its root-logger chatter: it logs every request at INFO and a failure with
    every rank's traceback on stderr; the trainer reports a failed save itself, in one line (describe_error)."""

    @staticmethod
    def _checkpointing_subprocess(pg_init_info: Any, parent_conn: Any) -> None:
        ape._init_logger = lambda rank: None  # in the checkpoint process only
        root = logging.getLogger()
        root.addHandler(logging.NullHandler())  # no "last resort" printing either
        root.setLevel(logging.CRITICAL + 1)
        ape._AsyncCheckpointProcess._checkpointing_subprocess(pg_init_info, parent_conn)


def staging_bytes(state: Any) -> int:
    """Bytes of host memory an async save stages ``state`` (a DCP state dict) into: every tensor this rank holds
    (a DTensor's local shard, a ZeRO ShardedTensor's local shards)."""
    if hasattr(state, "local_shards"):  # ShardedTensor: numel() would ask for the whole tensor
        return sum(s.tensor.numel() * s.tensor.element_size() for s in state.local_shards())
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    if isinstance(state, dict):
        return sum(staging_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(staging_bytes(v) for v in state)
    return 0


def staging_estimate(module: torch.nn.Module) -> int:
    """What ``staging_bytes`` will find in a save of ``module`` with AdamW, counted before the first step (asking
    DCP for the optimizer's state dict then would run a fake optimizer step: AdamW's step counter moves and the
    losses change): each parameter's local shard in fp32 with its two fp32 moments, plus the buffers. Under ZeRO-3 a
    parameter's own tensor is an empty placeholder between gathers: its shard is DeepSpeed's ``ds_tensor``. (ZeRO 1
    and 2 keep whole 16-bit parameters while the master and moments are partitioned: counted whole, an overcount.)"""
    total = 0
    for param in module.parameters():
        shard = getattr(param, "ds_tensor", None)  # ZeRO-3: this rank's partition of the parameter
        local = shard if isinstance(shard, torch.Tensor) else param.to_local() if hasattr(param, "to_local") else param
        total += 12 * local.numel()
    return total + sum(b.numel() * b.element_size() for b in module.buffers())


def size_text(n: float) -> str:
    """Bytes for a person: GB from 0.1 GB up, MB below."""
    return f"{n / 1e9:,.2f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


def check_staging_memory(need: int, ranks_per_node: int, available: int | None, shm_free: int | None) -> None:
    """Start-up refusal (ConfigError, one line) when this node's ranks' staging buffers cannot fit: the host
    memory the process may still take (MemAvailable, lowered by the cgroup's limit) and, since the buffers are
    shared memory, /dev/shm's free space. An OOM kill in the middle of a run is the alternative."""
    node = need * ranks_per_node
    limits = [(available, "available host memory (MemAvailable / the job's cgroup limit)")]
    limits.append((shm_free, "free space in /dev/shm, where shared memory lives"))
    for limit, what in limits:
        if limit is not None and node > limit:
            raise ConfigError(
                [
                    f"checkpoint.async_save: staging a checkpoint needs {size_text(need)} of host memory per rank"
                    f" ({size_text(node)} for this node's {ranks_per_node} rank(s)), more than the "
                    f"{size_text(limit)} of {what}; set checkpoint.async_save=false (a sync save stages "
                    "nothing), or run fewer ranks per node"
                ]
            )


def _die_with_trainer(trainer_pid: int) -> None:
    """The checkpoint process gets SIGKILL when the trainer dies (Linux), so no orphan writes on into a checkpoint
    a restarted job may be saving again."""
    _die_with_parent()
    if os.getppid() != trainer_pid:  # the trainer died before the call
        os.kill(os.getpid(), signal.SIGKILL)


def _read_manifest(file: Path, *, checksum: bool) -> dict[str, dict[str, Any]]:
    """{relative path: {"size", "sha256"}}; ValueError naming the first malformed part (a flipped byte in a key
    must demote the checkpoint, not crash the resume)."""
    data = json.loads(read_record(file))
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict):
        raise ValueError('no "files" mapping')
    _encoding_of(data)
    for rel, entry in files.items():
        size = entry.get("size") if isinstance(entry, dict) else None
        digest = entry.get("sha256") if isinstance(entry, dict) else None
        if not isinstance(size, int) or size < 0 or (checksum and not re.fullmatch(r"[0-9a-f]{64}", str(digest))):
            raise ValueError(f"malformed entry for {rel!r}: {entry!r}")
    return files


def tensor_encoding(step: Path) -> str:
    """How the shards of the checkpoint at ``step`` encode their tensors, as its manifest records it
    (``TENSOR_ENCODING``). No field (a checkpoint written before it) or no manifest at all (a plain DCP checkpoint,
    which our saves never leave) means DCP's own torch_save. ValueError (damage) for any other value."""
    try:
        data = json.loads(read_record(step / MANIFEST))
    except FileNotFoundError:
        return TORCH_SAVE
    try:
        return _encoding_of(data)
    except ValueError as e:
        raise ValueError(f"{MANIFEST}: {e}") from None


def read_record(file: Path, limit: int = RECORD_MAX) -> bytes:
    """A checkpoint's JSON record (manifest, trainer state, marker), read only up to ``limit``: a larger one (however
    its size came about), a link or a FIFO is damage, a ValueError, found before anything is read or allocated."""
    try:
        return read_bounded(file, limit)
    except UntrustedFile as e:
        raise ValueError(str(e)) from None


def _encoding_of(manifest: Any) -> str:
    """The manifest's TENSOR_ENCODING (absent: TORCH_SAVE); ValueError for any other value (the one check of it)."""
    encoding = manifest.get(TENSOR_ENCODING, TORCH_SAVE) if isinstance(manifest, dict) else None
    if encoding not in ENCODINGS:
        raise ValueError(f"{TENSOR_ENCODING} {encoding!r} is none of {', '.join(ENCODINGS)}")
    return encoding


def _files(path: Path) -> list[str]:
    """Every file of a checkpoint but the marker, the manifest and its parts, as sorted relative paths."""
    skip = {MARKER, MANIFEST, DAMAGED}
    return sorted(
        rel
        for f in path.rglob("*")
        if f.is_file() and f.name not in skip and not (rel := str(f.relative_to(path))).startswith(f"{PARTS_DIR}/")
    )


_OWNER = re.compile(r"^__(\d+)_|rank[-_](\d+)")


def _owner(rel: str, world_size: int) -> int:
    """The rank that wrote a checkpoint file, by its name: DCP's ``__<rank>_<n>.distcp``, ``rng/rank-<rank>.pt``;
    anything else (``.metadata``, ``trainer_state.json``) is rank 0's."""
    m = _OWNER.search(Path(rel).name)
    rank = int(m.group(1) or m.group(2)) if m else 0
    return rank if rank < world_size else 0


def _shard_owners(shards: list[str], world_size: int) -> dict[str, int]:
    """The rank of ``world_size`` that verifies each DCP shard at a load: its writer's rank mapped contiguously onto
    this world (writer w of W -> w * world_size // W). On the same world size a rank verifies its own files; on
    another one, the files holding the part of the model a rank loads (FSDP and ZeRO shard contiguously), so a
    resharded load still hashes most bytes while reading them, and every rank gets a share."""
    writers = {rel: _owner(rel, 1 << 30) for rel in shards}
    saved_world = max(writers.values(), default=0) + 1
    return {rel: w * world_size // saved_world for rel, w in writers.items()}


def _digest(file: Path, checksum: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"size": file.stat().st_size}
    if checksum:
        entry["sha256"] = file_sha256(file)
    return entry


def _test_kill_point(step: int) -> None:
    """Fault injection for the tests: with HPCDIST_TEST_KILL_IN_SAVE=<step>, every rank SIGKILLs itself after
    writing that step's shards and before the manifest and marker (a crash in the middle of a save)."""
    if os.environ.get(KILL_ENV) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
