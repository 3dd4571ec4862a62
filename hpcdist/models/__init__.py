"""Model definitions: the Llama-style transformer, its parameter/FLOP arithmetic and the YAML presets.

``ModelArgs``, the arithmetic and the presets (:mod:`hpcdist.models.args`) are torch-free and imported eagerly;
the ``nn.Module`` names come from :mod:`hpcdist.models.llama` on first use, so that ``import hpcdist.models.args``
(config validation, the planner) does not import torch, the heavy dependency.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hpcdist.models.args import ModelArgs, flops_per_token, load_preset, num_params, preset_names

if TYPE_CHECKING:
    from hpcdist.models.llama import (
        Attention,
        FeedForward,
        RMSNorm,
        Transformer,
        TransformerBlock,
        apply_rope,
        build_model,
        precompute_rope,
    )

_TORCH_NAMES = frozenset(
    (
        "Attention",
        "FeedForward",
        "RMSNorm",
        "Transformer",
        "TransformerBlock",
        "apply_rope",
        "build_model",
        "precompute_rope",
    )
)

__all__ = [
    "Attention",
    "FeedForward",
    "ModelArgs",
    "RMSNorm",
    "Transformer",
    "TransformerBlock",
    "apply_rope",
    "build_model",
    "flops_per_token",
    "load_preset",
    "num_params",
    "precompute_rope",
    "preset_names",
]


def __getattr__(name: str) -> Any:
    # Lazy (torch): `from hpcdist.models import build_model` imports hpcdist.models.llama on first use.
    if name in _TORCH_NAMES:
        return getattr(importlib.import_module("hpcdist.models.llama"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
