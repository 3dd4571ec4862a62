"""Pipeline parallelism: split the model into stages by cost, and build a torch.distributed.pipelining schedule.

A stage is a copy of the (meta) Transformer with the blocks of other stages deleted from ``layers`` and
``tok_embeddings`` / ``norm`` / ``output`` set to None where they do not belong, so every parameter keeps its
FQN (checkpoints need no renaming and load into any layout). With V virtual stages per rank (interleaved
schedules) a rank holds V such copies, e.g. pp=2, V=2, 8 layers: rank 0 holds stages 0 and 2 (layers 0-1 and
4-5), rank 1 stages 1 and 3.

Micro-batches: a step's per-dp-rank batch (global_batch_size / dp samples) is cut into micro_batch_size pieces,
n = global_batch_size / (micro_batch_size x dp); with pp > 1 all n go through the schedule in one ``step()``
(they are the pipeline's micro-batches; there is no separate accumulation loop). The loss of each micro-batch is
its mean and the schedule divides gradients by n (``scale_grads``), so the gradient is the batch mean exactly as
in the data-parallel path.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    _PipelineSchedule,
    get_schedule_class,
)

from hpcdist.models.args import ModelArgs
from hpcdist.models.llama import Transformer
from hpcdist.parallel.dims import SCHEDULES, default_stages_per_rank

__all__ = [
    "build_schedule",
    "part_costs",
    "split_layers",
    "split_model",
    "stage_ids",
]


def part_costs(args: ModelArgs, seq_len: int) -> tuple[float, float]:
    """(embedding, head) cost in units of one transformer block, for balancing stages.

    Head (final norm + output projection): its training FLOPs per token relative to a block's, since compute
    is what stalls a pipeline. Embedding: a lookup costs no FLOPs, but its V x D table plus gradients and Adam
    moments weigh on the first stage, which under 1F1B also keeps the most micro-batches in flight; it is
    weighted by its parameter count relative to a block's.
    """
    d, hd, kv = args.dim, args.head_dim, args.kv_heads
    block_params = d * args.n_heads * hd * 2 + 2 * d * kv * hd + 3 * d * args.ffn_dim
    block_flops = 6 * block_params + 12 * d * seq_len  # PaLM convention, as models.args.flops_per_token
    head_flops = 6 * d * args.vocab_size
    return args.vocab_size * d / block_params, head_flops / block_flops


def split_layers(n_layers: int, n_stages: int, *, first_cost: float = 0.0, last_cost: float = 0.0) -> list[list[int]]:
    """Contiguous layer ranges for ``n_stages`` stages (each >= 1 layer) minimizing the most expensive stage.

    A block costs 1; the first stage also pays ``first_cost`` (embedding) and the last ``last_cost`` (head).
    Exact (dynamic programming over split points, O(stages x layers^2): trivial for real depths). Ties go to
    the split that gives earlier stages more layers, so plain models split evenly front-loaded.
    """
    if not 1 <= n_stages <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {n_stages} stages (each needs at least one layer)")

    def cost(stage: int, lo: int, hi: int) -> float:
        return (hi - lo) + (first_cost if stage == 0 else 0.0) + (last_cost if stage == n_stages - 1 else 0.0)

    inf = float("inf")
    # best[s][i]: minimal max cost placing layers [0, i) on stages [0, s); cut[s][i]: where stage s - 1 starts
    best = [[inf] * (n_layers + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n_layers + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for i in range(s, n_layers - (n_stages - s) + 1):
            for j in range(i - 1, s - 2, -1):  # stage s - 1 holds [j, i); larger stages first on ties
                value = max(best[s - 1][j], cost(s - 1, j, i))
                if value < best[s][i] - 1e-12:
                    best[s][i], cut[s][i] = value, j
    bounds, i = [], n_layers
    for s in range(n_stages, 0, -1):
        bounds.append((cut[s][i], i))
        i = cut[s][i]
    return [list(range(lo, hi)) for lo, hi in reversed(bounds)]


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int, *, style: str) -> list[int]:
    """Stages held by pipeline rank ``pp_rank``: "loop" = r, r + pp, ...; "v" = r and 2 pp - 1 - r."""
    if style == "v":
        if stages_per_rank != 2:
            raise ValueError(f"V-shaped schedules hold exactly 2 stages per rank, got {stages_per_rank}")
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(stages_per_rank)]


def split_model(model: Transformer, layers: list[int], *, first: bool, last: bool) -> Transformer:
    """A stage: a deep copy of ``model`` (meta: no memory) keeping only ``layers`` and the parts it owns."""
    stage = copy.deepcopy(model)
    keep = {str(i) for i in layers}
    for name in [n for n in stage.layers if n not in keep]:
        del stage.layers[name]
    if not first:
        stage.tok_embeddings = None
    if not last:
        stage.norm = None
        stage.output = None
    return stage


def schedule_stages_per_rank(schedule: str, stages_per_rank: int | None) -> int:
    return stages_per_rank if stages_per_rank is not None else default_stages_per_rank(schedule)


def build_schedule(
    parts: Sequence[nn.Module],
    ids: list[int],
    *,
    num_stages: int,
    schedule: str,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
    pp_group: dist.ProcessGroup,
    get_mesh: Callable[..., Any] | None,
) -> _PipelineSchedule:
    """Wrap this rank's stage modules in PipelineStages and build the named schedule over them.

    Stage metadata (activation shapes, dtypes, DTensor placements) is inferred on the first step, so the same
    code serves fp32/bf16, TP (sequence-sharded DTensor activations, rebuilt on the receiving side from the mesh
    that ``get_mesh`` returns) and any micro-batch size.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"parallel.pp_schedule: {schedule!r} is not one of {', '.join(SCHEDULES)}")
    stages = [
        PipelineStage(part, stage_index=sid, num_stages=num_stages, device=device, group=pp_group, get_mesh=get_mesh)
        for part, sid in zip(parts, ids, strict=True)
    ]
    cls = get_schedule_class(schedule)
    if issubclass(cls, PipelineScheduleSingle):
        assert len(stages) == 1, f"{schedule} runs one stage per rank"
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
    assert issubclass(cls, PipelineScheduleMulti)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
