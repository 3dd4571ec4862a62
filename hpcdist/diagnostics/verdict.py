"""PASS / FAIL: expected bus bandwidth of a cluster profile, and every reason a run fails.

Expected numbers come from the ``hardware:`` block of the cluster profile ``hpcdist/resources/cluster/<name>.yaml``
(the planner reads the same block), e.g. a100_ib: 8x A100 with NVSwitch, ~230 GB/s intra-node all_reduce busbw;
8x HDR InfiniBand, ~190 GB/s between nodes. Those are nccl-tests peaks at large messages, so the bandwidth check
uses the all_reduce row of the largest size measured and is skipped (with a note) when that is below
``MIN_CHECK_BYTES``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hpcdist import resources

__all__ = ["MIN_CHECK_BYTES", "Expectation", "Verdict", "bandwidth_checks", "load_expectation"]

MIN_CHECK_BYTES = 256 << 20  # nccl-tests' all_reduce busbw on 8x A100 is within a few % of peak from here on


@dataclass(frozen=True)
class Expectation:
    """Bus bandwidth (GB/s) a healthy system reaches; None = not checked."""

    intra_node_gbps: float | None = None
    inter_node_gbps: float | None = None
    tolerance: float = 0.8  # PASS when measured >= tolerance x expected
    source: str = "none"


def load_expectation(
    cluster: str | None,
    *,
    intra: float | None = None,
    inter: float | None = None,
    tolerance: float = 0.8,
) -> Expectation:
    """From the shipped cluster profile ``cluster`` (or a YAML path) ``hardware.*_busbw_gbps``; explicit values win."""
    found: dict[str, Any] = {}
    source = "command line" if intra is not None or inter is not None else "none"
    if cluster and cluster != "none":
        shipped = resources.names("cluster")
        path = resources.path("cluster", cluster) if cluster in shipped else Path(cluster).expanduser()
        if not path.is_file():
            names = ", ".join(shipped)
            raise ValueError(f"--cluster {cluster!r}: no such profile; choose one of {names}, none, or a YAML path")
        data = yaml.safe_load(path.read_text()) or {}
        hardware = data.get("hardware") or {} if isinstance(data, dict) else {}
        found = {k: hardware.get(k) for k in ("intra_node_busbw_gbps", "inter_node_busbw_gbps")}
        source = f"{path.name} hardware:" + (" + command line" if intra is not None or inter is not None else "")
    if not 0 < tolerance <= 1:
        raise ValueError(f"--tolerance {tolerance}: must be in (0, 1]")
    return Expectation(
        intra_node_gbps=intra if intra is not None else found.get("intra_node_busbw_gbps"),
        inter_node_gbps=inter if inter is not None else found.get("inter_node_busbw_gbps"),
        tolerance=tolerance,
        source=source,
    )


@dataclass
class Verdict:
    passed: bool = True
    reasons: list[str] = field(default_factory=list)  # why it failed
    notes: list[str] = field(default_factory=list)  # checks skipped or passed, for the record
    exclude: list[str] = field(default_factory=list)  # hosts to keep out of the next allocation

    def fail(self, reason: str, hosts: list[str] | tuple[str, ...] = ()) -> None:
        self.passed = False
        self.reasons.append(reason)
        self.exclude = sorted(set(self.exclude) | {h for h in hosts if h})


def bandwidth_checks(verdict: Verdict, expect: Expectation, tables: list[dict[str, Any]]) -> None:
    """Compare the all_reduce row of the largest size of each scope with the expectation."""
    for table in tables:
        if table["op"] != "all_reduce" or not table["rows"]:
            continue
        wanted = expect.intra_node_gbps if table["scope"] == "intra-node" else expect.inter_node_gbps
        if wanted is None:
            verdict.notes.append(f"{table['scope']} busbw not checked (no expectation; pass --cluster or --expect-*)")
            continue
        row = table["rows"][-1]
        if row["size"] < MIN_CHECK_BYTES:
            verdict.notes.append(
                f"{table['scope']} busbw not checked: largest message {row['size']} B < {MIN_CHECK_BYTES >> 20} MiB, "
                "where the expected peak applies (raise --max-bytes)"
            )
            continue
        got, limit = row["in"]["busbw"], wanted * expect.tolerance
        worst = row.get("worst_host")
        where = f" (slowest node {worst})" if worst else ""
        text = f"{table['scope']} all_reduce busbw {got:.1f} GB/s at {row['size']} B{where}"
        if got < limit:
            verdict.fail(
                f"{text} < {limit:.1f} GB/s ({expect.tolerance:g} x {wanted:g}, {expect.source})",
                [worst] if worst else [],
            )
        else:
            verdict.notes.append(f"{text} >= {limit:.1f} GB/s: ok")
