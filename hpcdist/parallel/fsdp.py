"""Fully sharded data parallelism with torch FSDP2 (``fully_shard``), and HSDP on a 2-D mesh.

Every rank holds 1/shard of each parameter, gradient and optimizer state. Each transformer block is its own
FSDP unit: its parameters are all-gathered just before its forward (and again before its backward when
resharded after forward), and its gradients are reduce-scattered right after its backward, so at most a
couple of blocks are ever unsharded at once. The root unit holds what is left (embeddings, final norm, head).

HSDP (``parallel.fsdp.replicate > 1``): mesh ("replicate", "shard"); parameters are sharded within a group of
``shard`` ranks (one node, say) and replicated across the ``replicate`` groups; gradients are reduce-scattered
inside a group, then all-reduced across groups.

FSDP2 does not wrap the model: ``fully_shard`` turns parameters into DTensors in place and keeps every FQN, so
``get_state_dict`` names checkpoint entries exactly as the unsharded model does (DDP checkpoints load here).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from hpcdist.models.llama import Transformer
from hpcdist.parallel.base import Strategy


def fsdp_mesh(device_type: str, world_size: int, *, replicate: int) -> DeviceMesh:
    """1-D ("shard",) mesh over all ranks, or the 2-D ("replicate", "shard") mesh of HSDP when replicate > 1."""
    if not dist.is_initialized():
        raise ValueError("parallel.strategy=fsdp needs a multi-rank process group (torchrun or srun); use ddp")
    if replicate < 1 or world_size % replicate:
        raise ValueError(
            f"parallel.fsdp.replicate ({replicate}) must divide the world size ({world_size}): HSDP needs "
            f"replicate x shard == world size, e.g. parallel.fsdp.replicate=1 (plain FSDP)"
        )
    if replicate == 1:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    shard = world_size // replicate
    return init_device_mesh(device_type, (replicate, shard), mesh_dim_names=("replicate", "shard"))


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
    cpu_offload: bool,
) -> None:
    """Shard each block of ``model.layers``, then the root. Works on a meta model (nothing is allocated)."""
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        # compute (forward/backward) in param_dtype; gradients reduced in reduce_dtype; the sharded master
        # parameters and the optimizer state stay fp32 either way
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
    }
    if cpu_offload:
        # sharded parameters, gradients and optimizer state live in host memory; the optimizer steps on CPU
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # the last block's backward starts right after its forward: resharding it would only re-gather it
        fully_shard(block, reshard_after_forward=reshard_after_forward and i < len(blocks) - 1, **kwargs)
    # root: embeddings, final norm, output head (tied weights stay one parameter: both live in this unit).
    # FSDP2 keeps the root unsharded after forward regardless, as backward starts with it.
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)


@torch.no_grad()
def materialize_sharded(model: nn.Module, *, device: torch.device, seed: int) -> None:
    """Allocate the local shards of a sharded meta model and give it exactly the single-process init.

    ``init_weights`` on DTensor shards would draw each shard's random numbers independently (on CPU every rank
    draws the same first numbers for its own slice), so the full weights would differ from a DDP or
    one-process run with the same seed. Rank 0 therefore initializes one unsharded copy (the very same code
    and RNG sequence as ``parallelize.materialize``) and its values are broadcast into the shards.
    Cost: one full fp32 model in rank 0's host memory while this runs.
    """
    model.to_empty(device=device)
    # buffers (RoPE table) and deterministic parts; its random draws on shards are discarded just below
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        model.init_weights(buffer_device=device)
    torch.manual_seed(seed)
    full: dict[str, torch.Tensor] = {}
    if dist.get_rank() == 0:
        assert isinstance(model, Transformer), "materialize_sharded needs the hpcdist Transformer"
        with torch.device("meta"):
            reference = Transformer(model.args)
        reference.to_empty(device="cpu")
        reference.init_weights()  # draws from the RNG just seeded, like the unsharded path
        reference.tie_weights()
        full = reference.state_dict()
    # every rank ends with the RNG where the unsharded path leaves it (rank 0 just drew from it)
    state = torch.get_rng_state()
    obj = [state if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    torch.set_rng_state(obj[0])
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


class FSDPStrategy(Strategy):
    """``model`` is the sharded model itself: FSDP2 adds no wrapper, so ``module`` is the same object."""

    def __init__(self, model: nn.Module, *, mesh: DeviceMesh, **kwargs: Any):
        super().__init__(**kwargs)
        assert isinstance(model, FSDPModule), "apply_fsdp must run before FSDPStrategy"
        self.model = self.module = model
        self.mesh = mesh

    def replica_group(self) -> dist.ProcessGroup | None:
        # only HSDP has replicas: the ranks holding the same shard index across the replicate dimension
        if self.mesh.mesh_dim_names and "replicate" in self.mesh.mesh_dim_names:
            return self.mesh.get_group("replicate")
        return None

    def has_replicas(self) -> bool:
        return self.mesh.ndim == 2 and super().has_replicas()

    def _sync_context(self, is_last: bool) -> contextlib.AbstractContextManager[Any]:
        # gradient accumulation: non-final micro-batches keep unsharded gradients locally (no reduce-scatter,
        # no HSDP all-reduce); the last one reduces the accumulated sum
        self.model.set_requires_gradient_sync(is_last)  # type: ignore[operator]
        return contextlib.nullcontext()
