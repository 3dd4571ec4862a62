"""Every rank agrees: the one helper behind "did this work on every rank", "the worst outcome of all ranks" and
"every rank's value on every rank".

A group of ``None`` stands for one process: nothing is exchanged and the answer is this rank's own, so callers hand
down the group they have (a checkpoint's CPU group, the tier's copy group, :func:`world_group`) without branching on
the job's size. Every function is a collective on any other group: every rank of it calls the same ones in the same
order, or the job deadlocks (a rank that failed still calls, with its failure as its value).

The per-step stop agreement (hpcdist.fault.stop) is not here: it is asynchronous, overlapping the next step, and
these are not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

__all__ = ["all_ok", "gather", "world_group", "worst"]


def world_group() -> Any:
    """The job's default process group when there is one of more than one process; None (one process) otherwise."""
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None


@overload
def worst(code: int, group: Any, *, device: Any = None) -> int: ...


@overload
def worst(code: Sequence[int], group: Any, *, device: Any = None) -> list[int]: ...


def worst(code: int | Sequence[int], group: Any, *, device: Any = None) -> int | list[int]:
    """Collective over ``group``: the largest of every rank's ``code`` (a MAX all-reduce of int64), element by
    element for a sequence; ``code`` itself when ``group`` is None. Outcome codes are ordered worst last, so the
    largest is the one every rank acts on. ``device``: where the reduced tensor lives (NCCL reduces device tensors
    only; a gloo group takes the CPU default)."""
    if group is None:
        return code if isinstance(code, int) else list(code)
    import torch
    import torch.distributed as dist

    flag = torch.tensor([code] if isinstance(code, int) else list(code), dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    values = [int(v) for v in flag.cpu().tolist()]
    return values[0] if isinstance(code, int) else values


def all_ok(ok: bool, group: Any) -> bool:
    """Collective over ``group``: True when ``ok`` on every rank (one failure anywhere makes it False everywhere)."""
    return worst(0 if ok else 1, group) == 0


def gather(obj: Any, group: Any, world_size: int) -> list[Any]:
    """Collective over ``group`` (of ``world_size`` ranks): every rank's ``obj``, in rank order, on every rank;
    ``[obj]`` when ``group`` is None. The objects travel pickled: only values of the job's own ranks go in, never
    anything read from a file (unpickling someone else's bytes runs their code)."""
    if group is None:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj, group=group)
    return out
