"""Validation rules of a :class:`~hpcdist.config.JobConfig`: every problem, each saying how to fix it.

:func:`check` needs only the config (run at load); :func:`check_world` adds the rules that need the job's size
(the batch split, the 3d layout on that many ranks) and runs before any process group exists. Both include the
(pp, dp, tp) layout rules of :mod:`hpcdist.config.layout`, so a job learns every problem at once.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import signal
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from hpcdist.base.signals import parse_signal
from hpcdist.checkpoint.names import MARKER
from hpcdist.config import layout
from hpcdist.config.layout import STRATEGIES, LayoutKind
from hpcdist.config.loader import ConfigError, echo
from hpcdist.config.schema import ACTIVATION_CHECKPOINTING, COMPILE_BACKENDS, JobConfig, ParallelConfig
from hpcdist.models import hf_config
from hpcdist.models.args import MODEL_MAXIMA
from hpcdist.models.hf_directory import open_hf_dir

__all__ = [
    "BOUNDED_BY_RULES",
    "DATA_SOURCES",
    "DTYPES",
    "LR_SCHEDULES",
    "MAXIMA",
    "STRATEGIES",
    "VERIFY_MODES",
    "check",
    "check_world",
    "describe_spares",
    "grad_accum_steps",
    "shrink_problems",
]

VERIFY_MODES: tuple[str, ...] = ("checksum", "size", "none")
DATA_SOURCES = ("stdlib", "files", "synthetic")
DTYPES = ("auto", "fp32", "bf16", "fp16")
PARAM_DTYPES = ("auto", "fp32", "bf16")  # parallel.fsdp.param_dtype: fp16 comes with train.dtype=fp16 only
LR_SCHEDULES = ("cosine", "linear", "constant")

# The largest value of every numeric key (the smallest ones are the rules below). A typo (an extra zero, a pasted
# 400-digit number) then fails at load, naming the key, instead of as an OverflowError in the rules, in torch's
# seeding or in numpy; tests/unit/config/test_config.py checks that every numeric field of the schema has an entry.
# Keys in BOUNDED_BY_RULES have both ends in the rules below instead; optim.lr has no maximum on purpose: a diverging
# LR is what the NaN/Inf guard (train.nonfinite) is for.
BOUNDED_BY_RULES = frozenset(
    {"data.val_fraction", "optim.min_lr_ratio", "optim.beta1", "optim.beta2", "parallel.zero.stage", "optim.lr"}
)
_BIG = 10**12  # steps, samples, tokens: more than any run takes
MAXIMA: dict[str, tuple[float, str]] = {
    "run.seed": (2**63 - 1, "torch and numpy seeds are 64-bit"),
    **{f"model.{k}": v for k, v in MODEL_MAXIMA.items()},
    "data.seq_len": (2**20, ""),
    "data.prefetch": (64, "batches queued ahead; each holds a global batch share in host memory"),
    "data.max_tokens": (_BIG * 1000, ""),
    "data.synthetic_samples": (2**40, ""),
    "optim.warmup_steps": (_BIG, ""),
    "optim.weight_decay": (1e3, ""),
    "optim.eps": (1.0, ""),
    "optim.grad_clip": (1e12, ""),
    "train.steps": (_BIG, ""),
    "train.global_batch_size": (2**24, ""),
    "train.micro_batch_size": (2**20, ""),
    "train.eval_every_steps": (_BIG, ""),
    "train.eval_batches": (2**20, ""),
    "train.max_nonfinite_skips": (2**20, ""),
    "parallel.ddp.bucket_cap_mb": (2**20, ""),
    "parallel.ddp.powersgd.rank": (2**16, ""),
    "parallel.ddp.powersgd.start_iter": (_BIG, ""),
    "parallel.fsdp.replicate": (2**20, "ranks"),
    "parallel.zero.reduce_bucket_size": (2**40, ""),
    "parallel.zero.allgather_bucket_size": (2**40, ""),
    "parallel.zero.param_persistence_threshold": (2**40, ""),
    "parallel.pp": (2**20, "ranks"),
    "parallel.dp": (2**20, "ranks"),
    "parallel.tp": (2**20, "ranks"),
    "parallel.pp_stages_per_rank": (2**10, ""),
    "checkpoint.every_steps": (_BIG, ""),
    "checkpoint.every_minutes": (525_600.0, "a year"),
    "checkpoint.keep_last": (2**20, ""),
    "checkpoint.write_threads": (1024, ""),
    "checkpoint.local.every_steps": (_BIG, ""),
    "checkpoint.local.every_minutes": (525_600.0, "a year"),
    "checkpoint.local.keep": (2**10, ""),
    "fault.max_restarts": (2**20, ""),
    "fault.max_preemptions": (2**20, ""),
    "fault.max_failures": (2**20, ""),
    "fault.max_same_failure": (2**20, ""),
    "fault.max_excluded_nodes": (2**20, ""),
    "fault.spare_nodes": (2**20, "nodes"),
    "fault.min_nodes": (2**20, "nodes"),
    "fault.restart_backoff_s": (3600.0, "an hour"),
    "fault.regroup_settle_s": (3600.0, "an hour"),
    "fault.regroup_timeout_s": (86_400.0, "a day"),
    "fault.watchdog_timeout_s": (604_800.0, "a week"),
    "fault.watchdog_slow_phase_s": (604_800.0, "a week"),
    "logging.every_steps": (_BIG, ""),
    "logging.peak_flops": (1e20, "FLOP/s"),
    "logging.replica_check_every_steps": (_BIG, ""),
    "logging.straggler_every_steps": (_BIG, ""),
    "logging.straggler_factor": (1e6, ""),
    "logging.prometheus.port": (65535, ""),
    "logging.profile.steps": (10_000, "a trace grows with every profiled step"),
    "logging.profile.start_step": (_BIG, ""),
}
# The shortest watchdog allowance accepted: 0.001 s fired during an ordinary checkpoint save, and 1 s during the
# demo's second step on a busy 2-core machine (the allowance grows to 4x the slowest step only once steps are
# measured). Production wants tens of seconds (default 90); the multi-rank hang test uses this minimum.
MIN_WATCHDOG_S = 5.0
# Signals a stop cannot be asked with: KILL and STOP cannot be caught; TERM and INT already mean "stop without
# requeueing"; the others report a crash (a handler that returns would run the faulting instruction again).
_NOT_REQUEUE_SIGNALS = {
    signal.SIGKILL: "cannot be caught",
    signal.SIGSTOP: "cannot be caught",
    signal.SIGTERM: "already means: checkpoint and stop without requeueing",
    signal.SIGINT: "already means: checkpoint and stop without requeueing (Ctrl-C)",
    **{s: "reports a crash" for s in (signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT)},
}
# File-system limits (Linux NAME_MAX / PATH_MAX): longer paths fail with ENAMETOOLONG wherever they are first used.
_NAME_MAX, _PATH_MAX = 255, 4095


def _choice(key: str, value: str, options: Sequence[str]) -> list[str]:
    return [] if value in options else [f"{key}: {echo(value)} is not one of {', '.join(options)}"]


def _positive_problems(cfg: JobConfig, keys: Sequence[str], *, allow_zero: bool = False) -> list[str]:
    out = []
    for key in keys:
        v: Any = cfg
        for part in key.split("."):  # section.key or section.sub.key
            v = getattr(v, part)
        # `not finite` first: NaN compares False with everything and would slip through `v <= 0` (floats only:
        # math.isfinite of a 400-digit int raises OverflowError)
        if isinstance(v, float) and not math.isfinite(v):
            out.append(f"{key}: must be a finite number, got {v}")
        elif v is not None and (v < 0 if allow_zero else v <= 0):
            out.append(f"{key}: must be {'>= 0' if allow_zero else '> 0'}, got {v}")
    return out


def _numeric_fields(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(``section.key``, value) of every int / float field, nested sections included (bools are not numbers)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _numeric_fields(value, f"{prefix}{f.name}.")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield f"{prefix}{f.name}", value


def _maxima(cfg: JobConfig) -> list[str]:
    out = []
    for key, value in _numeric_fields(cfg):
        if key not in MAXIMA:
            continue
        top, unit = MAXIMA[key]
        shown = f"{top:,}" if isinstance(top, int) else f"{top:g}"
        if not value <= top:  # `not <=`: NaN is out of range too
            why = f" ({unit})" if unit else ""
            out.append(f"{key}: must be at most {shown}{why}, got {echo(value)}; set a smaller {key}")
    return out


def _path_problem(key: str, value: str) -> str | None:
    """A path the kernel would refuse whatever the disk holds: empty, a NUL byte, not encodable, a name longer than
    255 bytes or a path longer than 4095."""
    if not value.strip():
        return f"{key}: empty; name a path"
    if "\0" in value:
        return f"{key}: contains a NUL character; remove it"
    try:
        raw = os.fsencode(value)
    except UnicodeEncodeError:
        return f"{key}: {echo(value)} cannot be encoded as a file name on this system; use plain characters"
    if len(raw) > _PATH_MAX:
        return f"{key}: the path is {len(raw):,} bytes long, more than {_PATH_MAX}; choose a shorter {key}"
    longest = max(raw.split(b"/"), key=len)
    if len(longest) > _NAME_MAX:
        name = echo(os.fsdecode(longest))
        return (
            f"{key}: the name {name} is {len(longest)} bytes long; file systems allow {_NAME_MAX} per name: "
            f"choose a shorter {key}"
        )
    return None


def _paths(cfg: JobConfig) -> tuple[list[str], set[str]]:
    """Problems of every path-valued key, and the keys that have one (the disk checks skip those)."""
    c = cfg.checkpoint
    keys = {
        "run.dir": cfg.run.dir,
        "data.path": cfg.data.path,
        "checkpoint.dir": c.dir,
        "checkpoint.init_from": c.init_from,
        "fault.exclude_nodes_file": cfg.fault.exclude_nodes_file,
        "train.eval_data": cfg.train.eval_data,
        "checkpoint.resume": None if c.resume in ("auto", "none") else c.resume,
    }
    out, bad = [], set()
    for key, value in keys.items():
        problem = _path_problem(key, value) if value is not None else None
        if problem is not None and not value.strip():  # say what the key takes
            problem = {
                "run.dir": None,
                "checkpoint.resume": "checkpoint.resume: empty; use auto, none, or the path "
                "of a step-XXXXXXXX checkpoint",
            }.get(key, problem)
            bad.add(key)  # run.dir: its own rule below says it
        if problem:
            out.append(problem)
            bad.add(key)
    return out, bad


def _requeue_signal(text: str) -> list[str]:
    sig = parse_signal(text, numbers=False)
    if sig is None:
        return [f"fault.requeue_signal: {echo(text)} is not a signal name; use e.g. USR2, USR1"]
    if sig in _NOT_REQUEUE_SIGNALS:
        return [
            f"fault.requeue_signal: {sig.name} {_NOT_REQUEUE_SIGNALS[sig]}; use USR1 or USR2 (and sbatch "
            f"--signal=USR2@<seconds>)"
        ]
    return []


def _watchdog(f: Any) -> list[str]:
    out = []
    for key in ("watchdog_timeout_s", "watchdog_slow_phase_s"):
        v = getattr(f, key)
        if not math.isfinite(v) or v < 0:
            out.append(f"fault.{key}: must be >= 0 (0 disables the watchdog), got {v}")
        elif 0 < v < MIN_WATCHDOG_S:
            out.append(
                f"fault.{key}: must be 0 (off) or at least {MIN_WATCHDOG_S:g} s: a shorter allowance declares "
                f"a normal step or checkpoint save a hang; got {v:g} (the default is 90 s for the timeout, "
                "900 s for slow phases)"
            )
    return out


def _data_volume(cfg: JobConfig) -> list[str]:
    """data.max_tokens must leave one training sample after the validation split (the dataset's own arithmetic)."""
    d = cfg.data
    in_range = (  # out-of-range values are reported by their own rules; the arithmetic below needs sane ones
        d.max_tokens is not None
        and 1 <= d.max_tokens <= MAXIMA["data.max_tokens"][0]
        and 1 <= d.seq_len <= MAXIMA["data.seq_len"][0]
        and 0 <= d.val_fraction < 1
    )
    if d.source != "stdlib" or not in_range:
        return []

    def left_to_train(windows: int) -> int:
        return windows - (max(1, round(windows * d.val_fraction)) if d.val_fraction > 0 else 0)

    window = d.seq_len + 1
    if left_to_train(d.max_tokens // window) >= 1:
        return []
    need = next((w for w in range(1, 10_000) if left_to_train(w) >= 1), None)
    fix = f"set data.max_tokens >= {need * window}" if need else "lower data.val_fraction"
    return [
        f"data.max_tokens ({d.max_tokens}) holds {d.max_tokens // window} samples of data.seq_len + 1 = {window} "
        f"tokens: none left to train on after the validation split (data.val_fraction={d.val_fraction:g}); "
        f"{fix} or lower data.seq_len"
    ]


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


def _ip_address(value: object) -> bool:
    """An IPv4 / IPv6 address literal, or localhost (what an HTTP server can listen on without a name lookup)."""
    import ipaddress

    if value == "localhost":
        return True
    try:
        ipaddress.ip_address(value)  # type: ignore[arg-type]
    except ValueError:
        return False
    return True


def _trackers(cfg: JobConfig) -> list[str]:
    """logging.wandb / mlflow / prometheus: the values, and the optional package of each one that is switched on."""
    lg, p = cfg.logging, []
    p += _choice("logging.wandb.mode", lg.wandb.mode, ("online", "offline", "disabled"))
    if lg.prometheus.port < 0:
        p.append(f"logging.prometheus.port: must be >= 0 (0 = no HTTP server), got {lg.prometheus.port}")
    if lg.prometheus.port and lg.prometheus.textfile:
        p.append("logging.prometheus: set port or textfile, not both")
    if not _ip_address(lg.prometheus.addr):
        p.append(
            f"logging.prometheus.addr: {str(lg.prometheus.addr)[:80]!r} is not an IP address; 127.0.0.1 (this "
            "node only, the default) or 0.0.0.0 (every interface: anyone who reaches the node reads them)"
        )
    wanted = [
        ("logging.wandb.project", lg.wandb.project and lg.wandb.mode != "disabled", "wandb", "wandb"),
        ("logging.mlflow.tracking_uri", lg.mlflow.tracking_uri, "mlflow", "mlflow"),
        ("logging.prometheus", lg.prometheus.port or lg.prometheus.textfile, "prometheus_client", "prometheus"),
    ]
    for key, on, module, extra in wanted:
        if on and importlib.util.find_spec(module) is None:
            p.append(f"{key}: needs the {module} package: pip install 'hpcdist[{extra}]' (or unset {key})")
    return p


def check(cfg: JobConfig) -> list[str]:
    """Semantic checks that need no world size, one function per section. Returns problems (empty = valid)."""
    path_problems, bad_paths = _paths(cfg)
    kind = layout.requested_kind(cfg.parallel)  # None: auto, or a strategy _choice refused
    return [
        *_maxima(cfg),
        *path_problems,
        *_check_run(cfg),
        *_check_model(cfg),
        *_check_data(cfg),
        *_check_optim(cfg),
        *_check_train(cfg, kind),
        *_check_parallel(cfg, kind),
        *_check_checkpoint(cfg, kind, bad_paths),
        *_check_fault(cfg, bad_paths),
        *_check_logging(cfg),
    ]


def _check_run(cfg: JobConfig) -> list[str]:
    p = _choice("run.log_level", cfg.run.log_level.upper(), ("DEBUG", "INFO", "WARNING", "ERROR"))
    if not cfg.run.dir.strip():
        p.append("run.dir: must name a directory, e.g. run.dir=runs/my-run")
    if cfg.run.seed < 0:
        p.append(f"run.seed: must be >= 0, got {echo(cfg.run.seed)}")
    return p


def _check_model(cfg: JobConfig) -> list[str]:
    m = cfg.model
    # an unresolved model.vocab_size (auto without data, a typo) is already reported by config.vocab.resolve_vocab
    return [q for q in m.problems() if not (isinstance(m.vocab_size, str) and q.startswith("model.vocab_size="))]


def _check_data(cfg: JobConfig) -> list[str]:
    d = cfg.data
    p = _choice("data.source", d.source, DATA_SOURCES)
    p += _choice("data.dtype", d.dtype, ("uint16", "uint32"))
    p += _positive_problems(cfg, ["data.seq_len", "data.max_tokens", "data.synthetic_samples"])
    if d.seq_len > cfg.model.max_seq_len > 0:
        p.append(
            f"data.seq_len ({d.seq_len}) exceeds model.max_seq_len ({cfg.model.max_seq_len}); lower one or raise "
            "the other"
        )
    if not 0.0 <= d.val_fraction < 1.0:
        p.append(f"data.val_fraction: must be in [0, 1), got {d.val_fraction}")
    if d.prefetch < 0:
        p.append(f"data.prefetch: must be >= 0 (0 = no background thread), got {d.prefetch}")
    if d.source == "files" and not d.path and not d.sources:
        p.append("data.path: required when data.source=files (a directory made by `hpcdist prepare`)")
    if d.document_mask and d.source == "synthetic":
        p.append("data.document_mask: data.source=synthetic has no documents (random ids, no EOS); set it false")
    p += _data_volume(cfg)
    p += _check_sources(cfg)
    return p


def _check_optim(cfg: JobConfig) -> list[str]:
    o = cfg.optim
    p = _choice("optim.schedule", o.schedule, LR_SCHEDULES)
    p += _positive_problems(cfg, ["optim.lr", "optim.eps"])
    p += _positive_problems(
        cfg,
        [
            "optim.warmup_steps",
            "optim.weight_decay",
            "optim.grad_clip",
            "optim.min_lr_ratio",
            "optim.beta1",
            "optim.beta2",
        ],
        allow_zero=True,
    )
    for beta in ("beta1", "beta2"):
        if not getattr(o, beta) < 1:
            p.append(f"optim.{beta}: must be < 1, got {getattr(o, beta)}")
    if o.min_lr_ratio > 1:
        p.append(f"optim.min_lr_ratio: must be <= 1, got {o.min_lr_ratio}")
    return p


def _check_train(cfg: JobConfig, kind: LayoutKind | None) -> list[str]:
    t = cfg.train
    p = _choice("train.nonfinite", t.nonfinite, ("stop", "skip"))
    if t.nonfinite == "skip" and kind is not None and kind.zero_stage:
        p.append(
            "train.nonfinite=skip: DeepSpeed applies the update before the norm is known; use "
            "train.nonfinite=stop with parallel.strategy=zero"
        )
    if t.nonfinite_triage and kind is not None and kind.zero_stage:
        p.append(
            "train.nonfinite_triage: DeepSpeed applies the update before the norm is known, so the step cannot be "
            "re-run from the state before it; set train.nonfinite_triage=false with parallel.strategy=zero"
        )
    if t.max_nonfinite_skips < 1:
        p.append(f"train.max_nonfinite_skips: must be >= 1, got {t.max_nonfinite_skips}")
    p += _choice("train.dtype", t.dtype, DTYPES)
    p += _choice("train.activation_checkpointing", t.activation_checkpointing, ACTIVATION_CHECKPOINTING)
    if t.dtype == "fp16" and kind is LayoutKind.THREE_D and (cfg.parallel.tp > 1 or cfg.parallel.pp > 1):
        # the scaler must unscale every stage's and tp shard's gradients and agree on one overflow verdict across
        # the pp and tp groups before any stage steps: not built (ShardedGradScaler reduces over one group)
        p.append(
            "train.dtype=fp16 with parallel.tp > 1 or parallel.pp > 1: dynamic loss scaling is built for ddp, fsdp "
            "and zero only; use train.dtype=bf16 with tp/pp, or parallel.strategy=fsdp / zero for fp16"
        )
    if t.dtype == "fp16" and t.nonfinite_triage:
        # every inf/NaN gradient is the loss scaler's overflow skip in fp16, so the triage would never run
        p.append(
            "train.nonfinite_triage with train.dtype=fp16: a non-finite step is the loss scaler's overflow skip "
            "there; set train.nonfinite_triage=false, or train in bf16 / fp32 to triage NaN steps"
        )
    if t.dtype == "fp16" and cfg.parallel.fsdp.param_dtype == "bf16":
        p.append("parallel.fsdp.param_dtype=bf16 with train.dtype=fp16: set parallel.fsdp.param_dtype=auto (fp16)")
    p += _choice("train.compile_backend", t.compile_backend, COMPILE_BACKENDS)
    p += _positive_problems(
        cfg, ["train.steps", "train.global_batch_size", "train.micro_batch_size", "train.eval_batches"]
    )
    p += _positive_problems(cfg, ["train.eval_every_steps"], allow_zero=True)
    if t.eval_every_steps and cfg.data.val_fraction == 0 and cfg.data.source != "synthetic" and not t.eval_data:
        p.append(
            "train.eval_every_steps: evaluation needs held-out data; set data.val_fraction > 0 (e.g. 0.01) or "
            "train.eval_data to a prepared held-out dataset"
        )
    if t.global_batch_size > 0 and t.micro_batch_size > 0 and t.global_batch_size % t.micro_batch_size:
        p.append(
            f"train.global_batch_size ({t.global_batch_size}) must be a multiple of train.micro_batch_size "
            f"({t.micro_batch_size})"
        )
    return p


def _check_parallel(cfg: JobConfig, kind: LayoutKind | None) -> list[str]:
    par = cfg.parallel
    p = _choice("parallel.strategy", par.strategy, STRATEGIES)
    p += _choice("parallel.fsdp.param_dtype", par.fsdp.param_dtype, PARAM_DTYPES)
    p += _choice("parallel.fsdp.reduce_dtype", par.fsdp.reduce_dtype, ("fp32", "bf16"))
    if par.fsdp.replicate < 1:
        p.append(f"parallel.fsdp.replicate: must be >= 1 (1 = plain FSDP), got {par.fsdp.replicate}")
    p += _check_zero(cfg)
    p += _check_comm_hook(cfg)
    p += _positive_problems(cfg, ["parallel.ddp.bucket_cap_mb"])
    if kind is LayoutKind.THREE_D:
        p += _layout_problems(cfg, world_size=None)
    elif kind is not None:
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
    return p


def _check_checkpoint(cfg: JobConfig, kind: LayoutKind | None, bad_paths: set[str]) -> list[str]:
    c = cfg.checkpoint
    p = _positive_problems(cfg, ["checkpoint.keep_last"])
    p += _positive_problems(cfg, ["checkpoint.every_steps", "checkpoint.write_threads"], allow_zero=True)
    if isinstance(c.every_minutes, str):  # a number was read as one: any other text is neither a number nor auto
        if c.every_minutes != "auto":
            p.append(
                f"checkpoint.every_minutes: {echo(c.every_minutes)} is neither a number of minutes nor auto; give "
                "minutes (0 = off) or auto (the goodput model's interval)"
            )
    else:
        p += _positive_problems(cfg, ["checkpoint.every_minutes"], allow_zero=True)
    if c.verify not in VERIFY_MODES:
        p.append(f"checkpoint.verify: {c.verify!r} is not one of {', '.join(VERIFY_MODES)}")
    if c.resume not in ("auto", "none") and "checkpoint.resume" not in bad_paths:
        p += _named_checkpoint("checkpoint.resume", c.resume, "auto, none, or ")
    init = c.init_from
    if init is not None and "checkpoint.init_from" not in bad_paths:
        p += _hf_init(cfg, init) if hf_config.is_hf_dir(init) else _named_checkpoint("checkpoint.init_from", init, "")
    if init is not None and kind is LayoutKind.ZERO3:
        p.append(
            "checkpoint.init_from: parallel.zero.stage=3 cannot load weights from another run; start with "
            "parallel.zero.stage=1 or 2 (or fsdp), then resume that run's checkpoints with stage 3"
        )
    return p + _check_local_tier(cfg)


LOCAL_DIR_PLACEHOLDERS = ("{job_id}", "{user}", "{host}")  # hpcdist.checkpoint.local.layout.expand_dir fills them


def _check_local_tier(cfg: JobConfig) -> list[str]:
    """checkpoint.local: the node-local tier. Its directory's disk checks (owner, links, a node-local file system)
    run on each node at start-up (hpcdist.checkpoint.local.layout.open_local_dir): the login node cannot see it."""
    loc = cfg.checkpoint.local
    p = _positive_problems(cfg, ["checkpoint.local.keep"])
    p += _positive_problems(cfg, ["checkpoint.local.every_steps", "checkpoint.local.every_minutes"], allow_zero=True)
    cadence = loc.every_steps > 0 or loc.every_minutes > 0
    if loc.dir is None:
        if cadence:
            p.append(
                "checkpoint.local: every_steps / every_minutes set without checkpoint.local.dir; set dir to a "
                "node-local directory (e.g. /dev/shm/hpcdist-{job_id}) or drop them"
            )
        return p
    problem = _path_problem("checkpoint.local.dir", loc.dir)
    if problem:
        return [*p, problem]
    if not loc.dir.startswith("/"):
        p.append(
            f"checkpoint.local.dir: {echo(loc.dir)} is relative; give an absolute path on the node's own disk, "
            "e.g. /dev/shm/hpcdist-{job_id}"
        )
    unknown = sorted(set(re.findall(r"\{[^{}]*\}", loc.dir)) - set(LOCAL_DIR_PLACEHOLDERS))
    if unknown or loc.dir.count("{") != loc.dir.count("}"):
        p.append(
            f"checkpoint.local.dir: unknown placeholder {', '.join(unknown) or 'or unbalanced brace'} in "
            f"{echo(loc.dir)}; use only {', '.join(LOCAL_DIR_PLACEHOLDERS)}"
        )
    if not cadence:
        p.append(
            "checkpoint.local: no cadence; set checkpoint.local.every_steps or checkpoint.local.every_minutes "
            "(or drop checkpoint.local.dir)"
        )
    return p


def _check_fault(cfg: JobConfig, bad_paths: set[str]) -> list[str]:
    f = cfg.fault
    p = _requeue_signal(f.requeue_signal)
    for key in ("max_restarts", "max_failures", "max_same_failure", "max_excluded_nodes", "spare_nodes", "min_nodes"):
        if getattr(f, key) < 0:
            p.append(f"fault.{key}: must be >= 0, got {getattr(f, key)}")
    if f.max_same_failure == 0:
        p.append("fault.max_same_failure: must be >= 1 (1 = never requeue the same failure twice)")
    if not (math.isfinite(f.restart_backoff_s) and f.restart_backoff_s >= 0):
        p.append(f"fault.restart_backoff_s: must be a number of seconds >= 0, got {f.restart_backoff_s}")
    if f.in_process and not cfg.checkpoint.local.dir:
        p.append(
            "fault.in_process: needs checkpoint.local.dir (the snapshot the ranks roll back to, and its peer copy)"
        )
    if f.in_process and f.spare_nodes < 1:
        p.append("fault.in_process: needs fault.spare_nodes >= 1 (the node whose processes wait as warm spares)")
    if not (math.isfinite(f.regroup_settle_s) and f.regroup_settle_s > 0):
        p.append(f"fault.regroup_settle_s: must be a number of seconds > 0, got {f.regroup_settle_s}")
    if not (math.isfinite(f.regroup_timeout_s) and f.regroup_timeout_s > f.regroup_settle_s):
        p.append(
            f"fault.regroup_timeout_s: must be a number of seconds above fault.regroup_settle_s "
            f"({f.regroup_settle_s}), got {f.regroup_timeout_s}"
        )
    if f.max_preemptions < -1:
        p.append(f"fault.max_preemptions: must be >= 0, or -1 for unlimited, got {f.max_preemptions}")
    exclude = f.exclude_nodes_file
    if exclude is not None and "fault.exclude_nodes_file" not in bad_paths and not Path(exclude).is_file():
        p.append(f"fault.exclude_nodes_file: {echo(exclude)} is not a file (one host per line)")
    p += _watchdog(f)
    return p


def _check_logging(cfg: JobConfig) -> list[str]:
    log_ = cfg.logging
    p = _positive_problems(cfg, ["logging.every_steps", "logging.peak_flops"])
    p += _positive_problems(
        cfg, ["logging.replica_check_every_steps", "logging.straggler_every_steps"], allow_zero=True
    )
    if not (math.isfinite(log_.straggler_factor) and log_.straggler_factor > 1):
        p.append(f"logging.straggler_factor: must be > 1, got {log_.straggler_factor}")
    if log_.profile.steps < 0:
        p.append(f"logging.profile.steps: must be >= 0 (0 = off), got {log_.profile.steps}")
    if log_.profile.start_step < 1:
        p.append(f"logging.profile.start_step: must be >= 1 (steps count from 1), got {log_.profile.start_step}")
    p += _trackers(cfg)
    return p


def _hf_init(cfg: JobConfig, path: str) -> list[str]:
    """checkpoint.init_from naming a Hugging Face Llama directory: the model section must be the model config.json
    describes (its shape is read from there, presets are not changed), named key by key."""
    try:  # the whole directory, weights' headers included: a hostile one is refused before any process starts
        theirs = open_hf_dir(path, purpose=None).args  # memory: checked on the node that loads it
    except hf_config.HFConfigError as e:
        return [f"checkpoint.init_from: {e}"]
    if cfg.model.problems():
        return []  # reported on their own
    problem = hf_config.shape_mismatch(cfg.model, theirs, where=f"{path}/config.json")
    return [f"checkpoint.init_from: {problem}"] if problem else []


def _named_checkpoint(key: str, value: str, alternatives: str) -> list[str]:
    """A checkpoint the config names must be a directory holding the marker a complete save writes last (a
    directory like /etc used to pass this rule and fail after the process group existed)."""
    if not Path(value).is_dir():
        return [f"{key}: {echo(value)} is not {alternatives}an existing checkpoint directory (a step-XXXXXXXX)"]
    if not (Path(value) / MARKER).is_file():
        return [
            f"{key}: {echo(value)} is not a complete checkpoint (no {MARKER} marker: another kind of "
            "directory, an interrupted save or a damaged one); name a step-XXXXXXXX directory that holds "
            f"{MARKER}"
        ]
    return []


COMM_HOOKS = ("none", "allreduce", "bf16", "fp16", "powersgd")


def _no_comm_hook(par: ParallelConfig) -> str | None:
    """Why a DDP comm hook cannot apply to the layout parallel.strategy asks for, and the lever it has instead;
    None where it applies (ddp) or the strategy is refused on its own."""
    if layout.needs_planner(par.strategy):
        return "the planner may pick a sharded layout; set parallel.strategy=ddp"
    kind = layout.requested_kind(par)
    if kind is None or kind is LayoutKind.DDP:
        return None
    if kind.zero_stage:
        return (
            "DeepSpeed reduces gradients itself (its compressed optimizers, 1-bit Adam / 0/1 Adam, need the NCCL "
            "or MPI backend)"
        )
    if kind is LayoutKind.THREE_D:
        return "FSDP reduce-scatters gradients on dp; its lever is parallel.fsdp.reduce_dtype=bf16"
    return "FSDP reduce-scatters gradients itself; its lever is parallel.fsdp.reduce_dtype=bf16"


def _check_comm_hook(cfg: JobConfig) -> list[str]:
    d = cfg.parallel.ddp
    p = _choice("parallel.ddp.comm_hook", d.comm_hook, COMM_HOOKS)
    why = _no_comm_hook(cfg.parallel)
    if d.comm_hook != "none" and why is not None:
        p.append(f"parallel.ddp.comm_hook={d.comm_hook}: applies to parallel.strategy=ddp only ({why})")
    s = d.powersgd
    if s.rank < 1:
        p.append(f"parallel.ddp.powersgd.rank: must be >= 1, got {s.rank}")
    if (s.use_error_feedback or s.warm_start) and s.start_iter < 2:
        p.append(
            f"parallel.ddp.powersgd.start_iter: must be >= 2 with use_error_feedback or warm_start (DDP "
            f"rebuilds its buckets after the first step), got {s.start_iter}"
        )
    elif s.start_iter < 0:
        p.append(f"parallel.ddp.powersgd.start_iter: must be >= 0, got {s.start_iter}")
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
    reads_degrees = layout.requested_kind(par) is LayoutKind.THREE_D  # the others: dp = the world size
    if not reads_degrees and world_size is None:
        return []  # dp is the world size: nothing to check before the job has one
    degrees = layout.strategy_degrees(par, world_size or 1)
    p = layout.layout_problems(
        pp=degrees.pp,
        dp=degrees.dp,
        tp=degrees.tp,
        world_size=world_size,
        dp_replicate=degrees.dp_replicate,
        n_layers=m.n_layers,
        n_heads=m.n_heads,
        n_kv_heads=m.kv_heads,
        dim=m.dim,
        ffn_dim=m.ffn_dim,
        seq_len=cfg.data.seq_len,
        tie_embeddings=m.tie_embeddings,
        schedule=par.pp_schedule,
        stages_per_rank=par.pp_stages_per_rank,
        global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size,
        ranks_per_node=ranks_per_node,
        tp_across_nodes=par.tp_across_nodes,
        evaluates=t.eval_every_steps > 0,
        dp_name="parallel.dp" if reads_degrees else "the world size",
    )
    if par.fsdp.cpu_offload and reads_degrees:
        p.append("parallel.fsdp.cpu_offload: not supported with parallel.strategy=3d; use parallel.strategy=fsdp")
    return p


def check_world(cfg: JobConfig, world_size: int, *, ranks_per_node: int | None = None) -> None:
    """Checks that need the job's size. Raises ConfigError before any process group is created.

    ``ranks_per_node`` (GPUs per node) adds the rule that a tensor-parallel group stays inside one node."""
    if world_size < 1:
        raise ConfigError([f"world size must be >= 1, got {world_size}"])
    kind = layout.requested_kind(cfg.parallel)
    if kind in (LayoutKind.FSDP, LayoutKind.HSDP) and world_size == 1:
        raise ConfigError(
            ["parallel.strategy=fsdp shards over ranks and needs more than one; use parallel.strategy=ddp for one"]
        )
    # 3d and fsdp: every layout problem and the batch split below are reported together
    problems: list[str] = []
    if kind is not None and kind.fsdp_options_apply:
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


def shrink_problems(cfg: Any, nodes: int, ranks_per_node: int) -> list[str]:
    """At submit: refusals of fault.spare_nodes / fault.min_nodes for a job training on ``nodes`` nodes of
    ``ranks_per_node`` ranks: min_nodes above the nodes, or a layout that cannot run on min_nodes (tp x pp per replica
    larger than what remains, a global batch that does not divide), checked by the config's own world-size rules."""
    f = cfg.fault
    if f.min_nodes > nodes:
        return [f"fault.min_nodes={f.min_nodes}: more than the job's {nodes} training node(s); at most {nodes}"]
    if 0 < f.min_nodes < nodes:
        try:
            check_world(cfg, f.min_nodes * ranks_per_node, ranks_per_node=ranks_per_node)
        except ConfigError as e:
            return [
                f"fault.min_nodes={f.min_nodes}: the layout cannot shrink to {f.min_nodes} node(s) "
                f"({f.min_nodes * ranks_per_node} ranks): {p}; raise fault.min_nodes or set it to 0 (never shrink)"
                for p in e.problems
            ]
    return []


def describe_spares(cfg: Any, nodes: int) -> str | None:
    """One line for plan / the dry run: the nodes asked for with spares and how far in-job restarts may shrink."""
    f = cfg.fault
    if not f.spare_nodes and not f.min_nodes:
        return None
    floor = f.min_nodes if 0 < f.min_nodes < nodes else nodes
    return (
        f"nodes: {nodes} training + {f.spare_nodes} spare (fault.spare_nodes) = {nodes + f.spare_nodes} asked for; "
        f"in-job restarts continue on >= {floor} node(s) (fault.min_nodes), else the job requeues"
    )


def _data_parallel_size(cfg: JobConfig, world_size: int) -> int:
    """The data-parallel degree ``parallel.strategy`` stands for; 0 when its degrees cannot be resolved.

    The same arithmetic as :func:`hpcdist.parallel.dims.parallel_dims` (which this package must not import)."""
    if layout.requested_kind(cfg.parallel) is None:
        return 0  # auto (resolved before this runs) or a refused strategy
    degrees = layout.strategy_degrees(cfg.parallel, world_size)
    mesh, problems = degrees.mesh.resolve(world_size)
    replicate = degrees.dp_replicate
    return 0 if problems or replicate < 1 or mesh.dp % replicate else mesh.dp


def grad_accum_steps(cfg: JobConfig, dp_size: int) -> int:
    """Micro-batches each data-parallel rank runs per optimizer step."""
    return cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp_size)
