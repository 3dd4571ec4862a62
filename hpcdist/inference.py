"""A trained model back in one process: :func:`load_for_inference` (weights + tokenizer from a run's checkpoint or a
Hugging Face directory) and :func:`dataset_loss` (loss / perplexity on a prepared dataset), behind ``hpcdist generate``
and ``hpcdist eval``.

A checkpoint of any strategy and world size (ddp, fsdp, zero 1-3, 3d) stores the model's weights in DCP keyed by
FQN with global shapes, so one process without a process group reads them straight into a plain model (the readers
are :mod:`hpcdist.hf.source`'s, shared with ``hpcdist export``). The model's shape and the tokenizer come from the
config recorded in the checkpoint itself: the tokenizer is the one the run's prepared data records (``meta.json``), or
the byte tokenizer of the stdlib demo.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hpcdist.base.errors import CommandError, refusing
from hpcdist.checkpoint.errors import CheckpointMismatch
from hpcdist.checkpoint.state import STATE_FILE
from hpcdist.config import ConfigError, JobConfig
from hpcdist.config import loader as config_loader
from hpcdist.config.dataset_meta import load_meta
from hpcdist.config.vocab import DataError, check_same_tokenizer
from hpcdist.data import BatchLoader, ResumableSampler, TokenDataset, Tokenizer, load_tokenizer
from hpcdist.data.tokenizers import TokenizerError
from hpcdist.hf.import_ import HFWeights
from hpcdist.hf.source import find_checkpoint, load_fqn, load_run_tokenizer, run_config, saved_shapes
from hpcdist.models.args import ModelArgs
from hpcdist.models.hf_config import is_hf_dir
from hpcdist.models.llama import Transformer, precompute_rope

__all__ = [
    "EvalResult",
    "Loaded",
    "check_eval_data",
    "checkpoint_config",
    "dataset_loss",
    "load_for_inference",
    "load_weights",
]


@dataclass
class Loaded:
    """What :func:`load_for_inference` found, for messages and for ``hpcdist eval``'s defaults."""

    checkpoint: Path
    config: JobConfig | None
    """The config that trained the checkpoint; None for a Hugging Face directory (it carries no training config)."""


def checkpoint_config(step: Path, saved: dict[str, Any]) -> JobConfig:
    """The config that saved checkpoint ``step`` (``saved``: its trainer_state.json record), typed. Only parsed: the
    rules that check the run's surroundings (its data, other checkpoints) are the training start-up's business."""
    problems: list[str] = []
    cfg = config_loader.build(JobConfig, saved, "", problems)
    if problems:
        raise ConfigError([f"{step / STATE_FILE}: {p}" for p in problems])
    return cfg


def load_weights(model: Transformer, step: Path) -> None:
    """Read the model weights of checkpoint ``step`` into ``model`` (in place) by FQN; CheckpointMismatch naming
    the parameters when the checkpoint holds another model."""
    saved = {k: shape for k, (shape, _) in saved_shapes(step).items()}
    dest = model.state_dict()  # shares storage with the parameters: DCP loads in place
    tied = model.args.tie_embeddings
    problems = [f"{k}: not in the checkpoint" for k in dest if k not in saved and not (tied and k == "output.weight")]
    problems += [f"{k}: in the checkpoint, not in this model" for k in saved if k not in dest]
    problems += [
        f"{k}: checkpoint {list(saved[k])}, model {list(v.shape)}"
        for k, v in dest.items()
        if k in saved and saved[k] != tuple(v.shape)
    ]
    if problems:
        shown = "; ".join(problems[:3]) + (f"; ... ({len(problems)} in all)" if len(problems) > 3 else "")
        raise CheckpointMismatch(f"{step} holds a different model than its trainer state describes ({shown})", step)
    load_fqn(step, {k: v for k, v in dest.items() if k in saved})


def _empty_model(args: ModelArgs) -> Transformer:
    # meta build + to_empty: no time spent initializing weights that are overwritten next
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.rope_cache = precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta, device=torch.device("cpu"))
    return model


def load_for_inference(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    tokenizer: str | None = None,
) -> tuple[Transformer, Tokenizer | None, Loaded]:
    """(model in eval mode, tokenizer or None when the run records none, where they came from): the one entry point
    of ``hpcdist generate`` and ``hpcdist eval`` (and of anything else that wants a trained model in one process).
    ``path`` is

    * a hpcdist checkpoint of any strategy and world size: a step-XXXXXXXX directory, a checkpoints directory or a
      run directory (the newest complete step), checked like ``checkpoint.resume`` (trusted owner, COMPLETE, sizes).
      The model's shape and data come from the config that saved it (its trainer_state.json, not a config.yaml
      edited since); the tokenizer is the run's (the prepared data's, bytes for the stdlib demo; None for
      synthetic data and imported checkpoints, which record none);
    * a Hugging Face Llama directory (config.json + safetensors) and its tokenizer files.

    ``tokenizer`` (a ``load_tokenizer`` spec) overrides either. Bad input raises a one-line ValueError
    (ConversionError, HFConfigError, TokenizerError, ConfigError) or CheckpointMismatch."""
    path = Path(path).expanduser()
    if is_hf_dir(path):
        weights = HFWeights(path, purpose="generate")  # the whole directory checked, memory included
        model = _empty_model(weights.args)
        with torch.no_grad():
            for fqn, p in model.state_dict().items():
                p.copy_(weights.tensor(fqn))
        tok, loaded = load_tokenizer(tokenizer or path), Loaded(path, None)
    else:
        step = find_checkpoint(path)
        saved = run_config(step)
        cfg = checkpoint_config(step, saved)
        model = _empty_model(cfg.model_args())
        load_weights(model, step)
        loaded = Loaded(step, cfg)
        try:
            tok = load_run_tokenizer(saved, tokenizer)
        except TokenizerError:
            if tokenizer is not None:
                raise
            tok = None  # synthetic data or an imported checkpoint: the weights load; text needs --tokenizer
    return model.to(device=device, dtype=dtype).eval(), tok, loaded


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
        raise ConfigError(
            [
                f"{dataset.path} holds {len(dataset)} windows of {dataset.seq_len + 1} tokens: fewer than "
                f"one batch of {batch_size}; lower --batch-size or --seq-len"
            ]
        )
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


# ----------------------------------------------------------------------------- hpcdist generate / hpcdist eval


@refusing("generate", ValueError, OSError)  # PromptTooLong, CheckpointMismatch, TokenizerError are ValueErrors
def cmd_generate(args: argparse.Namespace) -> int:
    from hpcdist.models.generation import SamplingConfig, generate

    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k or None, top_p=args.top_p)
    model, tok, _ = load_for_inference(args.checkpoint, device=args.device, tokenizer=args.tokenizer)
    if tok is None:
        raise CommandError(
            f"generate: {args.checkpoint} records no tokenizer (synthetic data, or an imported "
            "checkpoint): pass --tokenizer SPEC (byte, a tokenizer.json or its directory, prepared data)"
        )
    prompt = [int(i) for i in tok.encode_batch([args.prompt])[0]]
    if tok.add_bos and tok.bos_id is not None:  # documents were prepared framed by BOS: prompts are too
        prompt = [tok.bos_id, *prompt]
    t0 = time.perf_counter()
    res = generate(
        model,
        prompt,
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        eos_id=tok.eos_id,
        vocab_limit=tok.vocab_size,
        seed=args.seed,
        use_cache=not args.no_cache,
    )
    seconds = time.perf_counter() - t0
    text = tok.decode(res.tokens)
    if args.json:
        print(
            json.dumps(
                {
                    "prompt": args.prompt,
                    "text": text,
                    "prompt_ids": prompt,
                    "new_ids": res.tokens,
                    "stop": res.stop,
                    "seconds": seconds,
                }
            )
        )
    else:
        print(args.prompt + text, flush=True)
        rate = len(res.tokens) / seconds if seconds > 0 else 0.0
        print(
            f"hpcdist: {len(res.tokens)} new tokens in {seconds:.2f}s ({rate:.1f} tokens/s), stopped at {res.stop}",
            file=sys.stderr,
        )
    return 0


@refusing("eval", ValueError, OSError)  # bad input of any kind: one line
def cmd_eval(args: argparse.Namespace) -> int:
    from hpcdist.base.atomic import atomic_write

    if is_hf_dir(args.checkpoint):  # its tokenizer, seq_len and batch sizes come from the run: a HF directory has none
        raise CommandError(
            f"eval: {args.checkpoint} is a Hugging Face directory; give the hpcdist checkpoint it was "
            "exported from (or run lm-eval-harness on it: README)"
        )
    model, _, loaded = load_for_inference(args.checkpoint, device=args.device)
    cfg = loaded.config
    assert cfg is not None  # a hpcdist checkpoint records the config that trained it
    check_eval_data(cfg, args.data)  # before any batch: the same ids must mean the same text
    seq_len = args.seq_len or cfg.data.seq_len
    if seq_len > model.args.max_seq_len:
        raise CommandError(f"eval: --seq-len {seq_len} exceeds the model's max_seq_len={model.args.max_seq_len}")
    dataset = TokenDataset(args.data, seq_len, key="--data")  # every shard checked before the first batch
    if cfg.data.document_mask:  # evaluated as it was trained: documents split at the data's EOS
        eos = load_meta(args.data, key="--data").raw.get("eos_id")
        if eos is None:
            raise CommandError(
                f"eval: the run trained with data.document_mask, but {args.data}'s meta.json records no eos_id to "
                "split documents at; prepare it with `hpcdist prepare`"
            )
        model.document_eos = int(eos)
    res = dataset_loss(
        model,
        dataset,
        batches=args.batches or cfg.train.eval_batches,
        batch_size=args.batch_size or cfg.train.global_batch_size,
    )
    out = {"checkpoint": str(loaded.checkpoint), "data": str(args.data), "seq_len": seq_len, **res.to_dict()}
    print(
        f"eval {loaded.checkpoint} on {args.data}: loss {res.loss:.4f}, perplexity {res.perplexity:.2f} "
        f"({res.batches} batches, {res.tokens:,} tokens)"
    )
    if args.json:
        atomic_write(args.json, json.dumps(out, indent=2) + "\n")
    return 0
