"""The checkpoint's bytes through DCP, hashed while they are written and while they are read: :class:`HashingWriter`
(each tensor item as its raw bytes, each file's sha256 computed beside the write) and :class:`HashingReader` (both
encodings, each shard verified against the manifest as the load reads it). DCP's writer threads' errors are
collected here, not printed, and fail the save."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import queue
import signal
import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import FileSystem, _OverlappingCpuLoader, _SerialCpuLoader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from hpcdist.base.atomic import atomic_write
from hpcdist.checkpoint import directio
from hpcdist.checkpoint import manifest as manifest_io
from hpcdist.checkpoint.manifest import (
    ENCODINGS,
    MANIFEST,
    PARTS_DIR,
    RAW,
    TENSOR_ENCODING,
    TORCH_SAVE,
    file_owner,
    files_of,
)
from hpcdist.checkpoint.names import step_name
from hpcdist.checkpoint.state import RANK_DIR
from hpcdist.fault.supervise import _die_with_parent

KILL_WRITER_ENV = "HPCDIST_TEST_KILL_WRITER"  # test-only: the checkpoint process dies writing that step (PartSpec)


@contextlib.contextmanager
def single_process_dcp() -> Iterator[None]:
    """Around a ``dcp.save`` / ``dcp.load`` that runs without a process group on purpose (a one-process run, a
    conversion, ``init_from`` of a Hugging Face directory): DCP warns "assuming the intent is to ... in a single
    process" on every such call, even with ``no_dist=True``. The one place that says so. (An async save without a
    process group warns from DCP's worker thread, after this would have returned: nothing here can scope that.)"""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield


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
def writer_thread_errors() -> Iterator[list[BaseException]]:
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


@dataclass
class PartSpec:
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

        self.part: PartSpec | None = None  # async save: write this rank's manifest part after the shards

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
            die_with_trainer(self.part.trainer_pid)
        with writer_thread_errors() as thread_errors:  # DCP drops a writer thread's failure: its files are missing
            fut = super().write_data(plan, planner)
        if thread_errors:
            raise thread_errors[0]
        if self.part is not None:  # (DCP's writer joined its threads: the future is done)
            if self.part.kill_step >= 0 and Path(self.path).name == step_name(self.part.kill_step):
                os.kill(os.getpid(), signal.SIGKILL)
            # this rank's part of the manifest: its shards' digests from the writing, its small files read here
            root, written = Path(self.path), self.digests()
            part = dict(written)
            for rel in files_of(root):
                if rel.startswith(("rng/", f"{RANK_DIR}/")) and file_owner(rel, self.part.world_size) == self.part.rank:
                    part[rel] = manifest_io.digest(root / rel, checksum=True)
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


def read_metadata(path: str | os.PathLike[str]) -> Metadata:
    """DCP's ``.metadata`` of a checkpoint directory (unpickled: only for a directory whose trust checks passed).
    A file that does not unpickle to DCP metadata is damage (ValueError naming the file), found here rather than
    inside ``dcp.load``, which would log two tracebacks of its own fallbacks before failing."""
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except OSError:
        raise
    except Exception as e:  # what unpickling other bytes raises varies: any of it means "not DCP metadata"
        raise ValueError(f".metadata: not DCP metadata ({type(e).__name__}: {e})"[:300]) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise ValueError(f".metadata: not DCP metadata (a {type(metadata).__name__})")
    return metadata


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


def die_with_trainer(trainer_pid: int) -> None:
    """The checkpoint process gets SIGKILL when the trainer dies (Linux), so no orphan writes on into a checkpoint
    a restarted job may be saving again."""
    _die_with_parent()
    if os.getppid() != trainer_pid:  # the trainer died before the call
        os.kill(os.getpid(), signal.SIGKILL)
