"""``hpcdist submit`` and friends without a SLURM daemon: rendered scripts, validation, executor choice.

SLURM's tools are replaced by small shell scripts on PATH where a test needs them (``fake_slurm``); the tests
that submit to a real cluster live in tests/slurm/.

The golden file tests/data/submit_dryrun.golden holds the script of ``hpcdist submit --dry-run`` for the sandbox
cluster (tmp paths and the interpreter normalized). After an intended change, regenerate it with

    UPDATE_GOLDEN=1 python -m pytest tests/unit/launch/test_launch.py -k golden

and review the diff.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pickle
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import submitit
import yaml

from hpcdist import cli, resources
from hpcdist.config import ConfigError
from hpcdist.config.cluster import cluster_names, parse_time
from hpcdist.launch import ClusterConfig, JobHandle, load_cluster, submit
from hpcdist.launch.submit import LaunchError, _signal_name, choose_executor, slurm_parameters
from hpcdist.launch.task import TrainTask, local_rank_environ, write_result
from hpcdist.schedulers.slurm.client import slurm_reachable

REPO = Path(__file__).resolve().parents[3]
DEMO = str(REPO / "configs" / "demo.yaml")
GOLDEN = REPO / "tests" / "data" / "submit_dryrun.golden"
SLEEP = shutil.which("sleep")
NASTY_NAME = "it's $(rm -rf /) `id` job"  # a space, a single quote, command substitutions
# A model small enough to train a few steps in a second or two (see tests/conftest.py SMALL).
TINY = [
    "model.preset=tiny",
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=128",
    "data.seq_len=32",
    "data.source=synthetic",
    "data.synthetic_samples=2000",
    "train.eval_every_steps=0",
    "optim.warmup_steps=2",
    "logging.every_steps=1",
    "logging.tensorboard=false",
    "logging.peak_flops=1e11",
    "checkpoint.every_steps=0",
]
_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """No launcher, SLURM, submitit or NCCL variables from the caller; the whole environment is restored
    afterwards (code under test sets variables of its own, which monkeypatch would not undo)."""
    saved = dict(os.environ)
    for name in list(os.environ):
        if name.startswith(("SLURM_", "SUBMITIT_", "NCCL_", "GLOO_", "TORCH_NCCL_")) or name in _LAUNCHER_VARS:
            monkeypatch.delenv(name)
    monkeypatch.delenv("HPCDIST_NCCL_PROFILE", raising=False)
    yield monkeypatch
    os.environ.clear()
    os.environ.update(saved)


def write_exe(path: Path, body: str) -> Path:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """sbatch/srun/scontrol/scancel/sacct stand-ins first on PATH. Returns their directory, where they record
    what they were given (submitted.sh, scancel.args). FAKE_STATE / FAKE_STDOUT shape `scontrol show job`; after
    scancel the job is CANCELLED."""
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    write_exe(bindir / "sbatch", f'cp "$1" {bindir}/submitted.sh\necho "Submitted batch job 4242"')
    write_exe(bindir / "srun", "exit 0")
    write_exe(bindir / "sacct", "echo 'accounting storage is disabled' >&2; exit 1")
    write_exe(bindir / "sinfo", "exit 1")
    write_exe(bindir / "scancel", f'echo "$@" > {bindir}/scancel.args')
    write_exe(
        bindir / "scontrol",
        'case "$1" in\n'
        '  ping) echo "Slurmctld(primary) at ctl is UP" ;;\n'
        '  show) if [ "${FAKE_STATE:-RUNNING}" = GONE ]; then\n'
        '          echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1; fi\n'
        f"        state=${{FAKE_STATE:-RUNNING}}; [ -f {bindir}/scancel.args ] && state=CANCELLED\n"
        '        echo "JobId=$4 JobName=my job JobState=$state Reason=None '
        'RunTime=00:00:05 StdOut=${FAKE_STDOUT:-/nonexistent/x}" ;;\n'
        "  *) exit 1 ;;\n"
        "esac",
    )
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return bindir


def snapshot_free(script: str) -> str:
    """A script with its code snapshot's name (submission time and pid; the dry run shows <time>-<pid>) replaced."""

    def fix(m: re.Match[str]) -> str:
        return re.sub(r"/code/[^/$]+\$", "/code/SNAPSHOT$", m.group(0).replace("'", ""))

    return re.sub(r"^export PYTHONPATH=.*$", fix, script, flags=re.MULTILINE)


def normalize(text: str, tmp_path: Path) -> str:
    """Machine-independent form of a rendered script."""
    return text.replace(shlex.quote(sys.executable), "PYTHON").replace(str(tmp_path), "/TMP")


def sbatch_argument(line: str) -> str:
    """The option sbatch reads from an `#SBATCH <option>` line (its parser: quotes, backslash escapes, #)."""
    out, quote, escape = [], "", False
    for ch in line.removeprefix("#SBATCH").lstrip():
        if escape:
            escape = False
        elif ch == "\\":
            escape = True
            continue
        elif quote:
            if ch == quote:
                quote = ""
                continue
        elif ch in "\"'":
            quote = ch
            continue
        elif ch == "#" or ch.isspace():
            break
        out.append(ch)
    assert not quote, f"unmatched quote in {line!r}"
    return "".join(out)


def dry_run_cli(capsys: pytest.CaptureFixture[str], run_dir: Path, *extra: str) -> str:
    rc = cli.main(
        [
            "submit",
            "configs/demo.yaml",
            "--cluster",
            "sandbox",
            "--nodes",
            "2",
            "--job-name",
            NASTY_NAME,
            f"run.dir={run_dir}",
            "train.global_batch_size=64",
            "--dry-run",
            *extra,
        ]
    )
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out


# --------------------------------------------------------------------------------------------- dry run


@pytest.fixture
def sandbox_script(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> tuple[str, Path]:
    monkeypatch.chdir(REPO)
    run_dir = tmp_path / "my runs" / "r1"  # a space in run.dir
    return dry_run_cli(capsys, run_dir), run_dir / "slurm"


def test_dry_run_matches_golden_file(sandbox_script: tuple[str, Path], tmp_path: Path) -> None:
    text = normalize(sandbox_script[0], tmp_path)
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "rendered script changed; see this file's docstring to regenerate"


def test_dry_run_has_the_job_shape(sandbox_script: tuple[str, Path]) -> None:
    text = sandbox_script[0]
    for fragment in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --requeue",
        "#SBATCH --signal=USR2@30",
        "#SBATCH --partition=debug",
        "#SBATCH --time=30",
        "--kill-on-bad-exit=1",
        "export HPCDIST_NCCL_PROFILE=ethernet",
    ):
        assert fragment in text
    assert "--exclusive" not in text  # the sandbox shares one machine


def test_dry_run_script_is_valid_bash(sandbox_script: tuple[str, Path], tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text(sandbox_script[0])
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_sbatch_reads_back_the_exact_job_name_and_paths(sandbox_script: tuple[str, Path]) -> None:
    text, folder = sandbox_script
    options = dict(
        sbatch_argument(line).removeprefix("--").partition("=")[::2]
        for line in text.splitlines()
        if line.startswith("#SBATCH")
    )
    assert options["job-name"] == NASTY_NAME
    assert options["output"] == f"{folder}/%j_0_log.out"
    assert options["error"] == f"{folder}/%j_0_log.err"


def test_running_the_script_injects_nothing(sandbox_script: tuple[str, Path], tmp_path: Path) -> None:
    """Run the script under bash with a recording srun: every argument arrives intact, nothing else runs."""
    text, folder = sandbox_script
    bindir = tmp_path / "bin"
    bindir.mkdir()
    record = tmp_path / "srun.json"
    write_exe(
        bindir / "srun",
        f'{shlex.quote(sys.executable)} -c "import json, os, sys; json.dump(dict(argv=sys.argv[1:], '
        f"profile=os.environ.get('HPCDIST_NCCL_PROFILE')), open('{record}', 'w'))\" \"$@\"",
    )
    for tool in ("rm", "id"):  # would run if the job name reached the shell unquoted
        write_exe(bindir / tool, f"touch {tmp_path}/INJECTED")
    script = tmp_path / "job.sh"
    script.write_text(text)
    # PYTHONPATH: the attempt loop the script's srun function runs is this checkout's
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "INJECTED").exists()
    got = json.loads(record.read_text())
    assert got["profile"] == "ethernet"
    assert got["argv"] == [
        "--unbuffered",
        "--output",
        f"{folder}/%j_%t_log.out",
        "--error",
        f"{folder}/%j_%t_log.err",
        "--kill-on-bad-exit=1",
        "--cpus-per-task=1",
        sys.executable,
        "-m",
        "hpcdist.fault.supervise",
        "--",
        sys.executable,
        "-u",
        "-m",
        "submitit.core._submit",
        str(folder),
    ]


def test_dry_run_through_the_installed_command(tmp_path: Path, sandbox_script: tuple[str, Path]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in _LAUNCHER_VARS}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpcdist",
            "submit",
            "configs/demo.yaml",
            "--cluster",
            "sandbox",
            "--nodes",
            "2",
            "--job-name",
            NASTY_NAME,
            f"run.dir={tmp_path / 'my runs' / 'r1'}",
            "train.global_batch_size=64",
            "--dry-run",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == sandbox_script[0]


def test_dry_run_with_cluster_overrides_and_extra_flags(tmp_path: Path) -> None:
    text = submit(
        DEMO,
        [f"run.dir={tmp_path}", "train.global_batch_size=128", "fault.requeue_signal=USR1"],
        cluster="a100_ib",
        dry_run=True,
        nodes=2,
        partition="gpu",
        account="proj-1",
        qos="high",
        constraint="a100-80gb",
        exclude="gpu[012,040]",
        extra_sbatch=["--mail-type=END", "--hint=nomultithread"],
        signal="USR1",
        time="2-00:00:00",
    )
    assert isinstance(text, str)
    lines = set(text.splitlines())
    for flag in (
        "--nodes=2",
        "--ntasks-per-node=8",
        "--gpus-per-node=8",
        "--cpus-per-task=16",
        "--mem=0",
        "--exclusive",
        "--partition=gpu",
        "--account=proj-1",
        "--qos=high",
        "--constraint=a100-80gb",
        "--exclude='gpu[012,040]'",
        "--mail-type=END",
        "--hint=nomultithread",
        "--time=2880",
        "--signal=USR1@300",
        "--job-name=demo",
    ):
        assert f"#SBATCH {flag}" in lines, flag
    assert sum(line.startswith("#SBATCH --signal") for line in lines) == 1
    # submitit's own pre-trainer handler must react to the same signal
    assert "export SUBMITIT_PREEMPT_SIGNAL=USR1" in lines
    assert "export HPCDIST_NCCL_PROFILE=ib_a100" in lines


def test_cpu_cluster_has_no_gpu_flag(tmp_path: Path) -> None:
    text = submit(DEMO, [f"run.dir={tmp_path}"], cluster="sandbox", dry_run=True, gpus_per_node=0, tasks_per_node=2)
    assert isinstance(text, str)
    assert "--gpus-per-node" not in text and "#SBATCH --ntasks-per-node=2" in text


def test_submit_with_in_process_recovery_asks_for_the_spare_and_runs_the_attempt_loop_with_it(tmp_path: Path) -> None:
    """The submitted job starts what the batch scripts start: the spare node is asked for beside the training node,
    and submitit's srun line goes through the attempt loop with --in-process (the store, the spares' step)."""
    over = [
        f"run.dir={tmp_path}/run",
        "fault.in_process=true",
        f"checkpoint.local.dir={tmp_path}/l",
        "fault.spare_nodes=1",
        "checkpoint.local.every_steps=1",
    ]
    text = submit(DEMO, over, cluster="sandbox", dry_run=True, nodes=1)
    assert isinstance(text, str)
    assert "#SBATCH --nodes=2" in text
    (loop,) = [line for line in text.splitlines() if line.startswith("srun() {")]
    assert "-m hpcdist.launch.attempts" in loop and "--spare-nodes 1" in loop and "--in-process" in loop
    assert not (tmp_path / "run").exists()


def test_local_cluster_dry_run_describes_the_local_run(tmp_path: Path) -> None:
    text = submit(DEMO, [f"run.dir={tmp_path}"], cluster="local", dry_run=True)
    assert isinstance(text, str)
    assert "LocalExecutor" in text and "2 task(s)" in text and "#SBATCH" not in text


# --------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("name", cluster_names())
def test_every_shipped_cluster_loads(name: str) -> None:
    cluster = load_cluster(name)
    assert cluster.name == name and cluster.problems() == []
    assert load_cluster(resources.path("cluster", name)) == cluster


def test_shipped_clusters_have_the_documented_shape() -> None:
    a100, sandbox, local = load_cluster("a100_ib"), load_cluster("sandbox"), load_cluster("local")
    assert (a100.gpus_per_node, a100.cpus_per_task, a100.mem, a100.time_minutes, a100.exclusive) == (
        8,
        16,
        "0",
        24 * 60,
        True,
    )
    assert (a100.signal, a100.signal_lead_s, a100.nccl_profile) == ("USR2", 300, "ib_a100")
    assert a100.hardware is not None
    mtbf = round(54 * 24 * 2048 / 466)
    assert dataclasses.astuple(a100.hardware) == (80, 312, 230, 190, 0.6, 2.0, mtbf, 1024, None)
    assert (sandbox.partition, sandbox.gpus_per_node, sandbox.cpus_per_task, sandbox.exclusive) == (
        "debug",
        4,
        1,
        False,
    )
    assert (sandbox.nccl_profile, sandbox.signal_lead_s) == ("ethernet", 30)
    assert local.executor == "local" and local.nodes == 1


def test_cluster_problems_are_reported_together() -> None:
    with pytest.raises(ConfigError) as exc:
        load_cluster(
            "sandbox",
            nodez=2,
            nodes=0,
            time="1:00",
            signal_lead_s=90,
            mem="lots",
            signal="KILL",
            cpus_per_task=0,
            extra_sbatch=["--time=5", "-x", "--comment=a\nb"],
            executor="cloud",
            python="py\nthon",
            nccl_profile="nope",
            log_dir="/x/%j",
            hardware={"gpu_mem_gb": -1, "tflops": 1},
        )
    problems = exc.value.problems
    text = "\n".join(problems)
    for fragment in (
        "cluster.nodez: unknown key; did you mean 'nodes'?",
        "valid keys: name, executor, nodes",
        "cluster.nodes: must be >= 1",
        "cluster.signal_lead_s (90) must be shorter than the time limit",
        "cluster.mem: 'lots'",
        "KILL cannot be caught",
        "cluster.cpus_per_task",
        "--time is managed",
        "'-x' is not --flag",
        "extra_sbatch[2]: must be one line",
        "cluster.executor: 'cloud'",
        "cluster.python: must be one line",
        "nccl profile 'nope'",
        "must not contain '%'",
        "cluster.hardware.gpu_mem_gb: must be > 0",
        "cluster.hardware.tflops: unknown key",
    ):
        assert fragment in text, fragment
    assert len(problems) == 15


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"job_name": "two\nlines"}, "cluster.job_name: must be one line"),
        ({"job_name": "tab\there"}, "control character"),
        ({"job_name": "back\\slash"}, "backslash"),
        ({"partition": "a b"}, "cluster.partition: must be a non-empty name without spaces"),
        ({"gpus_per_node": 0}, "tasks_per_node: required when gpus_per_node is 0"),
        ({"tasks_per_node": 2}, "must equal gpus_per_node"),
        ({"executor": "local", "nodes": 2}, "local executor runs on one node"),
        ({"nodes": "two"}, "cluster.nodes: must be int, got 'two'"),
        ({"extra_sbatch": [1]}, "must be a list of strings"),
    ],
)
def test_cluster_validation(overrides: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match=None) as exc:
        load_cluster("sandbox", **overrides)
    assert fragment in str(exc.value)


def test_cluster_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown; choose one of a100_ib, local, sandbox"):
        load_cluster("nope")
    with pytest.raises(ConfigError, match="does not exist"):
        load_cluster(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_cluster(bad)
    good = tmp_path / "mine.yaml"
    good.write_text("gpus_per_node: 2\ntime: 90\n")
    cluster = load_cluster(good, nodes=3)
    assert (cluster.name, cluster.nodes, cluster.world_size, cluster.time_minutes) == ("mine", 3, 6, 90)
    # a ClusterConfig goes through the same validation
    assert load_cluster(cluster, partition="x").partition == "x"
    with pytest.raises(ConfigError, match=r"cluster\.nodes"):
        load_cluster(dataclasses.replace(cluster, nodes=-1))


@pytest.mark.parametrize(
    ("text", "minutes"),
    [
        ("90", 90),
        (90, 90),
        ("30:00", 30),
        ("00:00:30", 1),
        ("24:00:00", 1440),
        ("1-00", 1440),
        ("2-12:30", 3630),
        ("1-00:00:01", 1441),
    ],
)
def test_parse_time(text: str | int, minutes: int) -> None:
    assert parse_time(text) == minutes


@pytest.mark.parametrize("text", ["", "1h", "1:2:3:4", "-5", "12:xx"])
def test_parse_time_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_time(text)


def test_training_config_is_checked_against_the_cluster(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        submit(
            DEMO,
            [f"run.dir={tmp_path}", "fault.requeue_signal=USR1", "train.stepz=1"],
            cluster="sandbox",
            nodes=0,
            dry_run=True,
        )
    text = str(exc.value)  # both files' problems at once
    assert "cluster.nodes" in text and "train.stepz" in text
    with pytest.raises(ConfigError) as exc:
        submit(DEMO, [f"run.dir={tmp_path}", "fault.requeue_signal=USR1"], cluster="sandbox", nodes=4, dry_run=True)
    text = str(exc.value)
    assert "x data-parallel size (16)" in text and "(on 4 node(s) x 4 tasks = 16 ranks)" in text
    assert "differs from fault.requeue_signal (USR1)" in text


@pytest.mark.parametrize(
    ("run", "fragment"),
    [
        ({"name": "a\nb"}, "run.name (the default job name): must be one line"),
        ({"dir": "/tmp/100%/x"}, "contains '%'"),
        ({"dir": "/tmp/a\\b"}, "set the cluster's log_dir"),
        ({"dir": "/tmp/a\nb"}, "run.dir (the default log_dir <run.dir>/slurm): must be one line"),
    ],
)
def test_run_values_that_reach_the_script_are_checked(tmp_path: Path, run: dict[str, str], fragment: str) -> None:
    # from a YAML file: an override on the command line cannot carry a newline (YAML folds it into a space)
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"run": run, "model": {"preset": "tiny"}, "train": {"global_batch_size": 32}}))
    with pytest.raises(ConfigError) as exc:
        submit(config, cluster="sandbox", dry_run=True)
    assert fragment in str(exc.value)


def test_newline_in_job_name_is_a_clean_cli_error(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["submit", DEMO, "--cluster", "sandbox", "--job-name", "a\nb", "--dry-run"])
    out = capsys.readouterr()
    assert rc == 2 and out.out == ""
    assert out.err.startswith("hpcdist: Invalid configuration") and "Traceback" not in out.err


def test_proxy_dump_signal_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # the trainer's setup_logging stops propagation on the hpcdist logger; caplog listens on the root
    monkeypatch.setattr(logging.getLogger("hpcdist"), "propagate", True)
    monkeypatch.delenv("NCCL_PROXY_DUMP_SIGNAL", raising=False)
    with caplog.at_level(logging.WARNING, logger="hpcdist.config.cluster"):
        load_cluster("sandbox")
        assert not caplog.records
        monkeypatch.setenv("NCCL_PROXY_DUMP_SIGNAL", "12")  # SIGUSR2 on Linux
        load_cluster("sandbox")
        assert "NCCL_PROXY_DUMP_SIGNAL=12 is the preemption signal USR2" in caplog.text
        assert "set in this environment" in caplog.text
        caplog.clear()
        monkeypatch.setenv("NCCL_PROXY_DUMP_SIGNAL", "10")  # SIGUSR1: no conflict with USR2
        profile = tmp_path / "dump.yaml"
        profile.write_text("NCCL_PROXY_DUMP_SIGNAL: {value: 12, why: dump proxy state on USR2}\n")
        load_cluster("sandbox", nccl_profile=str(profile))
        assert "set by nccl profile" in caplog.text and "set in this environment" not in caplog.text


# --------------------------------------------------------------------------------------------- executors


def test_no_sbatch_means_local(tmp_path: Path) -> None:
    ok, why = slurm_reachable({"PATH": str(tmp_path)})
    assert not ok and why == "sbatch is not on PATH"
    assert choose_executor(load_cluster("sandbox"), {"PATH": str(tmp_path)}) == (
        "local",
        "auto: no SLURM client installed: sbatch is not on PATH",
    )


def test_sbatch_without_a_controller_is_an_error(tmp_path: Path) -> None:
    # sbatch installed but no configuration source (FACTS.md): a SLURM client is installed, so this is a broken
    # login node, not a laptop: never fall back to running the job here
    for tool in ("sbatch", "srun", "scontrol", "sinfo"):
        write_exe(tmp_path / tool, f"echo '{tool}: fatal: Could not establish a configuration source' >&2; exit 1")
    for executor in ("auto", "slurm"):
        with pytest.raises(LaunchError, match=r"Could not establish a configuration source.*nothing was started"):
            choose_executor(load_cluster("sandbox", executor=executor), {"PATH": str(tmp_path)})
    assert choose_executor(load_cluster("local"), {"PATH": str(tmp_path)})[0] == "local"  # asked for: fine


def test_no_sbatch_and_two_nodes_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="local fallback runs one node"):
        choose_executor(load_cluster("sandbox", nodes=2), {"PATH": str(tmp_path)})


def hanging_controller(bindir: Path) -> Path:
    """A login node whose controller does not answer: real sbatch/srun stand-ins, scontrol and sinfo that hang."""
    bindir.mkdir(exist_ok=True)
    write_exe(bindir / "sbatch", "echo 'must not be called' >&2; exit 99")
    write_exe(bindir / "srun", "exit 0")
    write_exe(bindir / "scontrol", f"exec {SLEEP} 30")
    write_exe(bindir / "sinfo", f"exec {SLEEP} 30")
    return bindir


def test_a_hanging_controller_is_not_reachable(tmp_path: Path) -> None:
    ok, why = slurm_reachable({"PATH": str(hanging_controller(tmp_path))}, timeout=0.2)
    assert not ok and "did not answer" in why


def test_slow_controller_refuses_to_submit_and_starts_nothing_locally(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The found bug: `executor: auto` ran the job as local processes (on the login node) when the controller took
    longer than the ping timeout. Now: an error naming the reason, exit 2, no executor made, no run dir written."""
    bindir = hanging_controller(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("HPCDIST_SLURM_PING_TIMEOUT", "0.3")
    monkeypatch.setattr(submitit, "LocalExecutor", RecordingExecutor)
    monkeypatch.setattr(submitit, "SlurmExecutor", RecordingExecutor)
    RecordingExecutor.made.clear()
    run = tmp_path / "run"
    rc = cli.main(["submit", DEMO, "--cluster", "sandbox", f"run.dir={run}", "train.global_batch_size=32"])
    err = capsys.readouterr().err
    assert rc == 2, err  # the CLI's code for a refused submission
    assert "did not answer within 0.3 s" in err and "nothing was started" in err and "executor: local" in err
    assert RecordingExecutor.made == [] and not run.exists()


def test_dry_run_says_which_executor_and_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = [f"run.dir={tmp_path / 'run'}", "train.global_batch_size=32"]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no SLURM client at all
    assert cli.main(["submit", DEMO, "--cluster", "sandbox", "--dry-run", *overrides]) == 0
    assert "executor: local (auto: no SLURM client installed: sbatch is not on PATH)" in capsys.readouterr().err
    bindir = hanging_controller(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("HPCDIST_SLURM_PING_TIMEOUT", "0.3")
    assert cli.main(["submit", DEMO, "--cluster", "sandbox", "--dry-run", *overrides]) == 0
    err = capsys.readouterr().err
    assert "executor: none: submit would refuse" in err and "did not answer within" in err


def test_answering_controller_means_slurm(fake_slurm: Path) -> None:
    assert choose_executor(load_cluster("sandbox"))[0] == "slurm"
    assert choose_executor(load_cluster("local"))[0] == "local"


class RecordingExecutor:
    """Stands in for submitit.LocalExecutor: records what submit() asks for."""

    made: ClassVar[list[RecordingExecutor]] = []

    def __init__(self, folder: Path, python: str | None = None) -> None:
        self.folder, self.python, self.params = Path(folder), python, {}
        RecordingExecutor.made.append(self)

    def update_parameters(self, **params: Any) -> None:
        self.params.update(params)

    def submit(self, fn: Any) -> Any:
        self.fn = fn
        return SimpleNamespace(job_id="777", get_info=lambda: {"jobState": "RUNNING"})


def test_submit_falls_back_to_the_local_executor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch anywhere
    monkeypatch.setattr(submitit, "LocalExecutor", RecordingExecutor)
    RecordingExecutor.made.clear()
    overrides = [f"run.dir={tmp_path / 'run'}", "train.global_batch_size=32"]
    handle = submit("configs/demo.yaml", overrides, cluster="sandbox", time="10")
    assert isinstance(handle, JobHandle)
    (ex,) = RecordingExecutor.made
    assert ex.params["tasks_per_node"] == 4  # = the cluster's gpus_per_node
    assert ex.params["timeout_min"] == 10 and ex.params["signal_delay_s"] == 30
    assert "export HPCDIST_NCCL_PROFILE=ethernet" in ex.params["setup"]
    assert ex.folder == tmp_path / "run" / "slurm"
    assert isinstance(ex.fn, TrainTask) and ex.fn.config_path == DEMO  # made absolute
    assert (handle.job_id, handle.executor, handle.state, handle.num_tasks) == ("777", "local", "RUNNING", 4)
    assert handle.paths[3].stderr == tmp_path / "run" / "slurm" / "777_3_log.err"


def test_submit_through_slurm_sends_the_dry_run_script(fake_slurm: Path, tmp_path: Path) -> None:
    args: dict[str, Any] = dict(cluster="sandbox", nodes=2, job_name=NASTY_NAME)
    overrides = [f"run.dir={tmp_path / 'my runs'}", "train.global_batch_size=64"]
    handle = submit(DEMO, overrides, **args)
    assert isinstance(handle, JobHandle)
    assert (handle.job_id, handle.executor, handle.num_tasks) == ("4242", "slurm", 8)
    submitted = (fake_slurm / "submitted.sh").read_text()
    assert snapshot_free(submitted) == snapshot_free(submit(DEMO, overrides, dry_run=True, **args))
    assert f"export PYTHONPATH={shlex.quote(handle.snapshot)}$" in submitted
    assert Path(handle.snapshot, "hpcdist", "cli.py").is_file()
    folder = tmp_path / "my runs" / "slurm"
    assert handle.paths[5].stdout == folder / "4242_5_log.out"
    task = handle.job.submission().function  # what the nodes will unpickle
    # the config inside the checkout is read from the snapshot, like the code
    assert task == TrainTask(str(Path(handle.snapshot) / "configs" / "demo.yaml"), tuple(overrides))
    assert handle.state == "RUNNING"
    handle.cancel()
    assert (fake_slurm / "scancel.args").read_text().strip() == "4242"


def test_sbatch_refusal_is_a_launch_error(fake_slurm: Path, tmp_path: Path) -> None:
    write_exe(fake_slurm / "sbatch", "echo 'sbatch: error: invalid partition specified: debug' >&2; exit 1")
    with pytest.raises(LaunchError, match="invalid partition specified"):
        submit(DEMO, [f"run.dir={tmp_path}", "train.global_batch_size=32"], cluster="sandbox")


# --------------------------------------------------------------------------------------------- job handle


def handle_with_results(tmp_path: Path, outcomes: list[tuple[str, Any] | None]) -> JobHandle:
    for rank, outcome in enumerate(outcomes):
        if outcome is not None:
            write_result(tmp_path, "55", rank, outcome)  # what each task writes (never read: submitit's pickle)
    return JobHandle(SimpleNamespace(job_id="55"), executor="slurm", folder=tmp_path, num_tasks=len(outcomes))


def test_handle_waits_for_slurm_and_reads_rank_results(
    fake_slurm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = {"step": 7, "loss": 1.5}
    handle = handle_with_results(tmp_path, [("success", result), ("success", result)])
    with pytest.raises(TimeoutError, match="still RUNNING"):
        handle.wait(timeout=0.3, poll_s=0.1)
    monkeypatch.setenv("FAKE_STATE", "COMPLETED")
    assert handle.wait() == "COMPLETED"
    assert handle.result() == result and handle.results() == [result, result]
    monkeypatch.setenv("FAKE_STATE", "REQUEUED")  # preempted and requeued: not finished
    assert handle.done() is False
    monkeypatch.setenv("FAKE_STATE", "GONE")  # forgotten by the controller, no accounting: judged by results
    assert handle.state == "COMPLETED"


def test_handle_reports_a_failed_rank(fake_slurm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_STATE", "FAILED")
    handle = handle_with_results(tmp_path, [("success", {}), ("error", "Traceback ...\nValueError: boom")])
    with pytest.raises(LaunchError, match=r"(?s)rank 1 failed.*boom"):
        handle.result()
    handle = handle_with_results(tmp_path / "none", [None])
    monkeypatch.setenv("FAKE_STATE", "GONE")
    assert handle.state == "UNKNOWN"
    with pytest.raises(LaunchError, match="without a result from rank 0"):
        handle.result()


# --------------------------------------------------------------------------------------------- task


def test_train_task_pickles_and_has_no_submitit_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    task = TrainTask("configs/demo.yaml", ["train.steps=3"])
    assert task.config_path == DEMO and task.overrides == ("train.steps=3",)
    assert pickle.loads(pickle.dumps(task)) == task
    # submitit would call checkpoint() on rank 0 only; the trainer saves collectively on all ranks instead
    assert not hasattr(task, "checkpoint") and not hasattr(task, "__submitit_checkpoint__")


def test_local_tasks_get_torchrun_style_ranks() -> None:
    environ = {
        "SUBMITIT_EXECUTOR": "local",
        "SUBMITIT_LOCAL_NTASKS": "2",
        "SUBMITIT_LOCAL_GLOBALID": "1",
        "SUBMITIT_LOCAL_LOCALID": "1",
        "SUBMITIT_LOCAL_JOB_ID": "31337",
        "SLURM_JOB_ID": "9",
        "SLURM_PROCID": "0",
    }
    local_rank_environ(environ)
    assert {k: environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")} == {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
    }
    assert 20000 <= int(environ["MASTER_PORT"]) < 40000
    # an enclosing allocation's job is not this job: the trainer must never requeue it
    assert not any(k.startswith("SLURM_") for k in environ)
    slurm = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_PROCID": "3"}
    local_rank_environ(slurm)
    assert slurm == {"SUBMITIT_EXECUTOR": "slurm", "SLURM_PROCID": "3"}


def test_train_task_runs_the_cli_path_and_applies_the_nccl_profile(
    tmp_path: Path, clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clean_env.setenv("HPCDIST_NCCL_PROFILE", "ethernet")
    out = TrainTask(DEMO, (*TINY, f"run.dir={tmp_path}", "train.steps=3"))()
    assert out["step"] == 3 and out["loss_step"] == 3 and out["loss"] > 0 and out["resumed_from"] is None
    assert os.environ["NCCL_IB_DISABLE"] == "1"  # applied before the (here: absent) process group
    assert "nccl profile ethernet:" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------- status, logs, cancel


def test_logs_from_run_dir_and_from_slurm(
    fake_slurm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "run" / "slurm"
    folder.mkdir(parents=True)
    (folder / "4242_0_log.out").write_text("rank 0 says hi\n")
    (folder / "4242_3_log.err").write_text("rank 3 complains\n")
    assert cli.main(["logs", "4242", "--rank", "3", "--err", "--run-dir", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().out == "rank 3 complains\n"
    monkeypatch.setenv("FAKE_STDOUT", str(folder / "4242_0_log.out"))
    assert cli.main(["logs", "4242"]) == 0
    assert capsys.readouterr().out == "rank 0 says hi\n"
    assert cli.main(["logs", "4242", "--rank", "9"]) == 2
    assert "no log 4242_9_log.out" in capsys.readouterr().err


def test_status_and_cancel(fake_slurm: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", "4242"]) == 0
    out = capsys.readouterr().out
    assert "JobState: RUNNING" in out and "JobName: my job" in out
    assert cli.main(["cancel", "4242"]) == 0
    assert (fake_slurm / "scancel.args").read_text().strip() == "4242"
    assert capsys.readouterr().out == "cancelled job 4242: CANCELLED\n"  # said once the controller says it ended
    assert cli.main(["cancel", "4242; rm -rf /"]) == 2
    assert "is not a job id" in capsys.readouterr().err


def test_status_without_slurm_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert cli.main(["status", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hpcdist: status: scontrol is not on PATH") and "Traceback" not in err


def test_submit_help_lists_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["submit", "--help"])
    out = capsys.readouterr().out
    for option in (
        "--cluster",
        "--nodes",
        "--gpus-per-node",
        "--time",
        "--partition",
        "--account",
        "--qos",
        "--constraint",
        "--exclude",
        "--job-name",
        "--sbatch-arg",
        "--dry-run",
        "--wait",
    ):
        assert option in out


def test_sbatch_arg_adds_to_the_cluster_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = tmp_path / "c.yaml"
    cluster.write_text("gpus_per_node: 1\nextra_sbatch: [--comment=base]\n")
    rc = cli.main(
        ["submit", DEMO, "--cluster", str(cluster), "--sbatch-arg=--mail-type=END", "--dry-run", f"run.dir={tmp_path}"]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "#SBATCH --comment=base" in out and "#SBATCH --mail-type=END" in out


def test_import_hpcdist_is_light_and_submit_is_lazy() -> None:
    code = (
        "import sys, hpcdist; assert 'torch' not in sys.modules and 'submitit' not in sys.modules; "
        "import hpcdist.launch.submit; from hpcdist.launch import submit; assert callable(submit); "
        "assert hpcdist.submit is submit; print('ok')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "ok", proc.stderr


def test_parameters_are_valid_for_submitit() -> None:
    # submitit's SlurmExecutor refuses unknown parameters; its own check uses _make_sbatch_string's signature
    from submitit.slurm.slurm import _get_default_parameters

    params = slurm_parameters(load_cluster("a100_ib", partition="gpu"), job_name="x")
    assert set(params) <= set(_get_default_parameters())


def test_cluster_config_defaults_are_valid() -> None:
    assert ClusterConfig().problems() == []
    assert _signal_name("sigusr2") == _signal_name(" USR2") == "USR2"


# --------------------------------------------------------------------------------------------- slow


@pytest.mark.slow
def test_local_executor_trains_two_ranks(
    tmp_path: Path, clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """hpcdist submit with the LocalExecutor: two real ranks (started like spawn: ~10 s) train to the end, and the
    follow commands submit prints work as printed (`hpcdist status N` without --run-dir failed)."""
    argv = ["submit", DEMO, *TINY, f"run.dir={tmp_path}", "train.steps=4", "--cluster", "local", "--time", "5"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    found = re.search(
        r"submitted job (\d+) \(local, 2 ranks\).*follow: (hpcdist status .*); (hpcdist logs .*)", out, re.S
    )
    assert found, out
    job, status, logs = (
        found.group(1),
        shlex.split(found.group(2))[1:],
        shlex.split(found.group(3).replace(" R", " 1"))[1:],
    )
    assert status == ["status", job, "--run-dir", str(tmp_path)]
    deadline = time.monotonic() + 120
    text = ""
    while ": RUNNING" in text or not text:
        assert time.monotonic() < deadline, text
        assert cli.main(status) == 0
        text = capsys.readouterr().out
        time.sleep(0.5)
    # status and logs of a local job come from the run dir's record (SLURM knows nothing of it)
    assert f"job {job} (local executor" in text and ": COMPLETED" in text and "step 4, loss" in text, text
    log0 = (tmp_path / "slurm" / f"{job}_0_log.out").read_text()
    assert "ddp on 2 rank(s)" in log0 and "done: step 4" in log0
    assert cli.main(logs) == 0
    assert capsys.readouterr().out == (tmp_path / "slurm" / f"{job}_1_log.out").read_text()


# --------------------------------------------------------------------------------------------- memory check


def test_submit_refuses_a_layout_predicted_not_to_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """configs/train_13b.yaml (zero3, micro batch 2) without checkpointing on the default 1 node of a100_ib: the planner
    predicts 111.5 GiB/GPU of 78 usable; submit refuses and names the layouts that fit; --force renders it."""
    base = [
        "submit",
        str(REPO / "configs" / "train_13b.yaml"),
        "--cluster",
        "a100_ib",
        "--dry-run",
        f"run.dir={tmp_path / 'run'}",
        "train.activation_checkpointing=none",
        "train.micro_batch_size=2",
    ]
    assert cli.main(base) == 2
    out, err = capsys.readouterr()
    assert out == "" and "111.5 GiB per GPU, 78 GiB usable" in err
    # the planner's best row: the roomiest of the fast ones (selective at micro batch 2 fits too, but tight)
    assert "zero3 x 8 ranks, micro batch 1, activation checkpointing none, 71.6 GiB/GPU" in err
    assert "(overrides: train.micro_batch_size=1)" in err
    assert cli.main([*base, "train.micro_batch_size=1"]) == 0  # the named fix passes the check
    capsys.readouterr()
    assert cli.main([*base, "--force"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("#!/bin/bash") and "warning: --force: memory check:" in err
    # a profile without GPU memory numbers (the CPU sandbox) has nothing to check
    assert (
        cli.main(
            [*base[:2], "--cluster", "sandbox", "--dry-run", f"run.dir={tmp_path / 'run'}", "--gpus-per-node", "8"]
        )
        == 0
    )


# --------------------------------------------------------------------------------------------- sweeps, dependencies


def test_sweep_grid_is_one_array_with_a_run_dir_per_task(
    fake_slurm: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = tmp_path / "sw"
    argv = [
        "submit",
        DEMO,
        "--cluster",
        "sandbox",
        f"run.dir={base}",
        "--sweep",
        "optim.lr=1e-4,3e-4,1e-3",
        "--sweep",
        "train.global_batch_size=32,64",
        "--max-parallel",
        "2",
    ]
    assert cli.main([*argv, "--dry-run"]) == 0
    script, err = capsys.readouterr()
    assert "#SBATCH --array=0-5%2" in script and f"#SBATCH --output={base}/slurm/%A_%a_0_log.out" in script
    names = [f"optim.lr={lr}_train.global_batch_size={b}" for lr in ("1e-4", "3e-4", "1e-3") for b in (32, 64)]
    assert f"hpcdist_run_dirs=({' '.join(str(base / n) for n in names)})" in script
    assert '--run-dir "${hpcdist_run_dirs[$SLURM_ARRAY_TASK_ID]}"' in script
    assert [line.rsplit(": ", 1)[1] for line in err.splitlines() if "sweep task" in line] == [
        str(base / n) for n in names
    ]
    # submitted for real (sbatch stand-in): the very script, one handle per task, the record status reads
    assert cli.main(argv) == 0
    assert "submitted sweep as job array 4242 (6 tasks, 4 ranks each)" in capsys.readouterr().out
    submitted = (fake_slurm / "submitted.sh").read_text()
    # the CLI printed a newline; submitit ends its file with one where the script has no teardown
    assert snapshot_free(submitted).rstrip("\n") == snapshot_free(script).rstrip("\n")
    record = json.loads((base / "sweep.json").read_text())
    assert [t["job_id"] for t in record["tasks"]] == [f"4242_{i}" for i in range(6)]
    assert record["tasks"][5]["overrides"] == ["optim.lr=1e-3", "train.global_batch_size=64"]
    pickled = [pickle.loads((base / "slurm" / f"4242_{i}_submitted.pkl").read_bytes()).function for i in (0, 5)]
    assert pickled[1].overrides[-3:] == ("optim.lr=1e-3", "train.global_batch_size=64", f"run.dir={base / names[5]}")
    (base / names[5]).mkdir()
    (base / names[5] / "metrics.jsonl").write_text('{"step": 7, "loss": 2.5}\n{"step": 8, "loss": 2.25}\n')
    assert cli.main(["status", "4242", "--run-dir", str(base)]) == 0
    table = capsys.readouterr().out
    assert "sweep job 4242: 6 task(s)" in table
    assert re.search(r"4242_5 RUNNING\s+\S+\s+8\s+2\.2500  " + re.escape(str(base / names[5])), table), table


def test_a_bad_sweep_value_refuses_the_whole_sweep(
    fake_slurm: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep_file = tmp_path / "points.yaml"
    sweep_file.write_text("- {optim.lr: 1.0e-3}\n- {optim.lr: 3.0e-3, train.global_batch_size: 30}\n")
    argv = ["submit", DEMO, "--cluster", "sandbox", f"run.dir={tmp_path / 'sw'}", "--sweep-file", str(sweep_file)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "sweep task optim.lr=0.003_train.global_batch_size=30: train.global_batch_size" in err
    assert not (fake_slurm / "submitted.sh").exists() and not (tmp_path / "sw").exists()
    assert cli.main([*argv[:-2], "--sweep", "optim.lr"]) == 2
    assert "--sweep 'optim.lr': write key=value1,value2" in capsys.readouterr().err


def test_after_and_chain_render_dependencies(fake_slurm: Path, tmp_path: Path, capsys: Any) -> None:
    argv = ["submit", DEMO, "--cluster", "sandbox", f"run.dir={tmp_path / 'r'}", "train.global_batch_size=32"]
    assert cli.main([*argv, "--after", "123:afterok", "--dry-run"]) == 0
    assert "#SBATCH --dependency=afterok:123" in capsys.readouterr().out
    assert cli.main([*argv, "--after", "12;rm", "--dry-run"]) == 2
    assert "--after 12;rm" in capsys.readouterr().err
    assert cli.main([*argv, "--chain", "2"]) == 0
    assert "submitted job 4242 (slurm, 4 ranks); then 4242 (chained, afterany)" in capsys.readouterr().out
    # the second job depends on the first; both run with fault.requeue=false
    assert "#SBATCH --dependency=afterany:4242" in (fake_slurm / "submitted.sh").read_text()
    task = pickle.loads((tmp_path / "r" / "slurm" / "4242_submitted.pkl").read_bytes()).function
    assert task.overrides[-1] == "fault.requeue=false"


# --------------------------------------------------------------------------------------------- setup, containers

SETUP = ["module load cuda/12.4 nccl", "source /shared/venvs/train/bin/activate", "export HF_HOME='/shared/hf cache'"]
CONTAINERS = {
    "pyxis": {
        "runtime": "pyxis",
        "image": "nvcr.io#nvidia/pytorch:24.05-py3",
        "mounts": ["/shared:/shared", "/scratch/$USER:/scratch:rw"],
        "workdir": "/shared/code",
    },
    "apptainer": {
        "runtime": "apptainer",
        "image": "/shared/images/train it.sif",
        "mounts": ["/shared", "/scratch:/scratch"],
        "workdir": "/shared/code",
    },
}


@pytest.mark.parametrize("runtime", sorted(CONTAINERS))
def test_container_and_setup_rendering_matches_golden_file(
    runtime: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / f"{runtime}.yaml"
    data = yaml.safe_load(resources.path("cluster", "sandbox").read_text())
    profile.write_text(yaml.safe_dump({**data, "setup": SETUP, "container": CONTAINERS[runtime]}))
    rc = cli.main(
        [
            "submit",
            DEMO,
            "--cluster",
            str(profile),
            f"run.dir={tmp_path / 'run'}",
            "train.global_batch_size=32",
            "--dry-run",
        ]
    )
    out = capsys.readouterr()
    assert rc == 0, out.err
    text = normalize(out.out, tmp_path)
    golden = REPO / "tests" / "data" / f"submit_{runtime}.golden"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), "rendered script changed; see this file's docstring to regenerate"
    setup_at = text.index("# setup\n") + len("# setup\n")
    assert text[setup_at:].startswith("\n".join(SETUP) + "\n")  # the site's lines first, as written
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    if runtime == "pyxis":
        assert "'--container-image=nvcr.io#nvidia/pytorch:24.05-py3'" in srun
        assert "'--container-mounts=/shared:/shared,/scratch/$USER:/scratch:rw'" in srun  # quoted: no expansion
        assert "--container-workdir=/shared/code PYTHON -m hpcdist.fault.supervise" in srun
    else:
        prefix = (
            "apptainer exec --bind /shared --bind /scratch:/scratch --pwd /shared/code '/shared/images/train it.sif'"
        )
        wrapped = f"{prefix} PYTHON -m hpcdist.fault.supervise -- PYTHON -u -m submitit"
        assert wrapped in srun
        # the attempt loop (in-job restarts, the failure policy) runs inside the container too
        assert f"srun() {{ {prefix} PYTHON -m hpcdist.launch.attempts --run-dir" in text
    assert text.count("hpcdist.fault.supervise") == 1  # the supervisor inside, signals forwarded as without


@pytest.mark.parametrize(
    ("container", "fragment"),
    [
        ({"runtime": "docker", "image": "x"}, "cluster.container.runtime: 'docker' is not one of"),
        ({"runtime": "apptainer"}, "cluster.container.image: required for runtime apptainer"),
        ({"runtime": "command"}, "cluster.container.wrapper: required for runtime command"),
        ({"image": "x", "mounts": ["/a,/b"]}, "cluster.container.mounts[0]: one SRC[:DST[:FLAGS]] without commas"),
        ({"image": "x", "imgae": "y"}, "cluster.container.imgae: unknown key"),
        ({"image": "x\nrm -rf /"}, "cluster.container.image: must be one line"),
    ],
)
def test_container_validation(container: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_cluster("sandbox", container=container)
    assert fragment in str(e.value)


def test_setup_lines_are_one_line_each() -> None:
    with pytest.raises(ConfigError, match=r"cluster.setup\[1\]: must be one line"):
        load_cluster("sandbox", setup=["module load x", "echo a\nrm -rf /"])
    with pytest.raises(ConfigError, match=r"cluster\.setup: must be a list of shell lines"):
        load_cluster("sandbox", setup=[1])


def test_code_snapshot_copies_the_tracked_files_and_records_the_commit(tmp_path: Path) -> None:
    from hpcdist.launch.snapshot import create_snapshot

    snap = create_snapshot(tmp_path / "run")
    git = ["git", "-C", str(REPO)]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    status = subprocess.run(
        [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, check=True
    ).stdout
    record = json.loads((snap.path / "snapshot.json").read_text())
    assert (record["git_commit"], record["dirty"], record["source"]) == (head, bool(status.strip()), str(REPO))
    assert snap.path.parent == tmp_path / "run" / "code"
    tracked = subprocess.run(
        [*git, "ls-files", "--cached", "--others", "--exclude-standard"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert record["files"] == len({f for f in tracked if (REPO / f).is_file()})
    assert not (snap.path / ".venv").exists()  # ignored by git: not copied
    assert (snap.path / "hpcdist" / "launch" / "submit.py").read_bytes() == Path(__file__).parents[3].joinpath(
        "hpcdist", "launch", "submit.py"
    ).read_bytes()
    assert snap.map(DEMO) == str(snap.path / "configs" / "demo.yaml") and snap.map("/etc/x.yaml") == "/etc/x.yaml"


def _checkout(root: Path) -> Path:
    """A git checkout like a user's: the package, a prepared dataset and a virtualenv git does not ignore, runs."""
    for rel, size in {
        "hpcdist/__init__.py": 10,
        "hpcdist/data/loader.py": 10,  # a package folder named data/ is source
        "configs/demo.yaml": 10,
        "data/corpus/shard_00000.bin": 4096,  # `hpcdist prepare ... --out data/corpus` (README)
        ".venv/lib/site.py": 10,
        "venv2/pyvenv.cfg": 10,
        "runs/demo/metrics.jsonl": 10,
        "notes/big.bin": 0,
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x" * size)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    return root


def test_code_snapshot_copies_only_source(tmp_path: Path) -> None:
    """Prepared data, virtualenvs and runs in the checkout are not code: a snapshot per submit must not copy them."""
    from hpcdist.launch.snapshot import create_snapshot

    root = _checkout(tmp_path / "repo")
    snap = create_snapshot(root / "runs" / "demo", root=root)
    copied = sorted(str(p.relative_to(snap.path)) for p in snap.path.rglob("*") if p.is_file())
    assert copied == [
        "configs/demo.yaml",
        "hpcdist/__init__.py",
        "hpcdist/data/loader.py",
        "notes/big.bin",
        "snapshot.json",
    ]


def test_code_snapshot_over_the_cap_is_refused_naming_the_largest_files(tmp_path: Path) -> None:
    from hpcdist.launch.snapshot import create_snapshot

    root = _checkout(tmp_path / "repo")
    (root / "notes" / "big.bin").write_bytes(b"x" * 3000)
    with pytest.raises(LaunchError) as e:
        create_snapshot(tmp_path / "run", root=root, max_bytes=2000)
    msg = str(e.value)
    assert "notes/big.bin (2.9 KiB)" in msg and "HPCDIST_SNAPSHOT_MAX_MB" in msg and "--no-snapshot" in msg
    assert "\n" not in msg and not (tmp_path / "run" / "code").exists()  # one line, nothing copied


def _children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # ended while we looked
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie has ended: only its parent has not read its status)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_status_and_cancel_of_a_local_job_from_its_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A real LocalExecutor job with setup lines (what submit makes: a /bin/sh wrapper around the controller, which
    does not pass a signal on): cancel must end the ranks, wait for them, and say so; status then says CANCELLED."""
    from hpcdist.launch.records import record_job

    executor = submitit.LocalExecutor(folder=tmp_path / "slurm")
    executor.update_parameters(timeout_min=5, tasks_per_node=2, setup=["true"])
    # the ranks get Ctrl-C's default action, as from a shell: a test run started in the background by a
    # non-interactive shell (CI scripts, nohup ... &) has SIGINT ignored, which the ranks would inherit, and cancel's
    # SIGINT then waited out its 60 s grace before SIGKILL (60 s of this test in such runs, 1.3 s otherwise)
    previous = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        job = executor.submit(time.sleep, 600)  # two ranks that would run for ten minutes
    finally:
        signal.signal(signal.SIGINT, previous)
    record_job(
        tmp_path,
        {
            "job_id": job.job_id,
            "executor": "local",
            "folder": str(tmp_path / "slurm"),
            "num_tasks": 2,
            "snapshot": None,
        },
    )
    try:
        deadline = time.monotonic() + 30
        ranks: list[int] = []
        while len(ranks) < 2 and time.monotonic() < deadline:  # the controller (the shell's child) starts the ranks
            ranks = [r for c in _children(int(job.job_id)) for r in _children(c)]
            time.sleep(0.05)
        assert len(ranks) == 2, "the local job's two ranks did not start"
        argv = [job.job_id, "--run-dir", str(tmp_path)]
        assert cli.main(["status", *argv]) == 0
        assert ": RUNNING" in capsys.readouterr().out
        assert cli.main(["cancel", *argv]) == 0
        out = capsys.readouterr().out
        assert not any(_running(r) for r in ranks), f"cancel returned while a rank still runs: {out}"
        assert f"cancelled job {job.job_id}" in out and "ended" in out
        assert cli.main(["status", *argv]) == 0
        assert ": CANCELLED" in capsys.readouterr().out
        assert cli.main(["cancel", *argv]) == 2
        assert "has already ended" in capsys.readouterr().err
    finally:
        job.cancel(check=False)
        for pid in (int(job.job_id), *ranks):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


_LATE_HANDLER = """
import os, signal, sys, time
time.sleep(1.5)  # the imports and checks before the trainer installs its handler; SIGINT ignored meanwhile
signal.signal(signal.SIGINT, lambda s, f: os._exit(0))  # the trainer's: checkpoint and stop
time.sleep(600)
"""


def test_cancel_of_a_local_job_started_with_sigint_ignored_reaches_its_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A local job started from nohup or a background shell ignores SIGINT until the trainer installs its handler;
    cancel's SIGINT sent in that window was lost, and cancel waited its 60 s grace, then SIGKILLed the ranks (mid-save
    if one had begun). It now sends SIGINT to each rank once the rank no longer ignores it: the ranks' own handler
    ends them in seconds, and nothing is SIGKILLed."""
    from hpcdist.launch.records import end_local_job

    executor = submitit.LocalExecutor(folder=tmp_path / "slurm")
    executor.update_parameters(timeout_min=5, tasks_per_node=2, setup=["true"])
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as `nohup hpcdist submit ... &` starts it
    try:
        job = executor.submit(exec, _LATE_HANDLER)
    finally:
        signal.signal(signal.SIGINT, previous)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while len(ranks) < 2 and time.monotonic() < deadline:
            ranks = [r for c in _children(int(job.job_id)) for r in _children(c)]
            time.sleep(0.05)
        assert len(ranks) == 2, "the local job's two ranks did not start"
        t0 = time.monotonic()
        how = end_local_job(int(job.job_id), grace_s=30)
        assert time.monotonic() - t0 < 20 and "SIGKILL" not in how and "ignored" not in how, how
        assert not any(_running(r) for r in ranks)
    finally:
        job.cancel(check=False)
        for pid in (int(job.job_id), *ranks):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def test_status_of_a_job_slurm_forgot_reads_the_run_dir(
    fake_slurm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plain `sbatch sbatch/train.sh` job that SLURM no longer remembers (no accounting): progress and attempts
    from the run dir."""
    monkeypatch.setenv("FAKE_STATE", "GONE")
    (tmp_path / "metrics.jsonl").write_text('{"step": 9, "loss": 3.5}\n{"split": "val", "step": 9, "loss": 3.0}\n')
    (tmp_path / "restarts.json").write_text(
        json.dumps({"job_id": "77", "attempts": {"0": {}, "1": {}}, "stopped": None})
    )
    assert cli.main(["status", "77"]) == 2  # without the run dir: one line, the tool's error
    assert cli.main(["status", "77", "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "job 77: SLURM does not know it now" in out and "step 9, loss 3.5000" in out
    assert "restart ledger of job 77: 2 attempt(s)" in out


@pytest.mark.slow
def test_local_submit_returns_the_job_id_to_a_command_substitution(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    """`JOB=$(hpcdist submit CONFIG --cluster local)`: the shell reads the command's stdout until every writer has
    closed it. The local job's controller and ranks must not hold the caller's stdout/stderr (their output goes to
    the log files), so the id comes back while the job trains on; the job then runs to its stop without its caller."""
    argv = [sys.executable, "-m", "hpcdist", "submit", DEMO, *TINY, f"run.dir={tmp_path}", "logging.every_steps=5"]
    argv += ["train.steps=1000000", "--cluster", "local", "--time", "5"]  # a job far longer than the test
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    try:
        out, err = proc.communicate(timeout=90)  # EOF on both pipes: no process of the job holds them
    except subprocess.TimeoutExpired:
        proc.kill()
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)  # the job's processes still hold the write end
        try:
            out = os.read(proc.stdout.fileno(), 1 << 16).decode(errors="replace")
        except BlockingIOError:
            out = ""
        found = re.search(r"submitted job (\d+)", out)
        if found:  # the job must not outlive the test
            subprocess.run([sys.executable, "-m", "hpcdist", "cancel", found.group(1), "--run-dir", str(tmp_path)])
        pytest.fail(f"submit's stdout stayed open for 90 s after it printed the job: {out!r}")
    took = time.monotonic() - t0
    found = re.search(r"submitted job (\d+) \(local, 2 ranks\)", out)
    assert proc.returncode == 0 and found, (out, err)
    job = found.group(1)
    tree = [int(job), *_children(int(job))]
    try:
        log0 = tmp_path / "slurm" / f"{job}_0_log.out"
        deadline = time.monotonic() + 120
        # the first logged step is enough to show it trains on after its caller left
        while "step 5/" not in (log0.read_text() if log0.exists() else ""):
            assert time.monotonic() < deadline, f"no training step in {log0} after submit returned in {took:.1f} s"
            time.sleep(0.5)
        tree += [r for c in tree[1:] for r in _children(c)]
        done = subprocess.run(
            [sys.executable, "-m", "hpcdist", "cancel", job, "--run-dir", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0 and "ended" in done.stdout, (done.stdout, done.stderr)
        assert not any(_running(p) for p in tree), "a process of the job outlived cancel"
        # the ranks alone: a SIGINT to the controller makes it send one more to each rank (a second Ctrl-C: abort,
        # the stop checkpoint lost) and SIGKILL them a second later
        assert "(SIGINT to 2 rank(s))" in done.stdout, done.stdout
        err0 = log0.with_suffix(".err").read_text()
        assert "Ctrl-C: stopping after this step" in err0, err0[-2000:]  # cancel reached the ranks' own stop
        assert "aborted without a checkpoint" not in err0, err0[-2000:]
        assert (tmp_path / "checkpoints").is_dir() and any(
            (d / "COMPLETE").exists() for d in (tmp_path / "checkpoints").iterdir()
        ), "cancel left no stop checkpoint"
    finally:
        for pid in {*tree, *(r for c in tree[1:] for r in _children(c))}:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def test_submit_says_when_the_layout_it_passes_is_tight(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """configs/train_13b.yaml on one a100_ib node fits within TIGHT_FRACTION of the usable memory: the fit check
    passes it and says so in one line naming the headroom; a roomier layout (two nodes) says nothing."""
    from hpcdist.planning.layouts import TIGHT_FRACTION

    base = ["submit", str(REPO / "configs" / "train_13b.yaml"), "--cluster", "a100_ib", "--dry-run"]
    assert cli.main([*base, f"run.dir={tmp_path / 'a'}"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "tight" in line]
    assert len(lines) == 1, lines
    found = re.search(r"needs ([\d.]+) of ([\d.]+) GiB usable per GPU, ([\d.]+) GiB headroom", lines[0])
    assert found, lines[0]
    need, usable, headroom = map(float, found.groups())
    assert (1 - TIGHT_FRACTION) * usable < need <= usable and abs(usable - need - headroom) < 0.06, lines[0]
    assert cli.main([*base, "--nodes", "2", f"run.dir={tmp_path / 'b'}"]) == 0
    assert "tight" not in capsys.readouterr().err


def test_submit_says_when_model_keys_hide_the_preset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The starter config edited from `preset: tiny` to `preset: 7b` still trains tiny's shape (explicit keys win):
    submit says so in one line, as `hpcdist config` does; the unedited starter says nothing."""
    assert cli.main(["config", "demo"]) == 0
    starter = capsys.readouterr().out
    edited = tmp_path / "my.yaml"
    edited.write_text(starter.replace("preset: tiny", "preset: 7b", 1))
    base = ["submit", "--cluster", "local", "--dry-run", f"run.dir={tmp_path / 'run'}"]
    assert cli.main([base[0], str(edited), *base[1:]]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "7b" in line and "dim" in line]
    assert len(lines) == 1, lines
    plain = tmp_path / "plain.yaml"
    plain.write_text(starter)
    assert cli.main([base[0], str(plain), *base[1:]]) == 0
    assert "preset" not in capsys.readouterr().err
