"""Where this process sits in a distributed job: rank, node, rendezvous address, device, and the job's facts.

It turns the launcher's variables (torchrun's here; a scheduler's through the scheduler table,
:mod:`hpcdist.schedulers`) into a plain, validated :class:`DistEnv`; everything downstream receives that object
instead, its ``job`` (:class:`~hpcdist.schedulers.JobFacts`: job id, restarts, nodes) included.

Detection order in :func:`from_environ`:

1. torchrun (``TORCHELASTIC_RUN_ID``, or all of ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``), even inside a
   scheduler's allocation: torchrun's children carry the allocation's variables but their ranks are torchrun's.
2. a task of a scheduler's job step (SLURM's ``srun``; the scheduler's module says what a step is).
3. a single local process.

Before the process group exists, :func:`init_process_group` exports the resolved DistEnv the way torchrun hands it to
every process (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``; :func:`export_environ`): libraries read those, not the scheduler's (DeepSpeed
refuses to start without ``LOCAL_RANK``, even in one process). The names it added or changed are recorded in
``HPCDIST_EXPORTED``; while they keep those values, :func:`from_environ` reads the environment as if they had never
been exported, so a later call in the same process (or in a child, even a task of a nested srun) resolves from its
launcher again instead of taking hpcdist's own export for torchrun's.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import socket
import time
import zlib
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hpcdist import schedulers
from hpcdist.schedulers import EnvReader, JobFacts

if TYPE_CHECKING:  # torch is imported where it is used: reading the environment needs none (a refusal answers
    import torch  # before torch loads)

__all__ = [
    "DistEnv",
    "destroy_process_group",
    "export_environ",
    "from_environ",
    "init_process_group",
    "port_from_job_id",
]

log = logging.getLogger(__name__)

DEFAULT_MASTER_PORT = 29500
LAUNCHERS = (*(s.name for s in schedulers.SCHEDULERS), "torchrun", "single")
# JSON {name: value} of the variables export_environ added or changed (see the module docstring).
EXPORTED_VAR = "HPCDIST_EXPORTED"

# What each launcher reads, echoed in errors so a bad value is easy to trace to its variable (a scheduler's step
# launcher: its row's ``reads``).
_READS: dict[str, tuple[str, ...]] = {
    "torchrun": (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ),
    "single": ("MASTER_PORT",),
}

_DIGITS = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job; validated on construction."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    device: str
    backend: str
    launcher: str
    job_id: str | None
    """This job's own id (``job.instance_id``): seeds the rendezvous port and labels metrics; None outside a job."""
    hostname: str
    job: JobFacts = field(default_factory=JobFacts)
    """The job's facts (id to requeue, restarts, nodes): what the trainer and ``hpcdist.fault`` name and record."""

    def __post_init__(self) -> None:
        problems = []
        if self.world_size < 1:
            problems.append(f"world_size={self.world_size} must be >= 1")
        if not 0 <= self.rank < max(self.world_size, 1):
            problems.append(f"rank={self.rank} must be in [0, world_size={self.world_size})")
        if not 1 <= self.local_world_size <= max(self.world_size, 1):
            problems.append(f"local_world_size={self.local_world_size} must be in [1, world_size={self.world_size}]")
        if not 0 <= self.local_rank < max(self.local_world_size, 1):
            problems.append(f"local_rank={self.local_rank} must be in [0, local_world_size={self.local_world_size})")
        if not 1 <= self.num_nodes <= max(self.world_size, 1):
            problems.append(f"num_nodes={self.num_nodes} must be in [1, world_size={self.world_size}]")
        if not 0 <= self.node_rank < max(self.num_nodes, 1):
            problems.append(f"node_rank={self.node_rank} must be in [0, num_nodes={self.num_nodes})")
        if not 1 <= self.master_port <= 65535:
            problems.append(f"master_port={self.master_port} must be in [1, 65535]")
        if not self.master_addr:
            problems.append("master_addr is empty")
        if self.launcher not in LAUNCHERS:
            problems.append(f"launcher={self.launcher!r} must be one of {LAUNCHERS}")
        if problems:
            raise ValueError("invalid DistEnv: " + "; ".join(problems))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.device)


# ------------------------------------------------------------------------------------------------- ports


def port_from_job_id(job_id: str | None, base: int = 20000, span: int = 12000) -> int:
    """Rendezvous port every node of a job computes alike, in ``[base, base + span)``; None -> 29500.

    The default range 20000-31999 stays below Linux's ephemeral ports (32768+), which outgoing connections
    may already hold.

    Uses the decimal digits of the id ("123_4" -> 1234), so jobs submitted one after another get
    different ports (two jobs sharing a node do not collide unless their ids differ by a multiple of span).
    """
    if base < 1 or span < 1 or base + span > 65536:
        raise ValueError(f"port range base={base}, span={span} must lie within [1, 65535]")
    if job_id is None or not str(job_id).strip():
        return DEFAULT_MASTER_PORT
    digits = "".join(_DIGITS.findall(str(job_id)))
    # A stable hash, not hash(): that is salted per process and would differ between nodes.
    value = int(digits) if digits else zlib.crc32(str(job_id).encode())
    return base + value % span


# ----------------------------------------------------------------------------------------- environment


def _cuda_index(local_rank: int, device_count: int | None) -> int:
    """GPU index for this local rank among the GPUs this process can see."""
    if device_count is None or local_rank < device_count:
        return local_rank
    if device_count == 1:
        # The launcher bound one GPU to each task (srun --gpus-per-task=1, torchrun's virtual local rank):
        # CUDA_VISIBLE_DEVICES shows only ours, as device 0.
        return 0
    raise ValueError(
        f"local_rank={local_rank} but only {device_count} GPUs are visible "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): start at most one task per GPU"
    )


def from_environ(environ: Mapping[str, str] | None = None, *, cuda_available: bool | None = None) -> DistEnv:
    """Build the :class:`DistEnv` of this process from torchrun, a scheduler's job step or no variables (in that
    order), with the job's facts from the scheduler table.

    ``environ`` defaults to ``os.environ``; ``cuda_available=None`` asks torch (tests pass it explicitly).
    Missing or garbled integers raise ValueError naming the variable and its value.
    """
    env_map: Mapping[str, str] = _without_own_exports(os.environ if environ is None else environ)
    v = EnvReader(env_map)
    job = schedulers.job_facts(env_map)
    device_count: int | None = None
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
        device_count = torch.cuda.device_count() if cuda_available else None

    fields: dict[str, Any]
    reads = _READS["single"]
    if v.has("TORCHELASTIC_RUN_ID") or all(v.has(n) for n in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        launcher, reads = "torchrun", _READS["torchrun"]
        fields = _torchrun_fields(v)
    elif (step := schedulers.step_layout(v)) is not None:
        scheduler, fields = step
        launcher, reads = scheduler.name, scheduler.reads
        # every task of the step computes the same port from the job, unless the job script chose one
        fields["master_port"] = v.integer("MASTER_PORT", default=port_from_job_id(job.instance_id), minimum=1)
    else:
        launcher = "single"
        fields = dict(
            rank=0,
            local_rank=0,
            world_size=1,
            local_world_size=1,
            node_rank=0,
            num_nodes=1,
            master_addr="127.0.0.1",
            # No free-port search: with one process nobody else needs to find it, and init is skipped.
            master_port=v.integer("MASTER_PORT", default=DEFAULT_MASTER_PORT, minimum=1),
        )
    v.check(launcher)

    if cuda_available:
        device, backend = f"cuda:{_cuda_index(fields['local_rank'], device_count)}", "nccl"
    else:
        device, backend = "cpu", "gloo"
    try:
        # under every launcher the job id is the scheduler's: torchrun's run id is a rendezvous name ("none" by default)
        return DistEnv(
            **fields,
            job_id=job.instance_id,
            device=device,
            backend=backend,
            launcher=launcher,
            hostname=socket.gethostname(),
            job=job,
        )
    except ValueError as err:
        seen = ", ".join(f"{name}={env_map[name]}" for name in reads if v.has(name))
        raise ValueError(f"inconsistent {launcher} environment ({seen or 'no variables set'}): {err}") from None


def _own_exports(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables a previous :func:`export_environ` added or changed that still hold its values; {} if none.

    Stale records count for nothing: a name changed since (a launcher such as DeepSpeed's or a test harness set
    its own ranks) invalidates the whole record, and under torchrun (``TORCHELASTIC_RUN_ID``) its variables are
    authoritative even where they happen to equal an inherited record.
    """
    raw = environ.get(EXPORTED_VAR)
    if not raw or environ.get("TORCHELASTIC_RUN_ID", "").strip():
        return {}
    try:
        record = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(record, dict) or not all(isinstance(k, str) and isinstance(x, str) for k, x in record.items()):
        return {}
    return record if all(environ.get(name) == value for name, value in record.items()) else {}


def _without_own_exports(environ: Mapping[str, str]) -> Mapping[str, str]:
    """``environ`` minus what hpcdist exported itself, so that export carries no weight in detection."""
    own = _own_exports(environ)
    if not own:
        return environ
    return {name: value for name, value in environ.items() if name not in own}


def _torchrun_fields(v: EnvReader) -> dict[str, Any]:
    rank = v.integer("RANK")
    local_rank = v.integer("LOCAL_RANK")
    world_size = v.integer("WORLD_SIZE", minimum=1)
    # torchrun always sets these; other launchers that mimic it (RANK/LOCAL_RANK/WORLD_SIZE only) are taken
    # as one node.
    local_world_size = v.integer("LOCAL_WORLD_SIZE", default=world_size, minimum=1)
    return dict(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=v.integer("GROUP_RANK", default=rank // max(local_world_size, 1)),
        num_nodes=v.integer("GROUP_WORLD_SIZE", default=-(-world_size // max(local_world_size, 1)), minimum=1),
        master_addr=v.get("MASTER_ADDR") or "127.0.0.1",
        master_port=v.integer("MASTER_PORT", default=DEFAULT_MASTER_PORT, minimum=1),
    )


# --------------------------------------------------------------------------------------- process group


def _torchrun_variables(env: DistEnv) -> dict[str, str]:
    """The variables torchrun would give this process (names and meanings as torchrun's)."""
    return {
        "RANK": str(env.rank),
        "LOCAL_RANK": str(env.local_rank),
        "WORLD_SIZE": str(env.world_size),
        "LOCAL_WORLD_SIZE": str(env.local_world_size),
        "GROUP_RANK": str(env.node_rank),
        "GROUP_WORLD_SIZE": str(env.num_nodes),
        "MASTER_ADDR": env.master_addr,
        "MASTER_PORT": str(env.master_port),
    }


def export_environ(env: DistEnv, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Put ``env`` into ``environ`` (default ``os.environ``) as torchrun's variables; return what it changed.

    srun and a plain ``python`` set none of them, but the process group's ``env://`` reads MASTER_ADDR/PORT and
    DeepSpeed asserts LOCAL_RANK (also with world size 1). The DistEnv is what every rank computed alike, so it wins
    over a different value already there, loudly; a value hpcdist exported itself earlier (this process, or a
    parent whose srun started this one) is replaced quietly. The names added or changed go to ``HPCDIST_EXPORTED``
    (merged with still valid earlier records), so that :func:`from_environ` keeps resolving to the same DistEnv.
    """
    target: MutableMapping[str, str] = os.environ if environ is None else environ
    own = _own_exports(target)
    record = dict(own)
    changed: dict[str, str] = {}
    for name, value in _torchrun_variables(env).items():
        current = target.get(name)
        if current == value:
            continue
        if current is not None and current.strip() and name not in own:
            log.warning(
                "%s=%s in the environment differs from DistEnv's %s (%s launcher); using %s",
                name,
                current,
                value,
                env.launcher,
                value,
            )
        target[name] = value
        record[name] = changed[name] = value
    if record:
        target[EXPORTED_VAR] = json.dumps(record, sort_keys=True)
    else:
        target.pop(EXPORTED_VAR, None)  # a stale record inherited from a parent means nothing here
    return changed


def init_process_group(env: DistEnv, *, timeout_s: float = 1800) -> None:
    """Export ``env`` as torchrun's variables (:func:`export_environ`), then join the default process group
    (``env://``) for world_size > 1; no process group for one process, nothing new if already joined."""
    # Also for one process: libraries (DeepSpeed) read LOCAL_RANK / RANK / WORLD_SIZE whatever the world size.
    export_environ(env)
    if not env.is_distributed:
        return
    import torch

    if not torch.distributed.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    if torch.distributed.is_initialized():
        joined = torch.distributed.get_world_size()
        if joined != env.world_size:
            raise RuntimeError(f"a process group of {joined} ranks already exists, but env has {env.world_size}")
        return
    if env.device.startswith("cuda"):
        # Before init, so NCCL's communicator and any tensor created without a device land on our GPU.
        torch.cuda.set_device(env.torch_device())
    if env.rank != 0:
        _wait_for_master(env.master_addr, env.master_port, timeout_s)
    torch.distributed.init_process_group(
        backend=env.backend,
        init_method="env://",
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _wait_for_master(addr: str, port: int, timeout_s: float) -> None:
    """Poll until rank 0's TCPStore accepts connections. A client that reaches the port before the server listens
    backs off for timeout/10 (torch's TCPStore: 66 s with a 660 s timeout, 180 s with 30 min), so a rank that
    merely started first would stall the whole job; polling here costs at most 0.2 s after the server is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((addr, port), timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                return  # let init_process_group report the failure with its own message
            time.sleep(0.2)


def destroy_process_group() -> None:
    """Leave the default process group; safe when there is none.

    Where DeepSpeed took part (a ZeRO run), through DeepSpeed's own teardown: it keeps the groups it built (a
    clone of the world, the data-parallel group) in module globals and releases them only there; left behind, the
    next ZeRO engine in this process (the Python API, a notebook, a test session) is handed a destroyed group and
    fails with "Group ... is not registered"."""
    import sys

    import torch

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    ds_comm = sys.modules.get("deepspeed.comm")  # never imported here: only a run that used DeepSpeed has it
    if ds_comm is not None and ds_comm.is_initialized():
        ds_comm.destroy_process_group()
    else:
        torch.distributed.destroy_process_group()
