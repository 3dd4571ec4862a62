"""The goodput model's inputs at plan time, and the lines ``hpcdist plan`` and ``hpcdist report`` print from it.

What a plan cannot measure comes from the planner's own predictions (the layout's step time) and from stated
assumptions (the constants below): the checkpoint's state is fp32 weights + AdamW's two moments (12 bytes per
parameter, what the trainer's staging estimate counts), written by every node in parallel at
hardware.storage_write_gbps per node (the file system is assumed to scale with the job: at thousands of nodes its
aggregate bandwidth is the real limit, so the large-scale rows are a best case for the shared tier), plus a fixed
cost per save. The model itself is :mod:`hpcdist.checkpoint.cadence`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpcdist.checkpoint import cadence
from hpcdist.checkpoint.cadence import Prediction, Tier
from hpcdist.config.cluster import ClusterConfig, HardwareConfig
from hpcdist.config.schema import JobConfig
from hpcdist.models.args import num_params
from hpcdist.planning.layouts import StepEstimate, config_estimate

__all__ = [
    "PlanInputs",
    "for_config",
    "goodput_lines",
    "plan_inputs",
    "prediction_rows",
    "scale_nodes",
    "shared_mtbf_s",
]

STATE_BYTES_PER_PARAM = 12  # fp32 weights + AdamW's two fp32 moments
# Assumptions where the profile says nothing (a site replaces them with measurements):
DEFAULT_STORAGE_GBPS = 2.0  # shared file system write per node, GB/s: a parallel file system client
SAVE_FIXED_S = 5.0  # per shared save: the agreements, manifest, completion marker, metadata operations
LOCAL_WRITE_GBPS = 10.0  # node-local tier, GB/s per node: /dev/shm or a local NVMe array
HOST_COPY_GBPS = 10.0  # an async save's stall: device -> host staging copy, GB/s per GPU
ASYNC_FIXED_S = 1.0  # an async save's stall besides the copy: the agreements before it, the staging fence
SCALES_GPUS = (1024, 16384)  # the larger jobs a plan shows beside the configured one


@dataclass(frozen=True)
class PlanInputs:
    """Everything the model is given for one job, with where each number came from."""

    step_s: float
    state_bytes: float
    nodes: int
    gpus_per_node: int
    node_mtbf_hours: float
    shared: Tier
    local: Tier | None
    local_coverage: float
    storage_gbps: float
    storage_assumed: bool
    async_save: bool
    configured_interval_s: float | None
    """The config's own shared cadence in compute seconds (every_steps x step, every_minutes), None for auto."""
    configured_local_interval_s: float | None = None
    """The config's node-local cadence in compute seconds, None without a local tier."""

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def plan_inputs(
    cfg: JobConfig, hw: HardwareConfig, *, params: int, nodes: int, gpus_per_node: int, step_s: float
) -> PlanInputs | None:
    """The model's inputs for ``cfg`` on ``nodes`` x ``gpus_per_node`` GPUs at the planner's ``step_s``; None
    where the profile has no node MTBF."""
    if hw.node_mtbf_hours is None:
        return None
    state = float(STATE_BYTES_PER_PARAM * params)
    per_node = state / nodes
    gbps = hw.storage_write_gbps or DEFAULT_STORAGE_GBPS
    write_s = SAVE_FIXED_S + per_node / (gbps * 1e9)
    c = cfg.checkpoint
    if c.async_save:  # the loop stalls for the copy into host buffers; the write goes on behind training
        stall = ASYNC_FIXED_S + state / (nodes * gpus_per_node) / (HOST_COPY_GBPS * 1e9)
        shared = Tier(stall, cadence.assumed_recovery(cfg, nodes=nodes, step_s=step_s, load_s=write_s), write_s=write_s)
    else:
        shared = Tier(write_s, cadence.assumed_recovery(cfg, nodes=nodes, step_s=step_s, load_s=write_s))
    local = None
    if c.local.dir:
        local_s = per_node / (LOCAL_WRITE_GBPS * 1e9)
        peer_s = per_node / ((hw.inter_node_busbw_gbps or LOCAL_WRITE_GBPS) * 1e9) if nodes > 1 else 0.0
        # staged into the tier's host buffers beside the next step's forward and backward, then written and copied
        # behind training: the loop waits at most for that copy (counted here as if nothing overlapped it)
        stall = state / (nodes * gpus_per_node) / (HOST_COPY_GBPS * 1e9)
        recovery = cadence.assumed_recovery(cfg, nodes=nodes, step_s=step_s, load_s=local_s)
        local = Tier(stall, recovery, write_s=local_s + peer_s)
    local_every = [c.local.every_steps * step_s] if c.local.every_steps > 0 else []
    if c.local.every_minutes > 0 and local is not None:
        local_every.append(max(c.local.every_minutes * 60 - local.cost_s, step_s))
    every = [c.every_steps * step_s] if c.every_steps > 0 else []
    if isinstance(c.every_minutes, float) and c.every_minutes > 0:
        every.append(max(c.every_minutes * 60 - shared.cost_s, step_s))
    # auto: no configured cadence; no periodic save: the run's end (or a stop) is the only one
    configured = None if c.every_minutes == "auto" else min(every) if every else cfg.train.steps * step_s
    return PlanInputs(
        step_s=step_s,
        state_bytes=state,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        node_mtbf_hours=hw.node_mtbf_hours,
        shared=shared,
        local=local,
        local_coverage=cadence.local_coverage(cfg, nodes),
        storage_gbps=gbps,
        storage_assumed=hw.storage_write_gbps is None,
        async_save=c.async_save,
        configured_interval_s=configured,
        configured_local_interval_s=min(local_every) if local is not None and local_every else None,
    )


def scale_nodes(cfg: JobConfig, inputs: PlanInputs, hw: HardwareConfig, *, params: int, gpus: int) -> PlanInputs:
    """``inputs`` for the same model on ``gpus`` GPUs: the same step time (the global batch grows with the GPUs),
    the same state spread over more nodes. The configured cadence keeps its step count."""
    nodes = max(1, math.ceil(gpus / inputs.gpus_per_node))
    out = plan_inputs(cfg, hw, params=params, nodes=nodes, gpus_per_node=inputs.gpus_per_node, step_s=inputs.step_s)
    assert out is not None  # the same profile: its MTBF is there
    return out


def for_config(
    cfg: JobConfig,
    estimates: list[StepEstimate],
    *,
    cluster: ClusterConfig,
    hw: HardwareConfig,
    scales: tuple[int, ...] = SCALES_GPUS,
) -> tuple[PlanInputs, list[PlanInputs]] | None:
    """The model's inputs for the config's layout among the ranked ``estimates`` (the top fitting row for
    parallel.strategy=auto or a layout the planner lacks) on ``cluster``, and the same job at each of ``scales``
    GPUs larger than it; None without a node MTBF in the profile."""
    world = cluster.nodes * cluster.gpus_per_node
    est = config_estimate(cfg, estimates, world)
    params = num_params(cfg.model_args())
    inputs = plan_inputs(
        cfg, hw, params=params, nodes=cluster.nodes, gpus_per_node=cluster.gpus_per_node, step_s=est.step_s
    )
    if inputs is None:
        return None
    return inputs, [scale_nodes(cfg, inputs, hw, params=params, gpus=n) for n in scales if n > world]


def _predict(inputs: PlanInputs, interval_s: float | None, local_interval_s: float | None = None) -> Prediction:
    return cadence.predict(
        node_mtbf_hours=inputs.node_mtbf_hours,
        nodes=inputs.nodes,
        shared=inputs.shared,
        local=inputs.local,
        local_coverage=inputs.local_coverage,
        step_s=inputs.step_s,
        shared_interval_s=interval_s,
        local_interval_s=local_interval_s,
    )


def prediction_rows(inputs: PlanInputs) -> list[tuple[str, Prediction]]:
    """The config's cadence (where it has one) and the recommended one, each predicted."""
    configured = inputs.configured_interval_s
    rows = [("configured", _predict(inputs, configured, inputs.configured_local_interval_s))] if configured else []
    return [*rows, ("recommended", _predict(inputs, None))]


def shared_mtbf_s(inputs: PlanInputs) -> float:
    """The MTBF of the failures the shared tier recovers (all of them without a node-local tier)."""
    system = cadence.system_mtbf_s(inputs.node_mtbf_hours, inputs.nodes)
    share = 1.0 - (inputs.local_coverage if inputs.local is not None else 0.0)
    return system / share if share > 0 else math.inf


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def _cadence_text(p: Prediction, inputs: PlanInputs) -> str:
    minutes = cadence.every_minutes(p.shared_interval_s, inputs.shared.cost_s)
    steps = p.shared_interval_s / inputs.step_s if inputs.step_s > 0 else math.inf
    text = f"every {minutes:,.1f} min (~{steps:,.0f} steps)"
    if p.local_interval_s is not None and inputs.local is not None:
        local_min = cadence.every_minutes(p.local_interval_s, inputs.local.cost_s)
        text += f", local every {local_min:,.1f} min"
    return text


def goodput_lines(inputs: PlanInputs, scaled: list[PlanInputs], *, profile: str) -> list[str]:
    """``hpcdist plan``'s goodput section: the inputs, one row per job size and cadence, the recommendation."""
    s = inputs.shared
    r = s.recovery
    gb = inputs.state_bytes / 1e9
    bw = f"{inputs.storage_gbps:g} GB/s per node" + (" assumed" if inputs.storage_assumed else "")
    save = (
        f"stall {s.cost_s:.1f} s (async: host copy) + {s.write_s:.1f} s background write"
        if inputs.async_save
        else f"stall {s.cost_s:.1f} s"
    )
    lines = [
        f"Goodput (hpcdist.checkpoint.cadence: Daly's model; node MTBF {inputs.node_mtbf_hours:,.0f} h from cluster "
        f"{profile}, system MTBF = node MTBF / nodes):",
        f"  inputs: step {inputs.step_s:.2f} s (the layout's prediction); shared save of {gb:,.1f} GB state at {bw}: "
        f"{save}; recovery {r.total_s:.0f} s = detect {r.detect_s:.0f} + restart {r.restart_s:.0f} + init "
        f"{r.init_s:.0f} + load {r.load_s:.1f} + first step {r.first_step_s:.1f}",
    ]
    if inputs.local is not None:
        lines.append(
            f"  node-local tier: stall {inputs.local.cost_s:.1f} s (host copy) + {inputs.local.write_s:.1f} s "
            f"background write and peer copy, recovers {100 * inputs.local_coverage:.0f}% of failures (in-job restart "
            "with peer copies; else 0)"
        )
    header = (
        f"  {'GPUs':>7} {'nodes':>6} {'MTBF h':>9}  {'cadence':<12} {'goodput':>8} {'ckpt':>7} {'recomp':>7} "
        f"{'recov':>7}  interval"
    )
    lines.append(header)
    for inp in [inputs, *scaled]:
        for label, p in prediction_rows(inp):
            lines.append(
                f"  {inp.gpus:>7,} {inp.nodes:>6,} {p.system_mtbf_s / 3600:>9,.2f}  {label:<12} {_pct(p.goodput):>8} "
                f"{_pct(p.checkpoint):>7} {_pct(p.recompute):>7} {_pct(p.recovery):>7}  {_cadence_text(p, inp)}"
            )
    best = prediction_rows(inputs)[-1][1]
    minutes = cadence.every_minutes(best.shared_interval_s, s.cost_s)
    young = min(cadence.young_interval(s.cost_s, shared_mtbf_s(inputs)), cadence.MAX_INTERVAL_S)
    lines.append(
        f"  recommended for this job: checkpoint.every_minutes={minutes:.0f} (Daly's optimum; Young's sqrt(2CM) "
        f"{young / 60:,.1f} min of compute), or checkpoint.every_minutes=auto to use the run's measured step and "
        "save times"
    )
    lines.append(
        "  ckpt = save stalls, recomp = work redone after failures, recov = detect + restart + init + load + first "
        f"step; larger jobs: same step time and state (global batch grown with the GPUs), {SAVE_FIXED_S:g} s fixed "
        "per shared write, file-system bandwidth scaling with the nodes (hpcdist.planning.goodput)"
    )
    return lines
