"""Hostile Hugging Face directories through every command that reads one.

One small valid Llama directory (safetensors written directly, the byte tokenizer exported beside it, one file and a
sharded copy with an index) and more than 50 variants derived from it, each an edit another user could make: a FIFO
or a link where a file should be, an index naming files outside the directory, config.json values of the wrong type,
out of range, non-finite or huge, safetensors headers that lie or disagree with config.json. Each goes through
``hpcdist import``, ``hpcdist generate``, ``hpcdist eval``, ``checkpoint.init_from`` at config load (``hpcdist
config``) and the trainer's own ``load_into``, in a child forked from this process (torch stays imported) under a
time bound. Every one must be refused: exit 2 with a readable message (no traceback, no "unexpected error"; the
trainer's loader raises ConfigError, which ``hpcdist train`` prints that way), and no checkpoint may be written. The
valid directories themselves pass every command (the same harness can accept).

Before the fix (4b773a7), 92 directories x 5 commands gave 314 failures, every directory at least one: 12 commands hung
(a FIFO index entry or shard: import, generate, eval and the trainer's load; num_hidden_layers 1000000), 102
"unexpected error" lines, 24 directories imported with exit 0 into checkpoints, 12 generated text with exit 0.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from hpcdist import cli
from hpcdist.checkpoint.state import Checkpointable
from hpcdist.config import ConfigError
from hpcdist.data import ByteTokenizer
from hpcdist.hf.convert import to_hf_state_dict
from hpcdist.hf.import_ import HFWeights, load_into
from hpcdist.hf.tokenizer import export_tokenizer
from hpcdist.models.args import ModelArgs
from hpcdist.models.hf_config import hf_config
from hpcdist.models.llama import Transformer

ARGS = ModelArgs(vocab_size=258, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
# the run's model section equal to ARGS: checkpoint.init_from compares it with config.json
MODEL_KEYS = [
    "model.vocab_size=258",
    "model.dim=32",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=64",
    "model.max_seq_len=64",
    "model.norm_eps=1e-05",
    "model.rope_theta=10000.0",
    "model.tie_embeddings=false",
]
BOUND_S = 60.0  # the five commands of one directory together: the hangs seen ran until SIGKILL; a refusal takes ms
OTHER_UID = 54321


def _write_base(out: Path, *, shards: int) -> Path:
    out.mkdir()
    torch.manual_seed(0)
    model = Transformer(ARGS)
    state = to_hf_state_dict({k: v.detach() for k, v in model.state_dict().items()}, ARGS)
    names = list(state)
    if shards == 1:
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    else:
        weight_map = {}
        per = -(-len(names) // shards)
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = names[i * per : (i + 1) * per]
            save_file({k: state[k].contiguous() for k in part}, str(out / file))
            weight_map |= dict.fromkeys(part, file)
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(hf_config(ARGS, torch_dtype="float32", bos_id=256, eos_id=257)))
    export_tokenizer(ByteTokenizer(), out, max_len=ARGS.max_seq_len)
    return out


@pytest.fixture(scope="session")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-bases")
    return {"single": _write_base(root / "single", shards=1), "sharded": _write_base(root / "sharded", shards=3)}


# ------------------------------------------------------------------------------------------------ the edits
def _config(**changes: Any) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        data = json.loads((d / "config.json").read_text())
        for k, v in changes.items():
            if v is _DELETE:
                data.pop(k, None)
            else:
                data[k] = v
        (d / "config.json").write_text(json.dumps(data))

    return edit


_DELETE = object()


def _config_text(text: str | bytes) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        (d / "config.json").write_bytes(text.encode() if isinstance(text, str) else text)

    return edit


def _config_raw(key: str, literal: str) -> Callable[[Path], None]:
    """config.json with ``key`` set to a JSON literal json.dumps cannot write (NaN, 1e999, a 5,000-digit int)."""

    def edit(d: Path) -> None:
        data = json.loads((d / "config.json").read_text())
        data[key] = "@@"
        (d / "config.json").write_text(json.dumps(data).replace('"@@"', literal))

    return edit


def _fifo(name: str) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        if (d / name).exists():
            (d / name).unlink()
        os.mkfifo(d / name)

    return edit


def _replace_with_dir(name: str) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        (d / name).unlink()
        (d / name).mkdir()

    return edit


def _symlink(name: str, target: str, *, uid: int | None = None) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        (d / name).unlink()
        os.symlink(target, d / name)
        if uid is not None:
            os.lchown(d / name, uid, uid)

    return edit


def _header(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_header(path: Path, header: Any, data: bytes, *, raw: bytes | None = None) -> None:
    text = raw if raw is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _edit_header(change: Callable[[dict[str, Any]], None], file: str = "model.safetensors") -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        header, data = _header(d / file)
        change(header)
        _write_header(d / file, header, data)

    return edit


def _set_tensor(name: str, **fields: Any) -> Callable[[dict[str, Any]], None]:
    def change(header: dict[str, Any]) -> None:
        header[name].update(fields)

    return change


def _reshape(name: str, shape: list[int]) -> Callable[[Path], None]:
    """The tensor ``name`` with another shape of the same size (so the file stays consistent in itself)."""
    return _edit_header(_set_tensor(name, shape=shape))


def _drop_tensor(name: str) -> Callable[[dict[str, Any]], None]:
    def change(header: dict[str, Any]) -> None:
        del header[name]

    return change


def _resave_without(name: str) -> Callable[[Path], None]:
    """model.safetensors written again without the tensor ``name``: a consistent file that lacks it."""

    def edit(d: Path) -> None:
        state = load_file(str(d / "model.safetensors"))
        del state[name]
        save_file(state, str(d / "model.safetensors"))

    return edit


def _raw_file(name: str, content: bytes) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        (d / name).write_bytes(content)

    return edit


def _truncate(name: str, keep: int) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        with open(d / name, "r+b") as f:
            f.truncate(keep if keep >= 0 else os.path.getsize(d / name) + keep)

    return edit


def _index(change: Callable[[dict[str, Any]], Any]) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        index = json.loads((d / "model.safetensors.index.json").read_text())
        new = change(index)
        (d / "model.safetensors.index.json").write_text(json.dumps(index if new is None else new))

    return edit


def _point(entry: str) -> Callable[[dict[str, Any]], None]:
    """The first tensor of the index mapped to the file name ``entry``."""

    def change(index: dict[str, Any]) -> None:
        first = next(iter(index["weight_map"]))
        index["weight_map"][first] = entry

    return change


def _fifo_shard(d: Path) -> None:
    os.mkfifo(d / "evil.safetensors")
    _index(_point("evil.safetensors"))(d)


def _move_shard_elsewhere(d: Path) -> None:
    """The index names ../<file>: a valid shard beside the directory (another file read as weights)."""
    shutil.copy(d / "model-00001-of-00003.safetensors", d.parent / f"{d.name}-outside.safetensors")
    _index(
        lambda i: i["weight_map"].update(
            {
                k: f"../{d.name}-outside.safetensors"
                for k, v in i["weight_map"].items()
                if v == "model-00001-of-00003.safetensors"
            }
        )
    )(d)


def _lm_head_swapped(d: Path) -> None:
    """Every tensor keeps its shape, but lm_head's bytes are claimed by the embedding's entry: two names, one
    region (a file consistent in shape, its data overlapping)."""
    header, data = _header(d / "model.safetensors")
    header["lm_head.weight"]["data_offsets"] = header["model.embed_tokens.weight"]["data_offsets"]
    _write_header(d / "model.safetensors", header, data)


def _many(*edits: Callable[[Path], None]) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        for e in edits:
            e(d)

    return edit


L0 = "model.layers.0"
HIDDEN = ARGS.dim
# name -> (base, edit). Every one is a directory hpcdist must refuse.
HOSTILE: dict[str, tuple[str, Callable[[Path], None]]] = {
    # config.json itself
    "config-not-json": ("single", _config_text("{not json")),
    "config-a-list": ("single", _config_text("[1, 2]")),
    "config-nested-100k": ("single", _config_text("[" * 100_000 + "]" * 100_000)),
    "config-not-utf8": ("single", _config_text(b'{"model_type": "llama\xff\xfe"}')),
    "config-huge": ("single", _config_text('{"model_type": "llama", "pad": "' + "x" * 3_000_000 + '"}')),
    "config-fifo": ("single", _fifo("config.json")),
    "config-a-directory": ("single", _replace_with_dir("config.json")),
    "config-link-to-fifo": ("single", _many(_fifo("elsewhere-fifo"), _symlink("config.json", "elsewhere-fifo"))),
    "model-type-gpt2": ("single", _config(model_type="gpt2")),
    "model-type-missing": ("single", _config(model_type=_DELETE)),
    "rope-scaling-string": ("single", _config(rope_scaling="linear")),
    "rope-scaling-list": ("single", _config(rope_scaling=[1, 2])),
    "rope-scaling-llama3": ("single", _config(rope_scaling={"rope_type": "llama3", "factor": 8.0})),
    "rope-parameters-string": ("single", _config(rope_parameters="yarn")),
    "heads-zero": ("single", _config(num_attention_heads=0)),
    "heads-negative": ("single", _config(num_attention_heads=-4)),
    "heads-string": ("single", _config(num_attention_heads="4")),
    "hidden-float": ("single", _config(hidden_size=32.0)),
    "hidden-bool": ("single", _config(hidden_size=True)),
    "hidden-2-pow-20": ("single", _config(hidden_size=2**20, head_dim=None)),
    "layers-million": ("single", _config(num_hidden_layers=1_000_000)),
    "layers-more-than-weights": ("single", _config(num_hidden_layers=3)),
    "layers-fewer-than-weights": ("single", _config(num_hidden_layers=1)),
    "vocab-bigger-than-weights": ("single", _config(vocab_size=300)),
    "vocab-2-pow-40": ("single", _config(vocab_size=2**40)),
    "vocab-5000-digits": ("single", _config_raw("vocab_size", "9" * 5000)),
    "max-pos-1e30": ("single", _config(max_position_embeddings=1e30)),
    "max-pos-1e12-int": ("single", _config(max_position_embeddings=10**12)),
    "max-pos-zero": ("single", _config(max_position_embeddings=0)),
    "tie-string-false": ("single", _config(tie_word_embeddings="false")),
    "tie-false-weights-without-head": ("single", _resave_without("lm_head.weight")),
    "norm-eps-nan": ("single", _config_raw("rms_norm_eps", "NaN")),
    "norm-eps-negative": ("single", _config(rms_norm_eps=-1e-5)),
    "norm-eps-string": ("single", _config(rms_norm_eps="1e-5")),
    "rope-theta-1e999": ("single", _config_raw("rope_theta", "1e999")),
    "rope-theta-infinity": ("single", _config_raw("rope_theta", "Infinity")),
    "rope-theta-zero": ("single", _config(rope_theta=0)),
    "head-dim-wrong": ("single", _config(head_dim=6)),
    "head-dim-string": ("single", _config(head_dim="8")),
    "kv-heads-not-dividing": ("single", _config(num_key_value_heads=3)),
    "kv-heads-other-than-weights": ("single", _config(num_key_value_heads=4)),
    "intermediate-other-than-weights": ("single", _config(intermediate_size=65)),
    "attention-bias": ("single", _config(attention_bias=True)),
    "attention-bias-string": ("single", _config(attention_bias="false")),
    "hidden-act-gelu": ("single", _config(hidden_act="gelu")),
    "memory-4tb": (
        "single",
        _config(
            vocab_size=2**20,
            hidden_size=2**17,
            num_attention_heads=2**10,
            num_key_value_heads=2**10,
            head_dim=128,
            intermediate_size=2**19,
        ),
    ),
    "tokenizer-fifo": ("single", _fifo("tokenizer.json")),
    "tokenizer-config-a-directory": ("single", _replace_with_dir("tokenizer_config.json")),
    # model.safetensors
    "weights-missing": ("single", lambda d: (d / "model.safetensors").unlink()),
    "weights-fifo": ("single", _fifo("model.safetensors")),
    "weights-a-directory": ("single", _replace_with_dir("model.safetensors")),
    "weights-link-to-dev-zero": ("single", _symlink("model.safetensors", "/dev/zero")),
    "weights-empty": ("single", _raw_file("model.safetensors", b"")),
    "weights-truncated-data": ("single", _truncate("model.safetensors", -100)),
    "weights-truncated-header": ("single", _truncate("model.safetensors", 20)),
    "header-length-2-pow-63": ("single", _raw_file("model.safetensors", struct.pack("<Q", 2**63) + b"{}")),
    "header-not-json": ("single", lambda d: _write_header(d / "model.safetensors", None, b"", raw=b"{nope")),
    "header-a-list": ("single", lambda d: _write_header(d / "model.safetensors", [1], b"")),
    "header-nested-100k": (
        "single",
        lambda d: _write_header(d / "model.safetensors", None, b"", raw=b"[" * 100_000 + b"]" * 100_000),
    ),
    "header-offsets-past-end": ("single", _edit_header(_set_tensor("model.norm.weight", data_offsets=[0, 10**12]))),
    "header-offsets-reversed": ("single", _edit_header(_set_tensor("model.norm.weight", data_offsets=[128, 0]))),
    "header-dtype-i32": ("single", _edit_header(_set_tensor("model.norm.weight", dtype="I32"))),
    "header-dtype-unknown": ("single", _edit_header(_set_tensor("model.norm.weight", dtype="Q4"))),
    "header-shape-negative": ("single", _edit_header(_set_tensor("model.norm.weight", shape=[-32]))),
    "header-shape-string": ("single", _edit_header(_set_tensor("model.norm.weight", shape=["32"]))),
    "header-size-mismatch": ("single", _edit_header(_set_tensor("model.norm.weight", shape=[33]))),
    "tensor-missing": ("single", _resave_without(f"{L0}.self_attn.o_proj.weight")),
    "tensor-dropped-from-header": ("single", _edit_header(_drop_tensor(f"{L0}.self_attn.o_proj.weight"))),
    "gate-transposed": ("single", _reshape(f"{L0}.mlp.gate_proj.weight", [HIDDEN, 64])),
    "embed-transposed": ("single", _reshape("model.embed_tokens.weight", [HIDDEN, 258])),
    "qproj-flattened": ("single", _reshape(f"{L0}.self_attn.q_proj.weight", [HIDDEN * HIDDEN])),
    "norm-2d": ("single", _reshape("model.norm.weight", [1, HIDDEN])),
    "overlapping-tensors": ("single", _lm_head_swapped),
    # the index of a sharded directory
    "index-fifo": ("sharded", _fifo("model.safetensors.index.json")),
    "index-not-json": ("sharded", _raw_file("model.safetensors.index.json", b"{nope")),
    "index-huge": (
        "sharded",
        _raw_file("model.safetensors.index.json", b'{"weight_map": {}, "p": "' + b"x" * 17_000_000 + b'"}'),
    ),
    "index-map-a-list": ("sharded", _index(lambda i: i.update(weight_map=[1, 2]))),
    "index-entry-int": ("sharded", _index(_point(7))),  # type: ignore[arg-type]
    "index-entry-fifo": ("sharded", _fifo_shard),
    "index-entry-parent": ("sharded", _move_shard_elsewhere),
    "index-entry-absolute": ("sharded", _index(_point("/etc/passwd"))),
    "index-entry-dev-zero": ("sharded", _index(_point("/dev/zero"))),
    "index-entry-subdir": ("sharded", _index(_point("sub/model.safetensors"))),
    "index-entry-nul": ("sharded", _index(_point("model-00001-of-00003.safetensors\x00x"))),
    "index-entry-missing-file": ("sharded", _index(_point("model-00009-of-00009.safetensors"))),
    "index-entry-wrong-shard": (
        "sharded",
        _index(lambda i: i["weight_map"].update({"model.norm.weight": "model-00001-of-00003.safetensors"})),
    ),
    "index-entry-directory": ("sharded", _many(lambda d: (d / "sub").mkdir(), _index(_point("sub")))),
    "shard-fifo": ("sharded", _fifo("model-00002-of-00003.safetensors")),
    "shard-truncated": ("sharded", _truncate("model-00003-of-00003.safetensors", -4)),
    "shard-shape-wrong": (
        "sharded",
        _edit_header(_set_tensor("model.norm.weight", shape=[2, 16]), file="model-00003-of-00003.safetensors"),
    ),
}
if os.geteuid() == 0:  # links made by another user: only root can make them here (lchown)
    HOSTILE["weights-foreign-link"] = (
        "single",
        _many(
            lambda d: shutil.copy(d / "model.safetensors", d / "real.safetensors"),
            _symlink("model.safetensors", "real.safetensors", uid=OTHER_UID),
        ),
    )
    HOSTILE["config-foreign-link"] = (
        "single",
        _many(
            lambda d: shutil.copy(d / "config.json", d / "real.json"),
            _symlink("config.json", "real.json", uid=OTHER_UID),
        ),
    )


# --------------------------------------------------------------------------------------------------- harness
def _bounded(commands: dict[str, Callable[[], str | None]]) -> dict[str, str | None]:
    """Each command's verdict, the commands run one after another in a forked child for at most BOUND_S in all (then
    killed: the command running and those after it get a verdict saying so). A thread cannot bound these calls: the
    FIFO hang blocked in open() inside safetensors while holding the GIL, so the whole process, the test's own timer
    included, stopped (that is also why SIGTERM could not end the command). A fork costs milliseconds; importing
    torch in a fresh interpreter would cost seconds per command."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a line per verdict as it comes, then leave without running pytest's exit handlers
        try:
            os.close(read)
            with os.fdopen(write, "w") as out:
                for command, fn in commands.items():
                    sys.stderr = io.StringIO()
                    try:
                        verdict = fn()
                    except BaseException as e:  # anything escaping is what the test reports
                        verdict = f"raised {type(e).__name__}: {' '.join(str(e).split())[:300]}"
                    out.write(json.dumps([command, verdict]) + "\n")
                    out.flush()
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + BOUND_S
    killed = False
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            killed = True
            break
        time.sleep(0.005)
    with os.fdopen(read) as f:
        verdicts = dict(json.loads(line) for line in f)
    missing = [c for c in commands if c not in verdicts]
    for i, command in enumerate(missing):
        verdicts[command] = f"still running after {BOUND_S:.0f} s (killed)" if i == 0 else "never reached"
        if not killed:
            verdicts[command] = "the child died without a verdict"
    return verdicts


def _cli(argv: list[str], directory: Path, lines: int = 1) -> str | None:
    """None when the command refused the directory as it should: exit 2 and ``lines`` lines naming the directory (a
    config problem comes as the loader's header plus one line); else what went wrong. Runs in the child
    (:func:`_bounded`): stderr is a StringIO there."""
    code = cli.main(argv)
    err = sys.stderr.getvalue()  # type: ignore[attr-defined]
    shown = " ".join(err.split())[:300]
    if "Traceback" in err or "unexpected error" in err:
        return f"exit {code}: {shown}"
    if code != 2:
        return f"exit {code} (accepted)" if code == 0 else f"exit {code}: {shown}"
    if err.count("\n") != lines or str(directory) not in err:
        return f"not {lines} line(s) naming {directory}: {shown}"
    return None


def _model_state() -> tuple[Transformer, Checkpointable]:
    model = Transformer(ARGS)
    state = Checkpointable(
        dcp_state=lambda: {"model": model.state_dict()},
        load_dcp_state=lambda s: model.load_state_dict(s["model"]),
        trainer_state=dict,
        load_trainer_state=lambda _: None,
    )
    return model, state


def _load_into(directory: Path) -> str | None:
    """The trainer's checkpoint.init_from path (``Checkpointer.resume``): a refusal is a ConfigError, which ``hpcdist
    train`` prints as one message with exit 2 on every rank."""
    _, state = _model_state()
    try:
        load_into(directory, state, ARGS)
    except ConfigError as e:
        return None if str(directory) in str(e) else f"a ConfigError not naming {directory}: {e}"
    return "accepted"


def _commands(directory: Path, work: Path) -> dict[str, Callable[[], str | None]]:
    yaml = work / "empty.yaml"
    yaml.write_text("{}\n")
    config = [
        str(yaml),
        *MODEL_KEYS,
        "data.source=synthetic",
        "data.seq_len=32",
        f"run.dir={work / 'run'}",
        f"checkpoint.init_from={directory}",
    ]
    return {
        "import": lambda: _cli(["import", str(directory), "--out", str(work / "imported")], directory),
        "generate": lambda: _cli(["generate", str(directory), "--prompt", "hi", "--max-new-tokens", "2"], directory),
        "eval": lambda: _cli(["eval", str(directory), "--data", str(work / "no-data")], directory),
        "init_from (config)": lambda: _cli(["config", *config], directory, lines=2),
        "init_from (load_into)": lambda: _load_into(directory),
    }


# every single-process DCP call here (import, init_from) says it is meant: hpcdist.checkpoint.single_process_dcp
@pytest.mark.filterwarnings("error:torch.distributed is .*assuming the intent is to (save|load) in a single process")
def test_the_valid_directory_passes_every_command(
    bases: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The control: the same harness accepts the directories every hostile case is derived from."""
    for kind, base in bases.items():
        work = tmp_path / kind
        work.mkdir()
        _commands(base, work)  # writes the empty YAML
        assert cli.main(["import", str(base), "--out", str(work / "imported")]) == 0, capsys.readouterr().err
        assert (work / "imported" / "step-00000000" / "COMPLETE").is_file()
        assert cli.main(["generate", str(base), "--prompt", "hi", "--max-new-tokens", "2"]) == 0
        config = [
            str(work / "empty.yaml"),
            *MODEL_KEYS,
            "data.source=synthetic",
            "data.seq_len=32",
            f"run.dir={work / 'run'}",
            f"checkpoint.init_from={base}",
        ]
        assert cli.main(["config", *config]) == 0, capsys.readouterr().err
        model, state = _model_state()

        load_into(base, state, ARGS)
        torch.manual_seed(0)
        reference = Transformer(ARGS)  # the weights _write_base saved
        for k, v in reference.state_dict().items():
            assert torch.equal(model.state_dict()[k], v), k


def test_the_hugging_face_cache_layout_is_read(bases: dict[str, Path], tmp_path: Path) -> None:
    """Your own links are followed: the hub cache links snapshots/<rev>/<file> to ../../blobs/<sha>."""
    blobs, snapshot = tmp_path / "cache" / "blobs", tmp_path / "cache" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(bases["sharded"].iterdir())):
        shutil.copy(f, blobs / f"sha{i}")
        os.symlink(f"../../blobs/sha{i}", snapshot / f.name)
    weights = HFWeights(snapshot)
    torch.manual_seed(0)
    reference = Transformer(ARGS).state_dict()
    for fqn in weights.fqns():
        assert torch.equal(weights.tensor(fqn), reference[fqn]), fqn


def test_hostile_directories_are_refused_by_every_command(bases: dict[str, Path], tmp_path: Path) -> None:
    """Each hostile directory x import / generate / eval / init_from (config load and the trainer's load): exit 2 and
    one readable message, within BOUND_S, nothing imported. Every failure is collected and shown at once."""
    assert len(HOSTILE) >= 50
    failures: list[str] = []
    t0 = time.perf_counter()
    for name, (base, edit) in HOSTILE.items():
        directory = tmp_path / name / "hf"
        directory.parent.mkdir()
        shutil.copytree(bases[base], directory)
        edit(directory)
        for command, problem in _bounded(_commands(directory, tmp_path / name)).items():
            if problem is not None:
                failures.append(f"{name} x {command}: {problem}")
        if (tmp_path / name / "imported" / "step-00000000" / "COMPLETE").exists():
            failures.append(f"{name}: import wrote a complete checkpoint")
    elapsed = time.perf_counter() - t0
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures)
    assert elapsed < 5 * 60, elapsed


def test_a_fifo_named_by_the_index_does_not_hang_the_cli(bases: dict[str, Path], tmp_path: Path) -> None:
    """The real CLI in a subprocess (its signal handlers, its imports): an index entry naming a FIFO used to block in
    open() forever, and SIGTERM could not stop it. Now it is one line and exit 2, well within the bound."""
    directory = tmp_path / "hf"
    shutil.copytree(bases["sharded"], directory)
    _fifo_shard(directory)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3]), "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "hpcdist", "import", str(directory), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "evil.safetensors" in proc.stderr, proc.stderr
    assert "not a regular file" in proc.stderr, proc.stderr
    assert time.perf_counter() - t0 < 120
