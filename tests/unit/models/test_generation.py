"""KV-cache decoding equals the full-sequence forward; sampling (greedy, temperature, top-k, top-p) is seeded and
restricted to what it promises. Tiny fp32 models on CPU, no training."""

from __future__ import annotations

import pytest
import torch

from hpcdist.models.args import ModelArgs
from hpcdist.models.generation import PromptTooLong, SamplingConfig, generate, sample_next
from hpcdist.models.llama import KVCache, Transformer, build_model

V = 97


def _model(
    *, n_kv_heads: int | None = 2, tie: bool = True, init_std: float = 0.3, max_seq_len: int = 64
) -> Transformer:
    # init_std 0.3 (not 0.02): logits far from uniform, so greedy decoding is not one token repeated
    torch.manual_seed(0)
    args = ModelArgs(
        vocab_size=V,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=n_kv_heads,
        ffn_dim=96,
        max_seq_len=max_seq_len,
        tie_embeddings=tie,
        init_std=init_std,
    )
    return build_model(args, device="cpu").eval()


@pytest.mark.parametrize(("kv", "tie"), [(2, True), (None, False)], ids=["gqa-tied", "mha-untied"])
@torch.no_grad()
def test_incremental_decoding_with_cache_equals_the_full_forward(kv: int | None, tie: bool) -> None:
    """Prefill of 7 tokens, a chunk of 5 at position 7 (the masked case), then one token at a time: the logits of
    every position equal the full-sequence forward's within 1e-5 (logits of a few units: init_std 0.1; the
    difference is fp32 summation order and grows with the logits' scale)."""
    model = _model(n_kv_heads=kv, tie=tie, init_std=0.1)
    if tie:
        assert model.output.weight is model.tok_embeddings.weight
    tokens = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(1))
    full = model(tokens)  # (2, 20, V)
    cache = KVCache(model.args, batch_size=2)
    parts = [model(tokens[:, :7], cache=cache, start_pos=0), model(tokens[:, 7:12], cache=cache, start_pos=7)]
    parts += [model(tokens[:, i : i + 1], cache=cache, start_pos=i) for i in range(12, 20)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-5)
    assert full.abs().max() > 0.1  # not a trivially tiny output
    # the cache holds K kv heads, not H (GQA keeps its memory saving)
    assert cache.layers["0"].k.shape == (2, 64, kv or 4, 16)


def test_greedy_generation_with_cache_equals_without() -> None:
    model = _model()
    with_cache = generate(model, [5, 17, 3], max_new_tokens=40)
    without = generate(model, [5, 17, 3], max_new_tokens=40, use_cache=False)
    assert with_cache.tokens == without.tokens and len(with_cache.tokens) == 40
    assert len(set(with_cache.tokens)) > 3  # a real sequence, not one token repeated


def test_sampling_is_reproducible_with_a_seed_and_top_k_1_is_greedy() -> None:
    model = _model(init_std=0.02)  # near-uniform logits: sampling spreads over many tokens
    hot = SamplingConfig(temperature=1.0)
    a = generate(model, [1, 2], max_new_tokens=20, sampling=hot, seed=7)
    b = generate(model, [1, 2], max_new_tokens=20, sampling=hot, seed=7, use_cache=False)
    c = generate(model, [1, 2], max_new_tokens=20, sampling=hot, seed=8)
    assert a.tokens == b.tokens and a.tokens != c.tokens
    top1 = generate(model, [1, 2], max_new_tokens=20, sampling=SamplingConfig(temperature=1.0, top_k=1), seed=7)
    assert top1.tokens == generate(model, [1, 2], max_new_tokens=20).tokens


def test_top_k_samples_only_the_k_most_likely() -> None:
    """Nearly flat logits: without top-k, 2000 draws hit dozens of tokens (so this setup can fail); with top_k=3
    only the three largest logits are ever drawn, and all three are."""
    logits = (torch.arange(50, dtype=torch.float32) * 0.01).expand(2000, 50)  # largest: 47, 48, 49
    g = torch.Generator().manual_seed(0)
    free = sample_next(logits, SamplingConfig(temperature=1.0), g)
    assert len(set(free.tolist())) > 20
    picked = sample_next(logits, SamplingConfig(temperature=1.0, top_k=3), g)
    assert set(picked.tolist()) == {47, 48, 49}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)
    logits = probs.log().expand(3000, 4)
    g = torch.Generator().manual_seed(0)
    assert set(sample_next(logits, SamplingConfig(temperature=1.0, top_p=0.75), g).tolist()) == {1, 3}
    assert set(sample_next(logits, SamplingConfig(temperature=1.0, top_p=0.4), g).tolist()) == {1}
    assert set(sample_next(logits, SamplingConfig(temperature=1.0), g).tolist()) == {0, 1, 2, 3}


def test_vocab_limit_eos_and_length() -> None:
    model = _model()
    with torch.no_grad():  # make the padding rows (>= 90) the most likely: greedy would pick them
        model.output.weight[90:] = model.tok_embeddings.weight[:7] * 50
    free = generate(model, [1, 2, 3], max_new_tokens=20)
    assert any(t >= 90 for t in free.tokens)
    limited = generate(model, [1, 2, 3], max_new_tokens=20, vocab_limit=90)
    assert limited.tokens and all(t < 90 for t in limited.tokens)
    stop_at = limited.tokens[3]
    eos = generate(model, [1, 2, 3], max_new_tokens=20, vocab_limit=90, eos_id=stop_at)
    assert eos.stop == "eos" and eos.tokens == limited.tokens[: limited.tokens.index(stop_at)]
    short = _model(max_seq_len=16)
    assert generate(short, list(range(10)), max_new_tokens=50).stop == "max_seq_len"
    assert len(generate(short, list(range(10)), max_new_tokens=50).tokens) == 6
    with pytest.raises(PromptTooLong, match=r"16 tokens; model.max_seq_len=16 .* at most 15 tokens"):
        generate(short, list(range(16)), max_new_tokens=1)


def test_sampling_config_problems() -> None:
    assert SamplingConfig(temperature=0.7, top_k=5, top_p=0.9).problems() == []
    bad = SamplingConfig(temperature=-1, top_k=-2, top_p=1.5).problems()
    assert [p.split(":")[0] for p in bad] == ["--temperature", "--top-k", "--top-p"]
