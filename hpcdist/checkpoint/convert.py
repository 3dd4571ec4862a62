"""``hpcdist checkpoint convert``: a checkpoint step in DCP's own stock encoding, and optionally one ``torch.save``
file, so torch alone reads it.

hpcdist's shards hold each tensor's raw bytes (:class:`hpcdist.checkpoint.codec.HashingWriter`, the manifest's
``tensor_encoding``), which torch's stock ``FileSystemReader`` (``dcp.load``, ``dcp_to_torch_save``) cannot read.
The step is checked first as a named ``checkpoint.resume`` is (trusted, complete, every file's sha256 against its
manifest), read whole in one process through :class:`hpcdist.checkpoint.codec.HashingReader` into a state dict rebuilt
from its metadata (torch's own ``_EmptyStateDictLoadPlanner``, the one ``dcp_to_torch_save`` uses), then written
with a stock ``FileSystemWriter`` and, with ``torch_save``, as the nested dict ``dcp_to_torch_save`` would write.
Everything is written beside its destination first and moved into place only once complete: a refusal or a failure
leaves no partial output and changes nothing of the checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from hpcdist.base.errors import refusing
from hpcdist.checkpoint.codec import HashingReader, single_process_dcp
from hpcdist.checkpoint.errors import describe_error
from hpcdist.checkpoint.manager import CheckpointManager
from hpcdist.checkpoint.manifest import tensor_encoding
from hpcdist.checkpoint.names import MARKER
from hpcdist.checkpoint.state import STATE_FILE
from hpcdist.config.loader import ConfigError

__all__ = ["ConvertError", "Converted", "cmd_convert", "convert", "read_state"]


class ConvertError(ValueError):
    """Bad input to the conversion: one line saying what is wrong and what to do."""


@dataclass(frozen=True)
class Converted:
    step: Path
    out: Path
    torch_save: Path | None
    tensors: int
    bytes: int


def read_state(step: Path) -> dict[str, Any]:
    """Every entry of the DCP state of the verified checkpoint ``step`` (model, optimizer), as the nested dict the
    trainer saved: tensors as plain CPU tensors (whatever strategy and world size wrote them), the rest as saved."""
    state: dict[str, Any] = {}
    reader = HashingReader(str(step), hash_files=set(), encoding=tensor_encoding(step))
    planner = _EmptyStateDictLoadPlanner()
    with single_process_dcp():
        # as dcp_to_torch_save does: dcp.load would hand the planner a copy of ``state`` to fill
        _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
    reader.apply_deferred(planner)  # the pickled entries (param_groups): every file verified before the read
    return state


def _verified(step: Path) -> Path:
    """``step`` (links resolved) once it is a trusted, complete checkpoint whose every file matches its manifest."""
    if not step.is_dir():
        raise ConvertError(f"STEP_DIR: {step} is not a directory")
    if not (step / MARKER).is_file():
        raise ConvertError(
            f"STEP_DIR: {step} has no {MARKER} marker: it is not a checkpoint step (a step-XXXXXXXX directory of "
            "checkpoint.dir), or an incomplete one"
        )
    try:
        return CheckpointManager(step.parent, rank=0, world_size=1, verify="checksum").named(step, "STEP_DIR")
    except ConfigError as e:  # damaged or untrusted: the manager's problems, on one line
        raise ConvertError("; ".join(e.problems)) from None


def _refuse_unless_free(path: Path, what: str) -> None:
    """Refuse an output that would replace something: a non-empty directory or any existing file."""
    if path.is_dir() and not path.is_symlink():
        if any(path.iterdir()):
            raise ConvertError(f"{what}: {path} exists and is not empty; name a new or empty directory")
    elif path.exists() or path.is_symlink():
        raise ConvertError(f"{what}: {path} exists; name a new {'directory' if what == '--out' else 'file'}")
    if not path.parent.is_dir():
        raise ConvertError(f"{what}: {path.parent} is not a directory")


def _tensor_stats(state: Any) -> tuple[int, int]:
    if isinstance(state, torch.Tensor):
        return 1, state.numel() * state.element_size()
    items = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else ()
    counts = [_tensor_stats(v) for v in items]
    return sum(c for c, _ in counts), sum(b for _, b in counts)


def convert(
    step: str | os.PathLike[str], out: str | os.PathLike[str], torch_save: str | os.PathLike[str] | None = None
) -> Converted:
    """Write the checkpoint ``step`` as a stock DCP checkpoint ``out`` (plus its trainer_state.json) and, when given,
    as the single ``torch.save`` file ``torch_save``. ConvertError for bad input; nothing is written then."""
    step, out = Path(step), Path(out)
    save_file = Path(torch_save) if torch_save is not None else None
    _refuse_unless_free(out, "--out")
    if save_file is not None:
        _refuse_unless_free(save_file, "--torch-save")
    step = _verified(step)
    try:
        state = read_state(step)
    except (CheckpointException, ValueError) as e:  # CheckpointException is a BaseException, not an Exception
        raise ConvertError(f"STEP_DIR: {step}: its tensors cannot be read: {describe_error(e)}") from None
    tensors, size = _tensor_stats(state)
    tmp_out = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp_file: Path | None = None
    try:
        with single_process_dcp():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_out)), no_dist=True)
        shutil.copy2(step / STATE_FILE, tmp_out / STATE_FILE)  # step, tokens seen and the config that saved it
        if save_file is not None:
            fd, name = tempfile.mkstemp(prefix=f".{save_file.name}.", dir=save_file.parent)
            os.close(fd)
            tmp_file = Path(name)
            torch.save(state, tmp_file)
        _refuse_unless_free(out, "--out")  # nothing appeared there meanwhile
        if out.is_dir():
            out.rmdir()  # empty: the finished directory takes its place
        tmp_out.rename(out)
        if save_file is not None and tmp_file is not None:
            tmp_file.rename(save_file)
            tmp_file = None
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp_out)
        if tmp_file is not None:
            tmp_file.unlink(missing_ok=True)
    return Converted(step=step, out=out, torch_save=save_file, tensors=tensors, bytes=size)


@refusing("checkpoint convert", ValueError, OSError)
def cmd_convert(args: argparse.Namespace) -> int:
    res = convert(args.step_dir, args.out, args.torch_save)
    also = f" and {res.torch_save} (torch.save)" if res.torch_save else ""
    print(
        f"converted {res.step} to {res.out} (stock DCP){also}: {res.tensors} tensors, {res.bytes / 1e6:,.1f} MB; "
        "torch.distributed.checkpoint.load reads it without hpcdist"
    )
    return 0
