"""The layout vocabulary and the (pp, dp, tp) layout rules: pure arithmetic on degrees, the model's shape and the
batch, no process group.

The vocabulary (one owner; config, planner and runtime import it): ``parallel.strategy`` is user input, read only
by :func:`requested_kind` and :func:`strategy_degrees` (the alias functions: the one place its strings are
compared); everything downstream asks the degrees and the ZeRO stage. :class:`LayoutKind` names a layout from
them, :class:`LayoutDegrees` gives every layout record (``ParallelDims``, the planner's ``Layout``) the same
predicates and the one description (:meth:`LayoutDegrees.describe`).

Config validation runs them at load (no world size yet: the rules that need only the degrees and the model) and
again with the job's size (:func:`hpcdist.config.check_world`), before any process starts; every problem names the
degrees, the rule and a fix. :class:`MeshDegrees` names the mesh degrees (the one list of mesh dimensions) and
owns their arithmetic (:meth:`MeshDegrees.resolve`): :class:`hpcdist.parallel.dims.ParallelDims` and the
validation both resolve through it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from enum import Enum
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from hpcdist.config.schema import ParallelConfig

__all__ = [
    "SCHEDULES",
    "STRATEGIES",
    "Degrees",
    "LayoutDegrees",
    "LayoutKind",
    "MeshDegrees",
    "ScheduleInfo",
    "default_stages_per_rank",
    "layout_notes",
    "layout_problems",
    "needs_planner",
    "requested_kind",
    "resolve_degrees",
    "strategy_degrees",
    "strategy_of",
]

# parallel.strategy values this version can run (user input; read only by the alias functions below). Later
# strategies register here when they exist, so a config naming one that is not built yet fails validation instead
# of failing deep inside the trainer.
STRATEGIES: tuple[str, ...] = ("ddp", "fsdp", "zero", "3d", "auto")
_AUTO = "auto"


class LayoutKind(str, Enum):
    """A layout's name, derived from its degrees and ZeRO stage (never read from parallel.strategy): the planner's
    rows, the memory table, the start-up log and the dry run all say these. (``str, Enum`` with ``__str__`` rather
    than 3.11's StrEnum: Python 3.10 is supported.)"""

    DDP = "ddp"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    ZERO3 = "zero3"
    FSDP = "fsdp"
    HSDP = "hsdp"
    THREE_D = "3d"

    def __str__(self) -> str:  # "zero3", as StrEnum prints it (f-strings and format() included, 3.10 to 3.13)
        return str(self.value)

    @classmethod
    def of(cls, *, pp: int, dp: int, tp: int, dp_replicate: int, zero_stage: int) -> LayoutKind:
        """The kind of these degrees: ZeRO by its stage; pp or tp -> 3d; unsharded dp (dp_shard 1) -> ddp (one rank
        included); sharded dp -> hsdp with replicas, else fsdp."""
        if zero_stage:
            return cls.zero(zero_stage)
        if pp > 1 or tp > 1:
            return cls.THREE_D
        if dp // max(dp_replicate, 1) == 1:
            return cls.DDP
        return cls.HSDP if dp_replicate > 1 else cls.FSDP

    @classmethod
    def zero(cls, stage: int) -> LayoutKind:
        return (cls.ZERO1, cls.ZERO2, cls.ZERO3)[stage - 1]

    @classmethod
    def named(cls, name: str, *, zero_stage: int = 0, choices: tuple[LayoutKind, ...] | None = None) -> LayoutKind:
        """A kind from its name, or ``zero`` with ``zero_stage`` 1-3; ValueError naming the choices otherwise."""
        allowed = tuple(cls) if choices is None else choices
        if name == "zero":  # the config's spelling: the stage is a separate key
            if zero_stage not in (1, 2, 3):
                raise ValueError(f"strategy 'zero' needs zero_stage 1, 2 or 3, got {zero_stage}")
            kind = cls.zero(zero_stage)
        elif name not in {k.value for k in allowed}:
            raise ValueError(f"unknown strategy {name!r}: choose one of {', '.join(allowed)}")
        else:
            kind = cls(name)
        if zero_stage not in (0, kind.zero_stage):
            raise ValueError(f"strategy {name!r} contradicts zero_stage={zero_stage}")
        return kind

    @property
    def zero_stage(self) -> int:
        """1-3 for the ZeRO kinds (DeepSpeed partitions by its stage, not by the degrees), else 0."""
        return {LayoutKind.ZERO1: 1, LayoutKind.ZERO2: 2, LayoutKind.ZERO3: 3}.get(self, 0)

    @property
    def fsdp_options_apply(self) -> bool:
        """FSDP2 shards dp under this kind, so the parallel.fsdp.* options are read (fsdp, hsdp, 3d)."""
        return self in (LayoutKind.FSDP, LayoutKind.HSDP, LayoutKind.THREE_D)


@dataclass(frozen=True)
class MeshDegrees:
    """The device-mesh degrees by name, the one list of mesh dimensions: ranks are laid out row-major over the
    fields in this order (outermost first, the last innermost). A new mesh dimension is a field here; the
    arithmetic (:meth:`resolve`), the rank coordinates and the messages follow the fields. ``-1`` in one degree
    fills the ranks the others leave."""

    pp: int = 1
    dp: int = -1
    tp: int = 1

    def named(self) -> dict[str, int]:
        """{dimension name: degree}, outermost first."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def ranks(self) -> int:
        return math.prod(self.named().values())

    def where(self) -> str:
        """``(parallel.pp=2, parallel.dp=4, parallel.tp=1)``: the degrees as a problem message names them."""
        return "(" + ", ".join(f"parallel.{k}={v}" for k, v in self.named().items()) + ")"

    def coords(self, rank: int) -> dict[str, int]:
        """Rank ``rank``'s index along each dimension (row-major: the last dimension varies fastest)."""
        out: dict[str, int] = {}
        for name, degree in reversed(self.named().items()):
            rank, out[name] = divmod(rank, degree)
        return dict(reversed(out.items()))

    def resolve(self, world_size: int) -> tuple[MeshDegrees, list[str]]:
        """Fill a single -1 degree with the ranks left over; return (degrees, problems). Every degree is named."""
        degrees = self.named()
        shown = " x ".join(f"parallel.{k}={v}" for k, v in degrees.items())
        names = " x ".join(degrees)
        problems = [
            f"parallel.{k}={v}: must be a positive integer or -1 (= fill the remaining ranks)"
            for k, v in degrees.items()
            if not isinstance(v, int) or isinstance(v, bool) or (v < 1 and v != -1)
        ]
        if problems:
            return self, problems
        fill = [k for k, v in degrees.items() if v == -1]
        if len(fill) > 1:
            return self, [f"{shown}: at most one degree may be -1 (fill), got {len(fill)}; set the others"]
        fixed = math.prod(v for v in degrees.values() if v != -1)
        if fill:
            if world_size % fixed:
                return self, [
                    f"{shown}: the fixed degrees multiply to {fixed}, which does not divide the world size "
                    f"{world_size}, so parallel.{fill[0]}=-1 cannot fill the rest; pick degrees whose product divides "
                    f"{world_size}"
                ]
            return replace(self, **{fill[0]: world_size // fixed}), []
        if fixed != world_size:
            return self, [
                f"{shown} = {fixed} ranks, but the world size is {world_size}: {names} must equal the world size; "
                f"set one degree to -1 to fill the rest, e.g. parallel.dp=-1"
            ]
        return self, []


class Degrees(NamedTuple):
    """``parallel.strategy`` as degrees: (pp, dp, tp, dp_replicate, zero_stage); -1 still unresolved."""

    pp: int
    dp: int
    tp: int
    dp_replicate: int
    zero_stage: int

    @property
    def mesh(self) -> MeshDegrees:
        return MeshDegrees(pp=self.pp, dp=self.dp, tp=self.tp)


def needs_planner(strategy: str) -> bool:
    """``parallel.strategy=auto``: the planner picks the layout when the job knows its world size."""
    return strategy == _AUTO


def requested_kind(par: ParallelConfig) -> LayoutKind | None:
    """The kind ``parallel.strategy`` asks for before the world size is known; None for auto (and for a value
    validation refuses). 3d means "the configured degrees" here, whatever kind they turn out to be."""
    match par.strategy:
        case "ddp":
            return LayoutKind.DDP
        case "fsdp":
            return LayoutKind.HSDP if par.fsdp.replicate > 1 else LayoutKind.FSDP
        case "zero":
            return LayoutKind.zero(par.zero.stage) if par.zero.stage in (1, 2, 3) else None
        case "3d":
            return LayoutKind.THREE_D
    return None


def strategy_of(kind: LayoutKind) -> str:
    """The ``parallel.strategy`` value that runs ``kind`` (the inverse alias; the planner writes it)."""
    if kind.zero_stage:
        return "zero"
    return {LayoutKind.THREE_D: "3d", LayoutKind.DDP: "ddp"}.get(kind, "fsdp")


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


def strategy_degrees(par: ParallelConfig, world_size: int) -> Degrees:
    """``parallel.strategy`` as degrees: the one place the user-facing alias becomes a layout. ddp = dp over all
    ranks, all replicas (dp_shard 1); fsdp = dp over all ranks, sharded (HSDP: ``parallel.fsdp.replicate`` groups);
    3d = the configured degrees (-1 still unresolved); zero = dp over all ranks at ``parallel.zero.stage``
    (DeepSpeed partitions by its own stage, not by these degrees). ValueError for auto (the planner resolves it
    first) and for a value validation refuses."""
    kind = requested_kind(par)
    if kind is None:
        raise ValueError(
            f"parallel.strategy={par.strategy!r} has no degrees: auto is resolved by the planner first, and "
            f"validation refuses any other value (or parallel.zero.stage={par.zero.stage} outside 1-3)"
        )
    if kind is LayoutKind.THREE_D:
        return Degrees(par.pp, par.dp, par.tp, par.fsdp.replicate, 0)
    if kind is LayoutKind.DDP:
        return Degrees(1, world_size, 1, world_size, 0)
    if kind.zero_stage:
        return Degrees(1, world_size, 1, 1, kind.zero_stage)
    return Degrees(1, world_size, 1, par.fsdp.replicate, 0)


class LayoutDegrees:
    """What every layout record (``ParallelDims``, the planner's ``Layout``) derives from its degrees and ZeRO
    stage: the predicates, the kind and the one description. Subclasses are dataclasses holding the fields."""

    pp: int
    dp: int
    tp: int
    dp_replicate: int
    zero_stage: int

    @property
    def dp_shard(self) -> int:
        """Ranks one copy of the model states is spread over: 1 for ddp, dp for zero / fsdp / 3d, G for hsdp."""
        return self.dp // self.dp_replicate

    @property
    def mesh(self) -> MeshDegrees:
        """The mesh degrees by name."""
        return MeshDegrees(pp=self.pp, dp=self.dp, tp=self.tp)

    @property
    def ranks(self) -> int:
        return self.mesh.ranks

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def zero_enabled(self) -> bool:
        """DeepSpeed ZeRO over every rank (pp = tp = 1): its engine, not these degrees, partitions the states."""
        return self.zero_stage > 0

    @property
    def ddp_enabled(self) -> bool:
        """Pure replication (dp_shard 1, no pp/tp): torch DDP all-reduces buckets, cheaper than FSDP over size-1
        shards. With pp or tp, replicas stay FSDP2 units over a (dp, 1) mesh (DDP does not take DTensors)."""
        return self.dp > 1 and self.dp_shard == 1 and not (self.pp_enabled or self.tp_enabled or self.zero_enabled)

    @property
    def hsdp_enabled(self) -> bool:
        """FSDP2 on the 2-D (dp_replicate, dp_shard) mesh; pure replication without pp/tp is DDP instead."""
        return self.dp_replicate > 1 and not self.ddp_enabled and not self.zero_enabled

    @property
    def fsdp_enabled(self) -> bool:
        """dp > 1 handled by FSDP2 (sharded, HSDP, or replicas next to pp/tp)."""
        return self.dp_enabled and not self.ddp_enabled and not self.zero_enabled

    @property
    def needs_mesh(self) -> bool:
        """Whether the layout uses a DeviceMesh at all (ddp, zero and one rank do not: no sub-groups to create)."""
        return self.fsdp_enabled or self.pp_enabled or self.tp_enabled

    @property
    def kind(self) -> LayoutKind:
        return LayoutKind.of(
            pp=self.pp, dp=self.dp, tp=self.tp, dp_replicate=self.dp_replicate, zero_stage=self.zero_stage
        )

    def describe(self, *notes: str) -> str:
        """The one description of a layout: ``ddp x 4 ranks``, ``fsdp x 8 ranks``, ``hsdp 2 x 4`` (replicas x
        shard), ``zero3 x 4 ranks``, ``3d pp2 x dp2 (hsdp 2 x 1) x tp2``; ``notes`` follow, comma-separated (the
        config's options: :func:`layout_notes`; the planner's micro-batch)."""
        kind, n = self.kind, self.ranks
        ranks = f"{n} rank{'' if n == 1 else 's'}"
        if kind is LayoutKind.THREE_D:
            hsdp = f" (hsdp {self.dp_replicate} x {self.dp_shard})" if self.hsdp_enabled else ""
            text = f"3d pp{self.pp} x dp{self.dp}{hsdp} x tp{self.tp}"
        elif kind is LayoutKind.HSDP:
            text = f"hsdp {self.dp_replicate} x {self.dp_shard}"
        else:
            text = f"{kind} x {ranks}"
        return ", ".join((text, *notes))


def layout_notes(par: ParallelConfig, dims: LayoutDegrees) -> list[str]:
    """What the config adds to a layout's description: offload (ZeRO, FSDP) and the pipeline schedule."""
    if dims.zero_enabled:
        z = par.zero
        offload = [what for what, on in (("optimizer", z.offload_optimizer), ("params", z.offload_params)) if on]
        return [f"offload {' and '.join(offload)}"] if offload else []
    notes = ["cpu offload"] if dims.fsdp_enabled and par.fsdp.cpu_offload else []
    if dims.pp_enabled:
        per_rank = par.pp_stages_per_rank
        per_rank = default_stages_per_rank(par.pp_schedule) if per_rank is None else per_rank
        notes += [par.pp_schedule, f"{dims.pp * per_rank} stages"]
    return notes


def resolve_degrees(pp: int, dp: int, tp: int, world_size: int) -> tuple[MeshDegrees, list[str]]:
    """:meth:`MeshDegrees.resolve` of loose degrees (config values not yet known to be integers)."""
    return MeshDegrees(pp=pp, dp=dp, tp=tp).resolve(world_size)


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
    mesh = MeshDegrees(pp=pp, dp=dp, tp=tp)
    if world_size is not None:
        mesh, deg_problems = mesh.resolve(world_size)
        p += deg_problems
        if deg_problems:  # the rules below need resolved degrees
            return p
    elif any(not isinstance(v, int) or isinstance(v, bool) or (v < 1 and v != -1) for v in mesh.named().values()):
        return p + mesh.resolve(1)[1]
    pp, dp, tp = mesh.pp, mesh.dp, mesh.tp
    where = mesh.where()

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
