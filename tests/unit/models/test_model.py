"""Unit tests for hpcdist.models.llama: shapes, counts, init, causality, GQA, pipeline stages, presets."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hpcdist.models import (
    ModelArgs,
    Transformer,
    apply_rope,
    build_model,
    flops_per_token,
    load_preset,
    num_params,
    precompute_rope,
    preset_names,
)

# Published parameter counts: GPT-3 size classes (nominal) and the Llama-2 HF configs (exact).
PUBLISHED = {
    "125m": 125_000_000,
    "350m": 350_000_000,
    "1.3b": 1_300_000_000,
    "7b": 6_738_415_616,
    "13b": 13_015_864_320,
    "70b": 68_976_648_192,
}
ALL_PRESETS = ["tiny", *PUBLISHED]


def tiny_args(**overrides: object) -> ModelArgs:
    return dataclasses.replace(ModelArgs(**load_preset("tiny")), **overrides)


def unique_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a shared tensor once


def test_preset_files_match_names() -> None:
    assert sorted(preset_names()) == sorted(ALL_PRESETS)


@pytest.mark.parametrize("name", ALL_PRESETS)
def test_preset_param_count(name: str) -> None:
    args = ModelArgs(**load_preset(name))
    model = build_model(args)  # meta: no memory, even for 70b
    assert all(p.is_meta for p in model.parameters())
    assert unique_numel(model) == num_params(args)
    if name in PUBLISHED:
        published = PUBLISHED[name]
        assert abs(num_params(args) - published) / published < 0.02, (name, num_params(args), published)
    else:
        assert 1_000_000 <= num_params(args) <= 3_000_000
        assert args.vocab_size == 258 and args.kv_heads < args.n_heads  # byte vocab, GQA exercised


# (dim, n_layers, n_heads, n_kv_heads resolved, ffn_dim) from the Llama-2 HF configs.
LLAMA2_SHAPES = {"7b": (4096, 32, 32, 32, 11008), "13b": (5120, 40, 40, 40, 13824), "70b": (8192, 80, 64, 8, 28672)}


@pytest.mark.parametrize("name", sorted(LLAMA2_SHAPES))
def test_llama2_presets_exact_shapes(name: str) -> None:
    args = ModelArgs(**load_preset(name))
    assert (args.dim, args.n_layers, args.n_heads, args.kv_heads, args.ffn_dim) == LLAMA2_SHAPES[name]
    assert (args.vocab_size, args.tie_embeddings, args.rope_theta, args.max_seq_len) == (32000, False, 10000.0, 4096)
    assert num_params(args) == PUBLISHED[name]  # the Llama-2 shapes reproduce the HF counts exactly


def test_num_params_tied_and_excluding_embedding() -> None:
    args = tiny_args(tie_embeddings=True)
    model = build_model(args)
    assert model.output is not None and model.tok_embeddings is not None
    assert model.output.weight is model.tok_embeddings.weight
    assert unique_numel(model) == num_params(args)
    untied = tiny_args()
    table = untied.vocab_size * untied.dim
    assert num_params(untied) - num_params(args) == table
    assert num_params(untied, exclude_embedding=True) == num_params(untied) - table
    # A tied table is also the output head: it stays in the non-embedding count.
    assert num_params(args, exclude_embedding=True) == num_params(args)


def test_flops_per_token_hand_computed() -> None:
    args = ModelArgs(vocab_size=100, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=32)
    # head_dim 8. Per layer: wq 16*16=256, wk 16*8=128, wv 128, wo 256, SwiGLU 3*16*32=1536, 2 norms 32 -> 2336.
    # N = 2 layers * 2336 + final norm 16 + output head 16*100=1600 = 6288 (input table excluded).
    # Attention: 12 * n_layers 2 * dim 16 * seq 8 = 3072.
    assert num_params(args, exclude_embedding=True) == 6288
    assert flops_per_token(args, seq_len=8) == 6 * 6288 + 3072 == 40800


def test_forward_shape_and_dtype() -> None:
    torch.manual_seed(0)
    args = tiny_args()
    model = build_model(args, "cpu")
    tokens = torch.randint(0, args.vocab_size, (3, 17))
    logits = model(tokens)
    assert logits.shape == (3, 17, args.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_forward_rejects_too_long_sequence() -> None:
    args = tiny_args(max_seq_len=8)
    model = build_model(args, "cpu")
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_invalid_args_report_every_problem() -> None:
    with pytest.raises(ValueError) as err:
        Transformer(ModelArgs(dim=250, n_heads=4, n_kv_heads=3))
    message = str(err.value)
    assert "n_heads" in message and "divisible" in message and "n_kv_heads=3" in message


def test_causality() -> None:
    torch.manual_seed(0)
    args = tiny_args()
    model = build_model(args, "cpu")
    tokens = torch.randint(0, args.vocab_size, (2, 12))
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % args.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :-1], b[:, :-1], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, -1], b[:, -1])  # the changed position itself does see the change


def test_gqa_equals_mha_with_repeated_kv_heads() -> None:
    torch.manual_seed(0)
    gqa_args = tiny_args()  # 8 query heads, 2 kv heads
    n_rep = gqa_args.n_heads // gqa_args.kv_heads
    assert n_rep > 1
    gqa = build_model(gqa_args, "cpu")
    mha = build_model(dataclasses.replace(gqa_args, n_kv_heads=None), "cpu")
    state = gqa.state_dict()
    for key, value in state.items():
        if key.endswith(("attention.wk.weight", "attention.wv.weight")):
            # (K*Hd, D) -> (K, Hd, D) -> each kv head copied for its n_rep query heads -> (H*Hd, D)
            heads = value.view(gqa_args.kv_heads, gqa_args.head_dim, gqa_args.dim)
            state[key] = heads.repeat_interleave(n_rep, dim=0).reshape(-1, gqa_args.dim)
    mha.load_state_dict(state)
    tokens = torch.randint(0, gqa_args.vocab_size, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(gqa(tokens), mha(tokens), rtol=1e-5, atol=1e-5)


def test_rope_is_relative() -> None:
    # <rope(q, m), rope(k, n)> depends only on m - n, and RoPE preserves norms.
    torch.manual_seed(0)
    head_dim = 16
    rope = precompute_rope(head_dim, 32, 10000.0)  # (32, 8, 2)
    q, k = torch.randn(head_dim), torch.randn(head_dim)

    def at(x: torch.Tensor, pos: int) -> torch.Tensor:
        return apply_rope(x.view(1, 1, 1, head_dim), rope[pos : pos + 1]).view(head_dim)

    torch.testing.assert_close(at(q, 7) @ at(k, 3), at(q, 20) @ at(k, 16))
    torch.testing.assert_close(at(q, 9).norm(), q.norm())
    assert not torch.allclose(at(q, 7) @ at(k, 3), at(q, 7) @ at(k, 5))


def test_tied_embeddings_share_storage_after_to_empty() -> None:
    args = tiny_args(tie_embeddings=True)
    model = build_model(args)  # meta
    model.to_empty(device="cpu")
    model.tie_weights()
    model.init_weights()
    assert model.output is not None and model.tok_embeddings is not None
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    with torch.no_grad():
        model.tok_embeddings.weight[0, 0] = 123.0
    assert model.output.weight[0, 0].item() == 123.0
    # The tied matrix keeps the embedding init (std init_std), not overwritten by the head init.
    assert abs(model.tok_embeddings.weight[1:].std().item() - args.init_std) < 0.002
    assert unique_numel(model) == num_params(args)


def test_init_weights_deterministic_and_depth_scaled() -> None:
    args = tiny_args()
    torch.manual_seed(1)
    a = build_model(args, "cpu")
    torch.manual_seed(1)
    b = build_model(args, "cpu")
    torch.manual_seed(2)
    c = build_model(args, "cpu")
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.layers["0"].attention.wq.weight, c.layers["0"].attention.wq.weight)

    layer = a.layers["0"]
    out_std = args.init_std / math.sqrt(2 * args.n_layers)
    assert abs(layer.attention.wq.weight.std().item() - args.init_std) < 0.1 * args.init_std
    assert abs(layer.feed_forward.w2.weight.std().item() - out_std) < 0.1 * out_std
    assert abs(layer.attention.wo.weight.std().item() - out_std) < 0.1 * out_std
    assert layer.attention.wq.weight.abs().max().item() <= 3 * args.init_std  # truncated at 3 std
    assert torch.equal(layer.ffn_norm.weight, torch.ones(args.dim))
    assert a.norm is not None and torch.equal(a.norm.weight, torch.ones(args.dim))

    # Re-initializing restores the same values under the same seed.
    with torch.no_grad():
        for p in a.parameters():
            p.zero_()
    torch.manual_seed(1)
    a.init_weights()
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name


def test_meta_to_empty_init_matches_cpu_build() -> None:
    args = tiny_args()
    torch.manual_seed(0)
    direct = build_model(args, "cpu")
    with torch.device("meta"):
        model = Transformer(args)
    assert model.rope_cache.is_meta
    model.to_empty(device="cpu")
    model.tie_weights()
    torch.manual_seed(0)
    model.init_weights()
    for (name, expected), actual in zip(direct.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(expected, actual), name
    # The RoPE buffer is recomputed (to_empty left garbage) and never enters a checkpoint.
    torch.testing.assert_close(model.rope_cache, direct.rope_cache, rtol=0, atol=0)
    torch.testing.assert_close(model.rope_cache, precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta))
    assert not any("rope" in key for key in model.state_dict())
    tokens = torch.randint(0, args.vocab_size, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), direct(tokens), rtol=0, atol=0)


def test_pipeline_stages_compose_to_full_model() -> None:
    torch.manual_seed(0)
    args = tiny_args()
    full = build_model(args, "cpu")
    split = args.n_layers // 2

    first = copy.deepcopy(full)  # tok_embeddings + layers 0..split-1
    for i in range(split, args.n_layers):
        del first.layers[str(i)]
    first.norm = None
    first.output = None

    last = copy.deepcopy(full)  # layers split..n-1 + norm + output, fed hidden states
    for i in range(split):
        del last.layers[str(i)]
    last.tok_embeddings = None
    last.init_weights()  # must tolerate missing parts (values change; reload below)
    last.load_state_dict(full.state_dict(), strict=False)

    assert list(last.layers.keys()) == [str(i) for i in range(split, args.n_layers)]  # FQNs kept
    assert "layers.0.attention.wq.weight" not in last.state_dict()
    tokens = torch.randint(0, args.vocab_size, (2, 9))
    with torch.no_grad():
        hidden = first(tokens)
        assert hidden.shape == (2, 9, args.dim)
        torch.testing.assert_close(last(hidden), full(tokens))


def test_loss_decreases_with_adamw() -> None:
    torch.manual_seed(0)
    args = tiny_args()
    model = build_model(args, "cpu")
    batch = torch.randint(0, args.vocab_size, (4, 33))
    inputs, targets = batch[:, :-1], batch[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)

    def loss_fn() -> torch.Tensor:
        logits = model(inputs)
        return F.cross_entropy(logits.reshape(-1, args.vocab_size), targets.reshape(-1))

    first = loss_fn()
    # Small init: near-uniform predictions, loss close to ln(V).
    assert abs(first.item() - math.log(args.vocab_size)) < 0.3
    loss = first
    for _ in range(8):
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss = loss_fn()
    assert loss.item() < first.item() - 0.5, (first.item(), loss.item())


def test_load_preset_errors_and_paths(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tiny"):  # the message lists the available presets
        load_preset("does-not-exist")
    with pytest.raises(ValueError, match="does not exist"):
        load_preset(str(tmp_path / "missing.yaml"))

    custom = tmp_path / "custom.yaml"
    custom.write_text("dim: 64\nn_heads: 2\nn_layers: 1\n")
    assert load_preset(str(custom)) == {"dim": 64, "n_heads": 2, "n_layers": 1}

    bad = tmp_path / "bad.yaml"
    bad.write_text("dim: 64\nhidden: 3\nheads: 2\n")
    with pytest.raises(ValueError, match=r"\['heads', 'hidden'\]") as err:
        load_preset(str(bad))
    assert "ffn_dim" in str(err.value)  # valid keys are listed
