"""In-process recovery through `hpcdist train` itself: two ranks on hosts nodeA and nodeB and one warm spare on
nodeC (each forked process in a UTS namespace of its own, so each has its own host name and node-local directory),
a rendezvous store started as the product starts it (``python -m hpcdist.fault.regroup``). Rank 1 is SIGKILLed
mid-run: rank 0 keeps its pid, the spare becomes rank 1 with rank 1's files from the peer copy on nodeA, the run
resumes from the node-local snapshot (not the shared checkpoint), at most one completed step is computed again,
and every step's loss equals the run's without the kill."""

from __future__ import annotations

import ctypes
import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hpcdist import config as config_mod
from hpcdist.base.rundir import RunDir
from hpcdist.fault import supervise
from hpcdist.fault.goodput import read_goodput
from hpcdist.fault.inprocess import SPARE_ENV, STORE_ENV, WORLD_ENV
from tests.conftest import small_config
from tests.dist.harness import free_port, rank_environ, train_cli_and_exit

pytestmark = pytest.mark.dist

_CLONE_NEWUTS = 0x04000000
STEPS = 10
KILL_AFTER = 5  # rank 1 dies once rank 0 logged this step (one step later or two: the kill is asynchronous)


def _own_host_name(name: str) -> None:
    """This forked process gets a host name of its own (a UTS namespace): what a rank on another node sees."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWUTS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUTS)")
    socket.sethostname(name)


def _can_name_hosts() -> str | None:
    ctx = mp.get_context("fork")
    p = ctx.Process(target=_own_host_name, args=("probe",))
    p.start()
    p.join(30)
    return None if p.exitcode == 0 else "a UTS namespace needs root (CAP_SYS_ADMIN): no per-rank host names here"


def _cli(
    hosts: list[str], index: int, world: int, store: str, spare: bool, config_file: Path, log: Path, supervised: bool
) -> None:
    """``hpcdist train CONFIG`` as process ``index`` of ``hosts`` (a training rank, or a spare among the spares),
    on host ``hosts[index]``, with the local rank and node number a launcher gives it (forked: torch is imported
    already)."""
    host = hosts[index]
    _own_host_name(host)
    rank_environ(index, len(hosts), free_port())  # the store replaces MASTER_ADDR/PORT's rendezvous
    nodes = list(dict.fromkeys(hosts))
    os.environ.update(
        LOCAL_RANK=str(hosts[:index].count(host)),
        LOCAL_WORLD_SIZE=str(hosts.count(host)),
        GROUP_RANK=str(nodes.index(host)),
        GROUP_WORLD_SIZE=str(len(nodes)),
    )
    os.environ[STORE_ENV] = store
    if spare:  # as a launcher starts the spares: their own step's ranks, the training's size beside
        os.environ.update({SPARE_ENV: "1", WORLD_ENV: str(world)})
    if not supervised:
        train_cli_and_exit(config_file, log)
    # as a launcher runs a rank: a fresh interpreter under hpcdist.fault.supervise, which outlives it
    out = open(log, "w", buffering=1)  # noqa: SIM115  # the process's stdout and stderr until it exits
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    os._exit(supervise.supervise([sys.executable, "-m", "hpcdist", "train", str(config_file)]))


def _heartbeat_pid(run_dir: Path, rank: int) -> int:
    return int(json.loads((RunDir(run_dir).heartbeats / f"rank-{rank:05d}.json").read_text())["pid"])


def _records(run_dir: Path) -> list[dict[str, Any]]:
    path = RunDir(run_dir).metrics
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def _run(
    cfg: config_mod.JobConfig,
    tmp: Path,
    ranks: list[str],
    spares: list[str],
    kill: list[int],
    *,
    stop: bool = False,
    first: str | None = None,
    store_too: bool = False,
    attempt: int = 0,
) -> dict[str, Any]:
    """Start the store, rank r on host ``ranks[r]`` and a spare on each host of ``spares``; SIGKILL the process
    named ``first`` (a spare) at once, and the ranks in ``kill`` (with the store: ``store_too``) once rank 0 logged
    step KILL_AFTER; with ``stop``, those ranks run under their supervisor and are frozen (SIGSTOP) instead.
    ``attempt`` numbers the logs of a run started again on the same directories."""
    tmp.mkdir(parents=True, exist_ok=True)
    config_file = config_mod.save(cfg, tmp / "config.yaml")
    server = subprocess.Popen(
        [sys.executable, "-m", "hpcdist.fault.regroup"], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    procs: dict[str, Any] = {}
    names = [f"rank{r}" for r in range(len(ranks))] + [f"spare{i}" for i in range(len(spares))]
    logs = {name: tmp / f"{name}-{attempt}.log" for name in names}
    try:
        assert server.stdout is not None
        store = f"127.0.0.1:{int(server.stdout.readline())}"
        ctx = mp.get_context("fork")
        world = len(ranks)
        for r in range(world):
            args = (ranks, r, world, store, False, config_file, logs[f"rank{r}"], stop and r in kill)
            procs[f"rank{r}"] = ctx.Process(target=_cli, args=args)
        for i in range(len(spares)):
            procs[f"spare{i}"] = ctx.Process(
                target=_cli, args=(spares, i, world, store, True, config_file, logs[f"spare{i}"], False)
            )
        for p in procs.values():
            p.start()
        if first is not None:
            os.kill(procs[first].pid, signal.SIGKILL)
        pid0, killed_at = procs["rank0"].pid, None
        deadline = time.monotonic() + 240
        while kill and killed_at is None:
            for name in procs:  # a rank that ended before the kill: its log says why, at once
                if name.startswith("rank") and not procs[name].is_alive():
                    pytest.fail(f"{name} ended before the kill:\n{logs[name].read_text()[-3000:]}")
            if any(r["step"] >= KILL_AFTER for r in _records(Path(cfg.run.dir))):
                for r in kill:  # a supervised rank's own pid is in its heartbeat
                    pid = _heartbeat_pid(Path(cfg.run.dir), r) if stop else procs[f"rank{r}"].pid
                    os.kill(pid, signal.SIGSTOP if stop else signal.SIGKILL)
                if store_too:
                    server.kill()
                killed_at = time.time()
            assert time.monotonic() < deadline, f"no step {KILL_AFTER} within 240 s"
            time.sleep(0.02)
        for p in procs.values():
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        codes = {name: p.exitcode for name, p in procs.items()}
        ended_at = time.time()
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join()
        server.terminate()
        server.wait(30)
    texts = {name: path.read_text() if path.exists() else "" for name, path in logs.items()}  # killed before it wrote
    records = _records(Path(cfg.run.dir))
    return {
        "codes": codes,
        "logs": texts,
        "pid0": pid0,
        "killed_at": killed_at,
        "ended_at": ended_at,
        "records": records,
        "failures": RunDir(cfg.run.dir).failures,
        "goodput": read_goodput(cfg.run.dir),
    }


# rank r on host ranks[r], the spares' hosts, the ranks killed (frozen with SIGSTOP: "stop"), how far (float32 ulps)
# a logged loss may be from the uninterrupted run's. Four ranks: a rank whose trainer was rebuilt logs, at some
# steps, a loss one ulp off the uninterrupted run's while every gradient norm stays bitwise the same (the state
# trains identically; only the logged value's last bit moves). Two ranks: bitwise.
SCENARIOS = {
    "one-rank": (["nodeA", "nodeB"], ["nodeC"], [1], 0, False),
    "one-host": (["nodeA", "nodeA", "nodeB", "nodeB"], ["nodeC", "nodeC"], [2, 3], 1, False),
    # its supervisor kills it after 3 missed heartbeats (2 s each at a 10 s watchdog timeout)
    "frozen-rank": (["nodeA", "nodeB"], ["nodeC"], [1], 0, True),
}
FROZEN = ("fault.watchdog_timeout_s=10",)


def _config(tmp: Path, corpus_dir: Path, *overrides: str) -> config_mod.JobConfig:
    return small_config(
        tmp / "run",
        corpus_dir,
        f"train.steps={STEPS}",
        "checkpoint.every_steps=4",  # a shared checkpoint as new as a snapshot: the snapshot is taken
        f"checkpoint.local.dir={tmp}/local-{{host}}",
        "checkpoint.local.every_steps=1",
        "fault.regroup_settle_s=1.5",
        *overrides,
    )


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, corpus_dir: Path) -> Any:
    """The uninterrupted run of a layout (ranks' hosts, spares' hosts), run once per module: the spares leave unused."""
    reason = _can_name_hosts()
    if reason:
        pytest.skip(reason)
    done: dict[tuple[tuple[str, ...], tuple[str, ...]], dict[str, Any]] = {}

    def run(ranks: list[str], spares: list[str]) -> dict[str, Any]:
        key = (tuple(ranks), tuple(spares))
        if key not in done:
            tmp = tmp_path_factory.mktemp("straight")
            done[key] = _run(_config(tmp, corpus_dir), tmp, ranks, spares, [])
        return done[key]

    return run


@pytest.fixture(scope="module", params=sorted(SCENARIOS))
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, corpus_dir: Path, straight: Any
) -> dict[str, Any]:
    """The scenario's run with its kill, and the same layout's run without one."""
    ranks, spares, kill, ulps, stop = SCENARIOS[request.param]
    out: dict[str, Any] = {
        "ranks": ranks,
        "spares": spares,
        "kill": kill,
        "ulps": ulps,
        "straight": straight(ranks, spares),
    }
    tmp = tmp_path_factory.mktemp(f"{request.param}-killed")
    overrides = FROZEN if stop else ()
    out["killed"] = _run(_config(tmp, corpus_dir, *overrides), tmp, ranks, spares, kill, stop=stop)
    out["stop"] = stop
    return out


def _losses(records: list[dict[str, Any]], field: str = "loss") -> dict[int, float]:
    return {r["step"]: r[field] for r in records if "loss" in r}  # the last record of a step wins: the redone one


def _ulps(a: float, b: float) -> int:
    """How many float32 values lie between a and b (0: the same float32)."""
    ia, ib = (int(np.array(x, dtype=np.float32).view(np.int32)) for x in (a, b))
    return abs(ia - ib)


def test_without_a_failure_the_spares_leave_when_the_job_is_done(runs: dict[str, Any]) -> None:
    straight = runs["straight"]
    assert set(straight["codes"].values()) == {0}, straight["codes"]
    for i in range(len(runs["spares"])):
        assert "the job finished without needing this spare" in straight["logs"][f"spare{i}"]
    assert sorted(_losses(straight["records"])) == list(range(1, STEPS + 1))


def test_killed_ranks_are_replaced_by_the_spares_and_the_survivors_keep_their_processes(
    runs: dict[str, Any],
) -> None:
    killed, straight = runs["killed"], runs["straight"]
    world, kill = len(runs["ranks"]), runs["kill"]
    survivors = [r for r in range(world) if r not in kill]
    spares = [f"spare{i}" for i in range(len(runs["spares"]))]
    log0 = killed["logs"]["rank0"]
    for r in range(world):
        expected = -signal.SIGKILL if r in kill else 0
        assert killed["codes"][f"rank{r}"] == expected, killed["logs"][f"rank{r}"][-3000:]
    assert all(killed["codes"][name] == 0 for name in spares), [killed["logs"][n][-2000:] for n in spares]
    # the survivors: the same processes before and after (the log of one pid shows both generations)
    assert f"in-process recovery 1: generation 1 of {world} ranks formed" in log0, log0[-3000:]
    assert f"pid {killed['pid0']} stays" in log0
    for r in survivors:
        assert "in-process recovery 1:" in killed["logs"][f"rank{r}"]
    if runs["stop"]:  # a frozen rank: its supervisor killed it for its missing heartbeats, and said so
        lines = killed["failures"].read_text().splitlines()
        frozen = [json.loads(line) for line in lines if '"watchdog: frozen"' in line]
        assert sorted(rec["rank"] for rec in frozen) == kill, lines
    took = sorted(
        int(line.split("took rank ")[1].split()[0])
        for name in spares
        for line in killed["logs"][name].splitlines()
        if "warm spare on nodeC: took rank" in line
    )
    assert took == kill, [killed["logs"][n][-2000:] for n in spares]
    # the dead ranks' state came from the peer copies on nodeA, not from the shared checkpoint
    for r in kill:
        assert f"rank {r}'s files of step" in log0, log0[-3000:]
    resumes = [line for line in log0.splitlines() if "resumed from " in line]
    assert resumes and all("/local-nodeA/" in line for line in resumes), resumes
    # at most one completed step computed again: the log's steps go back once, by at most one
    steps = [r["step"] for r in killed["records"] if "loss" in r]
    back = [i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]]
    assert len(back) <= 1, steps
    redone = steps[back[0] - 1] - steps[back[0]] + 1 if back else 0
    assert redone <= 1, steps
    logged = [r for r in killed["records"] if "loss" in r]
    first_after = logged[back[0]] if back else next(r for r in logged if r["time"] >= killed["killed_at"])
    # every step trains as in the uninterrupted run, bit for bit (its gradient norm), and logs its loss
    assert _losses(killed["records"], "grad_norm") == _losses(straight["records"], "grad_norm")
    losses, expected = _losses(killed["records"]), _losses(straight["records"])
    assert sorted(losses) == sorted(expected)
    off = {step: (losses[step], expected[step]) for step in expected if _ulps(losses[step], expected[step])}
    assert all(_ulps(a, b) <= runs["ulps"] for a, b in off.values()), off
    # rank 0's goodput: the second generation is an attempt of its own, from the death it saw to its first step
    first, second = killed["goodput"]
    assert "generation" not in first and second["generation"] == 1, killed["goodput"]
    assert first["end"] == second["start"] >= killed["killed_at"], killed["goodput"]
    assert second["recovery"]["path"] == "in-process" and second["first_step"] == first_after["step"] - 1
    print(
        f"\nin-process recovery of ranks {kill} of {world} ({'SIGSTOP' if runs['stop'] else 'SIGKILL'}): "
        "signal -> next completed step "
        f"{first_after['time'] - killed['killed_at']:.2f} s, steps redone {redone}"
    )


# what in-process recovery cannot serve: the spare died before the failure (no rank takes the dead one's place), or
# the store went with the rank (the batch node, which also holds rank 0 under SLURM: nowhere to regroup)
FALLBACKS = {"spare-lost": {"first": "spare0"}, "store-lost": {"store_too": True}}


@pytest.mark.parametrize("case", sorted(FALLBACKS))
def test_what_in_process_recovery_cannot_serve_ends_the_attempt_and_a_restart_loses_nothing(
    case: str, tmp_path: Path, corpus_dir: Path, straight: Any
) -> None:
    ranks, spares = ["nodeA", "nodeB"], ["nodeC"]
    cfg = _config(tmp_path, corpus_dir, "fault.regroup_timeout_s=4")
    failed = _run(cfg, tmp_path, ranks, spares, [1], **FALLBACKS[case])
    log0 = failed["logs"]["rank0"]
    # the survivor tried, gave up within the bound, and ended its attempt for the in-job restart to take over
    assert "in-process recovery 1:" in log0 and "in-process recovery failed" in log0, log0[-3000:]
    assert "the in-job restart or the requeue takes over" in log0
    assert failed["codes"]["rank0"] not in (0, None), failed["codes"]
    assert None not in failed["codes"].values(), failed["codes"]  # nobody left hanging, the spare included
    assert failed["ended_at"] - failed["killed_at"] < 60
    print(f"\n{case}: kill -> every process of the attempt ended {failed['ended_at'] - failed['killed_at']:.1f} s")
    # the in-job restart: the dead rank on the spare's host, its files from the peer copy on nodeA
    again = _run(cfg, tmp_path, ["nodeA", "nodeC"], [], [], attempt=1)
    assert set(again["codes"].values()) == {0}, again["logs"]["rank0"][-3000:]
    assert "rank 1's files of step" in again["logs"]["rank0"]
    losses = _losses(again["records"])  # both attempts' records: the redone steps' last ones
    assert losses == _losses(straight(ranks, spares)["records"])
