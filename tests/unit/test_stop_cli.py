"""Signals sent to a real ``hpcdist train`` process (issue 13.8): Ctrl-C and SIGTERM stop with a checkpoint, a
one-line message and the shell's exit status; the requeue signal during start-up is remembered, not fatal."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcdist.checkpoint import MARKER, list_checkpoints
from tests.conftest import REPO, SMALL


def _start(tmp_path: Path, corpus_dir: Path, *extra: str) -> tuple[subprocess.Popen[str], Path]:
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "hpcdist", "train", "configs/demo.yaml", *SMALL, "train.steps=100000",
           "data.source=files", f"data.path={corpus_dir}", f"run.dir={run}", *extra]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for var in ("SLURM_JOB_ID", "SLURM_PROCID", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)  # one local process, whatever runs the tests
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, run


def _wait_for(proc: subprocess.Popen[str], needle: str, timeout: float = 120) -> str:
    """Read the process's output until a line contains ``needle``; the text so far."""
    assert proc.stdout is not None
    seen, sel = [], selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sel.select(timeout=1):
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            if needle in line:
                return "".join(seen)
    proc.kill()
    pytest.fail(f"never printed {needle!r}:\n{''.join(seen)[-3000:]}")


@pytest.mark.parametrize(("sig", "code", "name"), [(signal.SIGINT, 130, "SIGINT"), (signal.SIGTERM, 143, "SIGTERM")])
def test_interrupt_or_terminate_stops_with_a_checkpoint_and_says_so(
    tmp_path: Path, corpus_dir: Path, sig: signal.Signals, code: int, name: str
) -> None:
    proc, run = _start(tmp_path, corpus_dir)
    _wait_for(proc, "step 2/100000")
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == code, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert "done:" not in out
    assert f"stopped early by {name}: step " in out and " complete; run the same command again" in out, out[-2000:]
    complete = list_checkpoints(run / "checkpoints")[0]
    assert complete and (complete[-1][1] / MARKER).is_file()
    stopped = int(out.split(f"stopped early by {name}: step ")[1].split()[0])
    assert complete[-1][0] == stopped  # the checkpoint is the step it stopped at: nothing to redo


def test_the_requeue_signal_during_start_up_is_remembered(tmp_path: Path, corpus_dir: Path) -> None:
    """USR2 before the loop (data, model, resume) used to kill the rank (status 140, the node blamed); now the run
    stops after its first steps with a checkpoint. Outside SLURM there is no requeue: exit 0, with the message."""
    proc, run = _start(tmp_path, corpus_dir)
    _wait_for(proc, "layout: ")  # logged while the Trainer is being built, before the loop
    proc.send_signal(signal.SIGUSR2)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, (proc.returncode, out[-3000:])
    assert "stopped early by the requeue signal: step " in out, out[-2000:]
    assert list_checkpoints(run / "checkpoints")[0]
