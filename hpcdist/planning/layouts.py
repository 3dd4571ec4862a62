"""Layout planner: which parallel layout trains a model fastest on a cluster, and why.

``hpcdist plan`` prints the ranked table; ``parallel.strategy: auto`` takes its top row through
:func:`resolve_auto`. Memory comes from :mod:`hpcdist.planning.memory`; this module adds the layouts (every
``ParallelDims`` the cluster allows, plus ZeRO stages) and the step-time model, whose formulas, notation and
limits are written out in docs/PLANNER.md (keep the two in step).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hpcdist import config as config_mod
from hpcdist.config import ConfigError, JobConfig, LayoutKind
from hpcdist.config.cluster import (
    DEFAULT_EFFICIENCY,
    DEFAULT_MARGIN_GIB,
    ClusterConfig,
    HardwareConfig,
    cluster_hardware,
    load_cluster,
)
from hpcdist.config.layout import LayoutDegrees, requested_kind, strategy_of
from hpcdist.config.schema import ACTIVATION_CHECKPOINTING, activation_checkpointing_mode
from hpcdist.models.args import ModelArgs, flops_per_token, num_params
from hpcdist.parallel.dims import ParallelDims, parallel_dims
from hpcdist.planning.memory import (
    GIB,
    MemoryEstimate,
    estimate_3d_memory,
    estimate_memory,
    recompute_flops_fraction,
    stage_params,
)

__all__ = [
    "DEFAULT_EFFICIENCY",
    "DEFAULT_MARGIN_GIB",
    "LAYOUT_STRATEGIES",
    "HardwareConfig",
    "Layout",
    "StepEstimate",
    "activation_element_bytes",
    "apply_layout",
    "choose",
    "cluster_hardware",
    "config_estimate",
    "enumerate_layouts",
    "estimate_step",
    "format_count",
    "grad_reduce_bytes",
    "layout_memory",
    "layout_of",
    "layout_overrides",
    "layout_table",
    "pick",
    "rank_layouts",
    "resolve_auto",
]

LAYOUT_STRATEGIES: tuple[LayoutKind, ...] = tuple(LayoutKind)  # every kind is a planner row
TP_DEGREES = (1, 2, 4, 8)
_K = LayoutKind
_AC_SHORT = {"none": "off", "full": "full", "selective": "sel"}  # the table's AC column (width 4)
# ties in the ranking go to the simpler layout
_SIMPLER = {kind: i for i, kind in enumerate((_K.DDP, _K.FSDP, _K.HSDP, _K.ZERO1, _K.ZERO2, _K.ZERO3, _K.THREE_D))}
_REDUCE_BYTES = {"fp32": 4, "bf16": 2}


# ----------------------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Layout(LayoutDegrees):
    """One candidate: the trainer's own layout vocabulary (ParallelDims degrees, or a ZeRO stage over pure dp), a
    micro-batch and activation checkpointing. W = pp * dp * tp. Its kind and description: :class:`LayoutDegrees`."""

    pp: int
    dp: int
    tp: int
    micro_batch_size: int
    activation_checkpointing: str
    """none, full or selective (train.activation_checkpointing; a bool is read as full / none)."""
    dp_replicate: int = 1
    """HSDP replicas (dp = dp_replicate x dp_shard); dp_replicate == dp without pp/tp is DDP (ParallelDims)."""
    zero_stage: int = 0
    """1-3: DeepSpeed ZeRO over all W ranks (the degrees are then pp = tp = 1, dp = W); 0: not ZeRO."""

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(
            pp=self.pp,
            dp=self.dp,
            tp=self.tp,
            world_size=self.world_size,
            dp_replicate=self.dp_replicate,
            zero_stage=self.zero_stage,
        )

    @property
    def world_size(self) -> int:
        return self.ranks

    @property
    def strategy(self) -> LayoutKind:
        """The row's name, derived from the degrees: ddp, zero1-3, fsdp, hsdp or 3d."""
        return self.kind

    @property
    def dp_label(self) -> str:
        # hsdp: replicas x shard, the way the mesh is built
        return f"{self.dp_replicate}x{self.dp_shard}" if self.kind is LayoutKind.HSDP else str(self.dp)

    def __post_init__(self) -> None:
        mode = activation_checkpointing_mode(self.activation_checkpointing)
        object.__setattr__(self, "activation_checkpointing", mode)  # frozen: a bool (the old type) read as a mode

    def describe(self, *notes: str) -> str:
        ac = self.activation_checkpointing
        return super().describe(f"micro batch {self.micro_batch_size}", f"activation checkpointing {ac}", *notes)


# A fitting layout this close to the usable memory is "tight": the estimate's own error (a few percent against
# measurements, docs/PLANNER.md) and the allocator's fragmentation are of that size. Tight rows rank after the
# roomier ones, so auto takes one of those while any fits.
TIGHT_FRACTION = 0.05


@dataclass(frozen=True)
class StepEstimate:
    """Predicted memory and step time of one layout (all times in seconds per optimizer step)."""

    layout: Layout
    memory: MemoryEstimate
    fits: bool
    microbatches: int
    compute_s: float
    """m * (c_fwd + c_bwd): compute without the bubble."""
    tp_comm_s: float
    """m * t_tp."""
    p2p_s: float
    """m * t_p2p."""
    bubble_s: float
    """(pp - 1) * t_mb: idle pipeline time."""
    dp_comm_s: float
    """All data-parallel collective time, hidden or not."""
    dp_exposed_s: float
    """The part of dp_comm_s not hidden behind compute (t_dp)."""
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    tight: bool = False
    """Fits, but within TIGHT_FRACTION of the usable memory: fragmentation or a longer batch can tip it over."""

    def days(self, tokens: float) -> float:
        """Days to train ``tokens`` tokens at this rate on all the layout's GPUs."""
        return tokens / (self.tokens_per_s_per_gpu * self.layout.world_size) / 86400


# ------------------------------------------------------------------------------------------------ time model


def _ring(kind: str, nbytes: float, n: int, bandwidth: float) -> float:
    """Seconds for a ring collective of ``nbytes`` (full size) over ``n`` ranks at bus bandwidth (bytes/s)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
    return factor * nbytes / bandwidth


def _exposed(t: float, window: float, units: int) -> float:
    """Collective time not hidden behind ``window`` seconds of compute: one unit's share always shows."""
    if t <= 0:
        return 0.0
    return t / units + max(0.0, t * (units - 1) / units - window)


def _dp_events(layout: Layout, p_g: int, reduce_bytes: int, bw_dp: float, bw_shard: float) -> tuple[float, ...]:
    """Seconds of data-parallel traffic: (every micro-batch's forward, every micro-batch's backward, the first
    micro-batch's forward only, the last micro-batch's backward only, after the optimizer step).

    ``bw_dp``: bandwidth of the whole dp group; ``bw_shard``: of one FSDP shard group (HSDP: inside a replica)."""
    n = layout.dp
    match layout.kind:
        case LayoutKind.DDP:
            return 0.0, 0.0, 0.0, _ring("all_reduce", 4 * p_g, n, bw_dp), 0.0
        case LayoutKind.ZERO1:
            gather = _ring("all_gather", 2 * p_g, n, bw_dp)
            return 0.0, 0.0, 0.0, _ring("reduce_scatter", 2 * p_g, n, bw_dp), gather
        case LayoutKind.ZERO2:
            gather = _ring("all_gather", 2 * p_g, n, bw_dp)
            return 0.0, _ring("reduce_scatter", 2 * p_g, n, bw_dp), 0.0, 0.0, gather
        case LayoutKind.ZERO3:
            gather = _ring("all_gather", 2 * p_g, n, bw_dp)
            return gather, gather + _ring("reduce_scatter", 2 * p_g, n, bw_dp), 0.0, 0.0, 0.0
        case LayoutKind.FSDP | LayoutKind.HSDP | LayoutKind.THREE_D:
            shard, replicas = layout.dp_shard, layout.dp // layout.dp_shard
            gather = _ring("all_gather", 2 * p_g, shard, bw_shard)
            scatter = _ring("reduce_scatter", reduce_bytes * p_g, shard, bw_shard)
            scatter += _ring("all_reduce", reduce_bytes * p_g / shard, replicas, bw_dp)  # HSDP: across replicas
            if layout.pp > 1:  # hpcdist keeps a pipeline stage gathered for the whole step
                return 0.0, 0.0, gather, scatter, 0.0
            return gather, gather, 0.0, scatter, 0.0
    raise ValueError(f"unknown layout strategy {str(layout.kind)!r}: choose one of {', '.join(LAYOUT_STRATEGIES)}")


def layout_memory(
    args: ModelArgs,
    layout: Layout,
    *,
    seq_len: int,
    microbatches: int,
    gpus_per_node: int,
    reduce_bytes: int,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    document_mask: bool = False,
    element_bytes: int = 2,
) -> MemoryEstimate:
    """Per-GPU memory of ``layout`` (the planner's rows and the dry run's estimate); offload only for ZeRO;
    ``document_mask``: data.document_mask's mask (hpcdist.planning.memory.document_mask_bytes); ``element_bytes``:
    the activations' dtype (:func:`activation_element_bytes`)."""
    common: dict[str, Any] = {
        "micro_batch_size": layout.micro_batch_size,
        "seq_len": seq_len,
        "activation_checkpointing": layout.activation_checkpointing,
        "document_mask": document_mask,
        "element_bytes": element_bytes,
    }
    if not layout.kind.fsdp_options_apply:  # ddp and ZeRO: the per-strategy estimator
        return estimate_memory(
            args,
            strategy=layout.strategy,
            world_size=layout.dp,
            gpus_per_node=gpus_per_node,
            offload_optimizer=offload_optimizer,
            offload_params=offload_params,
            **common,
        )
    return estimate_3d_memory(
        args,
        tp=layout.tp,
        pp=layout.pp,
        dp=layout.dp,
        dp_shard=layout.dp_shard,
        microbatches=microbatches,
        reduce_bytes=reduce_bytes,
        strategy=layout.strategy,
        **common,
    )


def estimate_step(
    args: ModelArgs,
    layout: Layout,
    *,
    seq_len: int,
    global_batch_size: int,
    gpus_per_node: int,
    hw: HardwareConfig,
    reduce_bytes: int = 4,
    document_mask: bool = False,
    element_bytes: int = 2,
) -> StepEstimate:
    """Memory and step time of ``layout`` by the formulas of the module docstring (nothing else goes in)."""
    b, dp, tp, pp = layout.micro_batch_size, layout.dp, layout.tp, layout.pp
    world = layout.world_size
    if global_batch_size % (b * dp):
        raise ValueError(
            f"global batch {global_batch_size} is not divisible by micro batch {b} x data-parallel size {dp}"
        )
    m = global_batch_size // (b * dp)
    if pp > 1 and m < pp:
        raise ValueError(f"1F1B needs at least pp={pp} micro-batches per step, got {m}")
    per_node = min(gpus_per_node, world)
    intra, inter = hw.intra_node_busbw_gbps * 1e9, hw.inter_node_busbw_gbps * 1e9
    flops = flops_per_token(args, seq_len)
    rate = hw.peak_flops * hw.efficiency

    c_fwd = b * seq_len * flops / 3 / (tp * pp) / rate
    recomputes = layout.activation_checkpointing != "none"
    c_bwd = 2 * c_fwd + c_fwd * recompute_flops_fraction(args, layout.activation_checkpointing, seq_len)
    layers = -(-args.n_layers // pp)
    act_bytes = b * seq_len * args.dim * element_bytes  # one hidden-state tensor of the micro-batch
    # either mode re-runs the block's forward collectives (selective saves no collective's output), counted as the
    # forward's two all-reduces: an upper bound. Measured (dp2 x tp2 on 4 gloo ranks, torch 2.13), the recompute runs
    # both all-gathers and wo's reduce-scatter and stops before w2's (checkpoint's early stop): 1.5 all-reduces' worth
    t_tp = (4 + 2 * recomputes) * layers * _ring("all_reduce", act_bytes, tp, intra)
    t_p2p = 0.0
    if pp > 1:
        p2p_bw = intra if world <= per_node else inter / per_node
        t_p2p = 2 * (act_bytes / tp) / p2p_bw
    t_mb = c_fwd + c_bwd + t_tp + t_p2p
    t_pipe = (m + pp - 1) * t_mb

    p_g = -(-stage_params(args, pp=pp) // tp)
    # tp is innermost, dp next (dims.py): a dp group spans dp * tp consecutive ranks, a shard group dp_shard * tp
    bw_dp = intra if dp * tp <= per_node else inter
    bw_shard = intra if layout.dp_shard * tp <= per_node else inter
    fwd, bwd, first, last, after = _dp_events(layout, p_g, reduce_bytes, bw_dp, bw_shard)
    units = layers
    t_dp = after
    for i in range(1, m + 1):  # the first and the last micro-batch carry the once-per-step traffic
        t_dp += _exposed(fwd + (first if i == 1 else 0.0), c_fwd, units)
        t_dp += _exposed(bwd + (last if i == m else 0.0), c_bwd, units)

    step = t_pipe + t_dp
    tokens_per_gpu = global_batch_size * seq_len / (step * world)
    memory = layout_memory(
        args,
        layout,
        seq_len=seq_len,
        microbatches=m,
        gpus_per_node=per_node,
        reduce_bytes=reduce_bytes,
        document_mask=document_mask,
        element_bytes=element_bytes,
    )
    return StepEstimate(
        layout=layout,
        memory=memory,
        fits=memory.peak <= hw.usable_bytes,  # ZeRO: the model's build too
        tight=(1 - TIGHT_FRACTION) * hw.usable_bytes < memory.peak <= hw.usable_bytes,
        microbatches=m,
        compute_s=m * (c_fwd + c_bwd),
        tp_comm_s=m * t_tp,
        p2p_s=m * t_p2p,
        bubble_s=(pp - 1) * t_mb,
        dp_comm_s=m * (fwd + bwd) + first + last + after,
        dp_exposed_s=t_dp,
        step_s=step,
        tokens_per_s_per_gpu=tokens_per_gpu,
        mfu=tokens_per_gpu * flops / hw.peak_flops,
    )


# ------------------------------------------------------------------------------------------- enumeration + rank


def _cluster_shape(world_size: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, GPUs used per node). A job smaller than a node uses world_size GPUs of one node."""
    if world_size < 1 or gpus_per_node < 1:
        raise ValueError(f"world size and GPUs per node must be >= 1, got {world_size} and {gpus_per_node}")
    if world_size <= gpus_per_node:
        return 1, world_size
    if world_size % gpus_per_node:
        raise ValueError(
            f"world size {world_size} is not a whole number of nodes of {gpus_per_node} GPUs; "
            f"use a multiple of {gpus_per_node}"
        )
    return world_size // gpus_per_node, gpus_per_node


def _micro_batches(global_batch_size: int, dp: int, sizes: Sequence[int] | None) -> list[int]:
    if global_batch_size % dp:
        return []
    per_replica = global_batch_size // dp
    candidates = sizes if sizes is not None else [2**i for i in range(per_replica.bit_length())]
    return [b for b in candidates if b >= 1 and per_replica % b == 0]


def enumerate_layouts(
    args: ModelArgs,
    *,
    world_size: int,
    gpus_per_node: int,
    global_batch_size: int,
    seq_len: int,
    strategies: Iterable[str] = LAYOUT_STRATEGIES,
    micro_batch_sizes: Sequence[int] | None = None,
    fp16: bool = False,
) -> list[Layout]:
    """Every layout of the module docstring that divides the world and the global batch evenly; with ``fp16``
    (train.dtype=fp16) none with tp or pp, which the config refuses with it (no loss scaler across stages)."""
    nodes, per_node = _cluster_shape(world_size, gpus_per_node)
    unknown = [s for s in strategies if s not in LAYOUT_STRATEGIES]
    if unknown:
        raise ValueError(f"unknown layout strategies {unknown}: choose from {', '.join(LAYOUT_STRATEGIES)}")
    wanted = [LayoutKind(s) for s in strategies]
    out: list[Layout] = []

    def add(pp: int, dp: int, tp: int, *, dp_replicate: int = 1, zero_stage: int = 0) -> None:
        if fp16 and (pp > 1 or tp > 1):
            return  # hpcdist.config.rules refuses train.dtype=fp16 with tp/pp
        for b in _micro_batches(global_batch_size, dp, micro_batch_sizes):
            if pp > 1 and global_batch_size // (b * dp) < pp:
                continue  # 1F1B keeps every stage busy only with at least pp micro-batches
            for ac in ACTIVATION_CHECKPOINTING:
                out.append(
                    Layout(
                        pp=pp,
                        dp=dp,
                        tp=tp,
                        micro_batch_size=b,
                        activation_checkpointing=ac,
                        dp_replicate=dp_replicate,
                        zero_stage=zero_stage,
                    )
                )

    for kind in wanted:
        if kind is LayoutKind.DDP:
            add(1, world_size, 1, dp_replicate=world_size)
        elif kind.zero_stage:
            add(1, world_size, 1, zero_stage=kind.zero_stage)
        elif kind is LayoutKind.FSDP and world_size > 1:  # one rank: nothing to shard (the ddp row)
            add(1, world_size, 1)
        elif kind is LayoutKind.HSDP and nodes > 1:
            add(1, world_size, 1, dp_replicate=world_size // per_node)
        elif kind is LayoutKind.THREE_D:
            for tp in TP_DEGREES:
                if tp > per_node or per_node % tp or any(x % tp for x in (args.n_heads, args.kv_heads)):
                    continue  # tensor parallelism stays inside a node and splits whole heads
                if args.ffn_dim % tp or seq_len % tp:
                    continue  # whole SwiGLU columns; sequence parallelism splits the sequence evenly
                for pp in range(1, min(args.n_layers, world_size // tp) + 1):
                    if (world_size // tp) % pp or (tp == 1 and pp == 1):
                        continue
                    add(pp, world_size // (tp * pp), tp)
    return out


def rank_layouts(
    args: ModelArgs,
    *,
    world_size: int,
    gpus_per_node: int,
    global_batch_size: int,
    seq_len: int,
    hw: HardwareConfig,
    reduce_bytes: int = 4,
    strategies: Iterable[str] = LAYOUT_STRATEGIES,
    micro_batch_sizes: Sequence[int] | None = None,
    document_mask: bool = False,
    fp16: bool = False,
    element_bytes: int = 2,
) -> list[StepEstimate]:
    """Estimates for every layout, best first: fitting ones by tokens/s/GPU (ties: less memory, simpler), then
    the ones that do not fit in the same order."""
    layouts = enumerate_layouts(
        args,
        world_size=world_size,
        gpus_per_node=gpus_per_node,
        global_batch_size=global_batch_size,
        seq_len=seq_len,
        strategies=strategies,
        micro_batch_sizes=micro_batch_sizes,
        fp16=fp16,
    )
    estimates = [
        estimate_step(
            args,
            layout,
            seq_len=seq_len,
            global_batch_size=global_batch_size,
            gpus_per_node=gpus_per_node,
            hw=hw,
            reduce_bytes=reduce_bytes,
            document_mask=document_mask,
            element_bytes=element_bytes,
        )
        for layout in layouts
    ]
    estimates.sort(
        key=lambda e: (
            not e.fits,
            e.tight,
            -e.tokens_per_s_per_gpu,
            # at equal modelled speed no recompute beats selective's unmodelled elementwise recompute
            ACTIVATION_CHECKPOINTING.index(e.layout.activation_checkpointing),
            e.memory.peak,
            _SIMPLER[e.layout.strategy],
            e.layout.pp,
        )
    )
    return estimates


def choose(estimates: Sequence[StepEstimate]) -> StepEstimate:
    """The top fitting estimate of a ranked list; ValueError when nothing fits."""
    for e in estimates:
        if e.fits:
            return e
    raise ValueError(
        f"none of {len(estimates)} layouts fits in GPU memory: add nodes, shorten data.seq_len or lower "
        "train.global_batch_size (the smallest estimate is "
        f"{min((e.memory.peak for e in estimates), default=0) / GIB:.1f} GiB)"
    )


# ------------------------------------------------------------------------------------------------------ table


def _fixed(x: float, digits: int) -> str:
    """Fixed-point, or scientific when that would print as zero (tiny models)."""
    return f"{x:.{digits}f}" if x >= 10**-digits else f"{x:.1e}"


def format_count(n: float) -> str:
    """13015864320 -> 13.02B; 262144000000 -> 262.1B; 1e12 -> 1.00T; 2.9e6 -> 2.9M."""
    for scale, suffix, digits in ((1e12, "T", 2), (1e9, "B", 2 if n < 1e11 else 1), (1e6, "M", 1)):
        if n >= scale:
            return f"{n / scale:,.{digits}f}{suffix}"
    return f"{n:,.0f}"


def layout_table(
    estimates: Sequence[StepEstimate],
    *,
    args: ModelArgs,
    gpus_per_node: int,
    seq_len: int,
    global_batch_size: int,
    hw: HardwareConfig,
    tokens: float,
    top: int = 10,
    show_all: bool = False,
) -> str:
    """The ranked table printed by ``hpcdist plan``, with a header of inputs and a footer of assumptions."""
    if not estimates:
        raise ValueError("no layout divides this world size and global batch; change train.global_batch_size")
    world = estimates[0].layout.world_size
    nodes, per_node = _cluster_shape(world, gpus_per_node)
    fitting = [e for e in estimates if e.fits]
    shown = [*fitting[:top], *([e for e in estimates if not e.fits][:top] if show_all else [])]
    step_tokens = global_batch_size * seq_len
    lines = [
        f"Layouts: {format_count(num_params(args))} params on {nodes} node(s) x {per_node} GPU(s) = {world}; "
        f"global batch {global_batch_size} x seq {seq_len} = {step_tokens:,} tokens/step",
        f"hardware: {hw.gpu_mem_gb:g} GiB/GPU ({hw.gpu_mem_gb - hw.margin_gib:g} usable), bf16 peak "
        f"{hw.bf16_peak_tflops:g} TFLOP/s x efficiency {hw.efficiency:.2f}, bus bandwidth "
        f"{hw.intra_node_busbw_gbps:g} GB/s in a node / {hw.inter_node_busbw_gbps:g} GB/s across nodes; days = time "
        f"to train {format_count(tokens)} tokens",
    ]
    cols: tuple[str, ...] = ("rank", "strategy", "tp", "pp", "dp", "mbs", "AC", "mem GiB", "fits", "tok/s/GPU")
    cols += ("MFU %", "step s", "days")
    widths = (4, 8, 2, 2, 5, 3, 4, 7, 5, 9, 5, 7, 7)
    lines.append("  ".join(f"{c:>{w}}" for c, w in zip(cols, widths, strict=True)))
    for i, e in enumerate(shown, 1):
        lay = e.layout
        cells = (
            str(i) if e.fits else "-",
            lay.strategy,
            str(lay.tp),
            str(lay.pp),
            lay.dp_label,
            str(lay.micro_batch_size),
            _AC_SHORT[lay.activation_checkpointing],
            f"{e.memory.total / GIB:.1f}",
            "tight" if e.tight else "yes" if e.fits else "no",
            f"{e.tokens_per_s_per_gpu:,.0f}",
            f"{100 * e.mfu:.1f}",
            _fixed(e.step_s, 2),
            _fixed(e.days(tokens), 1),
        )
        lines.append("  ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)))
    lines += [
        f"{len(estimates)} layouts considered, {len(fitting)} fit; showing "
        f"{min(top, len(fitting))} fitting{' and the best that do not' if show_all else ''} (--top, --all).",
        *(
            [
                f"tight = within {100 * TIGHT_FRACTION:g}% of the usable memory: the estimate's error or the "
                "allocator's fragmentation can tip it over;",
                "  ranked after the roomier layouts, and auto takes one of those while any fits.",
            ]
            if any(e.tight for e in shown)
            else []
        ),
        "Model (formulas: docs/PLANNER.md): compute = tokens x flops_per_token (6N + 12*L*h*s; + the recomputed",
        "  forward: ~x4/3 for AC full, none for sel: its matmuls are saved) / (peak x efficiency). Data-parallel",
        "  collectives: ring all-reduce 2(n-1)/n, all-gather / reduce-scatter (n-1)/n of the bytes over bus bandwidth",
        "  (in-node if the group fits in a node),",
        "  hidden behind each micro-batch's forward/backward except one layer's share; the ZeRO-1/2 parameter",
        "  all-gather after the optimizer step is exposed. tp: sequence parallel, 4 all-reduce volumes per layer and",
        "  micro-batch (+2 recomputed), in-node, not overlapped. pp: 1F1B, bubble (pp-1)/(m+pp-1), p2p not overlapped.",
        "  Not modelled: optimizer step, data loading, launch gaps, efficiency varying with micro-batch or tp.",
        "Memory: planning/memory.py; fsdp / hsdp / 3d rows add FSDP2's unsharded gradients kept while accumulating",
        "  micro-batches (so they differ from the per-strategy table when accumulation > 1). AC = activation",
        "  checkpointing (off / full / sel = selective); mbs = micro batch size; hsdp dp = replicas x shard.",
    ]
    builds = {e.memory.build for e in shown if e.layout.zero_enabled}
    if builds:
        lines.append(
            f"  zero rows: building the model takes {max(builds) / GIB:.1f} GiB per GPU (the whole fp32 model, before "
            "DeepSpeed partitions it); fits counts it."
        )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ config <-> layout


def layout_overrides(layout: Layout) -> list[tuple[str, Any]]:
    """(config key, value) pairs that make a JobConfig run ``layout``."""
    out: list[tuple[str, Any]] = [
        ("train.micro_batch_size", layout.micro_batch_size),
        ("train.activation_checkpointing", layout.activation_checkpointing),
    ]
    kind = layout.kind
    out.append(("parallel.strategy", strategy_of(kind)))
    if kind.zero_stage:
        out += [("parallel.zero.stage", layout.zero_stage)]
        out += [("parallel.zero.offload_optimizer", False), ("parallel.zero.offload_params", False)]
        out.append(("parallel.zero.overlap_comm", True))  # the time model hides gradient reduction in backward
    elif kind is LayoutKind.THREE_D:
        out += [("parallel.pp", layout.pp), ("parallel.dp", layout.dp)]
        out += [("parallel.tp", layout.tp), ("parallel.fsdp.replicate", layout.dp_replicate)]
        if layout.pp > 1:  # the time model's bubble is 1F1B's
            out += [("parallel.pp_schedule", "1F1B"), ("parallel.pp_stages_per_rank", None)]
    elif kind is not LayoutKind.DDP:
        out += [("parallel.fsdp.replicate", layout.dp_replicate)]
    return out


def apply_layout(cfg: JobConfig, layout: Layout) -> tuple[JobConfig, list[str]]:
    """A copy of ``cfg`` set to run ``layout``, and the keys this build of the config lacks (then unusable)."""
    new = copy.deepcopy(cfg)
    missing = []
    for key, value in layout_overrides(layout):
        *path, leaf = key.split(".")
        node: Any = new
        for part in path:
            node = getattr(node, part)
        if not dataclasses.is_dataclass(node) or leaf not in {f.name for f in dataclasses.fields(node)}:
            missing.append(key)
            continue
        setattr(node, leaf, value)
    why = f"no such config key in this build (strategy {layout.strategy} not available)"
    return new, [f"{key}: {why}" for key in missing]


def layout_of(cfg: JobConfig, world_size: int) -> Layout:
    """The Layout a resolved config runs on ``world_size`` ranks (the inverse of :func:`apply_layout`): the trainer's
    own ParallelDims, plus the ZeRO stage."""
    p, t = cfg.parallel, cfg.train
    if requested_kind(p) is None:
        raise ValueError(f"parallel.strategy={p.strategy!r} has no planner layout")
    dims = parallel_dims(cfg, world_size)  # resolves a -1 degree
    return Layout(
        dims.pp,
        dims.dp,
        dims.tp,
        t.micro_batch_size,
        t.activation_checkpointing,
        dp_replicate=dims.dp_replicate,
        zero_stage=dims.zero_stage,
    )


def config_estimate(cfg: JobConfig, estimates: Sequence[StepEstimate], world_size: int) -> StepEstimate:
    """The config's own row among the ranked ``estimates``; the top fitting row for parallel.strategy=auto or a
    layout the planner does not rank."""
    try:
        layout = layout_of(cfg, world_size)
    except ValueError:
        layout = None
    fitting = [e for e in estimates if e.fits] or list(estimates)
    return next((e for e in estimates if e.layout == layout), fitting[0])


def rank_config_layouts(
    cfg: JobConfig, args: ModelArgs, *, world_size: int, gpus_per_node: int, hw: HardwareConfig
) -> list[StepEstimate]:
    """:func:`rank_layouts` for a job config: its global batch, sequence length, precision, document masking and
    gradient reduction dtype, for the model ``args``."""
    t = cfg.train
    return rank_layouts(
        args,
        world_size=world_size,
        gpus_per_node=gpus_per_node,
        global_batch_size=t.global_batch_size,
        seq_len=cfg.data.seq_len,
        hw=hw,
        reduce_bytes=grad_reduce_bytes(cfg),
        document_mask=cfg.data.document_mask,
        fp16=t.dtype == "fp16",
        element_bytes=activation_element_bytes(cfg),
    )


def activation_element_bytes(cfg: JobConfig) -> int:
    """Bytes per element of the activations the planner counts: 4 under train.dtype=fp32 (no autocast), else 2
    (bf16 and fp16 autocast; ``auto`` is bf16 on the GPUs the planner plans for). The norms' fp32 tensors and the
    fp32 logits are counted as fp32 either way (hpcdist.planning.memory.layer_saved_bytes)."""
    return 4 if cfg.train.dtype == "fp32" else 2


def grad_reduce_bytes(cfg: JobConfig) -> int:
    """Bytes per element FSDP reduces gradients in (parallel.fsdp.reduce_dtype)."""
    return _REDUCE_BYTES.get(cfg.parallel.fsdp.reduce_dtype, 4)


def _problems(cfg: JobConfig, world_size: int, gpus_per_node: int) -> list[str]:

    problems = config_mod.check(cfg)
    if not problems:
        try:
            config_mod.check_world(cfg, world_size, ranks_per_node=gpus_per_node)
        except config_mod.ConfigError as e:
            problems = e.problems
    return problems


def pick(
    cfg: JobConfig, estimates: Sequence[StepEstimate], world_size: int, gpus_per_node: int
) -> tuple[JobConfig, StepEstimate, str]:
    """The highest fitting row that ``cfg`` can run (config validation passes), and why it was taken.

    Rows above it are skipped for what validation says (a strategy this build lacks, a restriction such as ZeRO
    without checkpoints); the reason lists them grouped by problem.
    """

    fitting = [e for e in estimates if e.fits]
    skipped: Counter[str] = Counter()
    for i, e in enumerate(fitting, 1):
        new, missing = apply_layout(cfg, e.layout)
        problems = missing or _problems(new, world_size, gpus_per_node)
        if problems:
            skipped[f"{e.layout.strategy}: {problems[0]}"] += 1
            continue
        reason = (
            f"row {i} of {len(fitting)} fitting layouts ({len(estimates)} considered): {e.layout.describe()}; "
            f"predicted {e.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, {100 * e.mfu:.1f}% MFU, "
            f"{e.memory.total / GIB:.1f} GiB/GPU, step {e.step_s:.2f} s"
        )
        if e.tight:  # ranked after every roomier row: none of those is runnable
            reason += f" (tight: within {100 * TIGHT_FRACTION:g}% of the usable memory; no roomier layout runs)"
        if skipped:
            reason += "; skipped higher rows: " + "; ".join(f"{n} x {why}" for why, n in skipped.items())
        return new, e, reason
    if not fitting:
        try:
            choose(estimates)
        except ValueError as e:
            raise ConfigError([f"parallel.strategy=auto: {e}"]) from None
    raise ConfigError(
        [f"parallel.strategy=auto: none of the {len(fitting)} fitting layouts is runnable with this config"]
        + [f"{n} x {why}" for why, n in skipped.items()]
    )


def resolve_auto(
    cfg: JobConfig,
    world_size: int,
    cluster: ClusterConfig | str | os.PathLike[str] = "a100_ib",
    *,
    hardware: HardwareConfig | None = None,
) -> tuple[JobConfig, str]:
    """``parallel.strategy: auto``: the config set to the planner's best runnable layout, and why.

    ``cluster`` (a ClusterConfig, or a shipped profile name or a YAML path) gives GPUs per node and, unless
    ``hardware`` is passed, the hardware numbers. The global batch, sequence length and model stay as configured;
    the strategy, its degrees, the micro-batch size and activation checkpointing are chosen. Raises ConfigError
    when the cluster has no GPUs, nothing fits, or no fitting layout passes the config's validation.
    """

    cl = cluster if isinstance(cluster, ClusterConfig) else load_cluster(cluster)
    if cl.gpus_per_node < 1:
        raise ConfigError(
            [
                f"parallel.strategy=auto plans GPU layouts, but cluster {cl.name!r} has gpus_per_node: 0; "
                "name a strategy (e.g. parallel.strategy=ddp) or a GPU cluster profile"
            ]
        )
    try:
        hw = hardware or cluster_hardware(cl)
        estimates = rank_layouts(
            cfg.model_args(),
            world_size=world_size,
            gpus_per_node=cl.gpus_per_node,
            global_batch_size=cfg.train.global_batch_size,
            seq_len=cfg.data.seq_len,
            hw=hw,
            reduce_bytes=grad_reduce_bytes(cfg),
            document_mask=cfg.data.document_mask,
            fp16=cfg.train.dtype == "fp16",
            element_bytes=activation_element_bytes(cfg),
        )
    except ValueError as e:
        raise ConfigError([f"parallel.strategy=auto: {e}"]) from None
    if not estimates:
        raise ConfigError(
            [
                f"parallel.strategy=auto: no layout splits train.global_batch_size={cfg.train.global_batch_size} "
                f"over {world_size} ranks; make it a multiple of {world_size}"
            ]
        )
    new, _, reason = pick(cfg, estimates, world_size, cl.gpus_per_node)
    return new, f"parallel.strategy=auto on {world_size} GPUs ({cl.name}): {reason}"
