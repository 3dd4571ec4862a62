"""Hostile input: fuzzed command lines never produce a traceback, run directories that belong to someone else or
cannot be written are refused before anything starts, files follow the user's umask, nothing is unpickled.

(The config/override fuzzers live in test_config.py: 300 + 300 examples; the 400 command lines here make 1,000.)
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcdist import config as config_mod
from hpcdist.cli import main
from hpcdist.config import ConfigError, JobConfig, check_run_dir, load
from hpcdist.config.rules import _numeric_fields
from tests.dist.harness import single
from tests.training import train
from tests.unit.fuzz import OVERRIDES

ROOT = Path(__file__).resolve().parents[2]
HOSTILE = ["a b", "it's", 'say "hi"', "$(touch PWNED)", "`id`", "new\nline", "semi;colon", "-rf", "~", "%j", ""]

# quick runs: no corpus to prepare, no evaluation, nothing saved
_QUICK = [
    "train.steps=2",
    "train.eval_every_steps=0",
    "data.source=synthetic",
    "data.synthetic_samples=64",
    "checkpoint.save_final=false",
    "logging.tensorboard=false",
    "model.n_layers=1",
    "model.dim=64",
]
_FLAGS = ["--nodes", "--gpus-per-node", "--gpu-mem", "--world-size", "--cluster", "--tokens", "--top", "-h"]
_OPTIONS = st.lists(st.sampled_from(_FLAGS) | st.sampled_from(HOSTILE) | st.text(max_size=12), max_size=4)
_COMMANDS = st.sampled_from([["config", "configs/demo.yaml"], ["plan", "configs/train_13b.yaml"], ["config"], ["plan"]])


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
@given(command=_COMMANDS, options=_OPTIONS, overrides=OVERRIDES)
def test_fuzzed_command_lines_never_raise(command, options, overrides, capsys) -> None:
    """`hpcdist config|plan` with random options and overrides: an exit code and a message, never a traceback."""
    with _time_limit(30):
        try:
            code = main([*command, *overrides, *options])
        except SystemExit as e:  # argparse: usage errors exit 2, -h exits 0
            code = e.code
    assert code in (0, 1, 2, None)
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err and "unexpected error" not in out.err, out.err[-2000:]
    if code not in (0, None):
        assert out.err.strip(), "a failure must say why"


# ------------------------------------------------------------------------ extreme values


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """TimeoutError in this thread after ``seconds``: a hang fails its example instead of the whole run. The alarm
    pytest-timeout may have set is put back afterwards, less the time spent here."""

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    t0 = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - t0), 0.001))


_NUMBERS = [
    "0",
    "-0",
    "-1",
    "1",
    "2",
    "3",
    "7",
    "-7",
    str(2**31),
    str(2**63 - 1),
    str(2**63),
    str(2**64),
    str(-(2**63) - 1),
    str(10**400),
    str(-(10**400)),
    "9" * 4301,
    "1e308",
    "1e309",
    "-1e309",
    "5e-324",
    "-0.0",
    "1e-320",
    ".inf",
    "-.inf",
    ".nan",
    "1.5",
    "0x10",
    "0o17",
    "0b101",
    "1_000",
    "1e3",
    "3e-4",
    "1e",
    "+5",
    "00012",
    "0.001",
    "1e-9",
    "true",
    "null",
    "[]",
    "{}",
    "[1, 2]",
    "''",
]
_PATHS = [
    "",
    " ",
    "/",
    ".",
    "..",
    "~",
    "~root",
    "x" * 255,
    "x" * 256,
    f"/tmp/{'x' * 300}/r",
    "a/" * 2100,
    "a\x00b",
    "a\nb",
    "é/ü",
    "\udcff",
    "/dev/null",
    "/proc/self/mem",
    "/etc/passwd",
    "/etc/passwd/x",
    "/etc",
    "-rf",
    "$(touch PWNED)",
    "`id`",
    "runs/ok",
    "step-00000001",
    "/nonexistent/step-00000002",
    "'quoted'",
    "a b/c d",
]
_SIGNALS = [
    *(s.name for s in signal.Signals),
    *(s.name[3:].lower() for s in signal.Signals),
    "",
    " ",
    "USR3",
    "SIGRTMIN+1",
    "RTMIN",
    "0",
    "9",
    "-1",
    "12",
    "SIG",
    "sig usr2",
    "USR2\n",
    "KILL ",
    "ＵＳＲ2",
]
_RESUMES = ["auto", "none", "", " ", "AUTO", "None", "null", "~", "auto ", *_PATHS]
_NUMERIC_KEYS = [
    *sorted(k for k, _ in _numeric_fields(JobConfig())),
    "logging.peak_flops",
    "parallel.pp_stages_per_rank",
    "data.max_tokens",
    "model.n_kv_heads",
]
_PATH_KEYS = [
    "run.dir",
    "data.path",
    "checkpoint.dir",
    "checkpoint.init_from",
    "checkpoint.local.dir",
    "fault.exclude_nodes_file",
    "model.preset",
    "parallel.auto_cluster",
]
_KINDS = [
    (_NUMERIC_KEYS, _NUMBERS),
    (_PATH_KEYS, _PATHS),
    (["fault.requeue_signal"], _SIGNALS),
    (["checkpoint.resume"], _RESUMES),
]


def _pair(kind: tuple[list[str], list[str]]) -> st.SearchStrategy[str]:
    keys, values = kind
    anything = st.sampled_from(_NUMBERS + _PATHS + _SIGNALS) | st.text(max_size=12)  # a value of another kind
    return st.builds(lambda k, v: f"{k}={v}", st.sampled_from(keys), st.sampled_from(values) | anything)


_EXTREMES = st.lists(st.one_of(*(_pair(kind) for kind in _KINDS)), min_size=1, max_size=5)


@pytest.fixture(scope="module")
def fake_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory that looks like a complete checkpoint to the config rules (resume values point at it)."""
    d = tmp_path_factory.mktemp("ckpt") / "step-00000002"
    d.mkdir()
    (d / "COMPLETE").write_text("{}")
    return d


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(overrides=_EXTREMES, world=st.sampled_from([1, 2, 8, 3, 10**12]), resume_here=st.booleans())
def test_fuzzed_extreme_values_only_raise_config_error(overrides, world, resume_here, fake_checkpoint) -> None:
    """1,000 override sets of numeric extremes (400-digit ints, 1e309, NaN, 5e-324, 2**63), path extremes (255/256-
    byte names, 4 KiB paths, NUL, newline, unencodable, devices, files as directories), every signal name and number,
    and resume values, each over the demo config: load, the world-size rules and the run-directory checks raise
    ConfigError naming the problem or accept the config; nothing else, within 10 s each."""
    if resume_here:
        overrides = [*overrides, f"checkpoint.resume={fake_checkpoint}"]
    with _time_limit(10):
        try:
            cfg = load(ROOT / "configs/demo.yaml", overrides)
            config_mod.check_world(cfg, world)
            if not Path(cfg.run.dir).is_absolute():  # a relative run.dir is checked where it would be made
                cfg.run.dir = str(fake_checkpoint.parent / cfg.run.dir)
            check_run_dir(cfg)
        except ConfigError as e:
            assert e.problems and all(isinstance(p, str) and 0 < len(p) <= 1100 for p in e.problems), e.problems
            assert "Traceback" not in str(e)


_CLI_SAMPLE = [
    ["config", "configs/demo.yaml", f"train.steps={10**400}", "run.seed=-5", "fault.requeue_signal=STOP"],
    ["config", "configs/demo.yaml", f"run.dir=/tmp/{'y' * 256}", "checkpoint.resume=", "data.max_tokens=1e309"],
    [
        "config",
        "configs/demo.yaml",
        "checkpoint.dir=a\nb/" + "c" * 4100,
        "fault.watchdog_timeout_s=5e-324",
        "optim.lr=.nan",
    ],
    ["plan", "configs/train_13b.yaml", "--nodes", str(10**30), "train.global_batch_size=0"],
    ["train", "configs/demo.yaml", "--dry-run", "--world-size", "1000000000000", "data.seq_len=2000000"],
    ["train", "configs/demo.yaml", *_QUICK, f"checkpoint.init_from=/{'z' * 300}", "fault.requeue_signal=9"],
    ["train", "/dev/null", "run.dir=/tmp"],
]


@pytest.mark.parametrize("argv", _CLI_SAMPLE, ids=[f"{a[0]}-{i}" for i, a in enumerate(_CLI_SAMPLE)])
def test_extreme_command_lines_through_the_real_command(tmp_path: Path, argv: list[str]) -> None:
    """A sample of the extremes through `python -m hpcdist` (each start costs an interpreter): exit 2 with the
    problem, within 120 s, no traceback."""
    p = subprocess.run([sys.executable, "-m", "hpcdist", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode in (1, 2), (p.returncode, p.stderr[-2000:])
    assert "Traceback" not in p.stdout + p.stderr and "unexpected error" not in p.stderr, p.stderr[-2000:]
    assert p.stderr.startswith("hpcdist: "), p.stderr[-2000:]


# --------------------------------------------------------------------------------------------- YAML documents


def _alias_bomb(levels: int = 9, width: int = 9) -> str:
    """ "Billion laughs": ``levels`` lines of ``width`` aliases each describe width**levels values in a few hundred
    bytes; the last one is given where a section belongs (the error message used to repr it)."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]")
    return "\n".join([*lines, f"run: *l{levels - 1}", ""])


_CAPPED = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))  # 1 GiB of address space: the bomb needs far more
from hpcdist.cli import main
t0 = time.perf_counter()
code = main(["config", sys.argv[1]])
print(f"seconds={time.perf_counter() - t0:.3f} maxrss_kib={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}")
sys.exit(code)
"""


def test_yaml_alias_bomb_is_refused_at_once_under_a_memory_cap(tmp_path: Path) -> None:
    """9**9 values in 9 lines; under a 1 GiB cap `hpcdist config` answers in well under 5 s with one
    problem (it used to copy the expansion into an error message: 54-83 s and a MemoryError under 6 GiB)."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_alias_bomb())
    p = subprocess.run([sys.executable, "-c", _CAPPED, str(bomb)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "Traceback" not in p.stderr and "MemoryError" not in p.stderr, p.stderr[-2000:]
    assert p.returncode == 2, p.stderr[-2000:]
    seconds = float(re.search(r"seconds=([0-9.]+)", p.stdout).group(1))
    assert seconds < 5, p.stdout
    lines = p.stderr.splitlines()
    assert lines[0] == "hpcdist: Invalid configuration (1 problem):" and len(lines) == 2, p.stderr
    assert "line 1: its aliases (*name) expand to more than 10000 values" in lines[1] and len(lines[1]) < 300


def test_a_few_aliases_and_merge_keys_still_work(tmp_path: Path) -> None:
    path = tmp_path / "anchors.yaml"
    path.write_text(
        "train: &t {steps: 7, micro_batch_size: 4}\nrun: {dir: x}\noptim:\n  lr: &lr 0.01\n"
        "  warmup_steps: 1\n  min_lr_ratio: *lr\n"
    )
    cfg = load(path)
    assert (cfg.train.steps, cfg.train.micro_batch_size, cfg.optim.min_lr_ratio) == (7, 4, 0.01)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (
            "train:\n  steps: 5\nmodel: {dim: 64}\ntrain:\n  micro_batch_size: 4\n",
            "line 4: duplicate key 'train' (first at line 1): the second would silently replace the first",
        ),
        ("train:\n  steps: 5\n  steps: 6\n", "line 3: duplicate key 'steps' (first at line 2)"),
        ("[" * 2000 + "]" * 2000, "nested more than 64 levels deep"),
        ("run: &a [*a]\n", "expand to more than 10000 values"),
    ],
    ids=["section-twice", "key-twice", "deep-nesting", "self-reference"],
)
def test_refused_yaml_documents(tmp_path: Path, text: str, fragment: str) -> None:
    """A second `train:` block replaced the first silently; nesting and self-reference are bounded."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load(path)
    assert len(e.value.problems) == 1 and fragment in e.value.problems[0], e.value.problems


def test_overrides_are_bounded_like_files() -> None:
    bomb = "[" + ", ".join(f"&l{i} [{', '.join([f'*l{i - 1}' if i else '1'] * 9)}]" for i in range(9)) + "]"
    with pytest.raises(ConfigError, match=r"override run.dir: its aliases \(\*name\) expand to more than"):
        load(None, [f"run.dir={bomb}"])
    with pytest.raises(ConfigError, match=r"override train.steps: duplicate key 'a'"):
        load(None, ["train.steps={a: 1, a: 2}"])


def test_echoed_values_and_problem_lists_are_bounded(tmp_path: Path) -> None:
    """A megabyte-long value or a thousand bad keys give a report of a few kilobytes, naming the key."""
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump({"run": "x" * 500_000, "train": {f"k{i}": i for i in range(1000)}}))
    with pytest.raises(ConfigError) as e:
        load(path, [f"data.source={'y' * 500_000}"])
    report = str(e.value)
    assert len(report) < 20_000, len(report)
    assert "run: must be a section (a mapping of keys), got 'xxxxx" in report and "(500,002 characters)" in report
    assert "... and 952 more" in report
    (source,) = [p for p in e.value.problems if p.startswith("data.source:")]
    assert source.startswith("data.source: 'yyyy") and len(source) < 200, source[:300]
    assert len(e.value.problems) > 1000  # every problem is kept for callers; only the printed list is cut
    big = tmp_path / "huge.yaml"
    big.write_text("run:\n  dir: " + "z" * (2 << 20) + "\n")
    with pytest.raises(ConfigError, match=r"is 2,097,16\d bytes; a YAML file here is at most 1,048,576"):
        load(big)


# --------------------------------------------------------------------------------------------- one-line errors

# each of these ended in a traceback (OverflowError, ENAMETOOLONG, ValueError, OSError, torch's seed
# overflow, FileNotFoundError); 14.6: a watchdog of 0.001 s fired in a normal save. Now: the problem, the key, a fix.
_BAD_INPUTS = {
    "400-digit-steps": ([f"train.steps={10**400}"], "train.steps: must be at most 1,000,000,000,000, got an integer"),
    "300-char-name": ([f"run.dir=/tmp/{'x' * 300}/r"], "run.dir: the name 'xxx"),
    "resume-etc": (["checkpoint.resume=/etc"], "checkpoint.resume: '/etc' is not a complete checkpoint (no COMPLETE"),
    "resume-empty": (["checkpoint.resume=''"], "checkpoint.resume: empty; use auto, none"),
    "signal-kill": (["fault.requeue_signal=KILL"], "fault.requeue_signal: SIGKILL cannot be caught; use USR1 or USR2"),
    "signal-stop": (["fault.requeue_signal=STOP"], "fault.requeue_signal: SIGSTOP cannot be caught"),
    "signal-term": (["fault.requeue_signal=TERM"], "SIGTERM already means: checkpoint and stop without requeueing"),
    "seed-2**70": ([f"run.seed={2**70}"], "run.seed: must be at most 9,223,372,036,854,775,807 (torch and numpy"),
    "seed-negative": (["run.seed=-1"], "run.seed: must be >= 0, got -1"),
    "max-tokens-10": (["data.source=stdlib", "data.max_tokens=10"], "data.max_tokens (10) holds 0 samples of"),
    "files-etc": (["data.source=files", "data.path=/etc"], "data.path /etc: no prepared dataset there"),
    "watchdog-1ms": (["fault.watchdog_timeout_s=0.001"], "fault.watchdog_timeout_s: must be 0 (off) or at least 5 s"),
    "nul-byte": (["checkpoint.dir=a\x00b"], "checkpoint.dir: contains a NUL character"),
}


@pytest.mark.parametrize(("args", "fragment"), _BAD_INPUTS.values(), ids=_BAD_INPUTS.keys())
def test_bad_inputs_end_in_one_message_and_a_non_zero_exit(tmp_path: Path, capsys, args, fragment) -> None:
    code = main(["train", "configs/demo.yaml", *_QUICK, f"run.dir={tmp_path / 'run'}", *args])
    out = capsys.readouterr()
    assert code == 2, out.err[-3000:]
    assert "Traceback" not in out.out + out.err and "unexpected" not in out.err, out.err[-3000:]
    assert out.err.startswith("hpcdist: ") and fragment in out.err, out.err[-3000:]


@pytest.mark.parametrize("case", ["400-digit-steps", "resume-etc"])
def test_bad_inputs_through_the_real_command(tmp_path: Path, case: str) -> None:
    """The same through `python -m hpcdist` (a sample: each start imports torch): exit 2, no traceback."""
    args, fragment = _BAD_INPUTS[case]
    p = subprocess.run(
        [sys.executable, "-m", "hpcdist", "train", "configs/demo.yaml", *_QUICK, f"run.dir={tmp_path / 'run'}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and fragment in p.stderr, p.stderr[-3000:]
    assert "Traceback" not in p.stdout + p.stderr


def _boom(args: object) -> int:
    raise RuntimeError("boom\nsecond line of the message")


@pytest.mark.parametrize("run_dir_exists", [True, False])
def test_an_unexpected_error_prints_one_line_and_keeps_the_traceback(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch, run_dir_exists: bool
) -> None:
    """An error no rule foresaw is one line naming it and the file holding the traceback
    (in run.dir when it exists, else a new private temp file), exit 1; it used to be the traceback itself."""
    import hpcdist.cli as cli

    run_dir = tmp_path / "run"
    if run_dir_exists:
        run_dir.mkdir()
    monkeypatch.setitem(cli.COMMANDS, "config", _boom)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    code = main(["config", "configs/demo.yaml", f"run.dir={run_dir}"])
    err = capsys.readouterr().err
    assert code == 1 and len(err.splitlines()) == 1, err
    m = re.fullmatch(
        r"hpcdist: unexpected error: RuntimeError: boom second line of the message \(the traceback "
        r"is in (\S+); please report it\)\n",
        err,
    )
    assert m, err
    log = Path(m.group(1))
    assert log.parent == (run_dir if run_dir_exists else tmp_path / "tmp"), log
    assert log.name.startswith("hpcdist-error-") and log.suffix == ".log"
    assert "Traceback (most recent call last)" in log.read_text() and "in _boom" in log.read_text()
    if not run_dir_exists:
        assert log.stat().st_mode & 0o777 == 0o600  # mkstemp: nobody else reads it, nobody planted it


def test_data_with_a_larger_vocabulary_than_the_model_is_refused_at_start(tmp_path: Path, small_cfg) -> None:
    """Shards whose tokens reach 999 with model.vocab_size=258 failed mid-run (IndexError in the
    embedding); now the trainer refuses before the first step, naming both sizes."""
    from hpcdist.data import ByteTokenizer, prepare_shards

    class WideTokenizer(ByteTokenizer):
        vocab_size = 1000

        def encode(self, text, *, bos=False, eos=True):
            return super().encode(text, bos=bos, eos=eos).astype("int64") * 3  # ids up to 771: past 258

    src = tmp_path / "text.txt"
    src.write_text("hello world, " * 2000)
    wide = prepare_shards([src], tmp_path / "wide", tokenizer=WideTokenizer())
    cfg = small_cfg(f"data.path={wide}", "train.steps=2", "train.micro_batch_size=4", run_dir=tmp_path / "run")
    with pytest.raises(ConfigError, match=r"model.vocab_size=258 is smaller than the 1000 tokens of"):
        single(train, cfg)


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
    single(train, cfg)
    assert (tmp_path / name / "checkpoints" / "step-00000001" / "COMPLETE").is_file()
    assert not (tmp_path / "PWNED").exists() and not Path("PWNED").exists()


# --------------------------------------------------------------------------------------------- files written


def test_files_follow_the_users_umask(small_cfg, tmp_path: Path) -> None:
    """umask 027: every file of a run (config, metrics, checkpoint shards, manifest, marker, RNG) is 0640 or
    tighter, never group-writable or world-readable; directories 0750."""
    cfg = small_cfg("train.steps=2", "checkpoint.save_final=true", "train.micro_batch_size=4", run_dir=tmp_path / "r")
    old = os.umask(0o027)
    try:
        single(train, cfg)
    finally:
        os.umask(old)
    paths = list((tmp_path / "r").rglob("*"))
    assert any(p.suffix == ".distcp" for p in paths) and any(p.name == "MANIFEST.json" for p in paths)
    for p in paths:
        mode = p.stat().st_mode & 0o777
        assert mode & 0o027 == 0, f"{p}: {oct(mode)}"
        if p.is_file():
            assert mode == 0o640, f"{p}: {oct(mode)} (created with a mode that ignores the umask?)"


# Unpickling runs the writer's code. What may unpickle, and where: DCP's ``.metadata`` (a pickle in every DCP
# checkpoint) only where a checkpoint is loaded after its ownership check (hpcdist.config.dirs: checkpoint/load.py,
# under the manager's restore, and export's reader, docs/SECURITY.md); hf/import_.py's dcp.load reads through its own
# storage reader (safetensors headers, no pickle); everything else nowhere, whoever wrote the file.
_PICKLE_MODULES = {"pickle", "_pickle", "cloudpickle", "dill", "joblib", "shelve", "marshal"}
_AUDITED = {
    # checkpoint/local/tier.py: a node-local step is loaded only after verify_step_dir (every file yours alone, no link,
    # sizes and sha256 against its manifest) and the same-run check passed on every rank
    "dcp.load": {"checkpoint/load.py", "checkpoint/local/tier.py", "hf/source.py", "hf/import_.py"},
    # checkpoint/codec.py's read_metadata is the one reader of DCP's metadata; checkpoint/local/layout.py calls it in
    # verify_step_dir after the ownership walk and the manifest's hashes passed
    "read_metadata": {"checkpoint/load.py", "hf/source.py", "checkpoint/codec.py", "checkpoint/local/layout.py"},
}


def _unpickling(source: str) -> list[tuple[int, str]]:
    """(line, what) of every call that can unpickle in ``source``: the pickle modules (imported or called),
    submitit's ``pickle_load`` and its Job methods that load result / submission pickles, ``torch.load`` without
    ``weights_only=True``, ``np.load`` with ``allow_pickle`` not False, and DCP's load / read_metadata."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            if any(n.split(".")[0] in _PICKLE_MODULES or n == "pickle_load" for n in names if n):
                found.append((node.lineno, "import " + ", ".join(n for n in names if n)))
            continue
        if not isinstance(node, ast.Call):
            continue
        func = ast.unparse(node.func)
        kw = {k.arg: k.value for k in node.keywords}
        last = func.rsplit(".", 1)[-1]
        if func.split(".")[0] in _PICKLE_MODULES or last in ("pickle_load", "Unpickler"):
            found.append((node.lineno, func))
        elif last == "load" and "torch" in func:
            weights_only = kw.get("weights_only")
            if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                found.append((node.lineno, f"{func} without weights_only=True"))
        elif func in ("np.load", "numpy.load") and "allow_pickle" in kw:
            value = kw["allow_pickle"]
            if not (isinstance(value, ast.Constant) and value.value is False):
                found.append((node.lineno, f"{func}(allow_pickle=...)"))
        elif re.search(r"(^|\.|_)job\.(result|results|exception|submission)$", func):
            found.append((node.lineno, f"{func} (submitit loads a pickle)"))
        elif func in ("dcp.load", "torch.distributed.checkpoint.load") or last == "read_metadata":
            found.append((node.lineno, "dcp.load" if last == "load" else "read_metadata"))
    return found


def test_no_pickle_loading_in_hpcdist() -> None:
    """Nothing in the package unpickles, except DCP's loads of a checkpoint that passed its ownership check
    (audited sites): no pickle module, no submitit result pickle (`hpcdist status` ran another
    user's), torch.load only with weights_only=True, np.load never with allow_pickle."""
    # the detector finds each kind (so a new one cannot slip past a test that finds nothing)
    planted = (
        "import pickle\nfrom submitit.core.utils import pickle_load\npickle.loads(b)\npickle_load(p)\n"
        "torch.load(f)\ntorch.load(f, weights_only=False)\nnp.load(f, allow_pickle=True)\nself.job.result()\n"
        "cloudpickle.load(f)\nnp.load(f)\ntorch.load(f, weights_only=True)\nnp.load(f, allow_pickle=False)\n"
    )
    assert [line for line, _ in _unpickling(planted)] == [1, 2, 3, 4, 5, 6, 7, 8, 9], _unpickling(planted)
    bad, audited = [], []
    for py in sorted((ROOT / "hpcdist").rglob("*.py")):
        rel = py.relative_to(ROOT / "hpcdist").as_posix()
        for line, what in _unpickling(py.read_text()):
            if rel in _AUDITED.get(what, ()):
                audited.append(f"{rel}:{line}")
            else:
                bad.append(f"hpcdist/{rel}:{line}: {what}")
    assert not bad, "unpickling outside the audited sites:\n" + "\n".join(bad)
    assert audited, "expected the checkpoint restore's DCP load among the audited sites"
