"""The ranks a checkpoint is written and read by, and the few collectives the checkpoint code runs over their CPU
group (gloo: agreement flags and gathers work on NCCL jobs too)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class Ranks:
    """The ranks a checkpoint is read and written by: this one, how many, their CPU group (None: one process)
    and the threads a rank reads its share on."""

    rank: int
    world_size: int
    group: Any = None
    threads: int = 1

    def spread(self, items: list[str], fn: Callable[[str], Any]) -> dict[str, Any]:
        """{item: fn(item)}, the work split over the ranks (each reads its share once) and gathered to all. A rank
        runs its share on ``write_threads`` threads: one sha256 thread reads a cold file at ~0.5 of the disk's
        speed here (hashlib and reads release the GIL, so threads overlap the reading with the hashing)."""
        share = items[self.rank :: self.world_size]
        if self.threads > 1 and len(share) > 1:
            with ThreadPoolExecutor(max_workers=min(self.threads, len(share))) as pool:
                mine = dict(zip(share, pool.map(fn, share), strict=True))
        else:
            mine = {item: fn(item) for item in share}
        if self.group is None:
            return mine
        parts: list[dict[str, Any]] = [{} for _ in range(self.world_size)]
        dist.all_gather_object(parts, mine, group=self.group)
        return {k: v for part in parts for k, v in part.items()}

    def max(self, kind: int) -> int:
        """Collective: the worst of every rank's read outcome
        (READ_OK < READ_DAMAGE < READ_TRANSIENT < READ_MISMATCH)."""
        if self.group is None:
            return kind
        flag = torch.tensor([kind])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag)
