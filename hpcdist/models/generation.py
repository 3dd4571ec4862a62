"""Autoregressive decoding for :class:`~hpcdist.models.llama.Transformer`: sampling and the generation loop.

With the KV cache (the default) the prompt runs once (prefill) and each new token costs one forward of one position
against the cached keys/values; without it every step re-runs the whole sequence (kept as the reference the cache is
tested and benchmarked against). Sampling draws from a seeded ``torch.Generator`` only, so a seed reproduces a text.
A prompt is one document: a model trained with ``data.document_mask`` attends over all of it causally, EOS or not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hpcdist.models.llama import KVCache, Transformer

__all__ = ["GenerationResult", "PromptTooLong", "SamplingConfig", "generate", "sample_next"]


class PromptTooLong(ValueError):
    """The prompt leaves no room for a new token within model.max_seq_len."""


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is picked from the logits. temperature 0 = greedy (argmax; top_k / top_p unused)."""

    temperature: float = 0.0
    top_k: int | None = None
    """Sample only among the k most likely tokens (None or 0: all)."""
    top_p: float | None = None
    """Nucleus: sample among the fewest most likely tokens whose probabilities sum to >= top_p (None or 1: all)."""

    def problems(self) -> list[str]:
        out = []
        if not self.temperature >= 0:  # `not >=`: NaN too
            out.append(f"--temperature: must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            out.append(f"--top-k: must be >= 0 (0 = off), got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            out.append(f"--top-p: must be in (0, 1] (1 = off), got {self.top_p}")
        return out


@dataclass
class GenerationResult:
    tokens: list[int]
    """The new tokens (the EOS that stopped generation is not included)."""
    stop: str
    """eos | max_new_tokens | max_seq_len"""


def sample_next(
    logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Next token ids (B,) from last-position logits (B, V)."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / sampling.temperature
    if sampling.top_k:
        k = min(sampling.top_k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (B, 1): the k-th largest logit
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p is not None and sampling.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the more likely ones before it already reach top_p (the most likely always stays)
        drop_sorted = probs.cumsum(dim=-1) - probs >= sampling.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: Sequence[int],
    *,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    eos_id: int | None = None,
    vocab_limit: int | None = None,
    seed: int = 0,
    use_cache: bool = True,
) -> GenerationResult:
    """Continue ``prompt`` (token ids) by up to ``max_new_tokens`` tokens, stopping at ``eos_id`` or at the model's
    max_seq_len. ``vocab_limit``: ids >= it are never produced (model.vocab_size: auto pads the table past the
    tokenizer's vocabulary; those rows were never a target). Raises PromptTooLong when the prompt fills the context.
    """
    max_len = model.args.max_seq_len
    if not prompt:
        raise ValueError("the prompt encodes to no tokens; give some text")
    if len(prompt) >= max_len:
        raise PromptTooLong(
            f"the prompt is {len(prompt)} tokens; model.max_seq_len={max_len} leaves no room for a new token: "
            f"shorten it to at most {max_len - 1} tokens"
        )
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    seq = torch.tensor([list(prompt)], dtype=torch.long, device=device)  # (1, P)
    budget = min(max_new_tokens, max_len - len(prompt))
    cache = (
        KVCache(model.args, 1, max_seq_len=len(prompt) + budget, dtype=next(model.parameters()).dtype, device=device)
        if use_cache
        else None
    )
    out: list[int] = []
    start, step_input = 0, seq
    for _ in range(budget):
        if cache is not None:
            logits = model(step_input, cache=cache, start_pos=start)[:, -1]  # (1, V)
            start += step_input.shape[1]
        else:
            # the whole sequence again; a prompt is one document even if it holds an EOS (as the cached path, which
            # never masks): a model trained with data.document_mask gets one document id for all of it
            one_doc = torch.zeros_like(seq) if model.document_eos is not None else None
            logits = model(seq, doc_ids=one_doc)[:, -1]
        if vocab_limit is not None and vocab_limit < logits.shape[-1]:
            logits[:, vocab_limit:] = float("-inf")
        token = sample_next(logits, sampling, generator)  # (1,)
        if eos_id is not None and int(token) == eos_id:
            return GenerationResult(out, "eos")
        out.append(int(token))
        step_input = token[:, None]  # (1, 1)
        if cache is None:
            seq = torch.cat([seq, step_input], dim=1)
    return GenerationResult(out, "max_new_tokens" if budget == max_new_tokens else "max_seq_len")
