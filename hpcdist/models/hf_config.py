"""Torch-free mapping between :class:`ModelArgs` and a Hugging Face Llama ``config.json``.

The config checks (``checkpoint.init_from`` naming a Hugging Face directory), the export and the import all need it,
and the config layer may not load torch: so it lives here, beside ``ModelArgs``. The weights' conversion is in
:mod:`hpcdist.hf.convert`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hpcdist.models.args import MODEL_MAXIMA, ModelArgs

__all__ = [
    "CONFIG_NAME",
    "HFConfigError",
    "fqn_names",
    "fqn_to_hf",
    "hf_config",
    "hf_names",
    "hf_shape",
    "hf_to_fqn",
    "is_hf_dir",
    "model_args_from_hf",
    "shape_mismatch",
]

CONFIG_NAME = "config.json"
# ModelArgs field -> LlamaConfig key, for every field that fixes the weights' shapes or the forward's numbers
FIELD_TO_HF = {
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "ffn_dim": "intermediate_size",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "max_seq_len": "max_position_embeddings",
    "tie_embeddings": "tie_word_embeddings",
}


# ---------------------------------------------------------------------------------------------- weight names
# The names and shapes of the weights, torch-free (the directory checks at config load need them); the tensors'
# layouts are hpcdist.hf.convert's.
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
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
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
    return {
        "attention.wq.weight": (q, d),
        "attention.wk.weight": (kv, d),
        "attention.wv.weight": (kv, d),
        "attention.wo.weight": (d, q),
        "feed_forward.w1.weight": (args.ffn_dim, d),
        "feed_forward.w3.weight": (args.ffn_dim, d),
        "feed_forward.w2.weight": (d, args.ffn_dim),
    }[name]


def hf_names(args: ModelArgs) -> list[str]:
    """The Hugging Face tensor names of a model of ``args``, in file order."""
    return [fqn_to_hf(f) for f in fqn_names(args)]


class HFConfigError(ValueError):
    """A directory that is not a Hugging Face Llama this model can be (one line: what is wrong and the fix)."""


def is_hf_dir(path: str | Path) -> bool:
    """A Hugging Face model directory (it holds an entry named config.json), as opposed to a hpcdist step-XXXXXXXX
    checkpoint. Any entry counts (a FIFO, a link, a directory): :func:`hpcdist.models.hf_directory.open_hf_dir` then
    says what is wrong with it, instead of a checkpoint's error about a directory that is plainly not one."""
    return os.path.lexists(Path(path) / CONFIG_NAME)


def hf_config(args: ModelArgs, *, torch_dtype: str, bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
    """The ``config.json`` of a ``LlamaForCausalLM`` equal to a hpcdist model of ``args``."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": args.tie_embeddings,
        "initializer_range": args.init_std,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "torch_dtype": torch_dtype,
        "use_cache": True,
    }


def _where(where: str, key: str, value: Any) -> str:
    shown = f"a {type(value).__name__}" if isinstance(value, (dict, list)) else repr(value)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        shown = f"an integer of {len(str(abs(value)))} digits"
    return f"{where}: {key}={shown}"


def _integer(
    data: dict[str, Any], key: str, field: str, *, where: str, default: int | None = None, nullable: bool = False
) -> int | None:
    """config.json's ``key`` as a positive int no larger than ModelArgs' ``field`` allows (a float, a bool or a
    string is refused: ``hidden_size: 32.0`` is a hand-edited file, not a Llama)."""
    value = data.get(key)
    if value is None:  # absent or null
        if nullable or default is not None:
            return default
        raise HFConfigError(f"{where}: {key} is missing: a Llama config.json names it")
    if not isinstance(value, int) or isinstance(value, bool):
        raise HFConfigError(f"{_where(where, key, value)}: must be an integer")
    top, why = MODEL_MAXIMA[field]
    if not 1 <= value <= top:
        limit = f"at least 1 and at most {int(top):,}{f' ({why})' if why else ''}"
        raise HFConfigError(f"{_where(where, key, value)}: must be {limit}")
    return value


def _bounded_number(data: dict[str, Any], key: str, field: str, *, where: str, default: float) -> float:
    """config.json's ``key`` as a finite positive float no larger than ModelArgs' ``field`` allows."""
    value = data.get(key, default)
    if value is None:
        value = default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise HFConfigError(f"{_where(where, key, value)}: must be a number")
    top, _ = MODEL_MAXIMA[field]
    if not (math.isfinite(value) and 0 < value <= top):  # NaN fails every comparison: refused too
        raise HFConfigError(f"{_where(where, key, value)}: must be a finite number above 0 and at most {top:g}")
    return float(value)


def _boolean(data: dict[str, Any], key: str, *, where: str) -> bool:
    """``true`` / ``false`` only: ``"false"`` (a string) used to read as true."""
    value = data.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise HFConfigError(f"{_where(where, key, value)}: must be true or false (JSON booleans, not text)")
    return value


def _rope_type(data: dict[str, Any], *, where: str) -> tuple[str, dict[str, Any]]:
    """(RoPE type, the rope_parameters mapping) from ``rope_scaling`` (transformers 4) or ``rope_parameters``
    (transformers 5); each must be null or a mapping."""
    found: dict[str, dict[str, Any]] = {}
    for key in ("rope_scaling", "rope_parameters"):
        value = data.get(key)
        if value is None:
            found[key] = {}
        elif isinstance(value, dict):
            found[key] = value
        else:
            raise HFConfigError(f"{_where(where, key, value)}: must be null or a mapping (rope_type, ...)")
    for key, value in found.items():
        kind = value.get("rope_type", value.get("type", "default"))
        if kind is None:
            kind = "default"
        if not isinstance(kind, str):
            raise HFConfigError(f"{_where(where, f'{key}.rope_type', kind)}: must be a name such as 'default'")
        if kind != "default":
            raise HFConfigError(
                f"{where}: {key}.rope_type={kind!r}: hpcdist's Llama has no RoPE scaling "
                f"({kind}); it cannot load this model"
            )
    return "default", found["rope_parameters"]


def model_args_from_hf(data: Any, *, where: str = CONFIG_NAME) -> ModelArgs:
    """The ModelArgs of a Llama config.json, every key it reads checked like the YAML's model section: its type
    (integers are JSON integers, booleans JSON booleans, mappings mappings), its range and ModelArgs' maxima
    (MODEL_MAXIMA), finite numbers. HFConfigError naming the first bad key, or the first one hpcdist's Llama cannot
    represent (biases, RoPE scaling, another activation or head size)."""
    if not isinstance(data, dict):
        raise HFConfigError(f"{where}: expected a JSON object, got {type(data).__name__}")
    if data.get("model_type") != "llama":
        shown = data.get("model_type") if isinstance(data.get("model_type"), (str, type(None))) else "not a name"
        raise HFConfigError(
            f"{where}: model_type is {shown!r}, not 'llama': only Llama models (LlamaForCausalLM) "
            "convert to and from hpcdist"
        )
    for key, what in (("attention_bias", "biases in the attention projections"), ("mlp_bias", "biases in the MLP")):
        if _boolean(data, key, where=where):
            raise HFConfigError(f"{where}: {key}=true: hpcdist's Llama has no {what}; it cannot load this model")
    act = data.get("hidden_act", "silu")
    if act != "silu":
        raise HFConfigError(
            f"{_where(where, 'hidden_act', act)}: hpcdist's Llama has no other activation than "
            "SwiGLU (silu); it cannot load this model"
        )
    _, rope = _rope_type(data, where=where)
    vocab = _integer(data, "vocab_size", "vocab_size", where=where)
    dim = _integer(data, "hidden_size", "dim", where=where)
    layers = _integer(data, "num_hidden_layers", "n_layers", where=where)
    heads = _integer(data, "num_attention_heads", "n_heads", where=where)
    ffn = _integer(data, "intermediate_size", "ffn_dim", where=where)
    kv = _integer(data, "num_key_value_heads", "n_kv_heads", where=where, nullable=True) or heads
    head_dim = _integer(data, "head_dim", "dim", where=where, nullable=True)
    max_pos = _integer(data, "max_position_embeddings", "max_seq_len", where=where, default=2048)
    assert vocab and dim and layers and heads and ffn and kv and max_pos  # checked positive above (for mypy)
    if head_dim is not None and head_dim * heads != dim:
        raise HFConfigError(
            f"{where}: head_dim={head_dim} x num_attention_heads={heads} != hidden_size={dim}: "
            "hpcdist's Llama needs head_dim = hidden_size / heads"
        )
    theta_from = data if data.get("rope_theta") is not None else rope  # transformers 5 moved it into rope_parameters
    args = ModelArgs(
        vocab_size=vocab,
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=None if kv == heads else kv,
        ffn_dim=ffn,
        norm_eps=_bounded_number(data, "rms_norm_eps", "norm_eps", where=where, default=1e-6),
        rope_theta=_bounded_number(theta_from, "rope_theta", "rope_theta", where=where, default=10000.0),
        max_seq_len=max_pos,
        tie_embeddings=_boolean(data, "tie_word_embeddings", where=where),
        init_std=_bounded_number(data, "initializer_range", "init_std", where=where, default=0.02),
    )
    problems = args.problems()
    if problems:
        raise HFConfigError(f"{where}: {problems[0]}")
    return args


def shape_mismatch(model: ModelArgs, hf: ModelArgs, *, where: str) -> str | None:
    """One line naming the first model key whose value differs from the Hugging Face config's, or None.

    ``n_kv_heads`` compares resolved (null = n_heads); the init std is not part of the model's function."""
    for field, key in FIELD_TO_HF.items():
        mine, theirs = getattr(model, field), getattr(hf, field)
        if field == "n_kv_heads":
            mine, theirs = model.kv_heads, hf.kv_heads
        if mine != theirs and not (
            isinstance(mine, float)
            and isinstance(theirs, float)
            and abs(mine - theirs) <= 1e-12 * max(abs(mine), abs(theirs))
        ):
            return (
                f"model.{field}={mine!r} but {where} has {key}={theirs!r}: set model.{field}={theirs!r} (the model "
                "section must match the Hugging Face config it starts from)"
            )
    return None
