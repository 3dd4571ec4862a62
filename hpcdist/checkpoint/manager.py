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

Every file but DCP's goes through the manager's :class:`~hpcdist.checkpoint.storage.Storage` (the step directories'
one surface: a POSIX directory by default); restoring one checkpoint is :mod:`hpcdist.checkpoint.load`'s, an async
save's finish :mod:`hpcdist.checkpoint.staging`'s.

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
import json
import os
import signal
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from hpcdist import agree
from hpcdist.base.logging_utils import get_logger
from hpcdist.checkpoint.codec import KILL_WRITER_ENV, HashingWriter, PartSpec, single_process_dcp, writer_thread_errors
from hpcdist.checkpoint.errors import (
    READ_DAMAGE,
    READ_OK,
    CheckpointSaveError,
    UntrustedCheckpoint,
    describe_error,
    error_of,
    is_io_error,
)
from hpcdist.checkpoint.load import load_checkpoint, load_matching_weights, read_step_files
from hpcdist.checkpoint.manifest import PARTS_DIR, write_manifest
from hpcdist.checkpoint.names import DAMAGED, MARKER, step_dir, step_of
from hpcdist.checkpoint.policy import SavePolicy
from hpcdist.checkpoint.ranks import Ranks
from hpcdist.checkpoint.staging import (
    SOLO_PROCESS,
    CheckpointProcess,
    Staging,
    checkpoint_process,
    finish_async,
    size_text,
)
from hpcdist.checkpoint.state import RANK_DIR, STATE_FILE, Checkpointable, rng_state
from hpcdist.checkpoint.storage import (
    PosixStorage,
    Storage,
    nearly_full,
    newest,
    prune,
    refuse_if_only_damaged,
    set_aside_newer,
)
from hpcdist.checkpoint.verify import verify_checkpoint
from hpcdist.config.dirs import trusted_uids
from hpcdist.config.loader import ConfigError

KILL_ENV = "HPCDIST_TEST_KILL_IN_SAVE"  # test-only fault injection, see _test_kill_point
log = get_logger(__name__)


class CheckpointManager(SavePolicy):
    """Saves and resumes step-N checkpoints collectively; every rank calls every method. The loop asks it when to
    save (the cadence it is: :class:`SavePolicy`)."""

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
        every_minutes: float | str = 0.0,
        save_final: bool = True,
        total_steps: int | None = None,
        trusted_owners: Sequence[str] = (),
        local_every_steps: int = 0,
        local_every_minutes: float = 0.0,
        storage: Storage | None = None,
    ):
        """The cadence (:class:`SavePolicy`): ``every_steps`` / ``every_minutes`` (0: never), ``save_final`` at
        ``total_steps`` (train.steps; None: every last step is the run's end), the node-local tier's own."""
        super().__init__(
            rank=rank,
            every_steps=every_steps,
            every_minutes=every_minutes,
            save_final=save_final,
            total_steps=total_steps,
            local_every_steps=local_every_steps,
            local_every_minutes=local_every_minutes,
        )
        self.root, self.world_size = Path(root), world_size
        self.storage: Storage = storage if storage is not None else PosixStorage(self.root)
        self.last_ok = True  # the last save succeeded, as far as the save itself knows (an async one: see wait())
        self.trusted = trusted_uids(trusted_owners)  # besides this user and root
        self.keep_last, self.async_save, self.verify_mode = keep_last, async_save, verify
        self.write_threads = max(1, write_threads)
        self._pending: Future[bool] | None = None  # an async save's completion: marker written (True) or failed
        self._pending_path: Path | None = None  # that save's directory
        self._last_writer: HashingWriter | None = None  # the last sync save's writer: its files' digests
        self._stager: Staging | None = None  # async save: staging buffers, allocated once, reused
        self._staged: Future[dict[str, Any]] | None = None  # an async save's copy into them, until staging_fence
        self._process: CheckpointProcess | None = None  # async save: the process that writes them
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
        self.ranks = Ranks(rank, world_size, self._pg, self.write_threads)

    # ------------------------------------------------------------------------------------------ save
    def save(self, step: int, state: Checkpointable) -> Path | None:
        """Write step-N collectively; None when it failed with an I/O error (disk full, EIO, quota): then the partial
        directory is removed, every rank logs why, and the previous complete checkpoint stays the resume point.
        Any other error (a bug: training on would silently never checkpoint again) raises CheckpointSaveError on
        every rank, after the same clean-up."""
        self.saving(step)  # checkpoint.every_minutes counts from the start of the last save
        self.last_ok = False
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
            if self.storage.has(path, DAMAGED):  # a demoted checkpoint is evidence: moved aside, never deleted
                aside = self.storage.set_aside(path, "damaged")
                log.warning("kept the damaged %s as %s (saving step %s again)", path.name, aside.name, step_of(path))
            elif self.storage.has(path, MARKER):  # a complete checkpoint is never deleted to make room for a save
                aside = self.storage.set_aside(path, "abandoned")
                log.warning("kept the complete %s as %s (saving step %s again)", path.name, aside.name, step_of(path))
            elif self.storage.exists(path):  # leftover of a crashed save at the same step: never mix old and new
                self.storage.remove(path)
            self.storage.create(path)  # fails when the leftover could not be removed
            if self.async_save:
                (path / PARTS_DIR).mkdir()

    def _write_local(self, path: Path, state: Checkpointable) -> None:
        with self.storage.open_writer(path, f"rng/rank-{self.rank:05d}.pt") as f:
            torch.save(rng_state(), f)
        own = state.rank_state()
        if own:  # inside the step directory: it counts only once COMPLETE is written after every rank's files
            with self.storage.open_writer(path, f"{RANK_DIR}/rank-{self.rank:05d}.pt") as f:
                torch.save(own, f)
        if self.rank == 0:
            with self.storage.open_writer(path, STATE_FILE) as f:
                f.write(json.dumps(state.trainer_state(), indent=1).encode())

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
                    ok = finish_async(
                        fut,
                        path,
                        self.ranks,
                        written=lambda: written_by(self._last_writer),
                        complete=lambda: (
                            self._write_manifest(path, distributed=False),
                            self._complete(path, step, t0),
                        ),
                    )
                finally:
                    done.set_result(ok)

            # staged into buffers allocated once and reused (shared memory, pinned on CUDA) in the background, while
            # the next step's forward and backward run; the loop waits for the copy only before its optimizer step
            # (staging_fence). The checkpoint process serialises, hashes and writes from the buffers once it is done
            staged = self._staged = self._staging().stage_async(state.dcp_state())
            if self._process is None:
                self._process = checkpoint_process(self._async_pg)
            writer = self._writer(path)
            kill = os.environ.get(KILL_WRITER_ENV) == str(step)
            writer.part = PartSpec(self.rank, self.world_size, step if kill else -1, os.getpid())
            self._pending, self._pending_path = done, path
            self._process.submit(staged, writer).add_done_callback(shards_written)
            return
        with single_process_dcp(), writer_thread_errors() as thread_errors:
            dcp.save(state.dcp_state(), storage_writer=self._writer(path), planner=state.save_planner)
        if thread_errors:  # DCP drops a writer thread's failure: its files are missing from the checkpoint
            raise thread_errors[0]
        _test_kill_point(step)

    def _staging(self) -> Staging:
        if self._stager is None:
            # copy threads: the node's cores shared by its ranks, as the write threads are (at least 2: the copies
            # wait on memory more than on a core)
            self._stager = Staging(threads=max(2, self.write_threads))
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

    def prepare_staging(self, dcp_state: Callable[[], dict[str, Any]]) -> Future[float] | None:
        """Async save: start allocating the staging buffers (after the first optimizer step, when the optimizer state
        exists) beside the steps that follow, so neither the loop nor a save stalls for it; the future gives the
        seconds it took (None: there already, being made, or no async save). Logged when done: a one-off cost of
        the run. ``dcp_state``: what a save writes (Checkpointable.dcp_state), called only when the buffers are
        made."""
        if not self.async_save or (self._stager is not None and self._stager.ready):
            return None
        stager = self._staging()
        fut = stager.prepare(dcp_state())
        if fut is not None:
            fut.add_done_callback(
                lambda f: (
                    f.exception() is None
                    and log.info(
                        "checkpoint.async_save: %s of staging buffers allocated beside training in %.2f s (once)",
                        size_text(stager.bytes()),
                        f.result(),
                    )
                )
            )
        return fut

    def _writer(self, path: Path) -> HashingWriter:
        # DCP serializes and writes with one thread by default: 0.29 GB/s here against dd's 1.07 for a 1.5 GB
        # state; two threads halve the save (tools/bench/checkpoint.py). The writer hashes what it writes, so the
        # manifest needs no second pass over the shards (docs/CHECKPOINTS.md: that pass was ~20% of a save)
        self._last_writer = HashingWriter(str(path), thread_count=self.write_threads)
        return self._last_writer

    def _write_manifest(self, path: Path, *, distributed: bool) -> None:
        """MANIFEST.json of ``path`` (:func:`~hpcdist.checkpoint.manifest.write_manifest`), with the digests the last
        sync save's writer took while writing."""
        write_manifest(path, self.ranks, written_by(self._last_writer), distributed=distributed, storage=self.storage)

    def _complete(self, path: Path, step: int, t0: float) -> None:
        if self.rank == 0:
            seconds = time.perf_counter() - t0
            marker = {"step": step, "world_size": self.world_size, "time": time.time(), "save_seconds": seconds}
            self.storage.write_marker(path, marker)
            log.info("checkpoint %s complete (%.2fs)", path, seconds)
            prune(self.storage, self.keep_last)

    def _abandon(self, path: Path, step: int) -> None:
        previous = newest(self.storage, warn=False)
        free = self.storage.free_bytes() or 0
        log.error(
            "checkpoint at step %d failed (see the error above; %.1f MB free in %s): the resume point stays %s",
            step,
            free / 1e6,
            self.root,
            previous or "none (no complete checkpoint)",
        )
        if self.rank == 0:
            self.storage.remove(path)  # frees the space; it never had a marker
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
            failed, again = agree.worst([0 if ok else 1, int(restart)], self._pg)
            ok, restart = failed == 0, bool(again)
        else:
            _barrier()
        if restart and self._process is not None:
            # a failed background write may have killed a checkpoint process or broken their group: every rank
            # starts new ones at the next save (a fresh port), so that save works
            self._process.close()
            if self._process is SOLO_PROCESS.get("process"):
                del SOLO_PROCESS["process"]
            self._process = None
        if not ok and path is not None and self.rank == 0 and not self.storage.has(path, MARKER):
            self.storage.remove(path)
        return ok

    def close(self) -> None:
        """Collective: wait for an async save in flight, then stop the checkpoint process and free the staging
        buffers. The manager can still save afterwards (they are made again)."""
        self.wait()
        if self._process is not None:
            if self._process is not SOLO_PROCESS.get("process"):  # a one-process run's is shared: it stays for the next
                self._process.close()
            self._process = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    # ------------------------------------------------------------------------------------------ collectives
    def _all_ok(self, err: BaseException | None, *, log_error: bool = True) -> bool:
        """Collective: True iff no rank failed; each failure is logged by the rank that had it (unless the caller
        reports it itself)."""
        if err is not None and log_error:
            log.error("rank %d: checkpoint I/O failed: %s", self.rank, describe_error(err))
        level = 0 if err is None else 1 if is_io_error(err) or nearly_full(self.storage) else 2
        level = agree.worst(level, self._pg)
        self._not_io = level == 2  # some rank's error was not I/O: save() raises on every rank alike
        return level == 0

    # ------------------------------------------------------------------------------------------ load
    def verify(self, path: Path, mode: str | None = None, *, shards: bool = True) -> list[str]:
        """Collective: what is wrong with ``path`` against its manifest (empty = intact). ``mode``: checksum,
        size or none (default: the manager's). ``shards=False``: the DCP shards (``*.distcp``) are checked by size
        only; their sha256 is taken while the load reads them (:class:`HashingReader`, ``shard_verdict``)."""
        mode = mode or self.verify_mode
        return verify_checkpoint(path, mode, shards=shards, ranks=self.ranks, storage=self.storage)

    def resolve(self, resume: str) -> Path | None:
        """``auto`` -> newest complete checkpoint that verifies (damaged ones are skipped, with a warning, for the
        previous one) or None; ``none`` -> None; else that directory (must be complete and intact)."""
        if resume == "none":
            return None
        if resume == "auto":
            newest(self.storage)  # warns about interrupted saves
            for _, found in reversed(self.storage.steps()[0]):
                path = self._trusted(found, "checkpoint.resume=auto")  # someone else's step dir in ours: stop
                problems = self.verify(path)
                if not problems:
                    return path
                self._demote(path, problems)
            refuse_if_only_damaged(self.storage)
            return None
        return self.named(Path(resume), "checkpoint.resume")

    def _trusted(self, path: Path, key: str) -> Path:
        """Collective: ``path`` with links resolved (what is loaded is what was checked), once nobody but this user,
        root or a trusted owner can have written anything in it; UntrustedCheckpoint (the same on every rank)
        otherwise. Rank 0 walks the tree alone (stat only) and tells the others: one walk per job, not per rank."""
        real = path.resolve()
        if not self.storage.exists(real):
            return path  # nothing to load from; the caller says what is missing
        problems = [self.storage.trust_problems(real, self.trusted) if self.rank == 0 else []]
        if self._pg is not None:
            dist.broadcast_object_list(problems, src=0, group=self._pg)
        if problems[0]:
            raise UntrustedCheckpoint(key, path, problems[0])
        return real

    def named(self, path: Path, key: str) -> Path:
        """Collective: a checkpoint the config names (``key``) must be trusted, complete and intact: ConfigError
        otherwise (the user's value is wrong, not the program: one message, exit 2; UntrustedCheckpoint when someone
        else could have written it). Also for readers outside the trainer (``hpcdist export``): ``path`` with links
        resolved."""
        path = self._trusted(path, key)
        if not self.storage.has(path, MARKER):
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

    def init_weights(self, path: Path, state: Checkpointable) -> dict[str, list[str]]:
        """Collective: ``checkpoint.init_from``. The model weights of the complete, intact checkpoint ``path`` that
        match this model by name and shape are loaded; everything else keeps its initialization (optimizer,
        schedule, data position and step start fresh). Returns what did not match (missing / unexpected / shape)."""
        self.staging_fence()
        return load_matching_weights(self.named(path, "checkpoint.init_from"), state, self.storage, self.ranks)

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
            if not self.storage.has(path, MARKER):
                raise ConfigError(
                    [
                        f"checkpoint.resume: {path} has no {MARKER} marker: it is not a checkpoint, or an "
                        "incomplete one that cannot be trusted; name a step-XXXXXXXX directory holding "
                        f"{MARKER}"
                    ]
                )
            kind, problems = read_step_files(
                path, self.ranks, partial(self.verify, path, shards=False), partial(self.load, path, state), saved
            )
            if kind == READ_DAMAGE:
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
        newest(self.storage)  # warns about interrupted saves
        for _, found in reversed(self.storage.steps()[0]):
            path = self._trusted(found, "checkpoint.resume=auto")  # someone else's step dir in ours: stop
            kind, problems = read_step_files(
                path, self.ranks, partial(self.verify, path, shards=False), partial(self.load, path, state), saved
            )
            if kind == READ_OK:
                self.saved_step = int(saved["step"])
                return path
            self._demote(path, problems[1:] if problems[0] == "verify" else [f"loading failed: {problems[1]}"])
        refuse_if_only_damaged(self.storage)
        return None

    def _set_aside_newer(self, step: int, resumed: Path | str) -> None:
        """Collective. Resuming an explicitly named step turns back from every newer checkpoint of this run: left as
        they are, the next ``checkpoint.resume=auto`` (a requeue, a rerun) would jump back to that abandoned line.
        They are renamed ``step-N.abandoned-<time>``: kept, never resumed or pruned, and said."""
        _barrier(self._pg)  # every rank has finished reading before rank 0 renames
        err = error_of(lambda: set_aside_newer(self.storage, step, resumed)) if self.rank == 0 else None
        if not self._all_ok(err):
            raise RuntimeError(f"could not set aside the checkpoints newer than step {step} in {self.root}")

    def _demote(self, path: Path, problems: list[str]) -> None:
        """A damaged checkpoint is never a resume candidate again: its marker is renamed (files kept to inspect)."""
        log.warning("checkpoint %s is damaged, using the previous complete one: %s", path, "; ".join(problems))
        _barrier(self._pg)  # every rank has read the marker before it goes
        if self.rank == 0:
            with contextlib.suppress(OSError):
                self.storage.demote(path)
        _barrier(self._pg)

    def load(self, path: Path, state: Checkpointable) -> dict[str, Any]:
        """Collective: restore ``path`` into ``state``; the trainer state as saved. Raises on any problem; the
        per-rank files are read first, so a rank that fails there fails before the collective part.

        With ``verify=checksum`` the shards are hashed while DCP reads them (:class:`HashingReader`: each byte read
        once) and their verdict is agreed by every rank after DCP's read and before anything is applied: the
        trainer state, the RNG, a rank's own state and the pickled (non-tensor) entries of the optimizer state are
        taken only from a checkpoint that verified. Damage raises :class:`ShardsDamaged` on every rank; the DCP
        tensors of ``state`` then hold values of the damaged checkpoint, so the caller loads another checkpoint
        whole (a part it lacks refuses, :class:`CheckpointTainted`) or stops."""
        self.staging_fence()
        checksum = self.verify_mode == "checksum"
        return load_checkpoint(path, state, self.storage, self.ranks, checksum=checksum, tainted=self._tainted)


def _barrier(group: Any = None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _test_kill_point(step: int) -> None:
    """Fault injection for the tests: with HPCDIST_TEST_KILL_IN_SAVE=<step>, every rank SIGKILLs itself after
    writing that step's shards and before the manifest and marker (a crash in the middle of a save)."""
    if os.environ.get(KILL_ENV) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)


def written_by(writer: HashingWriter | None) -> dict[str, dict[str, Any]]:
    """The digests ``writer`` took of the shards while it wrote them (none without a writer: an async save's
    process hashed its own)."""
    return writer.digests() if writer is not None else {}
