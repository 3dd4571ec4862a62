"""The job configuration's schema: nested dataclasses whose fields are the YAML keys (the user's reference).

One section per dataclass; ``section.key=value`` overrides and YAML keys map 1:1 to these fields and their
docstrings say what each does. Loading lives in :mod:`hpcdist.config.loader` / :mod:`hpcdist.config.job`, the
rules in :mod:`hpcdist.config.rules`. Torch-free: the model section is :class:`hpcdist.models.args.ModelArgs`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from hpcdist.base.rundir import RunDir
from hpcdist.byte_vocab import BYTE_VOCAB
from hpcdist.models.args import ModelArgs

__all__ = [
    "ACTIVATION_CHECKPOINTING",
    "CheckpointConfig",
    "DataConfig",
    "FSDPConfig",
    "FaultConfig",
    "JobConfig",
    "LoggingConfig",
    "MlflowConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "PrometheusConfig",
    "RunConfig",
    "TrainConfig",
    "WandbConfig",
    "ZeroConfig",
    "activation_checkpointing_mode",
]


@dataclass
class RunConfig:
    """Identity and place of the run (``run:``)."""

    name: str = "hpcdist"
    """Job name (TensorBoard, logs, SLURM job name)."""
    dir: str = "runs/demo"
    """Run directory: resolved config, checkpoints/, metrics.jsonl, tensorboard/. Must be on a shared
    filesystem for multi-node jobs."""
    seed: int = 1234
    """Seed for weight init and data order; identical on all ranks so layouts agree."""
    log_level: str = "INFO"
    """Log level of rank 0: DEBUG, INFO, WARNING or ERROR; the other ranks log WARNING and above."""


@dataclass
class ModelConfig(ModelArgs):
    """The model (``model:``): the :class:`~hpcdist.models.args.ModelArgs` fields, optionally over a preset."""

    vocab_size: int | str = BYTE_VOCAB
    """Vocabulary size V (258 = the byte tokenizer), or ``auto``: the prepared data's vocabulary rounded up to a
    multiple of 64 (hpcdist.config.vocab; the padding rows are never a target). Data with ids >= V is refused at
    start-up."""
    preset: str | None = None
    """A shipped preset name (hpcdist/resources/models/<name>.yaml) or a YAML path; its keys are defaults under
    this section's keys."""


@dataclass
class DataSourceConfig:
    """One prepared dataset of a blend (``data.sources: [{path: ..., weight: ...}, ...]``)."""

    path: str = ""
    """A directory made by `hpcdist prepare`."""
    weight: float = 1.0
    """Its share of the samples, relative to the other sources' weights (> 0)."""


@dataclass
class DataConfig:
    """Training data (``data:``): where tokens come from and how they are cut into samples."""

    source: str = "stdlib"
    """stdlib: this interpreter's standard library sources (nothing downloaded); files: shards prepared by
    `hpcdist prepare` at data.path; synthetic: deterministic random tokens (benchmarks)."""
    path: str | None = None
    """Prepared shard directory (source=files); for stdlib, where to cache shards (default <run.dir>/data)."""
    sources: list[DataSourceConfig] = field(default_factory=list)
    """source=files, instead of path: a blend of prepared directories, ``[{path: ..., weight: ...}, ...]``. Each is
    read in its own epochs (every sample once per epoch), in the weights' proportion; all must share one tokenizer."""
    seq_len: int = 128
    """Tokens per sample (the model sees seq_len inputs and seq_len shifted targets)."""
    max_tokens: int | None = 4_000_000
    """Cap on tokens prepared from the stdlib corpus (keeps the demo's preparation to seconds)."""
    val_fraction: float = 0.01
    """Fraction of the tokens held out for evaluation, in [0, 1)."""
    shuffle: bool = True
    """A new sample order every epoch (seeded by run.seed, so resuming continues it)."""
    dtype: str = "uint16"
    """Token dtype of the prepared shards: uint16 (vocab <= 65536) or uint32."""
    prefetch: int = 2
    """Batches built ahead in a background thread (pinned memory on CUDA, copied non-blocking); 0 builds each batch
    in the training thread. Resume is exact either way: prefetched batches not yet trained on are not consumed."""
    synthetic_samples: int = 100_000
    """Samples in the synthetic dataset (source=synthetic)."""
    document_mask: bool = False
    """Attention never crosses an EOS inside a packed sample (block-causal) and RoPE positions restart at each
    document (hpcdist.models.llama). Needs data with an EOS id: stdlib, or files whose meta.json records eos_id (every
    `hpcdist prepare` does). model.document_attention says how: on a GPU (auto) FlexAttention with a block mask; on
    CPU (or dense) a (micro_batch, 1, seq_len, seq_len) mask per forward and, on GPU, no flash kernel (docs/DATA.md)."""


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule (``optim:``)."""

    lr: float = 3e-4
    """Peak learning rate, reached after warmup_steps and then decayed by the schedule."""
    min_lr_ratio: float = 0.1
    """Final LR as a fraction of lr (cosine / linear decay)."""
    schedule: str = "cosine"
    """LR decay after warmup: cosine, linear or constant."""
    warmup_steps: int = 100
    """Linear warmup to lr over this many steps (0 = none)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (matrices only; norms are not decayed)."""
    beta1: float = 0.9
    """AdamW first-moment decay, in [0, 1)."""
    beta2: float = 0.95
    """AdamW second-moment decay, in [0, 1)."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    grad_clip: float = 1.0
    """Max global gradient norm; 0 disables clipping (the norm is still measured)."""


COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
"""train.compile_backend's choices (torchtitan's compile.backend): torch.compile backends that train on CPU and GPU."""
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
"""train.activation_checkpointing's modes (hpcdist.parallel.parallelize applies them, hpcdist.planning.memory models
them)."""
_AC_ALIASES: dict[Any, str] = {True: "full", False: "none", "true": "full", "false": "none"}


def activation_checkpointing_mode(value: str | bool) -> str:
    """The mode a train.activation_checkpointing value names: booleans (YAML true/false, the key's old type) map to
    full/none; anything else is returned unchanged for the rules to accept or refuse."""
    if isinstance(value, bool):
        return _AC_ALIASES[value]
    return _AC_ALIASES.get(value.lower(), value) if isinstance(value, str) else value


@dataclass
class TrainConfig:
    """The training loop (``train:``): length, batch sizes, precision, evaluation."""

    steps: int = 1000
    """Optimizer steps to train in total (a resumed run continues up to this number)."""
    global_batch_size: int = 32
    """Samples per optimizer step across all data-parallel ranks."""
    micro_batch_size: int = 8
    """Samples per forward pass per rank; accumulation = global / (micro * data-parallel size)."""
    dtype: str = "auto"
    """auto = bf16 autocast on GPUs of compute capability 8.0 and later (A100, H100), fp16 (as below) on older ones
    (V100) unless tp/pp is on (bf16 there), fp32 on CPU (hpcdist.parallel.parallelize.train_dtype); fp32, bf16;
    fp16 = fp16 autocast with dynamic loss scaling (GPUs without bf16, e.g. V100): torch's GradScaler (ddp, one
    process), its sharded form (fsdp), DeepSpeed's fp16 mode (zero, GPU only); an overflow step is skipped by the
    scaler (counted as ``scaler_skips``), not a non-finite stop. Not with tp/pp."""
    activation_checkpointing: str | bool = "none"
    """none; full = keep each block's input only and recompute the whole block in backward (least memory, ~1/3 more
    compute); selective = op-level: keep the outputs of the expensive ops (every matmul, attention) and recompute the
    cheap ones (norms, RoPE, SiLU, products): about half of none's memory for no recomputed matmul. true/false are
    accepted as full/none."""
    compile: bool = False
    """torch.compile each transformer block (one graph reused for all blocks)."""
    compile_backend: str = "inductor"
    """torch.compile's backend: inductor (generated kernels: the speed-up; the default), aot_eager (the same dynamo
    and AOTAutograd graphs run with eager kernels: compiles in seconds; to tell a numerics difference of inductor's
    kernels from a tracing problem), eager (dynamo's capture only)."""
    eval_every_steps: int = 0
    """0 disables periodic evaluation."""
    eval_batches: int = 4
    """Batches per evaluation."""
    eval_data: str | None = None
    """A held-out prepared dataset (made by ``hpcdist prepare`` with the run's tokenizer) to evaluate on every
    eval_every_steps instead of the val split of the training data; its windows are read in order from the start."""
    nonfinite: str = "stop"
    """A NaN/Inf gradient norm: stop (exit 1 naming the first bad step; that state is never checkpointed) or skip
    (the update is dropped, the LR schedule not advanced; one device sync per step; not with parallel.strategy=zero)."""
    nonfinite_triage: bool = False
    """On a NaN/Inf gradient norm, re-run the step once on the same inputs from the state before it: reproducible =
    bad data (the samples are named; with nonfinite=skip they are skipped from then on and on resume, listed in
    <run.dir>/skipped_samples.json), not reproducible = bad hardware (a "hardware" failure blaming the rank's host in
    failures.jsonl, so a restart excludes it; the run stops). One device sync per step; not with strategy=zero."""
    max_nonfinite_skips: int = 10
    """With nonfinite=skip: more non-finite steps than this in a row stop the run like nonfinite=stop."""

    def __post_init__(self) -> None:
        # one spelling downstream: every reader compares against ACTIVATION_CHECKPOINTING
        self.activation_checkpointing = activation_checkpointing_mode(self.activation_checkpointing)


@dataclass
class FSDPConfig:
    """FSDP2 (``fully_shard``) settings; read only when parallel.strategy=fsdp."""

    reshard_after_forward: bool = True
    """Free each block's gathered parameters after its forward and gather them again for backward (ZeRO-3
    memory); false keeps them until backward (less communication, more memory: ZeRO-2 like)."""
    replicate: int = 1
    """HSDP: number of replica groups. 1 = shard over all ranks; R > 1 = shard inside groups of world/R ranks
    (e.g. one node) and all-reduce gradients across the R groups. Must divide the world size."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host memory (GPU jobs short of memory)."""
    param_dtype: str = "auto"
    """Dtype of the gathered parameters that forward/backward compute in: auto = what train.dtype selects (bf16 on
    GPUs from sm80, fp16 below, fp32 on CPU; train.dtype=bf16 makes it bf16 on CPU too), or fp32 / bf16. The
    sharded master weights and the optimizer state stay fp32."""
    reduce_dtype: str = "fp32"
    """Dtype gradients are reduce-scattered / all-reduced in: fp32 (exact sums) or bf16 (half the traffic)."""


@dataclass
class ZeroConfig:
    """DeepSpeed ZeRO settings; read only when parallel.strategy=zero."""

    stage: int = 2
    """1 = partition optimizer state, 2 = + gradients, 3 = + parameters."""
    offload_optimizer: bool = False
    """Optimizer state and step on the host (ZeRO-Offload; JIT-builds DeepSpeed's cpu_adam, ~100 s the first time)."""
    offload_params: bool = False
    """Partitioned parameters in host memory (ZeRO-Infinity); stage 3 only."""
    overlap_comm: bool = False
    """Overlap gradient reduction with backward (more memory for the buckets)."""
    reduce_bucket_size: int = 500_000_000
    """Elements per gradient reduce bucket."""
    allgather_bucket_size: int = 500_000_000
    """Elements per parameter all-gather bucket (stages 1 and 2)."""
    param_persistence_threshold: int = 100_000
    """Stage 3: parameters with fewer elements stay whole on every rank (DeepSpeed's default; 0 shards all)."""


@dataclass
class PowerSGDConfig:
    """PowerSGD gradient compression (parallel.ddp.comm_hook=powersgd; torch's ``PowerSGDState``)."""

    rank: int = 4
    """Rank of the low-rank approximation of each gradient matrix: traffic per n x m matrix falls from n*m to
    rank*(n+m) elements. 4 suits LLM-sized matrices (125m: 134x fewer bytes); small models need more (the demo's
    dim-256 model: 8-16, docs/PROFILING.md); higher converges closer to uncompressed."""
    start_iter: int = 100
    """Optimizer steps of plain all-reduce before compression starts (early gradients change fast). Keep it at
    least optim.warmup_steps (default 100) and about 10% of train.steps or more (torch's advice; measured on the
    demo: 10 -> 100 steps of 200 cut PowerSGD rank 8's final train-loss gap from 3.9% to 1.1%). At least 2 with
    error feedback or warm start (torch's rule: DDP rebuilds its buckets after the first step)."""
    use_error_feedback: bool = True
    """Add the previous step's compression error to this step's gradient (keeps convergence near uncompressed)."""
    warm_start: bool = True
    """Reuse last step's Q matrices as the starting point of the power iteration (one iteration then suffices)."""
    batched: bool = False
    """Compress each bucket as one flattened square matrix (torch's batched_powerSGD_hook): fewer, larger
    collectives, a coarser approximation."""


@dataclass
class DDPConfig:
    """DDP settings (parallel.strategy=ddp)."""

    bucket_cap_mb: int = 25
    """DDP gradient bucket size, in MiB (DDP's bucket_cap_mb)."""
    comm_hook: str = "none"
    """Gradient communication hook: none (DDP's built-in fp32 all-reduce, not measured), allreduce (the same
    fp32 all-reduce through torch's hook, so its bytes and time are measured), bf16 / fp16 (gradients sent in half
    precision: half the bytes), powersgd (low-rank compression, parallel.ddp.powersgd). Every hook but none logs
    ``comm_bytes_per_step`` and ``comm_share``."""
    powersgd: PowerSGDConfig = field(default_factory=PowerSGDConfig)
    """PowerSGD settings (comm_hook=powersgd)."""


@dataclass
class ParallelConfig:
    """How the job is spread over its ranks (``parallel:``)."""

    MOVED_KEYS: ClassVar[dict[str, str]] = {"bucket_cap_mb": "parallel.ddp.bucket_cap_mb"}
    """Keys of this section that live elsewhere now: refused at load with a line naming the new key."""

    strategy: str = "ddp"
    """ddp, fsdp (FSDP2, HSDP with fsdp.replicate > 1), zero (DeepSpeed ZeRO 1/2/3), 3d (pp x dp x tp on one
    DeviceMesh: pipeline stages, FSDP2 on dp, tensor + sequence parallel) or auto (the top row of `hpcdist plan`
    for this model on parallel.auto_cluster at the job's world size, chosen when the job starts and logged)."""
    auto_cluster: str = "a100_ib"
    """parallel.strategy=auto: the cluster profile (shipped name or YAML path) whose GPUs and bandwidths the
    planner assumes; checkpoint.every_minutes=auto: the profile whose node MTBF it assumes."""
    ddp: DDPConfig = field(default_factory=DDPConfig)
    """DDP settings: bucket size, gradient compression hooks (parallel.strategy=ddp)."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP2 / HSDP settings (parallel.strategy=fsdp)."""
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    """DeepSpeed ZeRO settings (parallel.strategy=zero)."""
    pp: int = 1
    """3d: pipeline-parallel degree (stages across ranks, outermost mesh dimension). -1 = fill the remaining ranks."""
    dp: int = -1
    """3d: data-parallel degree, FSDP2 over these ranks (parallel.fsdp.* apply; fsdp.replicate > 1 = HSDP).
    -1 (default) = fill: world size / (pp x tp)."""
    tp: int = 1
    """3d: tensor-parallel degree (innermost: consecutive ranks, one node). Must divide model.n_heads,
    model.n_kv_heads, model.ffn_dim and data.seq_len (sequence parallelism). -1 = fill."""
    tp_across_nodes: bool = False
    """Allow a tp group larger than one node (slow: every layer all-gathers and reduce-scatters activations)."""
    pp_schedule: str = "1F1B"
    """3d with pp > 1: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble or DualPipeV.
    Micro-batches per step = train.global_batch_size / (train.micro_batch_size x dp): they all go through the
    pipeline in one schedule step (no separate accumulation loop); 1F1B-like schedules need at least pp of them."""
    pp_stages_per_rank: int | None = None
    """Virtual pipeline stages per rank; null = 2 for interleaved / V schedules, 1 otherwise. Stages are cut by
    layer count balanced against the embedding and output-head cost (hpcdist.parallel.pp.split_layers)."""


@dataclass
class LocalCheckpointConfig:
    """The node-local checkpoint tier (``checkpoint.local``, hpcdist.checkpoint.local; docs/FAULTS.md): every
    rank saves its own shard on its node's disk at its own cadence, each node's files are copied to the next node
    over the job's process group, and a restart takes the newest step complete for every rank (counting those
    copies) when it is newer than the shared checkpoint."""

    dir: str | None = None
    """Node-local directory (an absolute path on the node's own disk, e.g. /dev/shm/hpcdist-{job_id} or a local
    NVMe), yours, never reached through another user's link; unset = no local tier. Placeholders: {job_id} (the
    SLURM job id, ``nojob`` outside SLURM; the same across requeues and in-job restarts), {user} (your user name),
    {host} (the node's host name: a file system shared by several nodes still gets one directory per node)."""
    every_steps: int = 0
    """Save locally every N steps (0 = by steps never)."""
    every_minutes: float = 0.0
    """Save locally when this many minutes passed since the last local save (0 = off); rank 0's clock decides and
    the ranks agree through the per-step stop agreement, as for checkpoint.every_minutes."""
    keep: int = 2
    """Newest complete local steps kept on each node (the peer copies too); older ones are deleted."""


@dataclass
class CheckpointConfig:
    """Saving and resuming (``checkpoint:``)."""

    every_steps: int = 100
    """Save every N steps (0 = only at the end)."""
    every_minutes: float | str = 0.0
    """Also save when this many minutes passed since the last save (0 = off), whichever of the two comes first:
    bounds the work a crash loses in wall time whatever the step time. Rank 0's clock decides; the ranks agree
    through the per-step stop agreement, so the save comes one step after the deadline, on every rank alike.
    ``auto``: the interval that maximises goodput for this run (Young/Daly, hpcdist.checkpoint.cadence), from the
    step time and the save stall rank 0 measures and the failure rate of parallel.auto_cluster's profile
    (hardware.node_mtbf_hours / the job's nodes; with checkpoint.local, only the failures that tier cannot recover);
    30 minutes until the first save has been measured, and without a node MTBF in the profile."""
    dir: str | None = None
    """Default <run.dir>/checkpoints."""
    keep_last: int = 3
    """Complete checkpoints to keep; older ones are deleted only after a newer one is complete."""
    resume: str = "auto"
    """auto = newest complete checkpoint if any, else fresh; none = fresh from step 0, the run.dir's complete
    checkpoints set aside as step-N.abandoned-<time> (kept, never resumed: give it for one run on the command line,
    not in a config a requeue reruns); or a step-XXXXXXXX path (newer checkpoints are set aside the same way)."""
    init_from: str | None = None
    """A step-XXXXXXXX checkpoint (any run, any strategy but ZeRO-3) whose model weights start this run when it
    has no checkpoint of its own yet: weights that match by name and shape are loaded, the others keep their
    initialization (listed in the log); optimizer, schedule, data position and step start fresh. Unlike
    checkpoint.resume it survives a requeue: once this run saved, it resumes from its own checkpoints. Or a Hugging
    Face Llama directory (config.json + safetensors, e.g. from `hpcdist export`): its weights, every one; the model
    section must equal config.json's (checked at load, key by key; docs/HF.md)."""
    async_save: bool = False
    """Write checkpoints in the background while training continues: the state is copied into host staging buffers
    (shared memory, pinned on CUDA; allocated once after the first step, reused; refused at start-up when the node
    cannot hold them) beside the next step's forward and backward, and a checkpoint process per rank writes them."""
    save_final: bool = True
    """Save a checkpoint when training ends."""
    write_threads: int = 0
    """Threads each rank writes its checkpoint shards with (DCP's FileSystemWriter); 0 = auto: this rank's share
    of the cores it may run on (os.sched_getaffinity, e.g. srun's --cpus-per-task), at most 8."""
    verify: str = "checksum"
    """Before resuming, check the checkpoint against its MANIFEST.json: checksum (sha256 of every file, read
    once, spread over the ranks), size (sizes only: cheap, catches truncation) or none. A damaged checkpoint is
    skipped for the previous complete one, with a warning naming the file."""
    trusted_owners: list[str] = field(default_factory=list)
    """User names whose checkpoints may be loaded besides your own (and root's), e.g. [alice] for a shared
    read-only checkpoint of hers. Loading a checkpoint unpickles parts of it, which runs any code its writer put
    there: before anything is read, every file and directory of the checkpoint must belong to you, root or one of
    these users, and none may be writable by others or by a group other than its owner's private one
    (docs/SECURITY.md)."""
    local: LocalCheckpointConfig = field(default_factory=LocalCheckpointConfig)
    """The node-local tier with peer copies (off unless ``checkpoint.local.dir`` is set)."""


@dataclass
class FaultConfig:
    """Preemption, requeue and failure policy (``fault:``)."""

    requeue_signal: str = "USR2"
    """Signal SLURM sends before the time limit (sbatch --signal=<sig>@<lead>): checkpoint on all ranks, requeue,
    exit. SIGTERM (scancel, preemption) always means: checkpoint and exit without requeueing."""
    requeue: bool = True
    """Requeue the SLURM job after the stop checkpoint (scontrol requeue), and after a failure (fault.max_failures)."""
    max_restarts: int = 10
    """Time-limit requeues (the requeue signal) allowed; preemptions and failures have their own limits below. Counted
    in <run.dir>/restarts.json (outside a run dir: SLURM_RESTART_COUNT)."""
    max_preemptions: int = -1
    """Restarts SLURM made by itself (preemption with PreemptMode=REQUEUE, a node failure, an admin requeue) after
    which the job stops instead of training again; -1 = unlimited."""
    max_failures: int = 5
    """Requeues after a failure (a rank raised, was killed, or hung past fault.watchdog_timeout_s); the batch script
    decides after srun fails (sbatch/common.sh -> hpcdist.launch.restarts after-step). 0 = a failure ends the job."""
    max_same_failure: int = 3
    """A failure loop: the same failure (same cause, e.g. the same exception or signal) this many times in a row stops
    requeueing with that reason, whatever max_failures still allows."""
    exclude_failed_nodes: bool = True
    """On a failure requeue, add the host the failure is attributed to to the job's excluded nodes (ExcNodeList)."""
    max_excluded_nodes: int = 2
    """At most this many nodes excluded in all, and never so many that the partition keeps fewer usable nodes than
    the job needs (the job must stay schedulable)."""
    exclude_nodes_file: str | None = None
    """Hosts to exclude at the next requeue too: one per line, comma-separated, or the `--exclude=...` line the
    nccl_check finder prints (same limits)."""
    spare_nodes: int = 0
    """Hot spares: the job asks SLURM for this many nodes more than it trains on (``hpcdist submit`` adds them to
    ``nodes``; with plain sbatch, ask for them in --nodes). When a training node fails or fails the health gate, the
    next attempt starts at once inside the allocation on a spare (in-job restart) instead of a requeue."""
    min_nodes: int = 0
    """In-job restarts may continue on fewer nodes than the layout's (fewer data-parallel replicas, the same global
    batch through more gradient accumulation) down to this many; 0 = the layout's node count (never shrink). When
    fewer healthy nodes remain the job requeues as before."""
    restart_backoff_s: float = 3.0
    """Pause before an in-job restart (the failed step's processes release ports and files); doubled for each
    further in-job restart of the same failure, at most 60 s."""
    in_process: bool = False
    """In-process recovery (docs/FAULTS.md): the job's unused healthy nodes (fault.spare_nodes) run warm spares; when
    a rank dies the other ranks keep their processes, rebuild their group and roll back to the newest node-local
    snapshot, and a spare takes the dead rank's place with its files from the peer copy. Needs checkpoint.local
    (``every_steps: 1`` loses at most one step) and fault.spare_nodes >= 1. What it cannot recover (no spare left,
    the batch node lost) takes the in-job restart or the requeue as before."""
    regroup_settle_s: float = 3.0
    """In-process recovery (a job whose launcher started a rendezvous store, ``HPCDIST_REGROUP_STORE``; docs/FAULTS.md):
    after a peer's death the surviving ranks wait this long for every rank to rejoin, then a rank still missing is
    declared dead and its number goes to a warm spare. It bounds the recovery from below and must exceed the spread
    between the survivors noticing the failure: about one step's compute between two collectives."""
    regroup_timeout_s: float = 120.0
    """In-process recovery: the rebuilt process group must form within this many seconds (a spare joined, every
    survivor back); otherwise the ranks fail as before and the in-job restart or requeue takes over."""
    watchdog_timeout_s: float = 90.0
    """Hang watchdog: a rank whose training step makes no progress for this long (or 4x its slowest step so far,
    if longer) dumps every thread's Python stack to its log, records the failure in <run.dir>/failures.jsonl and
    exits 124, so srun ends the step and the failure policy requeues or stops the job. 0 disables it; otherwise at
    least 5 s (shorter ones declare normal steps and saves hangs). 90 s keeps
    detection + SLURM's requeue hold (~2 min) + restart within the 5-minute recovery target (docs/FAULTS.md). The
    process-group (collective) timeout becomes the longest allowance + 60 s: NCCL's / gloo's own is the backstop."""
    watchdog_slow_phase_s: float = 900.0
    """The watchdog's allowance for the legitimately long phases: an attempt's first step (NCCL init, compile),
    checkpoint saves and their completion, evaluation. Never below watchdog_timeout_s."""


@dataclass
class WandbConfig:
    """Weights & Biases (``logging.wandb:``), rank 0 only; needs ``pip install 'hpcdist[wandb]'``."""

    project: str | None = None
    """W&B project; unset (the default) = no W&B run."""
    mode: str = "online"
    """online, offline (written under <run.dir>/wandb, upload later with `wandb sync`) or disabled."""
    entity: str | None = None
    """W&B team or user; default: the logged-in user's."""
    name: str | None = None
    """Display name of the run; default run.name."""


@dataclass
class MlflowConfig:
    """MLflow (``logging.mlflow:``), rank 0 only; needs ``pip install 'hpcdist[mlflow]'``."""

    tracking_uri: str | None = None
    """Tracking server URL or a file store (``file:///path/mlruns``); unset (the default) = no MLflow run."""
    experiment: str = "hpcdist"
    """Experiment name (created when missing)."""


@dataclass
class PrometheusConfig:
    """Prometheus metrics (``logging.prometheus:``) from each node's local rank 0."""

    port: int = 0
    """Serve /metrics over HTTP on this port (each node's local rank 0); 0 = no server."""
    addr: str = "127.0.0.1"
    """The address the HTTP server listens on: this node only by default (the server has no authentication, and
    the metrics name the job and its loss); ``0.0.0.0`` (or one interface's address) lets a scraper on another
    host read them: anyone who reaches the node then can (docs/SECURITY.md)."""
    textfile: str | None = None
    """Or write the metrics to this file for node_exporter's textfile collector (a directory ending in .prom files:
    give the .prom file's path; ``{node}`` is replaced by the node index)."""


@dataclass
class ProfileConfig:
    """torch.profiler over a few steps (``logging.profile:``); docs/PROFILING.md says how to open the files."""

    steps: int = 0
    """Steps to profile; 0 disables profiling."""
    start_step: int = 5
    """The first profiled step (1-based; after the first, slow steps). A run resumed past it profiles nothing."""
    memory: bool = False
    """Also record tensor memory in the trace and, on CUDA, dump an allocator snapshot (memory-rank-<r>.pickle,
    for https://pytorch.org/memory_viz)."""


@dataclass
class LoggingConfig:
    """Metrics, MFU and the health checks that run with logging (``logging:``)."""

    every_steps: int = 10
    """Log metrics every N steps."""
    tensorboard: bool = True
    """Also write TensorBoard event files to <run.dir>/tensorboard."""
    peak_flops: float | None = None
    """Per-device peak FLOP/s for MFU; default: bf16 peak table on GPU, measured fp32 matmul on CPU."""
    replica_check_every_steps: int = 0
    """Every N steps (on a log step) check that data-parallel replicas hold identical parameters: all-gather of a
    per-rank checksum, metric `replica_divergence`, a warning naming divergent ranks. 0 disables."""
    straggler_every_steps: int = 100
    """Every N steps all ranks all-gather their data-loading time per step and a fixed compute probe; ranks slower
    than the lower median by straggler_factor at two checks in a row get a warning and a failures.jsonl line; every
    check writes the `straggler` metrics. 0 disables."""
    straggler_factor: float = 1.5
    """How many times the lower median a rank's time must be to count as a straggler (> 1)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases run (rank 0): the resolved config as run config, the keys of metrics.jsonl; a resumed run
    continues the same W&B run (its id is kept in <run.dir>/trackers.json)."""
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    """MLflow run (rank 0), same contents and resume as wandb."""
    prometheus: PrometheusConfig = field(default_factory=PrometheusConfig)
    """Prometheus metrics of every node (its local rank 0): throughput, step time, loss, memory, restarts."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """torch.profiler traces of steps start_step .. start_step + steps - 1, one per rank, in <run.dir>/profile/."""


@dataclass
class JobConfig:
    """One training job: every section of the YAML; ``hpcdist.config.load`` builds and validates it."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def model_args(self) -> ModelArgs:
        fields = {f.name for f in dataclasses.fields(ModelArgs)}
        return ModelArgs(**{k: v for k, v in dataclasses.asdict(self.model).items() if k in fields})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else RunDir(self.run.dir).checkpoints
