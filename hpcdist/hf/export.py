"""``hpcdist export``: a hpcdist checkpoint of any strategy and world size -> a Hugging Face Llama directory.

Streamed on CPU, one tensor at a time: the shard plan comes from the checkpoint's DCP metadata (shapes and dtypes,
no data), then each output shard is filled by loading one FQN into a preallocated tensor (DCP reads only its bytes,
resharding whatever layout wrote it), converting it (:mod:`hpcdist.hf.convert`) and keeping the result until the
shard is written with safetensors (which writes from the tensors' memory, no copy). Peak memory: one output shard,
plus one tensor as saved and its converted copy. The directory is built under a temporary name beside ``out`` and
renamed when complete, so a killed export never leaves a half directory that looks finished.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from hpcdist.base.atomic import atomic_write, follow_umask
from hpcdist.hf.convert import fqn_names, fqn_to_hf, to_hf_tensor
from hpcdist.hf.source import (
    ConversionError,
    find_checkpoint,
    load_fqn,
    load_run_tokenizer,
    return_freed_memory,
    run_config,
    run_model_args,
    saved_shapes,
)
from hpcdist.hf.tokenizer import export_tokenizer
from hpcdist.models.args import ModelArgs
from hpcdist.models.hf_config import hf_config

__all__ = ["DTYPES", "ExportResult", "export", "parse_shard_size"]

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_HF_DTYPE = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


@dataclass
class ExportResult:
    out: Path
    checkpoint: Path
    files: list[str] = field(default_factory=list)
    total_bytes: int = 0
    largest_shard_bytes: int = 0
    seconds: float = 0.0


def parse_shard_size(text: str) -> int:
    """``5GB``, ``500MB``, ``2GiB``, ``1000000`` -> bytes (decimal units as Hugging Face's max_shard_size)."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    t = text.strip().upper()
    for unit, factor in units.items():
        if t.endswith(unit):
            try:
                return int(float(t[: -len(unit)]) * factor)
            except ValueError:
                break
    try:
        return int(t)
    except ValueError:
        raise ValueError(f"{text!r} is not a size: write e.g. 2GB, 500MB or 1GiB") from None


def _plan(args: ModelArgs, saved: dict, dtype: torch.dtype, max_shard: int | None) -> list[list[str]]:
    """FQNs of each output shard, in file order: a new shard starts when the next tensor would pass ``max_shard``."""
    missing = [f for f in fqn_names(args) if f not in saved]
    if missing:
        raise ConversionError(
            f"the checkpoint lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}: "
            "it does not hold the model its config describes"
        )
    shards: list[list[str]] = [[]]
    size = 0
    elsize = torch.empty(0, dtype=dtype).element_size()
    for fqn in fqn_names(args):
        shape, _ = saved[fqn]
        nbytes = elsize * int(torch.Size(shape).numel())
        if max_shard is not None and shards[-1] and size + nbytes > max_shard:
            shards.append([])
            size = 0
        shards[-1].append(fqn)
        size += nbytes
    return shards


def export(
    checkpoint: str | Path,
    out: str | Path,
    *,
    dtype: str = "bf16",
    max_shard_size: int | None = None,
    tokenizer: str | None = None,
    with_tokenizer: bool = True,
) -> ExportResult:
    """Write the Hugging Face Llama directory ``out`` (which must not exist or be empty) from ``checkpoint``."""
    t0 = time.perf_counter()
    return_freed_memory()
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConversionError(f"--out {out} exists and is not an empty directory: name a new one")
    if dtype not in DTYPES:
        raise ConversionError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    step = find_checkpoint(checkpoint)
    config = run_config(step)
    args = run_model_args(config)
    tok = load_run_tokenizer(config, tokenizer) if with_tokenizer else None
    if tok is not None and tok.vocab_size > args.vocab_size:
        raise ConversionError(
            f"the tokenizer has {tok.vocab_size} tokens but the model's vocabulary is model."
            f"vocab_size={args.vocab_size}: pass the --tokenizer it was trained with"
        )
    torch_dtype = DTYPES[dtype]
    saved = saved_shapes(step)
    shards = _plan(args, saved, torch_dtype, max_shard_size)
    names = (
        [SINGLE]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    result = ExportResult(out=out, checkpoint=step)
    try:
        weight_map: dict[str, str] = {}
        for name, fqns in zip(names, shards, strict=True):
            shard: dict[str, torch.Tensor] = {}
            for fqn in fqns:
                shape, saved_dtype = saved[fqn]
                t = torch.empty(shape, dtype=saved_dtype)
                load_fqn(step, {fqn: t})
                shard[fqn_to_hf(fqn)] = to_hf_tensor(fqn, t.to(torch_dtype), args).contiguous()
                del t  # the saved-dtype copy goes before the next tensor is loaded
                weight_map[fqn_to_hf(fqn)] = name
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            follow_umask(tmp / name)  # safetensors creates 0600: the run's other files follow the umask
            nbytes = sum(t.nbytes for t in shard.values())
            result.total_bytes += nbytes
            result.largest_shard_bytes = max(result.largest_shard_bytes, nbytes)
            del shard
        if len(shards) > 1:
            index = {"metadata": {"total_size": result.total_bytes}, "weight_map": weight_map}
            atomic_write(tmp / INDEX, json.dumps(index, indent=2) + "\n")
        bos, eos = (tok.bos_id, tok.eos_id) if tok is not None else (None, None)
        hf = hf_config(args, torch_dtype=_HF_DTYPE[torch_dtype], bos_id=bos, eos_id=eos)
        atomic_write(tmp / "config.json", json.dumps(hf, indent=2) + "\n")
        generation = {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False}
        atomic_write(tmp / "generation_config.json", json.dumps(generation, indent=2) + "\n")
        if tok is not None:
            export_tokenizer(tok, tmp, max_len=args.max_seq_len)
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    result.files = sorted(p.name for p in out.iterdir())
    result.seconds = time.perf_counter() - t0
    return result
