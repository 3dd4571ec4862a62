"""``apply_fsdp``: fully sharded data parallelism with torch FSDP2 (``fully_shard``), and HSDP on a 2-D mesh.

Every rank holds 1/shard of each parameter, gradient and optimizer state. Each transformer block is its own
FSDP unit: its parameters are all-gathered just before its forward (and again before its backward when
resharded after forward), and its gradients are reduce-scattered right after its backward, so at most a
couple of blocks are ever unsharded at once. The root unit holds what is left (embeddings, final norm, head).

HSDP (``parallel.fsdp.replicate > 1``): mesh ("dp_replicate", "dp_shard"); parameters are sharded within a group of
``shard`` ranks (one node, say) and replicated across the ``replicate`` groups; gradients are reduce-scattered
inside a group, then all-reduced across groups.

FSDP2 does not wrap the model: ``fully_shard`` turns parameters into DTensors in place and keeps every FQN, so
``get_state_dict`` names checkpoint entries exactly as the unsharded model does (DDP checkpoints load here).
``parallelize`` applies it on the ParallelDims mesh ("fsdp"); ``mesh.MeshStrategy`` runs the result.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard


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
