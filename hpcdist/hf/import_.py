"""Hugging Face Llama weights into hpcdist: ``hpcdist import`` (a step-0 checkpoint) and ``checkpoint.init_from``.

:class:`HFWeights` reads one tensor at a time from the directory's safetensors files (one file or an index of
shards) and returns it in hpcdist's FQN, layout (:mod:`hpcdist.hf.convert`) and float32. Two DCP adapters on it:

* :class:`HFSavePlanner` makes ``dcp.save`` write a checkpoint from meta tensors, reading each real tensor only
  when DCP's writer asks for it: the import holds one tensor at a time, not the model.
* :class:`HFStorageReader` is a DCP storage reader over the Hugging Face directory: ``dcp.load`` into any
  strategy's sharded state (FSDP / TP DTensors, ZeRO partitions, pipeline stages) reads just the boxes each rank
  needs, so ``checkpoint.init_from: HF_DIR`` needs no conversion step and no rank holds more than one tensor.

safetensors files are plain data (no pickle), so a Hugging Face directory needs no ownership check; it is hostile
input all the same: :mod:`hpcdist.models.hf_directory` checks it whole before anything is allocated, and reads its
bytes.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader

from hpcdist.checkpoint.codec import single_process_dcp
from hpcdist.checkpoint.errors import describe_error
from hpcdist.checkpoint.manager import CheckpointManager
from hpcdist.checkpoint.state import Checkpointable
from hpcdist.config import ConfigError
from hpcdist.data.tokenizers import TokenizerError, load_tokenizer
from hpcdist.hf.convert import fqn_names, fqn_to_hf, from_hf_tensor
from hpcdist.hf.source import ConversionError, return_freed_memory
from hpcdist.models.args import ModelArgs
from hpcdist.models.hf_config import HFConfigError, shape_mismatch
from hpcdist.models.hf_directory import Purpose, open_hf_dir

__all__ = ["HFSavePlanner", "HFStorageReader", "HFWeights", "import_checkpoint", "load_into"]

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


class HFWeights:
    """The weights of a Hugging Face Llama directory by hpcdist FQN, read one tensor at a time. The directory is
    checked first, whole (:func:`hpcdist.models.hf_directory.open_hf_dir`: files, config.json, every header against it,
    memory for ``purpose``): HFConfigError, one line, before any tensor is allocated."""

    def __init__(self, path: str | Path, *, purpose: Purpose = "import") -> None:
        self.dir = open_hf_dir(path, purpose=purpose)
        self.path = self.dir.path
        self.args = self.dir.args

    def fqns(self) -> list[str]:
        """The FQNs a hpcdist model of these args has (a tied model's output.weight is the embedding's)."""
        return [*fqn_names(self.args), *(["output.weight"] if self.args.tie_embeddings else [])]

    def _source(self, fqn: str) -> str:
        return "tok_embeddings.weight" if fqn == "output.weight" and self.args.tie_embeddings else fqn

    def shape(self, fqn: str) -> tuple[int, ...]:
        return self.dir.tensors[fqn_to_hf(self._source(fqn))].shape

    def tensor(self, fqn: str) -> torch.Tensor:
        """hpcdist's ``fqn`` in float32 and hpcdist's layout (a tied output.weight reads the embedding)."""
        src = self._source(fqn)
        name = fqn_to_hf(src)
        entry = self.dir.tensors[name]
        raw = torch.frombuffer(self.dir.read(name), dtype=_DTYPES[entry.dtype]).reshape(entry.shape)
        return from_hf_tensor(src, raw.to(torch.float32), self.args).contiguous()

    def metadata(self) -> Metadata:
        """DCP metadata of these weights under ``model.<fqn>``: one float32 chunk per tensor."""
        md = {}
        for fqn in self.fqns():
            size = torch.Size(self.shape(fqn))
            md[f"model.{fqn}"] = TensorStorageMetadata(
                properties=TensorProperties(dtype=torch.float32),
                size=size,
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)],
            )
        return Metadata(state_dict_metadata=md)  # type: ignore[arg-type]


class HFSavePlanner(DefaultSavePlanner):
    """Saves ``{"model": {fqn: meta tensor}}``: each tensor's data is read from the Hugging Face files only when the
    writer reaches it (DCP's CPU writer resolves one item at a time and drops it once written)."""

    def __init__(self, weights: HFWeights) -> None:
        super().__init__()
        self.weights = weights

    def lookup_object(self, index: MetadataIndex) -> Any:
        # read when the writer reaches it; dropped once written and hashed: HashingWriter keeps no reference to a
        # tensor it wrote (DCP's own writer kept every tensor of a file until the file was done, for its safetensors
        # format: 125m peaked at 2.9x the weights' size above baseline, and this planner freed each storage by hand)
        return self.weights.tensor(index.fqn.removeprefix("model."))


class HFStorageReader(StorageReader):
    """DCP storage reader over a Hugging Face Llama directory (``dcp.load(state, storage_reader=...)``)."""

    def __init__(self, weights: HFWeights) -> None:
        super().__init__()
        self.weights = weights

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.weights.metadata()

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        by_fqn = defaultdict(list)
        for req in plan.items:
            by_fqn[req.storage_index.fqn].append(req)
        for key, reqs in by_fqn.items():  # one whole tensor in memory at a time; each request takes its box
            full = self.weights.tensor(key.removeprefix("model."))
            for req in reqs:
                src = full
                for dim, (offset, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                    src = src.narrow(dim, offset, length)
                target = planner.resolve_tensor(req).detach()
                target.copy_(src)
                planner.commit_tensor(req, target)
            del full
        done: torch.futures.Future[None] = torch.futures.Future()  # DCP waits on a torch future
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # never picked by DCP's guessing from a path: only given explicitly


def load_into(path: str | Path, state: Checkpointable, args: ModelArgs) -> None:
    """Collective: ``checkpoint.init_from: HF_DIR``. The Hugging Face weights at ``path`` into this run's model state
    (any strategy); the model section must equal config.json's (checked at config load, again here: the directory
    may have changed since). A refusal is a ConfigError, which ``hpcdist train`` prints once, exit 2."""
    try:
        weights = HFWeights(path, purpose="init_from")
    except HFConfigError as e:
        raise ConfigError([f"checkpoint.init_from: {e}"]) from None
    problem = shape_mismatch(args, weights.args, where=f"{path}/config.json")
    if problem:
        raise ConfigError([f"checkpoint.init_from: {problem}"])
    model = state.dcp_state()["model"]
    try:
        with single_process_dcp():  # one process (a conversion, a 1-rank run): no process group on purpose
            dcp.load({"model": model}, storage_reader=HFStorageReader(weights))
    except CheckpointException as e:  # a BaseException: it would pass every `except Exception` up to the CLI
        raise ConversionError(
            f"checkpoint.init_from: {path}: its weights cannot be loaded into this model: {describe_error(e)}"
        ) from None
    state.load_dcp_state({"model": model})


def import_checkpoint(path: str | Path, out: str | Path, *, vocab_size: int | None = None) -> Path:
    """``hpcdist import``: the step-00000000 checkpoint of the Hugging Face Llama at ``path`` written into the
    checkpoints directory ``out``: model weights in float32 (no optimizer state: it starts fresh), the model
    section in trainer_state.json. Every strategy resumes from it (``checkpoint.resume``) or starts from it
    (``checkpoint.init_from``)."""
    return_freed_memory()
    weights = HFWeights(path, purpose="import")
    args = weights.args
    if vocab_size is not None and vocab_size != args.vocab_size:
        raise ConversionError(f"model.vocab_size={vocab_size} but {path}/config.json has vocab_size={args.vocab_size}")
    if (Path(path) / "tokenizer.json").is_file():  # the weights must cover every id the tokenizer produces
        try:
            tok = load_tokenizer(path)
        except TokenizerError as e:
            raise ConversionError(str(e)) from None
        if tok.vocab_size > args.vocab_size:
            raise ConversionError(
                f"{path}: the tokenizer has {tok.vocab_size} tokens but config.json's vocab_size "
                f"is {args.vocab_size}: the embedding table cannot cover it"
            )
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConversionError(f"--out {out} exists and is not empty: name a new checkpoints directory")
    out.mkdir(parents=True, exist_ok=True)
    meta = {"model": {fqn: torch.empty(weights.shape(fqn), device="meta") for fqn in weights.fqns()}}
    trainer_state = {
        "step": 0,
        "tokens_seen": 0,
        "world_size": 1,
        "imported_from": str(Path(path).resolve()),
        "config": {"model": dataclasses.asdict(args)},
    }
    state = Checkpointable(
        dcp_state=lambda: meta,
        load_dcp_state=lambda _: None,
        trainer_state=lambda: trainer_state,
        load_trainer_state=lambda _: None,
        save_planner=HFSavePlanner(weights),
    )
    saved = CheckpointManager(out, rank=0, world_size=1, keep_last=1).save(0, state)
    if saved is None:
        raise ConversionError(f"writing the checkpoint into {out} failed (see the error above)")
    return saved
