"""The one materializer: real storage and the single-process initialization for a model parallelized on meta.

Every layout starts from the same weights for the same ``run.seed`` on any device, so one process, a DDP run, a ZeRO
run, an FSDP run and a 3d run are comparable step by step (the equivalence tests rely on it): the weights are drawn
once, on the host, from the CPU generator seeded with ``run.seed`` (one unsharded copy, built with the model's own
``init_weights``), never on the device. A device's generator is another stream of numbers (CUDA's Philox is not the
CPU's Mersenne Twister), and ``init_weights`` on a shard would draw each shard's numbers independently.

Rank 0 draws; the copy reaches every rank one tensor at a time (a broadcast on the rank's device; the other ranks
never hold the whole model on the host) and every rank keeps what it holds of it: the whole tensor (one process,
DDP, ZeRO before DeepSpeed partitions it) or its slice (FSDP / HSDP / TP DTensors, pipeline stages). Cost: one full
fp32 model in rank 0's host memory while this runs, and one broadcast of the model (DDP's constructor broadcast is
then a no-op in value). Each rank's CPU RNG ends where drawing the copy left rank 0's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from hpcdist.models.llama import Transformer
from hpcdist.parallel.mesh import clean_fqn

__all__ = ["materialize"]


@torch.no_grad()
def materialize(
    parts: Sequence[nn.Module],
    *,
    reference: Transformer,
    device: torch.device,
    seed: int,
    param_device: torch.device | None = None,
) -> None:
    """Allocate this rank's ``parts`` on ``device`` and give them the single-process init of ``seed``.

    ``reference`` is the unsplit model (names, shapes, dtypes); it may be ``parts[0]`` itself when nothing is split,
    wrapped by activation checkpointing or compile (ZeRO's path): its names are read through ``clean_fqn``.
    ``param_device``: where the parameters live when not on ``device``: the host under FSDP2's CPU offload. FSDP2
    keeps a parameter's DTensor and only swaps its local tensor to the host, so parameters allocated on the GPU
    would still say ``cuda`` while their data and gradients are on the host (the first gradient is then refused:
    "attempting to assign a gradient with device type 'cpu' to a tensor with device type 'cuda'").
    Collective when a process group of several ranks exists (every rank calls it).
    """
    for part in parts:
        part.to_empty(device=param_device or device)
        part.init_buffers(device)  # type: ignore[operator]  # the RoPE table: computed, not drawn
        part.tie_weights()  # type: ignore[operator]
    mine: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, param in part.named_parameters(remove_duplicate=False):
            mine[clean_fqn(name)] = param

    distributed = dist.is_initialized() and dist.get_world_size() > 1
    is_src = not distributed or dist.get_rank() == 0
    full = _initial_weights(reference, seed) if is_src else {}
    for wrapped, meta in reference.state_dict().items():
        # torch.compile's wrapper keeps its '_orig_mod.' component in state_dict keys (checkpoint_wrapper drops its own)
        name = clean_fqn(wrapped)
        if distributed:
            value = full[name].to(device) if is_src else torch.empty(meta.shape, dtype=meta.dtype, device=device)
            dist.broadcast(value, src=0)
        else:
            value = full[name]
        p = mine.get(name)
        if p is None:
            continue
        if isinstance(p, DTensor):
            # every rank has the full value: slice locally (src_data_rank=None: no communication)
            local = distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None).to_local()
            p.to_local().copy_(local)
        else:
            p.copy_(value)
    if distributed:
        # the generator's state is a fixed-size byte tensor: one broadcast on the rank's device, no pickling
        state = torch.get_rng_state().to(device)
        dist.broadcast(state, src=0)
        torch.set_rng_state(state.cpu())


def _initial_weights(reference: Transformer, seed: int) -> dict[str, torch.Tensor]:
    """The unsharded model's initial weights for ``seed``, on the host: what every layout starts from."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        ref = Transformer(reference.args)
    ref.to_empty(device="cpu")
    ref.tie_weights()
    ref.init_weights()  # draws from the CPU generator just seeded, in the model's fixed order
    return ref.state_dict()
