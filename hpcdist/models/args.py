"""Torch-free model description: :class:`ModelArgs`, its parameter/FLOP arithmetic and the YAML presets.

Config validation, the memory estimator and the planner need the model's shape and counts but never its weights,
so they import this module and stay torch-free; :mod:`hpcdist.models.llama` builds the ``nn.Module`` from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcdist import resources
from hpcdist.base import safe_yaml
from hpcdist.byte_vocab import BYTE_VOCAB

__all__ = [
    "DOCUMENT_ATTENTION",
    "MODEL_MAXIMA",
    "ModelArgs",
    "flops_per_token",
    "load_preset",
    "num_params",
    "preset_names",
]


# The largest value of each numeric field (and why), for a YAML model section (config.rules.MAXIMA spreads these as
# model.*) and for a Hugging Face config.json alike (models.hf_config): one table, so both refuse the same values.
MODEL_MAXIMA: dict[str, tuple[float, str]] = {
    "vocab_size": (2**31 - 1, "token ids are int32 in the shards' uint32"),
    "dim": (2**17, ""),
    "n_layers": (2**14, ""),
    "n_heads": (2**14, ""),
    "n_kv_heads": (2**14, ""),
    "ffn_dim": (2**20, ""),
    "max_seq_len": (2**24, ""),
    "norm_eps": (1.0, ""),
    "rope_theta": (1e12, ""),
    "init_std": (10.0, ""),
}


DOCUMENT_ATTENTION = ("auto", "dense", "flex")
"""model.document_attention's choices (see the field)."""


@dataclass
class ModelArgs:
    """Shape and init hyper-parameters; the fields are exactly the keys of a ``model:`` YAML section."""

    vocab_size: int = BYTE_VOCAB
    """Vocabulary size V. 258 = byte-level tokenizer: 256 bytes + BOS + EOS."""
    dim: int = 256
    """Model (residual stream) width D."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Number of query heads H; head dim is dim // n_heads and must be even (RoPE rotates pairs)."""
    n_kv_heads: int | None = None
    """Key/value heads K. None = n_heads (multi-head attention); fewer = grouped-query attention."""
    ffn_dim: int = 688
    """SwiGLU hidden size F, explicit (no multiple_of rounding)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    max_seq_len: int = 2048
    """Longest sequence the RoPE table covers; longer inputs are rejected."""
    tie_embeddings: bool = False
    """Share the output head's weight with the token embedding table."""
    init_std: float = 0.02
    """Std of the normal init; wo and w2 use init_std / sqrt(2 * n_layers) (depth-scaled residual init)."""
    document_attention: str = "auto"
    """How attention keeps to each document under ``data.document_mask``: ``flex`` (FlexAttention with a block mask:
    fully masked blocks are skipped, no (B, 1, S, S) tensor; compiled on a GPU), ``dense`` (SDPA with an additive
    mask: trains on every device), ``auto`` (flex on CUDA, dense elsewhere: FlexAttention has no backward on CPU).
    Both compute the same attention; no effect without document masking."""

    @property
    def head_dim(self) -> int:
        """Per-head width Hd = dim // n_heads."""
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Resolved number of key/value heads (n_kv_heads, or n_heads when it is None)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def problems(self) -> list[str]:
        """Every inconsistency in these args, each with how to fix it; empty when valid."""
        out: list[str] = []
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                out.append(f"model.{name}={value!r}: must be a positive integer")
        for name in ("norm_eps", "rope_theta", "init_std"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                out.append(f"model.{name}={value!r}: must be a positive number")
        if not isinstance(self.tie_embeddings, bool):
            out.append(f"model.tie_embeddings={self.tie_embeddings!r}: must be true or false")
        if self.document_attention not in DOCUMENT_ATTENTION:
            out.append(
                f"model.document_attention={self.document_attention!r}: must be one of {', '.join(DOCUMENT_ATTENTION)}"
            )
        if out:  # the divisibility checks below need sane integers
            return out
        if self.dim % self.n_heads:
            out.append(
                f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}: pick n_heads dividing dim"
            )
        elif self.head_dim % 2:
            out.append(f"head dim = dim // n_heads = {self.head_dim} is odd: RoPE needs an even head dim")
        kv = self.n_kv_heads
        if kv is not None and (not isinstance(kv, int) or isinstance(kv, bool) or kv <= 0):
            out.append(f"model.n_kv_heads={kv!r}: must be a positive integer or null (= n_heads)")
        elif self.n_heads % self.kv_heads:
            out.append(
                f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={kv}: "
                "each kv head must serve a whole group of query heads"
            )
        return out


# ----------------------------------------------------------------------------------------------------------------------
# Arithmetic
# ----------------------------------------------------------------------------------------------------------------------


def num_params(args: ModelArgs, *, exclude_embedding: bool = False) -> int:
    """Closed-form parameter count; equals ``sum(p.numel() for p in model.parameters())`` (tied counted once).

    ``exclude_embedding`` drops the input embedding table. With tied embeddings that table is also the output
    head, which does real matmul work, so it stays counted (as in nanoGPT's non-embedding count).
    """
    d, hd, kv = args.dim, args.head_dim, args.kv_heads
    attention = d * (args.n_heads * hd) + 2 * d * (kv * hd) + (args.n_heads * hd) * d  # wq, wk + wv, wo
    feed_forward = 3 * d * args.ffn_dim  # w1, w3, w2
    per_layer = attention + feed_forward + 2 * d  # + attention_norm, ffn_norm
    table = args.vocab_size * d
    total = args.n_layers * per_layer + d + table  # + final norm + output head
    if not args.tie_embeddings:
        total += table  # separate input embedding table
        if exclude_embedding:
            total -= table
    return total


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token, PaLM appendix B convention.

        6 * N + 12 * n_layers * dim * seq_len

    N counts every parameter that takes part in a matmul: all parameters except the input embedding table
    (a lookup, not a matmul); the output head counts (``num_params(args, exclude_embedding=True)``). The 6 is
    2 FLOPs per multiply-add times 3 (forward, backward w.r.t. activations, backward w.r.t. weights). The
    second term is attention's QK^T and AV matmuls, 2 * 2 * n_layers * seq_len * (n_heads * head_dim) in the
    forward, times 3; n_heads * head_dim = dim. It counts the full S x S score matrix even though the
    causal mask skips half of it, and it ignores GQA (scores are per query head). The norms' few elementwise
    FLOPs are included in N for simplicity. Used for MFU, so it must match what everyone else reports.
    """
    n = num_params(args, exclude_embedding=True)
    return 6.0 * n + 12.0 * args.n_layers * args.dim * seq_len


# ----------------------------------------------------------------------------------------------------------------------
# Presets (hpcdist/resources/models/*.yaml, shipped as package data)
# ----------------------------------------------------------------------------------------------------------------------


def preset_names() -> list[str]:
    """Names of the shipped YAML presets (hpcdist/resources/models/), sorted."""
    return resources.names("models")


def load_preset(name_or_path: str) -> dict[str, Any]:
    """Read a model preset: a name from ``preset_names()`` or a path to a YAML file of ModelArgs fields.

    Returns the dict of fields (only the keys the file sets). Raises ValueError for an unknown name, a
    missing file, a non-mapping document, or keys that are not ModelArgs fields (all of them listed).
    """
    names = preset_names()
    if name_or_path in names:
        path = resources.path("models", name_or_path)
    else:
        path = Path(name_or_path)
        if path.suffix not in (".yaml", ".yml") and not path.is_file():
            raise ValueError(
                f"unknown model preset {name_or_path!r}: choose one of {names} or give a path to a YAML file"
            )
        if not path.is_file():
            raise ValueError(f"model preset file {str(path)!r} does not exist (presets by name: {names})")
    data = safe_yaml.load_file(path)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of ModelArgs fields, got {type(data).__name__}")
    valid = [f.name for f in dataclasses.fields(ModelArgs)]
    unknown = sorted(str(k) for k in data if k not in valid)
    if unknown:
        raise ValueError(f"{path}: unknown model key(s) {unknown}; valid keys are {valid}")
    return dict(data)
