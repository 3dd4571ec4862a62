"""One run per run.dir: a second run is refused before it writes anything; a dead holder never
blocks (the kernel drops a flock with its process); a requeue of the same job waits for its old step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcdist.base.rundir import RunDir
from hpcdist.checkpoint.names import list_checkpoints
from hpcdist.fault.rundir_lock import RunDirInUse, RunDirLock
from tests.conftest import REPO, SMALL

LOCK_FILE = RunDir(".").lock.name

HOLD = """
import sys, time
from hpcdist.fault.rundir_lock import RunDirLock
RunDirLock(sys.argv[1], job_id=sys.argv[2] or None).acquire()
print("held", flush=True)
time.sleep(float(sys.argv[3]))
"""


def _holder(run: Path, job_id: str = "", seconds: float = 600) -> subprocess.Popen[str]:
    """Another process (another job) holding run.dir's lock."""
    run.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run), job_id, str(seconds)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _reap(proc: subprocess.Popen[str]) -> None:
    """Wait for a holder and close its pipe (an unreaped child and an open pipe are ResourceWarnings)."""
    proc.wait()
    assert proc.stdout is not None
    proc.stdout.close()


def test_a_second_holder_is_refused_naming_the_first_and_a_killed_one_frees_it(tmp_path: Path) -> None:
    other = _holder(tmp_path, job_id="4242")
    try:
        with pytest.raises(RunDirInUse) as e:
            RunDirLock(tmp_path, job_id="7").acquire()
        msg = str(e.value)
        assert "run.dir" in msg and "SLURM job 4242" in msg and f"pid {other.pid}" in msg
        assert "scancel 4242" in msg and "choose another run.dir" in msg
    finally:
        other.send_signal(signal.SIGKILL)  # no clean-up runs: the lock must still go away
        _reap(other)
    lock = RunDirLock(tmp_path, job_id="7")
    lock.acquire()
    assert lock.held and '"job_id": "7"' in (tmp_path / LOCK_FILE).read_text()
    lock.acquire()  # idempotent within one process (a second Trainer of the same run)
    lock.release()
    assert not lock.held


def test_a_requeue_of_the_same_job_waits_for_its_old_step(tmp_path: Path) -> None:
    old = _holder(tmp_path, job_id="55", seconds=2)  # the old attempt, still exiting
    t0 = time.monotonic()
    lock = RunDirLock(tmp_path, job_id="55")
    lock.acquire(same_job_wait_s=30)
    assert lock.held and time.monotonic() - t0 >= 1
    lock.release()
    _reap(old)
    other = _holder(tmp_path, job_id="55")
    try:
        with pytest.raises(RunDirInUse):
            RunDirLock(tmp_path, job_id="55").acquire(same_job_wait_s=1.5)  # ... but not forever
    finally:
        other.kill()
        _reap(other)


def test_hpcdist_train_on_a_run_dir_in_use_exits_2_and_touches_nothing(tmp_path: Path, corpus_dir: Path) -> None:
    run = tmp_path / "run"
    first = [
        sys.executable,
        "-m",
        "hpcdist",
        "train",
        "configs/demo.yaml",
        *SMALL,
        "train.steps=4",
        "checkpoint.every_steps=2",
        "data.source=files",
        f"data.path={corpus_dir}",
        f"run.dir={run}",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_JOB_ID", "SLURM_PROCID", "RANK", "WORLD_SIZE")}
    done = subprocess.run(first, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.name != LOCK_FILE}
    assert [s for s, _ in list_checkpoints(run / "checkpoints")[0]] == [2, 4]

    other = _holder(run, job_id="4242")  # a second job on the same run.dir starts while this one runs
    try:
        again = subprocess.run(
            [*first, "train.steps=8"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
        )
    finally:
        other.kill()
        _reap(other)
    out = again.stdout + again.stderr
    assert again.returncode == 2, out[-3000:]
    assert out.count("is in use by SLURM job 4242") == 1 and "Traceback" not in out, out[-3000:]
    # nothing resumed, pruned, re-logged or overwritten
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.name != LOCK_FILE} == before
