"""Slow node / link finder: pairwise transfers that rank ranks and hosts by bandwidth and name the outliers.

A collective runs at the speed of its slowest member, so the sweep says *that* something is slow, not *what*.
Every pair is measured on its own, and each transfer is timed; a pair's bandwidth is its fastest transfer's:

- ranks, within each node, one pair at a time (all nodes at once): the two exchange both ways at once; a rank's
  score is the median bandwidth of its pairs. A slow GPU (or a rank starved of CPU) drags down every pair it is
  in, while its partners have one slow pair each, so the median separates them.
- hosts, in round-robin rounds (every host meets every other once; the host pairs of a round run at the same
  time, on disjoint hosts): local rank i of one host sends to local rank i of the other, all i at once (the whole
  node's traffic; one rail per GPU on a rail-optimized fabric), then the other way. Receivers time the
  transfers, giving a bandwidth per direction. A host's rx score is the upper median over peers of what they
  deliver to it, its tx score that of what it delivers to them.

An outlier scores below ``threshold`` x the reference, the upper median of all scores (with a single bad member the
reference is always a healthy value, also for two members). Host rx outliers are named first; a slow tx is only
blamed on the sender when its slow transfers do not all go to hosts already named for slow rx. With two hosts the
one link is seen from both ends, so the direction into the receiver decides and the report says it is ambiguous.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from statistics import median, median_high
from typing import Any

import torch
import torch.distributed as dist

from hpcdist.diagnostics.faults import Faults

__all__ = ["Outlier", "exclude_flag", "host_outliers", "host_plan", "measure", "rank_outliers", "round_robin"]


@dataclass(frozen=True)
class Outlier:
    kind: str  # "rank" | "host"
    name: str  # "3" or the hostname
    host: str
    score_gbps: float
    reference_gbps: float
    detail: str

    @property
    def ratio(self) -> float:
        return self.score_gbps / self.reference_gbps if self.reference_gbps > 0 else 0.0


@dataclass
class Transfer:
    """One planned transfer of this rank in one round: exchange with, send to, or receive from ``peer``."""

    peer: int
    mode: str  # "both" | "send" | "recv"
    tag: str  # what the measurement belongs to: "rank" or "host <src> -> <dst>"


@dataclass
class Round:
    name: str
    transfers: dict[int, Transfer] = field(default_factory=dict)  # by global rank


def round_robin(m: int) -> list[list[tuple[int, int]]]:
    """Circle method: m-1 rounds (m even) or m rounds (m odd) of disjoint pairs covering every pair once."""
    if m < 2:
        return []
    players: list[int | None] = list(range(m)) + ([None] if m % 2 else [])
    k = len(players)
    rounds = []
    for _ in range(k - 1):
        pairs = [(players[i], players[k - 1 - i]) for i in range(k // 2)]
        rounds.append([(min(a, b), max(a, b)) for a, b in pairs if a is not None and b is not None])
        players = [players[0], players[-1], *players[1:-1]]  # keep the first, rotate the rest
    return rounds


def host_plan(hosts: Sequence[str]) -> list[Round]:
    """Every round of the rank test (within nodes, all nodes at once) and of the host test (between nodes)."""
    members: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        members.setdefault(host, []).append(rank)
    nodes = list(members.values())
    plan: list[Round] = []
    # One pair per node at a time (all nodes at once): concurrent pairs of a node would compete for its CPU cores,
    # PCIe switches and NVSwitch ports, and a pair must be measured alone to be compared with the others.
    per_node = [[pair for rnd in round_robin(len(m)) for pair in rnd] for m in nodes]
    for k in range(max((len(p) for p in per_node), default=0)):
        rnd = Round(f"ranks pair {k + 1}")
        for ranks, pairs in zip(nodes, per_node, strict=True):
            if k < len(pairs):
                a, b = pairs[k]
                rnd.transfers[ranks[a]] = Transfer(ranks[b], "both", "rank")
                rnd.transfers[ranks[b]] = Transfer(ranks[a], "both", "rank")
        plan.append(rnd)
    names = list(members)
    for k, pairs in enumerate(round_robin(len(names))):
        for direction in (0, 1):
            rnd = Round(f"hosts round {k + 1}{'ab'[direction]}")
            for a, b in pairs:
                src, dst = (names[a], names[b]) if direction == 0 else (names[b], names[a])
                for s, d in zip(members[src], members[dst], strict=False):  # local rank i <-> local rank i
                    rnd.transfers[s] = Transfer(d, "send", f"host {src} -> {dst}")
                    rnd.transfers[d] = Transfer(s, "recv", f"host {src} -> {dst}")
            plan.append(rnd)
    return plan


def measure(
    plan: Sequence[Round],
    *,
    rank: int,
    nbytes: int,
    iters: int,
    warmup: int,
    device: torch.device,
    faults: Faults,
    step: Callable[[str], AbstractContextManager[Any]],
) -> list[dict[str, Any]]:
    """This rank's part of ``plan``: per round, the per-iteration seconds of its transfer (if it has one)."""
    sync: Callable[[], None] = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    send = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    recv = torch.empty_like(send)
    out = []
    for rnd in plan:
        mine = rnd.transfers.get(rank)
        with step(f"finder {rnd.name}"):
            ops: list[dist.P2POp] = []
            if mine is not None:
                if mine.mode in ("both", "send"):
                    ops.append(dist.P2POp(dist.isend, send, mine.peer))
                if mine.mode in ("both", "recv"):
                    ops.append(dist.P2POp(dist.irecv, recv, mine.peer))

            def transfer(ops: list[dist.P2POp] = ops) -> None:
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
                sync()

            timed = faults.delayed(rank, transfer)
            # Rounds must not overlap: a pair is measured with only its round running. The barrier is also a collective
            # of every rank on the default group, which NCCL needs before a batched p2p that involves only some ranks.
            dist.barrier()
            times = []
            for i in range(warmup + iters if ops else 0):
                start = time.perf_counter()
                (transfer if i < warmup else timed)()
                if i >= warmup:
                    times.append(time.perf_counter() - start)
        if mine is not None:
            out.append({"round": rnd.name, "peer": mine.peer, "mode": mine.mode, "tag": mine.tag, "seconds": times})
    return out


# ---------------------------------------------------------------------------------------------- scoring


def _bw(nbytes: int, seconds: Sequence[float]) -> float:
    """GB/s of the fastest iteration: what the pair can do. Noise (a neighbour's burst, a scheduler tick) only ever
    adds time, while a slow GPU or a throttled link slows every iteration, so the best one separates them."""
    return nbytes / min(seconds) / 1e9


def rank_pair_bandwidth(per_rank: Sequence[Sequence[dict[str, Any]]], nbytes: int) -> dict[tuple[int, int], float]:
    """(a, b) with a < b -> GB/s each way, from the slower side of the exchange."""
    seen: dict[tuple[int, int], float] = {}
    for rank, records in enumerate(per_rank):
        for rec in records:
            if rec["tag"] == "rank":
                pair = (min(rank, rec["peer"]), max(rank, rec["peer"]))
                bw = _bw(nbytes, rec["seconds"])
                seen[pair] = min(seen.get(pair, bw), bw)
    return seen


def host_link_bandwidth(
    per_rank: Sequence[Sequence[dict[str, Any]]], hosts: Sequence[str], nbytes: int
) -> dict[tuple[str, str], float]:
    """(src host, dst host) -> GB/s, summed over the concurrent rank pairs (rails), as timed by the receivers."""
    out: dict[tuple[str, str], float] = {}
    for rank, records in enumerate(per_rank):
        for rec in records:
            if rec["mode"] == "recv":
                link = (hosts[rec["peer"]], hosts[rank])
                out[link] = out.get(link, 0.0) + _bw(nbytes, rec["seconds"])
    return out


def rank_outliers(
    pair_bw: dict[tuple[int, int], float], hosts: Sequence[str], threshold: float
) -> tuple[list[Outlier], dict[int, float]]:
    """Ranks whose median pair bandwidth is below ``threshold`` x the upper median of all ranks' (and all scores)."""
    pairs_of: dict[int, list[float]] = {}
    for (a, b), bw in pair_bw.items():
        pairs_of.setdefault(a, []).append(bw)
        pairs_of.setdefault(b, []).append(bw)
    scores = {r: median(v) for r, v in sorted(pairs_of.items())}
    if not scores:
        return [], scores
    ref = median_high(scores.values())
    out = [
        Outlier(
            "rank",
            str(r),
            hosts[r],
            s,
            ref,
            f"rank {r} on {hosts[r]}: {s:.3g} GB/s to its node mates "
            f"(median of {len(pairs_of[r])} pair(s)) vs {ref:.3g} GB/s typical",
        )
        for r, s in scores.items()
        if s < threshold * ref
    ]
    return out, scores


def host_outliers(
    link_bw: dict[tuple[str, str], float], threshold: float
) -> tuple[list[Outlier], dict[str, dict[str, float]], bool]:
    """(outliers, {host: {"rx", "tx"}}, ambiguous). See the module docstring for the rules."""
    hosts = sorted({h for link in link_bw for h in link})
    rx = {h: median_high([bw for (s, d), bw in link_bw.items() if d == h]) for h in hosts}
    tx = {h: median_high([bw for (s, d), bw in link_bw.items() if s == h]) for h in hosts}
    scores = {h: {"rx": rx[h], "tx": tx[h]} for h in hosts}
    if len(hosts) < 2:
        return [], scores, False
    ref = median_high([*rx.values(), *tx.values()])
    slow_rx = {h for h in hosts if rx[h] < threshold * ref}
    out = []
    for h in sorted(slow_rx):
        senders = ", ".join(s for (s, d), bw in sorted(link_bw.items()) if d == h and bw < threshold * ref)
        out.append(
            Outlier(
                "host",
                h,
                h,
                rx[h],
                ref,
                f"{h} receives at {rx[h]:.3g} GB/s vs {ref:.3g} GB/s typical (slow from: {senders})",
            )
        )
    for h in hosts:
        slow_to = {d for (s, d), bw in link_bw.items() if s == h and bw < threshold * ref}
        if tx[h] < threshold * ref and not slow_to <= slow_rx:
            out.append(
                Outlier(
                    "host",
                    h,
                    h,
                    tx[h],
                    ref,
                    f"{h} sends at {tx[h]:.3g} GB/s vs {ref:.3g} GB/s typical (slow to: {', '.join(sorted(slow_to))})",
                )
            )
    return out, scores, len(hosts) == 2 and bool(out)


def exclude_flag(hosts: Sequence[str]) -> str | None:
    """The sbatch/srun option that keeps these hosts out of the next allocation."""
    names = sorted(set(hosts))
    return f"--exclude={','.join(names)}" if names else None
