"""An async save: the state copied into reused host buffers (pinned when CUDA is there) beside the next step, the
checkpoint process that writes them while training goes on, and the finish once its shards are written (each rank's
part of the manifest, then rank 0's manifest and marker); the memory that costs, estimated and checked before the
run starts."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import logging
import math
import multiprocessing as mp
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.cuda._pin_memory_utils as pin_memory_utils
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed.checkpoint import _async_process_executor as ape  # process-based async save
from torch.distributed.elastic.utils.distributed import get_free_port

from hpcdist.base.logging_utils import get_logger
from hpcdist.base.units import size_text
from hpcdist.checkpoint.codec import HashingWriter, single_process_dcp
from hpcdist.checkpoint.errors import describe_error, error_of
from hpcdist.checkpoint.manifest import MANIFEST, PARTS_DIR, write_part
from hpcdist.checkpoint.ranks import Ranks
from hpcdist.config.loader import ConfigError
from hpcdist.models.hf_directory import available_memory

log = get_logger(__name__)


class Staging:
    """An async save's host copy of the state: allocated once (``prepare``, after the first optimizer step, beside
    the training steps that follow; else by the first save) in shared memory, so the checkpoint process maps it
    without a copy (pinned on CUDA, for fast device-to-host copies), and refilled by every later save. The allocation
    is ours
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
        self._preparing: Future[float] | None = None  # the allocation running beside training (``prepare``)

    @property
    def ready(self) -> bool:
        """The buffers exist (a save refills them)."""
        return self._cache is not None

    def bytes(self) -> int:
        """Host memory the buffers hold."""
        return staging_bytes(self._cache) if self._cache is not None else 0

    def prepare(self, state: dict[str, Any]) -> Future[float] | None:
        """Start allocating the buffers for ``state`` beside training; the future gives the seconds it took (None:
        they exist or are being made). Only the state's structure is read (shapes, dtypes, layouts), never its values,
        so the steps that run meanwhile may change them; every page is touched here, so no later save pays the
        page faults. A save that comes first waits for the allocation to end."""
        if self._cache is not None or self._preparing is not None:
            return None
        # its own thread, at the lowest priority: the page faults cost CPU time, which a training step on the CPU
        # needs more (on a GPU node the cores are mostly idle)
        pool = ThreadPoolExecutor(1, thread_name_prefix="hpcdist-stage-alloc")
        self._preparing = pool.submit(self._allocate, state)
        pool.shutdown(wait=False)  # the thread ends with the allocation
        return self._preparing

    def _allocate(self, state: dict[str, Any]) -> float:
        with contextlib.suppress(OSError, AttributeError):  # this thread only (Linux: a thread is a task)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        t0 = time.perf_counter()
        self._release()
        self._pinned = torch.cuda.is_available()  # for fast device-to-host copies
        self._cache, self._flats = _host_buffers(state, pin=self._pinned)
        if not self._pinned:  # pinning maps every page already
            for flat in self._flats:
                _touch(flat)
        self.allocate_seconds = time.perf_counter() - t0
        return self.allocate_seconds

    def _wait_prepared(self) -> None:
        preparing, self._preparing = self._preparing, None
        if preparing is not None:
            preparing.result()  # its failure (no memory) is the save's

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state`` into the buffers and return the staged state."""
        return self.stage_async(state).result()

    def stage_async(self, state: dict[str, Any]) -> Future[dict[str, Any]]:
        """Start copying ``state`` into the buffers; the future gives the staged state once every byte is copied.
        Until then the state's tensors must not change (the trainer: ``CheckpointManager.staging_fence`` before its
        optimizer step) and no other refill may start (the caller waits for this one first). The pairing of source
        and buffer, and so every value that is not a tensor, is taken here, before returning."""
        staged, tasks = None, None
        self._wait_prepared()
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
        with contextlib.suppress(Exception):  # an allocation that failed fails no close
            self._wait_prepared()
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
_TOUCH = 64 << 20  # bytes per memset: the GIL is released for each, so the training thread runs between them


def _touch(flat: torch.Tensor) -> None:
    """Fault in every page of a new buffer on this thread, one memset at a time (ctypes releases the GIL for the
    call; torch's own fill would run on the intra-op threads the training step uses)."""
    ptr, n = flat.data_ptr(), flat.numel() * flat.element_size()
    for start in range(0, n, _TOUCH):
        ctypes.memset(ptr + start, 0, min(_TOUCH, n - start))


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


def finish_async(
    fut: Future[Any],
    path: Path,
    ranks: Ranks,
    *,
    written: Callable[[], dict[str, dict[str, Any]]],
    complete: Callable[[], Any],
) -> bool:
    """True when this rank's part of the async save ``fut`` of ``path`` is done (rank 0: ``complete``, the manifest
    and the marker, done too). ``written``: the digests this process's writer took (none when the checkpoint
    process wrote the shards: it leaves this rank's part itself)."""
    # runs in DCP's background thread on every rank once its shards are written (rank 0: and .metadata): each
    # rank hashes its own files and leaves its part in .manifest/ (no collectives off the main thread); rank 0
    # merges the parts into MANIFEST.json and writes the marker
    err = fut.exception()
    # the checkpoint process writes this rank's part; else hash here. MANIFEST.json there means rank 0 has merged
    # every part (ours included) and removed .manifest/: writing it again would put the directory back
    done = (path / PARTS_DIR / f"rank-{ranks.rank:05d}.json").is_file() or (path / MANIFEST).is_file()
    if err is None and not done:
        err = error_of(lambda: write_part(path, ranks, written()))
    if err is not None:
        log.error(
            "async checkpoint %s failed on rank %d: %s; it stays incomplete", path, ranks.rank, describe_error(err)
        )
        with contextlib.suppress(OSError):
            write_part(path, ranks, {}, failed=err)  # rank 0 stops waiting for this rank's part
        return False
    if ranks.rank == 0:
        err = error_of(complete)
        if err is not None:
            log.error("async checkpoint %s failed: %s; it stays incomplete", path, describe_error(err))
            return False
    return True


class CheckpointProcess:
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


SOLO_PROCESS: dict[str, CheckpointProcess] = {}  # a process without a process group: one checkpoint process for all


def checkpoint_process(group: Any) -> CheckpointProcess:
    """The checkpoint process for a manager's saves: per manager in a job (its group is the manager's), one per
    training process without a process group (a second manager in it, ``hpcdist import`` or the tests, reuses it
    instead of spawning and importing torch again)."""
    if dist.is_initialized():
        return CheckpointProcess(group)
    if "process" not in SOLO_PROCESS:
        SOLO_PROCESS["process"] = CheckpointProcess(group)
    return SOLO_PROCESS["process"]


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


def check_staging_fits(module: torch.nn.Module, ranks_per_node: int) -> None:
    """``check_staging_memory`` for a save of ``module`` on this node, before the first step: its estimate
    against the memory the process may still take and /dev/shm's free space (None where there is none)."""
    shm = Path("/dev/shm")
    check_staging_memory(
        staging_estimate(module),
        ranks_per_node,
        available_memory(),
        shutil.disk_usage(shm).free if shm.is_dir() else None,
    )
