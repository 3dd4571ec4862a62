"""In-process recovery: when a peer rank dies, the surviving ranks keep their processes, rebuild the process group
with :mod:`hpcdist.fault.regroup` and train on from the newest node-local snapshot; a warm spare takes the dead
rank's number and receives its state from the peer copy (docs/FAULTS.md, "In-process recovery").

A job opts in by starting a rendezvous store outside every rank (``python -m hpcdist.fault.regroup``, on a host
that is not a training host where it can) and giving each rank its address in ``HPCDIST_REGROUP_STORE=host:port``;
a process started with ``HPCDIST_REGROUP_SPARE=1`` as well is a warm spare: it has imported torch and hpcdist, read
the config and connected to the store, and waits there for a vacancy.

What survives a failure is the process (its imports, its data's memory maps, its CUDA context) and the run's state
in the node-local tier: each generation builds a fresh Trainer, whose resume takes the newest step complete for
every rank counting the peer copies (``checkpoint.local.every_steps: 1`` on ``/dev/shm`` makes that the last
completed step, so at most the failed step and the one before it are computed again). The model and optimizer
objects themselves are rebuilt: every wrapper that holds the dead group (DDP's reducer, FSDP's meshes, DeepSpeed's
groups, the checkpoint's copy group) would need it, and a fresh build on the new group is the one path that already
holds for every strategy.

What this cannot serve ends the rank as before, so the in-job restart or the requeue takes over: the store itself
is gone, no spare came within ``fault.regroup_timeout_s``, or ``fault.max_failures`` recoveries were spent.
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from hpcdist.base.errors import PeerRankDied
from hpcdist.base.logging_utils import get_logger
from hpcdist.config.loader import ConfigError
from hpcdist.env import DistEnv, export_environ
from hpcdist.fault.goodput import InProcessRecovery

__all__ = [
    "SPARE_ENV",
    "STORE_ENV",
    "WORLD_ENV",
    "Rendezvous",
    "SpareNotNeeded",
    "active",
    "adopt",
    "train_in_process",
]

log = get_logger(__name__)

STORE_ENV = "HPCDIST_REGROUP_STORE"
SPARE_ENV = "HPCDIST_REGROUP_SPARE"
WORLD_ENV = "HPCDIST_REGROUP_WORLD_SIZE"  # a spare's: the training's world size (its own launch counts spares only)
_STORE_CONNECT_S = 60.0  # the store is up before any rank starts (the launcher waits for its port): a minute is ample

T = TypeVar("T")


class SpareNotNeeded(Exception):
    """The job's training ended while this warm spare waited: nothing to do, exit 0."""


@dataclass(frozen=True)
class Rendezvous:
    """Where the job's rendezvous store listens, and whether this process is a warm spare."""

    host: str
    port: int
    spare: bool = False
    world_size: int | None = None
    """The training's world size, for a spare whose own launch counted only the spares (None: its own)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Rendezvous | None:
        """None when the job has no rendezvous store (in-process recovery off); ConfigError for a malformed one,
        before any process group exists."""
        value = environ.get(STORE_ENV, "").strip()
        spare = environ.get(SPARE_ENV, "").strip()
        if not value:
            if spare:
                raise ConfigError([f"{SPARE_ENV}={spare[:40]!r} is set without {STORE_ENV}: a spare needs the store"])
            return None
        host, sep, port = value.rpartition(":")
        problems = []
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            problems.append(f"{STORE_ENV}={value[:80]!r}: expected HOST:PORT with a port in 1..65535")
        if spare not in ("", "0", "1"):
            problems.append(f"{SPARE_ENV}={spare[:40]!r}: expected 1 (a warm spare) or 0")
        world = environ.get(WORLD_ENV, "").strip()
        if world and not (world.isdigit() and 1 <= int(world) <= 1 << 20):
            problems.append(f"{WORLD_ENV}={world[:40]!r}: expected the training's world size, 1..{1 << 20}")
        if problems:
            raise ConfigError(problems)
        return cls(host=host.strip("[]"), port=int(port), spare=spare == "1", world_size=int(world) if world else None)


def active(environ: Mapping[str, str]) -> bool:
    """Whether this process runs under in-process recovery: its launcher gave it a rendezvous store."""
    return bool(environ.get(STORE_ENV, "").strip())


def adopt(env: DistEnv, rank: int, world_size: int) -> DistEnv:
    """A spare's DistEnv once it took ``rank`` of ``world_size``: its own launch counted only the spares (its step's
    rank and size); the node it stands in for follows from the rank, with the training nodes' ranks per node equal
    to the spare's. Its local rank, and so its device, stay its own."""
    per_node = env.local_world_size
    nodes = max(1, world_size // per_node) if world_size % per_node == 0 else max(1, env.num_nodes)
    return dataclasses.replace(
        env,
        rank=rank,
        world_size=world_size,
        num_nodes=nodes,
        node_rank=min(rank // per_node, nodes - 1),
        local_world_size=min(per_node, world_size),
        local_rank=min(env.local_rank, min(per_node, world_size) - 1),
    )


def _release(failure: BaseException) -> None:
    """Let go of what the failed attempt's frames still hold (its Trainer: the strategy's, the checkpoint tiers' and
    the copy thread's process groups). gloo closes a group's connections only when the group is freed, so a peer
    blocked on one of them (a survivor still in the node-local copy with this rank) would otherwise wait out the
    collective timeout instead of failing at once and joining the next generation in time. The regroup's leave
    destroys the groups and collects what is then unreachable (hpcdist.fault.regroup)."""
    seen: set[int] = set()
    err: BaseException | None = failure
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if err.__traceback__ is not None:
            traceback.clear_frames(err.__traceback__)
        err = err.__cause__ or err.__context__


def train_in_process(
    rdv: Rendezvous,
    env: DistEnv,
    train: Callable[[DistEnv, InProcessRecovery | None], T],
    *,
    settle_s: float,
    timeout_s: float,
    collective_timeout_s: float,
    max_recoveries: int,
    rejoin: Callable[[], None] = lambda: None,
    exit_code: Callable[[T], int] = lambda _: 0,
) -> T:
    """Join the job's group through ``rdv`` (a spare: wait for a vacancy first), then ``train(env, None)``; after a
    peer's death (:class:`PeerRankDied`) call ``rejoin()`` (what the caller keeps across generations lets go of the
    dead group), rebuild the group in this process and ``train(env, recovery)`` again (``recovery``: the generation,
    when the death was seen, how long the regroup took), at most ``max_recoveries`` times. Rank 0
    marks the job done in the store with ``exit_code(result)``. Raises :class:`SpareNotNeeded` for a spare the job
    finished without."""
    import torch.distributed as dist

    from hpcdist.fault import regroup

    store = regroup.connect(rdv.host, rdv.port, timeout_s=max(timeout_s, _STORE_CONNECT_S))
    recovered: InProcessRecovery | None = None
    if env.device.startswith("cuda"):  # before the group: NCCL's communicator lands on this rank's GPU
        import torch

        torch.cuda.set_device(env.torch_device())
    if rdv.spare:
        log.info("warm spare on %s: waiting for a dead rank's number at %s:%d", env.hostname, rdv.host, rdv.port)
        member = regroup.standby(
            store, timeout_s=86_400 * 30, collective_timeout_s=collective_timeout_s, backend=env.backend
        )
        if member is None:
            raise SpareNotNeeded("the job finished without needing this spare")
        env = adopt(env, member.rank, member.world_size)
        # a warning: a failure happened, and this process now trains in the dead rank's place
        log.warning("warm spare on %s: took rank %d (generation %d)", env.hostname, member.rank, member.generation)
        # its first generation is the job's recovery from that death (its goodput attempt, as rank 0, starts there)
        started = member.started or time.time()
        recovered = InProcessRecovery(member.generation, started, max(0.0, time.time() - started))
    else:
        member = regroup.join_group(
            store, env.rank, env.world_size, collective_timeout_s=collective_timeout_s, backend=env.backend
        )
    export_environ(env)  # libraries (DeepSpeed) read RANK / WORLD_SIZE / LOCAL_RANK
    recoveries = 0
    try:
        while True:
            try:
                result = train(env, recovered)
            except PeerRankDied as died:
                failed_at = time.time()
                if recoveries >= max_recoveries:
                    log.error("in-process recovery: fault.max_failures=%d recoveries spent", max_recoveries)
                    raise
                failure = died
            else:
                if env.is_main:
                    regroup.mark_done(store, exit_code(result))
                return result
            recoveries += 1
            t0 = time.monotonic()
            log.warning(
                "in-process recovery %d: %s; rebuilding the process group (pid %d stays)",
                recoveries,
                " ".join(str(failure.__cause__ or failure).split())[:200],
                os.getpid(),
            )
            rejoin()
            _release(failure)
            try:
                member = regroup.regroup(
                    store,
                    member,
                    settle_s=settle_s,
                    timeout_s=timeout_s,
                    collective_timeout_s=collective_timeout_s,
                    backend=env.backend,
                )
            except (regroup.RegroupFailed, RuntimeError) as e:  # RuntimeError: the store itself is gone
                log.error("in-process recovery failed (%s): the in-job restart or the requeue takes over", e)
                raise failure from e
            recovered = InProcessRecovery(recoveries, failed_at, time.monotonic() - t0)
            log.info(
                "in-process recovery %d: generation %d of %d ranks formed in %.2f s; resuming from the newest "
                "snapshot every rank holds",
                recoveries,
                member.generation,
                member.world_size,
                time.monotonic() - t0,
            )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
