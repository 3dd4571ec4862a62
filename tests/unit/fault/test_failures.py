"""Failure records, attribution, the restart ledger and policy, node exclusion limits, the per-rank supervisor.

The requeue itself (scontrol) runs on the real SLURM sandbox: tests/slurm/test_faults_slurm.py.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcdist.base.rundir import RunDir
from hpcdist.diagnostics.finder import exclude_flag
from hpcdist.fault.failures import (
    classify_exception,
    primary_failure,
    read_failures,
    record,
    record_exception,
    signature,
)
from hpcdist.fault.health import record_unhealthy
from hpcdist.launch import restarts
from hpcdist.launch.restarts import (
    RestartPolicy,
    after_step,
    begin_attempt,
    failure_streak,
    load_ledger,
    parse_hosts,
    plan_exclusion,
    preemptions,
    save_ledger,
    time_limit_decision,
)
from hpcdist.schedulers import JobFacts

REPO = Path(__file__).resolve().parents[3]
# the texts torch 2.13's gloo raises when a peer process dies, and when a peer never answers
GLOO_PEER_DIED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:7585. This is typically caused by a remote worker crashing."
)
GLOO_TIMEOUT = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv"


def _policy(**kw) -> RestartPolicy:
    base = dict(
        requeue=True,
        max_time_limit=10,
        max_preemptions=-1,
        max_failures=5,
        max_same_failure=3,
        exclude_failed_nodes=True,
        max_excluded_nodes=2,
        exclude_nodes_file=None,
    )
    return RestartPolicy(**{**base, **kw})


def test_signature_ignores_numbers_paths_and_addresses() -> None:
    a = signature("exception", "RuntimeError: CUDA error at /opt/x/y.cu:12, device 3, ptr 0x7f00ab")
    b = signature("exception", "RuntimeError: CUDA error at /srv/z.cu:99, device 5, ptr 0x1234")
    assert a == b == "exception: RuntimeError: CUDA error at <path>:N, device N, ptr <hex>"
    assert signature("killed", "SIGKILL") != signature("killed", "SIGSEGV")


def test_peer_failures_are_not_blamed_on_the_rank_that_saw_them(tmp_path: Path) -> None:
    assert classify_exception(RuntimeError(GLOO_PEER_DIED)) == "collective"
    assert classify_exception(RuntimeError(GLOO_TIMEOUT)) == "collective"
    assert classify_exception(ValueError("loss is nan")) == "exception"
    try:
        raise RuntimeError(GLOO_PEER_DIED)
    except RuntimeError as e:
        peer = record_exception(tmp_path, e, rank=0, host="n1", step=7)
    try:
        raise MemoryError("out of memory on the host")
    except MemoryError as e:
        own = record_exception(tmp_path, e, rank=3, host="n2", step=7)
    assert peer is not None and peer["kind"] == "collective" and peer["blame"] == []
    assert own is not None and own["blame"] == [{"rank": 3, "host": "n2"}] and "MemoryError" in own["cause"]
    assert "Traceback" in own["detail"]
    assert [r["kind"] for r in read_failures(tmp_path)] == ["collective", "exception"]


def test_primary_failure_prefers_the_culprit_over_earlier_peer_errors() -> None:
    recs = [
        {"time": 1.0, "kind": "collective", "blame": []},  # a survivor noticed first
        {"time": 1.1, "kind": "killed", "blame": [{"rank": 2, "host": "n1"}]},  # the culprit's supervisor
        {"time": 6.0, "kind": "killed", "blame": [{"rank": 0, "host": "n1"}]},  # srun ending the step
        {"time": 0.5, "kind": "straggler", "blame": [{"rank": 1, "host": "n1"}]},  # a warning, not a failure
    ]
    assert primary_failure(recs)["blame"] == [{"rank": 2, "host": "n1"}]
    assert primary_failure(recs[:1])["kind"] == "collective"
    assert primary_failure(recs[3:]) is None


def test_a_gate_verdict_is_not_the_failure_of_the_step_that_ran_after_it(tmp_path: Path) -> None:
    """Found by tools/chaos: node2 failed the gate of attempt 5, node1 + node3 trained, rank 1 on node3 froze. The
    gate's record (blaming node2, earlier) was taken as the step's failure: the hang went unblamed, node2 was blamed
    again, and the recovery time was counted from the gate instead of the hang."""
    job = JobFacts("7", 5)
    record_unhealthy(tmp_path, "node2", ["nvidia_smi: GPU 0: 3 uncorrectable ECC error(s)"], job=job)
    hang = record(
        tmp_path,
        kind="hang",
        cause="no progress for 6 s",
        rank=0,
        host="node1",
        blame=[{"rank": 1, "host": "node3"}],
        job=job,
    )
    d = restarts.decide_failure(tmp_path, 124, _policy(), job)
    assert d.primary["kind"] == "hang" and d.blamed_hosts == ["node3"]
    assert d.entry["failed_at"] == hang["time"] and d.entry["signature"] == hang["signature"]
    # with no step failure (the gate left too few nodes), the verdict is still what the job has to go on
    assert primary_failure(read_failures(tmp_path, job_id="7", restart=5)[:1])["kind"] == "health"


def _append_many(run_dir: str, rank: int) -> None:
    for i in range(200):
        record(run_dir, kind="exception", cause=f"boom {i} " + "x" * 300, rank=rank, job=JobFacts("1", 0))


def test_concurrent_appends_keep_whole_lines(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_append_many, args=(str(tmp_path), r)) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    lines = RunDir(tmp_path).failures.read_text().splitlines()
    assert len(lines) == 800 and all(json.loads(line)["job_id"] == "1" for line in lines)


def test_preemptions_are_restarts_hpcdist_did_not_ask_for(tmp_path: Path) -> None:
    job0, policy = JobFacts("7", 0), _policy(max_preemptions=1)
    assert begin_attempt(tmp_path, policy, job0, write=True) is None
    data = load_ledger(tmp_path, "7")
    assert data["policy"]["max_preemptions"] == 1 and "0" in data["attempts"]
    restarts.mark_time_limit(tmp_path, job0, reason=None)  # restart 1 is ours (time limit)
    assert begin_attempt(tmp_path, policy, JobFacts("7", 1), write=True) is None
    assert begin_attempt(tmp_path, policy, JobFacts("7", 2), write=True) is None  # restart 2: SLURM's own (1)
    # restart 3: a second one SLURM made by itself -> over fault.max_preemptions=1; every rank says so, before
    # or after rank 0 wrote this attempt's entry
    assert "max_preemptions=1" in (begin_attempt(tmp_path, policy, JobFacts("7", 3), write=False) or "")
    assert "max_preemptions=1" in (begin_attempt(tmp_path, policy, JobFacts("7", 3), write=True) or "")
    assert "max_preemptions=1" in (begin_attempt(tmp_path, policy, JobFacts("7", 3), write=False) or "")
    data = load_ledger(tmp_path, "7")
    assert preemptions(data, 3) == 2 and data["stopped"]["restart"] == 3
    assert load_ledger(tmp_path, "8")["attempts"] == {}  # another job id: a fresh ledger
    assert begin_attempt(tmp_path, policy, JobFacts(None, 0), write=True) is None  # not SLURM: nothing to count


def test_time_limit_requeues_have_their_own_budget(tmp_path: Path) -> None:
    job = JobFacts("5", 4)
    data = {
        "job_id": "5",
        "attempts": {
            "0": {"requeued": "failure"},
            "1": {"requeued": "time_limit"},
            "2": {},
            "3": {"requeued": "time_limit"},
        },
        "excluded": [],
        "stopped": None,
        "policy": None,
    }
    save_ledger(tmp_path, data)
    assert time_limit_decision(tmp_path, 3, job) is None  # 2 time-limit requeues; the failure and preemption apart
    assert "max_restarts=2" in (time_limit_decision(tmp_path, 2, job) or "")
    assert "max_restarts=4" in (time_limit_decision(None, 4, job) or "")  # no run dir: SLURM_RESTART_COUNT
    restarts.mark_time_limit(tmp_path, job, reason=None)  # rank 0 marks this attempt: other ranks still agree
    assert time_limit_decision(tmp_path, 3, job) is None


def test_exclusion_never_makes_the_job_unschedulable() -> None:
    # one 1-node job on a 1-node partition: excluding its only node would leave it pending forever
    out, notes = plan_exclusion([], ["n1"], max_excluded=2, job_nodes=1, usable=["n1"])
    assert out == [] and "keep 0 usable node(s) for a 1-node job" in notes[0]
    out, notes = plan_exclusion([], ["n1"], max_excluded=2, job_nodes=1, usable=["n1", "n2"])
    assert out == ["n1"] and notes == []
    out, notes = plan_exclusion(["n1"], ["n2", "n3"], max_excluded=2, job_nodes=2, usable=["n1", "n2", "n3", "n4"])
    assert out == ["n1", "n2"] and "fault.max_excluded_nodes=2" in notes[0]
    out, _ = plan_exclusion(["n1"], ["n1", "n2"], max_excluded=5, job_nodes=1, usable=None)  # sinfo unavailable
    assert out == ["n1", "n2"]


def test_the_finders_suggestion_is_read_as_a_host_list() -> None:
    flag = exclude_flag(["gpu007", "gpu012"])  # what tools/nccl_check's finder prints
    assert flag is not None and parse_hosts(f"# from nccl_check\nsuggested: {flag}\ngpu[020-021]\n") == [
        "gpu007",
        "gpu012",
        "gpu020",
        "gpu021",
    ]
    assert parse_hosts("a,b\n\nb c\n") == ["a", "b", "c"]


def test_failure_loop_stops_requeueing_with_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = _policy(max_same_failure=2)
    sig = signature("killed", "rank 1 (pid 77) was killed by SIGKILL")
    # attempt 0 failed the same way and was requeued; attempt 1 fails again
    data = load_ledger(tmp_path, "9")
    data["attempts"]["0"] = {"restart": 0, "ended": "failure", "signature": sig, "requeued": "failure"}
    save_ledger(tmp_path, data)
    job = JobFacts("9", 1, partition="debug", num_nodes=1)
    record(
        tmp_path,
        kind="killed",
        cause="rank 1 (pid 99) was killed by SIGKILL",
        rank=1,
        host="n2",
        blame=[{"rank": 1, "host": "n2"}],
        job=job,
    )
    assert after_step(tmp_path, 137, policy, job) == 137  # not requeued: the job ends FAILED
    out = capsys.readouterr().out
    assert "killed: rank 1 (pid 99) was killed by SIGKILL [rank 1 on n2]" in out
    assert "failure loop: the same failure happened 2 time(s) in a row (fault.max_same_failure=2)" in out
    data = load_ledger(tmp_path, "9")
    assert "failure loop" in data["stopped"]["reason"] and data["attempts"]["1"]["ended"] == "failure"
    assert failure_streak(data, 1, sig) == 2
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # after_step ignores TERM while it requeues


def test_failure_budget_and_silent_failures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = JobFacts("4", 0)
    # nobody recorded anything (a node vanished): after-step records the exit itself; max_failures=0: no requeue
    assert after_step(tmp_path, 1, _policy(max_failures=0), job) == 1
    (rec,) = read_failures(tmp_path, job_id="4", restart=0)
    assert rec["kind"] == "exit" and "status 1" in rec["cause"]
    assert "fault.max_failures=0" in capsys.readouterr().out
    assert after_step(tmp_path, 0, _policy(), job) == 0  # success: nothing to decide
    # rank 0 requeued this attempt at its time limit; SLURM then ended the exiting ranks: nothing to decide either
    job = JobFacts("4", 1)
    restarts.mark_time_limit(tmp_path, job, reason=None)
    assert after_step(tmp_path, 143, _policy(), job) == 0 and "nothing to decide" in capsys.readouterr().out
    assert not read_failures(tmp_path, restart=1) and load_ledger(tmp_path, "4")["stopped"]["restart"] == 0
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _supervised(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    # the child announces itself the way hpcdist train does, then runs `code`
    child = (
        "import os, sys\n"
        "from hpcdist.fault.failures import announce_task\n"
        "from hpcdist.schedulers import JobFacts\n"
        f"announce_task({str(tmp_path)!r}, rank=5, host='hostA', job=JobFacts('12', 2))\n" + code
    )
    cmd = [sys.executable, "-m", "hpcdist.fault.supervise", "--", sys.executable, "-c", child]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_supervisor_records_a_rank_killed_by_a_signal_and_dies_the_same_way(tmp_path: Path) -> None:
    p = _supervised("os.kill(os.getpid(), 9)", tmp_path)
    assert p.returncode == -signal.SIGKILL, p.stderr  # srun sees "Killed", as without a supervisor
    (rec,) = read_failures(tmp_path)
    assert (rec["kind"], rec["rank"], rec["host"], rec["job_id"], rec["restart"]) == ("killed", 5, "hostA", "12", 2)
    assert rec["blame"] == [{"rank": 5, "host": "hostA"}] and rec["signature"] == "killed: SIGKILL"
    assert "SIGKILL" in p.stderr
    # one name: the module's own (the old `hpcdist.supervise:` prefix went with its shim)
    assert "hpcdist.fault.supervise: " in p.stderr and "hpcdist.supervise:" not in p.stderr


def test_supervisor_kills_a_rank_whose_watched_heartbeat_went_stale_and_blames_it(tmp_path: Path) -> None:
    # the child asks to be watched, beats once, then stops itself (SIGSTOP: its own threads stop with it)
    beat = tmp_path / "beat.json"
    code = (
        "from pathlib import Path\nfrom hpcdist.fault import supervise\n"
        f"Path({str(beat)!r}).write_text('{{}}')\n"
        f"supervise.watch(supervise.watch_file(), Path({str(beat)!r}), 1.0)\n"
        "os.kill(os.getpid(), 19)\n"
    )
    t0 = time.monotonic()
    p = _supervised(code, tmp_path)
    assert p.returncode == -signal.SIGKILL, p.stderr  # killed, though stopped
    assert time.monotonic() - t0 < 30
    (rec,) = read_failures(tmp_path)  # the frozen rank's record only, not a second "killed" one
    assert (rec["kind"], rec["rank"], rec["signature"]) == ("watchdog", 5, "watchdog: frozen")
    assert "wrote no heartbeat" in rec["cause"] and rec["blame"] == [{"rank": 5, "host": "hostA"}]


def test_a_watch_is_only_a_fresh_regular_files_age(tmp_path: Path) -> None:
    from hpcdist.fault import supervise

    beat, watch = tmp_path / "beat", tmp_path / "watch.json"
    assert supervise.frozen_for(watch, time.time()) is None  # nothing watched
    beat.write_text("")
    supervise.watch(watch, beat, 5.0)
    now = beat.stat().st_mtime
    assert supervise.frozen_for(watch, now + 1) is None  # fresh
    assert supervise.frozen_for(watch, now + 6) == pytest.approx((6.0, 5.0))
    beat.unlink()
    beat.symlink_to(tmp_path / "elsewhere")  # the run dir's file, never followed
    (tmp_path / "elsewhere").write_text("")
    assert supervise.frozen_for(watch, now + 6) is None
    watch.write_text('{"heartbeat": 3, "stale_s": "x"}')  # not what the child writes
    assert supervise.frozen_for(watch, now + 6) is None
    supervise.unwatch(watch)
    assert not watch.exists()


def test_the_old_module_names_are_gone() -> None:
    # `python -m hpcdist.supervise` / `hpcdist.launch.failures` were shims for scripts of an earlier version
    # (files, not find_spec: an editable install of another checkout would answer for this one)
    import hpcdist

    root = Path(hpcdist.__file__).parent
    for name in ("supervise.py", "launch/failures.py"):
        assert not (root / name).exists(), name


def test_supervisor_passes_exit_status_and_signals_through(tmp_path: Path) -> None:
    assert _supervised("sys.exit(7)", tmp_path).returncode == 7
    # SLURM ending the step (after another rank failed, or after a requeue) is no failure of this rank
    assert _supervised("os.kill(os.getpid(), 15)", tmp_path).returncode == -signal.SIGTERM
    assert not read_failures(tmp_path)  # an exit status is the rank's own business (it records exceptions itself)
    flag = tmp_path / "usr2"
    code = (
        "import signal, time\n"
        f"signal.signal(signal.SIGUSR2, lambda *a: open({str(flag)!r}, 'w').close())\n"
        "print('ready', flush=True)\n"
        f"deadline = time.time() + 60\nwhile not os.path.exists({str(flag)!r}) and time.time() < deadline:\n"
        "    time.sleep(0.01)\n"
    )
    child = (
        "import os, sys\nfrom hpcdist.fault.failures import announce_task\n"
        f"announce_task({str(tmp_path)!r}, rank=0, host='h')\n" + code
    )
    p = subprocess.Popen(
        [sys.executable, "-m", "hpcdist.fault.supervise", "--", sys.executable, "-c", child],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    os.kill(p.pid, signal.SIGUSR2)  # to the supervisor only: it forwards to the rank
    assert p.wait(60) == 0 and flag.exists()
    p.stdout.close()
