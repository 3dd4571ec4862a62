"""Goodput benchmark: what the goodput model predicts for the 13B flagship (configs/train_13b.yaml) on 32 A100
(4 nodes of cluster a100_ib) at Llama 3's failure rate (the profile's hardware.node_mtbf_hours: 466 interruptions
in 54 days on 2,048 8-GPU nodes -> 5,696 h per node), and the same job at 1,024 and 16,384 GPUs.

Nothing is timed: every input is the planner's (the layout's predicted step time, the state size, the stated
bandwidth and recovery assumptions of hpcdist.planning.goodput and hpcdist.checkpoint.cadence), printed beside the
table. Three setups of the same job:

- ``as shipped``: the config's shared tier (async saves every 500 steps), failures recovered by a requeue;
- ``shared auto``: the same with the model's recommended shared interval (checkpoint.every_minutes: auto);
- ``two tiers``: a node-local tier (/dev/shm, peer copies) with a hot spare node (in-job restart), both tiers at
  the model's intervals.

Goal (reported, never enforced): >= 97% predicted goodput. Run from the repository root::

    python tools/bench/goodput.py                       # well under a second
    python tools/bench/goodput.py --json runs/bench/my.json

It prints one table and writes every number to ``--json`` (default runs/bench/goodput.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

GOAL = 0.97
SETUPS = {
    "as shipped": [],
    "shared auto": ["checkpoint.every_minutes=auto"],
    "two tiers": [
        "checkpoint.every_minutes=auto",
        "checkpoint.local.dir=/dev/shm/hpcdist-{job_id}",
        "checkpoint.local.every_minutes=10",
        "fault.spare_nodes=1",
    ],
}


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="configs/train_13b.yaml", help="job config (default: the 13B flagship)")
    p.add_argument("--nodes", type=int, default=4, help="nodes of the configured job (default 4 = 32 GPUs)")
    p.add_argument("--cluster", default="a100_ib", help="cluster profile (default a100_ib)")
    p.add_argument("--json", type=Path, default=Path("runs/bench/goodput.json"), help="where to write the numbers")
    return p.parse_args()


def main() -> int:
    args = _parse()
    from hpcdist import config as config_mod
    from hpcdist.checkpoint import cadence
    from hpcdist.config.cluster import cluster_hardware, load_cluster
    from hpcdist.planning import goodput
    from hpcdist.planning import layouts as planner

    cluster = load_cluster(args.cluster, nodes=args.nodes)
    hw = cluster_hardware(cluster)
    rows, inputs_out = [], {}
    print(
        f"goodput model (hpcdist.checkpoint.cadence), {args.config} on cluster {cluster.name}: node MTBF "
        f"{hw.node_mtbf_hours:,.0f} h"
    )
    header = (
        f"{'setup':<12} {'GPUs':>7} {'nodes':>6} {'MTBF h':>8} {'cadence':<12} {'goodput':>8} {'ckpt':>7} "
        f"{'recomp':>7} {'recov':>7} {'shared min':>10} {'local min':>9} {'goal':>5}"
    )
    print(header)
    for name, overrides in SETUPS.items():
        cfg = config_mod.load(args.config, overrides)
        world = cluster.nodes * cluster.gpus_per_node
        estimates = planner.rank_config_layouts(
            cfg, cfg.model_args(), world_size=world, gpus_per_node=cluster.gpus_per_node, hw=hw
        )
        found = goodput.for_config(cfg, estimates, cluster=cluster, hw=hw)
        if found is None:
            print(f"cluster {cluster.name} gives no hardware.node_mtbf_hours", file=sys.stderr)
            return 1
        base, scaled = found
        inputs_out[name] = [_inputs(i) for i in (base, *scaled)]
        for inp in (base, *scaled):
            for label, p in goodput.prediction_rows(inp):
                shared_min = cadence.every_minutes(p.shared_interval_s, inp.shared.cost_s)
                local_min = (
                    cadence.every_minutes(p.local_interval_s, inp.local.cost_s)
                    if p.local_interval_s is not None and inp.local is not None
                    else None
                )
                row = {
                    "setup": name,
                    "gpus": inp.gpus,
                    "nodes": inp.nodes,
                    "system_mtbf_h": p.system_mtbf_s / 3600,
                    "cadence": label,
                    "goodput": p.goodput,
                    "checkpoint": p.checkpoint,
                    "recompute": p.recompute,
                    "recovery": p.recovery,
                    "shared_every_minutes": shared_min,
                    "local_every_minutes": local_min,
                    "meets_goal": p.goodput >= GOAL,
                }
                rows.append(row)
                local_text = f"{local_min:>9.1f}" if local_min is not None else f"{'-':>9}"
                goal = "yes" if row["meets_goal"] else "no"
                print(
                    f"{name:<12} {inp.gpus:>7,} {inp.nodes:>6,} {row['system_mtbf_h']:>8,.2f} {label:<12} "
                    f"{100 * p.goodput:>7.2f}% {100 * p.checkpoint:>6.2f}% {100 * p.recompute:>6.2f}% "
                    f"{100 * p.recovery:>6.2f}% {shared_min:>10.1f} {local_text} {goal:>5}"
                )
    first = inputs_out["as shipped"][0]
    rec, shared = first["shared"]["recovery"], first["shared"]
    print(
        f"inputs (32 GPUs, as shipped): step {first['step_s']:.2f} s (planner), state {first['state_bytes'] / 1e9:.1f} "
        f"GB, shared save stall {shared['cost_s']:.2f} s + background write {shared['write_s']:.1f} s "
        f"at {first['storage_gbps']:g} GB/s per node{' (assumed)' if first['storage_assumed'] else ''}; recovery "
        f"{sum(rec.values()):.0f} s = " + " + ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in rec.items())
    )
    two = inputs_out["two tiers"][0]
    print(
        f"two tiers: local stall {two['local']['cost_s']:.2f} s, peer copy {two['local']['write_s']:.2f} s, covers "
        f"{100 * two['local_coverage']:.0f}% of failures; in-job restart {two['shared']['recovery']['restart_s']:.0f} s"
    )
    print(f"goal: >= {100 * GOAL:g}% predicted goodput (reported, not enforced)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"goal": GOAL, "rows": rows, "inputs": inputs_out}, indent=1))
    print(f"wrote {args.json}")
    return 0


def _inputs(inp: Any) -> dict[str, Any]:
    return dataclasses.asdict(inp)


if __name__ == "__main__":
    sys.exit(main())
