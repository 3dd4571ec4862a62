"""Where a job runs: :class:`ClusterConfig` from a shipped profile ``<name>`` (or a YAML path) plus overrides.

Loaded with :mod:`hpcdist.config.loader`, like the job config: every problem is collected and reported at once
in one ConfigError, unknown keys list the valid ones. Everything that ends up in the generated sbatch script is
checked here to be one line without control characters, so quoting (done by :mod:`hpcdist.launch.submit`) is the
only defense the script needs.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import sys
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcdist import resources
from hpcdist.base.rundir import RunDir
from hpcdist.base.signals import parse_signal
from hpcdist.config import loader
from hpcdist.config import nccl_profiles as nccl
from hpcdist.config.loader import ConfigError

__all__ = [
    "DEFAULT_EFFICIENCY",
    "DEFAULT_MARGIN_GIB",
    "ClusterConfig",
    "ContainerConfig",
    "HardwareConfig",
    "cluster_hardware",
    "cluster_names",
    "load_cluster",
    "parse_time",
]

log = logging.getLogger(__name__)

EXECUTORS = ("auto", "slurm", "local")
# sbatch flags a ClusterConfig field (or submitit itself) controls: --sbatch-arg must not set them twice.
_FIELD_FLAGS = {
    "nodes": "nodes",
    "ntasks-per-node": "gpus_per_node / tasks_per_node",
    "ntasks": "nodes x tasks_per_node",
    "gpus-per-node": "gpus_per_node",
    "cpus-per-task": "cpus_per_task",
    "mem": "mem",
    "time": "time",
    "partition": "partition",
    "account": "account",
    "qos": "qos",
    "constraint": "constraint",
    "exclude": "exclude",
    "job-name": "job_name",
    "exclusive": "exclusive",
    "signal": "signal / signal_lead_s",
    "requeue": "(always set)",
    "no-requeue": "(--requeue is always set)",
    "output": "log_dir",
    "error": "log_dir",
    "open-mode": "(submitit sets append)",
    "array": "(one job per submit)",
    "wrap": "(submitit writes the script)",
}
_FLAG = re.compile(r"--([A-Za-z][A-Za-z0-9-]*)(?:=(.*))?", re.DOTALL)
_MEM = re.compile(r"\d+[KMGT]?", re.IGNORECASE)
_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


# Fraction of the bf16 peak that the matmul-bound forward/backward of a Llama block sustains with SDPA flash
# attention and no fused kernels: an assumption, not a measurement (see README "Planner": published A100 runs
# reach 52-61% MFU at 13B, i.e. 60-77% of peak counting the recomputed forward).
DEFAULT_EFFICIENCY = 0.60
# Usable GPU memory = gpu_mem - margin: the driver/ECC reservation (an A100-80GB shows ~79.2 GiB to CUDA) and
# room for allocator spikes that the estimator's 10% buffers do not cover.
DEFAULT_MARGIN_GIB = 2.0
_MEASURED = ("gpu_mem_gb", "bf16_peak_tflops", "intra_node_busbw_gbps", "inter_node_busbw_gbps")


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class HardwareConfig:
    """Per-GPU hardware numbers: the one hardware type, read from a cluster profile's ``hardware:`` block and used
    by the planner's memory and time model (``hpcdist plan``, ``parallel.strategy: auto``, the dry run); not used
    to submit. The four measured numbers may be missing from a profile (a CPU sandbox); ``require`` says which."""

    gpu_mem_gb: float | None = None
    """Memory of one GPU, counted in GiB as CUDA reports it (an A100-80GB: 80)."""
    bf16_peak_tflops: float | None = None
    """Dense bf16 tensor-core peak of one GPU (A100: 312; the MFU denominator)."""
    intra_node_busbw_gbps: float | None = None
    """Measured all-reduce bus bandwidth inside a node (NVLink/NVSwitch), GB/s (NVSwitch A100: ~230)."""
    inter_node_busbw_gbps: float | None = None
    """Measured all-reduce bus bandwidth across nodes, GB/s (8x HDR 200 Gb/s per node: ~190)."""
    efficiency: float = DEFAULT_EFFICIENCY
    """Fraction of peak the compute sustains (eta in docs/PLANNER.md): the planner's assumption for this cluster."""
    margin_gib: float = DEFAULT_MARGIN_GIB
    """GPU memory kept free: a layout fits when its estimate <= gpu_mem_gb - margin_gib."""
    node_mtbf_hours: float | None = None
    """Mean time between failures of one node, hours: the goodput model's failure rate (system MTBF = this / the
    job's nodes; hpcdist.checkpoint.cadence), for ``hpcdist plan``'s goodput lines, the report's prediction and
    checkpoint.every_minutes=auto. Derive it from your own cluster's interruption rate: nodes x hours / interruptions.
    a100_ib's 5,696 h is Llama 3's (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.4: 466 job
    interruptions in 54 days on 16,384 H100 GPUs = 2,048 8-GPU nodes): 54 x 24 x 2,048 / 466 = 5,695.8 hours per
    node. None: no goodput prediction, and checkpoint.every_minutes=auto keeps its default interval."""
    host_mem_gb: float | None = None
    """Host memory (RAM) of one node, GiB: the node-local checkpoint tier in /dev/shm (tmpfs, half the RAM by
    default) must fit it; ``hpcdist plan`` and the dry run check it. None: not checked."""
    storage_write_gbps: float | None = None
    """Sustained write (and read) bandwidth of the shared file system checkpoints go to, GB/s per node (each node
    writes its own ranks' shards); None = the goodput model's assumption (hpcdist.planning.goodput)."""

    @property
    def usable_bytes(self) -> float:
        return (float(self.gpu_mem_gb or 0) - self.margin_gib) * (1 << 30)

    @property
    def peak_flops(self) -> float:
        return float(self.bf16_peak_tflops or 0) * 1e12

    def problems(self) -> list[str]:
        """Every number out of range, as "key: rule, got value" (missing measured numbers are ``require``'s
        business: a CPU profile has none)."""
        out = []
        for name in _MEASURED:
            value = getattr(self, name)
            if value is not None and not (_is_finite_number(value) and value > 0):
                out.append(f"{name}: must be > 0, got {value!r}")
        for name in ("node_mtbf_hours", "storage_write_gbps", "host_mem_gb"):
            value = getattr(self, name)
            if value is not None and not (_is_finite_number(value) and value > 0):
                out.append(f"{name}: must be a positive finite number, got {value!r}")
        if not (_is_finite_number(self.efficiency) and 0 < self.efficiency <= 1):
            out.append(f"efficiency: must be in (0, 1], got {self.efficiency!r}")
        mem = self.gpu_mem_gb if _is_finite_number(self.gpu_mem_gb) and self.gpu_mem_gb > 0 else None
        if not (_is_finite_number(self.margin_gib) and self.margin_gib >= 0 and (mem is None or self.margin_gib < mem)):
            out.append(f"margin_gib: must be >= 0 and below gpu_mem_gb ({mem!r} GiB), got {self.margin_gib!r}")
        return out

    def require(self, cluster_name: str, **overrides: Any) -> HardwareConfig:
        """These numbers with ``overrides`` (None values ignored: ``gpu_mem_gb``, ``efficiency``, ``margin_gib``),
        all four measured ones present and every value in range; ValueError naming the missing keys otherwise."""
        hw = dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})
        missing = [f"hardware.{name}" for name in _MEASURED if getattr(hw, name) is None]
        if missing:
            raise ValueError(
                f"cluster {cluster_name!r} does not say {', '.join(missing)}: the planner needs GPU memory, bf16 peak "
                "and bus bandwidths; add a hardware: block like hpcdist/resources/cluster/a100_ib.yaml's"
            )
        problems = hw.problems()
        if problems:
            raise ValueError(f"cluster {cluster_name!r}: " + "; ".join(problems))
        return hw


CONTAINER_RUNTIMES = ("pyxis", "apptainer", "command")


@dataclass
class ContainerConfig:
    """Run every task of a SLURM job inside a container (the cluster profile's ``container:`` block). The rank's
    supervisor runs inside too, so signals (USR2 before the time limit) reach the trainer as without it."""

    runtime: str = "pyxis"
    """pyxis: srun --container-image/--container-mounts/--container-workdir (enroot); apptainer: each task runs
    as ``apptainer exec --bind M ... [--pwd WORKDIR] IMAGE <python ...>``; command: ``WRAPPER <python ...>``."""
    image: str | None = None
    """Image: a pyxis/enroot reference (nvcr.io#nvidia/pytorch:24.05-py3, /shared/img.sqsh) or an apptainer .sif."""
    mounts: list[str] = field(default_factory=list)
    """Bind mounts SRC[:DST[:FLAGS]], e.g. /shared:/shared (the run dir and the code must be visible inside)."""
    workdir: str | None = None
    """Working directory inside the container."""
    wrapper: str | None = None
    """runtime command: a program given the task's command line as its arguments (a site's own launcher)."""
    executable: str = "apptainer"
    """runtime apptainer: the program to run (apptainer, singularity, or a full path)."""


@dataclass
class ClusterConfig:
    """Resources and SLURM settings of one job; YAML keys map 1:1 to these fields."""

    name: str = "custom"
    """Label of this cluster (the YAML's file name when loaded by name)."""
    executor: str = "auto"
    """auto: SLURM where a SLURM client is installed (sbatch on PATH; its controller must answer, else submit fails),
    submitit's LocalExecutor (one node) only where none is installed; slurm: SLURM or fail; local: this machine."""
    nodes: int = 1
    gpus_per_node: int = 8
    """GPUs per node; one task (rank) per GPU. 0 for CPU-only nodes (then set tasks_per_node)."""
    tasks_per_node: int | None = None
    """Ranks per node; default gpus_per_node. Only needed when gpus_per_node is 0."""
    cpus_per_task: int = 1
    """CPU cores per rank (data loading, the Python thread); srun is given it too (22.05 no longer inherits it)."""
    mem: str | None = None
    """Memory per node in SLURM syntax (64G, 500M); "0" = all of the node's memory; null = site default."""
    time: str = "01:00:00"
    """Wall-clock limit: minutes, MM:SS, HH:MM:SS or D-HH[:MM[:SS]]."""
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    """Node features, e.g. a100-80gb (sbatch --constraint)."""
    exclude: str | None = None
    """Nodes never to run on, e.g. gpu[012,040] (sbatch --exclude)."""
    job_name: str | None = None
    """SLURM job name; default the training config's run.name."""
    exclusive: bool = False
    """Whole nodes (no other jobs' traffic on the NICs and PCIe switches)."""
    extra_sbatch: list[str] = field(default_factory=list)
    """Further sbatch flags, each "--flag=value" or "--flag" (e.g. --mail-type=END)."""
    signal: str = "USR2"
    """Signal SLURM sends signal_lead_s before the time limit: the trainer saves a checkpoint and requeues."""
    signal_lead_s: int = 300
    """Seconds of warning before the time limit: enough for one collective checkpoint save."""
    nccl_profile: str | None = None
    """NCCL profile applied in every task: a shipped name (ib_a100, ...) or a YAML path; a,b merges; null: none."""
    log_dir: str | None = None
    """submitit folder: job pickles and per-rank logs <jobid>_<rank>_log.out/.err; default <run.dir>/slurm."""
    python: str | None = None
    """Interpreter the job runs (same path on the compute nodes); default this one (sys.executable)."""
    setup: list[str] = field(default_factory=list)
    """Shell lines the batch script runs before srun, in order (module load, conda/venv activation, exports); each
    one line, written as given (they are shell commands) and shown by --dry-run."""
    container: ContainerConfig | None = None
    """Run each task in a container (pyxis, apptainer, or a wrapper command); null: on the host."""
    hardware: HardwareConfig | None = None

    # ---------------------------------------------------------------------------------------- derived
    @property
    def ntasks_per_node(self) -> int:
        return self.tasks_per_node if self.tasks_per_node is not None else self.gpus_per_node

    @property
    def world_size(self) -> int:
        return self.nodes * self.ntasks_per_node

    @property
    def time_minutes(self) -> int:
        return parse_time(self.time)

    @property
    def interpreter(self) -> str:
        return self.python or sys.executable

    def folder(self, run_dir: str | os.PathLike[str]) -> Path:
        """Absolute submitit folder for a run: log_dir, else <run_dir>/slurm."""
        path = Path(self.log_dir) if self.log_dir else RunDir(run_dir).slurm_logs
        return path.expanduser().absolute()

    def problems(self) -> list[str]:
        """Semantic checks (types are checked while loading). Empty = valid."""
        return _check(self)


def parse_time(text: str | int) -> int:
    """SLURM time limit -> whole minutes (seconds round up). Raises ValueError for other formats."""
    raw = str(text).strip()
    match = _TIME.fullmatch(raw)
    if not match:
        raise ValueError(f"{raw!r} is not a time: use minutes, HH:MM:SS or D-HH:MM:SS")
    days, a, b, c = match.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        hours, minutes, seconds = int(a), int(b or 0), int(c or 0)
        total = int(days) * 86400 + hours * 3600 + minutes * 60 + seconds
    elif c is not None:  # HH:MM:SS
        total = int(a) * 3600 + int(b) * 60 + int(c)
    elif b is not None:  # MM:SS (SLURM's reading of two fields)
        total = int(a) * 60 + int(b)
    else:  # minutes
        total = int(a) * 60
    return -(-total // 60)


def cluster_names() -> list[str]:
    """Clusters shipped in hpcdist/resources/cluster/."""
    return resources.names("cluster")


# --------------------------------------------------------------------------------------------- checks


def _one_line(key: str, value: str | None, *, sbatch: bool = True) -> list[str]:
    """A value that goes into the script: one line, no control characters (and no backslash for #SBATCH)."""
    if value is None:
        return []
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        what = "a newline" if "\n" in value or "\r" in value else "a control character"
        return [f"{key}: must be one line without control characters, got {what} in {value!r}"]
    if sbatch and "\\" in value:
        # sbatch's #SBATCH parser treats backslash as an escape even inside quotes: the value would change
        return [f"{key}: must not contain a backslash (sbatch would drop it), got {value!r}"]
    return []


def _check(c: ClusterConfig) -> list[str]:
    p: list[str] = []
    if c.executor not in EXECUTORS:
        p.append(f"cluster.executor: {c.executor!r} is not one of {', '.join(EXECUTORS)}")
    if c.nodes < 1:
        p.append(f"cluster.nodes: must be >= 1, got {c.nodes}")
    if c.gpus_per_node < 0:
        p.append(f"cluster.gpus_per_node: must be >= 0, got {c.gpus_per_node}")
    if c.tasks_per_node is not None:
        if c.tasks_per_node < 1:
            p.append(f"cluster.tasks_per_node: must be >= 1, got {c.tasks_per_node}")
        elif c.gpus_per_node > 0 and c.tasks_per_node != c.gpus_per_node:
            p.append(
                f"cluster.tasks_per_node ({c.tasks_per_node}) must equal gpus_per_node ({c.gpus_per_node}): "
                "the trainer runs one rank per GPU; leave tasks_per_node unset"
            )
    elif c.gpus_per_node == 0:
        p.append("cluster.tasks_per_node: required when gpus_per_node is 0 (ranks per CPU node), e.g. 2")
    if c.cpus_per_task < 1:
        p.append(f"cluster.cpus_per_task: must be >= 1, got {c.cpus_per_task}")
    if c.mem is not None and not _MEM.fullmatch(c.mem.strip()):
        p.append(f"cluster.mem: {c.mem!r} is not a SLURM size: a number with optional K/M/G/T, e.g. 64G; 0 = all")
    minutes = None
    try:
        minutes = parse_time(c.time)
        if minutes < 1:
            p.append(f"cluster.time: must be at least one minute, got {c.time!r}")
    except ValueError as e:
        p.append(f"cluster.time: {e}")
    if c.signal_lead_s < 0:
        p.append(f"cluster.signal_lead_s: must be >= 0, got {c.signal_lead_s}")
    elif minutes and c.signal_lead_s >= minutes * 60:
        p.append(
            f"cluster.signal_lead_s ({c.signal_lead_s}) must be shorter than the time limit "
            f"({c.time} = {minutes * 60} s)"
        )
    if parse_signal(c.signal, numbers=False) is None:
        p.append(f"cluster.signal: {c.signal!r} is not a signal name such as USR2, USR1 or TERM")
    elif c.signal.upper().removeprefix("SIG") in ("KILL", "STOP"):
        p.append(f"cluster.signal: {c.signal} cannot be caught, so the trainer could not save; use USR2")
    for key in ("name", "partition", "account", "qos", "constraint", "exclude", "job_name", "python"):
        p += _one_line(f"cluster.{key}", getattr(c, key), sbatch=key not in ("name", "python"))
    for key in ("partition", "account", "qos", "exclude"):
        value = getattr(c, key)
        if value is not None and (not value.strip() or any(ch.isspace() for ch in value)):
            p.append(f"cluster.{key}: must be a non-empty name without spaces, got {value!r}")
    if c.job_name is not None and not c.job_name.strip():
        p.append("cluster.job_name: must not be empty (or leave it unset to use run.name)")
    if c.python is not None and not c.python.strip():
        p.append("cluster.python: must name an interpreter (or leave it unset for this one)")
    if c.log_dir is not None:
        p += _one_line("cluster.log_dir", c.log_dir)
        if "%" in c.log_dir:
            p.append(f"cluster.log_dir: must not contain '%' (SLURM expands %j, %t, ... in log paths): {c.log_dir!r}")
    for i, flag in enumerate(c.extra_sbatch):
        p += _check_flag(f"cluster.extra_sbatch[{i}]", flag)
    if c.nccl_profile is not None:
        try:
            nccl.load_profile(c.nccl_profile)
        except ConfigError as e:
            p += [f"cluster.nccl_profile: {problem}" for problem in e.problems]
    if c.executor == "local" and c.nodes > 1:
        p.append(f"cluster.nodes: the local executor runs on one node, got {c.nodes}; use a SLURM cluster")
    if c.hardware is not None:
        p += [f"cluster.hardware.{problem}" for problem in c.hardware.problems()]
    for i, line in enumerate(c.setup):
        p += _one_line(f"cluster.setup[{i}]", line, sbatch=False)
    if c.container is not None:
        p += _check_container(c.container)
    return p


def _check_container(k: ContainerConfig) -> list[str]:
    p: list[str] = []
    if k.runtime not in CONTAINER_RUNTIMES:
        return [f"cluster.container.runtime: {k.runtime!r} is not one of {', '.join(CONTAINER_RUNTIMES)}"]
    if k.runtime in ("pyxis", "apptainer") and not (k.image or "").strip():
        p.append(f"cluster.container.image: required for runtime {k.runtime} (e.g. /shared/images/train.sif)")
    if k.runtime == "command" and not (k.wrapper or "").strip():
        p.append("cluster.container.wrapper: required for runtime command (the program that wraps each task)")
    for key in ("image", "workdir", "wrapper", "executable"):
        p += _one_line(f"cluster.container.{key}", getattr(k, key), sbatch=False)
    for i, mount in enumerate(k.mounts):
        p += _one_line(f"cluster.container.mounts[{i}]", mount, sbatch=False)
        if not mount.strip() or "," in mount:
            p.append(f"cluster.container.mounts[{i}]: one SRC[:DST[:FLAGS]] without commas, got {mount!r}")
    return p


def _check_flag(key: str, flag: str) -> list[str]:
    match = _FLAG.fullmatch(flag)
    if not match:
        return [f"{key}: {flag!r} is not --flag or --flag=value (long sbatch options only, e.g. --mail-type=END)"]
    name, value = match.group(1), match.group(2)
    if name in _FIELD_FLAGS:
        return [f"{key}: --{name} is managed by hpcdist; set cluster field {_FIELD_FLAGS[name]} instead"]
    return _one_line(key, value)


def signal_warnings(c: ClusterConfig, environ: Mapping[str, str]) -> list[str]:
    """Warnings about NCCL_PROXY_DUMP_SIGNAL naming the preemption signal (environment or NCCL profile)."""
    out = []
    warning = nccl.signal_conflict(environ.get("NCCL_PROXY_DUMP_SIGNAL"), c.signal)
    if warning:
        out.append(f"{warning} (set in this environment, which the job inherits)")
    if c.nccl_profile:
        try:
            entry = nccl.load_profile(c.nccl_profile).get("NCCL_PROXY_DUMP_SIGNAL")
        except ConfigError:
            entry = None  # reported by problems()
        warning = nccl.signal_conflict(entry[0] if entry else None, c.signal)
        if warning:
            out.append(f"{warning} (set by nccl profile {c.nccl_profile})")
    if c.signal.upper().removeprefix("SIG") == "USR1":
        out.append("cluster.signal USR1: NCCL may use SIGUSR1 itself; USR2 is the safe choice")
    return out


# --------------------------------------------------------------------------------------------- loading


def _cluster_path(name: str | os.PathLike[str], problems: list[str]) -> Path | None:
    text = str(name)
    if text in cluster_names():
        return resources.path("cluster", text)
    path = Path(text).expanduser()
    if path.suffix in (".yaml", ".yml") or path.is_file():
        return path
    problems.append(f"cluster {text!r}: unknown; choose one of {', '.join(cluster_names())} or give a YAML path")
    return None


# keys holding one string or a list of them, and what each string is (for the error message)
_STRING_LISTS = {"extra_sbatch": "strings like --mail-type=END", "setup": "shell lines like 'module load cuda/12.4'"}


def _build(data: Mapping[str, Any], problems: list[str]) -> ClusterConfig:
    hints = typing.get_type_hints(ClusterConfig)
    names = [f.name for f in dataclasses.fields(ClusterConfig)]
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = f"cluster.{name}"
        if name not in names:
            problems.append(loader.unknown_key(key, str(name), names))
            continue
        if name in _STRING_LISTS:  # one string or a list of them
            items = [value] if isinstance(value, str) else value
            if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
                problems.append(f"{key}: must be a list of {_STRING_LISTS[name]}, got {value!r}")
            else:
                kwargs[name] = list(items)
        elif name == "container":
            kwargs[name] = _build_container(value, problems)
        elif name == "hardware":
            kwargs[name] = _build_hardware(value, problems)
        else:
            coerced, err = loader.coerce(key, value, hints[name])
            if err:
                problems.append(err)
            else:
                kwargs[name] = coerced
    # a field with a bad value keeps its default, so the semantic checks below still run on the rest
    return ClusterConfig(**kwargs)


def cluster_hardware(
    cluster: ClusterConfig,
    *,
    gpu_mem_gb: float | None = None,
    efficiency: float | None = None,
    margin_gib: float | None = None,
) -> HardwareConfig:
    """The planner's numbers for ``cluster`` (its hardware: block, with the given overrides); ValueError naming the
    missing keys or the out-of-range values."""
    base = cluster.hardware or HardwareConfig()
    return base.require(cluster.name, gpu_mem_gb=gpu_mem_gb, efficiency=efficiency, margin_gib=margin_gib)


def _build_hardware(value: Any, problems: list[str]) -> HardwareConfig | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        problems.append(f"cluster.hardware: must be a mapping of {_hardware_keys()}, got {value!r}")
        return None
    kwargs: dict[str, Any] = {}
    for name, item in value.items():
        key = f"cluster.hardware.{name}"
        if name not in _hardware_keys():
            problems.append(loader.unknown_key(key, str(name), _hardware_keys()))
            continue
        coerced, err = loader.coerce(key, item, float | None)
        if err:
            problems.append(err)
        else:
            kwargs[name] = coerced
    return HardwareConfig(**kwargs)


def _build_container(value: Any, problems: list[str]) -> ContainerConfig | None:
    if value is None:
        return None
    names = [f.name for f in dataclasses.fields(ContainerConfig)]
    if not isinstance(value, Mapping):
        problems.append(f"cluster.container: must be a mapping of {', '.join(names)}, got {value!r}")
        return None
    kwargs: dict[str, Any] = {}
    for name, item in value.items():
        key = f"cluster.container.{name}"
        if name not in names:
            problems.append(loader.unknown_key(key, str(name), names))
        elif name == "mounts":
            items = [item] if isinstance(item, str) else item
            if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
                problems.append(f"{key}: must be a list like [/shared:/shared], got {item!r}")
            else:
                kwargs[name] = list(items)
        elif item is not None and not isinstance(item, str):
            problems.append(f"{key}: must be a string, got {item!r}")
        elif item is not None or name not in ("runtime", "executable"):
            kwargs[name] = item
    return ContainerConfig(**kwargs)


def _hardware_keys() -> list[str]:
    return [f.name for f in dataclasses.fields(HardwareConfig)]


def load_cluster(name_or_path: str | os.PathLike[str] | ClusterConfig, **overrides: Any) -> ClusterConfig:
    """A validated ClusterConfig from a shipped name (``cluster_names()``), a YAML path or a ClusterConfig; + overrides.

    Overrides are field values (``nodes=4, partition="gpu"``; ``hardware={...}`` merges into the block).
    Raises ConfigError listing every problem; logs a warning when NCCL_PROXY_DUMP_SIGNAL (environment or
    profile) is the preemption signal.
    """
    problems: list[str] = []
    data: dict[str, Any] = {}
    if isinstance(name_or_path, ClusterConfig):
        data = dataclasses.asdict(name_or_path)
    else:
        path = _cluster_path(name_or_path, problems)
        if path is not None and not path.is_file():
            names = ", ".join(cluster_names())
            problems.append(f"cluster file {str(path)!r} does not exist (clusters by name: {names})")
        elif path is not None:
            data, read_problems = loader.read_yaml(path)
            problems += [p.replace("config file", "cluster file", 1) for p in read_problems]
            data.setdefault("name", path.stem)
    for key, value in overrides.items():
        if key == "hardware" and isinstance(value, Mapping) and isinstance(data.get("hardware"), Mapping):
            data["hardware"] = {**data["hardware"], **value}
        else:
            data[key] = value
    cluster = _build(data, problems)
    problems += cluster.problems()
    if problems:
        raise ConfigError(problems)
    for warning in signal_warnings(cluster, os.environ):
        log.warning("%s", warning)
    return cluster
