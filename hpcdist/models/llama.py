"""Llama-style decoder-only transformer: RMSNorm, RoPE, grouped-query attention, SwiGLU.

One file on purpose (house style): the whole model. Its hyper-parameters (:class:`ModelArgs`), their
parameter/FLOP arithmetic and the preset loader are torch-free, in :mod:`hpcdist.models.args`.

Shape legend used in the comments:
    B  batch size              S  sequence length         D  model dim (``dim``)
    H  query heads (local)     K  key/value heads (local) Hd head dim (D // n_heads)
    F  SwiGLU hidden size      V  vocabulary size

"Local" heads: under tensor parallelism wq/wk/wv are column-sharded, so a rank sees H / tp query heads
and K / tp kv heads. Attention therefore derives its head counts from the projected tensors' shapes at
forward time (``view(B, S, -1, Hd)``) and never from ``ModelArgs``; TP needs no change in this file.

Pipeline stages keep FQNs: ``layers`` is a ModuleDict keyed "0".."n-1", and ``tok_embeddings``, ``norm``
and ``output`` may be set to None; forward skips whatever is missing.

Inference: ``forward(tokens, cache=KVCache(...), start_pos=p)`` runs tokens at positions p.. against the keys and
values cached for positions < p (and appends theirs). Training never passes a cache and runs the same code as
before it existed (plain causal SDPA over the whole sequence).

Document masking (``data.document_mask``; the trainer sets ``Transformer.document_eos`` to the data's EOS id): a
packed training sequence holds several documents, each ending with EOS. With ``document_eos`` set, forward derives
document ids from the token ids (:func:`document_ids`: an EOS belongs to the document it ends), restarts the RoPE
positions at each document (:func:`document_positions`) and attends block-causally (:func:`block_causal_mask`): a
token sees only the earlier tokens of its own document, so no logit of a document depends on another document's
tokens (exactly: masked scores are -inf, whose softmax weight is 0.0). A pipeline stage without the embedding never
sees token ids: the pipeline passes ``doc_ids`` (computed from the batch on every rank) as a keyword input to every
stage. Nothing is added to the data format; off (``document_eos`` None) the code path is the plain causal one.

Mechanism (``model.document_attention``), built once per forward and shared by every layer:

* ``flex`` (``auto`` on CUDA): FlexAttention with a document :class:`BlockMask` (torchtitan's way): blocks that no
  query of a document may see are skipped, the mask is a few integers per 128 x 128 block instead of a (B, 1, S, S)
  tensor, and the kernel is a fused one (flex_attention compiled once per process; a compiled block traces it in).
* ``dense`` (``auto`` elsewhere): SDPA with an additive float mask (0 / -inf, in the compute dtype). It trains on
  every device with every strategy here; flex_attention cannot train on CPU in torch 2.13 ("does not support
  backward on CPU"), so the CPU path stays dense. Its price: a (B, 1, S, S) mask per micro-batch (S = 4096, B = 1,
  bf16: 32 MiB) and, on GPU, no flash kernel (SDPA falls back to the memory-efficient one, which takes a bias).

Both compute the same attention (masked scores weigh exactly 0 in either); flex runs forward-only on CPU, which is
how the equivalence is tested there.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from hpcdist.models.args import ModelArgs  # torch-free, with its arithmetic and the presets (hpcdist.models.args)

__all__ = [
    "Attention",
    "FeedForward",
    "KVCache",
    "RMSNorm",
    "Transformer",
    "TransformerBlock",
    "apply_rope",
    "block_causal_mask",
    "build_model",
    "document_attention_kind",
    "document_block_mask",
    "document_ids",
    "document_positions",
    "precompute_rope",
]

# ----------------------------------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 whatever the input dtype (bf16 mean-of-squares drifts)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))  # (D,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (..., D)
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight  # (..., D)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def precompute_rope(head_dim: int, max_seq_len: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """RoPE table of shape (max_seq_len, head_dim // 2, 2): [..., 0] = cos, [..., 1] = sin, float32.

    Real-valued (not complex) so that ``to_empty``, ``Module.to(dtype)``, FSDP and DTensor treat it like any
    other float buffer.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))  # (Hd/2,)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)  # (S_max,)
    angles = torch.outer(positions, inv_freq)  # (S_max, Hd/2)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)  # (S_max, Hd/2, 2)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of each head by position-dependent angles.

    Interleaved pairs are the convention of Meta's original Llama checkpoints (HF's rotate_half splits halves).
    x: (B, S, heads, Hd); rope: (S, Hd/2, 2), already sliced to S, or (B, S, Hd/2, 2) with per-sample positions
    (document masking). Math in float32, result in x's dtype.
    """
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)  # (B, S, heads, Hd/2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]  # (B, S, heads, Hd/2) each
    cos = rope[..., None, :, 0].float()  # (S, 1, Hd/2) or (B, S, 1, Hd/2): broadcasts over B and heads
    sin = rope[..., None, :, 1].float()
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)  # (B, S, heads, Hd/2, 2)
    return rotated.flatten(-2).type_as(x)  # (B, S, heads, Hd)


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, S) token ids -> (B, S) int64 document index within each row: 0 up to and including the first EOS, then 1..

    An EOS belongs to the document it ends (it is that document's last input; its target is the next document's
    first token, predicted from the ended document alone)."""
    is_eos = (tokens == eos_id).long()
    return is_eos.cumsum(dim=1) - is_eos


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, S) document ids -> (B, S) int64 position of each token inside its document (0 at each document's start).

    The first document of a row usually began before the window: it starts at position 0 all the same (as
    Megatron's reset_position_ids)."""
    bsz, seqlen = doc_ids.shape
    idx = torch.arange(seqlen, device=doc_ids.device).expand(bsz, seqlen)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values  # start of each token's document
    return idx - first


def block_causal_mask(doc_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, S) document ids -> (B, 1, S, S) additive attention mask: 0 where query i may see key j (same document,
    j <= i), -inf elsewhere. Float in the compute dtype, not bool: SDPA turns a bool mask into a float one inside
    every call (a copy per layer, each kept for backward); this one is built once and shared."""
    seqlen = doc_ids.shape[1]
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=doc_ids.device).tril()
    allowed = (doc_ids[:, :, None] == doc_ids[:, None, :]) & causal  # (B, S, S)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=doc_ids.device)
    return mask.masked_fill_(~allowed, float("-inf"))[:, None]  # (B, 1, S, S): broadcasts over heads


def document_block_mask(doc_ids: torch.Tensor) -> BlockMask:
    """(B, S) document ids -> FlexAttention's block mask of the same rule as :func:`block_causal_mask` (query i sees
    key j of its own document, j <= i), shared by every head. On CUDA it is built by a compiled kernel, which never
    holds the (B, S, S) boolean mask the eager construction evaluates."""
    bsz, seqlen = doc_ids.shape

    def same_document_causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (doc_ids[b, q] == doc_ids[b, kv]) & (kv <= q)

    return create_block_mask(
        same_document_causal, bsz, None, seqlen, seqlen, device=doc_ids.device, _compile=doc_ids.is_cuda
    )


_FLEX_COMPILED: list = []  # flex_attention compiled once per process (CUDA): eager flex is an unfused reference


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
    if not q.is_cuda:  # CPU: the eager implementation (forward only in torch 2.13), unfused by choice
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex_attention(q, k, v, block_mask=block_mask)
    if not _FLEX_COMPILED:
        _FLEX_COMPILED.append(torch.compile(flex_attention, dynamic=False))
    return _FLEX_COMPILED[0](q, k, v, block_mask=block_mask)


def document_attention_kind(choice: str, device: torch.device) -> str:
    """model.document_attention resolved for ``device``: ``auto`` is flex on CUDA, dense elsewhere."""
    if choice == "auto":
        return "flex" if device.type == "cuda" else "dense"
    return choice


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, S, K, Hd) -> (B, S, K * n_rep, Hd); query head h reads kv head h // n_rep."""
    if n_rep == 1:
        return x
    bsz, seqlen, n_kv, head_dim = x.shape
    # expand is a view; the reshape copies once. Explicit repetition (rather than SDPA's enable_gqa) keeps
    # every SDPA backend (flash, mem-efficient, math) eligible on every torch version we support.
    return x[:, :, :, None, :].expand(bsz, seqlen, n_kv, n_rep, head_dim).reshape(bsz, seqlen, n_kv * n_rep, head_dim)


class Attention(nn.Module):
    """Causal self-attention with RoPE and grouped-query attention."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim  # the only head quantity kept: TP shards heads, never head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)  # D -> H*Hd
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)  # D -> K*Hd
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)  # D -> K*Hd
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)  # H*Hd -> D

    def init_weights(self, init_std: float, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std, a=-3 * init_std, b=3 * init_std)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=out_std, a=-3 * out_std, b=3 * out_std)

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        doc_mask: torch.Tensor | BlockMask | None = None,
        cache: LayerKV | None = None,
        start_pos: int = 0,
    ) -> torch.Tensor:
        # x: (B, S, D); rope: (S, Hd/2, 2) for positions start_pos .. start_pos + S - 1, or (B, S, Hd/2, 2);
        # doc_mask: None (causal), a (B, 1, S, S) additive block-causal mask or FlexAttention's BlockMask of the same
        # rule (document masking, training only)
        bsz, seqlen, _ = x.shape
        # -1 = local head count, read off the (possibly TP-sharded) projection outputs.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)  # (B, S, H, Hd)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)  # (B, S, K, Hd)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)  # (B, S, K, Hd)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        mask: torch.Tensor | None = None
        causal = True
        if isinstance(doc_mask, BlockMask):
            n_rep = q.shape[2] // k.shape[2]
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # (B, S, H, Hd)
            out = _flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), doc_mask)  # (B, H, S, Hd)
            return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))  # (B, S, D)
        if doc_mask is not None:
            causal = False
            # the same dtype as q keeps SDPA from converting (copying) it; a no-op unless autocast changed q's dtype
            mask = doc_mask if doc_mask.dtype == q.dtype else doc_mask.to(q.dtype)
        if cache is not None:
            # cached keys/values are stored before repeat_kv (K heads, not H: GQA's memory saving is kept)
            k, v = cache.update(start_pos, k, v)  # (B, T, K, Hd), T = start_pos + S
            if start_pos > 0:
                # SDPA's is_causal aligns the mask top-left, i.e. for S == T only: query i (position start_pos + i)
                # sees keys 0 .. start_pos + i. One new token (S == 1) sees every cached key: no mask at all.
                causal = False
                if seqlen > 1:
                    mask = torch.ones(seqlen, k.shape[1], dtype=torch.bool, device=x.device).tril(start_pos)

        n_rep = q.shape[2] // k.shape[2]  # H / K is the same before and after TP sharding
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # (B, T, H, Hd)

        # SDPA wants heads before sequence.
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),  # (B, H, S, Hd)
            k.transpose(1, 2),  # (B, H, T, Hd)
            v.transpose(1, 2),
            attn_mask=mask,
            is_causal=causal,
        )  # (B, H, S, Hd)
        out = out.transpose(1, 2).reshape(bsz, seqlen, -1)  # (B, S, H*Hd)
        return self.wo(out)  # (B, S, D)


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)  # gate, D -> F
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)  # up,   D -> F
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)  # down, F -> D

    def init_weights(self, init_std: float, out_std: float) -> None:
        for linear in (self.w1, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std, a=-3 * init_std, b=3 * init_std)
        nn.init.trunc_normal_(self.w2.weight, mean=0.0, std=out_std, a=-3 * out_std, b=3 * out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, S, D) -> (B, S, F) -> (B, S, D)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: h = x + attn(norm(x)); out = h + ffn(norm(h))."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def init_weights(self, init_std: float, out_std: float) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(init_std, out_std)
        self.feed_forward.init_weights(init_std, out_std)

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        doc_mask: torch.Tensor | BlockMask | None = None,
        cache: LayerKV | None = None,
        start_pos: int = 0,
    ) -> torch.Tensor:
        # x: (B, S, D) -> (B, S, D)
        if cache is None:  # training: exactly the positional call (x, rope, mask) the TP plan's PrepareModuleInput
            h = x + self.attention(self.attention_norm(x), rope, doc_mask)
        else:
            h = x + self.attention(self.attention_norm(x), rope, None, cache, start_pos)
        return h + self.feed_forward(self.ffn_norm(h))


# ----------------------------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------------------------


class Transformer(nn.Module):
    """Token ids (B, S) -> logits (B, S, V) in float32.

    Build on the meta device, shard, then ``to_empty(device=...)``, ``tie_weights()``, ``init_weights()``
    (see ``build_model``). ``tok_embeddings``, ``norm`` and ``output`` may be set to None in a pipeline stage;
    ``layers`` entries may be deleted (keys keep their original index, so FQNs and checkpoints line up).
    """

    rope_cache: torch.Tensor
    document_eos: int | None = None
    """The EOS id that ends documents when ``data.document_mask`` is on (set by the trainer); None: plain causal."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        problems = args.problems()
        if problems:
            raise ValueError("invalid model arguments:\n  - " + "\n  - ".join(problems))
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)  # V x D
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)  # D -> V
        # Non-persistent: checkpoints never carry it, and a meta-built model gets a real one in init_weights.
        self.register_buffer(
            "rope_cache", torch.empty(args.max_seq_len, args.head_dim // 2, 2), persistent=False
        )  # (S_max, Hd/2, 2), filled by init_weights
        self.tie_weights()
        self.init_weights()

    def tie_weights(self) -> None:
        """Point output.weight at tok_embeddings.weight when tie_embeddings is set and both parts exist.

        Call again after ``to_empty()``, which replaces each module's parameters separately and so unties them.
        """
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_buffers(self, device: torch.device | str) -> None:
        """Compute the RoPE buffer on ``device``: a function of the arguments alone (no random numbers are drawn)."""
        self.rope_cache = precompute_rope(
            self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, device=torch.device(device)
        )

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """(Re)initialize every parameter present and recompute the RoPE buffer.

        Deterministic under ``torch.manual_seed``: parts are visited in a fixed order (embeddings, layers by
        index, norm, output). Works on a meta model (no-op numerically), after ``to_empty``, and with any of
        tok_embeddings / norm / output set to None. ``buffer_device`` places the RoPE buffer (default: where
        it already lives).
        """
        self.init_buffers(buffer_device if buffer_device is not None else self.rope_cache.device)
        std = self.args.init_std
        # Residual-branch outputs (wo, w2) are scaled down so the residual stream's variance does not grow
        # with depth (GPT-2 / Megatron scheme): 2 such outputs per layer.
        out_std = std / math.sqrt(2 * self.args.n_layers)
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=std)
        for layer in self.layers.values():
            # Duck-typed: activation-checkpoint and torch.compile wrappers forward attribute access to the block.
            layer.init_weights(std, out_std)  # type: ignore[operator]
        if self.norm is not None:
            self.norm.reset_parameters()
        tied = (
            self.tok_embeddings is not None
            and self.output is not None
            and self.output.weight is self.tok_embeddings.weight
        )
        if self.output is not None and not tied:  # a tied head keeps the embedding init
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        start_pos: int = 0,
        *,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # tokens: (B, S) int64, or hidden states (B, S, D) when this pipeline stage has no tok_embeddings.
        # cache/start_pos (inference only): tokens sit at positions start_pos.., earlier ones are in the cache.
        # doc_ids: (B, S) document ids (document masking; see the module docstring): given by the pipeline to every
        # stage, else derived here from the token ids when document_eos is set.
        seqlen = tokens.shape[1]
        end = start_pos + seqlen
        if end > self.rope_cache.shape[0]:
            raise ValueError(
                f"sequence length {end} exceeds model.max_seq_len={self.rope_cache.shape[0]}: "
                "raise model.max_seq_len or shorten the sequences"
            )
        if cache is not None and end > cache.max_seq_len:
            raise ValueError(f"positions up to {end} do not fit a KV cache of {cache.max_seq_len}")
        if doc_ids is None and self.document_eos is not None and cache is None:
            if self.tok_embeddings is None:  # hidden states carry no EOS: the pipeline must pass doc_ids
                raise ValueError("document masking: a pipeline stage without tok_embeddings needs doc_ids")
            doc_ids = document_ids(tokens, self.document_eos)
        if doc_ids is not None and cache is not None:
            raise ValueError("document masking is for training sequences; generation treats a prompt as one document")
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # (B, S, D)
        doc_mask: torch.Tensor | BlockMask | None = None
        if doc_ids is None:
            rope = self.rope_cache[start_pos:end]  # (S, Hd/2, 2)
        else:
            rope = self.rope_cache[document_positions(doc_ids)]  # (B, S, Hd/2, 2): positions restart per document
            if document_attention_kind(self.args.document_attention, doc_ids.device) == "flex":
                doc_mask = document_block_mask(doc_ids)  # shared by every layer
            else:
                # the dtype q will have: autocast's where it is on (the embedding's output stays float32 under it)
                device_type = h.device.type
                dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else h.dtype
                doc_mask = block_causal_mask(doc_ids, dtype)  # (B, 1, S, S), shared by every layer
        for name, layer in self.layers.items():
            # (B, S, D); training calls the block with (h, rope, mask), the TP plan's positional inputs
            h = layer(h, rope, doc_mask) if cache is None else layer(h, rope, None, cache.layers[name], start_pos)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h  # hidden states for the next pipeline stage
        return self.output(h).float()  # (B, S, V); float32 so the loss is accurate under bf16 compute


# ----------------------------------------------------------------------------------------------------------------------
# Inference: key/value cache
# ----------------------------------------------------------------------------------------------------------------------


class LayerKV:
    """One layer's cached keys and values, preallocated: k, v of shape (B, S_max, K, Hd), rotary already applied."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v

    def update(self, start_pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, S, K, Hd) at positions start_pos.. and return every position so far, (B, T, K, Hd) each."""
        end = start_pos + k.shape[1]
        self.k[:, start_pos:end] = k
        self.v[:, start_pos:end] = v
        return self.k[:, :end], self.v[:, :end]


class KVCache:
    """Keys and values of every layer for ``batch_size`` sequences of up to ``max_seq_len`` tokens (default: the
    model's). Memory: 2 * n_layers * B * S_max * K * Hd elements (K kv heads: GQA shrinks it by H / K)."""

    def __init__(
        self,
        args: ModelArgs,
        batch_size: int,
        *,
        max_seq_len: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        self.max_seq_len = min(max_seq_len or args.max_seq_len, args.max_seq_len)
        shape = (batch_size, self.max_seq_len, args.kv_heads, args.head_dim)
        zeros = lambda: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        self.layers = {str(i): LayerKV(zeros(), zeros()) for i in range(args.n_layers)}


def build_model(args: ModelArgs, device: str | torch.device = "meta") -> Transformer:
    """Build a Transformer on ``device``; on a real device it is also initialized.

    Always constructed on the meta device first and then materialized with ``to_empty`` + ``tie_weights`` +
    ``init_weights``: no time is spent on nn.Linear's default init (minutes on CPU for 7B+), and the result
    equals the trainer's path (meta build -> parallelize -> to_empty -> init_weights) under the same seed.
    """
    with torch.device("meta"):
        model = Transformer(args)
    device = torch.device(device)
    if device.type != "meta":
        model.to_empty(device=device)
        model.tie_weights()
        model.init_weights()
    return model
