"""`tools/nccl_check --plot out.png`: the sweep and the finder in one picture (matplotlib, the ``plot`` extra).

Drawn from the JSON document of the run (``report._jsonable`` form, so a saved --json file can be drawn the same
way): per collective, bus bandwidth vs message size for each scope (intra-node, inter-node) with the cluster
profile's expected busbw as horizontal lines; and, when the finder ran, the pairwise bandwidth as heat maps (rank x
rank and, with several hosts, host x host).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hpcdist.diagnostics.report import _jsonable

__all__ = ["write_diagnostics_plot"]


def _pairs(mapping: dict[str, float], names: list[str]) -> list[list[float]]:
    """{"a->b": GB/s} -> a symmetric matrix over ``names`` (NaN where nothing was measured)."""
    index = {n: i for i, n in enumerate(names)}
    m = [[math.nan] * len(names) for _ in names]
    for key, value in mapping.items():
        a, b = key.split("->")
        if a in index and b in index and value is not None:
            m[index[a]][index[b]] = m[index[b]][index[a]] = value
    return m


def write_diagnostics_plot(doc: dict[str, Any], path: str | Path) -> Path:
    from hpcdist.report.plots import import_pyplot, save_png

    plt = import_pyplot()
    doc = _jsonable(doc)
    sweep = doc.get("sweep") or []
    ops = list(dict.fromkeys(t["op"] for t in sweep))
    finder = doc.get("finder") or {}
    rank_pairs = finder.get("rank_pairs") or {}
    hosts = sorted(set(finder.get("hosts") or []))
    heat = [h for h in (("rank", rank_pairs), ("host", finder.get("links") or {})) if h[1]]
    if heat and heat[0][0] == "rank" and len(hosts) < 2:
        heat = heat[:1]  # one host: no host x host matrix to draw
    cols = 3
    rows = max(1, math.ceil(len(ops) / cols)) + (1 if heat else 0)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    expect = (doc.get("options") or {}).get("expect") or {}
    for i, op in enumerate(ops):
        ax = axes[i // cols][i % cols]
        for table in (t for t in sweep if t["op"] == op):
            for placement in ("out", "in"):
                pts = [
                    (r["size"], r[placement]["busbw"])
                    for r in table["rows"]
                    if isinstance(r.get(placement), dict) and r[placement].get("busbw") is not None
                ]
                if pts:
                    style = "-o" if placement == "out" else "--x"
                    ax.plot(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        style,
                        markersize=3,
                        label=f"{table['scope']} ({placement}-place)",
                    )
        for key, label, color in (
            ("intra_node_gbps", "expected intra", "#2ca02c"),
            ("inter_node_gbps", "expected inter", "#d62728"),
        ):
            if expect.get(key):
                ax.axhline(expect[key], color=color, linestyle=":", label=f"{label} {expect[key]:g} GB/s")
        ax.set_xscale("log", base=2)
        ax.set(title=op, xlabel="message size (bytes)", ylabel="busbw (GB/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    for j in range(len(ops), (rows - (1 if heat else 0)) * cols):
        axes[j // cols][j % cols].axis("off")
    if heat:
        for j, (kind, mapping) in enumerate(heat):
            ax = axes[rows - 1][j]
            names = [str(r) for r in range(len(finder.get("hosts") or []))] if kind == "rank" else hosts
            im = ax.imshow(_pairs(mapping, names), cmap="viridis")
            ax.set_xticks(range(len(names)), names, fontsize=6, rotation=90 if kind == "host" else 0)
            ax.set_yticks(range(len(names)), names, fontsize=6)
            ax.set_title(f"finder: {kind} x {kind} GB/s")
            fig.colorbar(im, ax=ax, shrink=0.8)
        for j in range(len(heat), cols):
            axes[rows - 1][j].axis("off")
    fig.suptitle(f"nccl_check: {(doc.get('layout') or {}).get('world_size', '?')} ranks")
    fig.tight_layout()
    return save_png(fig, Path(path))
