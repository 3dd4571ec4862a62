"""Turn a meta-device model into a train-ready Strategy. The one place that chooses a strategy.

Every layout is a ParallelDims (``parallel.strategy`` is only an alias for its degrees and ZeRO stage, see
``parallel_dims``); every one but ZeRO goes through one ``parallelize``, per pipeline stage of this rank, in
torchtitan's fixed order: tensor parallel -> activation checkpointing -> compile -> FSDP2 (all on meta) ->
materialize -> DDP (pure replication only: DDP needs real parameters, it broadcasts them at construction) ->
optimizer. TP and FSDP shard meta tensors, so no rank ever holds the whole model. ZeRO hands the materialized model
to DeepSpeed.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from hpcdist.config import ConfigError, JobConfig, grad_accum_steps
from hpcdist.env import DistEnv, export_environ
from hpcdist.models.llama import Transformer, build_model
from hpcdist.optim import optimizer_builder
from hpcdist.parallel.base import Strategy
from hpcdist.parallel.ddp import DDPStrategy
from hpcdist.parallel.dims import SCHEDULES, ParallelDims
from hpcdist.parallel.fsdp import apply_fsdp
from hpcdist.parallel.materialize import materialize
from hpcdist.parallel.mesh import MeshStrategy
from hpcdist.parallel.pp import part_costs, schedule_stages_per_rank, split_layers, split_model, stage_ids
from hpcdist.parallel.tp import apply_tp
from hpcdist.parallel.zero import ZeroStrategy, deepspeed_config, import_deepspeed

# Ops whose outputs selective checkpointing keeps (torchtitan's op-level list, less its float8 and collective
# entries): the matmuls and every SDPA backend. Whatever else a block computes (norms, RoPE, SiLU, products,
# reshapes) is cheap and recomputed in backward.
_SAC_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}
_CUDNN_SDPA = getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", None)
if _CUDNN_SDPA is not None:
    _SAC_SAVE_OPS.add(_CUDNN_SDPA.default)


def _save_expensive_ops(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _SAC_SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_SAVE_ONLY_MODES: dict[type, type] = {}


def _save_ops_only(mode_cls: type) -> type:
    """``mode_cls`` (one of torch's two SAC dispatch modes) narrowed to the ops in ``_SAC_SAVE_OPS``: every other op
    runs as if no mode were there, in the forward and in the recompute alike. torch's own modes record every op of
    the forward and refuse any op in the recompute that the forward did not run ("... encountered during backward
    but not found in storage"), yet what a block's forward dispatches is not a function of the block alone: ZeRO-3's
    pre-forward hooks all-gather a parameter (c10d._allgather_base_ plus DeepSpeed's copies) only where the
    partition coordinator has not fetched it already, which differs between the forward and the recompute (after a
    checkpoint load, with prefetch), and DTensor's functional collectives pair each collective with a wait_tensor
    whose recompute must run, not return a cached handle. Such ops are recomputed anyway under this policy, so the
    narrowed modes compute the same values; only the saved ops' order must match, and a block runs its matmuls in
    one fixed order. Under tracing (compile) torch's modes run unchanged: they tag the graph for the partitioner."""
    sub = _SAVE_ONLY_MODES.get(mode_cls)
    if sub is None:
        from torch.utils.checkpoint import _is_compiling

        def dispatch(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func not in _SAC_SAVE_OPS and not _is_compiling(func, args, kwargs or {}):
                return func(*args, **(kwargs or {}))
            return mode_cls.__torch_dispatch__(self, func, types, args, kwargs)

        sub = _SAVE_ONLY_MODES[mode_cls] = type(
            mode_cls.__name__ + "SaveOpsOnly", (mode_cls,), {"__torch_dispatch__": dispatch}
        )
    return sub


def _selective_context_fn() -> tuple[Any, Any]:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    modes = create_selective_checkpoint_contexts(_save_expensive_ops)
    for mode in modes:  # a class swap keeps torch's constructor, whose arguments differ between torch releases
        mode.__class__ = _save_ops_only(type(mode))
    return modes


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """train.activation_checkpointing per transformer block: ``full`` keeps only each block's input and recomputes
    the block in backward; ``selective`` (op-level) also keeps the outputs of the ops in ``_SAC_SAVE_OPS`` and
    recomputes the rest; ``none`` changes nothing. Non-reentrant checkpointing either way (the one form that
    composes with FSDP2, DTensor and compile). Under tensor parallelism either mode's recompute issues the block's
    functional collectives again (both sequence-parallel all-gathers and wo's reduce-scatter; it stops before w2's),
    every tp rank in the same order, so selective composes with tp (looped 2-8 rank runs of pp2 x tp2, dp2 x tp2 and
    pp2 x dp2 x tp2, half with torch's own SAC modes, are the evidence)."""
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"train.activation_checkpointing: {mode!r} is not one of none, full, selective")
    extra = {"context_fn": _selective_context_fn} if mode == "selective" else {}
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False, **extra))


def apply_compile(model: nn.Module, backend: str = "inductor") -> None:
    """Compile block by block: blocks are identical, so one graph is reused and compile time stays flat in depth."""
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, torch.compile(block, fullgraph=True, backend=backend))


def train_dtype(cfg: JobConfig, device: torch.device) -> str:
    """``train.dtype`` as this run trains on ``device``: fp32, bf16 or fp16 (with the loss scaler, grad_scaler). The
    one place ``auto`` is resolved: fp32 on the CPU; on CUDA bf16 from compute capability 8.0 (A100, H100: bf16
    tensor cores, and SDPA's flash and memory-efficient kernels take it) and fp16 below (V100: no bf16 tensor cores,
    and those kernels refuse bf16 on sm70, leaving the O(S^2) math kernel). fp16 needs a loss scaler, which ddp,
    fsdp and zero have and tensor- or pipeline-parallel stages have not (hpcdist.config.rules refuses fp16 there):
    with tp or pp ``auto`` stays bf16."""
    dtype = cfg.train.dtype
    if dtype != "auto":
        return dtype
    if device.type != "cuda":
        return "fp32"
    if cfg.parallel.tp > 1 or cfg.parallel.pp > 1:
        return "bf16"
    return "bf16" if _compute_capability(device) >= (8, 0) else "fp16"


def _compute_capability(device: torch.device) -> tuple[int, int]:
    if not torch.cuda.is_available():
        # a GPU job's settings rendered where there is no GPU (tools/deepspeed_configs): for the A100s (sm80) the
        # cluster configs describe
        return (8, 0)
    return tuple(torch.cuda.get_device_capability(device))  # type: ignore[return-value]


def autocast_dtype(dtype: str) -> torch.dtype | None:
    """The autocast dtype of a resolved dtype name (train_dtype, or parallel.fsdp.param_dtype); None: fp32, no
    autocast."""
    if dtype == "fp16":
        return torch.float16  # with a loss scaler (grad_scaler)
    if dtype == "bf16":
        return torch.bfloat16
    return None


def grad_scaler(cfg: JobConfig, device: torch.device) -> Any:
    """fp16's dynamic loss scaler (train_dtype: train.dtype=fp16, or auto below sm80; None for other dtypes); torch's
    defaults: 2**16, x2 after 2000 steps without overflow, /2 on an overflow. With several ranks the sharded form
    (torch.distributed.fsdp's ShardedGradScaler), under DDP too: it all-reduces the overflow verdict (one float per
    step), so every rank skips the same steps. FSDP2 needs that (each rank sees its shards only); DDP's ranks hold the
    same reduced gradients, except where one rank's went bad after the reduce (as the non-finite skip,
    hpcdist.parallel.base.Strategy._update), and a replica that skipped alone would silently diverge
    (test_fp16_two_ranks_overflow_on_one_rank: it did)."""
    if train_dtype(cfg, device) != "fp16":
        return None
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type)
    return torch.amp.GradScaler(device.type)


def zero_ds_config(cfg: JobConfig, *, dp_size: int, device: torch.device) -> dict:
    """The DeepSpeed config for ``parallel.strategy=zero``: batch, accumulation and clipping come from the train
    and optim sections, so DeepSpeed's view of the step can never disagree with hpcdist's."""
    z = cfg.parallel.zero
    dtype = train_dtype(cfg, device)
    return deepspeed_config(
        stage=z.stage,
        micro_batch_size=cfg.train.micro_batch_size,
        grad_accum=grad_accum_steps(cfg, dp_size),
        dp_size=dp_size,
        grad_clip=cfg.optim.grad_clip,
        bf16=dtype == "bf16",
        fp16=dtype == "fp16",
        offload_optimizer=z.offload_optimizer,
        offload_params=z.offload_params,
        overlap_comm=z.overlap_comm,
        buckets=(z.reduce_bucket_size, z.allgather_bucket_size),
        param_persistence_threshold=z.param_persistence_threshold,
    )


def warm_up(cfg: JobConfig, dims: ParallelDims) -> Transformer:
    """What a rank can build before it knows its place (a warm spare, ahead of a vacancy): the model on the meta
    device, which the Trainer then takes instead of building its own, and the strategy's libraries imported (DeepSpeed
    for ZeRO). Neither depends on the rank, so the spare that takes any rank's place uses them as they are."""
    if dims.zero_enabled:
        import_deepspeed()
    return build_model(cfg.model_args(), device="meta")


def build_strategy(cfg: JobConfig, env: DistEnv, model: Transformer, dims: ParallelDims) -> Strategy:
    """``dims``: the rank's one ParallelDims (hpcdist.rankfacts), the same object the trainer's data loader reads."""
    device = env.torch_device()
    if dims.zero_enabled:
        return build_zero(cfg, env, model)
    meshes = dims.build_meshes(device.type) if dims.needs_mesh else {}
    stages = parallelize(
        cfg, model, dims, meshes, dims.coords(env.rank)["pp"], device=device, compile_blocks=cfg.train.compile
    )
    offload = dims.fsdp_enabled and cfg.parallel.fsdp.cpu_offload
    materialize(
        stages.parts,
        reference=model,
        device=device,
        seed=cfg.run.seed,
        param_device=torch.device("cpu") if offload else None,
    )
    common = {
        "device": device,
        "grad_accum": grad_accum_steps(cfg, dims.dp),
        "micro_batch_size": cfg.train.micro_batch_size,
        "grad_clip": cfg.optim.grad_clip,
        # FSDP's MixedPrecisionPolicy casts the gathered parameters; otherwise plain autocast
        "autocast_dtype": None if dims.fsdp_enabled else autocast_dtype(train_dtype(cfg, device)),
        "dp_group": meshes["dp"].get_group() if meshes else None,
        "build_optimizer": optimizer_builder(cfg.optim, cfg.train.steps),
    }
    if not dims.needs_mesh:  # pure replication (or one rank): one whole model, DDP when there are replicas
        ddp = cfg.parallel.ddp
        common["grad_scaler"] = grad_scaler(cfg, device)
        return DDPStrategy(
            stages.parts[0],
            bucket_cap_mb=ddp.bucket_cap_mb,
            comm_hook=ddp.comm_hook,
            powersgd=dataclasses.asdict(ddp.powersgd),
            seq_len=cfg.data.seq_len,
            **common,
        )
    common["grad_scaler"] = grad_scaler(cfg, device)  # fp16: fsdp only (the config refuses tp/pp)
    return MeshStrategy(
        stages.parts,
        dims=dims,
        meshes=meshes,
        stage_ids=stages.ids,
        num_stages=stages.num_stages,
        schedule=cfg.parallel.pp_schedule,
        loss_parallel=True,
        **common,
    )


def build_zero(cfg: JobConfig, env: DistEnv, model: Transformer) -> ZeroStrategy:
    """DeepSpeed's engine on the materialized whole model; it wraps the optimizer and schedule itself.

    The whole model is built in fp32 on every GPU before DeepSpeed partitions it (4 bytes/param: 52 GB for 13B), at
    every stage: materialize gives it the single-process init of the seed, the same weights every strategy starts
    from, and DeepSpeed's engine, the checkpoint views (ZeroStrategy.dcp_state) and the fp32 master are built from
    whole parameters. The planner counts that build peak (hpcdist.planning.memory.zero_build_bytes) and refuses a
    layout whose build does not fit."""
    device = env.torch_device()
    if train_dtype(cfg, device) == "fp16" and device.type != "cuda":
        # DeepSpeed's CPU accelerator reports no fp16 support (is_fp16_supported() is None, deepspeed 0.19)
        raise ConfigError(
            [
                "train.dtype=fp16 with parallel.strategy=zero needs GPUs (DeepSpeed has no fp16 mode on CPU); "
                "use train.dtype=fp32 or bf16 here, or parallel.strategy=ddp / fsdp for fp16 on CPU"
            ]
        )
    # DeepSpeed asserts LOCAL_RANK even for one process; hpcdist.run exports it with the process group, a
    # Trainer built directly (the Python API, one process, no init_process_group) did not
    export_environ(env)
    apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
    if cfg.train.compile:
        apply_compile(model, cfg.train.compile_backend)
    materialize([model], reference=model, device=device, seed=cfg.run.seed)
    return ZeroStrategy(
        model,
        stage=cfg.parallel.zero.stage,
        ds_config=zero_ds_config(cfg, dp_size=env.world_size, device=device),
        device=device,
        grad_accum=grad_accum_steps(cfg, env.world_size),
        micro_batch_size=cfg.train.micro_batch_size,
        grad_clip=cfg.optim.grad_clip,
        # DeepSpeed's bf16 mode (bf16 weights and grads, fp32 master) replaces autocast wherever it is on
        autocast_dtype=None,
        dp_group=None,
        build_optimizer=optimizer_builder(cfg.optim, cfg.train.steps),
    )


@dataclass
class Stages:
    """What ``parallelize`` returns: this rank's stage modules (the whole model when pp == 1), their stage ids,
    the number of stages and the layers of every stage."""

    parts: list[nn.Module]
    ids: list[int]
    num_stages: int
    layers: list[list[int]]


def parallelize(
    cfg: JobConfig,
    model: Transformer,
    dims: ParallelDims,
    meshes: dict[str, Any],
    pp_rank: int,
    *,
    device: torch.device,
    compile_blocks: bool,
) -> Stages:
    """Every ParallelDims layout up to materialization, on the meta model (also what the dry run applies, so the two
    cannot drift): split this rank's pipeline stage(s) off (stages keep the unsplit FQNs), then per stage TP ->
    activation checkpointing -> compile -> FSDP2 on the dp mesh. ``model`` itself stays the unsplit reference
    (names and shapes). DDP is applied after materialization (``build_strategy``)."""
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
    compute = autocast_dtype(train_dtype(cfg, device) if f.param_dtype == "auto" else f.param_dtype)
    for part in parts:
        if dims.tp_enabled:
            apply_tp(part, meshes["tp"], loss_parallel=True)
        apply_activation_checkpointing(part, cfg.train.activation_checkpointing)
        if compile_blocks:
            apply_compile(part, cfg.train.compile_backend)
        if dims.fsdp_enabled:
            apply_fsdp(
                part,
                meshes["fsdp"],
                param_dtype=compute or torch.float32,
                reduce_dtype=torch.bfloat16 if f.reduce_dtype == "bf16" else torch.float32,
                # with pp every micro-batch would gather each block again after resharding: keep them gathered
                # for the whole step (the schedule reshards after the last backward)
                reshard_after_forward=f.reshard_after_forward and not dims.pp_enabled,
                cpu_offload=f.cpu_offload,  # config rules allow it only without pp/tp
            )
    return Stages(parts, ids, num_stages, layers)
