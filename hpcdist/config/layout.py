"""The (pp, dp, tp) layout rules: pure arithmetic on degrees, the model's shape and the batch, no process group.

Config validation runs them at load (no world size yet: the rules that need only the degrees and the model) and
again with the job's size (:func:`hpcdist.config.check_world`), before any process starts; every problem names the
degrees, the rule and a fix. :class:`hpcdist.parallel.dims.ParallelDims` resolves its degrees with
:func:`resolve_degrees`, so the runtime layout and the validation share one arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "SCHEDULES",
    "ScheduleInfo",
    "default_stages_per_rank",
    "layout_problems",
    "resolve_degrees",
    "strategy_degrees",
]


@dataclass(frozen=True)
class ScheduleInfo:
    """What validation needs to know about a torch.distributed.pipelining schedule."""

    multi_stage: bool
    """Several (virtual) stages per rank (PipelineScheduleMulti) rather than exactly one."""
    style: str = "loop"
    """Stage -> rank mapping: "loop" (stage s on rank s % pp) or "v" (rank r holds r and 2 pp - 1 - r)."""
    min_microbatches: str = "any"
    """Micro-batches per step a rank needs: "any", "pp" (1F1B-like: one in flight per rank to fill the pipe) or
    "stages" (one per stage)."""
    rounds: bool = False
    """Interleaved schedules run micro-batches in rounds of pp: n must be a multiple of n // pp."""
    forward_only: bool = True
    """``schedule.eval()`` works (torch 2.13's V schedules fail forward-only: "can't steal_bwd_input")."""


# The schedules that ran correctly here (tests/dist/test_3d.py); names as torch's get_schedule_class spells them.
SCHEDULES: dict[str, ScheduleInfo] = {
    "GPipe": ScheduleInfo(multi_stage=False),
    "1F1B": ScheduleInfo(multi_stage=False, min_microbatches="pp"),
    "Interleaved1F1B": ScheduleInfo(multi_stage=True, min_microbatches="pp", rounds=True),
    "LoopedBFS": ScheduleInfo(multi_stage=True),
    "InterleavedZeroBubble": ScheduleInfo(multi_stage=True, min_microbatches="pp", rounds=True),
    "ZBVZeroBubble": ScheduleInfo(multi_stage=True, style="v", min_microbatches="pp", forward_only=False),
    "DualPipeV": ScheduleInfo(multi_stage=True, style="v", min_microbatches="stages", forward_only=False),
}


def default_stages_per_rank(schedule: str) -> int:
    """Virtual stages per pipeline rank when parallel.pp_stages_per_rank is not set: 2 for multi-stage schedules."""
    info = SCHEDULES.get(schedule)
    return 2 if info is not None and info.multi_stage else 1


def strategy_degrees(
    strategy: str, *, pp: int, dp: int, tp: int, replicate: int, world_size: int
) -> tuple[int, int, int, int]:
    """``parallel.strategy`` as degrees (pp, dp, tp, dp_replicate): the one place the user-facing alias becomes a
    layout. ddp = dp over all ranks, all replicas (dp_shard 1); fsdp = dp over all ranks, sharded (HSDP:
    ``replicate`` groups); 3d = the configured degrees (-1 still unresolved); zero = dp over all ranks (DeepSpeed
    partitions by its own stage, not by these degrees)."""
    match strategy:
        case "3d":
            return pp, dp, tp, replicate
        case "ddp":
            return 1, world_size, 1, world_size
        case "fsdp":
            return 1, world_size, 1, replicate
        case _:
            return 1, world_size, 1, 1


def resolve_degrees(pp: int, dp: int, tp: int, world_size: int) -> tuple[tuple[int, int, int], list[str]]:
    """Fill a single -1 degree with the ranks left over; return (degrees, problems). Every degree is named."""
    degrees = {"pp": pp, "dp": dp, "tp": tp}
    shown = " x ".join(f"parallel.{k}={v}" for k, v in degrees.items())
    problems = [
        f"parallel.{k}={v}: must be a positive integer or -1 (= fill the remaining ranks)"
        for k, v in degrees.items()
        if not isinstance(v, int) or isinstance(v, bool) or (v < 1 and v != -1)
    ]
    if problems:
        return (pp, dp, tp), problems
    fill = [k for k, v in degrees.items() if v == -1]
    if len(fill) > 1:
        return (pp, dp, tp), [f"{shown}: at most one degree may be -1 (fill), got {len(fill)}; set the others"]
    fixed = math.prod(v for v in degrees.values() if v != -1)
    if fill:
        if world_size % fixed:
            return (pp, dp, tp), [
                f"{shown}: the fixed degrees multiply to {fixed}, which does not divide the world size "
                f"{world_size}, so parallel.{fill[0]}=-1 cannot fill the rest; pick degrees whose product divides "
                f"{world_size}"
            ]
        degrees[fill[0]] = world_size // fixed
    elif fixed != world_size:
        return (pp, dp, tp), [
            f"{shown} = {fixed} ranks, but the world size is {world_size}: pp x dp x tp must equal the world size; "
            f"set one degree to -1 to fill the rest, e.g. parallel.dp=-1"
        ]
    return (degrees["pp"], degrees["dp"], degrees["tp"]), []


def layout_problems(
    *,
    pp: int,
    dp: int,
    tp: int,
    world_size: int | None,
    dp_replicate: int = 1,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    dim: int,
    ffn_dim: int,
    seq_len: int,
    tie_embeddings: bool,
    schedule: str,
    stages_per_rank: int | None,
    global_batch_size: int,
    micro_batch_size: int,
    ranks_per_node: int | None = None,
    tp_across_nodes: bool = False,
    evaluates: bool = False,
    dp_name: str = "parallel.dp",
) -> list[str]:
    """Every reason a (pp, dp, tp) layout cannot run this model, each naming the degrees, the rule and a fix.

    ``world_size=None`` (config loading, no job yet): only the checks that do not need it, with -1 degrees
    skipped. ``ranks_per_node`` (GPUs per node) enables the tp-inside-a-node rule; ``evaluates``: the job runs
    periodic evaluation (forward-only pipeline steps). ``dp_name``: what the user set dp with (``parallel.dp``, or
    "the world size" for parallel.strategy=fsdp).
    """
    p: list[str] = []
    if schedule not in SCHEDULES:
        p.append(f"parallel.pp_schedule: {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if world_size is not None:
        (pp, dp, tp), deg_problems = resolve_degrees(pp, dp, tp, world_size)
        p += deg_problems
        if deg_problems:  # the rules below need resolved degrees
            return p
    elif any(not isinstance(v, int) or isinstance(v, bool) or (v < 1 and v != -1) for v in (pp, dp, tp)):
        return p + resolve_degrees(pp, dp, tp, 1)[1]
    where = f"(parallel.pp={pp}, parallel.dp={dp}, parallel.tp={tp})"

    if tp > 1:
        for name, value in (("model.n_heads", n_heads), ("model.n_kv_heads", n_kv_heads)):
            if value % tp:
                p.append(
                    f"parallel.tp={tp} does not divide {name}={value}: tensor parallelism gives each tp rank whole "
                    f"attention heads; pick a tp dividing {value}"
                )
        if ffn_dim % tp:
            p.append(f"parallel.tp={tp} does not divide model.ffn_dim={ffn_dim}: the MLP is split column-wise by tp")
        if dim % tp:
            p.append(f"parallel.tp={tp} does not divide model.dim={dim}")
        if seq_len % tp:
            p.append(
                f"parallel.tp={tp} does not divide data.seq_len={seq_len}: sequence parallelism splits each sequence "
                f"into tp equal parts between the blocks; pick data.seq_len as a multiple of {tp}"
            )
        if ranks_per_node is not None and not tp_across_nodes and (tp > ranks_per_node or ranks_per_node % tp):
            p.append(
                f"parallel.tp={tp} does not fit inside one node of {ranks_per_node} ranks: tp groups all-gather and "
                f"reduce-scatter activations in every layer and need NVLink; pick tp dividing {ranks_per_node} (move "
                "the rest to parallel.dp or parallel.pp) or set parallel.tp_across_nodes=true to allow it"
            )

    if schedule in SCHEDULES and pp > 1:
        info = SCHEDULES[schedule]
        spr = stages_per_rank if stages_per_rank is not None else default_stages_per_rank(schedule)
        if spr < 1:
            p.append(f"parallel.pp_stages_per_rank={spr}: must be >= 1")
        elif not info.multi_stage and spr != 1:
            p.append(
                f"parallel.pp_schedule={schedule} runs exactly one stage per rank, but parallel.pp_stages_per_rank="
                f"{spr}; use an interleaved schedule (e.g. Interleaved1F1B) for virtual stages"
            )
        elif info.style == "v" and spr != 2:
            p.append(f"parallel.pp_schedule={schedule} needs parallel.pp_stages_per_rank=2 (a V of two stages)")
        else:
            stages = pp * spr
            if stages > n_layers:
                p.append(
                    f"parallel.pp={pp} x parallel.pp_stages_per_rank={spr} = {stages} pipeline stages but model."
                    f"n_layers={n_layers}: every stage needs at least one transformer block; lower pp or the "
                    "stages per rank"
                )
            if evaluates and not info.forward_only:
                p.append(
                    f"parallel.pp_schedule={schedule} cannot run forward-only steps in this torch version, so "
                    "train.eval_every_steps must be 0; or pick another schedule (e.g. Interleaved1F1B)"
                )
            if tie_embeddings:
                p.append(
                    f"model.tie_embeddings=true with parallel.pp={pp}: the tied embedding and output head live on "
                    "the first and last pipeline stages; untie them (model.tie_embeddings=false) or use pp=1"
                )
            if world_size is not None and micro_batch_size > 0 and global_batch_size % (micro_batch_size * dp) == 0:
                n = global_batch_size // (micro_batch_size * dp)  # micro-batches per step per dp rank
                need = {"any": 1, "pp": pp, "stages": stages}[info.min_microbatches]
                if n < need:
                    unit = f"{stages} stages" if info.min_microbatches == "stages" else f"parallel.pp={pp}"
                    p.append(
                        f"parallel.pp_schedule={schedule} needs at least {need} micro-batches per step ({unit}), "
                        f"but train.global_batch_size={global_batch_size} / (train.micro_batch_size="
                        f"{micro_batch_size} x parallel.dp={dp}) = {n}; raise train.global_batch_size to "
                        f"{need * micro_batch_size * dp} or lower train.micro_batch_size {where}"
                    )
                elif info.rounds and n % max(1, n // pp):
                    p.append(
                        f"parallel.pp_schedule={schedule} runs micro-batches in rounds of parallel.pp={pp}: "
                        f"{n} micro-batches per step must be a multiple of {n} // {pp} = {n // pp}; use a multiple "
                        f"of {pp} micro-batches (train.global_batch_size / (train.micro_batch_size x parallel.dp))"
                    )

    if dp_replicate < 1:
        p.append(f"parallel.fsdp.replicate={dp_replicate}: must be >= 1")
    elif dp_replicate > 1 and dp > 0 and dp % dp_replicate:
        p.append(
            f"parallel.fsdp.replicate ({dp_replicate}) must divide {dp_name} ({dp}): HSDP splits the data-parallel "
            f"ranks into replicate x shard groups; pick a divisor of {dp} (or 1 for plain FSDP)"
        )
    elif dp_replicate > 1 and dp_replicate == dp and pp == 1 and tp == 1:
        # ParallelDims runs this layout as DDP: the parallel.fsdp options would silently not apply
        p.append(
            f"parallel.fsdp.replicate ({dp_replicate}) equals {dp_name} ({dp}): every shard group is one rank, "
            "which is pure replication; use parallel.strategy=ddp, or a smaller parallel.fsdp.replicate"
        )
    return p
