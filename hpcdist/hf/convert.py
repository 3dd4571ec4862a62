"""Weight names and layouts between hpcdist's Llama and Hugging Face's ``LlamaForCausalLM``: pure functions.

Every weight maps by name, and all but two keep their values. ``wq`` and ``wk`` differ in row order: hpcdist
rotates interleaved pairs (rows 2i, 2i+1 of a head; Meta's original layout, :func:`hpcdist.models.llama.apply_rope`)
while transformers' ``rotate_half`` pairs row i with row i + head_dim/2. So to Hugging Face each head's even rows come
first, then its odd rows; back, the halves interleave again. ``wk`` has ``kv_heads`` heads (GQA).
A tied model (``tie_embeddings``) has no ``lm_head`` in Hugging Face's files (``tie_word_embeddings``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from hpcdist.models.args import ModelArgs

if TYPE_CHECKING:  # torch-free at run time: the names and shapes are what the config checks need
    import torch

__all__ = [
    "from_hf_state_dict",
    "from_hf_tensor",
    "hf_names",
    "hf_shape",
    "hf_to_fqn",
    "permute_from_hf",
    "permute_to_hf",
    "to_hf_state_dict",
    "to_hf_tensor",
]  # fmt: skip

# hpcdist layer-relative name -> Hugging Face layer-relative name
_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_LAYER_BACK = {v: k for k, v in _LAYER.items()}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}  # fmt: skip
_TOP_BACK = {v: k for k, v in _TOP.items()}
_OURS = re.compile(r"^layers\.(\d+)\.(.+)$")
_THEIRS = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def fqn_names(args: ModelArgs) -> Iterator[str]:
    """hpcdist's parameter FQNs in Hugging Face's file order (embeddings, layers by index, norm, head); a tied
    model has no separate head."""
    yield "tok_embeddings.weight"
    for i in range(args.n_layers):
        for name in _LAYER:
            yield f"layers.{i}.{name}"
    yield "norm.weight"
    if not args.tie_embeddings:
        yield "output.weight"


def fqn_to_hf(fqn: str) -> str:
    if fqn in _TOP:
        return _TOP[fqn]
    m = _OURS.match(fqn)
    if m is None or m.group(2) not in _LAYER:
        raise KeyError(f"{fqn}: not a weight of hpcdist's Llama")
    return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"


def hf_to_fqn(name: str) -> str:
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    m = _THEIRS.match(name)
    if m is None or m.group(2) not in _LAYER_BACK:
        raise KeyError(f"{name}: not a weight of a Hugging Face Llama")
    return f"layers.{m.group(1)}.{_LAYER_BACK[m.group(2)]}"


def hf_shape(fqn: str, args: ModelArgs) -> tuple[int, ...]:
    """The shape hpcdist's ``fqn`` has, and so the Hugging Face tensor of that name must have, for ``args``."""
    d, q, kv = args.dim, args.n_heads * args.head_dim, args.kv_heads * args.head_dim
    if fqn in ("tok_embeddings.weight", "output.weight"):
        return (args.vocab_size, d)
    if fqn == "norm.weight" or fqn.endswith("_norm.weight"):
        return (d,)
    name = fqn.split(".", 2)[2]
    return {"attention.wq.weight": (q, d), "attention.wk.weight": (kv, d), "attention.wv.weight": (kv, d),
            "attention.wo.weight": (d, q), "feed_forward.w1.weight": (args.ffn_dim, d),
            "feed_forward.w3.weight": (args.ffn_dim, d), "feed_forward.w2.weight": (d, args.ffn_dim)}[name]  # fmt: skip


def hf_names(args: ModelArgs) -> list[str]:
    """The Hugging Face tensor names of a model of ``args``, in file order."""
    return [fqn_to_hf(f) for f in fqn_names(args)]


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
