"""Tensor parallelism (Megatron-style) with sequence parallelism, as DTensor ``parallelize_module`` plans.

Per block, on a 1-D "tp" mesh of T ranks:

    residual h (B, S/T, D) Shard(1) --attention_norm (SequenceParallel)--> all-gather seq --> (B, S, D)
      wq, wk, wv  ColwiseParallel   -> each rank holds H/T query and K/T kv heads (whole heads)
      wo          RowwiseParallel   -> partial sums, reduce-scattered back to (B, S/T, D) Shard(1)
    same for the MLP: w1 (gate), w3 (up) colwise, w2 (down) rowwise.

Between blocks the activations stay sequence-sharded, so the norms (and the residual adds) run on S/T tokens and
no rank holds a full (B, S, D) activation outside attention/MLP. The token embedding is split by vocabulary rows
(each rank looks up its rows, then a reduce-scatter yields Shard(1)); the output head is split by vocabulary
columns; with ``loss_parallel`` the logits stay vocabulary-sharded (B, S, V/T) and cross entropy runs on the
shards (``torch.distributed.tensor.parallel.loss_parallel``), so full-vocabulary logits never exist.

The residual stream is kept as a DTensor (``use_local_output=False`` where it is produced) rather than a local
tensor: its shape is then the global one, so the model reads the true sequence length for RoPE also on a
pipeline stage whose input is hidden states, and pipeline stages send/receive it with its placement.

Works on a meta model (nothing allocated): TP runs before FSDP and materialization. Attention needs no change:
it reads local head counts from the projected shapes (see hpcdist.models.llama).
"""

from __future__ import annotations

from typing import cast

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = ["apply_tp", "block_plan"]


def block_plan() -> dict[str, ParallelStyle]:
    """The plan of one TransformerBlock: attention and MLP split by heads / hidden units, norms sequence-parallel."""
    return {
        "attention_norm": SequenceParallel(),
        # x arrives sequence-sharded and is all-gathered once for the three projections; rope is a plain buffer,
        # the document mask (or None) a plain tensor every tp rank computed alike from the same token ids
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None),
            desired_input_layouts=(Replicate(), None, None),
            use_local_output=True,
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool) -> None:
    """Shard ``model`` (a Transformer or a pipeline stage of one: parts may be None, layers a subset) over tp_mesh.

    ``loss_parallel``: the head returns vocabulary-sharded DTensor logits (B, S, V/T); the caller must compute the
    loss (and run its backward) under ``loss_parallel()``. Otherwise the logits are all-gathered to a plain
    (B, S, V) tensor.
    """
    root: dict[str, ParallelStyle] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        # rows = vocabulary: a rank embeds the tokens in its rows (zeros elsewhere); the partial sums are
        # reduce-scattered along the sequence, which is exactly the layout the first block expects
        root["tok_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        )
    if getattr(model, "norm", None) is not None:
        root["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        root["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if root:
        parallelize_module(model, tp_mesh, root)
    for block in cast(nn.ModuleDict, model.layers).values():
        parallelize_module(block, tp_mesh, block_plan())
