"""The peer copy's transport: one step directory sent from a node to the next over the job's own ranks, as
point-to-point messages of at most ``CHUNK`` bytes (memory stays bounded, no ssh), and received into a
``.partial`` directory whose COMPLETE is written once every byte matched the manifest.

:class:`StepTransport` is what the tier needs of a transport: ``send`` and ``recv`` of one step directory between
two ranks, and the ring's round (``exchange``) built on them; :class:`PeerTransport` implements them over a gloo
group. The receiving side's checks (:class:`_Sink`) belong to every transport: what arrives is trusted only once it
matched the manifest that came with it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpcdist.base.atomic import atomic_write
from hpcdist.base.owners import writer_problem
from hpcdist.base.units import size_text
from hpcdist.checkpoint.local.layout import FILE_NAME, MAX_FILES, listing, make_room
from hpcdist.checkpoint.manifest import MANIFEST, read_record
from hpcdist.checkpoint.names import MARKER, step_name

CHUNK = 16 << 20  # bytes per point-to-point message: one send and one receive buffer per rank at a time


HEADER_MAX = 1 << 20  # a copy's file list, JSON


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
                if not isinstance(name, str) or not FILE_NAME.match(name) or name in (MARKER, ".", ".."):
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
                make_room(old)
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


class NothingAnnounced(ValueError):
    """The sender announced no file list: its own log says why (the directory could not be listed)."""


class StepTransport(ABC):
    """How one rank's step directory reaches another rank: ``send`` on the rank holding it, ``recv`` on the rank
    that keeps it, each blocking until its side is done (torchft's CheckpointTransport is the model: a transport over
    HTTP or RDMA implements these two). ``exchange``, the round of the tier's ring, is built on them alone."""

    rank: int
    world_size: int

    @abstractmethod
    def send(self, dst: int, step: int, src_dir: Path, origin: int, *, group: Any = None) -> None:
        """``src_dir``, rank ``origin``'s files of ``step``, to rank ``dst`` (which calls ``recv``). Raises after the
        last message when something went wrong on this side; the receiver then refuses the copy."""

    @abstractmethod
    def recv(self, src: int, step: int, into: Path, origin: int, *, group: Any = None) -> None:
        """Rank ``origin``'s files of ``step`` from rank ``src`` into ``into/step-N`` (through ``step-N.partial``,
        COMPLETE written once every byte matched the manifest that came with them); anything else raises, and
        nothing of it is left but what the checks refused to trust."""

    def exchange(
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
        """One round: this rank sends (``send``: (this rank, receiver)) the directory ``source(origin)`` and/or
        receives (``recv``: (sender, this rank)) one into ``dest(o)``, ``o`` the rank whose files come: the sender
        when replicating, this rank when a restore fetches its own files back. Both at once (the send on a thread of
        its own while this one receives): in a ring every rank sends and receives, so neither side may wait for the
        other to end first. Raises what went wrong once both sides are done, the receiving side's first (what this
        rank holds), unless its peer announced nothing and this rank's own send failed too."""
        outcome: list[BaseException] = []
        sender = None
        if send is not None:
            src_dir = source(origin)

            def run() -> None:
                try:
                    self.send(send[1], step, src_dir, origin, group=group)
                except BaseException as e:  # raised on the calling thread below, after the join
                    outcome.append(e)

            sender = threading.Thread(target=run, name=f"hpcdist-local-send-{step}", daemon=True)
            sender.start()
        received: BaseException | None = None
        try:
            if recv is not None:
                expect = self.rank if restore else recv[0]
                self.recv(recv[0], step, dest(expect), expect, group=group)
        except BaseException as e:
            received = e
        finally:
            if sender is not None:
                sender.join()  # its messages end by themselves: received, or timed out by the group
        sent = outcome[0] if outcome else None
        if isinstance(received, NothingAnnounced) and sent is not None:
            raise sent
        if received is not None:
            raise received
        if sent is not None:
            raise sent


class PeerTransport(StepTransport):
    """Step directories between this rank and its peers as point-to-point messages over the job's own ranks (a
    gloo group; every wait bounded by that group's timeout). On the wire, in this order: the sizes (int64: the
    header's bytes, the files' bytes), the header (JSON: origin, step, the files' names and sizes), then the files'
    bytes concatenated, in messages of at most ``CHUNK`` bytes."""

    def __init__(self, rank: int, world_size: int, group: Any = None):
        self.rank, self.world_size, self.group = rank, world_size, group

    def send(self, dst: int, step: int, src_dir: Path, origin: int, *, group: Any = None) -> None:
        """A directory that cannot be listed is announced as nothing (no header: the receiver expects no more); a
        file that shrank since it was listed is sent as zeros (the receiver stays in step and its manifest check
        refuses the copy). Either raises here after the last message."""
        g = self.group if group is None else group
        header, files, error = b"", [], None
        try:
            files = [(n, s) for n, s in sorted(listing(src_dir).items()) if n != MARKER]
            header = json.dumps({"origin": origin, "step": step, "files": files}).encode()
            if len(header) > HEADER_MAX:
                raise ValueError(f"a file list of {len(header)} bytes")
        except (OSError, ValueError) as e:  # announce nothing: the receiver expects nothing more
            error, header, files = e, b"", []
        total = sum(s for _, s in files)
        dist.send(torch.tensor([len(header), total], dtype=torch.int64), dst, group=g)
        if header:
            dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8), dst, group=g)
        chunks = _chunks(src_dir, files) if files else iter(())
        for i in range(-(-total // CHUNK)):
            try:
                out = next(chunks)  # a view of one reused buffer: each send ends before the next read
            except (OSError, StopIteration) as e:  # a file shrank: zeros keep the receiver in step; its
                error = error or e  # manifest check rejects the copy
                out = torch.zeros(min(CHUNK, total - i * CHUNK), dtype=torch.uint8)
            dist.send(out, dst, group=g)
        if error is not None:
            raise error

    def recv(self, src: int, step: int, into: Path, origin: int, *, group: Any = None) -> None:
        """Takes every byte the sender announced, even after a problem on this side (a refused header, a full
        disk): the next round's messages stay in step. Raises that problem (or the manifest check's) at the end."""
        g = self.group if group is None else group
        got = torch.zeros(2, dtype=torch.int64)
        dist.recv(got, src, group=g)
        announced = int(got[0])
        if not 0 < announced <= HEADER_MAX:  # our own sender never announces more
            raise NothingAnnounced(f"rank {src} sent no file list (its log says why)")
        rhdr = torch.zeros(announced, dtype=torch.uint8)
        dist.recv(rhdr, src, group=g)
        total = int(got[1])
        sink = _Sink(lambda _origin: into, rhdr.numpy().tobytes(), total, step, self.world_size, origin)
        rbuf: torch.Tensor | None = None
        for i in range(-(-total // CHUNK)):
            if rbuf is None:
                rbuf = torch.empty(min(CHUNK, total), dtype=torch.uint8)  # one buffer, reused
            part = rbuf[: min(CHUNK, total - i * CHUNK)]
            dist.recv(part, src, group=g)
            sink.write(part.numpy())
        sink.finish()  # raises what went wrong on the receiving side
