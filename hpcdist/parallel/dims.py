"""ParallelDims: the single truth for the (pp, dp, tp) degrees and ZeRO stage of a job, their validation and meshes.

Rank layout: ranks are laid out row-major over ("pp", "dp", "tp"), so ``tp`` is the innermost (fastest varying)
dimension. With 8 ranks per node, consecutive ranks share a node, so a tp group of <= 8 ranks maps to GPUs of
one node and its per-layer activation all-gathers / reduce-scatters run over NVLink; dp crosses nodes next
(FSDP's per-block parameter all-gathers and gradient reduce-scatters, overlapped with compute) and pp outermost
(point-to-point activations between neighbouring stages only, the lightest traffic to send over InfiniBand).
With HSDP, dp itself is split into ("dp_replicate", "dp_shard"), dp_shard inner.

This module is import-light (no process group, no model): the trainer computes its data-parallel coordinate with
``dp_rank`` arithmetic. The layout vocabulary (``LayoutKind``; the kind, ``*_enabled`` predicates and the one
description of ``LayoutDegrees``, which ParallelDims and the planner's Layout share) and the layout rules config
validation runs before any process group exists (``layout_problems``, ``resolve_degrees``) live in
:mod:`hpcdist.config.layout` (torch-free, importable by config and planning) and are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

# The layout rules are pure arithmetic on config values, so they live with the config (which must not import this
# package); re-exported here as the layout vocabulary's other half.
from hpcdist.config.layout import (
    SCHEDULES,
    LayoutDegrees,
    LayoutKind,
    MeshDegrees,
    ScheduleInfo,
    default_stages_per_rank,
    layout_notes,
    layout_problems,
    resolve_degrees,
    strategy_degrees,
)

if TYPE_CHECKING:
    from hpcdist.config import JobConfig

__all__ = [
    "SCHEDULES",
    "LayoutDegrees",
    "LayoutKind",
    "MeshDegrees",
    "ParallelDims",
    "ScheduleInfo",
    "default_stages_per_rank",
    "describe_layout",
    "layout_problems",
    "parallel_dims",
    "resolve_degrees",
    "strategy_degrees",
]


@dataclass
class ParallelDims(LayoutDegrees):
    """Degrees of pipeline (pp), data (dp) and tensor (tp) parallelism, and the ZeRO stage; ``-1`` in one degree
    fills the rest. Its kind, predicates (``*_enabled``) and description come from :class:`LayoutDegrees`.

    Constructing it resolves -1 and checks pp x dp x tp == world_size (ValueError naming every degree). Model- and
    batch-dependent rules live in ``layout_problems`` (config validation runs them before any process group).
    """

    pp: int = 1
    dp: int = -1
    tp: int = 1
    world_size: int = 1
    dp_replicate: int = 1
    """HSDP: dp = dp_replicate x dp_shard; parameters are sharded over dp_shard and replicated over dp_replicate."""
    zero_stage: int = 0
    """1-3: DeepSpeed ZeRO over every rank (pp = tp = 1, dp = world, no mesh); 0: not ZeRO."""
    _meshes: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        mesh, problems = self.mesh.resolve(self.world_size)
        self.pp, self.dp, self.tp = mesh.pp, mesh.dp, mesh.tp
        if not problems and (self.dp_replicate < 1 or self.dp % self.dp_replicate):
            problems.append(
                f"parallel.fsdp.replicate={self.dp_replicate} must divide parallel.dp={self.dp} (HSDP: dp = "
                "replicate x shard)"
            )
        if self.zero_stage not in (0, 1, 2, 3):
            problems.append(f"parallel.zero.stage={self.zero_stage}: must be 1, 2 or 3")
        elif self.zero_stage and (self.pp, self.tp, self.dp_replicate) != (1, 1, 1):
            problems.append("ZeRO runs over every rank as pure data parallelism: pp, tp and replicate must be 1")
        if problems:
            raise ValueError("invalid parallel layout:\n  - " + "\n  - ".join(problems))

    # ------------------------------------------------------------------------------------------ coordinates
    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each dimension (row-major over pp, dp, tp; tp innermost)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size})")
        return self.mesh.coords(rank)

    def dp_rank(self, rank: int) -> int:
        """Which slice of the global batch this rank reads: tp and pp peers of one dp replica read the same one."""
        return self.coords(rank)["dp"]

    # ------------------------------------------------------------------------------------------ meshes
    def build_meshes(self, device_type: str) -> dict[str, Any]:
        """Named device meshes, created once (every rank must call this, in the same order, the first time).

        Keys: "world" (the root mesh), "pp", "dp", "tp", "fsdp" (what FSDP shards over: "dp", or the 2-D
        ("dp_replicate", "dp_shard") mesh of HSDP), "dp_tp" (dp and tp flattened: DTensor reduces a norm that is
        partial over both in one all-reduce instead of two) and for HSDP "dp_replicate", "dp_shard". Size-1
        dimensions are kept so every key always exists (e.g. the dp group for the loss mean when dp == 1).
        """
        if self._meshes:
            return self._meshes
        from torch.distributed.device_mesh import init_device_mesh  # keep this module import-light

        if self.hsdp_enabled:
            names = ("pp", "dp_replicate", "dp_shard", "tp")
            world = init_device_mesh(
                device_type, (self.pp, self.dp_replicate, self.dp_shard, self.tp), mesh_dim_names=names
            )
            # one flattened "dp" group for the loss mean and the data coordinate; FSDP gets the 2-D sub-mesh
            dp_mesh = world["dp_replicate", "dp_shard"]._flatten("dp")
            self._meshes = {
                "world": world,
                "pp": world["pp"],
                "dp": dp_mesh,
                # gradient-norm reductions over every shard of a stage run as one all-reduce on this group
                "dp_tp": world["dp_replicate", "dp_shard", "tp"]._flatten("dp_tp"),
                "fsdp": world["dp_replicate", "dp_shard"],
                "dp_replicate": world["dp_replicate"],
                "dp_shard": world["dp_shard"],
                "tp": world["tp"],
            }
        else:
            degrees = self.mesh.named()
            world = init_device_mesh(device_type, tuple(degrees.values()), mesh_dim_names=tuple(degrees))
            self._meshes = {
                "world": world,
                "pp": world["pp"],
                "dp": world["dp"],
                "dp_tp": world["dp", "tp"]._flatten("dp_tp"),
                "fsdp": world["dp"],
                "tp": world["tp"],
            }
        return self._meshes


def parallel_dims(cfg: JobConfig, world_size: int) -> ParallelDims:
    """The job's layout: ``parallel.strategy`` turned into degrees (:func:`strategy_degrees`), resolved and checked."""
    d = strategy_degrees(cfg.parallel, world_size)
    return ParallelDims(
        pp=d.pp, dp=d.dp, tp=d.tp, world_size=world_size, dp_replicate=d.dp_replicate, zero_stage=d.zero_stage
    )


def describe_layout(cfg: JobConfig, dims: ParallelDims) -> str:
    """The layout ``build_strategy`` builds, for the start-up log and the dry run: :meth:`LayoutDegrees.describe`
    of the job's degrees plus the config's notes (``zero3 x 4 ranks, offload optimizer``, ``3d pp2 x dp2 x tp2,
    Interleaved1F1B, 4 stages``). Pure: the config (strategy already resolved from auto) and its ``parallel_dims``."""
    return dims.describe(*layout_notes(cfg.parallel, dims))
