"""`hpcdist plan --plot PNG`: per-GPU memory of the top layouts as stacked bars against the GPU's memory.

The table says which layouts fit; the picture says why: which category (parameters, gradients, optimizer states,
activations, buffers) fills the GPU in each, and how close each comes to the usable memory (GPU memory minus the
margin). Needs matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hpcdist.planning.layouts import StepEstimate
from hpcdist.planning.memory import GIB

__all__ = ["CATEGORIES", "write_memory_plot"]

CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers")
_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd")


def _label(e: StepEstimate) -> str:
    lay = e.layout
    return (
        f"{lay.strategy} tp{lay.tp} pp{lay.pp} dp{lay.dp_label}\nmbs {lay.micro_batch_size} "
        f"AC {lay.activation_checkpointing}"
    )


def write_memory_plot(
    estimates: Sequence[StepEstimate], path: str | Path, *, gpu_mem_gb: float, margin_gib: float
) -> Path:
    """Stacked GiB per category for ``estimates`` (in the table's order), with the GPU's and the usable memory."""
    from hpcdist.report.plots import import_pyplot, save_png

    plt = import_pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(estimates) + 2), 4.8))
    x = list(range(len(estimates)))
    bottom = [0.0] * len(estimates)
    for cat, color in zip(CATEGORIES, _COLORS, strict=True):
        values = [getattr(e.memory, cat) / GIB for e in estimates]
        ax.bar(x, values, bottom=bottom, color=color, label=cat)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    gpu_gib = gpu_mem_gb  # the planner reads the profile's gpu_mem_gb as GiB (HardwareConfig.usable_bytes)
    ax.axhline(gpu_gib, color="black", linewidth=1.2, label=f"GPU memory {gpu_gib:.1f} GiB")
    ax.axhline(
        gpu_gib - margin_gib, color="black", linestyle="--", linewidth=1, label=f"usable ({margin_gib:g} GiB margin)"
    )
    ax.set_xticks(x, [_label(e) for e in estimates], fontsize=7, rotation=45, ha="right")
    for i, e in enumerate(estimates):
        ax.annotate(
            f"{e.tokens_per_s_per_gpu:,.0f} tok/s" if e.fits else "does not fit",
            (i, bottom[i]),
            ha="center",
            va="bottom",
            fontsize=6,
        )
    ax.set(ylabel="GiB per GPU", title="per-GPU memory of the top layouts (ranked by predicted tokens/s/GPU)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return save_png(fig, Path(path))
