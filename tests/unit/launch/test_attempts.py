"""The attempt loop (hpcdist.launch.attempts) with stand-in srun / scontrol / sinfo: the gate's verdicts, the nodes
each attempt runs on, in-job restart vs requeue, shrinking to fault.min_nodes; recovery split; submit's refusals.
The real-SLURM scenarios are tests/slurm/test_injob_slurm.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hpcdist import config as config_mod
from hpcdist.fault.failures import read_failures
from hpcdist.fault.goodput import recovery
from hpcdist.launch import attempts
from hpcdist.launch.records import run_summary
from hpcdist.launch.restarts import load_ledger, preemptions
from tests.conftest import SMALL

FAKE_SRUN = """#!{python}
import json, os, sys, time
log = os.environ["FAKE_LOG"]
args = sys.argv[1:]
nodes = next((a.split("=", 1)[1] for a in args if a.startswith("--nodelist=")), "")
nodes = nodes.split(",") if nodes else os.environ["SLURM_JOB_NODELIST_EXPANDED"].split(",")
health = "health" in args
with open(log, "a") as f:
    f.write(json.dumps(dict(argv=args, nodes=nodes, attempt=os.environ.get("HPCDIST_ATTEMPT"), health=health)) + "\\n")
if health:
    if os.environ.get("FAKE_NO_GATE"):
        print("usage: hpcdist: invalid choice: 'health'", file=sys.stderr)
        sys.exit(2)
    bad = os.environ.get("FAKE_BAD", "")
    for n in [n for n in nodes if n != os.environ.get("FAKE_SILENT")]:
        reasons = ["nvidia_smi: GPU 0: 3 uncorrectable ECC error(s)"] if n == bad else []
        print(json.dumps(dict(host=n, ok=n != bad, reasons=reasons, seconds=0.1)))
    sys.exit(1 if bad in nodes else 0)
steps = [json.loads(line) for line in open(log) if not json.loads(line)["health"]]
plan = os.environ.get("FAKE_STEPS", "0").split(",")
rc = int(plan[len(steps) - 1]) if len(steps) <= len(plan) else 0
if rc:
    victim = nodes[-1]
    rec = dict(time=time.time(), job_id="7", restart=int(os.environ["HPCDIST_ATTEMPT"]), rank=1, host=victim, pid=1,
               kind="killed", cause="rank 1 (pid 1) was killed by SIGKILL", blame=[dict(rank=1, host=victim)],
               step=3, signature="killed: SIGKILL")
    with open(os.path.join(os.environ["FAKE_RUN"], "failures.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\\n")
sys.exit(rc)
"""


@pytest.fixture(autouse=True)
def _signal_handlers_given_back():
    """The attempt loop's relay installs its handlers for good (it is a process of its own in a job); run in this
    process, it must not leave them to the next test file (test_stop.py saw _forward as SIGTERM's handler)."""
    sigs = (signal.SIGUSR2, signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
    saved = {s: signal.getsignal(s) for s in sigs}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A stand-in SLURM on PATH for a job of 3 nodes; returns (run dir, reader of the srun calls, scontrol log)."""
    bindir, run = tmp_path / "bin", tmp_path / "run"
    bindir.mkdir()
    run.mkdir()
    (bindir / "srun").write_text(FAKE_SRUN.format(python=sys.executable))
    (bindir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol.log\n')
    (bindir / "sinfo").write_text("#!/bin/sh\nprintf 'node1 idle\\nnode2 idle\\nnode3 idle\\nnode4 idle\\n'\n")
    for f in bindir.iterdir():
        f.chmod(0o755)
    for name in [n for n in os.environ if n.startswith(("SLURM_", "HPCDIST_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "srun.log"))
    monkeypatch.setenv("FAKE_RUN", str(run))
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "1")
    allocation(monkeypatch, 3)

    def calls(health: bool = False) -> list[dict]:
        lines = (tmp_path / "srun.log").read_text().splitlines()
        return [c for c in map(json.loads, lines) if c["health"] == health]

    def scontrol() -> str:
        path = tmp_path / "scontrol.log"
        return path.read_text() if path.exists() else ""

    return run, calls, scontrol


def allocation(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    monkeypatch.setenv("SLURM_JOB_NODELIST", f"node[1-{n}]")
    monkeypatch.setenv("SLURM_JOB_NODELIST_EXPANDED", ",".join(f"node{i}" for i in range(1, n + 1)))
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", str(n))


CMD = ["srun", "--kill-on-bad-exit=1", "python", "-m", "hpcdist", "train", "demo.yaml"]


def test_a_node_that_fails_the_gate_at_the_first_start_never_runs_a_rank(
    fake_slurm, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, calls, scontrol = fake_slurm
    monkeypatch.setenv("FAKE_BAD", "node2")
    assert attempts.loop(CMD, run, spare=1, min_nodes=0, backoff=0) == 0
    (gate,) = calls(health=True)
    assert gate["nodes"] == ["node1", "node2", "node3"] and "--ntasks-per-node=1" in gate["argv"]
    (step,) = calls()
    assert step["argv"][:4] == ["--nodes=2", "--ntasks=2", "--nodelist=node1,node3", "--kill-on-bad-exit=1"]
    assert step["attempt"] == "0"
    (rec,) = [r for r in read_failures(run) if r["kind"] == "health"]
    assert rec["host"] == "node2" and "3 uncorrectable ECC error(s)" in rec["cause"]
    ledger = load_ledger(run, "7")
    assert ledger["gate_failed"] == {"node2": ["nvidia_smi: GPU 0: 3 uncorrectable ECC error(s)"]}
    assert ledger["attempts"]["0"]["nodes"] == ["node1", "node3"] and ledger["attempts"]["0"]["path"] == "first"
    why = "nvidia_smi: GPU 0: 3 uncorrectable ECC error(s)"
    assert f"unhealthy node node2: failed the health gate: {why}" in run_summary(run)
    assert scontrol() == ""


def test_a_failed_step_restarts_in_the_job_on_the_spare(fake_slurm, monkeypatch: pytest.MonkeyPatch) -> None:
    run, calls, scontrol = fake_slurm
    monkeypatch.setenv("FAKE_STEPS", "1,0")  # the first step dies (rank 1 on node2 killed), the second succeeds
    assert attempts.loop(CMD, run, spare=1, min_nodes=0, backoff=0) == 0
    first, second = calls()
    assert (first["nodes"], first["attempt"]) == (["node1", "node2"], "0")
    assert (second["nodes"], second["attempt"]) == (["node1", "node3"], "1")
    assert [g["nodes"] for g in calls(health=True)] == [["node1", "node2", "node3"], ["node1", "node3"]]
    assert scontrol() == ""  # never requeued
    ledger = load_ledger(run, "7")
    a0, a1 = ledger["attempts"]["0"], ledger["attempts"]["1"]
    assert a0["restarted"] == "in-job" and a0["excluded"] == ["node2"] and a0["requeued"] is None
    assert a1["path"] == "in-job" and a1["nodes"] == ["node1", "node3"]
    assert preemptions(ledger, 1) == 0  # an in-job restart is not a restart SLURM made by itself
    assert "2 attempt(s) (1 restarted in the job)" in run_summary(run)


def test_too_few_healthy_nodes_requeue_with_the_bad_host_excluded(fake_slurm, monkeypatch: pytest.MonkeyPatch) -> None:
    run, calls, scontrol = fake_slurm
    allocation(monkeypatch, 2)
    monkeypatch.setenv("FAKE_STEPS", "1")
    assert attempts.loop(CMD, run, spare=0, min_nodes=0, backoff=0) == 0
    (step,) = calls()
    assert step["argv"] == CMD[1:]  # the whole allocation: the command as given
    assert scontrol().splitlines() == ["requeue 7", "update jobid=7 ExcNodeList=node2"]
    ledger = load_ledger(run, "7")
    assert ledger["attempts"]["0"]["requeued"] == "failure" and ledger["excluded"] == ["node2"]


def test_min_nodes_continues_on_fewer_nodes(fake_slurm, monkeypatch: pytest.MonkeyPatch) -> None:
    run, calls, scontrol = fake_slurm
    allocation(monkeypatch, 2)
    monkeypatch.setenv("FAKE_STEPS", "1,0")
    assert attempts.loop(CMD, run, spare=0, min_nodes=1, backoff=0) == 0
    assert [c["argv"][:3] for c in calls()][1] == ["--nodes=1", "--ntasks=1", "--nodelist=node1"]
    assert scontrol() == ""


def test_without_the_gate_command_every_node_counts_as_healthy(fake_slurm, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_NO_GATE", "1")
    assert attempts.run_gate(["node1", "node2"]) == {
        "node1": (True, [attempts.GATE_UNAVAILABLE]),
        "node2": (True, [attempts.GATE_UNAVAILABLE]),
    }
    monkeypatch.delenv("FAKE_NO_GATE")
    monkeypatch.setenv("FAKE_BAD", "node2")
    monkeypatch.setenv("FAKE_SILENT", "node9")
    got = attempts.run_gate(["node1", "node2", "node9"])  # node9 never answers: unhealthy
    assert got["node1"] == (True, []) and got["node2"][0] is False and got["node9"][0] is False


def test_recovery_is_split_from_the_failure_to_the_first_step() -> None:
    ledger = {
        "attempts": {
            "0": {"failed_at": 100.0, "step_end": 103.0, "decided": 103.5, "restarted": "in-job"},
            "1": {"path": "in-job", "gate_start": 104.5, "gate_s": 0.5, "launched": 105.0},
        }
    }
    entry = {"restart": 1, "start": 105.5, "restore_s": 1.0, "loop_start": 110.0, "first_step_at": 111.0}
    assert recovery(entry, ledger) == {
        "detection": 3.0,
        "wait": 1.0,
        "gate": 0.5,
        "step_start": 0.5,
        "checkpoint_load": 1.0,
        "init": 3.5,
        "first_step": 1.0,
        "total": 11.0,
        "path": "in-job",
    }
    assert recovery({**entry, "restart": 0}, ledger) is None


def test_recovery_after_a_requeue_by_someone_else_counts_from_its_stop_signal() -> None:
    """Found by tools/chaos: after `scontrol requeue` the next attempt had no recovery (the stopped attempt has no
    failure record and no time-limit end); the attempt loop stamps when the stop signal came."""
    ledger = {
        "attempts": {
            "0": {"stopped_at": 100.0, "step_end": 102.0},
            "1": {"path": "requeue", "gate_start": 134.0, "gate_s": 0.5, "launched": 134.5},
        }
    }
    entry = {"restart": 1, "start": 135.0, "restore_s": 0.5, "loop_start": 138.0, "first_step_at": 139.0}
    rec = recovery(entry, ledger)
    assert rec is not None and rec["total"] == 39.0 and rec["detection"] == 2.0 and rec["wait"] == 32.0
    assert rec["path"] == "requeue"
    del ledger["attempts"]["0"]["stopped_at"]  # no signal seen (the loop was killed): from the step's end
    assert recovery(entry, ledger)["total"] == 37.0


@pytest.mark.parametrize(
    ("extra", "nodes", "fragment"),
    [
        (["fault.min_nodes=5"], 4, "fault.min_nodes=5: more than the job's 4 training node(s)"),
        # dp 3 does not divide the global batch of 8: the layout cannot shrink to 3 nodes
        (["fault.min_nodes=3"], 4, "fault.min_nodes=3: the layout cannot shrink to 3 node(s) (3 ranks)"),
    ],
)
def test_a_min_nodes_the_layout_cannot_shrink_to_is_refused(extra: list[str], nodes: int, fragment: str) -> None:
    cfg = config_mod.load(
        "configs/demo.yaml", [*SMALL, "train.global_batch_size=8", "train.micro_batch_size=1", *extra]
    )
    (problem,) = config_mod.shrink_problems(cfg, nodes, 1)
    assert fragment in problem
    ok = config_mod.load("configs/demo.yaml", [*SMALL, "train.global_batch_size=8", "fault.min_nodes=2"])
    assert config_mod.shrink_problems(ok, nodes, 1) == []
    assert "4 training + 0 spare" in (config_mod.describe_spares(ok, nodes) or "")


def test_fault_keys_are_validated() -> None:
    with pytest.raises(config_mod.ConfigError, match=r"fault\.restart_backoff_s: must be a number of seconds >= 0"):
        config_mod.load("configs/demo.yaml", ["fault.restart_backoff_s=-1"])
    with pytest.raises(config_mod.ConfigError, match=r"fault\.spare_nodes: must be >= 0"):
        config_mod.load("configs/demo.yaml", ["fault.spare_nodes=-1"])


def test_a_requeue_signal_between_steps_reaches_the_next_step(tmp_path: Path) -> None:
    """USR2 (the time-limit warning) that arrives during the gate or the backoff is not lost: the next srun gets it."""
    import signal

    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)}
    try:
        step = attempts._Step()
        step.RELAY_AFTER_S = 0.3
        os.kill(os.getpid(), signal.SIGUSR2)  # no step running: remembered
        assert step.pending == [signal.SIGUSR2] and not step.stopping
        got = tmp_path / "got"
        script = f"trap 'echo USR2 > {got}; exit 0' USR2; for i in $(seq 100); do sleep 0.1; done; exit 9"
        assert step.run(["sh", "-c", script], dict(os.environ)) == 0
        assert got.read_text().strip() == "USR2" and step.pending == []
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def test_the_report_shows_each_attempts_path_nodes_and_recovery(tmp_path: Path) -> None:
    from hpcdist.report import page
    from hpcdist.report.rundata import RunData

    ledger = {
        "job_id": "7",
        "attempts": {
            "0": {"path": "first", "ended": "failure", "restarted": "in-job", "nodes": ["node1", "node2"]},
            "1": {"path": "in-job", "nodes": ["node1", "node3"]},
        },
        "gate_failed": {"node4": ["gpus: 3 of 4 visible"]},
    }
    (tmp_path / "restarts.json").write_text(json.dumps(ledger))
    rec = {"path": "in-job", "total": 17.1, "detection": 3.2, "gate": 0.3, "init": 12.5}
    attempts_ = [{"start": 1.0, "end": 2.0}, {"start": 3.0, "last": 4.0, "recovery": rec}]
    (tmp_path / "goodput.json").write_text(json.dumps({"attempts": attempts_}))
    data = RunData.load(tmp_path)
    html = page._attempts(data) + page._restarts(data)
    assert "<td>attempt 2</td><td>in-job</td><td>17.1</td><td>3.2</td>" in html
    assert "<td>in-job</td><td></td><td></td><td>node1,node3</td>" in html and "node4: gpus: 3 of 4 visible" in html


def test_the_failure_budget_stops_in_job_restarts_too(fake_slurm, monkeypatch: pytest.MonkeyPatch) -> None:
    """fault.max_failures counts in-job restarts: with 1, the second failure ends the job with the reason."""
    from hpcdist.launch.restarts import RestartPolicy

    run, calls, scontrol = fake_slurm
    allocation(monkeypatch, 4)
    monkeypatch.setenv("FAKE_STEPS", "1,1,0")
    policy = RestartPolicy(True, 10, -1, 1, 3, True, 2, None)
    assert attempts.loop(CMD, run, spare=2, min_nodes=0, backoff=0, policy=policy) == 1
    assert len(calls()) == 2 and scontrol() == ""
    ledger = load_ledger(run, "7")
    assert "1 restart(s) after a failure already (fault.max_failures=1)" in ledger["stopped"]["reason"]


def test_a_garbled_ledger_is_not_trusted_for_host_names(tmp_path: Path) -> None:
    ledger = {"job_id": "7", "attempts": {"0": {"path": "first"}, "x": 1}, "excluded": "node1", "gate_failed": [1]}
    (tmp_path / "restarts.json").write_text(json.dumps(ledger))
    data = load_ledger(tmp_path, "7")
    assert data["excluded"] == [] and data["gate_failed"] == {} and list(data["attempts"]) == ["0"]
    (tmp_path / "restarts.json").write_text(json.dumps({"job_id": "7", "attempts": []}))
    assert load_ledger(tmp_path, "7")["attempts"] == {}


def test_the_attempt_loop_does_not_import_torch() -> None:
    """The batch script starts `python -m hpcdist.launch.attempts` once per job and per requeue, before any rank:
    it decides nodes and restarts, never computes. Importing torch there (through fault.stop's StopReason) cost 2 s
    of CPU on an idle machine, 10+ s under load, on every job of the SLURM tier."""
    code = "import sys, hpcdist.launch.attempts; print('TORCH', 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert "TORCH False" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize(
    "slurm_env, expected",
    [
        ({"SLURM_GPUS_PER_NODE": "8", "SLURM_GPUS_ON_NODE": "8"}, "8"),  # sbatch --gpus-per-node=8
        ({"SLURM_GPUS_PER_NODE": "a100:4"}, "4"),  # a typed request
        ({"SLURM_GPUS_ON_NODE": "2"}, "2"),  # --gres=gpu:2
        ({"SLURM_JOB_GPUS": "0,1,2"}, "3"),  # only the allocated GPUs' indices
        ({}, None),  # no GPU asked of the scheduler (a CPU partition, the SLURM sandbox): nothing to count
    ],
)
def test_the_gate_is_given_the_gpus_the_job_asked_the_scheduler_for(
    fake_slurm, monkeypatch: pytest.MonkeyPatch, slurm_env: dict[str, str], expected: str | None
) -> None:
    """A node showing 7 of its 8 GPUs must fail the gate: the loop passes the job's GPUs per node, which only the
    scheduler knows; and the device checks get their own, longer bound than the fast checks (--device-timeout)."""
    run, calls, _ = fake_slurm
    for name, value in slurm_env.items():
        monkeypatch.setenv(name, value)
    assert attempts.loop(CMD, run, spare=0, min_nodes=0, backoff=0) == 0
    (gate,) = calls(health=True)
    argv = gate["argv"]
    if expected is None:
        assert "--gpus" not in argv, argv
    else:
        assert argv[argv.index("--gpus") + 1] == expected, argv
    fast = float(argv[argv.index("--timeout") + 1])
    device = float(argv[argv.index("--device-timeout") + 1])
    assert device > fast, argv
