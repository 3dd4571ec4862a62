"""Per-GPU memory estimator for the data-parallel strategies: which ones fit a model on a given cluster.

Everything is in bytes per GPU, bf16 mixed precision with Adam (two fp32 moments). fp16 (train.dtype=fp16) costs
the same bytes: 2-byte compute copies and gradients as bf16, plus the loss scaler's scale and growth counter (8 bytes
per GPU, not counted). Two model-state columns:

* ``model_states_ideal``: the ZeRO paper's 16 bytes/param (2 bf16 params + 2 bf16 grads + 12 fp32 master
  weights, momentum and variance), sharded as each strategy shards it. A lower bound with no gathered layers
  and no communication buffers.
* ``model_states_deepspeed``: for zero2 / zero3 (with and without CPU offload) the GPU-side numbers of
  DeepSpeed's own ``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_model_states_mem_needs``
  (deepspeed/runtime/zero/stage_1_and_2.py, stage3.py), reproduced exactly from total and largest-layer
  parameter counts; ``None`` for strategies DeepSpeed has no estimator for.

The params / grads / optimizer categories (and so ``total``) use the realistic accounting of each strategy:
DeepSpeed's for zero1-3 (zero1 derived from the same terms), FSDP2's for fsdp / hsdp, ZeRO paper's for ddp.

``estimate_3d_memory`` extends the FSDP accounting to (pp, dp, tp) layouts: tensor parallelism divides parameters
and (with sequence parallelism) activations by tp, pipeline parallelism keeps ``ceil(n_layers / pp)`` layers per
stage and up to pp micro-batches of activations on the first stage (1F1B), and gradient accumulation adds the
unsharded gradients FSDP2 keeps while gradient sync is off. hpcdist.planning.layouts uses it for fsdp, hsdp and 3d.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcdist.config.layout import LayoutKind
from hpcdist.config.schema import activation_checkpointing_mode
from hpcdist.models.args import ModelArgs, flops_per_token, num_params

__all__ = [
    "GIB",
    "STRATEGIES",
    "MemoryEstimate",
    "activation_bytes",
    "activation_bytes_3d",
    "document_mask_bytes",
    "estimate_3d_memory",
    "estimate_memory",
    "head_saved_bytes",
    "largest_layer_params",
    "largest_unit_params",
    "layer_saved_bytes",
    "plan_table",
    "recompute_flops_fraction",
    "saved_activation_bytes",
    "stage_params",
    "zero_build_bytes",
]

GIB = 2**30
# the kinds this estimator models (3d: estimate_3d_memory)
STRATEGIES: tuple[LayoutKind, ...] = tuple(k for k in LayoutKind if k is not LayoutKind.THREE_D)
_K = LayoutKind

# Buffers (fragmentation, NCCL / cuBLAS workspaces, CUDA context): a stated margin, not a measurement.
BUFFER_FRACTION = 0.10  # 10% of (model states + activations) for allocator fragmentation and comm buckets
CUDA_CONTEXT_BYTES = 1 * GIB  # CUDA context + cuBLAS/NCCL workspaces per process


@dataclass
class MemoryEstimate:
    """Per-GPU bytes by category; ``total`` = params + grads + optimizer + activations + buffers."""

    strategy: str
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    total: int
    model_states_ideal: int
    """16 bytes/param (ZeRO paper), sharded as the strategy shards it."""
    model_states_deepspeed: int | None = None
    """GPU side of DeepSpeed's estimator (zero2 / zero3 only), else None."""
    build: int = 0
    """Per-GPU bytes while the model is built, before the first step (:func:`zero_build_bytes` for ZeRO); 0 where
    the build never exceeds the step (the sharded strategies shard on the meta device first)."""

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> int:
        """The larger of the step's total and the build's peak: what the GPU must hold at some point."""
        return max(self.total, self.build)

    def fits(self, gpu_mem_bytes: int | float) -> bool:
        return self.peak <= gpu_mem_bytes


def largest_layer_params(args: ModelArgs) -> int:
    """Largest number of parameters directly owned by one module (DeepSpeed's ``model_to_params`` definition:
    ``p.numel()`` summed over ``m.parameters(recurse=False)``): the embedding / output table or one Linear."""
    d, hd = args.dim, args.head_dim
    return max(
        args.vocab_size * d,  # tok_embeddings, output
        d * args.ffn_dim,  # w1 / w2 / w3
        d * args.n_heads * hd,  # wq / wo
        d * args.kv_heads * hd,  # wk / wv
    )


def largest_unit_params(args: ModelArgs) -> int:
    """Largest FSDP2 unit as hpcdist.parallel.fsdp wraps the model: each TransformerBlock is one unit, the root
    unit holds what remains (tok_embeddings + final norm + output head)."""
    total = num_params(args)
    block = (total - args.dim - args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)) // args.n_layers
    return max(block, total - args.n_layers * block)


def layer_saved_bytes(
    args: ModelArgs,
    mode: str | bool,
    *,
    tokens: int,
    element_bytes: int = 2,
    tp: int = 1,
    sequence_parallel: bool = True,
) -> int:
    """Bytes one TransformerBlock keeps from its forward for its backward, for ``tokens`` = s*b tokens, counted
    from what hpcdist.models.llama saves (measured with saved-tensor hooks and malloc on CPU: tests/unit/
    parallel/test_activation_checkpointing.py) rather than Korthikanti's GPT count. ``element_bytes``: the compute dtype
    (2 = bf16, 4 = fp32); RMSNorm and RoPE compute in fp32 whatever it is.

    * none: per RMSNorm its fp32 input (4D) + the normed output and its weighted product (2eD); attention keeps the
      roped q, k (or the repeated k, v copies under GQA), v, the SDPA output (wo reads it as a view) and the fp32
      log-sum-exp (4H); SwiGLU keeps w1's, w3's, silu's and the product's outputs (4eF).
    * full: the block's input (eD); the block is recomputed in backward.
    * selective: the input and the outputs of every matmul (wq, wk, wv, wo, w1, w3, w2) and of SDPA (+ log-sum-exp):
      hpcdist.parallel.parallelize's policy; norms, RoPE, SiLU and products are recomputed.

    Tensor parallelism shards heads and the MLP hidden size; sequence parallelism also shards the norms' and the
    residual stream's tensors, else those stay whole on every tp rank. wo's and w2's outputs are kept before the
    row-parallel reduction: whole (s x D partial sums) on every tp rank.
    """
    mode = activation_checkpointing_mode(mode)
    e, d, hd = element_bytes, args.dim, args.head_dim
    q, kv, ffn = args.n_heads * hd, args.kv_heads * hd, args.ffn_dim
    sharded_stream = sequence_parallel and tp > 1  # norms and residual stream split over tp ranks
    stream_div = tp if sharded_stream else 1
    if mode == "full":
        return tokens * e * d // stream_div
    if mode == "selective":
        stream = e * d
        sharded = e * (q + 2 * kv) + e * q + 4 * args.n_heads + 2 * e * ffn
        return tokens * (stream // stream_div + sharded // tp + 2 * e * d)
    elif mode == "none":
        stream = 2 * (4 * d + 2 * e * d)  # two RMSNorms
        kv_saved = 2 * e * q if q != kv else 2 * e * kv  # repeat_kv copies k and v under GQA; else k', v
        sharded = e * q + kv_saved + e * q + 4 * args.n_heads + 4 * e * ffn
    else:
        raise ValueError(f"activation checkpointing mode {mode!r} is not one of none, full, selective")
    return tokens * (stream // stream_div + sharded // tp)


def head_saved_bytes(args: ModelArgs, *, tokens: int, element_bytes: int = 2, tp: int = 1) -> int:
    """The final RMSNorm's saved tensors and the fp32 log-softmax of the logits the loss keeps (vocabulary-sharded
    under tp: hpcdist's loss-parallel cross-entropy)."""
    return tokens * ((4 * args.dim + 2 * element_bytes * args.dim) + 4 * args.vocab_size // tp)


def saved_activation_bytes(
    args: ModelArgs,
    *,
    micro_batch_size: int,
    seq_len: int,
    activation_checkpointing: str | bool,
    element_bytes: int = 2,
) -> int:
    """What one micro-batch's forward leaves alive for its backward (one process, no tp/pp): every layer's saved
    bytes plus the head's. The peak adds the one layer recomputed at a time (:func:`activation_bytes`)."""
    tokens = micro_batch_size * seq_len
    per_layer = layer_saved_bytes(args, activation_checkpointing, tokens=tokens, element_bytes=element_bytes)
    return args.n_layers * per_layer + head_saved_bytes(args, tokens=tokens, element_bytes=element_bytes)


def recompute_flops_fraction(args: ModelArgs, mode: str | bool, seq_len: int) -> float:
    """Extra forward FLOPs backward spends recomputing, as a fraction of the forward's: full recomputes every block
    (the forward less the output head); selective keeps every matmul's and attention's output, so it recomputes no
    FLOPs this model counts (the norms', RoPE's and SiLU's elementwise work is memory-bound and, like in
    flops_per_token, not counted: the planner ranks none before selective at equal speed)."""
    mode = activation_checkpointing_mode(mode)
    if mode in ("none", "selective"):
        return 0.0
    forward = flops_per_token(args, seq_len) / 3  # 2N + attention per token
    return (forward - 2 * args.vocab_size * args.dim) / forward


def document_mask_bytes(*, micro_batch_size: int, seq_len: int, element_bytes: int = 2) -> int:
    """``data.document_mask``'s block-causal mask: one (b, 1, s, s) additive mask in the compute dtype per micro-batch
    in flight, shared by every layer (hpcdist.models.llama.block_causal_mask); its bool temporaries (3 b s^2 bytes
    while it is built) are freed before the first layer runs. Attention time is unchanged in the model: the PaLM
    FLOP count already charges the full s^2 scores, which a masked SDPA computes (no block skipping)."""
    return micro_batch_size * seq_len * seq_len * element_bytes


def activation_bytes(
    args: ModelArgs,
    *,
    micro_batch_size: int,
    seq_len: int,
    activation_checkpointing: str | bool,
    flash_attention: bool = True,
    element_bytes: int = 2,
    document_mask: bool = False,
) -> int:
    """Peak activation memory per GPU (data parallelism does not divide it), 16-bit by default.

    :func:`saved_activation_bytes` (every layer's :func:`layer_saved_bytes` + the head), plus, with checkpointing
    (full or selective), one layer recomputed in full at a time during backward. hpcdist uses SDPA (flash / memory-
    efficient kernels), which never materializes the a*s*s score matrix; ``flash_attention=False`` adds
    Korthikanti et al.'s ``5*a*s^2*b`` bytes per materialized layer (scores, softmax, dropout mask).
    ``document_mask``: plus :func:`document_mask_bytes`.
    """
    s, b = seq_len, micro_batch_size
    scores = 0 if flash_attention else 5 * args.n_heads * s * s * b
    mask = document_mask_bytes(micro_batch_size=b, seq_len=s, element_bytes=element_bytes) if document_mask else 0
    full_layer = layer_saved_bytes(args, "none", tokens=s * b, element_bytes=element_bytes) + scores
    mode = activation_checkpointing_mode(activation_checkpointing)
    saved = saved_activation_bytes(
        args, micro_batch_size=b, seq_len=s, activation_checkpointing=mode, element_bytes=element_bytes
    )
    if mode == "none":
        return saved + args.n_layers * scores + mask
    return saved + full_layer + mask


def zero_build_bytes(args: ModelArgs) -> int:
    """Per-GPU peak of building a ZeRO model (any stage, any world size): hpcdist.parallel.parallelize.build_zero
    materializes the whole model in fp32 on every GPU (4 bytes/param) and hands it to DeepSpeed, which partitions it
    only then; casting it to bf16 (one parameter at a time) and flattening the bf16 copies into its buckets (2 + 2
    bytes/param, the fp32 model freed by then) stay within the same 4 bytes/param. Plus the CUDA context, as the
    step's buffers count it."""
    return 4 * num_params(args) + CUDA_CONTEXT_BYTES


def _deepspeed_zero2_gpu(p: int, n: int, offload: bool) -> int:
    # stage_1_and_2.estimate_zero2_model_states_mem_needs: offload -> 2P (bf16 params); else
    # 2P + 18P/N (18 = 2 grads16 + 4 grads32 + 4 params32 + 8 Adam m, v).
    return 2 * p if offload else 2 * p + int(18 * p / n)


def _deepspeed_zero3_gpu(p: int, largest: int, n: int, offload_optimizer: bool, offload_params: bool) -> int:
    # stage3.estimate_zero3_model_states_mem_needs: largest layer gathered (4 bytes/param: bf16 param + grad)
    # plus 2P/N (bf16 param shard) with optimizer offload, nothing more with param offload too, 18P/N without.
    big = 4 * largest
    if offload_optimizer:
        return big if offload_params else big + int(2 * p / n)
    return big + int(18 * p / n)


def estimate_memory(
    args: ModelArgs,
    *,
    strategy: str,
    world_size: int,
    gpus_per_node: int,
    micro_batch_size: int,
    seq_len: int,
    activation_checkpointing: str | bool,
    zero_stage: int = 0,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    fsdp_replicate: int = 1,
    document_mask: bool = False,
    element_bytes: int = 2,
) -> MemoryEstimate:
    """Per-GPU memory of one training step under ``strategy`` (ddp, zero1, zero2, zero3, fsdp, hsdp; or
    ``zero`` with ``zero_stage`` 1-3). ``offload_*`` apply to zero2 (optimizer) and zero3 (optimizer, params).
    hsdp shards over ``world_size // fsdp_replicate`` GPUs (default replicate = number of nodes).
    ``element_bytes``: the activations' compute dtype (hpcdist.planning.layouts.activation_element_bytes)."""
    kind = LayoutKind.named(strategy, zero_stage=zero_stage, choices=STRATEGIES)
    if world_size < 1 or gpus_per_node < 1:
        raise ValueError(f"world_size and gpus_per_node must be >= 1, got {world_size}, {gpus_per_node}")
    if (offload_optimizer or offload_params) and kind not in (_K.ZERO2, _K.ZERO3):
        raise ValueError(f"offload is modelled for zero2 / zero3 only, not {kind}")
    if offload_params and not offload_optimizer:
        raise ValueError("offload_params needs offload_optimizer (DeepSpeed's estimator has no params-only case)")
    if offload_params and kind is _K.ZERO2:
        raise ValueError("zero2 does not offload parameters; use zero3")

    p = num_params(args)
    n = world_size
    big = largest_layer_params(args)
    ds: int | None = None

    if kind is _K.DDP:
        # ZeRO paper, nothing sharded: 2 bf16 params + 2 bf16 grads + 12 fp32 (master, m, v). (hpcdist's DDP
        # keeps fp32 params + fp32 grads under autocast: 4 + 4 + 8 = the same 16 bytes.)
        params, grads, optim = 2 * p, 2 * p, 12 * p
        ideal = 16 * p
    elif kind is _K.ZERO1:
        # DeepSpeed stage 1 (same terms as its stage-2 estimator, gradients not partitioned): full bf16 params
        # and grads, fp32 grad partition, 12/N fp32 master + Adam. DeepSpeed has no stage-1 estimator.
        params, grads, optim = 2 * p, 2 * p + 4 * p // n, 12 * p // n
        ideal = 4 * p + 12 * p // n
    elif kind is _K.ZERO2:
        ds = _deepspeed_zero2_gpu(p, n, offload_optimizer)
        if offload_optimizer:  # grads and optimizer step live on the CPU
            params, grads, optim = 2 * p, 0, 0
        else:
            params, grads, optim = 2 * p, 6 * p // n, 12 * p // n
        ideal = 2 * p if offload_optimizer else 2 * p + 14 * p // n  # GPU-resident part of the 16 bytes
    elif kind is _K.ZERO3:
        ds = _deepspeed_zero3_gpu(p, big, n, offload_optimizer, offload_params)
        # DeepSpeed counts the gathered largest layer at 4 bytes/param (2 bf16 param + 2 bf16 grad) and, without
        # offload, 18P/N for the shards: the bf16 grads are reduce-scattered through buckets, not kept.
        shard = 0 if offload_params else 2 * p // n
        params = 2 * big + shard
        grads = 2 * big + (0 if offload_optimizer else 4 * p // n)
        optim = 0 if offload_optimizer else 12 * p // n
        ideal = 0 if offload_params else 2 * p // n if offload_optimizer else 16 * p // n
    else:  # fsdp / hsdp: FSDP2 as hpcdist.parallel.fsdp configures it
        replicate = fsdp_replicate if kind is _K.HSDP else 1
        if replicate < 1 or n % replicate:
            raise ValueError(f"fsdp_replicate ({replicate}) must divide world_size ({n})")
        shard = n // replicate
        unit = largest_unit_params(args)
        # Assumed: fp32 sharded params (4/shard) + fp32 sharded grads (4/shard) + Adam m, v (8/shard), plus the
        # largest unit all-gathered in bf16 (2 bytes/param) and its unsharded fp32 gradient before the
        # reduce-scatter (4 bytes/param, reduce_dtype=fp32). Prefetch of a second unit is left to the margin.
        params = 4 * p // shard + 2 * unit
        grads = 4 * p // shard + 4 * unit
        optim = 8 * p // shard
        ideal = 16 * p // shard

    acts = activation_bytes(
        args,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        activation_checkpointing=activation_checkpointing,
        document_mask=document_mask,
        element_bytes=element_bytes,
    )
    rest = params + grads + optim + acts
    buffers = int(BUFFER_FRACTION * rest) + CUDA_CONTEXT_BYTES
    name = kind.value + ("+offload" if offload_optimizer else "")
    zero = kind in (_K.ZERO1, _K.ZERO2, _K.ZERO3)
    return MemoryEstimate(
        strategy=name,
        params=params,
        grads=grads,
        optimizer=optim,
        activations=acts,
        buffers=buffers,
        total=rest + buffers,
        model_states_ideal=ideal,
        model_states_deepspeed=ds,
        build=zero_build_bytes(args) if zero else 0,
    )


def _block_params(args: ModelArgs) -> int:
    """Parameters of one TransformerBlock (attention, SwiGLU, two RMSNorm weights)."""
    total = num_params(args)
    return (total - args.dim - args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)) // args.n_layers


def stage_params(args: ModelArgs, *, pp: int) -> int:
    """Parameters of the heaviest pipeline stage, before tensor parallelism divides them.

    pp = 1: the whole model. pp > 1: ``ceil(n_layers / pp)`` blocks plus the larger end: the last stage's
    output head + final norm (V*D + D) outweighs the first stage's embedding table (V*D). With tied embeddings
    each end stage holds its own copy of the table, so the count is the same.
    """
    if pp < 1:
        raise ValueError(f"pp must be >= 1, got {pp}")
    if pp == 1:
        return num_params(args)
    return -(-args.n_layers // pp) * _block_params(args) + args.vocab_size * args.dim + args.dim


def activation_bytes_3d(
    args: ModelArgs,
    *,
    micro_batch_size: int,
    seq_len: int,
    activation_checkpointing: str | bool,
    tp: int = 1,
    pp: int = 1,
    microbatches: int = 1,
    sequence_parallel: bool = True,
    document_mask: bool = False,
    element_bytes: int = 2,
) -> int:
    """Activation memory of the heaviest pipeline stage under tensor and pipeline parallelism (SDPA; 16-bit unless
    ``element_bytes`` says otherwise).

    Per layer and micro-batch :func:`layer_saved_bytes` of the mode (tensor parallelism splits the heads' and the
    MLP's tensors, sequence parallelism also the norms' and the residual stream's); with checkpointing (full or
    selective) one layer is recomputed in full at a time.

    A stage holds ``ceil(n_layers / pp)`` layers. Under 1F1B the first stage has up to ``min(pp,
    microbatches)`` micro-batches in flight (its warm-up forwards), the last stage one, plus the fp32 logits
    (``s*b*V*4``, divided by tp: hpcdist's TP plan keeps the logits vocabulary-sharded for a loss-parallel
    cross-entropy). The result is the larger of the two. With tp = pp = 1 this equals :func:`activation_bytes`
    (flash attention). ``document_mask``: each micro-batch in flight also holds its :func:`document_mask_bytes` (every
    tp rank the whole mask: it is replicated).
    """
    if tp < 1 or pp < 1 or microbatches < 1:
        raise ValueError(f"tp, pp and microbatches must be >= 1, got {tp}, {pp}, {microbatches}")
    tokens = seq_len * micro_batch_size
    kw = {"tokens": tokens, "tp": tp, "sequence_parallel": sequence_parallel, "element_bytes": element_bytes}
    mode = activation_checkpointing_mode(activation_checkpointing)
    per_layer = layer_saved_bytes(args, mode, **kw)
    recompute = 0 if mode == "none" else layer_saved_bytes(args, "none", **kw)  # one layer rebuilt at a time
    layers = -(-args.n_layers // pp)
    mask = (
        document_mask_bytes(micro_batch_size=micro_batch_size, seq_len=seq_len, element_bytes=element_bytes)
        if document_mask
        else 0
    )

    def stage(in_flight: int) -> int:
        return in_flight * (layers * per_layer + mask) + recompute

    head = head_saved_bytes(args, tokens=tokens, tp=tp, element_bytes=element_bytes)
    if pp == 1:
        return stage(1) + head
    return max(stage(min(pp, microbatches)), stage(1) + head)


def estimate_3d_memory(
    args: ModelArgs,
    *,
    tp: int,
    pp: int,
    dp: int,
    micro_batch_size: int,
    seq_len: int,
    activation_checkpointing: str | bool,
    microbatches: int = 1,
    dp_shard: int | None = None,
    sequence_parallel: bool = True,
    reduce_bytes: int = 4,
    strategy: str = LayoutKind.THREE_D,
    document_mask: bool = False,
    element_bytes: int = 2,
) -> MemoryEstimate:
    """Per-GPU memory of a (pp, dp, tp) layout with FSDP2 over dp, for the heaviest pipeline stage.

    ``P_s = ceil(stage_params(pp) / tp)`` parameters per GPU before FSDP; FSDP shards them over ``dp_shard``
    ranks (default dp; HSDP: the ranks of one replica group) with :func:`estimate_memory`'s FSDP accounting:
    fp32 params, grads, Adam m and v sharded (16 bytes/param) plus the largest unit (divided by tp) gathered in
    bf16 with its fp32 gradient. With tp = pp = 1 and one micro-batch this is exactly ``estimate_memory``'s
    fsdp (dp_shard = world) or hsdp (dp_shard = GPUs per replica) row.

    Gradient accumulation (``microbatches > 1``) costs what FSDP2 does when gradient sync is off for the
    non-final micro-batches (hpcdist's FSDP strategy, and torch.distributed.pipelining for every FSDP stage):
    each unit keeps its unsharded gradient in the reduce dtype (``reduce_bytes * P_s``). Under pp > 1 hpcdist
    does not reshard after forward (the whole stage stays gathered for the step), so the stage's bf16
    parameters add ``2 * P_s``. The heaviest stage is approximated by :func:`stage_params`
    (hpcdist.parallel.pp.split_layers balances the embedding and head, so real stages hold at most about this).
    Activations: :func:`activation_bytes_3d`. Buffers: as in ``estimate_memory``.
    """
    problems = []
    for name, value in (("tp", tp), ("pp", pp), ("dp", dp), ("microbatches", microbatches)):
        if value < 1:
            problems.append(f"{name} must be >= 1, got {value}")
    shard = dp if dp_shard is None else dp_shard
    if shard < 1 or dp % shard:
        problems.append(f"dp_shard ({shard}) must divide dp ({dp})")
    if pp > args.n_layers:
        problems.append(f"pp ({pp}) exceeds n_layers ({args.n_layers}): a stage needs at least one layer")
    if tp > 0 and (args.n_heads % tp or args.kv_heads % tp):
        problems.append(f"tp ({tp}) must divide n_heads ({args.n_heads}) and n_kv_heads ({args.kv_heads})")
    if reduce_bytes not in (2, 4):
        problems.append(f"reduce_bytes must be 2 (bf16) or 4 (fp32), got {reduce_bytes}")
    if problems:
        raise ValueError("; ".join(problems))

    p_s = -(-stage_params(args, pp=pp) // tp)
    unit = -(-largest_unit_params(args) // tp)
    params = 4 * p_s // shard + 2 * unit
    grads = 4 * p_s // shard + 4 * unit
    optim = 8 * p_s // shard
    if microbatches > 1:
        grads += reduce_bytes * p_s  # unsharded accumulated gradient of every unit until the last micro-batch
    if pp > 1:
        params += 2 * p_s  # no resharding after forward under pp: the stage's bf16 copy stays gathered
    acts = activation_bytes_3d(
        args,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        activation_checkpointing=activation_checkpointing,
        tp=tp,
        pp=pp,
        microbatches=microbatches,
        sequence_parallel=sequence_parallel,
        document_mask=document_mask,
        element_bytes=element_bytes,
    )
    rest = params + grads + optim + acts
    buffers = int(BUFFER_FRACTION * rest) + CUDA_CONTEXT_BYTES
    return MemoryEstimate(
        strategy=str(strategy),
        params=params,
        grads=grads,
        optimizer=optim,
        activations=acts,
        buffers=buffers,
        total=rest + buffers,
        model_states_ideal=16 * p_s // shard,
    )


# (kind, offload_optimizer, offload_params): the memory table's rows, labelled kind[+offload]
_ROWS = (
    (_K.DDP, False, False),
    (_K.ZERO1, False, False),
    (_K.ZERO2, False, False),
    (_K.ZERO2, True, False),
    (_K.ZERO3, False, False),
    (_K.ZERO3, True, True),
    (_K.FSDP, False, False),
    (_K.HSDP, False, False),
)
TABLE_ROWS = tuple(kind + ("+offload" if off_opt else "") for kind, off_opt, _ in _ROWS)


def plan_table(
    args: ModelArgs,
    *,
    nodes: int,
    gpus_per_node: int,
    gpu_mem_gb: float,
    micro_batch_size: int,
    seq_len: int,
    activation_checkpointing: str | bool,
    document_mask: bool = False,
    element_bytes: int = 2,
) -> str:
    """One row per strategy: GiB per GPU by category, total, whether it fits ``gpu_mem_gb`` (GiB), and the
    DeepSpeed-estimator model states beside the 16-bytes/param ideal. hsdp replicates across nodes and shards
    inside each node. zero3+offload offloads both optimizer and parameters to the CPU."""
    world = nodes * gpus_per_node
    mem = gpu_mem_gb * GIB
    mask = document_mask_bytes(micro_batch_size=micro_batch_size, seq_len=seq_len, element_bytes=element_bytes)
    header = (
        f"{num_params(args) / 1e9:.2f}B params, {nodes} node(s) x {gpus_per_node} GPU(s) = {world}, "
        f"{gpu_mem_gb:g} GiB/GPU, micro batch {micro_batch_size}, seq {seq_len}, activation checkpointing "
        f"{activation_checkpointing_mode(activation_checkpointing)}, {8 * element_bytes}-bit activations"
        + (f", document mask ({mask / GIB:.2f} GiB per micro-batch, in activ)" if document_mask else "")
        + "; per GPU"
    )
    cols: tuple[str, ...]
    cols = ("strategy", "params GiB", "grads GiB", "optim GiB", "activ GiB", "buffers GiB", "total GiB", "fits")
    cols += ("DS states GiB", "16B/param GiB")  # model states: DeepSpeed's estimate, the 16 bytes/param ideal
    cols += ("build GiB",)  # the model's build, where it exceeds the step's memory (ZeRO)
    widths = (13, 10, 9, 9, 9, 11, 9, 4, 13, 13, 9)
    lines = [header, "  ".join(f"{c:>{w}}" for c, w in zip(cols, widths, strict=True))]
    for kind, off_opt, off_par in _ROWS:
        e = estimate_memory(
            args,
            strategy=kind,
            world_size=world,
            gpus_per_node=gpus_per_node,
            micro_batch_size=micro_batch_size,
            seq_len=seq_len,
            activation_checkpointing=activation_checkpointing,
            offload_optimizer=off_opt,
            offload_params=off_par,
            fsdp_replicate=nodes,
            document_mask=document_mask,
            element_bytes=element_bytes,
        )
        ds = "-" if e.model_states_deepspeed is None else f"{e.model_states_deepspeed / GIB:.1f}"
        cells = [e.params, e.grads, e.optimizer, e.activations, e.buffers, e.total]
        row = [f"{e.strategy:>13}", *(f"{c / GIB:{w}.1f}" for c, w in zip(cells, widths[1:7], strict=True))]
        row += [f"{'yes' if e.fits(mem) else 'no':>4}", f"{ds:>13}", f"{e.model_states_ideal / GIB:13.1f}"]
        row.append(f"{e.build / GIB:9.1f}" if e.build else f"{'-':>9}")
        lines.append("  ".join(row))
    lines += [
        "activations: the model's saved tensors per layer (SDPA: no a*s^2 scores) + fp32 logits; buffers: 10% margin "
        "+ 1 GiB CUDA context",
        "model states (params + grads + optimizer): DS states = DeepSpeed's zero2/zero3 estimator (GPU side); "
        "16B/param = the",
        "  ZeRO paper's 16 bytes/param, sharded",
        "build: ZeRO materializes the whole fp32 model on every GPU before DeepSpeed partitions it (4 bytes/param + "
        "CUDA context);",
        "  fits = the larger of build and total fits",
    ]
    return "\n".join(lines) + "\n"
