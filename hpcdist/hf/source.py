"""Where the weights of a conversion come from: a hpcdist checkpoint (DCP, by FQN) or a Hugging Face directory.

A checkpoint argument may be a step-XXXXXXXX directory, a checkpoints directory (its newest complete step) or a run
directory (``<run.dir>/checkpoints``); its model and data config come from the ``trainer_state.json`` every
checkpoint carries (the config that saved it), so exporting needs no YAML.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from hpcdist.base.rundir import RunDir
from hpcdist.checkpoint.codec import HashingReader, read_metadata, single_process_dcp
from hpcdist.checkpoint.errors import describe_error
from hpcdist.checkpoint.manager import CheckpointManager
from hpcdist.checkpoint.manifest import tensor_encoding
from hpcdist.checkpoint.names import MARKER, latest
from hpcdist.checkpoint.state import STATE_FILE
from hpcdist.data.tokenizers import Tokenizer, TokenizerError, load_tokenizer, recorded_tokenizer
from hpcdist.models.args import ModelArgs

__all__ = [
    "ConversionError",
    "find_checkpoint",
    "load_fqn",
    "load_run_tokenizer",
    "return_freed_memory",
    "run_config",
    "run_model_args",
    "saved_shapes",
]


class ConversionError(ValueError):
    """Bad input to export / import / load: one line saying what is wrong and the fix."""


def find_checkpoint(path: str | Path, *, key: str = "CHECKPOINT_DIR") -> Path:
    """The complete step directory ``path`` names (itself, the newest in it, or the newest of the run it is), checked
    like ``checkpoint.resume``: trusted, complete and intact by size (ConfigError otherwise)."""
    path = Path(path)
    if not path.is_dir():
        raise ConversionError(f"{key}: {path} is not a directory")
    step = path
    if not (path / MARKER).is_file():
        step = latest(path, warn=False) or latest(RunDir(path).checkpoints, warn=False)  # type: ignore[assignment]
        if step is None:
            raise ConversionError(
                f"{key}: {path} holds no complete hpcdist checkpoint (a step-XXXXXXXX directory with "
                f"{MARKER}, a checkpoints directory or a run directory)"
            )
    # sizes only: a sha256 pass would read the optimizer state too, several times the weights
    return CheckpointManager(step.parent, rank=0, world_size=1, verify="size").named(step, key)


def run_config(step: Path) -> dict[str, Any]:
    """The config that saved the checkpoint ``step`` (from its trainer_state.json), as plain dicts."""
    try:
        config = json.loads((step / STATE_FILE).read_text(encoding="utf-8")).get("config")
    except (OSError, ValueError, AttributeError) as e:
        raise ConversionError(f"{step}: no readable {STATE_FILE} ({e})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise ConversionError(f"{step}/{STATE_FILE}: no model config recorded; it was not saved by hpcdist's trainer")
    return config


def run_model_args(config: dict[str, Any]) -> ModelArgs:
    fields = {f.name for f in dataclasses.fields(ModelArgs)}
    return ModelArgs(**{k: v for k, v in config["model"].items() if k in fields})


def load_run_tokenizer(config: dict[str, Any], spec: str | None = None) -> Tokenizer:
    """``spec`` when given, else the tokenizer the run's data was prepared with (byte for data.source=stdlib)."""
    if spec is not None:
        return load_tokenizer(spec)
    if "data" not in config:  # a checkpoint made by `hpcdist import`: the tokenizer stayed with the Hugging Face files
        raise TokenizerError(
            "the checkpoint records no data config, so no tokenizer: pass --tokenizer SPEC (byte, a "
            "tokenizer.json or its directory, the Hugging Face directory it came from)"
        )
    data = config["data"] or {}
    if data.get("source", "stdlib") == "stdlib":
        return load_tokenizer("byte")
    paths = [data.get("path")] if data.get("path") else [s.get("path") for s in data.get("sources") or []]
    if data.get("source") != "files" or not paths:
        raise TokenizerError(
            f"the run's data (data.source={data.get('source')}) records no tokenizer: pass --"
            "tokenizer SPEC (byte, a tokenizer.json or its directory, prepared data)"
        )
    found = recorded_tokenizer(Path(paths[0]))
    if found is None:
        raise TokenizerError(
            f"the tokenizer of the run's data {paths[0]} is missing (no prepared dataset there any "
            "more): pass --tokenizer SPEC (byte, a tokenizer.json or its directory)"
        )
    return found


def return_freed_memory() -> None:
    """Make glibc hand every freed block of 1 MiB or more straight back to the system (Linux; elsewhere nothing).

    A conversion allocates and frees one tensor after another; glibc's default raises its mmap threshold to the size
    of the largest block freed (up to 32 MiB), after which those tensors come from the heap and their freed space
    stays in the process: importing the 125m preset grew RSS by 0.44 GB of freed heap (peak 2.9x the largest tensor
    above baseline, 1.5x with this). Process-wide: the conversions call it; the trainer does not."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(name).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = -3 (malloc.h); setting it ends the dynamic rise


def load_fqn(step: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Fill the preallocated ``tensors`` (FQN -> tensor of the saved shape) from the checkpoint ``step``: DCP reads
    just their bytes, whatever strategy and world size wrote them (ZeRO partitions, FSDP / TP shards)."""
    with single_process_dcp():
        try:
            # our reader: it knows the manifest's tensor encoding (raw), DCP's own does not
            reader = HashingReader(str(step), hash_files=set(), encoding=tensor_encoding(step))
            dcp.load({"model": tensors}, storage_reader=reader)
        except (CheckpointException, ValueError) as e:  # CheckpointException is a BaseException: it would pass
            # every `except Exception` up to the CLI; ValueError: the manifest names no known tensor encoding
            raise ConversionError(f"{step}: its weights cannot be read: {describe_error(e)}") from None


def saved_shapes(step: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """FQN -> (global shape, dtype) of every model tensor in the checkpoint, from its DCP metadata."""
    try:
        metadata = read_metadata(step)
    except (OSError, ValueError) as e:
        raise ConversionError(f"{step}: {describe_error(e)}") from None
    return {
        key[len("model.") :]: (tuple(meta.size), meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and hasattr(meta, "size")
    }
