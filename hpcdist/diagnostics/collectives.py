"""The collective sweep: nccl-tests' measurements and result checks, through torch.distributed.

Sizes follow nccl-tests: ``size`` is the bytes of the whole buffer -- the all_reduce / broadcast / send buffer, the
all_gather *output*, the reduce_scatter *input*, the all_to_all buffer -- rounded down so that split operations
divide it evenly over the ranks (at least one element each). With ``t`` the time of one operation:

    algbw = size / t                     (GB/s, 1 GB = 1e9 bytes)
    busbw = algbw * factor(op, n):  all_reduce 2(n-1)/n; reduce_scatter, all_gather, all_to_all (n-1)/n;
                                    broadcast and send/recv 1

busbw is comparable across operations and rank counts: it is the traffic one rank's link carries, so it is what
you compare against the hardware. Times are averaged over the ranks of the group (nccl-tests' default).

Every buffer holds small integers (a period-17 pattern shifted per rank) so each result is known exactly and
compared element by element after one untimed, freshly reset call: the ``#wrong`` column.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from statistics import fmean
from typing import Any

import torch
import torch.distributed as dist

from hpcdist.diagnostics.faults import Faults
from hpcdist.diagnostics.names import OPS

__all__ = [
    "OPS",
    "PLACEMENTS",
    "Case",
    "bandwidths",
    "build_case",
    "busbw_factor",
    "count_wrong",
    "group_table",
    "message_sizes",
    "op_sizes",
    "sweep_op",
]

# torch has no out-of-place all_reduce or broadcast, and NCCL's in-place all_to_all / send-recv do not exist.
PLACEMENTS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("in",),
    "all_gather": ("out", "in"),
    "reduce_scatter": ("out", "in"),
    "all_to_all": ("out",),
    "broadcast": ("in",),
    "sendrecv": ("out",),
}
_SPLIT = ("all_gather", "reduce_scatter", "all_to_all")
REDOP = {"all_reduce": "sum", "reduce_scatter": "sum"}
ROOT = {"broadcast": 0}
DTYPE_NAMES = {torch.float32: "float", torch.float16: "half", torch.bfloat16: "bfloat16", torch.float64: "double"}
_PERIOD = 17  # prime, so the shift 3*rank gives 17 distinct patterns; values -8..8 are exact in every float type
_MAX = 8

# all_gather_single / reduce_scatter_single are the names since torch 2.13; older releases (the setup.cfg range
# starts at 2.6) have only the *_into_tensor / *_tensor spellings, which 2.13 still accepts with a warning.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor of ``op`` on ``n`` ranks."""
    if n < 1:
        raise ValueError(f"n={n} ranks: must be >= 1")
    match op:
        case "all_reduce":
            return 2 * (n - 1) / n
        case "all_gather" | "reduce_scatter" | "all_to_all":
            return (n - 1) / n
        case "broadcast" | "sendrecv":
            return 1.0
    raise ValueError(f"unknown operation {op!r}; known: {', '.join(OPS)}")


def bandwidths(op: str, size_bytes: int, seconds: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s of one ``op`` of ``size_bytes`` that took ``seconds`` on ``n`` ranks."""
    algbw = size_bytes / seconds / 1e9 if seconds > 0 else float("inf")
    return algbw, algbw * busbw_factor(op, n)


def message_sizes(min_bytes: int, max_bytes: int, factor: int = 2) -> list[int]:
    """min, min*factor, ... up to max (inclusive when hit), like nccl-tests' -b/-e/-f."""
    if min_bytes < 1 or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"sizes {min_bytes}..{max_bytes} step x{factor}: need 1 <= min <= max and factor >= 2")
    out, size = [], min_bytes
    while size <= max_bytes:
        out.append(size)
        size *= factor
    return out


def op_sizes(op: str, sizes: Sequence[int], n: int, elem_size: int) -> list[int]:
    """Element counts of the whole buffer for each size, rounded like nccl-tests, duplicates dropped."""
    counts: list[int] = []
    for size in sizes:
        count = max(size // elem_size, 1)
        if op in _SPLIT:
            count = max(count // n, 1) * n
        if count not in counts:
            counts.append(count)
    return counts


# ------------------------------------------------------------------------------------------------- cases


@dataclass
class Case:
    """One operation ready to run: ``run`` is timed, ``reset`` + ``run`` + ``result`` vs ``expected`` is checked."""

    run: Callable[[], Any]
    reset: Callable[[], Any]
    result: torch.Tensor
    expected: Callable[[], torch.Tensor]


def _tile(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    base = (torch.arange(_PERIOD, dtype=torch.float32) - _MAX).to(dtype=dtype, device=device)
    return base.repeat(numel // _PERIOD + 2)[: numel + _PERIOD]


def build_case(
    op: str, placement: str, count: int, group: dist.ProcessGroup, dtype: torch.dtype, device: torch.device
) -> Case:
    """Buffers and closures for one (op, placement, element count) on ``group``."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    tile = _tile(count, dtype, device)

    def pattern(r: int, numel: int = count) -> torch.Tensor:
        start = (3 * r) % _PERIOD
        return tile[start : start + numel]

    def total(parts: list[torch.Tensor]) -> torch.Tensor:
        acc = torch.zeros(parts[0].shape, dtype=torch.float32, device=device)
        for part in parts:
            acc += part.float()
        return acc

    c = count // n  # per-rank chunk of the split operations
    mine = slice(me * c, (me + 1) * c)

    def noop() -> None:
        return None

    match op, placement:
        case "all_reduce", "in":
            buf = pattern(me).clone()
            return Case(
                lambda: dist.all_reduce(buf, group=group),
                lambda: buf.copy_(pattern(me)),
                buf,
                lambda: total([pattern(r) for r in range(n)]),
            )
        case "broadcast", "in":
            buf = pattern(me).clone()
            src = dist.get_global_rank(group, ROOT["broadcast"])
            return Case(
                lambda: dist.broadcast(buf, src=src, group=group),
                lambda: buf.copy_(pattern(me)),
                buf,
                lambda: pattern(ROOT["broadcast"]),
            )
        case "all_gather", "out":
            inp, out = pattern(me, c).clone(), torch.empty(count, dtype=dtype, device=device)
            return Case(
                lambda: _all_gather(out, inp, group=group),
                noop,
                out,
                lambda: torch.cat([pattern(r, c) for r in range(n)]),
            )
        case "all_gather", "in":
            out = torch.empty(count, dtype=dtype, device=device)
            inp = out[mine]  # NCCL's in-place all_gather: the input is this rank's slot of the output

            def reset_gather() -> None:
                out.fill_(-_MAX - 1)
                inp.copy_(pattern(me, c))

            reset_gather()
            return Case(
                lambda: _all_gather(out, inp, group=group),
                reset_gather,
                out,
                lambda: torch.cat([pattern(r, c) for r in range(n)]),
            )
        case "reduce_scatter", "out" | "in":
            inp = pattern(me).clone()
            out = inp[mine] if placement == "in" else torch.empty(c, dtype=dtype, device=device)
            return Case(
                lambda: _reduce_scatter(out, inp, group=group),
                lambda: inp.copy_(pattern(me)),
                out,
                lambda: total([pattern(r)[mine] for r in range(n)]),
            )
        case "all_to_all", "out":
            inp, out = pattern(me).clone(), torch.empty(count, dtype=dtype, device=device)
            return Case(
                lambda: dist.all_to_all_single(out, inp, group=group),
                noop,
                out,
                lambda: torch.cat([pattern(r)[mine] for r in range(n)]),
            )
        case "sendrecv", "out":
            send, recv = pattern(me).clone(), torch.empty(count, dtype=dtype, device=device)
            nxt, prv = dist.get_global_rank(group, (me + 1) % n), dist.get_global_rank(group, (me - 1) % n)

            def ring() -> None:
                # nccl-tests' sendrecv: everyone sends to the next rank and receives from the previous one at once
                ops = [dist.P2POp(dist.isend, send, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()

            return Case(ring, noop, recv, lambda: pattern((me - 1) % n))
    raise ValueError(f"{op} has no {placement}-of-place variant; see PLACEMENTS")


def count_wrong(got: torch.Tensor, expected: torch.Tensor, n: int) -> int:
    """Elements of ``got`` that differ from ``expected`` (NaN counts as wrong).

    Sums of n values in -8..8 are exact unless they exceed the type's integer range (bf16: 256); beyond it, one
    rounding step of the type is allowed.
    """
    eps = torch.finfo(got.dtype).eps
    tol = 0.0 if _MAX * n <= 2 / eps else _MAX * n * eps  # 2/eps: the first integer the type cannot hold
    diff = (got.float() - expected.float()).abs()
    return int((~(diff <= tol)).sum().item())


# ------------------------------------------------------------------------------------------------- sweep


def sweep_op(
    op: str,
    group: dist.ProcessGroup,
    sizes: Sequence[int],
    *,
    dtype: torch.dtype,
    device: torch.device,
    iters: int,
    warmup: int,
    rank: int,
    faults: Faults,
    step: Callable[[str], AbstractContextManager[Any]],
) -> list[dict[str, Any]]:
    """This rank's measurements of ``op`` on ``group`` for every size: [{"count", "placement", "seconds", "wrong"}].

    ``step(name)`` wraps every measurement (the watchdog's deadline).
    """
    n = dist.get_world_size(group)
    sync: Callable[[], None] = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    out = []
    for count in op_sizes(op, sizes, n, torch.tensor([], dtype=dtype).element_size()):
        for placement in PLACEMENTS[op]:
            with step(f"{op} {count} elements {'in-place' if placement == 'in' else 'out-of-place'}"):
                case = build_case(op, placement, count, group, dtype, device)
                run = faults.delayed(rank, case.run)
                for _ in range(warmup):
                    case.run()
                sync()
                dist.barrier(group=group)  # start together, as nccl-tests does
                start = time.perf_counter()
                for _ in range(iters):
                    run()
                sync()
                seconds = (time.perf_counter() - start) / iters
                case.reset()
                case.run()
                sync()
                faults.corrupt(rank, case.result)
                wrong = count_wrong(case.result, case.expected(), n)
            out.append({"count": count, "placement": placement, "seconds": seconds, "wrong": wrong})
    return out


def group_table(
    op: str, per_rank: Sequence[Sequence[dict[str, Any]]], ranks: Sequence[int], dtype: torch.dtype
) -> list[dict[str, Any]]:
    """Rows of one group (its ranks' measurements gathered on rank 0): one row per size, a column set per placement."""
    elem = torch.tensor([], dtype=dtype).element_size()
    n = len(ranks)
    rows: dict[int, dict[str, Any]] = {}
    for i, point in enumerate(per_rank[ranks[0]]):
        times = {r: per_rank[r][i]["seconds"] for r in ranks}
        wrong = {r: per_rank[r][i]["wrong"] for r in ranks}
        seconds = fmean(times.values())
        algbw, busbw = bandwidths(op, point["count"] * elem, seconds, n)
        row = rows.setdefault(
            point["count"],
            {
                "size": point["count"] * elem,
                "count": point["count"],
                "type": DTYPE_NAMES.get(dtype, str(dtype)),
                "redop": REDOP.get(op, "none"),
                "root": ROOT.get(op, -1),
                "ranks": list(ranks),
            },
        )
        row[point["placement"]] = {
            "time_us": seconds * 1e6,
            "algbw": algbw,
            "busbw": busbw,
            "wrong": sum(wrong.values()),
            "wrong_by_rank": {str(r): w for r, w in wrong.items() if w},
            "time_us_by_rank": {str(r): t * 1e6 for r, t in times.items()},
        }
    return list(rows.values())
