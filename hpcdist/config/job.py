"""Load, dump and save a :class:`~hpcdist.config.JobConfig`: the generic loader applied to the job schema.

Precedence is CLI overrides > YAML > model preset > dataclass defaults. Every problem found (YAML, keys, types,
the rules of :mod:`hpcdist.config.rules`) is reported at once in one :class:`ConfigError`, before any process
group exists (litgpt / submitit style).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from hpcdist.base.atomic import atomic_write
from hpcdist.config import loader, rules, vocab
from hpcdist.config.loader import ConfigError
from hpcdist.config.schema import JobConfig
from hpcdist.models.args import load_preset

__all__ = ["dump", "load", "save"]


def load(path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()) -> JobConfig:
    """Load YAML (optional) + overrides into a validated JobConfig; raise ConfigError listing every problem."""
    data, problems = loader.load_tree(path, overrides)
    model = data.get("model")
    preset = loader.raw_text(model.get("preset")) if isinstance(model, Mapping) else None
    if preset is not None and preset != "":
        try:
            data["model"] = loader.merge(load_preset(str(preset)), model)
        except (ValueError, OSError) as e:
            problems.append(f"model.preset: {e}")
        except yaml.YAMLError as e:
            problems.append(f"model.preset: {str(preset)!r} is not valid YAML: {getattr(e, 'problem', e)}")

    cfg = loader.build(JobConfig, data, "", problems)
    problems += vocab.resolve_vocab(cfg)  # model.vocab_size: auto -> a number, so every later user sees one
    problems += rules.check(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def dump(cfg: JobConfig) -> str:
    """The resolved config as YAML: every section and key, in schema order (what ``save`` writes)."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def save(cfg: JobConfig, path: str | os.PathLike[str]) -> Path:
    """Write the resolved config atomically (a reader never sees half a file)."""
    return atomic_write(path, dump(cfg))
