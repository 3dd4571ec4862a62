"""``hpcdist train CONFIG --dry-run --world-size N``: check a layout for N ranks on a machine without GPUs.

For each of a few ranks, in this one process: a fake process group pretends to be rank r of N (torch's
``FakeStore`` + backend "fake": collectives return at once and move no data), the model is built on the meta
device (shapes only, no memory), and the strategy's parallel plan is applied as the trainer applies it:
activation-checkpoint wrappers and FSDP2 ``fully_shard`` on the real DeviceMesh (HSDP's 2-D one included) through
hpcdist.parallel's own functions. The per-rank count is then read off the sharded parameters (DTensor local
shards), not computed. What cannot run on meta is counted by its rule instead, and the report says so:

* ddp: every rank holds the whole model (DDP broadcasts real tensors at construction).
* zero: DeepSpeed's engine allocates its flat buffers at initialize; counted with its partition rule
  (stages 1-2: full bf16 parameters on every rank, the fp32 master + Adam partition ``ceil(P / dp)``; stage 3: each
  parameter split into ``ceil(numel / dp)`` pieces except those under ``param_persistence_threshold``).
* 3d: ParallelDims' meshes, this rank's pipeline stage(s) split off the meta model, TP, activation checkpointing
  and FSDP2 on the dp mesh, as hpcdist.parallel.parallelize.parallelize does before materializing; counts differ per
  pipeline stage, so the first rank of every stage is included by default.

The report ends with the memory estimate (hpcdist.planning.memory) and, when the cluster profile has hardware
numbers, the planner's predicted throughput for this layout. Nothing is allocated beyond the meta model's Python
objects.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from hpcdist import config as config_mod
from hpcdist.base.units import size_text
from hpcdist.config import JobConfig
from hpcdist.config.cluster import ClusterConfig, HardwareConfig, load_cluster
from hpcdist.models.args import num_params
from hpcdist.models.llama import build_model
from hpcdist.parallel.dims import describe_layout, parallel_dims
from hpcdist.planning.layouts import DEFAULT_MARGIN_GIB, format_count
from hpcdist.planning.memory import GIB, MemoryEstimate
from hpcdist.planning.snapshot import Footprint, footprint

T = TypeVar("T")

__all__ = ["DryRunReport", "RankCount", "dry_run", "parse_ranks"]


@dataclass
class RankCount:
    """What one rank holds after the parallel plan is applied."""

    rank: int
    node: int
    coords: str
    """The rank's place in the mesh, e.g. "shard 5" or "replicate 1, shard 5"."""
    params: int
    """Parameter elements resident on this rank (local shards, or full tensors where nothing is sharded)."""
    optimizer_params: int
    """Elements this rank keeps fp32 master weights / Adam moments for."""
    how: str
    """"sharded on meta" (read off DTensor shards) or the rule used ("replicated", "DeepSpeed partition rule")."""


@dataclass
class DryRunReport:
    cfg: JobConfig
    world_size: int
    gpus_per_node: int
    layout: str
    total_params: int
    counts: list[RankCount]
    memory: MemoryEstimate
    gpu_mem_gib: float | None
    seconds: float
    hardware: HardwareConfig | None = None
    notes: list[str] = field(default_factory=list)
    prediction: str | None = None

    def text(self) -> str:
        nodes = max(1, math.ceil(self.world_size / self.gpus_per_node))
        t = self.cfg.train
        accum = config_mod.grad_accum_steps(self.cfg, self._dp())
        lines = [
            f"dry run: {self.cfg.run.name}, {format_count(self.total_params)} params ({self.total_params:,}) on "
            f"{self.world_size} ranks ({nodes} node(s) x {min(self.gpus_per_node, self.world_size)})",
            f"layout: {self.layout}; micro batch {t.micro_batch_size} x {accum} micro-batch(es) per step x "
            f"{self._dp()} data-parallel = global batch {t.global_batch_size}; seq {self.cfg.data.seq_len}; "
            f"activation checkpointing {t.activation_checkpointing}",
            "",
            f"{'rank':>5}  {'node':>4}  {'mesh':<22}  {'params':>15}  {'share':>7}  {'optimizer state':>15}  how",
        ]
        for c in self.counts:
            share = 100 * c.params / self.total_params
            lines.append(
                f"{c.rank:>5}  {c.node:>4}  {c.coords:<22}  {c.params:>15,}  {share:>6.2f}%  {c.optimizer_params:>15,}"
                f"  {c.how}"
            )
        m = self.memory
        cats = ("params", "grads", "optimizer", "activations", "buffers")
        lines += [
            "",
            "memory estimate per GPU (hpcdist.planning.memory, GiB): "
            + ", ".join(f"{name} {getattr(m, name) / GIB:.1f}" for name in cats)
            + f"; total {m.total / GIB:.1f}",
        ]
        if m.build > m.total:
            lines.append(
                f"model build per GPU: {m.build / GIB:.1f} GiB (ZeRO materializes the whole fp32 model on every GPU "
                "before DeepSpeed partitions it)"
            )
        if self.gpu_mem_gib is not None:
            usable = self.gpu_mem_gib - DEFAULT_MARGIN_GIB
            verdict = "fits" if self.fits else "does NOT fit"
            lines[-1] += f" -> {verdict} in {usable:g} GiB ({self.gpu_mem_gib:g} GiB less the planner's margin)"
        if self.cfg.checkpoint.async_save:  # the trainer refuses at start-up when this does not fit the node
            per_rank = max(4 * c.params + 8 * c.optimizer_params for c in self.counts)
            ranks = min(self.gpus_per_node, self.world_size)
            lines.append(
                f"async checkpoint staging (host shared memory, allocated once after the first step): up to "
                f"{size_text(per_rank)} per rank (fp32 weights + AdamW's 2 moments), {size_text(per_rank * ranks)} "
                f"per node of {ranks} rank(s)"
            )
        if self.snapshot is not None:  # what the node-local tier keeps on each node (hpcdist.checkpoint.local)
            assert self.cfg.checkpoint.local.dir is not None  # a footprint exists only with one
            lines.append(self.snapshot.line(self.cfg.checkpoint.local.dir))
        if self.prediction:
            lines.append(self.prediction)
        lines += [f"note: {n}" for n in self.notes]
        lines.append(f"dry run took {self.seconds:.1f} s; nothing was allocated or trained")
        return "\n".join(lines) + "\n"

    @property
    def snapshot(self) -> Footprint | None:
        """The node-local tier's footprint per node (None without one): each rank's fp32 weights and AdamW's two
        moments, the largest of the ranks counted."""
        per_rank = max(4 * c.params + 8 * c.optimizer_params for c in self.counts)
        ranks = min(self.gpus_per_node, self.world_size)
        nodes = max(1, math.ceil(self.world_size / self.gpus_per_node))
        return footprint(self.cfg, self.hardware, per_rank_bytes=per_rank, ranks_per_node=ranks, nodes=nodes)

    @property
    def fits(self) -> bool | None:
        """Whether the estimate (the step, and ZeRO's model build) fits in GPU memory less the planner's margin; None
        without a GPU memory figure."""
        if self.gpu_mem_gib is None:
            return None
        return self.memory.peak <= (self.gpu_mem_gib - DEFAULT_MARGIN_GIB) * GIB

    def _dp(self) -> int:
        return parallel_dims(self.cfg, self.world_size).dp


def parse_ranks(spec: str | None, world_size: int) -> list[int]:
    """``None`` -> first, middle and last rank; ``all``; or a comma list like ``0,7,31``. ValueError if out of range."""
    if spec is None:
        return sorted({0, world_size // 2, world_size - 1})
    if spec.strip() == "all":
        return list(range(world_size))
    try:
        ranks = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--ranks {spec!r}: give comma-separated integers like 0,7,31 or 'all'") from None
    bad = [r for r in ranks if not 0 <= r < world_size]
    if not ranks or bad:
        raise ValueError(f"--ranks {spec!r}: ranks must lie in 0..{world_size - 1}")
    return ranks


def _count_rank(cfg: JobConfig, rank: int, node: int, world_size: int) -> RankCount:
    """Parameters this rank holds under cfg's plan, applied to a meta model as ``rank`` of a fake group."""
    with _fake_group(rank, world_size):
        model = build_model(cfg.model_args())  # meta: shapes only
        if parallel_dims(cfg, world_size).zero_enabled:
            # the trainer's order: checkpointing before DeepSpeed
            from hpcdist.parallel.parallelize import apply_activation_checkpointing

            apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
            resident, optim = _zero_count(cfg, model, world_size)
            how = f"DeepSpeed ZeRO-{cfg.parallel.zero.stage} partition rule"
            return RankCount(rank, node, f"dp {rank}", resident, optim, how)
        where, n, how = _layout_count(cfg, model, rank, world_size)
        return RankCount(rank, node, where, n, n, how)


def _in_child(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) in a forked child process; its result or its exception comes back through a pipe."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)

    def run() -> None:
        try:
            child.send((True, fn(*args)))
        except BaseException as e:  # sent back and re-raised in the parent
            child.send((False, e))

    proc = ctx.Process(target=run, daemon=True)
    proc.start()
    child.close()
    try:
        ok, value = parent.recv()
    except EOFError:
        proc.join()
        raise RuntimeError(f"the dry run's child process died (exit code {proc.exitcode})") from None
    proc.join()
    if not ok:
        raise value
    return value


@contextlib.contextmanager
def _fake_group(rank: int, world_size: int) -> Iterator[None]:
    """This process as rank ``rank`` of ``world_size`` on torch's fake backend (no peers, no data moved)."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # private, but what torch tests with
    except ImportError as e:  # a torch build without the testing package
        raise RuntimeError(f"the dry run needs torch's fake process group (torch.testing._internal): {e}") from None
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _local_numel(p: torch.Tensor) -> int:
    to_local = getattr(p, "to_local", None)  # DTensor: this rank's shard only
    return to_local().numel() if callable(to_local) else p.numel()


def _layout_count(cfg: JobConfig, model: nn.Module, rank: int, world_size: int) -> tuple[str, int, str]:
    """Apply hpcdist's plan to the meta model as ``rank``: (mesh coordinates, local elements, how it was counted).

    ``parallelize`` is the function the trainer itself runs before materializing: split this rank's pipeline
    stage(s) off the meta model, then per stage TP -> activation checkpointing -> FSDP2 on the dp mesh (DDP wraps
    the materialized model later: its ranks hold the whole model).
    """
    from hpcdist.parallel.parallelize import parallelize

    dims = parallel_dims(cfg, world_size)
    coords = dims.coords(rank)
    meshes = dims.build_meshes("cpu") if dims.needs_mesh else {}
    # the dtypes a GPU run would use (they do not change the counts); no compile: nothing runs
    stages = parallelize(cfg, model, dims, meshes, coords["pp"], device=torch.device("cuda"), compile_blocks=False)
    seen: set[int] = set()
    n = 0
    for part in stages.parts:
        for p in part.parameters():
            if id(p) not in seen:  # tied embeddings in one stage count once
                seen.add(id(p))
                n += _local_numel(p)
    if not dims.needs_mesh:
        return f"replica {rank}", n, "replicated (DDP)"
    if not (dims.pp_enabled or dims.tp_enabled):
        where = (
            f"replicate {rank // dims.dp_shard}, shard {rank % dims.dp_shard}" if dims.hsdp_enabled else f"shard {rank}"
        )
        return where, n, "sharded on meta (FSDP2)"
    held = []
    for i in stages.ids:
        lo, hi = stages.layers[i][0], stages.layers[i][-1]
        span = f"layer {lo}" if lo == hi else f"layers {lo}-{hi}"
        extra = (" + embedding" if i == 0 else "") + (" + head" if i == stages.num_stages - 1 else "")
        held.append(f"stage {i} ({span}{extra})")
    where = f"pp {coords['pp']}, dp {coords['dp']}, tp {coords['tp']}"
    return where, n, f"sharded on meta: {', '.join(held)}"


def _zero_count(cfg: JobConfig, model: nn.Module, world_size: int) -> tuple[int, int]:
    """(resident parameter elements, optimizer-state elements) per rank by DeepSpeed's partition rule."""
    z = cfg.parallel.zero
    sizes = [p.numel() for p in model.parameters()]
    total = sum(sizes)
    if z.stage < 3:  # parameters whole on every rank; the flat fp32 master + Adam buffer split evenly (padded)
        return total, math.ceil(total / world_size)
    # stage 3: each parameter partitioned on its own (padded to a multiple of dp); those at or under the
    # persistence threshold also stay whole on every rank (DeepSpeed's ds_persist)
    keep = getattr(z, "param_persistence_threshold", 0)
    shards = [math.ceil(n / world_size) for n in sizes]
    resident = sum(n if n <= keep else s for n, s in zip(sizes, shards, strict=True))
    return resident, sum(shards)


def _memory(cfg: JobConfig, world_size: int, gpus_per_node: int) -> MemoryEstimate:
    """The planner's estimate for the layout this config runs (its own row, ZeRO offload included)."""
    from hpcdist.planning import layouts as planner

    t, p = cfg.train, cfg.parallel
    layout = planner.layout_of(cfg, world_size)
    zero = layout.zero_enabled
    return planner.layout_memory(
        cfg.model_args(),
        layout,
        seq_len=cfg.data.seq_len,
        gpus_per_node=gpus_per_node,
        microbatches=t.global_batch_size // (t.micro_batch_size * layout.dp),
        reduce_bytes=planner.grad_reduce_bytes(cfg),
        offload_optimizer=zero and p.zero.offload_optimizer,
        offload_params=zero and p.zero.offload_params,
        document_mask=cfg.data.document_mask,
        element_bytes=planner.activation_element_bytes(cfg),
    )


def _prediction(cfg: JobConfig, world_size: int, cluster: ClusterConfig) -> str | None:
    """The planner's step time for this very layout, when the cluster profile has hardware numbers."""
    from hpcdist.planning import layouts as planner

    try:
        hw = planner.cluster_hardware(cluster)
        est = planner.estimate_step(
            cfg.model_args(),
            planner.layout_of(cfg, world_size),
            seq_len=cfg.data.seq_len,
            global_batch_size=cfg.train.global_batch_size,
            gpus_per_node=cluster.gpus_per_node,
            hw=hw,
            reduce_bytes=planner.grad_reduce_bytes(cfg),
            document_mask=cfg.data.document_mask,
            element_bytes=planner.activation_element_bytes(cfg),
        )
    except ValueError:
        return None  # no hardware block (a CPU profile): nothing to predict
    return (
        f"planner prediction ({cluster.name}, efficiency {hw.efficiency:.2f}): "
        f"{est.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, {100 * est.mfu:.1f}% MFU, step {est.step_s:.2f} s"
    )


def dry_run(
    cfg: JobConfig,
    world_size: int,
    *,
    cluster: str | os.PathLike[str] | ClusterConfig = "a100_ib",
    ranks: Sequence[int] | None = None,
) -> DryRunReport:
    """Validate ``cfg`` for ``world_size`` ranks and apply its parallel plan to a meta model as each of ``ranks``.

    ``cluster`` (name, path or ClusterConfig) gives GPUs per node and GPU memory; ``parallel.strategy: auto`` is
    resolved by the planner first. Raises ConfigError for an invalid layout (before any process group exists) and
    RuntimeError when a process group is already initialized in this process.
    """
    start = time.perf_counter()
    cl = cluster if isinstance(cluster, ClusterConfig) else load_cluster(cluster)
    gpus_per_node = cl.gpus_per_node or cl.ntasks_per_node
    notes: list[str] = []
    if config_mod.needs_planner(cfg.parallel.strategy):
        from hpcdist.planning.layouts import resolve_auto

        cfg, reason = resolve_auto(cfg, world_size, cl)
        notes.append(reason)
    config_mod.check_world(cfg, world_size, ranks_per_node=gpus_per_node)
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("the dry run makes its own fake process group: run it outside torchrun/srun")
    chosen = sorted(set(ranks)) if ranks is not None else _default_ranks(cfg, world_size)
    bad = [r for r in chosen if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"ranks {bad} are outside 0..{world_size - 1}")

    args = cfg.model_args()
    total = num_params(args)
    counts: list[RankCount] = []
    for rank in chosen:
        # each rank in a forked child: the fake group, DTensor's caches and meshes never leak into this process
        # (a later real run in the same process, e.g. a test session, would otherwise reuse them)
        counts.append(_in_child(_count_rank, cfg, rank, rank // gpus_per_node, world_size))
    dims = parallel_dims(cfg, world_size)
    if dims.zero_enabled:
        notes.append("ZeRO counts follow DeepSpeed's partitioning rule; its engine cannot be built on meta tensors")
    return DryRunReport(
        cfg=cfg,
        world_size=world_size,
        gpus_per_node=gpus_per_node,
        layout=describe_layout(cfg, dims),
        total_params=total,
        counts=counts,
        memory=_memory(cfg, world_size, min(gpus_per_node, world_size)),
        gpu_mem_gib=getattr(cl.hardware, "gpu_mem_gb", None),
        hardware=cl.hardware,
        seconds=time.perf_counter() - start,
        notes=notes,
        prediction=_prediction(cfg, world_size, cl),
    )


def _default_ranks(cfg: JobConfig, world_size: int) -> list[int]:
    """First, middle and last rank; under pipeline parallelism also the first rank of every stage (counts differ
    between stages, not between the dp / tp ranks of one stage)."""
    ranks = set(parse_ranks(None, world_size))
    dims = parallel_dims(cfg, world_size)
    ranks |= {stage * dims.dp * dims.tp for stage in range(dims.pp)}
    return sorted(ranks)
