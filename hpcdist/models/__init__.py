"""Model definitions: the Llama-style transformer, its parameter/FLOP arithmetic and the YAML presets."""

from hpcdist.models.llama import (
    Attention,
    FeedForward,
    ModelArgs,
    RMSNorm,
    Transformer,
    TransformerBlock,
    apply_rope,
    build_model,
    flops_per_token,
    load_preset,
    num_params,
    precompute_rope,
    preset_names,
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
