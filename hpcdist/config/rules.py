"""Validation rules of a :class:`~hpcdist.config.JobConfig`: every problem, each saying how to fix it.

:func:`check` needs only the config (run at load); :func:`check_world` adds the rules that need the job's size
(the batch split, the 3d layout on that many ranks) and runs before any process group exists. Both include the
(pp, dp, tp) layout rules of :mod:`hpcdist.config.layout`, so a job learns every problem at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from hpcdist.config import layout
from hpcdist.config.loader import ConfigError
from hpcdist.config.schema import JobConfig
from hpcdist.signals import parse_signal

__all__ = [
    "BYTE_VOCAB",
    "DATA_SOURCES",
    "DTYPES",
    "LR_SCHEDULES",
    "STRATEGIES",
    "VERIFY_MODES",
    "check",
    "check_world",
    "grad_accum_steps",
]

# Strategies this version can run. Later strategies register here when they exist, so a config naming one
# that is not built yet fails validation instead of failing deep inside the trainer.
VERIFY_MODES: tuple[str, ...] = ("checksum", "size", "none")
STRATEGIES: tuple[str, ...] = ("ddp", "fsdp", "zero", "3d", "auto")
DATA_SOURCES = ("stdlib", "files", "synthetic")
DTYPES = ("auto", "fp32", "bf16")
LR_SCHEDULES = ("cosine", "linear", "constant")
BYTE_VOCAB = 258  # hpcdist.data.ByteTokenizer.vocab_size; kept here so config stays import-light


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


def _check_sources(cfg: JobConfig) -> list[str]:
    d, out = cfg.data, []
    if not d.sources:
        return out
    if d.source != "files":
        out.append(f"data.sources: a blend of prepared directories needs data.source=files, not {d.source!r}")
    if d.path:
        out.append("data.sources and data.path: give one (a blend, or one prepared directory)")
    for i, s in enumerate(d.sources):
        if not s.path.strip():
            out.append(f"data.sources[{i}].path: must name a directory made by `hpcdist prepare`")
        if not (math.isfinite(s.weight) and s.weight > 0):
            out.append(f"data.sources[{i}].weight: must be a finite number > 0, got {s.weight}")
    return out


def check(cfg: JobConfig) -> list[str]:
    """Semantic checks that need no world size. Returns problems (empty = valid)."""
    p: list[str] = []
    p += _choice("parallel.strategy", cfg.parallel.strategy, STRATEGIES)
    p += _choice("data.source", cfg.data.source, DATA_SOURCES)
    p += _choice("train.nonfinite", cfg.train.nonfinite, ("stop", "skip"))
    if cfg.train.nonfinite == "skip" and cfg.parallel.strategy == "zero":
        p.append("train.nonfinite=skip: DeepSpeed applies the update before the norm is known; use "
                 "train.nonfinite=stop with parallel.strategy=zero")  # fmt: skip
    if cfg.train.max_nonfinite_skips < 1:
        p.append(f"train.max_nonfinite_skips: must be >= 1, got {cfg.train.max_nonfinite_skips}")
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
         "checkpoint.every_minutes", "checkpoint.write_threads", "logging.replica_check_every_steps",
         "logging.straggler_every_steps",
         "train.eval_every_steps", "optim.min_lr_ratio", "optim.beta1", "optim.beta2"],
        allow_zero=True,
    )  # fmt: skip
    if parse_signal(cfg.fault.requeue_signal, numbers=False) is None:
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
    if not math.isfinite(cfg.fault.watchdog_slow_phase_s) or cfg.fault.watchdog_slow_phase_s < 0:
        p.append(f"fault.watchdog_slow_phase_s: must be >= 0, got {cfg.fault.watchdog_slow_phase_s}")
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
    # an unresolved model.vocab_size (auto without data, a typo) is already reported by config.vocab.resolve_vocab
    p += [q for q in m.problems() if not (isinstance(m.vocab_size, str) and q.startswith("model.vocab_size="))]
    if cfg.data.seq_len > m.max_seq_len > 0:
        p.append(
            f"data.seq_len ({cfg.data.seq_len}) exceeds model.max_seq_len ({m.max_seq_len}); "
            "lower one or raise the other"
        )
    if cfg.data.prefetch < 0:
        p.append(f"data.prefetch: must be >= 0 (0 = no background thread), got {cfg.data.prefetch}")
    if cfg.data.source == "files" and not cfg.data.path and not cfg.data.sources:
        p.append("data.path: required when data.source=files (a directory made by `hpcdist prepare`)")
    p += _check_sources(cfg)

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
    init = cfg.checkpoint.init_from
    if init is not None and not Path(init).is_dir():
        p.append(f"checkpoint.init_from: {init!r} is not an existing checkpoint directory (a step-XXXXXXXX)")
    if init is not None and cfg.parallel.strategy == "zero" and cfg.parallel.zero.stage == 3:
        p.append("checkpoint.init_from: parallel.zero.stage=3 cannot load weights from another run; start with "
                 "parallel.zero.stage=1 or 2 (or fsdp), then resume that run's checkpoints with stage 3")  # fmt: skip
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
    """The layout rules for the degrees ``parallel.strategy`` stands for (3d, and fsdp = dp over every rank)."""
    par, m, t = cfg.parallel, cfg.model, cfg.train
    if m.problems():  # reported on their own; the layout rules need a sane model
        return []
    pp, dp, tp, replicate = layout.strategy_degrees(
        par.strategy, pp=par.pp, dp=par.dp, tp=par.tp, replicate=par.fsdp.replicate, world_size=world_size or 1
    )
    if par.strategy != "3d" and world_size is None:
        return []  # dp is the world size: nothing to check before the job has one
    p = layout.layout_problems(
        pp=pp, dp=dp, tp=tp, world_size=world_size, dp_replicate=replicate,
        n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.kv_heads, dim=m.dim, ffn_dim=m.ffn_dim,
        seq_len=cfg.data.seq_len, tie_embeddings=m.tie_embeddings, schedule=par.pp_schedule,
        stages_per_rank=par.pp_stages_per_rank, global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size, ranks_per_node=ranks_per_node, tp_across_nodes=par.tp_across_nodes,
        evaluates=t.eval_every_steps > 0, dp_name="parallel.dp" if par.strategy == "3d" else "the world size",
    )  # fmt: skip
    if par.fsdp.cpu_offload and par.strategy == "3d":
        p.append("parallel.fsdp.cpu_offload: not supported with parallel.strategy=3d; use parallel.strategy=fsdp")
    return p


def check_world(cfg: JobConfig, world_size: int, *, ranks_per_node: int | None = None) -> None:
    """Checks that need the job's size. Raises ConfigError before any process group is created.

    ``ranks_per_node`` (GPUs per node) adds the rule that a tensor-parallel group stays inside one node."""
    if world_size < 1:
        raise ConfigError([f"world size must be >= 1, got {world_size}"])
    if cfg.parallel.strategy == "fsdp" and world_size == 1:
        raise ConfigError(
            ["parallel.strategy=fsdp shards over ranks and needs more than one; use parallel.strategy=ddp for one"]
        )
    # 3d and fsdp: every layout problem and the batch split below are reported together
    problems: list[str] = []
    if cfg.parallel.strategy in ("3d", "fsdp"):
        problems = _layout_problems(cfg, world_size=world_size, ranks_per_node=ranks_per_node)
    t = cfg.train
    dp = _data_parallel_size(cfg, world_size)  # 0: an impossible layout, already in problems
    if dp and t.global_batch_size % (t.micro_batch_size * dp):
        fix = t.micro_batch_size * dp
        problems.append(
            f"train.global_batch_size ({t.global_batch_size}) must be divisible by train.micro_batch_size "
            f"({t.micro_batch_size}) x data-parallel size ({dp}) = {fix}; e.g. train.global_batch_size="
            f"{max(fix, (t.global_batch_size // fix) * fix)}"
        )
    if problems:
        raise ConfigError(problems)


def _data_parallel_size(cfg: JobConfig, world_size: int) -> int:
    """The data-parallel degree ``parallel.strategy`` stands for; 0 when its degrees cannot be resolved.

    The same arithmetic as :func:`hpcdist.parallel.dims.parallel_dims` (which this package must not import)."""
    par = cfg.parallel
    pp, dp, tp, replicate = layout.strategy_degrees(
        par.strategy, pp=par.pp, dp=par.dp, tp=par.tp, replicate=par.fsdp.replicate, world_size=world_size
    )
    (_, dp, _), problems = layout.resolve_degrees(pp, dp, tp, world_size)
    return 0 if problems or replicate < 1 or dp % replicate else dp


def grad_accum_steps(cfg: JobConfig, dp_size: int) -> int:
    """Micro-batches each data-parallel rank runs per optimizer step."""
    return cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp_size)
