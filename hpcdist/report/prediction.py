"""The goodput model's prediction from a run's own measurements, beside the goodput the run measured.

Inputs, each from the run directory: the step time (metrics.jsonl's step_time_s, else train time / steps), the
stall per shared and node-local save (goodput.json's per-tier save counts and seconds; an async save's later waits
count to the shared tier), the cadence the run kept (train time / saves), the recoveries it measured (their mean
per part; without a failure yet the model's assumptions for the run's fault section), the nodes (ranks.json) and
the node MTBF of the run's parallel.auto_cluster profile. Background writes are not measured: an async save's
write after its stall is left out (it moves a failure's loss by a few seconds at most).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import yaml

from hpcdist import config as config_mod
from hpcdist.base import safe_yaml
from hpcdist.base.untrusted import one_line
from hpcdist.checkpoint import cadence
from hpcdist.checkpoint.cadence import Prediction, Recovery, Tier
from hpcdist.config import loader as config_loader
from hpcdist.report.rundata import RunData

__all__ = ["RunPrediction", "predict_run"]


@dataclass(frozen=True)
class RunPrediction:
    """The model's inputs as measured, and its predictions at the run's cadence and at the recommended one."""

    inputs: dict[str, Any]
    at_run_cadence: Prediction
    recommended: Prediction


def _step_s(data: RunData) -> float | None:
    times = [r["step_time_s"] for r in data.train if isinstance(r.get("step_time_s"), (int, float))]
    if times:
        return float(statistics.median(times))
    steps = sum(max(0, (a.last_step or a.first_step) - a.first_step) for a in data.attempts)
    train = data.goodput.get("train", 0.0)
    return train / steps if steps > 0 and train > 0 else None


def _recovery(data: RunData, cfg: config_mod.JobConfig, nodes: int, step_s: float, load_s: float) -> Recovery:
    recs = [a.recovery for a in data.attempts if a.recovery]

    def mean(*keys: str) -> float:
        return statistics.fmean(sum(float(r.get(k) or 0.0) for k in keys) for r in recs)

    if not recs:
        return cadence.assumed_recovery(cfg, nodes=nodes, step_s=step_s, load_s=load_s)
    return Recovery(
        detect_s=mean("detection"),
        restart_s=mean("wait", "gate", "step_start"),
        init_s=mean("init"),
        load_s=mean("checkpoint_load"),
        first_step_s=mean("first_step"),
    )


def predict_run(data: RunData) -> RunPrediction | str:
    """The prediction for the run in ``data``, or a line saying which input is missing."""
    step_s = _step_s(data)
    saves = data.saves
    shared_n, local_n = int(saves.get("saves_shared", 0)), int(saves.get("saves_local", 0))
    if step_s is None or shared_n == 0:
        return "no prediction yet: the run has not measured a step and a shared checkpoint save"
    # the config as the report read it (bounded, never through a link or a FIFO), not the file again
    problems: list[str] = []
    try:
        tree = safe_yaml.load_text(data.config_text) if data.config_text else None
        if not isinstance(tree, dict):
            raise ValueError("not a mapping")
        cfg = config_loader.build(config_mod.JobConfig, tree, "", problems)
    except (yaml.YAMLError, ValueError) as e:
        problems.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
    if problems:
        return f"no prediction: the run's config.yaml does not load ({one_line(problems[0])})"
    nodes = max(1, len(set(data.hosts)))
    try:
        facts = cadence.failure_facts(cfg, nodes)
    except (config_mod.ConfigError, OSError) as e:
        return f"no prediction: cluster profile {cfg.parallel.auto_cluster!r} does not load ({e})"
    if facts["node_mtbf_hours"] is None:
        return f"no prediction: cluster profile {cfg.parallel.auto_cluster!r} gives no hardware.node_mtbf_hours"
    g = data.goodput
    local_s = float(saves.get("save_local_s", 0.0))
    # the shared saves' own stall, plus the waits of async saves after them (all checkpoint time not local)
    shared_cost = max(0.0, g.get("checkpoint_save", 0.0) - local_s) / shared_n
    restores = [a.seconds.get("restore", 0.0) for a in data.attempts if a.seconds.get("restore", 0.0) > 0]
    load_s = statistics.fmean(restores) if restores else shared_cost
    recovery = _recovery(data, cfg, nodes, step_s, load_s)
    shared = Tier(shared_cost, recovery)
    local = Tier(local_s / local_n, recovery) if local_n else None
    train = g.get("train", 0.0)
    kwargs: dict[str, Any] = {
        "node_mtbf_hours": facts["node_mtbf_hours"],
        "nodes": nodes,
        "shared": shared,
        "local": local,
        "local_coverage": facts["local_coverage"],
        "step_s": step_s,
    }
    run_interval = max(train / shared_n, step_s)
    at_run = cadence.predict(
        **kwargs, shared_interval_s=run_interval, local_interval_s=max(train / local_n, step_s) if local_n else None
    )
    inputs = {
        "step_s": step_s,
        "shared_save_s": shared_cost,
        "shared_saves": shared_n,
        "local_save_s": local.cost_s if local else None,
        "local_saves": local_n,
        "recovery": recovery,
        "recovery_measured": any(a.recovery for a in data.attempts),
        "nodes": nodes,
        "node_mtbf_hours": facts["node_mtbf_hours"],
        "profile": cfg.parallel.auto_cluster,
    }
    return RunPrediction(inputs=inputs, at_run_cadence=at_run, recommended=cadence.predict(**kwargs))
