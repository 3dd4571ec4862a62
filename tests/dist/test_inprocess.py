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

import pytest

from hpcdist import config as config_mod
from hpcdist.base.rundir import RunDir
from hpcdist.fault.inprocess import SPARE_ENV, STORE_ENV, WORLD_ENV
from tests.conftest import small_config
from tests.dist.harness import free_port, rank_environ

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


def _cli(host: str, rank: int, store: str, spare: bool, config_file: Path, log: Path) -> None:
    """``hpcdist train CONFIG`` as rank ``rank`` of 2 on ``host`` (forked: torch is imported already)."""
    _own_host_name(host)
    rank_environ(rank, 2, free_port())  # the store replaces MASTER_ADDR/PORT's rendezvous
    os.environ[STORE_ENV] = store
    if spare:  # as a launcher starts a spare: its own rank and size are the spares', the training's size beside
        os.environ.update({SPARE_ENV: "1", WORLD_ENV: "2", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
    out = open(log, "w", buffering=1)  # noqa: SIM115  # the process's stdout and stderr until it exits
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    sys.stdout = sys.stderr = out
    from hpcdist.cli import main

    code = 1
    try:
        code = main(["train", str(config_file)])
    finally:
        out.flush()
        os._exit(code)


def _records(run_dir: Path) -> list[dict[str, Any]]:
    path = RunDir(run_dir).metrics
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def _run(cfg: config_mod.JobConfig, tmp: Path, *, kill: bool) -> dict[str, Any]:
    """Start the store, ranks 0 and 1 and the spare; with ``kill``, SIGKILL rank 1 after step KILL_AFTER."""
    tmp.mkdir(parents=True, exist_ok=True)
    config_file = config_mod.save(cfg, tmp / "config.yaml")
    server = subprocess.Popen(
        [sys.executable, "-m", "hpcdist.fault.regroup"], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    procs: dict[str, Any] = {}
    logs = {name: tmp / f"{name}.log" for name in ("rank0", "rank1", "spare")}
    try:
        assert server.stdout is not None
        store = f"127.0.0.1:{int(server.stdout.readline())}"
        ctx = mp.get_context("fork")
        for name, host, rank, spare in (("rank0", "nodeA", 0, False), ("rank1", "nodeB", 1, False)):
            procs[name] = ctx.Process(target=_cli, args=(host, rank, store, spare, config_file, logs[name]))
        procs["spare"] = ctx.Process(target=_cli, args=("nodeC", 0, store, True, config_file, logs["spare"]))
        for p in procs.values():
            p.start()
        pid0, killed_at = procs["rank0"].pid, None
        deadline = time.monotonic() + 240
        while kill and killed_at is None:
            if any(r["step"] >= KILL_AFTER for r in _records(Path(cfg.run.dir))):
                os.kill(procs["rank1"].pid, signal.SIGKILL)
                killed_at = time.time()
            assert procs["rank0"].is_alive(), logs["rank0"].read_text()[-3000:]
            assert time.monotonic() < deadline, f"no step {KILL_AFTER} within 240 s"
            time.sleep(0.02)
        for p in procs.values():
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        codes = {name: p.exitcode for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join()
        server.terminate()
        server.wait(30)
    texts = {name: path.read_text() for name, path in logs.items()}
    return {"codes": codes, "logs": texts, "pid0": pid0, "killed_at": killed_at, "records": _records(Path(cfg.run.dir))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, corpus_dir: Path) -> dict[str, dict[str, Any]]:
    reason = _can_name_hosts()
    if reason:
        pytest.skip(reason)
    out = {}
    for name, kill in (("straight", False), ("killed", True)):
        tmp = tmp_path_factory.mktemp(name)
        cfg = small_config(
            tmp / "run",
            corpus_dir,
            f"train.steps={STEPS}",
            "checkpoint.every_steps=4",  # a shared checkpoint older than the snapshots: it must not be read
            f"checkpoint.local.dir={tmp}/local-{{host}}",
            "checkpoint.local.every_steps=1",
            "fault.regroup_settle_s=1.5",
        )
        out[name] = _run(cfg, tmp, kill=kill)
    return out


def _losses(records: list[dict[str, Any]]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if "loss" in r}  # the last record of a step wins: the redone one


def test_without_a_failure_the_spare_leaves_when_the_job_is_done(runs: dict[str, dict[str, Any]]) -> None:
    straight = runs["straight"]
    assert straight["codes"] == {"rank0": 0, "rank1": 0, "spare": 0}, straight["logs"]["spare"][-2000:]
    assert "the job finished without needing this spare" in straight["logs"]["spare"]
    assert sorted(_losses(straight["records"])) == list(range(1, STEPS + 1))


def test_a_killed_rank_is_replaced_by_the_spare_and_the_survivor_keeps_its_process(
    runs: dict[str, dict[str, Any]],
) -> None:
    killed, straight = runs["killed"], runs["straight"]
    log0, spare = killed["logs"]["rank0"], killed["logs"]["spare"]
    assert killed["codes"]["rank0"] == 0 and killed["codes"]["spare"] == 0, (log0[-3000:], spare[-3000:])
    assert killed["codes"]["rank1"] == -signal.SIGKILL
    # the survivor: the same process before and after (the log of one pid shows both generations)
    assert "in-process recovery 1: generation 1 of 2 ranks formed" in log0, log0[-3000:]
    assert f"pid {killed['pid0']} stays" in log0
    assert "warm spare on nodeC: took rank 1 (generation 1)" in spare, spare[-3000:]
    # rank 1's state came from the peer copy on nodeA, not from the shared checkpoint
    assert "files of step" in log0 and "come from rank 0's node" in log0, log0[-3000:]
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
    # every step's loss is the uninterrupted run's, bit for bit
    assert _losses(killed["records"]) == _losses(straight["records"])
    print(
        f"\nin-process recovery: kill -> next completed step {first_after['time'] - killed['killed_at']:.2f} s, "
        f"steps redone {redone}"
    )
