"""One model in one process from a directory, for inference (generation, evaluation): a hpcdist checkpoint of any
strategy and world size, or a Hugging Face Llama directory."""

from __future__ import annotations

from pathlib import Path

import torch

from hpcdist.data.tokenizers import Tokenizer, TokenizerError, load_tokenizer
from hpcdist.hf.import_ import HFWeights
from hpcdist.hf.source import find_checkpoint, load_fqn, run_config, run_model_args, run_tokenizer
from hpcdist.models.args import ModelArgs
from hpcdist.models.hf_config import is_hf_dir
from hpcdist.models.llama import Transformer, precompute_rope

__all__ = ["load_model_from_dir"]


def _empty_model(args: ModelArgs) -> Transformer:
    # meta build + to_empty: no time spent initializing weights that are overwritten next
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.rope_cache = precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta, device=torch.device("cpu"))
    return model


def load_model_from_dir(
    path: str | Path, *, tokenizer: str | None = None
) -> tuple[Transformer, ModelArgs, Tokenizer | None]:
    """(model in eval mode, float32 on CPU; its ModelArgs; its tokenizer or None when there is none) from ``path``:

    * a hpcdist checkpoint: a step-XXXXXXXX directory, a checkpoints directory or a run directory (the newest
      complete step); checked like ``checkpoint.resume`` (trusted, complete, sizes match the manifest). The
      tokenizer is the run's (the prepared data's, byte for data.source=stdlib); None if it cannot be found.
    * a Hugging Face Llama directory (config.json + safetensors): its tokenizer.json / tokenizer.model if any.

    ``tokenizer`` (a ``load_tokenizer`` spec) overrides either. Raises ConversionError / HFConfigError /
    ConfigError (all ValueErrors) with one line on bad input."""
    path = Path(path)
    tok: Tokenizer | None
    if is_hf_dir(path):
        weights = HFWeights(path)
        args = weights.args
        model = _empty_model(args)
        with torch.no_grad():
            for fqn, p in model.state_dict().items():
                p.copy_(weights.tensor(fqn))
        has_tok = (path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file()
        tok = load_tokenizer(tokenizer or path) if (tokenizer or has_tok) else None
    else:
        step = find_checkpoint(path)
        config = run_config(step)
        args = run_model_args(config)
        model = _empty_model(args)
        load_fqn(step, dict(model.state_dict()))
        try:
            tok = run_tokenizer(config, tokenizer)
        except TokenizerError:
            if tokenizer is not None:
                raise
            tok = None
    return model.eval(), args, tok
