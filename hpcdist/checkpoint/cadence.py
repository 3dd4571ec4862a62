"""The goodput model: what checkpoints and failures cost a run, and the checkpoint interval that costs least.

Torch-free arithmetic, shared by the planner (``hpcdist plan``: inputs from its own predictions), the report
(``hpcdist report``: inputs the run measured) and the trainer's ``checkpoint.every_minutes: auto`` (the save policy
feeds it the step time and save stall it measures).

One tier (Daly's model, "A higher order estimate of the optimum checkpoint interval for restart dumps", FGCS 2006):
failures arrive at random (exponential) with the system MTBF M = node MTBF / nodes. The run computes for an interval
tau, stalls C seconds for a save, and so on; a failure costs the recovery R (detect it, restart and initialize, load
the checkpoint, the first step) and the work since the last complete save (on average about half of tau + C: the
recomputed work). A save written in the background (async) counts only once complete, so a failure also loses the
write time W after the stall. A segment tau + C then takes ``M e^{(R+W)/M} (e^{(tau+C)/M} - 1)`` wall seconds on
average (failures during recovery and during the redone work included) and goodput = tau / that. The interval that
maximises it is Young's ``sqrt(2 C M)`` to first order (C << M); Daly's higher-order estimate
``sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + C / 18M) - C`` (M when C >= 2M) stays within a fraction of a percent of the
exact optimum of this goodput function when C is not small against M. :func:`optimal_interval` gives Daly's (it is
Young's plus terms that vanish as C / M -> 0); R and W do not move the optimum (they scale the segment's time by a
constant factor).

Two tiers, as simply as is honest: the node-local tier (a cheap snapshot to the node's disk with a peer copy) recovers
a fraction ``local_coverage`` of the failures (one lost node: its state survives on the peer), the shared tier the
rest (the node and its peer lost together, a failure of the file system or the network, a requeue onto other nodes
whose disks hold nothing of the run). Each tier is Daly's model for its own share of the failures (MTBF M / coverage,
M / (1 - coverage)) with its own cost and recovery, and their losses add: exact when one tier's failures do not change
the other's cadence, which holds while each loss is small. Without a local tier the shared tier covers every failure.
Not modelled: failures correlated in time, the time a job waits in the queue after a requeue (that is the scheduler's,
not the cadence's), a save that fails, saves at a stop or the run's end.

Intervals are compute seconds between saves (tau); checkpoint.every_minutes counts from the start of one save to the
next, i.e. tau + C: :func:`every_minutes` converts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hpcdist.config.cluster import load_cluster
from hpcdist.config.schema import JobConfig

__all__ = [
    "AUTO_DEFAULT_MINUTES",
    "DEFAULT_LOCAL_COVERAGE",
    "MAX_INTERVAL_S",
    "Prediction",
    "Recovery",
    "Split",
    "Tier",
    "assumed_recovery",
    "every_minutes",
    "failure_facts",
    "in_job_restart",
    "local_coverage",
    "node_mtbf_hours",
    "optimal_interval",
    "predict",
    "segment_split",
    "system_mtbf_s",
    "young_interval",
]

# checkpoint.every_minutes=auto before the run has measured a save: the interval the trainer uses until then.
AUTO_DEFAULT_MINUTES = 30.0
# The longest interval the model recommends: where failures are so rare that the optimum runs to days, a shared
# checkpoint a few times a day still bounds what a requeue, a user's restart or a lost file system costs.
MAX_INTERVAL_S = 6 * 3600.0
# Share of failures the node-local tier recovers where it can (peer copies on another node, a restart that keeps the
# surviving nodes): an assumption. Most interruptions of large runs are one GPU or one host (Llama 3: 78% hardware,
# most of it single GPUs); the rest (a node and its peer together, a switch, the file system, a bug that fails
# again) need the shared tier.
DEFAULT_LOCAL_COVERAGE = 0.9
# A recovery's parts where nothing measured them (a plan; a run without a failure yet): assumptions.
INIT_S = 60.0  # process start to the loop, less the load: imports, rendezvous, model build, data
REQUEUE_S = 120.0  # a requeue's restart: SLURM's requeue hold and the scheduler (the queue wait not counted)
HEALTH_GATE_S = 30.0  # an in-job restart: the health gate on every node
FIRST_STEP_STEPS = 2.0  # the first step after a restart, in steps (communicators, allocator warm-up)


@dataclass(frozen=True)
class Recovery:
    """Seconds from a failure to the first completed step after it, by part (goodput.json's recovery split)."""

    detect_s: float
    """The failure until it is noticed: a crash ends srun at once, a hang waits for the watchdog."""
    restart_s: float
    """Noticed until the new processes start: in-job restart's backoff and health gate, or a requeue's hold."""
    init_s: float
    """Process start to the loop, less the load: imports, rendezvous, model build, data."""
    load_s: float
    """Reading the checkpoint back."""
    first_step_s: float
    """The first step (communicator set-up and compilation make it slower than the others)."""

    @property
    def total_s(self) -> float:
        return self.detect_s + self.restart_s + self.init_s + self.load_s + self.first_step_s


@dataclass(frozen=True)
class Tier:
    """One checkpoint tier: its stall per save, background write time, and the recovery from it."""

    cost_s: float
    """Seconds the training loop stalls per save (an async save: the copy into host buffers and its fence)."""
    recovery: Recovery
    write_s: float = 0.0
    """Seconds a save goes on writing after the stall (async saves): a failure then also loses them."""


def system_mtbf_s(node_mtbf_hours: float, nodes: int) -> float:
    """Mean time between failures of the whole job, seconds: any one node failing stops it."""
    return node_mtbf_hours * 3600.0 / max(1, nodes)


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum, sqrt(2 C M) compute seconds between saves."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def optimal_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order estimate of the compute seconds between saves that maximise goodput (module docstring),
    at most :data:`MAX_INTERVAL_S`; Young's sqrt(2 C M) is its first term. A free save (C = 0): save every step
    (0 here; the caller's step time is the floor)."""
    if not math.isfinite(mtbf_s):
        return MAX_INTERVAL_S
    if cost_s <= 0:
        return 0.0
    if cost_s >= 2.0 * mtbf_s:
        return min(mtbf_s, MAX_INTERVAL_S)
    x = cost_s / (2.0 * mtbf_s)
    tau = young_interval(cost_s, mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - cost_s
    return min(max(tau, 0.0), MAX_INTERVAL_S)


@dataclass(frozen=True)
class Split:
    """Fractions of wall time of one tier's model: useful work and the three losses (they sum to 1)."""

    useful: float
    checkpoint: float
    recompute: float
    recovery: float


def segment_split(interval_s: float, tier: Tier, mtbf_s: float) -> Split:
    """Where the wall time goes in Daly's model of one tier: ``interval_s`` of compute between saves, failures with
    MTBF ``mtbf_s`` (infinite: none). The stall is the tier's cost, plus the rest of the previous save's background
    write when the interval is shorter than it. Per segment, failures before it completes: e^{T/M} - 1 (T = interval
    + stall);
    recomputed work: the work lost to them (about T/2 each) plus the background write W each; recovery: R each, the
    failures during a recovery included."""
    tau = max(interval_s, 0.0)
    # one save in flight at a time: a save due before the previous one's background write ended waits for it
    c = max(tier.cost_s, 0.0) + max(0.0, tier.write_s - tau)
    t = tau + c
    if t <= 0:
        return Split(0.0, 0.0, 0.0, 1.0)
    if not math.isfinite(mtbf_s):
        return Split(tau / t, c / t, 0.0, 0.0)
    m = mtbf_s
    failures = math.expm1(t / m)  # expected failures before the segment completes
    lost = m * failures - t  # the work since the segment's start at each failure, summed
    restart = tier.recovery.total_s + tier.write_s
    restart_total = failures * m * math.expm1(restart / m)  # recovery + redone write, failures during them included
    rec_share = tier.recovery.total_s / restart if restart > 0 else 0.0
    total = t + lost + restart_total  # = M e^{(R+W)/M} (e^{T/M} - 1)
    return Split(
        useful=tau / total,
        checkpoint=c / total,
        recompute=(lost + restart_total * (1.0 - rec_share)) / total,
        recovery=restart_total * rec_share / total,
    )


@dataclass(frozen=True)
class Prediction:
    """Predicted goodput and its losses (fractions of wall time), the intervals used and the failure rate."""

    goodput: float
    checkpoint: float
    """Both tiers' save stalls."""
    recompute: float
    """Work done again after failures (since the last complete save of the tier that recovered it)."""
    recovery: float
    """Detect, restart, init, load, first step: per failure."""
    shared_interval_s: float
    """Compute seconds between shared saves."""
    local_interval_s: float | None
    """Compute seconds between node-local saves; None without a local tier."""
    system_mtbf_s: float
    nodes: int
    shared_optimal: bool
    """The shared interval is the model's optimum (not a given cadence)."""


def predict(
    *,
    node_mtbf_hours: float,
    nodes: int,
    shared: Tier,
    local: Tier | None = None,
    local_coverage: float = DEFAULT_LOCAL_COVERAGE,
    step_s: float = 0.0,
    shared_interval_s: float | None = None,
    local_interval_s: float | None = None,
) -> Prediction:
    """Goodput of a job of ``nodes`` nodes: the shared tier (and the node-local one, if given, recovering
    ``local_coverage`` of the failures) saving every ``*_interval_s`` compute seconds, or at the model's optimum where
    None (never more often than every step, ``step_s``, nor than the tier's background write). The module
    docstring says the model and its assumptions."""
    mtbf = system_mtbf_s(node_mtbf_hours, nodes)
    coverage = min(max(local_coverage, 0.0), 1.0) if local is not None else 0.0
    shared_mtbf = mtbf / (1.0 - coverage) if coverage < 1.0 else math.inf
    optimal = shared_interval_s is None
    if shared_interval_s is None:  # never more often than every step, nor than a background write takes
        shared_interval_s = max(optimal_interval(shared.cost_s, shared_mtbf), step_s, shared.write_s)
    parts = [segment_split(shared_interval_s, shared, shared_mtbf)]
    if local is not None:
        local_mtbf = mtbf / coverage if coverage > 0 else math.inf
        if local_interval_s is None:
            local_interval_s = max(optimal_interval(local.cost_s, local_mtbf), step_s, local.write_s)
        parts.append(segment_split(local_interval_s, local, local_mtbf))
    checkpoint = sum(p.checkpoint for p in parts)
    recompute = sum(p.recompute for p in parts)
    recovery = sum(p.recovery for p in parts)
    return Prediction(
        goodput=max(0.0, 1.0 - checkpoint - recompute - recovery),
        checkpoint=checkpoint,
        recompute=recompute,
        recovery=recovery,
        shared_interval_s=shared_interval_s,
        local_interval_s=local_interval_s,
        system_mtbf_s=mtbf,
        nodes=nodes,
        shared_optimal=optimal,
    )


def every_minutes(interval_s: float, cost_s: float) -> float:
    """checkpoint.every_minutes for ``interval_s`` compute seconds between saves of ``cost_s`` stall each: the clock
    counts from the start of the last save, so the save's own stall is part of the interval."""
    return (interval_s + cost_s) / 60.0


def local_coverage(cfg: JobConfig, nodes: int) -> float:
    """The share of failures the job's node-local tier recovers (:data:`DEFAULT_LOCAL_COVERAGE`) where it can: a
    tier is configured, its steps have peer copies on another node (more than one node), and a failure restarts in
    the same allocation (hot spares or shrinking: fault.spare_nodes, fault.min_nodes), whose surviving nodes still
    hold their files. A requeue lands on nodes whose disks may hold nothing of the run: 0 then."""
    in_job = in_job_restart(cfg, nodes)
    return DEFAULT_LOCAL_COVERAGE if cfg.checkpoint.local.dir and nodes > 1 and in_job else 0.0


def in_job_restart(cfg: JobConfig, nodes: int) -> bool:
    """A failure restarts inside the allocation (hot spares, or shrinking to fault.min_nodes), not by a requeue."""
    return cfg.fault.spare_nodes > 0 or 0 < cfg.fault.min_nodes < nodes


def assumed_recovery(cfg: JobConfig, *, nodes: int, step_s: float, load_s: float) -> Recovery:
    """A recovery's parts where none was measured: detection by the hang watchdog (a crash ends srun at once: the
    watchdog's timeout is the slower of the two), the restart path ``cfg``'s fault section takes, the constants
    above, ``load_s`` to read the checkpoint back."""
    f = cfg.fault
    return Recovery(
        detect_s=f.watchdog_timeout_s or REQUEUE_S,
        restart_s=f.restart_backoff_s + HEALTH_GATE_S if in_job_restart(cfg, nodes) else REQUEUE_S,
        init_s=INIT_S,
        load_s=load_s,
        first_step_s=FIRST_STEP_STEPS * step_s,
    )


def node_mtbf_hours(profile: str) -> float | None:
    """The node MTBF of cluster profile ``profile`` (a shipped name or a YAML path): hardware.node_mtbf_hours, None
    where the profile has none."""
    hw = load_cluster(profile).hardware
    return hw.node_mtbf_hours if hw is not None else None


def failure_facts(cfg: JobConfig, nodes: int) -> dict[str, Any]:
    """What checkpoint.every_minutes=auto assumes about failures for ``cfg`` on ``nodes`` nodes: the node MTBF of
    parallel.auto_cluster's profile, the nodes and the node-local tier's coverage (``SavePolicy.expect_failures``)."""
    return {
        "node_mtbf_hours": node_mtbf_hours(cfg.parallel.auto_cluster),
        "nodes": nodes,
        "local_coverage": local_coverage(cfg, nodes),
    }
