"""Joining under a deadline: rank 0's TCPStore as a side channel that exists before any process group.

``init_process_group`` waits for every rank or times out with a count ("3/4 clients joined"), never with the names
of the missing ones. Here each rank first posts a record (its audit) under its own key, so at the deadline rank 0
knows exactly which ranks did not arrive and on which host they were expected. The process group is then built
on the same store (one port, as with ``env://``), and the watchdog keeps using it while collectives run.
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from hpcdist.env import DistEnv

__all__ = ["JoinError", "JoinResult", "join", "key"]

NS = "nccl_check"
_POLL_S = 0.1
_ACK_WAIT_S = 5.0


def _first_line(err: BaseException) -> str:
    """c10d errors carry a C++ backtrace after the first line; the first line is the message."""
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def key(*parts: object) -> str:
    return "/".join([NS, *map(str, parts)])


class JoinError(RuntimeError):
    """This rank could not join: rank 0's store is unreachable, or rank 0 says ranks are missing."""


@dataclass
class JoinResult:
    """What rank 0 saw at the deadline (every rank receives it)."""

    store: dist.TCPStore
    records: list[dict[str, Any] | None]  # by rank; None for a rank that did not join (rank 0 only, else empty)
    hosts: list[str | None]  # hostname of every rank that joined
    missing: list[int] = field(default_factory=list)
    waited_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.missing

    def expected_host(self, rank: int, local_world_size: int) -> str:
        """Where a missing rank should have run: launchers place ranks in blocks of local_world_size per node."""
        node = rank // max(local_world_size, 1)
        for other, host in enumerate(self.hosts):
            if host is not None and other // max(local_world_size, 1) == node:
                return host
        return f"node index {node} (no rank of that node joined)"


def open_store(env: DistEnv, timeout_s: float) -> dist.TCPStore:
    """Rank 0 serves; the others connect, retrying until ``timeout_s`` (rank 0 may start last)."""
    return dist.TCPStore(
        env.master_addr,
        env.master_port,
        world_size=env.world_size,
        is_master=env.rank == 0,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,  # we wait ourselves, so the deadline ends with names instead of an exception
    )


def join(env: DistEnv, record: dict[str, Any], timeout_s: float) -> JoinResult:
    """Post ``record``, wait up to ``timeout_s`` for every rank; rank 0 decides and tells everybody.

    Raises :class:`JoinError` on ranks other than 0 when the store cannot be reached or ranks are missing; rank 0
    returns the result (with ``missing``) so it can report.
    """
    start = time.monotonic()
    try:
        store = open_store(env, timeout_s)
    except (RuntimeError, TimeoutError) as err:  # DistNetworkError / DistStoreError derive from RuntimeError
        raise JoinError(
            f"rank {env.rank} on {env.hostname}: could not reach rank 0's rendezvous store at "
            f"{env.master_addr}:{env.master_port} within {timeout_s:g} s: rank 0 did not start, or that address is "
            f"not reachable from here ({type(err).__name__}: {_first_line(err)})"
        ) from None
    store.set(key("join", env.rank), json.dumps(record))
    store.set(key("at", env.rank), "0\tjoined")  # the watchdog's first progress marker
    if env.rank != 0:
        return _follow(store, env, timeout_s - (time.monotonic() - start) + 30)

    records: list[dict[str, Any] | None] = [None] * env.world_size
    pending = set(range(env.world_size))
    deadline = start + timeout_s
    while pending:
        for rank in sorted(pending):
            if store.check([key("join", rank)]):
                records[rank] = json.loads(store.get(key("join", rank)))
                pending.discard(rank)
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(_POLL_S)
    hosts = [r["hostname"] if r else None for r in records]
    result = JoinResult(store, records, hosts, sorted(pending), time.monotonic() - start)
    store.set(key("join", "result"), json.dumps({"hosts": hosts, "missing": result.missing}))
    if result.missing:
        # rank 0 exits after its report and takes the store with it: let the others read the verdict first
        joined = env.world_size - len(result.missing) - 1
        until = time.monotonic() + _ACK_WAIT_S
        while store.add(key("join", "ack"), 0) < joined and time.monotonic() < until:
            time.sleep(_POLL_S)
    return result


def _follow(store: dist.TCPStore, env: DistEnv, timeout_s: float) -> JoinResult:
    """A rank other than 0 waits for rank 0's decision."""
    try:
        store.wait([key("join", "result")], datetime.timedelta(seconds=max(timeout_s, 1.0)))
        decided = json.loads(store.get(key("join", "result")))
        store.add(key("join", "ack"), 1)
    except (RuntimeError, TimeoutError) as err:
        raise JoinError(f"rank {env.rank}: no word from rank 0 after joining ({_first_line(err)})") from None
    if decided["missing"]:
        raise JoinError(f"rank {env.rank}: rank 0 gave up waiting for rank(s) {decided['missing']} (see its report)")
    return JoinResult(store, [], decided["hosts"], [], 0.0)
