"""Every README command runs, the SLURM ones, on the sandbox: each runs with bash from its own
checkout-like scratch directory (configs/, sbatch/, tools/ symlinked: the batch scripts cd to $SLURM_SUBMIT_DIR, and
runs/ land there), with the sandbox's environment and the additions tests/readme_commands.py lists for it.

Every command of one sandbox shape is started by one module fixture before any test waits, so the jobs run side by
side (the batch scripts that ask for --exclusive still run alone); each test then waits for its own.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.readme_commands import TINY, as_run, check_for, command_id, run_bash, runnable, workdir
from tests.slurm.conftest import Cluster, job_info, job_output, wait_job

TIMEOUT = 360  # seconds a job may take from submission, queueing behind the others included


@dataclass
class Started:
    """One README command started on the sandbox."""

    command: str  # the line as run
    cwd: Path
    job_id: str = ""
    proc: subprocess.Popen[str] | None = None  # srun and the python block run in the foreground


def _submitted(command: str, proc: subprocess.CompletedProcess[str], pattern: str) -> str:
    found = re.search(pattern, proc.stdout)
    assert proc.returncode == 0 and found, f"`{command}` exited {proc.returncode}:\n{proc.stdout[-3000:]}"
    return found.group(1)


def _sbatch(cluster: Cluster, text: str, cwd: Path) -> Started:
    command = as_run(text, check_for(text))
    proc = run_bash(command, cwd, env=cluster.env, timeout=60)
    return Started(command, cwd, job_id=_submitted(command, proc, r"Submitted batch job (\d+)"))


def _submit(cluster: Cluster, command: str, cwd: Path) -> str:
    proc = run_bash(command, cwd, env=cluster.env, timeout=120)
    return _submitted(command, proc, r"submitted job (\d+) \(slurm, ")  # slurm, not submitit's local executor


def _background(cluster: Cluster, argv: list[str], command: str, cwd: Path) -> Started:
    out = (cwd / "command.out").open("w")
    proc = subprocess.Popen(  # its own process group: teardown can stop srun with the shell that started it
        argv, cwd=cwd, env=cluster.env, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    return Started(command, cwd, proc=proc)


def _finish(started: Started, timeout: float = TIMEOUT) -> str:
    assert started.proc is not None
    try:
        started.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(started.proc.pid, signal.SIGKILL)
        started.proc.wait()
    output = (started.cwd / "command.out").read_text(errors="replace")
    assert started.proc.returncode == 0, f"`{started.command}` exited {started.proc.returncode}:\n{output[-4000:]}"
    return output


def _expect(text: str, output: str) -> None:
    for fragment in check_for(text).expect:
        assert fragment in output, f"`{text}`: {fragment!r} not in its output:\n{output[-4000:]}"


def _scratch(root: Path, name: str) -> Path:
    return workdir(root / re.sub(r"\W+", "-", name)[:60])


# ------------------------------------------------------------------------------- one node x 8 fake GPUs


@pytest.fixture(scope="module")
def started(slurm_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Started]]:
    """Start every README command of the one-node sandbox at once; -> {README text: Started}."""
    root = tmp_path_factory.mktemp("readme")
    env = slurm_cluster.env
    out: dict[str, Started] = {}
    try:
        for text in runnable("jobctl"):
            # JOB: a 4-rank job that still runs when the line runs (rank 3 has a log; cancel has something to cancel).
            # Submitted first, and its test runs first and cancels it: it trains until then.
            cwd = _scratch(root, "jobctl")
            long_run = f"hpcdist submit configs/demo.yaml --cluster sandbox {' '.join(TINY)} train.steps=100000"
            out[text] = Started("", cwd, job_id=_submit(slurm_cluster, long_run, cwd))
        for text in runnable("sbatch"):
            out[text] = _sbatch(slurm_cluster, text, _scratch(root, text))
        for text in runnable("submit"):
            command = as_run(text, check_for(text))
            cwd = _scratch(root, text)
            out[text] = Started(command, cwd, job_id=_submit(slurm_cluster, command, cwd))
        for text in runnable("srun"):
            command = as_run(text, check_for(text))
            out[text] = _background(slurm_cluster, ["bash", "-c", command], command, _scratch(root, text))
        for text in runnable("python"):
            code = as_run(text, check_for(text))
            out[text] = _background(slurm_cluster, [sys.executable, "-c", code], code, _scratch(root, "python block"))
        yield out
    finally:
        for s in out.values():
            if s.proc is not None and s.proc.poll() is None:
                os.killpg(s.proc.pid, signal.SIGKILL)
                s.proc.wait()
            printed = re.match(r"\d+ ", (s.cwd / "command.out").read_text()) if s.proc is not None else None
            for job_id in {s.job_id, printed.group().strip() if printed else ""} - {""}:
                subprocess.run(["scancel", job_id], env=env, capture_output=True, check=False)


@pytest.mark.parametrize("text", runnable("jobctl"), ids=command_id)
def test_jobctl_command(slurm_cluster: Cluster, started: dict[str, Started], text: str) -> None:
    """First in the file: its job trains until this cancels it, taking CPU from the others meanwhile."""
    job = started[text]
    log3 = job.cwd / "runs" / "demo" / "slurm" / f"{job.job_id}_3_log.out"
    deadline = time.monotonic() + TIMEOUT
    while not (log3.exists() and log3.stat().st_size):
        info = job_info(slurm_cluster, job.job_id)
        assert info["JobState"] in ("PENDING", "RUNNING"), f"job {job.job_id} ended before rank 3 logged: {info}"
        assert time.monotonic() < deadline, f"no {log3} after {TIMEOUT} s: {info}"
        time.sleep(0.5)
    command = as_run(text, check_for(text), job=job.job_id)
    proc = run_bash(command, job.cwd, env=slurm_cluster.env, timeout=60)
    assert proc.returncode == 0, f"`{command}` exited {proc.returncode}:\n{proc.stdout[-3000:]}"
    assert re.search(rf"^\s*{job.job_id}\s+debug\s", proc.stdout, re.M), proc.stdout  # status: the queue shows it
    assert log3.read_text(errors="replace")[:200] in proc.stdout  # logs --rank 3 printed rank 3's log
    assert f"cancelled job {job.job_id}" in proc.stdout
    assert wait_job(slurm_cluster, job.job_id, timeout=60) == "CANCELLED"


@pytest.mark.parametrize("text", runnable("sbatch"), ids=command_id)
def test_sbatch_command(slurm_cluster: Cluster, started: dict[str, Started], text: str) -> None:
    job = started[text]
    state = wait_job(slurm_cluster, job.job_id, timeout=TIMEOUT)
    output = job_output(slurm_cluster, job.job_id)
    assert state == "COMPLETED", f"`{job.command}` -> job {job.job_id} {state}:\n{output[-4000:]}"
    assert Path(job_info(slurm_cluster, job.job_id)["StdOut"]).parent == job.cwd  # %x-%j.out in the submit dir
    _expect(text, output)
    run_dir = re.findall(r"run\.dir=(\S+)", job.command) or ["runs/demo"]  # relative to the submit dir
    assert (job.cwd / run_dir[-1] / "checkpoints" / "step-00000002" / "COMPLETE").is_file(), output[-3000:]


@pytest.mark.parametrize("text", runnable("srun"), ids=command_id)
def test_srun_command(started: dict[str, Started], text: str) -> None:
    output = _finish(started[text])
    _expect(text, output)
    assert (started[text].cwd / "runs" / "demo" / "checkpoints" / "step-00000002" / "COMPLETE").is_file(), output[
        -3000:
    ]


@pytest.mark.parametrize("text", runnable("submit"), ids=command_id)
def test_submit_command(slurm_cluster: Cluster, started: dict[str, Started], text: str) -> None:
    job = started[text]
    state = wait_job(slurm_cluster, job.job_id, timeout=TIMEOUT)
    log0 = job.cwd / "runs" / "demo" / "slurm" / f"{job.job_id}_0_log.out"
    log = log0.read_text(errors="replace") if log0.exists() else f"(no {log0})"
    assert state == "COMPLETED", f"`{job.command}` -> job {job.job_id} {state}:\n{log[-4000:]}"
    assert job_info(slurm_cluster, job.job_id)["NumTasks"] == "4"
    assert "step 2/2" in log and (job.cwd / "runs" / "demo" / "checkpoints" / "step-00000002" / "COMPLETE").is_file()


@pytest.mark.parametrize("text", runnable("python"), ids=command_id)
def test_python_block(slurm_cluster: Cluster, started: dict[str, Started], text: str) -> None:
    output = _finish(started[text])
    first = output.splitlines()[0] if output else ""
    found = re.match(r"(\d+) (\w+) (\S+_0_log\.out)$", first)
    assert found, f"print(job.job_id, job.state, job.paths[0].stdout) printed {first!r}:\n{output[-3000:]}"
    job_id, log0 = found.group(1), Path(found.group(3))
    assert job_info(slurm_cluster, job_id)["JobState"] == "COMPLETED"  # job.wait() returned at the end
    assert log0.is_file() and "step 2/2" in log0.read_text(errors="replace")


# ------------------------------------------------------------------------- two nodes x 4 fake GPUs each


@pytest.fixture(scope="module")
def started2(slurm_cluster2: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Started]]:
    """Submit every README command of the two-node sandbox at once."""
    root = tmp_path_factory.mktemp("readme2")
    out: dict[str, Started] = {}
    try:
        for text in runnable("sbatch2"):
            out[text] = _sbatch(slurm_cluster2, text, _scratch(root, text))
        yield out
    finally:
        for s in out.values():
            subprocess.run(["scancel", s.job_id], env=slurm_cluster2.env, capture_output=True, check=False)


@pytest.mark.parametrize("text", runnable("sbatch2"), ids=command_id)
def test_sbatch2_command(slurm_cluster2: Cluster, started2: dict[str, Started], text: str) -> None:
    job = started2[text]
    state = wait_job(slurm_cluster2, job.job_id, timeout=TIMEOUT)
    output = job_output(slurm_cluster2, job.job_id)
    assert state == "COMPLETED", f"`{job.command}` -> job {job.job_id} {state}:\n{output[-6000:]}"
    _expect(text, output)
    json_out = re.search(r"--json (\S+)", text)
    if json_out:  # written where the README says, relative to the submit directory
        assert (job.cwd / json_out.group(1)).is_file(), output[-3000:]
