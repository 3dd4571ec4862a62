"""The memory check ``hpcdist submit`` runs before a job waits in the queue: does the config's own layout fit the
cluster's GPUs (the planner's estimate, as ``hpcdist plan`` and ``train --dry-run`` print it), and if not, which
layout nearest to it does.

Torch-free (the planner's formulas only), so the submit path stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcdist import config as config_mod
from hpcdist.config import ConfigError, JobConfig
from hpcdist.config.cluster import ClusterConfig, cluster_hardware
from hpcdist.planning import layouts as planner
from hpcdist.planning.memory import GIB

__all__ = ["FitCheck", "check_fit"]

# How far the search for a node count on which the config's own layout fits goes (x nodes, doubling).
_MAX_NODE_FACTOR = 64


@dataclass(frozen=True)
class FitCheck:
    """The config's layout on the requested nodes, its estimate, and where it would fit instead."""

    layout: planner.Layout
    need_gib: float
    usable_gib: float
    nodes: int
    gpus_per_node: int
    best: str | None = None
    """The planner's best layout that fits on these nodes and that this config can run, as overrides."""
    best_reason: str | None = None
    nodes_needed: int | None = None
    """The fewest nodes (doubling) on which the config's own layout fits; None: none up to 64x."""

    @property
    def fits(self) -> bool:
        return self.need_gib <= self.usable_gib

    @property
    def tight(self) -> bool:
        """Fits, but within the planner's TIGHT_FRACTION of the usable memory (its StepEstimate.tight)."""
        return self.fits and self.need_gib > (1 - planner.TIGHT_FRACTION) * self.usable_gib

    def tight_note(self) -> str:
        """One line for a layout that passes tight: the estimate's error or fragmentation can tip it over."""
        return (
            f"memory check: {self.layout.describe()} is tight: needs {self.need_gib:.1f} of {self.usable_gib:g} GiB "
            f"usable per GPU, {self.usable_gib - self.need_gib:.1f} GiB headroom (within "
            f"{100 * planner.TIGHT_FRACTION:g}%); an OOM at step 1 is possible (hpcdist plan lists roomier layouts)"
        )

    def refusal(self) -> str:
        """One line: what does not fit, and the nearest layouts that do."""
        where = f"{self.nodes} node(s) x {self.gpus_per_node} GPUs"
        text = (
            f"memory check: {self.layout.describe()} on {where} needs {self.need_gib:.1f} GiB per GPU, "
            f"{self.usable_gib:g} GiB usable (hardware.gpu_mem_gb minus margin_gib); "
        )
        fixes = []
        if self.best:
            fixes.append(f"the best layout that fits on {where}: {self.best_reason} (overrides: {self.best})")
        if self.nodes_needed:
            fixes.append(f"--nodes {self.nodes_needed} fits this layout")
        if not fixes:
            fixes.append("no layout fits; shorten data.seq_len or lower train.global_batch_size")
        return text + "; or ".join(fixes) + " (hpcdist plan lists the layouts; --force submits anyway)"


def _need(cfg: JobConfig, layout: planner.Layout, gpus_per_node: int) -> float:
    t, p = cfg.train, cfg.parallel
    zero = layout.zero_enabled
    est = planner.layout_memory(
        cfg.model_args(),
        layout,
        seq_len=cfg.data.seq_len,
        gpus_per_node=gpus_per_node,
        microbatches=max(1, t.global_batch_size // (t.micro_batch_size * layout.dp)),
        reduce_bytes=planner.grad_reduce_bytes(cfg),
        offload_optimizer=zero and p.zero.offload_optimizer,
        offload_params=zero and p.zero.offload_params,
        document_mask=cfg.data.document_mask,
        element_bytes=planner.activation_element_bytes(cfg),
    )
    return est.peak / GIB  # ZeRO: the whole fp32 model built on every GPU, when that exceeds the step


def _value(cfg: JobConfig, key: str) -> object:
    node: object = cfg
    for part in key.split("."):
        node = getattr(node, part, None)
    return node


def check_fit(cfg: JobConfig, cluster: ClusterConfig) -> FitCheck | None:
    """The fit of ``cfg``'s layout on ``cluster``'s nodes; None when there is nothing to check (no GPUs, no
    hardware block, parallel.strategy=auto, which the job resolves itself to a fitting layout)."""
    if cluster.gpus_per_node < 1 or cluster.hardware is None:
        return None
    try:
        hw = cluster_hardware(cluster)
        layout = planner.layout_of(cfg, cluster.world_size)
    except ValueError:
        return None  # no gpu_mem_gb in the profile, or a strategy the planner does not model
    usable = hw.usable_bytes / GIB
    need = _need(cfg, layout, cluster.gpus_per_node)
    check = FitCheck(layout, need, usable, cluster.nodes, cluster.gpus_per_node)
    if check.fits:
        return check
    best = reason = None
    estimates = planner.rank_layouts(
        cfg.model_args(),
        world_size=cluster.world_size,
        gpus_per_node=cluster.gpus_per_node,
        global_batch_size=cfg.train.global_batch_size,
        seq_len=cfg.data.seq_len,
        hw=hw,
        reduce_bytes=planner.grad_reduce_bytes(cfg),
        document_mask=cfg.data.document_mask,
        fp16=cfg.train.dtype == "fp16",
        element_bytes=planner.activation_element_bytes(cfg),
    )
    try:
        _, chosen, _ = planner.pick(cfg, estimates, cluster.world_size, cluster.gpus_per_node)
        keys = [(k, v) for k, v in planner.layout_overrides(chosen.layout) if _value(cfg, k) != v]
        best = " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in keys)
        reason = f"{chosen.layout.describe()}, {chosen.memory.peak / GIB:.1f} GiB/GPU"
    except ConfigError:
        pass  # nothing fits (or nothing this config can run) on these nodes
    nodes_needed = None
    nodes = cluster.nodes * 2
    while nodes <= cluster.nodes * _MAX_NODE_FACTOR:
        world = nodes * cluster.gpus_per_node
        try:
            config_mod.check_world(cfg, world)
            bigger = planner.layout_of(cfg, world)
        except (ConfigError, ValueError):
            break  # the global batch does not split over more ranks
        if _need(cfg, bigger, cluster.gpus_per_node) <= usable:
            nodes_needed = nodes
            break
        nodes *= 2
    return FitCheck(layout, need, usable, cluster.nodes, cluster.gpus_per_node, best, reason, nodes_needed)
