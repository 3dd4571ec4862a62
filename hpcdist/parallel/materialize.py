"""The one materializer: real storage and the single-process initialization for a model parallelized on meta.

Every layout starts from the same weights for the same ``run.seed``, so a DDP run, an FSDP run, a 3d run and one
process are comparable step by step (the equivalence tests rely on it):

* nothing sharded or split (one process, DDP, ZeRO): each rank initializes its whole model in place with the seed
  (every rank draws the same numbers; DDP's constructor broadcast is then a no-op in value);
* sharded (FSDP / HSDP / TP DTensors) or split into pipeline stages: ``init_weights`` on a shard would draw each
  shard's numbers independently, so rank 0 initializes one unsharded copy on the host with the very code and RNG
  sequence of the in-place path, broadcasts it one tensor at a time (the other ranks never hold the whole model)
  and every rank keeps its slice. Cost: one full fp32 model in rank 0's host memory while this runs.

Either way each rank's RNG ends where the in-place path leaves it.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from hpcdist.models.llama import Transformer
from hpcdist.parallel.mesh import clean_fqn

__all__ = ["materialize"]


@torch.no_grad()
def materialize(parts: Sequence[nn.Module], *, reference: Transformer, device: torch.device, seed: int) -> None:
    """Allocate this rank's ``parts`` on ``device`` and give them the single-process init of ``seed``.

    ``reference`` is the unsplit model (names, shapes, dtypes); it may be ``parts[0]`` itself when nothing is split,
    wrapped by activation checkpointing or compile (ZeRO's path): its names are read through ``clean_fqn``.
    Collective when the layout shards or splits (every rank calls it); purely local otherwise.
    """
    if _whole_and_plain(parts, reference):
        _init_in_place(parts[0], device=device, seed=seed)
        return
    for part in parts:
        part.to_empty(device=device)
        # the RoPE buffer; the random draws on shards are discarded (overwritten below, RNG restored)
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
            part.init_weights(buffer_device=device)  # type: ignore[operator]
        part.tie_weights()  # type: ignore[operator]
    mine: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, param in part.named_parameters(remove_duplicate=False):
            mine[clean_fqn(name)] = param

    distributed = dist.is_initialized() and dist.get_world_size() > 1
    is_src = not distributed or dist.get_rank() == 0
    torch.manual_seed(seed)
    full: dict[str, torch.Tensor] = {}
    if is_src:
        with torch.device("meta"):
            ref = Transformer(reference.args)
        ref.to_empty(device="cpu")
        ref.init_weights()  # draws from the RNG just seeded, like the in-place path
        ref.tie_weights()
        full = ref.state_dict()
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
        state = [torch.get_rng_state() if is_src else None]
        dist.broadcast_object_list(state, src=0)
        torch.set_rng_state(cast(torch.Tensor, state[0]))


def _whole_and_plain(parts: Sequence[nn.Module], reference: nn.Module) -> bool:
    """One part holding the whole model in plain tensors: every rank can initialize it alike with no broadcast.
    The same answer on every rank (it depends on the layout only), so the collective branch is taken by all."""
    if len(parts) != 1 or any(isinstance(p, DTensor) for p in parts[0].parameters()):
        return False
    names = {clean_fqn(n) for n, _ in reference.named_parameters()}
    return {clean_fqn(n) for n, _ in parts[0].named_parameters()} == names


def _init_in_place(model: nn.Module, *, device: torch.device, seed: int) -> None:
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=device)  # type: ignore[operator]
    model.tie_weights()  # type: ignore[operator]
