"""Weight names and layouts between hpcdist's Llama and Hugging Face's ``LlamaForCausalLM``: pure functions.

Every weight maps by name, and all but two keep their values. ``wq`` and ``wk`` differ in row order: hpcdist
rotates interleaved pairs (rows 2i, 2i+1 of a head; Meta's original layout, :func:`hpcdist.models.llama.apply_rope`)
while transformers' ``rotate_half`` pairs row i with row i + head_dim/2. So to Hugging Face each head's even rows come
first, then its odd rows; back, the halves interleave again. ``wk`` has ``kv_heads`` heads (GQA).
A tied model (``tie_embeddings``) has no ``lm_head`` in Hugging Face's files (``tie_word_embeddings``).
The names and shapes themselves are :mod:`hpcdist.models.hf_config`'s (torch-free: the config checks need them).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hpcdist.models.args import ModelArgs
from hpcdist.models.hf_config import fqn_names, fqn_to_hf, hf_names, hf_shape, hf_to_fqn  # torch-free, re-exported

__all__ = [
    "fqn_names",
    "fqn_to_hf",
    "from_hf_state_dict",
    "from_hf_tensor",
    "hf_names",
    "hf_shape",
    "hf_to_fqn",
    "permute_from_hf",
    "permute_to_hf",
    "to_hf_state_dict",
    "to_hf_tensor",
]


def permute_to_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """(heads*Hd, D) rows in interleaved-pair order -> rotate-half order (each head: even rows, then odd rows)."""
    rows, dim = w.shape
    return w.reshape(heads, rows // heads // 2, 2, dim).transpose(1, 2).reshape(rows, dim)


def permute_from_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`permute_to_hf`."""
    rows, dim = w.shape
    return w.reshape(heads, 2, rows // heads // 2, dim).transpose(1, 2).reshape(rows, dim)


def _heads(fqn: str, args: ModelArgs) -> int | None:
    if fqn.endswith("attention.wq.weight"):
        return args.n_heads
    if fqn.endswith("attention.wk.weight"):
        return args.kv_heads
    return None


def to_hf_tensor(fqn: str, t: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """hpcdist's tensor ``fqn`` as Hugging Face stores it (a new contiguous tensor for wq / wk)."""
    heads = _heads(fqn, args)
    return permute_to_hf(t, heads) if heads is not None else t


def from_hf_tensor(fqn: str, t: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """Hugging Face's tensor for hpcdist's ``fqn`` in hpcdist's layout."""
    heads = _heads(fqn, args)
    return permute_from_hf(t, heads) if heads is not None else t


def to_hf_state_dict(state: Mapping[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """hpcdist FQN -> tensor (a full, unsharded model) into Hugging Face names and layouts. A tied model's
    ``output.weight`` (the embedding itself) is dropped."""
    return {fqn_to_hf(f): to_hf_tensor(f, state[f], args) for f in fqn_names(args)}


def from_hf_state_dict(state: Mapping[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Hugging Face names -> tensors into hpcdist FQNs and layouts (no ``output.weight`` for a tied model: call
    ``Transformer.tie_weights`` after loading). KeyError naming a missing tensor."""
    out = {}
    for fqn in fqn_names(args):
        name = fqn_to_hf(fqn)
        if name not in state:
            raise KeyError(f"{name}: missing from the Hugging Face weights")
        out[fqn] = from_hf_tensor(fqn, state[name], args)
    return out
