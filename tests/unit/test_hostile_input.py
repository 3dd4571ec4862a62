"""Hostile input: fuzzed command lines never produce a traceback, run directories that belong to someone else or
cannot be written are refused before anything starts, files follow the user's umask, nothing is unpickled.

(The config/override fuzzers live in test_config.py: 300 + 300 examples; the 400 command lines here make 1,000.)
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcdist.cli import main
from hpcdist.config import ConfigError, check_run_dir
from hpcdist.trainer import Trainer
from tests.dist.harness import single
from tests.unit.test_config import _OVERRIDES

ROOT = Path(__file__).resolve().parents[2]
HOSTILE = ["a b", "it's", 'say "hi"', "$(touch PWNED)", "`id`", "new\nline", "semi;colon", "-rf", "~", "%j", ""]

_FLAGS = ["--nodes", "--gpus-per-node", "--gpu-mem", "--world-size", "--cluster", "--tokens", "--top", "-h"]
_OPTIONS = st.lists(st.sampled_from(_FLAGS) | st.sampled_from(HOSTILE) | st.text(max_size=12), max_size=4)
_COMMANDS = st.sampled_from([["config", "configs/demo.yaml"], ["plan", "configs/train_13b.yaml"], ["config"], ["plan"]])


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
@given(command=_COMMANDS, options=_OPTIONS, overrides=_OVERRIDES)
def test_fuzzed_command_lines_never_raise(command, options, overrides, capsys) -> None:
    """`hpcdist config|plan` with random options and overrides: an exit code and a message, never a traceback."""
    try:
        code = main([*command, *overrides, *options])
    except SystemExit as e:  # argparse: usage errors exit 2, -h exits 0
        code = e.code
    assert code in (0, 1, 2, None)
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    if code not in (0, None):
        assert out.err.strip(), "a failure must say why"


# --------------------------------------------------------------------------------------------- run directories


def test_run_dir_owned_by_another_user_is_refused(small_cfg, tmp_path: Path, capsys) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to chown a directory to another user (CI runs as root)")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 4242, 4242)
    with pytest.raises(ConfigError, match=r"run.dir: .* belongs to uid 4242, not to you .*choose your own run.dir"):
        check_run_dir(small_cfg(run_dir=theirs))
    # through the CLI: exit 2 and the message, nothing written into their directory
    assert main(["train", "configs/demo.yaml", f"run.dir={theirs}"]) == 2
    assert "belongs to uid 4242" in capsys.readouterr().err
    assert list(theirs.iterdir()) == []


@contextlib.contextmanager
def _read_only_dir(path: Path) -> Iterator[Path]:
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a read-only tmpfs (needs root / CAP_SYS_ADMIN): {r.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_unwritable_run_dir_is_refused(small_cfg, tmp_path: Path) -> None:
    with _read_only_dir(tmp_path / "ro") as ro:  # root ignores permission bits: a read-only mount stops it too
        with pytest.raises(ConfigError, match=r"run.dir: cannot write in .*Read-only file system"):
            check_run_dir(small_cfg(run_dir=ro / "run"))
        with pytest.raises(ConfigError, match=r"checkpoint.dir: cannot write in"):
            check_run_dir(small_cfg(f"checkpoint.dir={ro}/ck", run_dir=tmp_path / "ok"))


def test_run_dir_that_is_a_file_is_refused(small_cfg, tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        check_run_dir(small_cfg(run_dir=f))


@pytest.mark.parametrize("name", ["with space", "quote's", "$(touch PWNED)", "semi;colon`id`"])
def test_hostile_run_dir_names_are_plain_paths(small_cfg, tmp_path: Path, name: str) -> None:
    """A run directory named like a shell injection is just a name: the run writes into exactly that directory."""
    cfg = small_cfg("train.steps=1", "checkpoint.save_final=true", "train.micro_batch_size=4", run_dir=tmp_path / name)
    check_run_dir(cfg)
    single(lambda env, c: Trainer(c, env).train(), cfg)
    assert (tmp_path / name / "checkpoints" / "step-00000001" / "COMPLETE").is_file()
    assert not (tmp_path / "PWNED").exists() and not Path("PWNED").exists()


# --------------------------------------------------------------------------------------------- files written


def test_files_follow_the_users_umask(small_cfg, tmp_path: Path) -> None:
    """umask 027: every file of a run (config, metrics, checkpoint shards, manifest, marker, RNG) is 0640 or
    tighter, never group-writable or world-readable; directories 0750."""
    cfg = small_cfg("train.steps=2", "checkpoint.save_final=true", "train.micro_batch_size=4", run_dir=tmp_path / "r")
    old = os.umask(0o027)
    try:
        single(lambda env, c: Trainer(c, env).train(), cfg)
    finally:
        os.umask(old)
    paths = list((tmp_path / "r").rglob("*"))
    assert any(p.suffix == ".distcp" for p in paths) and any(p.name == "MANIFEST.json" for p in paths)
    for p in paths:
        mode = p.stat().st_mode & 0o777
        assert mode & 0o027 == 0, f"{p}: {oct(mode)}"
        if p.is_file():
            assert mode == 0o640, f"{p}: {oct(mode)} (created with a mode that ignores the umask?)"


def test_no_pickle_loading_in_hpcdist() -> None:
    """Every torch.load in the package passes weights_only=True: a checkpoint file can never run code."""
    calls = []
    for py in (ROOT / "hpcdist").rglob("*.py"):
        for node in ast.walk(ast.parse(py.read_text())):
            if (
                isinstance(node, ast.Call)
                and ast.unparse(node.func) in ("torch.load", "load")
                and "torch" in ast.unparse(node.func)
            ):
                kw = {k.arg: k.value for k in node.keywords}
                calls.append((py.name, node.lineno))
                assert "weights_only" in kw and ast.literal_eval(kw["weights_only"]) is True, f"{py}:{node.lineno}"
    assert calls, "expected the RNG restore to use torch.load"
    # checkpoints and configs: no pickle anywhere on their path (submitit's own job-result pickle, read by
    # hpcdist.launch for `JobHandle.result()`, is submitit's format, not a checkpoint or config)
    for module in ("checkpoint.py", "config", "trainer.py", "data", "parallel"):
        for py in [ROOT / "hpcdist" / module] if module.endswith(".py") else (ROOT / "hpcdist" / module).rglob("*.py"):
            assert not re.search(r"import pickle|pickle\.load|pickle_load", py.read_text()), py
