"""Sharded checkpoints with torch.distributed.checkpoint (DCP).

Layout of one checkpoint, ``<dir>/step-00001234/``:

    *.distcp, .metadata     model + optimizer shards, written by every rank through DCP
    native/                 a strategy's own sharded files where DCP cannot hold its state (DeepSpeed ZeRO's
                            flat fp32 partitions and optimizer moments), written before the marker too
    trainer_state.json      step, tokens seen, data sampler, LR scheduler (rank 0)
    rng/rank-00003.pt       each rank's RNG states (plain tensors: loadable with weights_only=True)
    COMPLETE                written last, by rank 0, after every rank's shards are on disk

A directory without ``COMPLETE`` is a crashed or in-flight save: resume ignores it (with a warning) and
pruning never deletes a complete checkpoint before a newer one is complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from hpcdist.logging_utils import get_logger

MARKER = "COMPLETE"
NATIVE = "native"
STATE_FILE = "trainer_state.json"
_STEP_RE = re.compile(r"^step-(\d{8})$")
log = get_logger(__name__)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def list_checkpoints(root: Path) -> tuple[list[tuple[int, Path]], list[Path]]:
    """(complete checkpoints sorted by step, incomplete directories)."""
    complete, incomplete = [], []
    if not root.is_dir():
        return [], []
    for d in root.iterdir():
        m = _STEP_RE.match(d.name)
        if not m or not d.is_dir():
            continue
        if (d / MARKER).is_file():
            complete.append((int(m.group(1)), d))
        else:
            incomplete.append(d)
    return sorted(complete), sorted(incomplete)


def latest(root: Path, *, warn: bool = True) -> Path | None:
    """Newest complete checkpoint under ``root``; incomplete ones newer than it are reported and skipped."""
    complete, incomplete = list_checkpoints(root)
    newest = complete[-1][0] if complete else -1
    if warn:
        for d in incomplete:
            if int(d.name.split("-")[1]) > newest:
                log.warning("ignoring %s: no %s marker (an interrupted save); it will not be resumed from", d, MARKER)
    return complete[-1][1] if complete else None


@dataclass
class Stateful:
    """What a checkpoint holds, as callables so the manager never knows the strategy's types."""

    dcp_state: Callable[[], dict[str, Any]]
    """Sharded state (model + optimizer) for DCP; also the destination tensors on load."""
    load_dcp_state: Callable[[dict[str, Any]], None]
    trainer_state: Callable[[], dict[str, Any]]
    load_trainer_state: Callable[[dict[str, Any]], None]
    save_native: Callable[[Path], None] | None = None
    """Collective: write the strategy's own sharded state into the given directory (None: DCP holds it all)."""
    load_native: Callable[[Path], None] | None = None
    """Collective: restore what ``save_native`` wrote; called instead of the DCP load when the directory exists."""


class CheckpointManager:
    """Saves and resumes step-N checkpoints collectively; every rank calls every method."""

    def __init__(self, root: Path, *, rank: int, world_size: int, keep_last: int = 3, async_save: bool = False):
        self.root, self.rank, self.world_size = Path(root), rank, world_size
        self.keep_last, self.async_save = keep_last, async_save
        self._pending: Future[Any] | None = None
        self._pg = None
        if async_save and dist.is_initialized():
            # async DCP runs its collectives in a background thread while training runs collectives on the
            # default group; sharing one group between threads deadlocks, and on GPU jobs it must be a CPU group
            self._pg = dist.new_group(backend="gloo")

    # ------------------------------------------------------------------------------------------ save
    def save(self, step: int, state: Stateful) -> Path:
        self.wait()  # one save in flight at a time; also makes the previous checkpoint complete
        path = step_dir(self.root, step)
        if self.rank == 0:
            if path.exists():  # leftover of a crashed save at the same step: never mix old and new shards
                shutil.rmtree(path)
            (path / "rng").mkdir(parents=True)
        _barrier()
        t0 = time.perf_counter()
        torch.save(_rng_state(), path / "rng" / f"rank-{self.rank:05d}.pt")
        if self.rank == 0:
            _atomic_write(path / STATE_FILE, json.dumps(state.trainer_state(), indent=1))
        if state.save_native is not None:  # synchronous, collective; before the marker like every other file
            state.save_native(path / NATIVE)
        if self.async_save:
            fut = dcp.async_save(state.dcp_state(), checkpoint_id=str(path), process_group=self._pg)
            fut.add_done_callback(lambda f: self._finish(f, path, step, t0))
            self._pending = fut
        else:
            with _single_process_ok():
                dcp.save(state.dcp_state(), checkpoint_id=str(path))
            _barrier()  # every rank's shards and rng file are written before the marker
            self._finish(None, path, step, t0)
        return path

    def _finish(self, fut: Future[Any] | None, path: Path, step: int, t0: float) -> None:
        if fut is not None and fut.exception() is not None:
            log.error("async checkpoint %s failed: %s; it stays incomplete", path, fut.exception())
            return
        if self.rank == 0:
            seconds = time.perf_counter() - t0
            marker = {"step": step, "world_size": self.world_size, "time": time.time(), "save_seconds": seconds}
            _atomic_write(path / MARKER, json.dumps(marker))
            log.info("checkpoint %s complete (%.2fs)", path, seconds)
            self._prune()

    def wait(self) -> None:
        """Block until an async save in flight is complete (call before exit and before the next save)."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        _barrier()

    def _prune(self) -> None:
        complete, incomplete = list_checkpoints(self.root)
        for _, d in complete[: -self.keep_last]:
            shutil.rmtree(d, ignore_errors=True)
        newest = complete[-1][0] if complete else -1
        for d in incomplete:  # crashed saves older than a complete checkpoint are garbage
            if int(d.name.split("-")[1]) < newest:
                shutil.rmtree(d, ignore_errors=True)

    # ------------------------------------------------------------------------------------------ load
    def resolve(self, resume: str) -> Path | None:
        """``auto`` -> newest complete checkpoint or None; ``none`` -> None; else that directory (must be complete)."""
        if resume == "none":
            return None
        if resume == "auto":
            return latest(self.root)
        path = Path(resume)
        if not (path / MARKER).is_file():
            raise ValueError(
                f"checkpoint.resume: {path} has no {MARKER} marker; it is incomplete and cannot be trusted"
            )
        return path

    def load(self, path: Path, state: Stateful) -> dict[str, Any]:
        if state.load_native is not None and (path / NATIVE).is_dir():
            state.load_native(path / NATIVE)
        else:
            dest = state.dcp_state()
            metadata = dcp.FileSystemReader(str(path)).read_metadata()
            saved = {key.split(".", 1)[0] for key in metadata.state_dict_metadata}
            for part in [k for k in dest if k not in saved]:  # e.g. a ZeRO checkpoint's DCP part has no "optim"
                log.warning("%s holds no %r state: it is not restored (starts fresh)", path, part)
                del dest[part]
            with _single_process_ok():
                dcp.load(dest, checkpoint_id=str(path))
            state.load_dcp_state(dest)
        trainer_state = json.loads((path / STATE_FILE).read_text())
        state.load_trainer_state(trainer_state)
        rng_file = path / "rng" / f"rank-{self.rank:05d}.pt"
        if rng_file.is_file():  # absent when resuming on more ranks than saved: those ranks keep their seeded RNG
            _set_rng_state(torch.load(rng_file, weights_only=True))
        _barrier()
        return trainer_state


@contextlib.contextmanager
def _single_process_ok() -> Iterator[None]:
    # a one-process run uses DCP without a process group on purpose; DCP warns about that on every call
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
