"""Torch-free mapping between :class:`ModelArgs` and a Hugging Face Llama ``config.json``.

The config checks (``checkpoint.init_from`` naming a Hugging Face directory), the export and the import all need it,
and the config layer may not load torch: so it lives here, beside ``ModelArgs``. The weights' conversion is in
:mod:`hpcdist.hf.convert`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpcdist.models.args import ModelArgs

__all__ = ["CONFIG_NAME", "HFConfigError", "hf_config", "is_hf_dir", "model_args_from_hf", "read_hf_config",
           "shape_mismatch"]  # fmt: skip

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


class HFConfigError(ValueError):
    """A directory that is not a Hugging Face Llama this model can be (one line: what is wrong and the fix)."""


def is_hf_dir(path: str | Path) -> bool:
    """A Hugging Face model directory (it holds config.json), as opposed to a hpcdist step-XXXXXXXX checkpoint."""
    return (Path(path) / CONFIG_NAME).is_file()


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


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """config.json of the directory ``path``; HFConfigError when there is none or it is not a Llama."""
    file = Path(path) / CONFIG_NAME
    if not file.is_file():
        raise HFConfigError(f"{path}: no {CONFIG_NAME}: not a Hugging Face model directory")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise HFConfigError(f"{file}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise HFConfigError(f"{file}: expected a JSON object, got {type(data).__name__}")
    if data.get("model_type") != "llama":
        raise HFConfigError(f"{file}: model_type is {data.get('model_type')!r}, not 'llama': only Llama models "
                            "(LlamaForCausalLM) convert to and from hpcdist")  # fmt: skip
    return data


def model_args_from_hf(data: dict[str, Any], *, where: str = CONFIG_NAME) -> ModelArgs:
    """The ModelArgs of a Llama config.json (as read by :func:`read_hf_config`); HFConfigError naming the first key
    hpcdist's Llama cannot represent (biases, RoPE scaling, another activation or head size)."""
    rope = data.get("rope_parameters") or {}  # transformers 5 writes rope_type + rope_theta here
    rope_type = (data.get("rope_scaling") or {}).get("rope_type") or rope.get("rope_type") or "default"
    problems = [
        ("attention_bias", "biases in the attention projections") if data.get("attention_bias") else None,
        ("mlp_bias", "biases in the MLP") if data.get("mlp_bias") else None,
        ("hidden_act", "other activation than SwiGLU") if data.get("hidden_act", "silu") != "silu" else None,
        ("rope_scaling", f"RoPE scaling ({rope_type})") if rope_type != "default" else None,
    ]
    for key, what in filter(None, problems):
        raise HFConfigError(f"{where}: {key}={data.get(key, rope)!r}: hpcdist's Llama has no {what}; it cannot "
                            "load this model")  # fmt: skip
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if not isinstance(data.get(k), int)]  # fmt: skip
    if missing:
        raise HFConfigError(f"{where}: missing or non-integer {', '.join(missing)}")
    heads = data["num_attention_heads"]
    head_dim = data.get("head_dim") or data["hidden_size"] // heads
    if head_dim * heads != data["hidden_size"]:
        raise HFConfigError(f"{where}: head_dim={head_dim} x num_attention_heads={heads} != hidden_size="
                            f"{data['hidden_size']}: hpcdist's Llama needs head_dim = hidden_size / heads")  # fmt: skip
    kv = data.get("num_key_value_heads") or heads
    args = ModelArgs(
        vocab_size=data["vocab_size"],
        dim=data["hidden_size"],
        n_layers=data["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=None if kv == heads else kv,
        ffn_dim=data["intermediate_size"],
        norm_eps=float(data.get("rms_norm_eps", 1e-6)),
        rope_theta=float(data.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        max_seq_len=int(data.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(data.get("tie_word_embeddings", False)),
        init_std=float(data.get("initializer_range", 0.02)),
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
        if mine != theirs and not (isinstance(mine, float) and isinstance(theirs, float) and
                                   abs(mine - theirs) <= 1e-12 * max(abs(mine), abs(theirs))):  # fmt: skip
            return (f"model.{field}={mine!r} but {where} has {key}={theirs!r}: set model.{field}={theirs!r} (the model "
                    "section must match the Hugging Face config it starts from)")  # fmt: skip
    return None
