"""Rebuild the default process group in-process after a peer dies: the survivors keep their pids and memory, a warm
spare takes the dead rank's number.

The rendezvous is a TCPStore hosted by a small process of its own (:func:`serve`, ``python -m
hpcdist.fault.regroup``), never by a training rank: a store inside rank 0 would die with rank 0 and take every
survivor's way back with it. Each incarnation of the group is a *generation* n with its own key space,
``PrefixStore(f"gen{n}", store)``, so nothing a dead generation left behind (half-written gloo addresses, stale
claims) is read by the next one.

Protocol, generation n (all waits bounded):

1. every member claims its rank: ``compare_set(f"rank/{r}", "", "member:<pid>")`` under gen n. Exactly one
   process owns a rank per generation; a process that finds its rank taken is :class:`Evicted`.
2. a survivor waits up to ``settle_s`` for every rank to be claimed. A rank still unclaimed then is declared dead:
   its key becomes ``vacant`` (so the dead rank, should it be merely slow, is evicted instead of doubling up) and
   one vacancy ``"<n>:<rank>:<world_size>"`` is posted on a queue that the spares read.
3. a spare (:func:`standby`) took a ticket ``j`` when it started and waits for vacancy ``j``; it then owns the rank.
4. everyone calls ``init_process_group`` on ``PrefixStore("pg", gen n)`` with the same world size; gloo's
   full-mesh connect is the barrier and ``timeout_s`` bounds it (no spare, or a second death: :class:`RegroupFailed`
   after the next generations were tried until the deadline).

``settle_s`` is the price of not knowing who died: it must exceed the time by which survivors notice the failure
apart. A survivor blocked in the failed collective notices within milliseconds (gloo raises on the dead peer's
closed connection, or on a peer that already left); one busy computing notices only at its next collective, so on a
real model ``settle_s`` exceeds the compute between two collectives.

What survives is the caller's business: after :func:`regroup` (or :func:`standby`) every member calls
:func:`agree_resume_step` so all resume at the newest step every survivor has completed. Wrappers that hold the old
group (DDP's reducer, FSDP's meshes, DeepSpeed's groups) must be rebuilt by the caller; tensors need not be.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

__all__ = [
    "Evicted",
    "Membership",
    "RegroupFailed",
    "agree_resume_step",
    "connect",
    "join_group",
    "mark_done",
    "regroup",
    "serve",
    "standby",
]

VACANT = "vacant"
_SPARE_TICKETS = "spare/tickets"  # each spare's ticket j: it fills the j-th vacancy ever posted
_VACANCIES = "spare/vacancies"
_DONE = "job/done"
_POLL_S = 0.05
_STARTED = "started"  # in a generation's store: the wall time its first survivor began the regroup
_SPARE_POLL_S = 0.1  # a spare's look at the vacancy queue: its share of the recovery time
# a rank that has not completed any step yet: larger than every real step, so MIN ignores it
_NO_STEP = 2**62


class Evicted(RuntimeError):
    """This process's rank was given to another (it was declared dead while slow): it must leave the job."""


class RegroupFailed(RuntimeError):
    """No complete group formed before the deadline (no spare came, or members kept failing)."""


@dataclass(frozen=True)
class Membership:
    """This process's place in the current generation of the group."""

    rank: int
    world_size: int
    generation: int
    started: float | None = None  # a later generation: when its first survivor began the regroup (wall time)


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def serve(port: int = 0, *, timeout_s: float = 300) -> dist.TCPStore:
    """Host the rendezvous store in this process (the launcher's helper process, not a rank); ``store.port`` is the
    port bound (useful with ``port=0``). The store lives as long as the returned object and this process.

    torch's TCPStore server listens on every interface, whatever host name it is given, and has no
    authentication: like torchrun's own store, it belongs on a network that only the job's hosts reach."""
    return dist.TCPStore("localhost", port, is_master=True, wait_for_workers=False, timeout=_delta(timeout_s))


def connect(host: str, port: int, *, timeout_s: float = 300) -> dist.TCPStore:
    """A client of the rendezvous store; ``timeout_s`` bounds every blocking store call made through it."""
    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=_delta(timeout_s))


def _generation(store: dist.Store, n: int) -> dist.PrefixStore:
    return dist.PrefixStore(f"gen{n}", store)


def _claim(gen: dist.Store, rank: int, value: str) -> bool:
    return gen.compare_set(f"rank/{rank}", "", value).decode() == value


def _init(gen: dist.Store, membership: Membership, collective_timeout_s: float, backend: str) -> None:
    # The default group's store keys carry a per-process counter (its name, "0" after a clean destroy). A failed
    # init_process_group (a peer died while the group formed) bumps it and nothing resets it, so this process would
    # wait under "gen<n>/pg/1/..." while its peers publish under "gen<n>/pg/0/...": never the same group. No group
    # exists here, so restarting the count is what a clean destroy would have done.
    if not dist.is_initialized():
        distributed_c10d._world.group_count = 0
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore("pg", gen),
        rank=membership.rank,
        world_size=membership.world_size,
        timeout=_delta(collective_timeout_s),
    )


def _leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    # gloo closes a group's connections only when the group object is freed: collected now, a peer still blocked
    # on one of this process's groups fails at once instead of at its timeout
    gc.collect()


def join_group(
    store: dist.Store,
    rank: int,
    world_size: int,
    *,
    generation: int = 0,
    collective_timeout_s: float = 60,
    backend: str = "gloo",
) -> Membership:
    """Form the first generation: claim ``rank`` and initialise the default process group with the others."""
    gen = _generation(store, generation)
    if not _claim(gen, rank, f"member:{os.getpid()}"):
        raise Evicted(f"rank {rank} of generation {generation} is already taken")
    membership = Membership(rank, world_size, generation)
    _init(gen, membership, collective_timeout_s, backend)
    return membership


def _wait_claimed(gen: dist.Store, world_size: int, settle_s: float) -> list[int]:
    """The ranks still unclaimed after ``settle_s`` (or none, as soon as every rank is claimed)."""
    keys = [f"rank/{r}" for r in range(world_size)]
    deadline = time.monotonic() + settle_s
    while True:
        missing = [r for r, key in enumerate(keys) if not gen.check([key])]
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(_POLL_S)


def _declare_vacant(store: dist.Store, gen: dist.Store, n: int, rank: int, world_size: int) -> None:
    """Mark ``rank`` dead in generation ``n`` and post one vacancy for it, however many survivors race here."""
    current = gen.compare_set(f"rank/{rank}", "", VACANT).decode()
    if current != VACANT:
        return  # claimed after all, just in time: a slow survivor, not a dead one
    if gen.add(f"posted/{rank}", 1) != 1:
        return  # another survivor posted it
    ticket = store.add(_VACANCIES, 1) - 1
    store.set(f"spare/vacancy/{ticket}", f"{n}:{rank}:{world_size}")


def regroup(
    store: dist.Store,
    membership: Membership,
    *,
    settle_s: float = 10,
    timeout_s: float = 120,
    collective_timeout_s: float = 60,
    backend: str = "gloo",
) -> Membership:
    """Leave the failed group and join the next generation with the same rank and world size.

    Called by every survivor after a collective raised (a dead peer's closed connection, or the collective
    timeout). Ranks found dead after ``settle_s`` are offered to the spares; the group forms once every rank is
    owned. Tries later generations (another death during the rebuild) until ``timeout_s`` has passed, then raises
    :class:`RegroupFailed`; raises :class:`Evicted` if this rank was already given away."""
    _leave()
    deadline = time.monotonic() + timeout_s
    n = membership.generation
    last_error: BaseException | None = None
    while time.monotonic() < deadline:
        n += 1
        gen = _generation(store, n)
        if not _claim(gen, membership.rank, f"member:{os.getpid()}"):
            raise Evicted(f"rank {membership.rank} of generation {n} was given to another process")
        gen.compare_set(_STARTED, "", f"{time.time():.6f}")  # the first survivor here says when the recovery began
        for dead in _wait_claimed(gen, membership.world_size, settle_s):
            _declare_vacant(store, gen, n, dead, membership.world_size)
        nxt = Membership(membership.rank, membership.world_size, n)
        try:
            _init(gen, nxt, min(collective_timeout_s, max(deadline - time.monotonic(), 1.0)), backend)
            return nxt
        except RuntimeError as err:  # a member died while the group formed, or the spare never came
            last_error = err
            _leave()
    raise RegroupFailed(f"no complete group of {membership.world_size} within {timeout_s} s: {last_error}")


def standby(
    store: dist.Store, *, timeout_s: float = 3600, collective_timeout_s: float = 60, backend: str = "gloo"
) -> Membership | None:
    """Wait (bounded) as a warm spare for a dead rank's number, then join its generation as that rank.

    Start it early: it has imported torch and connected to the store already, so a recovery costs only the
    group's rebuild, not an interpreter's start. A vacancy whose generation the survivors already left (they moved
    on after another failure, and posted a new vacancy there) is skipped for the next one. Returns None once the
    job marked itself done (:func:`mark_done`: no rank will ever need this spare); raises :class:`RegroupFailed` if
    no group formed within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    me = f"spare:{os.getpid()}"
    while (left := deadline - time.monotonic()) > 0:
        key = f"spare/vacancy/{store.add(_SPARE_TICKETS, 1) - 1}"
        while not store.check([key]):
            if store.check([_DONE]):
                return None
            if time.monotonic() >= deadline:
                raise RegroupFailed(f"no vacancy filled within {timeout_s} s")
            time.sleep(_SPARE_POLL_S)
        n, rank, world_size = (int(v) for v in store.get(key).decode().split(":"))
        if _abandoned(store, n, world_size):
            continue
        gen = _generation(store, n)
        if gen.compare_set(f"rank/{rank}", VACANT, me).decode() != me:
            continue
        membership = Membership(rank, world_size, n, started=_started(gen))
        try:
            _init(gen, membership, min(collective_timeout_s, max(left, 1.0)), backend)
            return membership
        except RuntimeError:
            _leave()
    raise RegroupFailed(f"no vacancy filled within {timeout_s} s")


def _started(gen: dist.Store) -> float | None:
    """When generation ``gen``'s recovery began, as its first survivor wrote it (None if unset or not a time)."""
    if not gen.check([_STARTED]):
        return None
    try:
        value = float(gen.get(_STARTED).decode()[:32])
    except (UnicodeDecodeError, ValueError):
        return None
    return value if math.isfinite(value) and value > 0 else None


def mark_done(store: dist.Store, exit_code: int = 0) -> None:
    """The job's training ended (rank 0 returned, with the exit status its ranks end with): waiting spares leave
    instead of waiting out their timeout, and the store's host learns how the training ended (:func:`main`)."""
    store.set(_DONE, str(int(exit_code)))


def _abandoned(store: dist.Store, n: int, world_size: int) -> bool:
    """Whether a member already claimed a rank in generation n + 1: generation n will never form."""
    later = _generation(store, n + 1)
    return any(later.check([f"rank/{r}"]) for r in range(world_size))


def agree_resume_step(completed: int | None) -> int:
    """The step every member resumes at: the smallest of the survivors' completed step counts (``None`` for a
    spare, which has none). A survivor may be one step ahead (it completed a collective that a peer did not), so it
    keeps the snapshot before its last step; the spare receives that state from a survivor."""
    value = torch.tensor([_NO_STEP if completed is None else completed], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    step = int(value.item())
    if step == _NO_STEP:
        raise RuntimeError("no member of the group has completed a step: nothing to resume from")
    return step


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hpcdist.fault.regroup [--port P]``: host the rendezvous store until SIGTERM. Prints the port
    bound, then ``done <status>`` once rank 0 marked the training ended (:func:`mark_done`): the launcher's way to
    tell a recovered run, whose step lost a task, from a failed one."""
    parser = argparse.ArgumentParser(prog="python -m hpcdist.fault.regroup", description=main.__doc__)
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on stdout)")
    args = parser.parse_args(argv)
    store = serve(args.port)
    print(store.port, flush=True)

    def end(*_: object) -> None:
        # the launcher ends the store when the training step has ended, recovered or not: spares still waiting
        # leave on the mark (a spare ignores the signal itself, as every rank does during its start-up)
        if not store.check([_DONE]):
            store.set(_DONE, "aborted")
            time.sleep(3 * _SPARE_POLL_S)
        sys.exit(0)

    signal.signal(signal.SIGTERM, end)
    while not store.check([_DONE]):
        time.sleep(0.2)
    print(f"done {store.get(_DONE).decode()}", flush=True)
    while True:  # the spares read the mark from here: the store stays until the launcher ends it
        signal.pause()


if __name__ == "__main__":
    sys.exit(main())
