"""ParallelDims: the single truth for the (pp, dp, tp) degrees of a job, their validation and their meshes.

Rank layout: ranks are laid out row-major over ("pp", "dp", "tp"), so ``tp`` is the innermost (fastest varying)
dimension. With 8 ranks per node, consecutive ranks share a node, so a tp group of <= 8 ranks maps to GPUs of
one node and its per-layer activation all-gathers / reduce-scatters run over NVLink; dp crosses nodes next
(FSDP's per-block parameter all-gathers and gradient reduce-scatters, overlapped with compute) and pp outermost
(point-to-point activations between neighbouring stages only, the lightest traffic to send over InfiniBand).
With HSDP, dp itself is split into ("dp_replicate", "dp_shard"), dp_shard inner.

This module is import-light (no process group, no model): the trainer computes its data-parallel coordinate with
``dp_rank`` arithmetic. The layout rules config validation runs before any process group exists
(``layout_problems``, ``resolve_degrees``) live in :mod:`hpcdist.config.layout` and are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

# The layout rules are pure arithmetic on config values, so they live with the config (which must not import this
# package); re-exported here as the layout vocabulary's other half.
from hpcdist.config.layout import (
    SCHEDULES,
    ScheduleInfo,
    default_stages_per_rank,
    layout_problems,
    resolve_degrees,
    strategy_degrees,
)

if TYPE_CHECKING:
    from hpcdist.config import JobConfig

__all__ = [
    "SCHEDULES",
    "ParallelDims",
    "ScheduleInfo",
    "default_stages_per_rank",
    "layout_problems",
    "parallel_dims",
    "resolve_degrees",
    "strategy_degrees",
]


@dataclass
class ParallelDims:
    """Degrees of pipeline (pp), data (dp) and tensor (tp) parallelism; ``-1`` in one of them fills the rest.

    Constructing it resolves -1 and checks pp x dp x tp == world_size (ValueError naming every degree). Model- and
    batch-dependent rules live in ``layout_problems`` (config validation runs them before any process group).
    """

    pp: int = 1
    dp: int = -1
    tp: int = 1
    world_size: int = 1
    dp_replicate: int = 1
    """HSDP: dp = dp_replicate x dp_shard; parameters are sharded over dp_shard and replicated over dp_replicate."""
    _meshes: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        (self.pp, self.dp, self.tp), problems = resolve_degrees(self.pp, self.dp, self.tp, self.world_size)
        if not problems and (self.dp_replicate < 1 or self.dp % self.dp_replicate):
            problems.append(
                f"parallel.fsdp.replicate={self.dp_replicate} must divide parallel.dp={self.dp} (HSDP: dp = "
                "replicate x shard)"
            )
        if problems:
            raise ValueError("invalid parallel layout:\n  - " + "\n  - ".join(problems))

    # ------------------------------------------------------------------------------------------ degrees
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
    def hsdp_enabled(self) -> bool:
        """FSDP2 on the 2-D (dp_replicate, dp_shard) mesh; pure replication without pp/tp is DDP instead."""
        return self.dp_replicate > 1 and not self.ddp_enabled

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    @property
    def ddp_enabled(self) -> bool:
        """Pure replication (dp_shard 1, no pp/tp): torch DDP all-reduces buckets, cheaper than FSDP over size-1
        shards. With pp or tp, replicas stay FSDP2 units over a (dp, 1) mesh (DDP does not take DTensors)."""
        return self.dp > 1 and self.dp_shard == 1 and not (self.pp_enabled or self.tp_enabled)

    @property
    def fsdp_enabled(self) -> bool:
        """dp > 1 handled by FSDP2 (sharded, HSDP, or replicas next to pp/tp)."""
        return self.dp_enabled and not self.ddp_enabled

    @property
    def needs_mesh(self) -> bool:
        """Whether the layout uses a DeviceMesh at all (ddp and one rank do not: no sub-groups to create)."""
        return self.fsdp_enabled or self.pp_enabled or self.tp_enabled

    # ------------------------------------------------------------------------------------------ coordinates
    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each dimension (row-major over pp, dp, tp; tp innermost)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size})")
        return {"pp": rank // (self.dp * self.tp), "dp": (rank // self.tp) % self.dp, "tp": rank % self.tp}

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
            world = init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=("pp", "dp", "tp"))
            self._meshes = {
                "world": world,
                "pp": world["pp"],
                "dp": world["dp"],
                "dp_tp": world["dp", "tp"]._flatten("dp_tp"),
                "fsdp": world["dp"],
                "tp": world["tp"],
            }
        return self._meshes

    def describe(self) -> str:
        hsdp = f" (HSDP {self.dp_replicate} x {self.dp_shard})" if self.hsdp_enabled else ""
        return f"pp={self.pp} x dp={self.dp}{hsdp} x tp={self.tp} = {self.world_size} ranks"


def parallel_dims(cfg: JobConfig, world_size: int) -> ParallelDims:
    """The job's layout: ``parallel.strategy`` turned into degrees (:func:`strategy_degrees`), resolved and checked."""
    par = cfg.parallel
    pp, dp, tp, replicate = strategy_degrees(
        par.strategy, pp=par.pp, dp=par.dp, tp=par.tp, replicate=par.fsdp.replicate, world_size=world_size
    )
    return ParallelDims(pp=pp, dp=dp, tp=tp, world_size=world_size, dp_replicate=replicate)
