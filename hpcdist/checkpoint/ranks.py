"""The ranks a checkpoint is written and read by, and their CPU group (gloo: the agreement flags and gathers of
hpcdist.agree work on NCCL jobs too)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from hpcdist.agree import gather


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
        return {k: v for part in gather(mine, self.group, self.world_size) for k, v in part.items()}
