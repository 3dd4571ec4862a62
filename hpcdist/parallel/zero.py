"""DeepSpeed ZeRO stages 1/2/3: optimizer state (1), + gradients (2), + parameters (3) partitioned over ranks.

DeepSpeed owns the step: it counts micro-batches, divides the loss by gradient_accumulation_steps in
``engine.backward``, reduces gradients, clips and steps the optimizer and the LR schedule at the
accumulation boundary. The optimizer and schedule are hpcdist's torch AdamW + LambdaLR, handed to
``deepspeed.initialize`` (naming AdamW in the DeepSpeed config would JIT-build fused_adam).

Checkpoints: DeepSpeed keeps each rank's part of the fp32 master weights and AdamW moments in flat partitions.
``dcp_state`` presents them in the torch strategies' layout (``get_state_dict``: ``model.<fqn>`` and
``optim.state.<fqn>.exp_avg`` ...), each parameter a ShardedTensor of its real shape whose local shards are
boxes viewing this rank's flat range: every rank writes only its partition (no gather), DCP records global
shapes and chunks like an FSDP checkpoint, and any strategy on any world size loads it (ZeRO loads DDP/FSDP
checkpoints the same way, the views as destinations). Exact: the fp32 master and the moments are what is saved.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties

from hpcdist.parallel.base import Strategy, cross_entropy
from hpcdist.parallel.mesh import clean_fqn

log = logging.getLogger(__name__)


def deepspeed_config(
    *,
    stage: int,
    micro_batch_size: int,
    grad_accum: int,
    dp_size: int,
    grad_clip: float,
    bf16: bool,
    offload_optimizer: bool,
    offload_params: bool,
    overlap_comm: bool,
    buckets: tuple[int, int],
    param_persistence_threshold: int = 100_000,
    fp16: bool = False,
) -> dict[str, Any]:
    """The DeepSpeed config dict. ``buckets`` = (reduce_bucket_size, allgather_bucket_size) in elements."""
    reduce_bucket, allgather_bucket = buckets
    zero: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": overlap_comm,
        "reduce_bucket_size": reduce_bucket,
        "contiguous_gradients": True,
    }
    if stage in (1, 2):
        zero["allgather_bucket_size"] = allgather_bucket
    else:
        zero["stage3_param_persistence_threshold"] = param_persistence_threshold
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch_size * grad_accum * dp_size,
        "gradient_clipping": grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        # the client (torch) optimizer is used as is; this only stops DeepSpeed refusing it under ZeRO
        "zero_allow_untested_optimizer": True,
        # with offload DeepSpeed insists on its own cpu_adam (a ~100 s g++ JIT build, impossible without a
        # compiler); torch's fused CPU AdamW steps the offloaded fp32 partitions instead
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if bf16:
        # DeepSpeed reduces in the model's dtype unless told otherwise: 8 mantissa bits summing every rank's
        # gradient (the FSDP path reduces in fp32). fp32 reduction, rounded to bf16 once afterwards.
        cfg["communication_data_type"] = "fp32"
        if stage > 1 or offload_optimizer:
            # micro-batches summed into fp32 gradient partitions. Not at stage 1 on the GPU: there DeepSpeed
            # (engine._do_optimizer_sanity_check) replaces its ZeRO optimizer with BF16_Optimizer, whose flat
            # partitions are not the ones this module's checkpoints (dcp_state) and memory accounting read
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if fp16:
        # dynamic loss scaling (loss_scale 0), torch GradScaler's schedule: 2**16, x2 after 2000 clean steps, /2 on
        # an overflow (hysteresis 1: at the first one), the overflow step skipped
        cfg["fp16"] = {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 2000,
            "hysteresis": 1,
            "min_loss_scale": 1,
        }
    return cfg


# The fields of DeepSpeed's DynamicLossScaler (0.19, deepspeed.runtime.fp16.loss_scaler) that update_scale changes:
# the scale, the step counter, the step of the last overflow (growth comes loss_scale_window clean steps after it) and
# the overflows left before the next halving (hysteresis). Its window, factor, minimum and hysteresis depth come
# from deepspeed_config's fp16 block, so a resume takes them from the config, not the checkpoint.
_DS_SCALER_FIELDS = {
    "scale": "cur_scale",
    "iter": "cur_iter",
    "last_overflow_iter": "last_overflow_iter",
    "hysteresis": "cur_hysteresis",
}


def _is_int(v: Any, low: int, high: int = 2**62) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and low <= v < high


def loss_scaler_state(scaler: Any) -> dict[str, Any]:
    """A DeepSpeed DynamicLossScaler's changing state as JSON numbers (``_DS_SCALER_FIELDS``)."""
    return {
        "scale": float(scaler.cur_scale),
        **{key: int(getattr(scaler, attr)) for key, attr in _DS_SCALER_FIELDS.items() if key != "scale"},
    }


def load_loss_scaler_state(scaler: Any, state: dict[str, Any]) -> None:
    """Set ``scaler`` (a DeepSpeed DynamicLossScaler) from ``loss_scaler_state``'s dict, read from a checkpoint
    (another user's file): every value is checked against the scaler's own configured ranges before any is set.
    A state without DeepSpeed's counters (a checkpoint of torch's GradScaler: ddp/fsdp in fp16) carries its scale
    over and starts the growth interval afresh: the two scalers count clean steps differently."""
    scale = state.get("scale")
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and scaler.min_scale <= scale < math.inf):
        raise ValueError(
            f"grad_scaler.scale must be a finite number >= the minimum loss scale {scaler.min_scale}, got {scale!r}"
        )
    if "iter" not in state:
        scaler.cur_scale = float(scale)
        return
    it, last, hyst = state.get("iter"), state.get("last_overflow_iter"), state.get("hysteresis")
    if not _is_int(it, 0):
        raise ValueError(f"grad_scaler.iter must be a non-negative integer, got {it!r}")
    if not _is_int(last, -1, max(it, 0)):  # -1: no overflow yet; an overflow is recorded before iter advances
        raise ValueError(f"grad_scaler.last_overflow_iter must be an integer in [-1, iter={it}), got {last!r}")
    if not _is_int(hyst, 1, scaler.delayed_shift + 1):
        raise ValueError(
            f"grad_scaler.hysteresis must be an integer in [1, {scaler.delayed_shift}] (the configured hysteresis), "
            f"got {hyst!r}"
        )
    scaler.cur_scale, scaler.cur_iter, scaler.last_overflow_iter, scaler.cur_hysteresis = float(scale), it, last, hyst


def _skip_shm_comm_build() -> None:
    """DeepSpeed's TorchBackend JIT-builds the deepspeed_shm_comm C++ op (~60 s, needs g++) unless it is marked
    incompatible; the gloo/NCCL process group hpcdist already created does all communication."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


# DeepSpeed 0.19's TorchBackend calls the torch 2.13 names that torch deprecated for ``*_single``: a FutureWarning per
# call site and rank, re-shown each time a warnings.catch_warnings elsewhere resets the registry (50 lines in a
# 3-step ZeRO-3 run on 2 ranks). They are DeepSpeed's calls, not the user's to fix: filtered by message.
_DEEPSPEED_DEPRECATIONS = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"


def _quiet_deepspeed_deprecations() -> None:
    warnings.filterwarnings("ignore", message=_DEEPSPEED_DEPRECATIONS, category=FutureWarning)


def import_deepspeed() -> Any:
    """DeepSpeed, imported the way every ZeRO rank needs it (no shm op build, its deprecation warnings quiet); a
    warm spare calls it ahead, so its takeover does not pay DeepSpeed's import (seconds) after a peer died."""
    _skip_shm_comm_build()
    _quiet_deepspeed_deprecations()
    import deepspeed

    return deepspeed


def _ensure_process_group(device: torch.device, dp_size: int) -> None:
    """A one-rank process group when the job has one process: hpcdist joins none then (hpcdist.env's
    init_process_group), but DeepSpeed works only inside one (``initialize(dist_init_required=False)`` asserts it;
    letting DeepSpeed create it would bind a TCP port through env://). An in-process store needs no port. The
    trainer's caller (hpcdist.run.main) destroys it with the rest at the end of the run."""
    if dist.is_initialized():
        return
    if dp_size != 1:
        # a 1-rank group here would let each of the job's ranks train alone, silently
        raise RuntimeError(f"parallel.strategy=zero on {dp_size} ranks: join the process group first (hpcdist.env)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    log.info("one process: created a 1-rank %s process group for DeepSpeed", backend)


class _OwnGpu:
    """Mixed into DeepSpeed's CUDA accelerator: every device index DeepSpeed hands it names this process's GPU."""

    index: int

    def device_name(self, device_index: Any = None) -> str:
        return super().device_name(None if device_index is None else self.index)  # type: ignore[misc]

    def device(self, device_index: Any = None) -> torch.device:
        return super().device(None if device_index is None else self.index)  # type: ignore[misc]

    def set_device(self, device_index: Any) -> None:
        super().set_device(self.index)  # type: ignore[misc]


def _bind_accelerator(device: torch.device) -> None:
    """Bind DeepSpeed's accelerator to ``device``, the GPU hpcdist chose (hpcdist.env).

    DeepSpeed takes the local rank for the CUDA ordinal of its GPU: its engine calls ``set_device(LOCAL_RANK)``, and
    ZeRO-3's partitioner and its trace checks allocate on ``device_name(os.environ["LOCAL_RANK"])`` during every
    step. Where each task sees only its own GPU (``srun --gpus-per-task=1``, ``--gpu-bind``, per-task cgroups) local
    rank 3's GPU is ``cuda:0`` and ``cuda:3`` does not exist ("invalid device ordinal"). DeepSpeed's accelerator
    is the one place it asks for a device (``set_accelerator``, its override point), and every index it passes there
    is that local rank: bound, each names ``device``, while ``LOCAL_RANK`` keeps torchrun's meaning for everyone
    else. The CPU accelerator has one device and is left as it is."""
    from deepspeed.accelerator import get_accelerator, set_accelerator

    current = get_accelerator()
    if device.type != "cuda" or current.device_name() != "cuda":
        return
    if not isinstance(current, _OwnGpu):
        current = type(f"Bound{type(current).__name__}", (_OwnGpu, type(current)), {})()
        set_accelerator(current)
    current.index = device.index if device.index is not None else torch.cuda.current_device()


class ZeroStrategy(Strategy):
    def __init__(
        self,
        model: nn.Module,
        *,
        stage: int,
        ds_config: dict[str, Any],
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        deepspeed = import_deepspeed()
        self.stage = stage
        self.module = model
        self._fp16 = bool(ds_config.get("fp16", {}).get("enabled"))  # DeepSpeed's dynamic loss scaling
        # built before initialize, on the materialized model: DeepSpeed wraps this torch optimizer and steps
        # this scheduler at each accumulation boundary
        self._attach_optimizer(model)
        # each param group's FQNs, taken before DeepSpeed swaps the groups' parameters for its flat partitions:
        # checkpoints list groups by FQN, as the torch strategies' optimizer state dicts do
        # (the unwrapped model's FQNs: activation checkpointing and compile insert path components a run without them,
        # or another strategy, would not find)
        names = {id(p): clean_fqn(n) for n, p in model.named_parameters()}
        self._fqn_groups = [[names[id(p)] for p in g["params"]] for g in self.optimizer.param_groups]
        self._shard_layout: dict[str, list[ShardMetadata]] | None = None  # built at the first checkpoint
        _ensure_process_group(self.device, _dp_size(ds_config))
        _bind_accelerator(self.device)
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=model,
            optimizer=self.optimizer,
            lr_scheduler=self.scheduler,
            config=ds_config,
            dist_init_required=False,
        )
        self.engine = engine
        self.model = engine
        self.ds_optimizer = ds_optimizer

    # ------------------------------------------------------------------------------------------ train
    def forward_backward(self, batch: torch.Tensor) -> torch.Tensor:
        if not self.engine.training:
            self.engine.train()
        total = torch.zeros((), device=self.device)
        n = 0
        for inputs, targets in self._micro_batches(batch):
            with self._autocast():
                loss = cross_entropy(self.engine(inputs), targets)
            # engine.backward divides by gradient_accumulation_steps itself (scale_wrt_gas): pass the raw loss
            self.engine.backward(loss)
            n += 1
            total += loss.detach() / self.grad_accum
            if n < self.grad_accum:
                # a non-boundary step() only advances DeepSpeed's micro-step counter (no reduce, no update)
                self.engine.step()
        if n != self.grad_accum:
            raise ValueError(f"expected {self.grad_accum} micro-batches per step, got {n}")
        return total

    def optimizer_step(self, *, skip_nonfinite: bool = False) -> torch.Tensor:
        """The boundary step: DeepSpeed reduces, clips, steps AdamW and the LR schedule, zeroes grads.
        ``skip_nonfinite`` is refused by the config rules: DeepSpeed applies the step before the norm is known."""
        if skip_nonfinite:
            raise ValueError("train.nonfinite=skip is not available with parallel.strategy=zero")
        if not self.engine.is_gradient_accumulation_boundary():
            raise RuntimeError("ZeroStrategy.optimizer_step called before the last micro-batch of the step")
        skipped = self.engine.skipped_steps
        self.engine.step()
        # fp16: DeepSpeed skipped the update on an overflow (and halved its loss scale)
        self.last_step_overflow = self._fp16 and self.engine.skipped_steps > skipped
        self.overflow_steps += self.last_step_overflow
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            norm = float("nan")
        return torch.as_tensor(norm, dtype=torch.float32).detach().reshape(())

    @property
    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def loss_scale(self) -> float | None:
        return float(self.ds_optimizer.loss_scale) if self._fp16 else None

    def scaler_state(self) -> dict[str, Any] | None:
        """fp16: DeepSpeed's dynamic loss scaler (its own checkpoint format, which hpcdist's DCP checkpoint does not
        write, would pickle the object) as plain numbers for trainer_state.json, and the overflow count."""
        if not self._fp16:
            return None
        return {**loss_scaler_state(self.ds_optimizer.loss_scaler), "overflow_steps": self.overflow_steps}

    def load_scaler_state(self, state: dict[str, Any]) -> None:
        """``state``: from a checkpoint's trainer_state.json (another user's file): all validated before any is set."""
        if not self._fp16:
            return
        skips = state.get("overflow_steps")
        if not _is_int(skips, 0):
            raise ValueError(f"grad_scaler.overflow_steps must be a non-negative integer, got {skips!r}")
        load_loss_scaler_state(self.ds_optimizer.loss_scaler, state)
        self.overflow_steps = skips

    def has_replicas(self) -> bool:
        # stages 1-2 keep whole parameters on every rank (comparable); stage 3 holds disjoint partitions
        return self.stage < 3 and super().has_replicas()

    def local_params(self) -> list[torch.Tensor]:
        """Stage 3: this rank's partition (``ds_tensor``); stages 1-2: the whole 16-bit parameters."""
        return [getattr(p, "ds_tensor", p) for p in self.module.parameters()]

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """DeepSpeed's own buffers (0.19 attribute names): 16-bit weights (flat; stage 3: this rank's partition
        plus persistent small parameters), gradient partitions, fp32 master partitions and the Adam moments."""
        opt = self.ds_optimizer
        params = self.local_params()
        if self.stage == 3:
            grads = [opt.grad_partitions_flat_buffer]
            master = list(opt.fp32_partitioned_groups_flat)
        else:
            # a partition's entry is None between steps (DeepSpeed resets it after the update)
            grads = [g for gs in opt.averaged_gradients.values() if gs for g in gs if g is not None]
            grads += [p.grad for p in self.module.parameters() if p.grad is not None]
            master = list(opt.single_partition_of_fp32_groups)
        moments = [v for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        return {"params": params, "grads": grads, "optimizer": master + moments}

    # ------------------------------------------------------------------------------------------ checkpoint
    def _fragments(self) -> list[_Fragment]:
        """Where this rank's fp32 master of each parameter lies: DeepSpeed's flat partition, the offset in it and
        the flat range of the parameter it covers (empty on a rank holding none of it). Views, never copies."""
        opt, out = self.ds_optimizer, []
        for name, p in self.module.named_parameters():
            fqn = clean_fqn(name)  # as every other strategy names it (wrappers dropped)
            shape = tuple(getattr(p, "ds_shape", p.shape))
            if self.stage == 3:
                # every rank holds [rank * k, (rank + 1) * k) of the flat parameter, the last one padded
                group, offset, k = opt.grad_position[opt.get_param_id(p)]
                start = opt._get_param_partition_rank(p) * k
                numel = max(0, min(k, p.ds_numel - start))
                flat = opt.fp32_partitioned_groups_flat[group]
            else:
                mapping = getattr(p, "_hp_mapping", None)  # None: no element of p in this rank's partition
                if mapping is None:
                    out.append(_Fragment(fqn, shape, None, 0, 0, 0))
                    continue
                flat = opt.single_partition_of_fp32_groups[mapping.param_group_index]
                offset, numel = mapping.hp_fragment_address.start, mapping.hp_fragment_address.numel
                start = mapping.lp_fragment_address.start
            out.append(_Fragment(fqn, shape, flat, offset, start, numel))
        return out

    def _moments(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The AdamW state of one flat fp32 partition, created as torch's AdamW would at its first step when the
        optimizer has not stepped yet (a fresh run loading a checkpoint): loading writes into it in place."""
        state = self.optimizer.state[flat]
        if not state:
            state.update(
                step=_step_tensor(self.optimizer, flat, 0.0),
                exp_avg=torch.zeros_like(flat),
                exp_avg_sq=torch.zeros_like(flat),
            )
        return state

    def _layout(self, fragments: list[_Fragment]) -> dict[str, list[ShardMetadata]]:
        """Every rank's boxes of every parameter, gathered once (one collective; the partitioning never changes):
        each ShardedTensor is then built locally, instead of one metadata collective per tensor per save."""
        if self._shard_layout is None:
            mine = {
                f.fqn: (
                    str(f.flat.device if f.flat is not None else self.device),
                    [(o, z) for o, z, _, _ in flat_boxes(f.shape, f.start, f.start + f.numel)],
                )
                for f in fragments
            }
            parts: list[Any] = [mine]
            if dist.get_world_size() > 1:
                parts = [None] * dist.get_world_size()
                dist.all_gather_object(parts, mine)
            self._shard_layout = {
                f.fqn: [
                    ShardMetadata(list(o), list(z), f"rank:{r}/{part[f.fqn][0]}")
                    for r, part in enumerate(parts)
                    for o, z in part[f.fqn][1]
                ]
                for f in fragments
            }
        return self._shard_layout

    def _sharded(self, frag: _Fragment, source: torch.Tensor | None, layout: list[ShardMetadata]) -> ShardedTensor:
        """One parameter-shaped ShardedTensor whose local shards are row-aligned boxes viewing this rank's part of
        ``source`` (a flat fp32 partition or a moment): DCP writes the boxes' data, and loads straight into it."""
        shards = []
        pinned = False
        if source is not None and frag.numel:
            # detached (same storage): DeepSpeed's flat fp32 partitions are leaves that require grad, and async
            # staging deep-copies the shards, which torch allows only for leaf tensors
            local = source.detach().narrow(0, frag.offset, frag.numel)
            pinned = local.is_pinned()  # offloaded partitions
            rank = dist.get_rank()
            for offsets, sizes, a, b in flat_boxes(frag.shape, frag.start, frag.start + frag.numel):
                view = local[a - frag.start : b - frag.start].view(sizes)
                shards.append(Shard.from_tensor_and_offsets(view, list(offsets), rank))
        properties = TensorProperties(dtype=torch.float32, pin_memory=pinned)
        metadata = ShardedTensorMetadata(layout, torch.Size(frag.shape), properties)
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, metadata)

    def dcp_state(self) -> dict[str, Any]:
        """The fp32 master weights and AdamW state keyed by FQN in the torch strategies' layout (``get_state_dict``),
        each rank holding only its own partition as boxes of the real shapes: no gather, a checkpoint every strategy
        loads on any world size (a DDP run reads the master as its weights, the moments as its optimizer state)."""
        model: dict[str, Any] = {}
        state: dict[str, Any] = {}
        step = self._step()
        fragments = self._fragments()
        layout = self._layout(fragments)
        for frag in fragments:
            # a rank holding no part of a parameter leaves it out: DCP's load takes an entry without local shards
            # for a sign of a pre-2.4 checkpoint and fails
            if not frag.numel:
                continue
            moments = self._moments(frag.flat) if frag.flat is not None else {}
            model[frag.fqn] = self._sharded(frag, frag.flat, layout[frag.fqn])
            state[frag.fqn] = {key: self._sharded(frag, moments.get(key), layout[frag.fqn]) for key in _MOMENTS}
            state[frag.fqn]["step"] = step.clone()
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": list(fqns)}
            for g, fqns in zip(self.optimizer.param_groups, self._fqn_groups, strict=True)
        ]
        return {"model": model, "optim": {"state": state, "param_groups": groups}}

    def _step(self) -> torch.Tensor:
        # AdamW steps every group together: DeepSpeed's flat partitions all hold the same count
        states = [s for s in self.optimizer.state.values() if "step" in s]
        return torch.as_tensor(states[0]["step"] if states else 0.0, dtype=torch.float32).detach().clone()

    def load_dcp_state(self, state: dict[str, Any]) -> None:
        """``state`` is ``dcp_state()`` after ``dcp.load``: the master and moments were written in place through
        the views. Here: the step count, then the 16-bit weights refreshed from the new master. The groups'
        hyper-parameters are not taken from the checkpoint (DCP hands the loaded copies to a dict of its own when
        it flattens ShardedTensors): the LR schedule's state and the config set them, as the trainer would anyway."""
        optim = state.get("optim")
        if optim is not None:
            # AdamW's bias correction: one count for all groups, as saved (any entry this rank holds has it)
            for entry in list(optim["state"].values())[:1]:
                for flat, flat_state in self.optimizer.state.items():
                    if "step" in flat_state:
                        flat_state["step"] = _step_tensor(self.optimizer, flat, float(entry["step"]))
        else:
            log.warning("loaded model weights only: the checkpoint has no optimizer state, moments restart")
        self._refresh_bit16()

    @torch.no_grad()
    def _refresh_bit16(self) -> None:
        """The module's 16-bit weights from the fp32 master, as DeepSpeed does after each step."""
        opt = self.ds_optimizer
        if self.stage == 3:
            for i in range(len(opt.fp32_partitioned_groups_flat)):
                opt._reassign_or_swap_out_partitioned_parameters(i)  # fp32 partition -> 16-bit partition
            if opt.persistent_parameters:  # small parameters every rank keeps whole
                opt.persistent_parameters[0].all_gather(opt.persistent_parameters)
        else:
            opt.update_lp_params()  # copies this rank's partition and all-gathers the others'


_MOMENTS = ("exp_avg", "exp_avg_sq")


def _step_tensor(optimizer: torch.optim.Optimizer, flat: torch.Tensor, value: float) -> torch.Tensor:
    """AdamW's step count for the flat partition ``flat``, placed as torch places it (AdamW's first step, and
    ``Optimizer.load_state_dict``): on the partition's device where the group is fused or capturable, whose kernels
    read it as a device pointer; a CPU scalar otherwise. hpcdist's AdamW is fused on CUDA (hpcdist.optim), and
    offloaded partitions are on the CPU. ZeRO-3 puts a partition into its group only for the step: between steps
    the optimizer's defaults (hpcdist builds every group alike) say."""
    group = next((g for g in optimizer.param_groups if any(p is flat for p in g["params"])), optimizer.defaults)
    on_device = bool(group.get("fused") or group.get("capturable"))
    return torch.tensor(value, dtype=torch.float32, device=flat.device if on_device else "cpu")


@dataclass(frozen=True)
class _Fragment:
    fqn: str
    shape: tuple[int, ...]
    flat: torch.Tensor | None  # DeepSpeed's flat fp32 partition holding it
    offset: int  # where in ``flat``
    start: int  # where in the flattened parameter
    numel: int


def flat_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[list[int], list[int], int, int]]:
    """The flat range [start, stop) of a row-major tensor of ``shape`` as N-D boxes: (offsets, sizes, a, b), each
    box holding the flat elements [a, b) in order. A partial leading slice, whole slices of dim 0, a partial
    trailing slice (the partial ones split the same way one dimension down): at most 2 * ndim - 1 boxes."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [([start], [stop - start], start, stop)]
    inner = math.prod(shape[1:])
    boxes: list[tuple[list[int], list[int], int, int]] = []

    def partial(row: int, lo: int, hi: int) -> None:
        base = row * inner
        for offsets, sizes, a, b in flat_boxes(shape[1:], lo - base, hi - base):
            boxes.append(([row, *offsets], [1, *sizes], a + base, b + base))

    pos = start
    if pos % inner:
        end = min(stop, (pos // inner + 1) * inner)
        partial(pos // inner, pos, end)
        pos = end
    rows = (stop - pos) // inner
    if rows:
        boxes.append(([pos // inner] + [0] * (len(shape) - 1), [rows, *shape[1:]], pos, pos + rows * inner))
        pos += rows * inner
    if pos < stop:
        partial(pos // inner, pos, stop)
    return boxes


def _dp_size(ds_config: dict[str, Any]) -> int:
    # deepspeed_config's train_batch_size is micro x accumulation x data-parallel ranks
    per_rank = ds_config["train_micro_batch_size_per_gpu"] * ds_config["gradient_accumulation_steps"]
    return ds_config["train_batch_size"] // per_rank
