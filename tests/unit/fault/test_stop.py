"""Stop reasons (hpcdist.fault.stop) and the after-stop requeue decision (hpcdist.launch.restarts.after_stop, no SLURM
needed: scontrol is replaced by a script on PATH)."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

import pytest
import torch

from hpcdist.base.logging_utils import setup_logging
from hpcdist.fault.stop import StopFlag, StopReason, signal_number
from hpcdist.launch.requeue import requeue
from hpcdist.launch.restarts import after_stop
from hpcdist.schedulers import JobFacts


def _after(job: JobFacts, reason: StopReason, *, rank: int = 0, **kw) -> int:
    return after_stop(reason, rank=rank, job=job, **kw)


def _fake_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rc: int = 0) -> Path:
    log = tmp_path / "calls"
    script = tmp_path / "bin" / "scontrol"
    script.parent.mkdir()
    script.write_text(f'#!/bin/sh\necho "$@" >> {log}\necho "scontrol: boom" >&2\nexit {rc}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{script.parent}:{os.environ['PATH']}")
    return log


def test_signal_sets_flag_only_and_term_wins() -> None:
    h = StopFlag(rank=0, device=torch.device("cpu"), job=JobFacts(None, 0)).install()
    try:
        assert h.agreed() == StopReason.NONE
        os.kill(os.getpid(), signal.SIGUSR2)
        assert h.agreed() == StopReason.TIME_LIMIT
        os.kill(os.getpid(), signal.SIGTERM)
        assert h.agreed() == StopReason.TERMINATE
        os.kill(os.getpid(), signal.SIGUSR2)  # a later USR2 never downgrades a TERM
        assert h.agreed() == StopReason.TERMINATE
    finally:
        h.uninstall()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_requeue_after_time_limit_signal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_scontrol(tmp_path, monkeypatch)
    assert _after(JobFacts("123", 0), StopReason.TIME_LIMIT) == 0
    assert calls.read_text().split() == ["requeue", "123"]


def test_no_requeue_on_terminate_limit_or_disabled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_scontrol(tmp_path, monkeypatch)
    assert _after(JobFacts("9", 0), StopReason.TERMINATE) == 0
    assert _after(JobFacts("9", 0), StopReason.TIME_LIMIT, requeue_enabled=False) == 0
    assert _after(JobFacts("9", 3), StopReason.TIME_LIMIT, max_restarts=3) == 3
    # not a SLURM job: nothing continues the partial run, so never 0 but 128 + the signal
    assert _after(JobFacts(None, 0), StopReason.TIME_LIMIT) == 128 + signal.SIGUSR2
    assert _after(JobFacts(None, 0), StopReason.TIME_LIMIT, requeue_signal="USR1") == 128 + signal.SIGUSR1
    assert _after(JobFacts(None, 0), StopReason.INTERRUPT) == 130
    assert _after(JobFacts(None, 0), StopReason.TERMINATE) == 143
    assert _after(JobFacts("9", 0), StopReason.TIME_LIMIT, rank=1) == 0  # only rank 0 talks to SLURM
    assert not calls.exists()


def test_requeue_failure_names_the_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    setup_logging(0)  # the hpcdist handler writes to stdout, whatever ran before
    _fake_scontrol(tmp_path, monkeypatch, rc=1)
    assert requeue("77") == 4
    assert "dependency=afterany:77" in capsys.readouterr().out
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert requeue("77") == 4


def test_signal_number() -> None:  # the job's facts from SLURM's variables: tests/unit/schedulers/test_schedulers.py
    assert signal_number("usr1") == signal.SIGUSR1 and signal_number("SIGTERM") == signal.SIGTERM


def test_a_held_signal_is_taken_over_by_the_stop_flag_or_given_back(request: pytest.FixtureRequest) -> None:
    """In one process with real signals: while the entry point holds them (hpcdist.base.signals.hold), a stop
    signal neither kills nor raises; the stop flag acts on it once installed; a command without a stop flag gets
    Ctrl-C's KeyboardInterrupt back at release."""
    from hpcdist.base import signals

    # a command starts with Python's own Ctrl-C handler (a pytest-xdist worker ignores SIGINT: restored afterwards)
    prev = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, prev))
    before = signal.getsignal(signal.SIGINT)
    signals.hold()
    try:
        os.kill(os.getpid(), signal.SIGUSR2)  # the default action would end this process
        os.kill(os.getpid(), signal.SIGTERM)
        h = StopFlag(rank=0, device=torch.device("cpu"), job=JobFacts(None, 0)).install()
        assert h.agreed() == StopReason.TERMINATE  # acted on, the strongest of the two
        h.uninstall()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the original, not the hold
        assert signal.getsignal(signal.SIGINT) is before
    finally:
        signals.release()
    signals.hold()
    os.kill(os.getpid(), signal.SIGINT)  # held: no KeyboardInterrupt in the middle of an import
    with pytest.raises(KeyboardInterrupt):
        signals.release()
    assert signal.getsignal(signal.SIGINT) is before
    assert StopReason.TIME_LIMIT.exit_code("USR2") == 140 and StopReason.NONE.exit_code() == 0
