"""Typed job configuration: YAML + ``section.key=value`` overrides -> a validated :class:`JobConfig`.

Precedence is CLI overrides > YAML > model preset > dataclass defaults. Every problem found is collected
and reported at once in one :class:`ConfigError`, before any process group exists (litgpt / submitit style).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import pwd
import signal
import tempfile
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hpcdist.models.llama import ModelArgs, load_preset
from hpcdist.parallel.dims import ParallelDims, layout_problems

# Strategies this version can run. Later strategies register here when they exist, so a config naming one
# that is not built yet fails validation instead of failing deep inside the trainer.
VERIFY_MODES: tuple[str, ...] = ("checksum", "size", "none")
STRATEGIES: tuple[str, ...] = ("ddp", "fsdp", "zero", "3d", "auto")
DATA_SOURCES = ("stdlib", "files", "synthetic")
DTYPES = ("auto", "fp32", "bf16")
LR_SCHEDULES = ("cosine", "linear", "constant")
BYTE_VOCAB = 258  # hpcdist.data.ByteTokenizer.vocab_size; kept here so config stays import-light


@dataclass(frozen=True)
class _Typed:
    """An override value as parsed by YAML plus the text the user typed: a str key takes the text, so
    ``run.name=2024-05-01`` stays a string instead of becoming a date (YAML 1.1 would also turn ``yes`` into True)."""

    value: Any
    text: str


class ConfigError(ValueError):
    """A user-facing configuration problem. ``str()`` is a readable, one-paragraph report."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        n = len(self.problems)
        head = f"Invalid configuration ({n} problem{'s' if n != 1 else ''}):"
        super().__init__("\n".join([head, *(f"  - {p}" for p in self.problems)]))


# --------------------------------------------------------------------------------------------------- sections


@dataclass
class RunConfig:
    name: str = "hpcdist"
    """Job name (TensorBoard, logs, SLURM job name)."""
    dir: str = "runs/demo"
    """Run directory: resolved config, checkpoints/, metrics.jsonl, tensorboard/. Must be on a shared
    filesystem for multi-node jobs."""
    seed: int = 1234
    """Seed for weight init and data order; identical on all ranks so layouts agree."""
    log_level: str = "INFO"


@dataclass
class ModelConfig(ModelArgs):
    preset: str | None = None
    """A shipped preset name (hpcdist/resources/models/<name>.yaml) or a YAML path; its keys are defaults under
    this section's keys."""


@dataclass
class DataConfig:
    source: str = "stdlib"
    """stdlib: this interpreter's standard library sources (nothing downloaded); files: shards prepared by
    `hpcdist prepare` at data.path; synthetic: deterministic random tokens (benchmarks)."""
    path: str | None = None
    """Prepared shard directory (source=files); for stdlib, where to cache shards (default <run.dir>/data)."""
    seq_len: int = 128
    """Tokens per sample (the model sees seq_len inputs and seq_len shifted targets)."""
    max_tokens: int | None = 4_000_000
    """Cap on tokens prepared from the stdlib corpus (keeps the demo's preparation to seconds)."""
    val_fraction: float = 0.01
    shuffle: bool = True
    dtype: str = "uint16"
    synthetic_samples: int = 100_000


@dataclass
class OptimConfig:
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    """Final LR as a fraction of lr (cosine / linear decay)."""
    schedule: str = "cosine"
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Max global gradient norm; 0 disables clipping (the norm is still measured)."""


@dataclass
class TrainConfig:
    steps: int = 1000
    """Optimizer steps to train in total (a resumed run continues up to this number)."""
    global_batch_size: int = 32
    """Samples per optimizer step across all data-parallel ranks."""
    micro_batch_size: int = 8
    """Samples per forward pass per rank; accumulation = global / (micro * data-parallel size)."""
    dtype: str = "auto"
    """auto = bf16 autocast on GPU, fp32 on CPU."""
    activation_checkpointing: bool = False
    compile: bool = False
    eval_every_steps: int = 0
    """0 disables periodic evaluation."""
    eval_batches: int = 4


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
    """Dtype of the gathered parameters that forward/backward compute in: auto = bf16 on GPU, fp32 on CPU
    (what train.dtype selects; train.dtype=bf16 makes it bf16 on CPU too), or fp32 / bf16. The sharded master
    weights and the optimizer state stay fp32."""
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
class ParallelConfig:
    strategy: str = "ddp"
    """ddp, fsdp (FSDP2, HSDP with fsdp.replicate > 1), zero (DeepSpeed ZeRO 1/2/3), 3d (pp x dp x tp on one
    DeviceMesh: pipeline stages, FSDP2 on dp, tensor + sequence parallel) or auto (the top row of `hpcdist plan`
    for this model on parallel.auto_cluster at the job's world size, chosen when the job starts and logged)."""
    auto_cluster: str = "a100_ib"
    """parallel.strategy=auto: the cluster profile (shipped name or YAML path) whose GPUs and bandwidths the
    planner assumes."""
    bucket_cap_mb: int = 25
    """DDP gradient bucket size."""
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
class CheckpointConfig:
    every_steps: int = 100
    """Save every N steps (0 = only at the end)."""
    dir: str | None = None
    """Default <run.dir>/checkpoints."""
    keep_last: int = 3
    """Complete checkpoints to keep; older ones are deleted only after a newer one is complete."""
    resume: str = "auto"
    """auto = newest complete checkpoint if any, else fresh; none = always fresh; or a step-XXXXXXXX path."""
    async_save: bool = False
    save_final: bool = True
    verify: str = "checksum"
    """Before resuming, check the checkpoint against its MANIFEST.json: checksum (sha256 of every file, read
    once, spread over the ranks), size (sizes only: cheap, catches truncation) or none. A damaged checkpoint is
    skipped for the previous complete one, with a warning naming the file."""


@dataclass
class FaultConfig:
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
    decides after srun fails (sbatch/common.sh -> hpcdist.launch.failures after-step). 0 = a failure ends the job."""
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
    watchdog_timeout_s: float = 600.0
    """Hang watchdog: a rank whose loop makes no progress (a step, a checkpoint save, an evaluation) for this long
    dumps every thread's Python stack to its log, records the failure in <run.dir>/failures.jsonl and exits 124, so
    srun ends the step and the failure policy requeues or stops the job. 0 disables it. The process-group
    (collective) timeout becomes this + 60 s, so NCCL's / gloo's own timeout is only the backstop."""


@dataclass
class LoggingConfig:
    every_steps: int = 10
    tensorboard: bool = True
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


@dataclass
class JobConfig:
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
        return Path(self.checkpoint.dir) if self.checkpoint.dir else Path(self.run.dir) / "checkpoints"


# --------------------------------------------------------------------------------------------------- loading


def parse_overrides(overrides: Iterable[str]) -> tuple[dict[str, Any], list[str]]:
    """``["train.steps=10", "model.dim=64"]`` -> nested dict; values parsed as YAML scalars/lists."""
    tree, problems = _parse_overrides(overrides)
    return _unwrap(tree), problems


def _unwrap(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _unwrap(v) for k, v in node.items()}
    return node.value if isinstance(node, _Typed) else node


def _parse_overrides(overrides: Iterable[str]) -> tuple[dict[str, Any], list[str]]:
    tree: dict[str, Any] = {}
    problems: list[str] = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or "." not in key or any(not part for part in key.split(".")):
            problems.append(f"override {item!r}: expected section.key=value, e.g. train.steps=200")
            continue
        try:
            parsed = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            parsed = raw  # an unparsable value is taken as a plain string; type checking catches misuse
        value = _Typed(parsed, raw)
        node = tree
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                problems.append(f"override {item!r}: {p} is set both as a value and as a section")
                break
        else:
            node[leaf] = value
    return tree, problems


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


def _read_yaml(path: Path) -> tuple[dict[str, Any], list[str]]:
    if not path.is_file():
        return {}, [f"config file {str(path)!r} does not exist (pass a YAML file such as configs/demo.yaml)"]
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        return {}, [f"config file {str(path)!r} is not UTF-8 text; save it as UTF-8"]
    except OSError as e:
        return {}, [f"config file {str(path)!r} cannot be read: {e.strerror}"]
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        return {}, [f"config file {str(path)!r} is not valid YAML{where}: {getattr(e, 'problem', e)}"]
    if data is None:
        return {}, []
    if not isinstance(data, dict):
        return {}, [
            f"config file {str(path)!r} must be a mapping of sections (run:, model:, ...), not {type(data).__name__}"
        ]
    return data, []


def _type_name(tp: Any) -> str:
    args = typing.get_args(tp)
    if args:
        return " or ".join("null" if a is type(None) else a.__name__ for a in args)
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> tuple[Any, str | None]:
    """Check ``value`` against a simple annotation (int, float, bool, str, X | None)."""
    allowed = typing.get_args(tp) if isinstance(tp, types.UnionType) else (tp,)
    if isinstance(value, _Typed):
        # only a scalar YAML turned into something else (date, bool, number) falls back to the typed text;
        # a quoted string keeps YAML's unquoting, lists and mappings stay type errors
        text_wanted = str in allowed and not isinstance(value.value, (str, dict, list, type(None)))
        value = value.text if text_wanted else value.value
    if value is None:
        return (None, None) if type(None) in allowed else (None, f"{key}: must be {_type_name(tp)}, got null")
    for t in allowed:
        if t is bool and isinstance(value, bool):
            return value, None
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value, None
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value), None
            except OverflowError:
                return None, f"{key}: {str(value)[:20]}... is too large for a float"
        if t is float and isinstance(value, str):
            # YAML 1.1 reads "1e11" and "3e-4" (no dot) as strings: accept what is plainly a number
            try:
                return float(value), None
            except (ValueError, OverflowError):
                pass
        if t is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value), None
    shown = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    return None, f"{key}: must be {_type_name(tp)}, got {shown}"


def _unknown(key: str, name: str, valid: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{key}: unknown key; {hint}valid keys: {', '.join(valid)}"


def _build(cls: type, data: Mapping[str, Any], prefix: str, problems: list[str]) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in names:
            problems.append(_unknown(key, str(name), names))
            continue
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, Mapping):
                shown = value.text if isinstance(value, _Typed) else value
                problems.append(f"{key}: must be a section (a mapping of keys), got {shown!r}")
                continue
            kwargs[name] = _build(tp, value, f"{key}.", problems)
        else:
            coerced, err = _coerce(key, value, tp)
            if err:
                problems.append(err)
            else:
                kwargs[name] = coerced
    return cls(**kwargs)


def load(path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()) -> JobConfig:
    """Load YAML (optional) + overrides into a validated JobConfig; raise ConfigError listing every problem."""
    problems: list[str] = []
    data: dict[str, Any] = {}
    if path is not None:
        data, problems = _read_yaml(Path(path))
    over, over_problems = _parse_overrides(overrides)
    problems += over_problems
    data = _merge(data, over)

    model = data.get("model")
    preset = model.get("preset") if isinstance(model, Mapping) else None
    preset = preset.text if isinstance(preset, _Typed) else preset
    if preset is not None and preset != "":
        try:
            data["model"] = _merge(load_preset(str(preset)), model)
        except (ValueError, OSError) as e:
            problems.append(f"model.preset: {e}")
        except yaml.YAMLError as e:
            problems.append(f"model.preset: {str(preset)!r} is not valid YAML: {getattr(e, 'problem', e)}")

    cfg = _build(JobConfig, data, "", problems)
    problems += check(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


# --------------------------------------------------------------------------------------------------- validation


def _choice(key: str, value: str, options: Sequence[str]) -> list[str]:
    return [] if value in options else [f"{key}: {value!r} is not one of {', '.join(options)}"]


def _positive(cfg: JobConfig, keys: Sequence[str], *, allow_zero: bool = False) -> list[str]:
    out = []
    for key in keys:
        section, name = key.split(".")
        v = getattr(getattr(cfg, section), name)
        # `not finite` first: NaN compares False with everything and would slip through `v <= 0`
        if v is not None and not math.isfinite(v):
            out.append(f"{key}: must be a finite number, got {v}")
        elif v is not None and (v < 0 if allow_zero else v <= 0):
            out.append(f"{key}: must be {'>= 0' if allow_zero else '> 0'}, got {v}")
    return out


def check(cfg: JobConfig) -> list[str]:
    """Semantic checks that need no world size. Returns problems (empty = valid)."""
    p: list[str] = []
    p += _choice("parallel.strategy", cfg.parallel.strategy, STRATEGIES)
    p += _choice("data.source", cfg.data.source, DATA_SOURCES)
    p += _choice("data.dtype", cfg.data.dtype, ("uint16", "uint32"))
    p += _choice("train.dtype", cfg.train.dtype, DTYPES)
    p += _choice("optim.schedule", cfg.optim.schedule, LR_SCHEDULES)
    p += _choice("parallel.fsdp.param_dtype", cfg.parallel.fsdp.param_dtype, DTYPES)
    p += _choice("parallel.fsdp.reduce_dtype", cfg.parallel.fsdp.reduce_dtype, ("fp32", "bf16"))
    if cfg.parallel.fsdp.replicate < 1:
        p.append(f"parallel.fsdp.replicate: must be >= 1 (1 = plain FSDP), got {cfg.parallel.fsdp.replicate}")
    p += _check_zero(cfg)
    if cfg.parallel.strategy == "3d":
        p += _layout_problems(cfg, world_size=None)
    elif cfg.parallel.strategy in ("ddp", "fsdp", "zero"):
        par = cfg.parallel
        ignored = [
            f"parallel.{k}={getattr(par, k)}"
            for k, unset in (("pp", 1), ("dp", -1), ("tp", 1))
            if getattr(par, k) != unset
        ]
        if ignored:
            p.append(
                f"{', '.join(ignored)}: only parallel.strategy=3d reads the degrees (parallel.strategy={par.strategy} "
                "is pure data parallel over all ranks); set parallel.strategy=3d or drop them"
            )
    p += _choice("run.log_level", cfg.run.log_level.upper(), ("DEBUG", "INFO", "WARNING", "ERROR"))
    p += _positive(
        cfg,
        ["train.steps", "train.global_batch_size", "train.micro_batch_size", "train.eval_batches", "data.seq_len",
         "optim.lr", "logging.every_steps", "checkpoint.keep_last", "parallel.bucket_cap_mb", "data.max_tokens",
         "data.synthetic_samples", "logging.peak_flops", "optim.eps"],
    )  # fmt: skip
    p += _positive(
        cfg,
        ["optim.warmup_steps", "optim.weight_decay", "optim.grad_clip", "checkpoint.every_steps",
         "logging.replica_check_every_steps", "logging.straggler_every_steps",
         "train.eval_every_steps", "optim.min_lr_ratio", "optim.beta1", "optim.beta2"],
        allow_zero=True,
    )  # fmt: skip
    sig = cfg.fault.requeue_signal.upper()
    if (sig if sig.startswith("SIG") else f"SIG{sig}") not in signal.Signals.__members__:
        p.append(f"fault.requeue_signal: {cfg.fault.requeue_signal!r} is not a signal name; use e.g. USR2, USR1")
    for key in ("max_restarts", "max_failures", "max_same_failure", "max_excluded_nodes"):
        if getattr(cfg.fault, key) < 0:
            p.append(f"fault.{key}: must be >= 0, got {getattr(cfg.fault, key)}")
    if cfg.fault.max_same_failure == 0:
        p.append("fault.max_same_failure: must be >= 1 (1 = never requeue the same failure twice)")
    if cfg.fault.max_preemptions < -1:
        p.append(f"fault.max_preemptions: must be >= 0, or -1 for unlimited, got {cfg.fault.max_preemptions}")
    if cfg.fault.exclude_nodes_file is not None and not Path(cfg.fault.exclude_nodes_file).is_file():
        p.append(f"fault.exclude_nodes_file: {cfg.fault.exclude_nodes_file!r} is not a file (one host per line)")
    if not math.isfinite(cfg.fault.watchdog_timeout_s) or cfg.fault.watchdog_timeout_s < 0:
        p.append(
            f"fault.watchdog_timeout_s: must be >= 0 (0 disables the watchdog), got {cfg.fault.watchdog_timeout_s}"
        )
    if not (math.isfinite(cfg.logging.straggler_factor) and cfg.logging.straggler_factor > 1):
        p.append(f"logging.straggler_factor: must be > 1, got {cfg.logging.straggler_factor}")
    if not cfg.run.dir.strip():
        p.append("run.dir: must name a directory, e.g. run.dir=runs/my-run")
    if not 0.0 <= cfg.data.val_fraction < 1.0:
        p.append(f"data.val_fraction: must be in [0, 1), got {cfg.data.val_fraction}")
    for beta in ("beta1", "beta2"):
        if not getattr(cfg.optim, beta) < 1:
            p.append(f"optim.{beta}: must be < 1, got {getattr(cfg.optim, beta)}")
    if cfg.optim.min_lr_ratio > 1:
        p.append(f"optim.min_lr_ratio: must be <= 1, got {cfg.optim.min_lr_ratio}")
    if cfg.train.eval_every_steps and cfg.data.val_fraction == 0 and cfg.data.source != "synthetic":
        p.append("train.eval_every_steps: evaluation needs held-out data; set data.val_fraction > 0 (e.g. 0.01)")

    m = cfg.model
    p += m.problems()
    if cfg.data.seq_len > m.max_seq_len > 0:
        p.append(
            f"data.seq_len ({cfg.data.seq_len}) exceeds model.max_seq_len ({m.max_seq_len}); "
            "lower one or raise the other"
        )
    if cfg.data.source != "synthetic" and 0 < m.vocab_size < BYTE_VOCAB:
        p.append(f"model.vocab_size ({m.vocab_size}) is smaller than the byte tokenizer's {BYTE_VOCAB} tokens")
    if cfg.data.source == "files" and not cfg.data.path:
        p.append("data.path: required when data.source=files (a directory made by `hpcdist prepare`)")

    t = cfg.train
    if t.global_batch_size > 0 and t.micro_batch_size > 0 and t.global_batch_size % t.micro_batch_size:
        p.append(
            f"train.global_batch_size ({t.global_batch_size}) must be a multiple of train.micro_batch_size "
            f"({t.micro_batch_size})"
        )
    if cfg.checkpoint.verify not in VERIFY_MODES:
        p.append(f"checkpoint.verify: {cfg.checkpoint.verify!r} is not one of {', '.join(VERIFY_MODES)}")
    if cfg.checkpoint.resume not in ("auto", "none") and not Path(cfg.checkpoint.resume).is_dir():
        p.append(f"checkpoint.resume: {cfg.checkpoint.resume!r} is not auto, none, or an existing checkpoint directory")
    return p


def _check_zero(cfg: JobConfig) -> list[str]:
    z, p = cfg.parallel.zero, []
    if z.stage not in (1, 2, 3):
        p.append(f"parallel.zero.stage: must be 1, 2 or 3, got {z.stage}")
    if z.offload_params and z.stage != 3:
        p.append(f"parallel.zero.offload_params: needs parallel.zero.stage=3 (got stage {z.stage})")
    for key in ("reduce_bucket_size", "allgather_bucket_size"):
        if getattr(z, key) <= 0:
            p.append(f"parallel.zero.{key}: must be > 0, got {getattr(z, key)}")
    if z.param_persistence_threshold < 0:
        p.append(f"parallel.zero.param_persistence_threshold: must be >= 0, got {z.param_persistence_threshold}")
    return p


def _layout_problems(cfg: JobConfig, *, world_size: int | None, ranks_per_node: int | None = None) -> list[str]:
    par, m, t = cfg.parallel, cfg.model, cfg.train
    if m.problems():  # reported on their own; the layout rules need a sane model
        return []
    p = layout_problems(
        pp=par.pp, dp=par.dp, tp=par.tp, world_size=world_size, dp_replicate=par.fsdp.replicate,
        n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.kv_heads, dim=m.dim, ffn_dim=m.ffn_dim,
        seq_len=cfg.data.seq_len, tie_embeddings=m.tie_embeddings, schedule=par.pp_schedule,
        stages_per_rank=par.pp_stages_per_rank, global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size, ranks_per_node=ranks_per_node, tp_across_nodes=par.tp_across_nodes,
        evaluates=t.eval_every_steps > 0,
    )  # fmt: skip
    if par.fsdp.cpu_offload:
        p.append("parallel.fsdp.cpu_offload: not supported with parallel.strategy=3d; use parallel.strategy=fsdp")
    return p


def parallel_dims(cfg: JobConfig, world_size: int) -> ParallelDims:
    """The job's (pp, dp, tp) layout: 3d reads parallel.pp/dp/tp; every other strategy is pure data parallel."""
    par = cfg.parallel
    if par.strategy == "3d":
        return ParallelDims(pp=par.pp, dp=par.dp, tp=par.tp, world_size=world_size, dp_replicate=par.fsdp.replicate)
    return ParallelDims(pp=1, dp=world_size, tp=1, world_size=world_size)


def check_world(cfg: JobConfig, world_size: int, *, ranks_per_node: int | None = None) -> None:
    """Checks that need the job's size. Raises ConfigError before any process group is created.

    ``ranks_per_node`` (GPUs per node) adds the rule that a tensor-parallel group stays inside one node."""
    if world_size < 1:
        raise ConfigError([f"world size must be >= 1, got {world_size}"])
    # 3d: every layout problem and the batch split below are reported together
    problems: list[str] = []
    if cfg.parallel.strategy == "3d":
        problems = _layout_problems(cfg, world_size=world_size, ranks_per_node=ranks_per_node)
    if cfg.parallel.strategy == "fsdp" and world_size == 1:
        raise ConfigError(
            ["parallel.strategy=fsdp shards over ranks and needs more than one; use parallel.strategy=ddp for one"]
        )
    replicate = cfg.parallel.fsdp.replicate
    if cfg.parallel.strategy == "fsdp" and replicate > 1 and world_size % replicate:
        raise ConfigError(
            [
                f"parallel.fsdp.replicate ({replicate}) must divide the world size ({world_size}): HSDP needs "
                f"replicate x shard == world size; pick a divisor of {world_size} (or 1 for plain FSDP)"
            ]
        )
    t = cfg.train
    try:
        dp = parallel_dims(cfg, world_size).dp  # data-parallel degree: the world, or what 3d leaves of it
    except ValueError:  # an impossible 3d layout, already in problems
        dp = 0
    if dp and t.global_batch_size % (t.micro_batch_size * dp):
        fix = t.micro_batch_size * dp
        problems.append(
            f"train.global_batch_size ({t.global_batch_size}) must be divisible by train.micro_batch_size "
            f"({t.micro_batch_size}) x data-parallel size ({dp}) = {fix}; e.g. train.global_batch_size="
            f"{max(fix, (t.global_batch_size // fix) * fix)}"
        )
    if problems:
        raise ConfigError(problems)


def grad_accum_steps(cfg: JobConfig, dp_size: int) -> int:
    return cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp_size)


# --------------------------------------------------------------------------------------------------- saving


def dump(cfg: JobConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def save(cfg: JobConfig, path: str | os.PathLike[str]) -> Path:
    """Write the resolved config atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(dump(cfg))
    os.replace(tmp, path)
    return path


def check_run_dir(cfg: JobConfig) -> None:
    """File-system checks of run.dir and checkpoint.dir, before any process starts: raises ConfigError when one is
    not a directory, belongs to another user (their run: resuming it would mix two users' checkpoints), or cannot
    be written (read-only mount, permissions). Nothing is created."""
    problems = []
    for key, value in (("run.dir", cfg.run.dir), ("checkpoint.dir", cfg.checkpoint.dir)):
        if value is not None:
            problems += _dir_problems(key, Path(value))
    if problems:
        raise ConfigError(problems)


def _dir_problems(key: str, path: Path) -> list[str]:
    if path.exists() and not path.is_dir():
        return [f"{key}: {str(path)!r} exists and is not a directory; choose another {key}"]
    if path.is_dir() and path.stat().st_uid != os.getuid():
        owner = _user_name(path.stat().st_uid)
        return [
            f"{key}: {str(path)!r} belongs to {owner}, not to you ({_user_name(os.getuid())}): it is another user's "
            f"run; choose your own {key}"
        ]
    existing = next(p for p in (path, *path.parents) if p.exists())
    try:  # os.access says yes to root on a read-only mount: only a real write tells
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".hpcdist-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return [f"{key}: cannot write in {str(existing)!r} ({e.strerror}); make it writable or choose another {key}"]
    return []


def _user_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"
