"""data.document_mask: attention never crosses an EOS inside a packed sequence, RoPE positions restart
at each document; the config refuses it where it cannot work; generation treats a prompt as one document; the planner
counts the mask. The multi-rank equivalence is in tests/dist/test_document_mask.py."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from hpcdist import config as config_mod
from hpcdist.byte_vocab import BYTE_EOS_ID as BYTE_EOS
from hpcdist.config import ConfigError
from hpcdist.config.vocab import check_data, data_eos
from hpcdist.data import ByteTokenizer
from hpcdist.models import build_model
from hpcdist.models.args import ModelArgs, load_preset
from hpcdist.models.generation import generate
from hpcdist.models.llama import block_causal_mask, document_ids, document_positions
from hpcdist.planning.memory import activation_bytes, activation_bytes_3d, document_mask_bytes, plan_table

EOS = 5
S = 48
CUT = 20  # document 1 = tokens 0..CUT (the EOS at CUT ends it), document 2 = CUT + 1 ..


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    args = dataclasses.replace(
        ModelArgs(**load_preset("tiny")), dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64
    )
    return build_model(args, "cpu").eval()


def _packed(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(EOS + 1, 258, (2, S), generator=g)  # no EOS but the one placed below
    tokens[:, CUT] = EOS
    return tokens


def _edit_document_1(tokens: torch.Tensor) -> torch.Tensor:
    edited = tokens.clone()
    edited[:, :CUT] = torch.where(edited[:, :CUT] == 100, 101, 100)  # every token of document 1 changed, no EOS
    return edited


@torch.no_grad()
def test_document_1_cannot_reach_document_2(model: torch.nn.Module) -> None:
    tokens = _packed()
    edited = _edit_document_1(tokens)
    model.document_eos = None
    try:  # off: document 2 attends to document 1 (what a packed sequence does without the mask)
        off = (model(tokens) - model(edited))[:, CUT + 1 :].abs().max()
        model.document_eos = EOS
        on = model(tokens) - model(edited)
    finally:
        model.document_eos = None
    assert off > 1e-3
    assert on[:, CUT + 1 :].abs().max() == 0  # exactly: masked scores are -inf, softmax weight 0.0
    assert on[:, :CUT].abs().max() > 1e-3  # document 1's own logits do change


@torch.no_grad()
def test_document_2_alone_at_position_0_equals_inside_the_pack(model: torch.nn.Module) -> None:
    tokens = _packed(1)
    model.document_eos = EOS
    try:
        packed = model(tokens)[:, CUT + 1 :]
        alone = model(tokens[:, CUT + 1 :])  # one document from position 0
    finally:
        model.document_eos = None
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    # without the restart (positions CUT + 1.. inside the pack) the same tokens give other logits
    shifted = model(tokens)[:, CUT + 1 :]
    assert (shifted - alone).abs().max() > 1e-3


def test_ids_positions_and_mask() -> None:
    tokens = torch.tensor([[7, EOS, 8, 9, EOS, EOS, 3]])
    ids = document_ids(tokens, EOS)
    assert ids.tolist() == [[0, 0, 1, 1, 1, 2, 3]]  # an EOS belongs to the document it ends
    assert document_positions(ids).tolist() == [[0, 1, 0, 1, 2, 0, 0]]
    allowed = block_causal_mask(ids, torch.float32)[0, 0] == 0
    assert allowed.tolist()[3] == [False, False, True, True, False, False, False]
    assert allowed.diagonal().all() and not allowed.triu(1).any()  # causal, and no row without a key


@torch.no_grad()
def test_under_bf16_autocast_the_mask_still_isolates(model: torch.nn.Module) -> None:
    tokens = _packed(2)
    model.document_eos = EOS
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a, b = model(tokens), model(_edit_document_1(tokens))
    finally:
        model.document_eos = None
    assert (a - b)[:, CUT + 1 :].abs().max() == 0


@torch.no_grad()
def test_generation_treats_a_prompt_as_one_document(model: torch.nn.Module) -> None:
    prompt = [9, 10, EOS, 11, 12]  # an EOS inside the prompt does not split it
    model.document_eos = EOS
    try:
        cached = generate(model, prompt, max_new_tokens=4, use_cache=True)
        recomputed = generate(model, prompt, max_new_tokens=4, use_cache=False)
    finally:
        model.document_eos = None
    plain = generate(model, prompt, max_new_tokens=4, use_cache=False)
    assert cached.tokens == recomputed.tokens == plain.tokens
    with pytest.raises(ValueError, match="tok_embeddings needs doc_ids"):
        stage = build_model(model.args, "cpu")
        stage.tok_embeddings, stage.document_eos = None, EOS
        stage(torch.zeros(1, 4, model.args.dim))


def test_byte_eos_constant_matches_the_tokenizer() -> None:
    assert ByteTokenizer.eos_id == BYTE_EOS


def test_config_refuses_where_it_cannot_work(corpus_dir: Path, tmp_path: Path) -> None:
    base = ["model.preset=tiny", f"run.dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError, match=r"data.document_mask: data.source=synthetic has no documents"):
        config_mod.load(None, [*base, "data.source=synthetic", "data.document_mask=true"])
    with pytest.raises(ConfigError, match=r"data\.document_mask"):
        config_mod.load(None, [*base, "data.document_mask=maybe"])
    # prepared data whose meta.json records no EOS id: refused at start-up, one line naming the key
    no_eos = tmp_path / "no_eos"
    shutil.copytree(corpus_dir, no_eos)
    meta = json.loads((no_eos / "meta.json").read_text())
    del meta["eos_id"]
    (no_eos / "meta.json").write_text(json.dumps(meta))
    cfg = config_mod.load(None, [*base, "data.source=files", f"data.path={no_eos}", "data.document_mask=true"])
    problems = check_data(cfg, strict=False)
    assert len(problems) == 1 and problems[0].startswith("data.document_mask: data.path=") and "eos_id" in problems[0]
    ok = config_mod.load(None, [*base, "data.source=files", f"data.path={corpus_dir}", "data.document_mask=true"])
    assert check_data(ok, strict=False) == [] and data_eos(ok) == (ByteTokenizer.eos_id, "")
    assert data_eos(config_mod.load(None, base))[0] == BYTE_EOS  # stdlib


def test_planner_counts_the_mask() -> None:
    args = ModelArgs(**load_preset("tiny"))
    kw = {"micro_batch_size": 2, "seq_len": 256, "activation_checkpointing": "none"}
    mask = document_mask_bytes(micro_batch_size=2, seq_len=256)
    assert mask == 2 * 256 * 256 * 2
    assert activation_bytes(args, **kw, document_mask=True) - activation_bytes(args, **kw) == mask
    # 1F1B's first stage holds pp micro-batches in flight, each with its own mask
    three = {**kw, "pp": 2, "microbatches": 4}
    assert activation_bytes_3d(args, **three, document_mask=True) - activation_bytes_3d(args, **three) >= 2 * mask
    table = plan_table(args, nodes=1, gpus_per_node=8, gpu_mem_gb=80, document_mask=True, **kw)
    assert "document mask (0.00 GiB per micro-batch" in table.splitlines()[0]
    assert "document mask" not in plan_table(args, nodes=1, gpus_per_node=8, gpu_mem_gb=80, **kw)


@torch.no_grad()
def test_flex_and_dense_document_attention_compute_the_same_logits_and_loss(model: torch.nn.Module) -> None:
    """model.document_attention=flex (FlexAttention's block mask; eager and forward-only on CPU) against dense (SDPA
    with the additive mask): several documents per row, at other places in each row, fp32. Tolerance 1e-5 absolute
    on the logits (measured: a few 1e-7, the order of summation differs)."""
    from hpcdist.models.llama import document_attention_kind, document_block_mask

    tokens = _packed(3)
    tokens[0, [6, 13, 31, 40]] = EOS  # row 0: six documents; row 1: three (CUT and these two)
    tokens[1, [9, 44]] = EOS
    doc_ids = document_ids(tokens, EOS)
    block_mask = document_block_mask(doc_ids)  # its rule, evaluated at every (query, key): the dense mask's
    b, q, kv = torch.meshgrid(torch.arange(2), torch.arange(S), torch.arange(S), indexing="ij")
    allowed = block_mask.mask_mod(b, torch.zeros_like(b), q, kv)
    assert torch.equal(torch.where(allowed, 0.0, float("-inf"))[:, None], block_causal_mask(doc_ids, torch.float32))
    targets = torch.roll(tokens, -1, dims=1)
    model.document_eos = EOS
    try:
        out = {}
        for kind in ("dense", "flex"):
            model.args.document_attention = kind
            out[kind] = model(tokens)
    finally:
        model.args.document_attention, model.document_eos = "auto", None
    diff = (out["flex"] - out["dense"]).abs().max().item()
    print(f"flex vs dense: max |logit difference| {diff:.2e}")
    assert diff < 1e-5
    loss = {k: torch.nn.functional.cross_entropy(v.flatten(0, 1), targets.flatten()).item() for k, v in out.items()}
    assert loss["flex"] == pytest.approx(loss["dense"], abs=1e-6)
    # the block mask's rule is the dense mask's: it is what the documents above needed (not plain causal attention)
    model.document_eos = None
    try:
        causal = model(tokens)
    finally:
        model.document_eos = None
    assert (causal - out["dense"]).abs().max().item() > 1e-3
    assert document_attention_kind("auto", torch.device("cuda", 0)) == "flex"
    assert document_attention_kind("auto", torch.device("cpu")) == "dense"


def test_document_attention_choices_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"model\.document_attention='fused': must be one of auto, dense, flex"):
        config_mod.load(None, ["model.document_attention=fused"])
    assert config_mod.load(None, ["model.document_attention=flex"]).model_args().document_attention == "flex"


def _with_meta(corpus_dir: Path, dest: Path, **edits: object) -> Path:
    shutil.copytree(corpus_dir, dest)
    meta = json.loads((dest / "meta.json").read_text())
    meta.update(edits)
    (dest / "meta.json").write_text(json.dumps(meta))
    return dest


def test_an_eos_id_the_tokenizer_record_contradicts_is_refused(corpus_dir: Path, tmp_path: Path) -> None:
    meta = json.loads((corpus_dir / "meta.json").read_text())
    assert meta["tokenizer"]["eos_id"] == meta["eos_id"] == ByteTokenizer.eos_id  # prepare writes both, equal
    edited = _with_meta(corpus_dir, tmp_path / "edited", eos_id=100)  # a byte id: splitting there cuts words
    base = ["model.preset=tiny", f"run.dir={tmp_path / 'run'}", "data.source=files", f"data.path={edited}"]
    cfg = config_mod.load(None, [*base, "data.document_mask=true"])
    problems = check_data(cfg, strict=False)
    assert len(problems) == 1 and "eos_id=100 but the tokenizer record says eos_id=257" in problems[0], problems


def test_a_document_mask_whose_eos_never_occurs_is_named(
    corpus_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from hpcdist.data.build import document_eos
    from hpcdist.data.shards import TokenDataset, eos_count

    assert eos_count(TokenDataset(corpus_dir, 64), ByteTokenizer.eos_id) > 0  # the corpus is many documents
    tokenizer = {**json.loads((corpus_dir / "meta.json").read_text())["tokenizer"], "eos_id": 0}
    nul = _with_meta(corpus_dir, tmp_path / "nul", eos_id=0, tokenizer=tokenizer)  # a NUL byte never occurs
    for data, warned in ((corpus_dir, False), (nul, True)):
        cfg = config_mod.load(
            None,
            [
                "model.preset=tiny",
                f"run.dir={tmp_path / 'run'}",
                "data.source=files",
                f"data.path={data}",
                "data.document_mask=true",
                "data.seq_len=64",
            ],
        )
        caplog.clear()
        with caplog.at_level("WARNING", logger="hpcdist"):
            assert document_eos(cfg, TokenDataset(data, 64)) == (0 if warned else ByteTokenizer.eos_id)
        said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert bool(said) == warned, said
        if warned:
            assert len(said) == 1 and "id 0" in said[0] and "one document" in said[0], said
