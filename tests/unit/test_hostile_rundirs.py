"""Every reader of a run directory against the generated hostile run dirs (tests/unit/hostile_rundirs.py): `status`,
`report`, the attempt loop, after-step and `train` never hang (each under a time bound; SIGTERM ends the attempt
loop within 5 s), never print a traceback, an "unexpected error" or a terminal escape, and never report a failed
step as a success. Plus the hostile cluster-prepare directories `status` reads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcdist.launch import attempts, records, restarts
from hpcdist.report import page
from hpcdist.report.rundata import RunData
from hpcdist.schedulers import JobFacts
from tests.conftest import SMALL
from tests.unit.hostile_rundirs import JOB, Hostile, hostile_rundirs, printed_problems, time_bound

HOSTILE = hostile_rundirs()
IDS = [h.name for h in HOSTILE]
BOUND_S = 5.0  # far above what any reader needs here (milliseconds); below it, a hang


def test_the_set_is_large_and_covers_every_file_kind() -> None:
    assert len(HOSTILE) >= 70
    assert {h.record for h in HOSTILE} >= {"restarts.json", "failures.jsonl", "goodput.json", "run_summary.json"}


@pytest.fixture
def signals_restored():
    """The attempt loop and after-step install signal handlers: give pytest its own back."""
    sigs = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
    saved = {s: signal.getsignal(s) for s in sigs}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


@pytest.fixture
def no_slurm_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No srun / scontrol / sinfo: the gate is unavailable and a requeue fails, so only the failure policy decides."""
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


def _check_output(capsys: pytest.CaptureFixture[str], extra: str = "") -> str:
    out = capsys.readouterr()
    text = out.out + out.err + extra
    assert not printed_problems(text), (printed_problems(text), text[-3000:])
    return text


@pytest.mark.parametrize("hostile", HOSTILE, ids=IDS)
def test_status_reads_a_hostile_run_dir(hostile: Hostile, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = hostile.build(tmp_path)
    with time_bound(BOUND_S):
        text = records.run_summary(run, JOB) + "\n" + records.run_summary(run)
    assert text.startswith(f"run dir {run}")
    _check_output(capsys, text)


@pytest.mark.parametrize("hostile", HOSTILE, ids=IDS)
def test_status_command_on_a_hostile_run_dir(
    hostile: Hostile, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_slurm_tools
) -> None:
    """`hpcdist status JOB --run-dir DIR` as a user types it (SLURM cannot answer: the run dir's records)."""
    from hpcdist import cli

    run = hostile.build(tmp_path)
    with time_bound(BOUND_S):
        rc = cli.main(["status", JOB, "--run-dir", str(run)])
    text = _check_output(capsys)
    assert rc == 0, text[-2000:]


@pytest.mark.parametrize("hostile", HOSTILE, ids=IDS)
def test_report_reads_a_hostile_run_dir(hostile: Hostile, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = hostile.build(tmp_path)
    with time_bound(BOUND_S):
        data = RunData.load(run)
        html = page.render_page(run, data, {})
    assert "hpcdist run report" in html
    _check_output(capsys)


@pytest.mark.parametrize("hostile", HOSTILE, ids=IDS)
def test_after_step_never_reports_a_failed_step_as_success(
    hostile: Hostile, tmp_path: Path, capsys: pytest.CaptureFixture[str], signals_restored, no_slurm_tools
) -> None:
    run = hostile.build(tmp_path)
    job = JobFacts(JOB, 0, scheduler="slurm", num_nodes=1)
    with time_bound(BOUND_S):
        rc = restarts.after_step(run, 1, None, job)
    assert rc == 1  # nothing could requeue it (no scontrol): the job must end FAILED
    _check_output(capsys)


@pytest.mark.parametrize("hostile", HOSTILE, ids=IDS)
def test_attempt_loop_ends_a_failing_job_on_a_hostile_run_dir(
    hostile: Hostile,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    signals_restored,
    no_slurm_tools,
) -> None:
    run = hostile.build(tmp_path)
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_JOB_ID", JOB)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n1")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "1")
    with time_bound(BOUND_S):
        rc = attempts.loop(["/bin/false"], run, 0, 0, 0.0)
    assert rc == 1
    _check_output(capsys)


def test_sigterm_ends_the_attempt_loop_within_5_s_on_a_fifo(tmp_path: Path) -> None:
    """A FIFO failures.jsonl and a step that fails: the loop reads the records, decides, and a TERM ends it."""
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "failures.jsonl")
    os.mkfifo(run / "restarts.json.in")  # a FIFO beside: nothing reads it
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(SLURM_JOB_ID=JOB, SLURM_JOB_NODELIST="n1", SLURM_NTASKS_PER_NODE="1", PATH="/nonexistent")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    step = [sys.executable, "-c", "import time; time.sleep(0.5); raise SystemExit(1)"]
    cmd = [sys.executable, "-m", "hpcdist.launch.attempts", "--run-dir", str(run), "--restart-backoff-s", "0.5"]
    proc = subprocess.Popen([*cmd, "--", *step], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        time.sleep(3.0)  # the first step failed by now, its records are being read
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        out, _ = proc.communicate(timeout=5.0)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = out.decode(errors="replace")
    assert took < 5.0
    assert proc.returncode != 0, text
    assert "srun exited with status 1" in text and "Traceback" not in text, text


# ------------------------------------------------------------------------------------------------ prepare dirs

_PLAN = {"slices": [[]], "tokenizer": "byte", "dtype": "uint16", "fingerprint": "f", "shard_tokens": 10,
         "text_field": "text"}  # fmt: skip
PREPARE_CASES = {
    "part_meta_num_tokens_string": ("parts/0/meta.json", json.dumps({"num_tokens": "x", "shards": []})),
    "part_meta_shards_number": ("parts/0/meta.json", json.dumps({"shards": 5, "num_tokens": 1})),
    "part_meta_deep": ("parts/0/meta.json", "[" * 100_000),
    "part_meta_fifo": ("parts/0/meta.json", None),
    "jobs_array_escape": ("parts/jobs.json", json.dumps({"array": "\x1b[2J\nFAKE LINE", "merge": [1, "\x1b[31m"]})),
    "jobs_list": ("parts/jobs.json", json.dumps([1, 2])),
    "jobs_fifo": ("parts/jobs.json", None),
    "progress_wrong": ("parts/0/progress.jsonl", '{"tokens": "x"}\n[1]\n{"tokens": 1e999}\n'),
    "progress_fifo": ("parts/0/progress.jsonl", None),
    "merged_meta_wrong": ("meta.json", json.dumps({"fingerprint": "f", "num_tokens": "x"})),
    "merged_meta_fingerprint_list": ("meta.json", json.dumps({"fingerprint": ["f"], "num_tokens": 3})),
}


@pytest.mark.parametrize("case", list(PREPARE_CASES))
def test_status_reads_a_hostile_prepare_dir(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hpcdist.data.array import prepare_status
    from hpcdist.launch.prepare_array import find_prepare

    out = tmp_path / "out"
    (out / "parts" / "0").mkdir(parents=True)
    (out / "parts" / "plan.json").write_text(json.dumps(_PLAN))
    rel, text = PREPARE_CASES[case]
    if text is None:
        os.mkfifo(out / rel)
    else:
        (out / rel).write_text(text)
    with time_bound(BOUND_S):
        assert find_prepare(None, out) == out
        shown = prepare_status(out)
    assert shown.startswith(f"cluster prepare {out}")
    _check_output(capsys, shown)


# ------------------------------------------------------------------------------------------------ train

TRAIN_CASES = {
    "goodput_fifo": ("goodput.json", None),
    "goodput_attempts_numbers": ("goodput.json", json.dumps({"attempts": [5]})),
    "restarts_fifo": ("restarts.json", None),
    "run_summary_fifo": ("run_summary.json", None),
}


@pytest.mark.parametrize("case", list(TRAIN_CASES))
def test_train_starts_and_ends_on_a_hostile_record(
    case: str, tmp_path: Path, corpus_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An accounting file never stops training: two steps, exit 0, whatever goodput.json, restarts.json or
    run_summary.json holds."""
    from hpcdist import cli
    from hpcdist import config as config_mod

    run = tmp_path / "run"
    run.mkdir()
    name, text = TRAIN_CASES[case]
    if text is None:
        os.mkfifo(run / name)
    else:
        (run / name).write_text(text)
    cfg = config_mod.load(
        None, [*SMALL, f"run.dir={run}", "data.source=files", f"data.path={corpus_dir}", "train.steps=2"]
    )
    yaml = tmp_path / "cfg.yaml"
    config_mod.save(cfg, yaml)
    capsys.readouterr()
    with time_bound(120.0):
        rc = cli.main(["train", str(yaml)])
    text_out = _check_output(capsys)
    assert rc == 0, text_out[-3000:]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert 2 in steps
