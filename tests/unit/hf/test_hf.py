"""Hugging Face Llama export / import against transformers itself.

Each variant trains a tiny model for two steps with the real trainer (one process) and saves it through the real
CheckpointManager; ``hpcdist export`` turns it into a directory that transformers' ``LlamaForCausalLM`` and
``AutoTokenizer`` load, and ``hpcdist import`` turns that back into a checkpoint. References are the trainer's own
weights and hpcdist's own forward."""

from __future__ import annotations

import json
import os
import shutil
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from hpcdist import cli
from hpcdist import config as config_mod
from hpcdist.data import load_tokenizer
from hpcdist.hf.convert import from_hf_state_dict, permute_from_hf, permute_to_hf
from hpcdist.inference import load_for_inference
from hpcdist.models.llama import build_model
from tests.conftest import SMALL
from tests.dist.harness import single
from tests.training import train

transformers = pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[test]') is not installed")

RTOL = 1e-5  # fp32: transformers and hpcdist differ only in the order of a few float operations (~3e-7 seen)
TEXT = "Grüße, 世界! naïve café — ok ✓ 🚀\n\tdef f(x): return x"

# (data fixture, extra overrides): GQA with the byte tokenizer; tied embeddings (MHA) and GQA + tied with a BPE
VARIANTS = {
    "byte-gqa": ("corpus_dir", ("model.n_kv_heads=2",)),
    "bpe-tied": ("bpe_corpus_dir", ("model.n_kv_heads=4", "model.tie_embeddings=true", "model.vocab_size=auto")),
    "bpe-gqa-tied": ("bpe_corpus_dir", ("model.n_kv_heads=1", "model.tie_embeddings=true", "model.vocab_size=auto")),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A 2-step run of the variant, its checkpoint and its fp32 export (made through the CLI)."""
    data_fixture, extra = VARIANTS[request.param]
    data = request.getfixturevalue(data_fixture)
    root = tmp_path_factory.mktemp(f"hf-{request.param}")
    overrides = [
        *SMALL,
        f"run.dir={root / 'run'}",
        "data.source=files",
        f"data.path={data}",
        "train.steps=2",
        "checkpoint.save_final=true",
        "train.global_batch_size=4",
        "train.micro_batch_size=4",
        *extra,
    ]
    cfg = config_mod.load(None, overrides)
    out = single(partial(train, params=True), cfg)  # one process: the plain model's state
    hf = root / "hf"
    assert cli.main(["export", str(root / "run"), "--out", str(hf), "--dtype", "fp32"]) == 0
    return {
        **out,
        "cfg": cfg,
        "overrides": overrides,
        "root": root,
        "hf": hf,
        "data": data,
        "step": Path(cfg.checkpoint_dir) / "step-00000002",
    }


def _ours(run: dict[str, Any]) -> torch.nn.Module:
    model = build_model(run["cfg"].model, "cpu")
    model.load_state_dict(run["params"])
    return model.eval()


def _batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (3, 24), generator=torch.Generator().manual_seed(0))


def test_logits_equal_transformers(run: dict[str, Any]) -> None:
    """LlamaForCausalLM.from_pretrained(export) gives hpcdist's logits on a batch (fp32): names, the q/k row
    permutation (GQA: kv heads for wk), tied embeddings, rope_theta and the norm eps all map."""
    hf = transformers.LlamaForCausalLM.from_pretrained(run["hf"], dtype=torch.float32).eval()
    tokens = _batch(run["cfg"].model.vocab_size)
    with torch.no_grad():
        want = _ours(run)(tokens)
        got = hf(tokens).logits
    assert got.shape == want.shape
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel < RTOL, rel
    config = json.loads((run["hf"] / "config.json").read_text())
    assert config["tie_word_embeddings"] == run["cfg"].model.tie_embeddings
    with safe_open(str(run["hf"] / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())  # a safe_open handle is not a mapping
    assert ("lm_head.weight" in names) != run["cfg"].model.tie_embeddings  # tied: no separate head


def test_tokenizer_equals_the_runs(run: dict[str, Any]) -> None:
    """AutoTokenizer.from_pretrained(export) encodes and decodes non-ASCII text like the run's tokenizer (the byte
    tokenizer exported as a tokenizer.json; a BPE copied), and its BOS/EOS are the config's."""
    ours = load_tokenizer(run["data"])
    theirs = transformers.AutoTokenizer.from_pretrained(run["hf"])
    ids = ours.encode_batch([TEXT])[0].tolist()
    assert theirs(TEXT)["input_ids"] == ids
    assert theirs.decode(ids) == ours.decode(ids) == TEXT
    framed = [ours.eos_id, *ids[:5], ours.eos_id]
    assert theirs.decode(framed, skip_special_tokens=True) == ours.decode(framed)
    assert theirs.eos_token_id == ours.eos_id and theirs.bos_token_id == ours.bos_id
    config = json.loads((run["hf"] / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (ours.bos_id, ours.eos_id)


@pytest.mark.parametrize("run", ["bpe-gqa-tied"], indirect=True)
def test_greedy_generation_equals_an_argmax_loop(run: dict[str, Any]) -> None:
    """transformers' generate (greedy, its KV cache) continues a prompt with the tokens an argmax loop over hpcdist's
    forward (no cache) picks."""
    hf = transformers.LlamaForCausalLM.from_pretrained(run["hf"], dtype=torch.float32).eval()
    prompt = _batch(run["cfg"].model.vocab_size)[:1, :8]
    ours, tokens = _ours(run), prompt
    with torch.no_grad():
        for _ in range(10):
            tokens = torch.cat([tokens, ours(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
        got = hf.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert got.tolist() == tokens.tolist()


def test_hpcdist_generate_on_the_export_equals_transformers_generate(
    run: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """`hpcdist generate HF_DIR` (greedy, KV cache, the exported tokenizer) continues a text prompt with the tokens
    transformers' greedy generate picks from the same prompt ids, token for token (the ids past the tokenizer's
    vocabulary, padding rows of vocab_size auto, are suppressed on both sides)."""
    new = 12
    assert cli.main(["generate", str(run["hf"]), "--prompt", "def main(", "--max-new-tokens", str(new), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    hf = transformers.LlamaForCausalLM.from_pretrained(run["hf"], dtype=torch.float32).eval()
    vocab = transformers.AutoTokenizer.from_pretrained(run["hf"])
    padding = list(range(len(vocab), run["cfg"].model.vocab_size))
    with torch.no_grad():
        got = hf.generate(
            torch.tensor([out["prompt_ids"]]),
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            suppress_tokens=padding or None,
        )
    theirs = got[0, len(out["prompt_ids"]) :].tolist()
    assert len(out["new_ids"]) >= 1 and theirs == out["new_ids"], (theirs, out)


@pytest.mark.parametrize("run", ["byte-gqa", "bpe-gqa-tied"], indirect=True)
def test_import_round_trip_and_resume(run: dict[str, Any], tmp_path: Path) -> None:
    """hpcdist import of the export is a step-0 checkpoint holding the trained weights bit for bit; resuming from it
    (checkpoint.resume, fresh optimizer and data) gives the first loss of starting from the original checkpoint's
    weights (checkpoint.init_from)."""
    ckpt = tmp_path / "imported"
    assert cli.main(["import", str(run["hf"]), "--out", str(ckpt)]) == 0
    model, tok, _ = load_for_inference(ckpt)
    args = model.args
    assert tok is None  # an imported checkpoint records no data, so no tokenizer (generate asks for --tokenizer)
    for name, want in run["params"].items():
        assert torch.equal(model.state_dict()[name], want), name
    assert args.vocab_size == run["cfg"].model.vocab_size and args.tie_embeddings == run["cfg"].model.tie_embeddings
    one = ["train.steps=1", "checkpoint.save_final=false"]
    resumed = config_mod.load(
        None, [*run["overrides"], *one, f"run.dir={tmp_path / 'a'}", f"checkpoint.resume={ckpt / 'step-00000000'}"]
    )
    inited = config_mod.load(
        None, [*run["overrides"], *one, f"run.dir={tmp_path / 'b'}", f"checkpoint.init_from={run['step']}"]
    )
    got, want = single(train, resumed)["losses"], single(train, inited)["losses"]
    assert got == want and list(got) == [1]


def test_bf16_and_sharded_export(run: dict[str, Any], tmp_path: Path) -> None:
    """--dtype bf16 --max-shard-size: several safetensors files and an index naming each tensor's file; the
    tensors are the trained weights rounded to bf16 (read back through the inverse permutation), and import reads
    the shards back to those values in float32."""
    out = tmp_path / "bf16"
    old = os.umask(0o027)  # docs/SECURITY.md: every file follows the umask (the safetensors were 0600)
    try:
        assert cli.main(["export", str(run["step"]), "--out", str(out), "--max-shard-size", "100KB"]) == 0
    finally:
        os.umask(old)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir() if p.is_file()} == {
        p.name: "0o640" for p in out.iterdir() if p.is_file()
    }
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files == sorted(p.name for p in out.glob("model-*.safetensors"))
    tensors = {}
    for name in files:
        with safe_open(str(out / name), framework="pt") as f:
            names = list(f.keys())  # a safe_open handle is not a mapping
            assert all(index["weight_map"][k] == name for k in names)
            tensors.update({k: f.get_tensor(k) for k in names})
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = from_hf_state_dict(tensors, run["cfg"].model)
    for name, t in back.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, run["params"][name].to(torch.bfloat16)), name
    # imported back (through the index of shards): float32 of those bf16 values
    assert cli.main(["import", str(out), "--out", str(tmp_path / "imported")]) == 0
    model, _, _ = load_for_inference(tmp_path / "imported")
    for name, want in run["params"].items():
        assert torch.equal(model.state_dict()[name], want.to(torch.bfloat16).float()), name


def test_permutations_are_inverse_and_interleave_to_halves() -> None:
    """Per head, HF's rotate-half order is the even rows then the odd rows of hpcdist's interleaved pairs."""
    heads, hd, dim = 3, 8, 5
    w = torch.arange(heads * hd * dim, dtype=torch.float32).reshape(heads * hd, dim)
    hf = permute_to_hf(w, heads)
    rows = [h * hd + r for h in range(heads) for r in [*range(0, hd, 2), *range(1, hd, 2)]]
    assert torch.equal(hf, w[rows])
    assert torch.equal(permute_from_hf(hf, heads), w)


# ---------------------------------------------------------------------------------------------------- bad input
def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], *fragments: str, lines: int = 1) -> str:
    """``lines``: a config problem comes as the config loader's header plus one line per problem."""
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == lines and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    return err


def _big_tokenizer(path: Path, size: int) -> Path:
    """A tokenizer.json of ``size`` tokens (a word-level vocabulary, EOS last)."""
    from tokenizers import Tokenizer, models

    vocab = {f"w{i}": i for i in range(size - 1)} | {"<|endoftext|>": size - 1}
    path.mkdir()
    Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0")).save(str(path / "tokenizer.json"))
    return path


def _hf_copy(run: dict[str, Any], tmp_path: Path, **config: Any) -> Path:
    out = tmp_path / "hf-copy"
    shutil.copytree(run["hf"], out)
    data = json.loads((out / "config.json").read_text())
    data.update(config)
    (out / "config.json").write_text(json.dumps(data))
    return out


@pytest.mark.parametrize("run", ["byte-gqa"], indirect=True)
def test_bad_input_is_one_line(run: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Not a Llama config, no config.json, not a checkpoint, a vocabulary the model does not cover, a tokenizer that
    is gone, a model section that is not config.json's: each one line (exit 2), no traceback, nothing written."""
    not_llama = _hf_copy(run, tmp_path, model_type="gpt2")
    _one_line_error(capsys, ["import", str(not_llama), "--out", str(tmp_path / "c1")], "model_type is 'gpt2'")
    _one_line_error(capsys, ["import", str(tmp_path), "--out", str(tmp_path / "c2")], "no config.json")
    _one_line_error(capsys, ["export", str(tmp_path), "--out", str(tmp_path / "o1")], "no complete hpcdist checkpoint")
    assert not (tmp_path / "c1").exists() and not (tmp_path / "o1").exists()
    # a tokenizer larger than the model's vocabulary (the import checks the HF directory's own tokenizer too)
    # (its own tokenizer.json replaced by one a token larger than config.json's vocab_size: the weights still agree
    # with config.json, which the import checks first)
    vocab = run["cfg"].model.vocab_size
    big = tmp_path / "big-tok"
    shutil.copytree(run["hf"], big)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (big / name).unlink(missing_ok=True)
    shutil.copy(_big_tokenizer(tmp_path / "tok-big", vocab + 1) / "tokenizer.json", big / "tokenizer.json")
    _one_line_error(capsys, ["import", str(big), "--out", str(tmp_path / "c3")], "the embedding table cannot cover")
    tok = str(_big_tokenizer(tmp_path / "tok", vocab + 1))
    _one_line_error(
        capsys,
        ["export", str(run["step"]), "--out", str(tmp_path / "o2"), "--tokenizer", tok],
        f"{vocab + 1} tokens",
        f"model.vocab_size={vocab}",
    )
    # the run's prepared data (and so its tokenizer) moved away
    moved = tmp_path / "moved"
    shutil.copytree(run["root"] / "run", moved)
    state_file = next(moved.glob("checkpoints/step-*/trainer_state.json"))
    state = json.loads(state_file.read_text())
    state["config"]["data"]["path"] = str(tmp_path / "gone")
    _rewrite_checkpoint_file(state_file, json.dumps(state))
    _one_line_error(
        capsys, ["export", str(moved), "--out", str(tmp_path / "o3")], "tokenizer", "is missing", "--tokenizer"
    )
    # checkpoint.init_from: HF_DIR with another model section: the key and config.json's value, at config load
    yaml = tmp_path / "empty.yaml"
    yaml.write_text("{}\n")
    _one_line_error(
        capsys,
        ["config", str(yaml), *run["overrides"], "model.n_layers=3", f"checkpoint.init_from={run['hf']}"],
        "model.n_layers=3",
        "num_hidden_layers=2",
        lines=2,
    )
    _one_line_error(
        capsys,
        ["config", str(yaml), *run["overrides"], f"checkpoint.init_from={not_llama}"],
        "checkpoint.init_from",
        "model_type is 'gpt2'",
        lines=2,
    )


def _rewrite_checkpoint_file(path: Path, text: str) -> None:
    """Edit a checkpoint file and its manifest entry (size) so the checkpoint stays intact by size."""
    path.write_text(text)
    manifest_file = path.parent / "MANIFEST.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["files"][path.name]["size"] = path.stat().st_size
    manifest_file.write_text(json.dumps(manifest))
