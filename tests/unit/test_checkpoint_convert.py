"""``hpcdist checkpoint convert``: a step of the real trainer, converted, read by torch alone (a subprocess that never
imports hpcdist) through stock ``dcp.load``, ``dcp_to_torch_save`` and ``torch.load(weights_only=True)``; every
entry equals what hpcdist's own resume of the original step holds. Bad input is one line and writes nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from hpcdist import cli
from hpcdist.checkpoint.names import MARKER, step_dir
from hpcdist.trainer import Trainer
from tests.conftest import small_config
from tests.dist.harness import single
from tests.training import train

STEPS = 3
TRAIN = [
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "checkpoint.save_final=true",
    "checkpoint.keep_last=1",
]

# torch alone: the stock DCP output loaded into a state dict built from its metadata, the same output through
# dcp_to_torch_save, and the --torch-save file; both nested dicts must be the same, and all of it goes back as one
# weights_only file
STOCK_READ = """
import sys
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

out, file, via, result = sys.argv[1:5]
meta = dcp.FileSystemReader(out).read_metadata()
loaded = {
    key: torch.empty(m.size, dtype=m.properties.dtype)
    for key, m in meta.state_dict_metadata.items()
    if isinstance(m, TensorStorageMetadata)
}
dcp.load(loaded, storage_reader=dcp.FileSystemReader(out), no_dist=True)
dcp_to_torch_save(out, via)
theirs = flatten_state_dict(torch.load(via, weights_only=True))[0]
ours = flatten_state_dict(torch.load(file, weights_only=True))[0]
assert sorted(theirs) == sorted(ours), (sorted(theirs), sorted(ours))
for key, value in theirs.items():
    same = torch.equal(value, ours[key]) if isinstance(value, torch.Tensor) else value == ours[key]
    assert same and type(value) is type(ours[key]), key
assert "hpcdist" not in sys.modules, sorted(m for m in sys.modules if m.startswith("hpcdist"))
torch.save({"dcp": loaded, "torch_save": ours}, result)
"""


def _resumed(env: Any, cfg: Any) -> dict[str, Any]:
    """The DCP state (model + optimizer) hpcdist's own resume of the step holds, flattened as DCP keys it."""
    trainer = Trainer(cfg, env)
    return flatten_state_dict(trainer.strategy.dcp_state())[0]


@pytest.fixture(scope="module")
def step(tmp_path_factory: pytest.TempPathFactory, corpus_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("convert")
    cfg = small_config(root / "run", corpus_dir, f"train.steps={STEPS}", *TRAIN)
    assert single(train, cfg)["step"] == STEPS
    return step_dir(Path(cfg.checkpoint_dir), STEPS)


def _stock_read(tmp_path: Path, out: Path, file: Path) -> dict[str, Any]:
    result = tmp_path / "stock.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = [sys.executable, "-c", STOCK_READ, str(out), str(file), str(tmp_path / "via.pt"), str(result)]
    proc = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return torch.load(result, weights_only=True)


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want.detach().cpu())
    return got == want


def test_stock_torch_reads_the_conversion_and_it_equals_hpcdists_resume(
    step: Path, tmp_path: Path, corpus_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, file = tmp_path / "dcp", tmp_path / "state.pt"
    (out).mkdir()  # an empty directory is taken
    assert cli.main(["checkpoint", "convert", str(step), "--out", str(out), "--torch-save", str(file)]) == 0
    assert "stock DCP" in capsys.readouterr().out
    assert (out / ".metadata").is_file() and (out / "trainer_state.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left beside them
    stock = _stock_read(tmp_path, out, file)

    cfg = small_config(tmp_path / "resume", corpus_dir, f"train.steps={STEPS}", *TRAIN, f"checkpoint.resume={step}")
    want = single(_resumed, cfg)
    tensors = {key: value for key, value in want.items() if isinstance(value, torch.Tensor)}
    assert any(k.startswith("model.") for k in tensors) and any(k.startswith("optim.") for k in tensors)
    assert sorted(stock["dcp"]) == sorted(tensors)
    for key, value in tensors.items():
        assert _same(stock["dcp"][key], value), key
    assert sorted(stock["torch_save"]) == sorted(want)
    for key, value in want.items():
        assert _same(stock["torch_save"][key], value), key
    assert (step / MARKER).is_file()  # the source is untouched


def _one_line(capsys: pytest.CaptureFixture[str], argv: list[str], *fragments: str) -> None:
    code = cli.main(["checkpoint", "convert", *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_bad_input_is_one_line_and_writes_nothing(
    step: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, file = tmp_path / "out", tmp_path / "state.pt"
    args = ["--out", str(out), "--torch-save", str(file)]
    _one_line(capsys, [str(tmp_path / "nowhere"), *args], "is not a directory")
    (tmp_path / "plain").mkdir()
    _one_line(capsys, [str(tmp_path / "plain"), *args], f"no {MARKER} marker")
    assert not out.exists() and not file.exists()

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    _one_line(capsys, [str(step), "--out", str(busy)], "exists and is not empty")
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    file.write_text("mine")
    _one_line(capsys, [str(step), *args], "--torch-save", "exists")
    assert file.read_text() == "mine" and not out.exists()
    file.unlink()

    damaged = tmp_path / "ckpt" / step.name
    shutil.copytree(step, damaged)
    shard = sorted(damaged.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    _one_line(capsys, [str(damaged), *args], "is damaged", shard.name, "sha256")
    assert (damaged / MARKER).is_file()  # refused, not demoted: the converter changes no checkpoint

    untrusted = tmp_path / "other" / step.name
    shutil.copytree(step, untrusted)
    untrusted.joinpath("trainer_state.json").chmod(0o666)
    _one_line(capsys, [str(untrusted), *args], "cannot be trusted")
    assert not out.exists() and not file.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
