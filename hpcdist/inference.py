"""A trained model back in one process: :func:`load_for_inference` (weights + tokenizer from a run's checkpoint) and
:func:`dataset_loss` (loss / perplexity on a prepared dataset), behind ``hpcdist generate`` and ``hpcdist eval``.

A checkpoint of any strategy and world size (ddp, fsdp, zero 1-3, 3d) stores the model's weights in DCP keyed by
FQN with global shapes, so one process without a process group reads them straight into a plain model. The model's
shape and the tokenizer come from the run's resolved ``config.yaml`` (run.dir, beside ``checkpoints/``): the tokenizer
is the one the run's prepared data records (``meta.json``), or the byte tokenizer of the stdlib / synthetic demo.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

from hpcdist.checkpoint import MARKER, CheckpointManager, CheckpointMismatch, latest
from hpcdist.config import ConfigError, JobConfig
from hpcdist.config import loader as config_loader
from hpcdist.config.vocab import DataError, check_same_tokenizer, dataset_paths
from hpcdist.data import BatchLoader, ByteTokenizer, ResumableSampler, TokenDataset, Tokenizer, load_tokenizer
from hpcdist.data.tokenizers import TokenizerError
from hpcdist.models import Transformer, build_model
from hpcdist.rundir import RunDir

__all__ = [
    "EvalResult",
    "Loaded",
    "check_eval_data",
    "dataset_loss",
    "load_for_inference",
    "load_weights",
    "read_run_config",
    "resolve_checkpoint",
    "run_tokenizer",
]


@dataclass
class Loaded:
    """What :func:`load_for_inference` found, for messages and for ``hpcdist eval``'s defaults."""

    checkpoint: Path
    config: JobConfig


def resolve_checkpoint(path: str | Path) -> tuple[Path, Path]:
    """(the step-N checkpoint to read, the run's config.yaml) for a run directory (its newest complete checkpoint),
    a checkpoints directory (its newest), or one step-N directory. ConfigError (one line) when neither is found."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ConfigError([f"{path}: no such directory; give a run directory, its checkpoints/ or a step-N checkpoint"])
    if (path / MARKER).is_file() or path.name.startswith("step-"):
        step, config = path, path.parent.parent / "config.yaml"  # run.dir/checkpoints/step-N
    elif RunDir(path).config.is_file():
        cfg = read_run_config(RunDir(path).config)
        found = latest(cfg.checkpoint_dir, warn=False)
        if found is None:
            raise ConfigError([f"{path}: the run has no complete checkpoint in {cfg.checkpoint_dir}"])
        step, config = found, RunDir(path).config
    else:
        found = latest(path, warn=False)
        if found is None:
            raise ConfigError([f"{path}: neither a run directory (no config.yaml) nor a checkpoints directory "
                               "(no complete step-N inside)"])  # fmt: skip
        step, config = found, path.parent / "config.yaml"
    if not config.is_file():
        raise ConfigError([f"{step}: the run's config.yaml is not at {config} (it names the model's shape and data); "
                           "give the checkpoint inside its run directory (run.dir/checkpoints/step-N)"])  # fmt: skip
    return step, config


def read_run_config(path: Path) -> JobConfig:
    """The run's saved config, resolved as the run wrote it. Only parsed and typed: the rules that check the run's
    surroundings (its data, other checkpoints) are the training start-up's business, not a reader's."""
    data, problems = config_loader.load_tree(path)
    cfg = config_loader.build(JobConfig, data, "", problems)
    if problems:
        raise ConfigError([f"{path}: {p}" for p in problems])
    if not isinstance(cfg.model.vocab_size, int):
        raise ConfigError([f"{path}: model.vocab_size={cfg.model.vocab_size!r} is not resolved (not a run's config)"])
    return cfg


def run_tokenizer(cfg: JobConfig) -> Tokenizer:
    """The tokenizer the run's data was made with: the prepared dataset's recorded one, or bytes for the demo."""
    if cfg.data.source in ("stdlib", "synthetic"):
        return ByteTokenizer()
    paths = dataset_paths(cfg)
    if not paths:
        raise ConfigError(["the run's config names no data.path: its tokenizer is unknown"])
    key, path = paths[0]
    try:
        return load_tokenizer(path)
    except TokenizerError as e:
        raise ConfigError([f"the run's tokenizer: {key}={path}: {e}"]) from None


@contextlib.contextmanager
def _no_process_group_warning() -> Iterator[None]:
    # reading DCP in one process without a process group is intended here; DCP warns about it on every call
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*process group.*")
        warnings.filterwarnings("ignore", message=".*torch.distributed is .*")
        yield


def load_weights(model: Transformer, step: Path) -> None:
    """Read the model weights of checkpoint ``step`` into ``model`` (in place) by FQN; CheckpointMismatch naming
    the parameters when the checkpoint holds another model."""
    metadata = dcp.FileSystemReader(str(step)).read_metadata()
    saved = {
        key[len("model.") :]: tuple(meta.size)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and hasattr(meta, "size")
    }
    dest = model.state_dict()  # shares storage with the parameters: DCP loads in place
    tied = (
        model.output is not None
        and model.tok_embeddings is not None
        and (model.output.weight is model.tok_embeddings.weight)
    )
    problems = [f"{k}: not in the checkpoint" for k in dest if k not in saved and not (tied and k == "output.weight")]
    problems += [f"{k}: in the checkpoint, not in this model" for k in saved if k not in dest]
    problems += [f"{k}: checkpoint {list(saved[k])}, model {list(v.shape)}" for k, v in dest.items()
                 if k in saved and saved[k] != tuple(v.shape)]  # fmt: skip
    if problems:
        shown = "; ".join(problems[:3]) + (f"; ... ({len(problems)} in all)" if len(problems) > 3 else "")
        raise CheckpointMismatch(f"{step} holds a different model than its run's config.yaml describes ({shown})", step)
    with _no_process_group_warning():
        dcp.load({"model": {k: v for k, v in dest.items() if k in saved}}, checkpoint_id=str(step))


def load_for_inference(
    path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[Transformer, Tokenizer, Loaded]:
    """(model in eval mode, tokenizer, where they came from) for a hpcdist run / checkpoint directory.

    The one entry point of ``hpcdist generate`` and ``hpcdist eval``: other sources of weights (a Hugging Face
    directory) plug in here, by what ``path`` holds."""
    step, config = resolve_checkpoint(path)
    cfg = read_run_config(config)
    # trust (who could have written the files: DCP's .metadata is unpickled), COMPLETE marker, manifest
    step = CheckpointManager(
        step.parent, rank=0, world_size=1, verify=cfg.checkpoint.verify, trusted_owners=cfg.checkpoint.trusted_owners
    ).resolve(str(step))  # type: ignore[assignment]
    tokenizer = run_tokenizer(cfg)
    model = build_model(cfg.model_args(), device="cpu")
    load_weights(model, step)
    model = model.to(device=device, dtype=dtype).eval()
    return model, tokenizer, Loaded(step, cfg)


@dataclass
class EvalResult:
    loss: float
    """Mean next-token cross-entropy over every target token of the batches (nats)."""
    batches: int
    tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {"loss": self.loss, "perplexity": self.perplexity, "batches": self.batches, "tokens": self.tokens}


def check_eval_data(cfg: JobConfig, data: str | Path) -> None:
    """A dataset for evaluating this run's model: prepared, with the run's tokenizer (ConfigError, one line)."""
    problems = check_same_tokenizer(cfg, "--data", str(data))
    if problems:
        raise DataError(problems)  # one line


@torch.no_grad()
def dataset_loss(model: Transformer, dataset: TokenDataset, *, batches: int, batch_size: int) -> EvalResult:
    """Loss on the first ``batches`` batches of ``batch_size`` windows, in order (what the trainer's Evaluator reads
    on one rank); fewer batches when the dataset is smaller (windows are never read twice)."""
    available = len(dataset) // batch_size
    if available < 1:
        raise ConfigError([f"{dataset.path} holds {len(dataset)} windows of {dataset.seq_len + 1} tokens: fewer than "
                           f"one batch of {batch_size}; lower --batch-size or --seq-len"])  # fmt: skip
    batches = min(batches, available)
    loader = BatchLoader(
        dataset, ResumableSampler(len(dataset), shuffle=False), global_batch_size=batch_size, dp_rank=0, dp_size=1
    )
    device = next(model.parameters()).device
    total, tokens = torch.zeros((), dtype=torch.float64), 0
    for _ in range(batches):
        batch = loader.next_batch().to(device)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = model(inputs)
        total += F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum").double().cpu()
        tokens += targets.numel()
    return EvalResult(float(total / tokens), batches, tokens)
