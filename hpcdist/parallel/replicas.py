"""The replica check (``logging.replica_check_every_steps``): data-parallel replicas must hold bitwise-identical
parameters. A strategy says which ranks are replicas (``Strategy.replica_group`` / ``has_replicas``); this module
compares them, outside the strategy seam."""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from hpcdist.base.logging_utils import get_logger
from hpcdist.parallel.base import Strategy

log = get_logger(__name__)


@torch.no_grad()
def replica_checksums(strategy: Strategy) -> list[tuple[float, float]]:
    """Collective over ``strategy.replica_group()``: each replica's float64 (sum, sum of |x|) of its local
    parameters. Two numbers compared separately: their sum alone would miss a negative weight moving towards zero."""
    local = torch.zeros(2, dtype=torch.float64)
    for p in strategy.model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p  # DTensor shard: the replica holds this slice
        local[0] += t.detach().double().sum().cpu()
        local[1] += t.detach().double().abs().sum().cpu()  # a sum alone misses sign-symmetric drift
    group = strategy.replica_group()
    if not strategy.has_replicas():
        return [(float(local[0]), float(local[1]))]
    local = local.to(strategy.device)  # NCCL gathers device tensors
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    return [(float(g[0]), float(g[1])) for g in gathered]


def replica_ranks(strategy: Strategy) -> list[int]:
    """Global ranks of ``strategy.replica_group()``, in the order ``replica_checksums`` returns them."""
    group = strategy.replica_group()
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def check_replicas(strategy: Strategy, *, step: int, rank: int) -> float:
    """Collective: the largest relative difference between replicas (0.0: identical); the first rank of each
    replica group warns naming the ranks that differ from the majority (a silent data corruption, a
    non-deterministic kernel, or a rank that skipped an update)."""
    sums = replica_checksums(strategy)
    ref = Counter(sums).most_common(1)[0][0]  # the majority value; a tie goes to the lowest rank's
    ranks = replica_ranks(strategy)
    bad = [r for r, c in zip(ranks, sums, strict=True) if c != ref]
    divergence = max(abs(a - b) / max(abs(b), 1e-30) for c in sums for a, b in zip(c, ref, strict=True))
    if bad and rank == ranks[0]:  # HSDP has one replica group per shard: each group's first rank
        msg = "step %d: data-parallel replicas diverged: rank(s) %s differ from the majority (max rel. diff %.3g)"
        log.warning(msg, step, bad, divergence)
    if strategy.replica_group() is not None and dist.is_initialized():
        # several replica groups (HSDP): the metric rank 0 writes is the worst over all of them
        worst = torch.tensor(divergence, dtype=torch.float64, device=strategy.device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        divergence = float(worst)
    return divergence
