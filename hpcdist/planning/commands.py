"""The planner's commands: ``hpcdist plan`` (memory per strategy, layouts ranked by modelled step time, what
``parallel.strategy=auto`` would take) and ``hpcdist train --dry-run`` (the real parallelize on a meta model).
Refusals are ``CommandError`` lines printed by hpcdist.cli; torch loads only in the dry run."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

from hpcdist import config as config_mod
from hpcdist.base.errors import CommandError, refusing
from hpcdist.config.command import warn_data
from hpcdist.planning.memory import GIB


@refusing("train --dry-run", ValueError, RuntimeError, passing=(config_mod.ConfigError,))
def cmd_dry_run(args: argparse.Namespace) -> int:
    from hpcdist.planning.dryrun import dry_run, parse_ranks

    cfg = config_mod.load(args.config, args.overrides)
    warn_data(cfg)
    world = args.world_size or 8
    ranks = None if args.ranks is None else parse_ranks(args.ranks, world)  # None: the dry run's default
    report = dry_run(cfg, world, cluster=args.cluster or "a100_ib", ranks=ranks)
    print(report.text(), end="", flush=True)
    if report.snapshot is not None and report.snapshot.problem:
        raise CommandError(f"train --dry-run: {report.snapshot.problem}", code=1)
    if report.fits is False:
        raise CommandError(
            # the report above names the model's build when it is the larger of the two
            f"train --dry-run: the memory estimate ({report.memory.peak / GIB:.1f} GiB per GPU) does not fit; "
            "see hpcdist plan for layouts that do",
            code=1,
        )
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from hpcdist.config.cluster import load_cluster
    from hpcdist.planning import layouts as planner
    from hpcdist.planning.memory import plan_table

    cfg = config_mod.load(args.config, args.overrides)
    shape = {k: v for k, v in (("nodes", args.nodes), ("gpus_per_node", args.gpus_per_node)) if v is not None}
    cluster = load_cluster(args.cluster, **shape)
    if cluster.gpus_per_node < 1:
        raise CommandError(f"plan: cluster {cluster.name!r} has no GPUs; pass --gpus-per-node or a GPU --cluster")
    try:
        hw = planner.cluster_hardware(
            cluster, gpu_mem_gb=args.gpu_mem, efficiency=args.efficiency, margin_gib=args.mem_margin
        )
    except ValueError as e:
        raise CommandError(f"plan: {e}") from e
    args_model, world = cfg.model_args(), cluster.nodes * cluster.gpus_per_node
    print(
        plan_table(
            args_model,
            nodes=cluster.nodes,
            gpus_per_node=cluster.gpus_per_node,
            gpu_mem_gb=hw.gpu_mem_gb,
            micro_batch_size=cfg.train.micro_batch_size,
            seq_len=cfg.data.seq_len,
            activation_checkpointing=cfg.train.activation_checkpointing,
            document_mask=cfg.data.document_mask,
            element_bytes=planner.activation_element_bytes(cfg),
        )
    )
    t = cfg.train
    estimates = planner.rank_config_layouts(
        cfg, args_model, world_size=world, gpus_per_node=cluster.gpus_per_node, hw=hw
    )
    if not estimates:
        raise CommandError(
            f"plan: no layout splits train.global_batch_size={t.global_batch_size} over {world} GPUs; "
            f"make it a multiple of {world}"
        )
    tokens = args.tokens if args.tokens is not None else t.steps * t.global_batch_size * cfg.data.seq_len
    print(
        planner.layout_table(
            estimates,
            args=args_model,
            gpus_per_node=cluster.gpus_per_node,
            seq_len=cfg.data.seq_len,
            global_batch_size=t.global_batch_size,
            hw=hw,
            tokens=tokens,
            top=args.top,
            show_all=args.all,
        ),
        end="",
        flush=True,  # before the error line on stderr
    )
    mine = _config_layout_line(cfg, estimates, world, hw.usable_bytes)
    if mine:
        print(textwrap.fill(mine, width=118, subsequent_indent="  "), flush=True)
    for line in _goodput_lines(cfg, estimates, world, cluster, hw):
        print(line, flush=True)
    snap = _snapshot_line(cfg, estimates, world, cluster, hw)
    if snap:
        print(textwrap.fill(snap, width=118, subsequent_indent="  "), flush=True)
    spares = config_mod.describe_spares(cfg, cluster.nodes)
    for line in ([spares] if spares else []) + config_mod.shrink_problems(cfg, cluster.nodes, cluster.gpus_per_node):
        print(line, flush=True)
    if args.plot:
        from hpcdist.planning.plot import write_memory_plot
        from hpcdist.report.plots import MissingMatplotlib

        fitting = [e for e in estimates if e.fits]  # the table's rows: the top fitting, with --all the top others
        shown = [*fitting[: args.top], *([e for e in estimates if not e.fits][: args.top] if args.all else [])]
        try:
            print(f"plot: {write_memory_plot(shown, args.plot, gpu_mem_gb=hw.gpu_mem_gb, margin_gib=hw.margin_gib)}")
        except MissingMatplotlib as e:
            raise CommandError(f"plan --plot: {e}") from e
    if not any(e.fits for e in estimates):
        smallest = min(e.memory.peak for e in estimates) / GIB
        raise CommandError(
            f"plan: none of {len(estimates)} layouts fits: the smallest needs {smallest:.1f} GiB per GPU, "
            f"{hw.gpu_mem_gb - hw.margin_gib:g} GiB usable (--gpu-mem minus --mem-margin); add nodes, shorten "
            "data.seq_len or lower train.global_batch_size (--all lists them)" + _offload_hint(cfg, cluster, hw),
            code=1,
        )
    try:
        _, chosen, reason = planner.pick(cfg, estimates, world, cluster.gpus_per_node)
    except config_mod.ConfigError as e:
        print(f"auto: {e}")
        return 0
    keys = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in planner.layout_overrides(chosen.layout)]
    print(textwrap.fill(f"auto would take {reason}", width=118, subsequent_indent="  "))
    print(textwrap.fill(f"as overrides: {' '.join(keys)}", width=118, initial_indent="  ", subsequent_indent="    "))
    return 0


# The memory table's CPU-offload rows, most GPU memory saved first, and the keys that turn each on. The ranked
# layouts leave offload out (its speed is the host's and the PCIe link's, which the time model does not know).
_OFFLOAD = (
    ("zero3+offload", 3, True, "parallel.zero.offload_optimizer=true parallel.zero.offload_params=true"),
    ("zero2+offload", 2, False, "parallel.zero.offload_optimizer=true"),
)


def _offload_hint(cfg: config_mod.JobConfig, cluster: Any, hw: Any) -> str:
    """When a CPU-offload row of the memory table fits where no ranked layout does: which one and its keys."""
    from hpcdist.planning.memory import estimate_memory

    for label, stage, off_params, keys in _OFFLOAD:
        need = estimate_memory(
            cfg.model_args(),
            strategy=f"zero{stage}",
            world_size=cluster.nodes * cluster.gpus_per_node,
            gpus_per_node=cluster.gpus_per_node,
            micro_batch_size=cfg.train.micro_batch_size,
            seq_len=cfg.data.seq_len,
            activation_checkpointing=cfg.train.activation_checkpointing,
            offload_optimizer=True,
            offload_params=off_params,
            document_mask=cfg.data.document_mask,
        ).peak
        if need <= hw.usable_bytes:
            return (
                f"; with CPU offload {label} fits ({need / GIB:.1f} GiB per GPU; its speed is not modelled, so it is "
                f"not ranked): parallel.strategy=zero parallel.zero.stage={stage} {keys}"
            )
    return ""


def _config_layout_line(cfg: config_mod.JobConfig, estimates: list[Any], world: int, usable: float) -> str | None:
    """Where the config's own layout stands in the ranking: its row, memory and whether it is tight or does not
    fit (it may be far below the rows shown). None for parallel.strategy=auto or a layout the planner lacks."""
    from hpcdist.planning import layouts as planner

    try:
        layout = planner.layout_of(cfg, world)
    except ValueError:
        return None
    match = next((e for e in estimates if e.layout == layout), None)
    if match is None:
        return None
    fitting = [e for e in estimates if e.fits]
    need = f"{match.memory.peak / GIB:.1f} GiB/GPU of {usable / GIB:g} usable"
    if not match.fits:
        state = f"does not fit ({need})"
    elif match.tight:
        state = (
            f"row {fitting.index(match) + 1} of {len(fitting)} fitting, tight ({need}: within "
            f"{100 * planner.TIGHT_FRACTION:g}%)"
        )
    else:
        state = f"row {fitting.index(match) + 1} of {len(fitting)} fitting ({need})"
    return f"the config's layout: {layout.describe()}: {state}"


def _snapshot_line(cfg: config_mod.JobConfig, estimates: list[Any], world: int, cluster: Any, hw: Any) -> str | None:
    """The node-local tier's footprint for the config's layout (the top fitting row when the planner lacks it)."""
    from hpcdist.models.args import num_params
    from hpcdist.planning.goodput import STATE_BYTES_PER_PARAM
    from hpcdist.planning.layouts import config_estimate
    from hpcdist.planning.snapshot import footprint

    if not cfg.checkpoint.local.dir:
        return None
    est = config_estimate(cfg, estimates, world)
    # what a rank checkpoints: fp32 weights and AdamW's moments as the layout holds them (at least its even share:
    # an offloaded optimizer holds its state off the GPU)
    held = est.memory.params + est.memory.optimizer
    per_rank = max(held, STATE_BYTES_PER_PARAM * num_params(cfg.model_args()) / world)
    ranks = min(cluster.gpus_per_node, world)
    fp = footprint(cfg, hw, per_rank_bytes=per_rank, ranks_per_node=ranks, nodes=cluster.nodes)
    assert fp is not None  # a local dir is set
    return fp.line(cfg.checkpoint.local.dir, est.step_s) + (f": {fp.problem}" if fp.problem else "")


def _goodput_lines(cfg: config_mod.JobConfig, estimates: list[Any], world: int, cluster: Any, hw: Any) -> list[str]:
    """The goodput model's prediction for the config's layout at the profile's node MTBF, and at larger jobs."""
    from hpcdist.planning import goodput

    found = goodput.for_config(cfg, estimates, cluster=cluster, hw=hw)
    if found is None:
        return [f"goodput: cluster {cluster.name!r} gives no hardware.node_mtbf_hours: no prediction"]
    return goodput.goodput_lines(*found, profile=cluster.name)
