"""Turn a meta-device model into a trained-ready Strategy. The one place that chooses a strategy.

Order matters and is fixed (torchtitan's): tensor parallel -> activation checkpointing -> compile ->
(FSDP on meta) -> materialize + init -> data parallel wrapper -> optimizer. Only TP/FSDP can run before
materialization (they shard meta tensors, so no rank ever holds the whole model); DDP needs real parameters
because it broadcasts them from rank 0 at construction.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh

from hpcdist.config import JobConfig, grad_accum_steps
from hpcdist.env import DistEnv, export_environ
from hpcdist.models.llama import Transformer
from hpcdist.optim import build_optimizer
from hpcdist.parallel.base import Strategy
from hpcdist.parallel.ddp import DDPStrategy
from hpcdist.parallel.dims import SCHEDULES, ParallelDims, parallel_dims
from hpcdist.parallel.fsdp import FSDPStrategy, apply_fsdp, fsdp_mesh, materialize_sharded
from hpcdist.parallel.pp import part_costs, schedule_stages_per_rank, split_layers, split_model, stage_ids
from hpcdist.parallel.threed import ThreeDStrategy, materialize_parts
from hpcdist.parallel.tp import apply_tp
from hpcdist.parallel.zero import ZeroStrategy, deepspeed_config


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each transformer block in backward: activation memory per block drops to its input."""
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))


def apply_compile(model: nn.Module) -> None:
    """Compile block by block: blocks are identical, so one graph is reused and compile time stays flat in depth."""
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, torch.compile(block, fullgraph=True))


def materialize(model: nn.Module, *, device: torch.device, seed: int) -> None:
    """Allocate real storage for a meta model and initialize it identically on every rank."""
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    model.tie_weights()


def autocast_dtype(dtype: str, device: torch.device) -> torch.dtype | None:
    if dtype == "bf16" or (dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None  # fp32: no autocast


def apply_fsdp_config(model: nn.Module, mesh: DeviceMesh, cfg: JobConfig, *, device: torch.device) -> None:
    """``apply_fsdp`` with parallel.fsdp.* (strategy fsdp; also the dry run's plan). Mixed precision is FSDP's
    policy (gathered params cast once per unit), not autocast."""
    f = cfg.parallel.fsdp
    compute = autocast_dtype(cfg.train.dtype if f.param_dtype == "auto" else f.param_dtype, device)
    apply_fsdp(
        model,
        mesh,
        param_dtype=compute or torch.float32,
        reduce_dtype=torch.bfloat16 if f.reduce_dtype == "bf16" else torch.float32,
        reshard_after_forward=f.reshard_after_forward,
        cpu_offload=f.cpu_offload,
    )


def zero_ds_config(cfg: JobConfig, *, dp_size: int, device: torch.device) -> dict:
    """The DeepSpeed config for ``parallel.strategy=zero``: batch, accumulation and clipping come from the train
    and optim sections, so DeepSpeed's view of the step can never disagree with hpcdist's."""
    z = cfg.parallel.zero
    return deepspeed_config(
        stage=z.stage, micro_batch_size=cfg.train.micro_batch_size, grad_accum=grad_accum_steps(cfg, dp_size),
        dp_size=dp_size, grad_clip=cfg.optim.grad_clip,
        bf16=autocast_dtype(cfg.train.dtype, device) is torch.bfloat16, offload_optimizer=z.offload_optimizer,
        offload_params=z.offload_params, overlap_comm=z.overlap_comm,
        buckets=(z.reduce_bucket_size, z.allgather_bucket_size),
        param_persistence_threshold=z.param_persistence_threshold,
    )  # fmt: skip


def describe_layout(cfg: JobConfig, world_size: int) -> str:
    """The layout ``build_strategy`` builds, for the start-up log: ``ddp x 4 ranks``, ``fsdp x 8 ranks``,
    ``hsdp 2 x 4`` (replicas x shard), ``zero3 x 4 ranks, offload optimizer``, ``3d pp2 x dp2 x tp2,
    Interleaved1F1B, 4 stages``. Pure: the config (strategy already resolved from auto) and the world size."""
    par = cfg.parallel
    ranks = f"{world_size} rank{'' if world_size == 1 else 's'}"
    match par.strategy:
        case "ddp":
            return f"ddp x {ranks}"
        case "fsdp":
            r = par.fsdp.replicate
            text = f"hsdp {r} x {world_size // r}" if r > 1 else f"fsdp x {ranks}"
            return text + (", cpu offload" if par.fsdp.cpu_offload else "")
        case "zero":
            z = par.zero
            offload = [what for what, on in (("optimizer", z.offload_optimizer), ("params", z.offload_params)) if on]
            return f"zero{z.stage} x {ranks}" + (f", offload {' and '.join(offload)}" if offload else "")
        case "3d":
            dims = parallel_dims(cfg, world_size)
            hsdp = f" (hsdp {dims.dp_replicate} x {dims.dp_shard})" if dims.hsdp_enabled else ""
            text = f"3d pp{dims.pp} x dp{dims.dp}{hsdp} x tp{dims.tp}"
            if dims.pp_enabled:
                stages = dims.pp * schedule_stages_per_rank(par.pp_schedule, par.pp_stages_per_rank)
                text += f", {par.pp_schedule}, {stages} stages"
            return text
        case other:
            return f"{other} x {ranks}"


def build_strategy(cfg: JobConfig, env: DistEnv, model: nn.Module) -> Strategy:
    device = env.torch_device()
    dp_size = env.world_size  # pure data parallelism: every rank is a replica
    common = {
        "device": device,
        "grad_accum": grad_accum_steps(cfg, dp_size),
        "micro_batch_size": cfg.train.micro_batch_size,
        "grad_clip": cfg.optim.grad_clip,
        "autocast_dtype": autocast_dtype(cfg.train.dtype, device),
        "dp_group": None,
    }
    # 3d applies these itself: per pipeline stage, after tensor parallelism (build_3d)
    if cfg.train.activation_checkpointing and cfg.parallel.strategy != "3d":
        apply_activation_checkpointing(model)
    if cfg.train.compile and cfg.parallel.strategy != "3d":
        apply_compile(model)

    strategy: Strategy
    match cfg.parallel.strategy:
        case "ddp":
            materialize(model, device=device, seed=cfg.run.seed)
            strategy = DDPStrategy(model, bucket_cap_mb=cfg.parallel.bucket_cap_mb, **common)
        case "fsdp":
            mesh = fsdp_mesh(device.type, env.world_size, replicate=cfg.parallel.fsdp.replicate)
            apply_fsdp_config(model, mesh, cfg, device=device)
            # on the sharded meta model: to_empty allocates only local shards; init equals the unsharded path's
            materialize_sharded(model, device=device, seed=cfg.run.seed)
            strategy = FSDPStrategy(model, mesh=mesh, **{**common, "autocast_dtype": None})
        case "zero":
            o = cfg.optim
            # DeepSpeed asserts LOCAL_RANK even for one process; hpcdist.run exports it with the process group, a
            # Trainer built directly (the Python API, one process, no init_process_group) did not
            export_environ(env)
            materialize(model, device=device, seed=cfg.run.seed)
            ds_config = zero_ds_config(cfg, dp_size=dp_size, device=device)
            # DeepSpeed's bf16 mode (bf16 weights and grads, fp32 master) replaces autocast wherever it is on
            zero_common = {**common, "autocast_dtype": None}
            # DeepSpeed wraps the optimizer and schedule, so they exist before the engine (not after the match)
            return ZeroStrategy(
                model, stage=cfg.parallel.zero.stage, ds_config=ds_config, **zero_common,
                build_optimizer=lambda m: build_optimizer(
                    m, lr=o.lr, weight_decay=o.weight_decay, betas=(o.beta1, o.beta2), eps=o.eps,
                    warmup_steps=o.warmup_steps, total_steps=cfg.train.steps, schedule=o.schedule,
                    min_lr_ratio=o.min_lr_ratio,
                ),
            )  # fmt: skip
        case "3d":
            strategy = build_3d(cfg, env, model, common)
        case other:  # config validation rejects unknown names first; this guards programmatic use
            raise ValueError(f"parallel.strategy: {other!r} is not available")

    o = cfg.optim
    strategy.optimizer, strategy.scheduler = build_optimizer(
        strategy.model,
        lr=o.lr,
        weight_decay=o.weight_decay,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        warmup_steps=o.warmup_steps,
        total_steps=cfg.train.steps,
        schedule=o.schedule,
        min_lr_ratio=o.min_lr_ratio,
    )
    return strategy


def shard_3d(
    cfg: JobConfig,
    model: Transformer,
    dims: ParallelDims,
    meshes: dict[str, DeviceMesh],
    pp_rank: int,
    *,
    device: torch.device,
    compile_blocks: bool,
) -> tuple[list[nn.Module], list[int], int, list[list[int]]]:
    """build_3d up to materialization, on the meta model (also what the dry run applies, so the two cannot drift):
    split this rank's pipeline stage(s) off (stages keep the unsplit FQNs), then per stage TP -> activation
    checkpointing -> compile -> FSDP2 on the dp mesh. Returns (parts, stage ids, number of stages, layers per
    stage); ``model`` itself stays the unsplit reference (names and shapes)."""
    par, f = cfg.parallel, cfg.parallel.fsdp
    per_rank = schedule_stages_per_rank(par.pp_schedule, par.pp_stages_per_rank) if dims.pp_enabled else 1
    num_stages = dims.pp * per_rank
    ids = stage_ids(pp_rank, dims.pp, per_rank, style=SCHEDULES[par.pp_schedule].style)
    if dims.pp_enabled:
        embed_cost, head_cost = part_costs(model.args, cfg.data.seq_len)
        layers = split_layers(model.args.n_layers, num_stages, first_cost=embed_cost, last_cost=head_cost)
        parts = [split_model(model, layers[i], first=i == 0, last=i == num_stages - 1) for i in ids]
    else:
        layers, parts = [list(range(model.args.n_layers))], [copy.deepcopy(model)]
    compute = autocast_dtype(cfg.train.dtype if f.param_dtype == "auto" else f.param_dtype, device)
    for part in parts:
        if dims.tp_enabled:
            apply_tp(part, meshes["tp"], loss_parallel=True)
        if cfg.train.activation_checkpointing:
            apply_activation_checkpointing(part)
        if compile_blocks:
            apply_compile(part)
        if dims.dp_enabled:
            apply_fsdp(
                part, meshes["fsdp"], param_dtype=compute or torch.float32,
                reduce_dtype=torch.bfloat16 if f.reduce_dtype == "bf16" else torch.float32,
                # with pp every micro-batch would gather each block again after resharding: keep them gathered
                # for the whole step (the schedule reshards after the last backward)
                reshard_after_forward=f.reshard_after_forward and not dims.pp_enabled, cpu_offload=False,
            )  # fmt: skip
    return parts, ids, num_stages, layers


def build_3d(cfg: JobConfig, env: DistEnv, model: nn.Module, common: dict) -> ThreeDStrategy:
    """pp x dp x tp, per pipeline stage of this rank: split -> TP -> AC -> compile -> FSDP2 (meta) -> materialize."""
    assert isinstance(model, Transformer), "3d splits and shards the hpcdist Transformer"
    par, device = cfg.parallel, common["device"]
    dims = parallel_dims(cfg, env.world_size)
    meshes = dims.build_meshes(device.type) if env.world_size > 1 else {}
    coords = dims.coords(env.rank)

    parts, ids, num_stages, _ = shard_3d(
        cfg, model, dims, meshes, coords["pp"], device=device, compile_blocks=cfg.train.compile
    )
    materialize_parts(parts, reference=model, device=device, seed=cfg.run.seed)
    return ThreeDStrategy(
        parts, dims=dims, meshes=meshes, stage_ids=ids, num_stages=num_stages, schedule=par.pp_schedule,
        loss_parallel=True,
        **{
            **common,
            "grad_accum": grad_accum_steps(cfg, dims.dp),
            # FSDP's MixedPrecisionPolicy casts when dp shards; otherwise plain autocast
            "autocast_dtype": None if dims.dp_enabled else common["autocast_dtype"],
            "dp_group": meshes["dp"].get_group() if meshes else None,
        },
    )  # fmt: skip
