"""The ``hpcdist`` command line, run as a user runs it: ``python -m hpcdist ...`` in a subprocess.

No test here trains: every ``train`` invocation carries a config that fails validation, which happens before
the trainer (or any process group) is built.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import yaml

from hpcdist import cli
from hpcdist import config as config_mod
from hpcdist.data import ByteTokenizer, TokenDataset
from tests.unit.harness import hpcdist

REPO = Path(__file__).resolve().parents[2]
DEMO = "configs/demo.yaml"


def assert_clean_failure(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    """Non-zero exit, one readable message on stderr naming the problem, no traceback, nothing on stdout."""
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("hpcdist: "), proc.stderr
    for frag in fragments:
        assert frag in proc.stderr, f"{frag!r} not in stderr:\n{proc.stderr}"
    assert proc.stdout == ""


# --------------------------------------------------------------------------------------------------- help


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        ((), ("train", "config", "prepare", "examples:", "hpcdist train configs/demo.yaml")),
        (("train",), ("config", "section.key=value", "CLI > YAML > preset > defaults", "checkpoint.resume=auto")),
        (("config",), ("config", "section.key=value", "--world-size")),
        (("prepare",), ("inputs", "--out", "--glob", "--stdlib", "--dtype", "--shard-tokens", "--max-tokens")),
    ],
    ids=["top", "train", "config", "prepare"],
)
def test_help(args: tuple[str, ...], fragments: tuple[str, ...]) -> None:
    proc = hpcdist(*args, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: hpcdist {' '.join(args)}".rstrip())
    text = " ".join(proc.stdout.split())  # argparse re-wraps descriptions to the terminal width
    for frag in fragments:
        assert frag in text, f"{frag!r} not in help:\n{proc.stdout}"


def test_version() -> None:
    from importlib import metadata

    import hpcdist as pkg

    proc = hpcdist("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"hpcdist {metadata.version('hpcdist')}\n"
    assert metadata.version("hpcdist") == pkg.__version__  # setup.cfg and the package agree


def test_version_without_an_installed_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)  # a checkout on PYTHONPATH, never pip-installed
    from hpcdist import __version__

    assert cli._version() == __version__


def test_description_names_every_strategy() -> None:
    text = " ".join(hpcdist("--help").stdout.split())
    for name in ("DDP", "FSDP2/HSDP", "ZeRO", "3D", "auto"):
        assert name in text, text


def test_no_command_is_a_usage_error() -> None:
    proc = hpcdist()
    assert proc.returncode == 2
    assert "usage: hpcdist" in proc.stderr and "COMMAND" in proc.stderr
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        ((DEMO, "train.stepz=3"), ("train.stepz: unknown key", "did you mean 'steps'?")),
        ((DEMO, "train.steps=ten"), ("train.steps: must be int", "'ten'")),
        (("configs/no-such-config.yaml",), ("configs/no-such-config.yaml", "does not exist")),
        ((DEMO, "trainsteps=3"), ("'trainsteps=3'", "expected section.key=value")),
        ((DEMO, "model.preset=tiny2"), ("model.preset:", "'tiny2'", "tiny")),
    ],
    ids=["unknown-key", "wrong-type", "missing-file", "override-syntax", "unknown-preset"],
)
def test_train_rejects_bad_config_before_training(tmp_path: Path, args: tuple[str, ...], fragments: tuple[str, ...]):
    run_dir = tmp_path / "run"
    proc = hpcdist("train", *args, f"run.dir={run_dir}")
    assert_clean_failure(proc, "Invalid configuration", *fragments)
    assert not run_dir.exists(), "a bad config must fail before the run directory is created"


# ---------------------------------------------------------------------------------------- one message per job

_RUN_DIR_IS_A_FILE = "exists and is not a directory"


def _as_rank(rank: int, *, nodes: int, args: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    """``hpcdist train ARGS`` as rank ``rank`` of a 2-rank torchrun-style job on 1 or 2 nodes (it fails before any
    rendezvous)."""
    per_node = 2 // nodes
    layout = {"RANK": rank, "LOCAL_RANK": rank % per_node, "WORLD_SIZE": 2, "LOCAL_WORLD_SIZE": per_node}
    return hpcdist("train", *args, environ={k: str(v) for k, v in layout.items()})


def test_config_error_is_printed_by_rank_0_only(tmp_path: Path) -> None:
    args = (DEMO, "train.stepz=3", f"run.dir={tmp_path / 'run'}")
    first, other = _as_rank(0, nodes=1, args=args), _as_rank(1, nodes=1, args=args)
    assert_clean_failure(first, "Invalid configuration", "train.stepz: unknown key")
    assert other.returncode == first.returncode == 2
    assert other.stderr == other.stdout == ""  # the same error N times would bury it


def test_run_dir_error_is_printed_once_per_node(tmp_path: Path) -> None:
    """run.dir as each host sees it (a node-local mount can differ): the first rank of every node says so."""
    run_dir = tmp_path / "file"
    run_dir.write_text("")
    args = (DEMO, f"run.dir={run_dir}")
    first, same_node, second_node = (_as_rank(r, nodes=n, args=args) for r, n in ((0, 1), (1, 1), (1, 2)))
    assert_clean_failure(first, _RUN_DIR_IS_A_FILE)
    assert_clean_failure(second_node, "hpcdist: rank 1 on ", _RUN_DIR_IS_A_FILE)
    assert same_node.stderr == "" and same_node.returncode == first.returncode == second_node.returncode == 2


# --------------------------------------------------------------------------------------------------- config


def test_config_prints_resolved_yaml(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = hpcdist("config", DEMO, "train.steps=7", f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    assert printed["train"]["steps"] == 7
    assert printed["run"]["dir"] == str(run_dir)
    assert printed["model"]["preset"] == "tiny"
    # what is printed is exactly the resolved config: it loads back to the same JobConfig
    out = tmp_path / "printed.yaml"
    out.write_text(proc.stdout)
    assert config_mod.load(out) == config_mod.load(REPO / DEMO, ["train.steps=7", f"run.dir={run_dir}"])
    assert not run_dir.exists()


def test_config_world_size_checks_batch_divisibility(tmp_path: Path) -> None:
    batch = ("train.global_batch_size=16", "train.micro_batch_size=8")
    proc = hpcdist("config", DEMO, *batch, f"run.dir={tmp_path}", "--world-size", "3")
    assert_clean_failure(
        proc,
        "train.global_batch_size (16) must be divisible by train.micro_batch_size (8) x data-parallel size (3) = 24",
        "e.g. train.global_batch_size=24",
    )


# --------------------------------------------------------------------------------------------------- prepare

DOC_A = "def f(x):\n    return x + 1\n" * 2
DOC_B = "caf\u00e9 \u2603 -- second document\n"


def test_prepare_writes_shards_token_dataset_can_read(tmp_path: Path) -> None:
    src = tmp_path / "in"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text(DOC_A, encoding="utf-8")
    (src / "sub" / "b.txt").write_text(DOC_B, encoding="utf-8")
    (src / "skipped.md").write_text("not matched by --glob")
    out = tmp_path / "out"

    proc = hpcdist("prepare", src, "--out", out, "--shard-tokens", "32")
    assert proc.returncode == 0, proc.stderr
    assert "prepared 2 files" in proc.stdout

    tok = ByteTokenizer()
    stream = np.concatenate([tok.encode(DOC_A), tok.encode(DOC_B)])  # sorted order, EOS after each document
    meta = json.loads((out / "meta.json").read_text())
    assert meta["num_tokens"] == len(stream)
    assert meta["num_documents"] == 2
    shards = sorted(out.glob("shard-*.bin"))
    assert [s.name for s in shards] == [s["name"] for s in meta["shards"]]
    assert len(shards) == -(-len(stream) // 32)
    on_disk = np.concatenate([np.fromfile(s, dtype=np.uint16) for s in shards])
    np.testing.assert_array_equal(on_disk, stream)

    # 32-token shards and 8-token windows: the windows tile each shard, so they read back the whole stream
    ds = TokenDataset(out, seq_len=7)
    assert ds.vocab_size == tok.vocab_size
    windows = [ds[i] for i in range(len(ds))]
    assert all(w.shape == (8,) for w in windows)
    full = np.concatenate(windows)
    np.testing.assert_array_equal(full, stream[: len(full)])
    assert len(stream) - len(full) < 8
    assert tok.decode(full).startswith(DOC_A)


def test_prepare_missing_input_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    out = tmp_path / "out"
    proc = hpcdist("prepare", missing, "--out", out)
    assert_clean_failure(proc, "prepare: input", str(missing), "does not exist")
    assert not out.exists()


# --------------------------------------------------------------------------------------------------- main() in-process
# Same entry point without a fresh interpreter (each subprocess above pays ~2 s of torch import).


def run_main(*argv: str | os.PathLike[str]) -> int:
    try:
        return cli.main([str(a) for a in argv])
    except SystemExit as e:  # argparse errors and --help exit
        return e.code if isinstance(e.code, int) else 1


def test_main_reports_every_problem_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = run_main("config", REPO / DEMO, "train.stepz=3", "optim.schedule=step", "=3", f"run.dir={tmp_path}")
    out, err = capsys.readouterr()
    assert rc != 0 and out == ""
    assert err.startswith("hpcdist: Invalid configuration (3 problems):")
    for frag in ("train.stepz: unknown key", "optim.schedule: 'step' is not one of", "'=3'"):
        assert frag in err


def test_main_config_world_size_that_divides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main("config", REPO / DEMO, f"run.dir={tmp_path}", "--world-size", "2") == 0
    assert yaml.safe_load(capsys.readouterr().out)["train"]["global_batch_size"] == 16


def test_main_config_accepts_overrides_after_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main("config", REPO / DEMO, "--world-size", "2", "train.steps=7", f"run.dir={tmp_path}") == 0
    assert yaml.safe_load(capsys.readouterr().out)["train"]["steps"] == 7


def test_main_config_rejects_world_size_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main("config", REPO / DEMO, f"run.dir={tmp_path}", "--world-size", "0") != 0
    assert "--world-size" in capsys.readouterr().err


def test_main_prepare_directory_without_matching_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.md").write_text("# only markdown\n")
    assert run_main("prepare", tmp_path, "--out", tmp_path / "out") != 0
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("hpcdist: prepare: no input files") and "--glob" in err
    assert not (tmp_path / "out").exists()


def test_main_prepare_bad_option_value_is_a_clean_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.txt").write_text("hello\n")
    assert run_main("prepare", tmp_path / "a.txt", "--out", tmp_path / "out", "--shard-tokens", "0") != 0
    assert "shard-tokens" in capsys.readouterr().err  # argparse names the option and the rule


def test_output_into_a_closed_pipe_ends_quietly() -> None:
    """`hpcdist plan ... | head -1` printed a BrokenPipeError traceback once head had its line."""
    cmd = f"{sys.executable} -m hpcdist plan configs/train_13b.yaml --nodes 4 --gpus-per-node 8 | head -1"
    p = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr[-2000:]
    # 141 (128 + SIGPIPE, as a C tool killed by it) when head left first; 0 when the whole table fit the pipe
    assert p.stdout.count("\n") == 1 and p.returncode in (0, 141), p.returncode


def test_a_log_into_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    """`hpcdist logs JOB | head -1` said `hpcdist: logs: cannot read None: Broken pipe` (exit 2): logs took the
    closed stdout for an unreadable log. Every command's closed pipe ends the one way."""
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / "123_0_log.out").write_text("a line of the log\n" * 200_000)
    cmd = f"{sys.executable} -m hpcdist logs 123 --run-dir {tmp_path} | head -1"
    p = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.stderr == "" and p.stdout == "a line of the log\n", p.stderr[-2000:]
    assert p.returncode in (0, 141), p.returncode


# ------------------------------------------------------------------------------------- thin CLI


def test_cli_holds_no_command_body() -> None:
    """Hpcdist/cli.py is argparse, dispatch and the one error wrapper; each command's body lives beside
    its library and refuses through CommandError (the one place that prints ``hpcdist: <line>`` is cli._fail)."""
    import ast
    import importlib

    tree = ast.parse((REPO / "hpcdist" / "cli.py").read_text())
    functions = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert not {f for f in functions if f.startswith("cmd_")}, functions
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "_fail"]
    assert len(calls) <= 4, f"{len(calls)} _fail calls in cli.py: raise hpcdist.base.errors.CommandError in the command"
    for name, target in cli.COMMANDS.items():
        assert isinstance(target, str) and not target.startswith("hpcdist.cli"), (name, target)
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), target


def test_help_of_every_command_imports_no_command_module() -> None:
    """``hpcdist X --help`` stays instant: parsing imports none of the command modules (nor torch)."""
    modules = sorted({t.partition(":")[0] for t in cli.COMMANDS.values() if isinstance(t, str)})
    commands = [c for c in cli.COMMANDS if c != "dry-run"]
    code = (
        "import sys\nfrom hpcdist import cli\n"
        f"for c in {commands!r}:\n"
        "    try:\n        cli._parser().parse_args([*c.split(), *(['train'] if c == 'tokenizer' else []), '--help'])\n"
        "    except SystemExit:\n        pass\n"
        f"print(sorted(m for m in sys.modules if m in {modules!r} or m == 'torch'))"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "[]", p.stdout[-500:]


def test_refusing_turns_the_named_errors_into_one_line_and_lets_others_pass() -> None:
    from hpcdist.base.errors import CommandError, refusing
    from hpcdist.config import ConfigError

    def raising(e: BaseException) -> Callable[[], int]:
        @refusing("thing", ValueError, OSError, passing=(ConfigError,))
        def command() -> int:
            raise e

        return command

    with pytest.raises(CommandError) as info:
        raising(ValueError("bad value"))()
    assert (info.value.message, info.value.code) == ("thing: bad value", 2)
    for passes in (ConfigError("its own line"), BrokenPipeError(), KeyError("a bug"), KeyboardInterrupt()):
        with pytest.raises(type(passes)):
            raising(passes)()


_TORCHRUN_3 = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3"}
_TORCHRUN_3 |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    ("overrides", "launcher", "named"),
    [
        (["data.source=files", "data.path=/nonexistent/corpus"], {}, "no prepared dataset"),
        (["run.dir=/proc/hpcdist-run"], {}, "run.dir"),
        ([], _TORCHRUN_3, "data-parallel size (3)"),  # demo's 16 samples per step do not split over 3 torchrun ranks
    ],
    ids=["data", "run-dir", "world"],
)
def test_a_data_run_dir_or_world_mistake_in_train_is_refused_before_torch_is_imported(
    overrides: list[str], launcher: dict[str, str], named: str
) -> None:
    """Run.main's other torch-free checks (the prepared data, run.dir, the batch split on
    this job's ranks) waited for torch's import too: 63-88 s on this machine under load, for a one-line refusal."""
    code = (
        "import sys\n"
        "from hpcdist import cli\n"
        f"rc = cli.main(['train', 'configs/demo.yaml', *{overrides!r}])\n"
        "print('TORCH', 'torch' in sys.modules, 'RC', rc)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in _TORCHRUN_3}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env={**env, **launcher}, capture_output=True, text=True, timeout=120
    )
    assert "TORCH False RC 2" in out.stdout, out.stdout + out.stderr
    assert named in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_config_mistake_in_train_is_refused_before_torch_is_imported(tmp_path: Path) -> None:
    """``hpcdist train`` validates the config before importing torch and the trainer: a mistake costs a fraction of
    a second, not the 5-25 s of torch's import on a busy node (and the tests that check refusals run that fast
    too). Before, cmd_train imported hpcdist.run (torch, the trainer) first and let run.main validate."""
    code = (
        "import sys\n"
        "from hpcdist import cli\n"
        "rc = cli.main(['train', 'configs/demo.yaml', 'train.steps=-1', 'run.dir=" + str(tmp_path / "run") + "'])\n"
        "print('TORCH', 'torch' in sys.modules, 'RC', rc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert "TORCH False RC 2" in out.stdout, out.stdout + out.stderr
    assert "train.steps" in out.stderr and len([line for line in out.stderr.splitlines() if line.strip()]) == 2
    assert not (tmp_path / "run").exists()  # nothing written for a refused config


# ------------------------------------------------------------------------------------ a discoverable CLI


def test_every_subcommand_and_option_has_help() -> None:
    """Walks the whole argparse tree: a subcommand without a one-line help, or an option / positional without
    help, is a flag nobody can learn from `--help`."""
    from tests.unit.harness import parsers

    silent: list[str] = []
    for path, parser in parsers(cli._parser()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                listed = {id(action.choices[c.dest]) for c in action._choices_actions}  # an alias shares its parser
                silent += [f"{path} {n} (no help line)" for n, sub in action.choices.items() if id(sub) not in listed]
                silent += [f"{path} {c.dest} (empty help)" for c in action._choices_actions if not c.help]
            elif not isinstance(action, argparse._HelpAction) and not action.help:
                silent.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    assert not silent, "without help:\n  " + "\n  ".join(silent)


def test_top_level_help_lists_every_command_in_one_group() -> None:
    proc = hpcdist("--help")
    assert proc.returncode == 0, proc.stderr
    for title, _ in cli.GROUPS:
        assert f"\n{title}:\n" in proc.stdout, title
    action = next(a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction))
    grouped = [name for _, names in cli.GROUPS for name in names]
    primary = [c.dest for c in action._choices_actions]
    assert sorted(grouped) == sorted(primary), set(grouped) ^ set(primary)
    assert "-m hpcdist.cli" not in proc.stdout and "torchrun --nproc_per_node=2 -m hpcdist train" in proc.stdout


def test_a_mistyped_command_gets_a_did_you_mean() -> None:
    proc = hpcdist("trian", DEMO)
    assert proc.returncode == 2
    assert "unknown command 'trian'; did you mean 'train'?" in proc.stderr, proc.stderr
    assert "choose from" not in proc.stderr


def test_nccl_check_is_a_subcommand_with_its_own_options() -> None:
    for name in ("nccl-check", "nccl_check"):
        proc = hpcdist(name, "--help")
        assert proc.returncode == 0, proc.stderr
        assert "usage: nccl_check" in proc.stdout and "--nproc" in proc.stdout


def test_data_preparation_under_one_verb_and_the_old_names(tmp_path: Path) -> None:
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("hello world\n" * 200, encoding="utf-8")
    new = hpcdist("data", "prepare", texts, "--out", tmp_path / "new", "--workers", "1")
    old = hpcdist("prepare", texts, "--out", tmp_path / "old", "--workers", "1")
    assert new.returncode == 0 and old.returncode == 0, new.stderr + old.stderr
    shards = sorted(p.name for p in (tmp_path / "new").glob("shard-*.bin"))
    assert shards and all((tmp_path / "new" / s).read_bytes() == (tmp_path / "old" / s).read_bytes() for s in shards)
    check = hpcdist("data", "check", tmp_path / "new", "--full")
    assert check.returncode == 0, check.stdout + check.stderr
    for args in (("data", "tokenizer", "--help"), ("tokenizer", "train", "--help")):
        proc = hpcdist(*args)
        assert proc.returncode == 0 and "--vocab-size" in proc.stdout, args


def test_one_torchrun_spelling_in_docs_and_help() -> None:
    from tests.unit.harness import user_docs

    hits = [p.name for p in user_docs() if "-m hpcdist.cli" in p.read_text(encoding="utf-8")]
    assert not hits and "-m hpcdist.cli" not in cli.EPILOG, hits
