"""A rank killed mid-run, seen from its peer: `hpcdist train` (the CLI's main) on 2 real gloo ranks, each its own
process, rank 1 SIGKILLed after a few steps. The survivor ends in one clear line, "a peer rank died", with
the exit status the attempt loop restarts on (1), never "unexpected error ... please report it"; its failure
record is a ``collective`` one, blamed on nobody."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest

from hpcdist import config as config_mod
from hpcdist.base.rundir import RunDir
from hpcdist.fault.failures import read_failures
from tests.dist.harness import free_port, rank_environ, train_cli_and_exit

pytestmark = pytest.mark.dist


def _cli_rank(rank: int, port: int, config_file: Path, log: Path) -> None:
    """A forked process that runs ``hpcdist train CONFIG`` as rank ``rank`` of 2 (the CLI's own main, its output in
    ``log``; forked, so it skips the interpreter's start and torch's import), and exits with its status."""
    rank_environ(rank, 2, port)
    train_cli_and_exit(config_file, log)


def _trained_steps(run_dir: Path) -> int:
    path = RunDir(run_dir).metrics
    if not path.is_file():
        return 0
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line.strip()]
    return max(steps, default=0)


def test_a_killed_peer_is_a_restartable_peer_death_not_an_unexpected_error(small_cfg, tmp_path: Path) -> None:
    cfg = small_cfg("train.steps=100000", "checkpoint.every_steps=0", "checkpoint.save_final=false")
    config_file = config_mod.save(cfg, tmp_path / "config.yaml")
    port = free_port()
    logs = [tmp_path / "rank0.log", tmp_path / "rank1.log"]
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_cli_rank, args=(r, port, config_file, logs[r]), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 120
        while _trained_steps(Path(cfg.run.dir)) < 3:
            assert all(p.is_alive() for p in procs), logs[0].read_text()[-3000:]
            assert time.monotonic() < deadline, "no step 3 within 120 s"
            time.sleep(0.05)
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[0].join(timeout=120)
        rc = procs[0].exitcode
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    out = logs[0].read_text()
    last = [line for line in out.splitlines() if line.startswith("hpcdist: ")]
    assert "unexpected error" not in out and "please report it" not in out, out[-3000:]
    assert last and last[-1].startswith("hpcdist: a peer rank died or stopped answering after step "), out[-3000:]
    assert "a restart resumes from the last checkpoint" in last[-1]
    assert rc == 1
    records = read_failures(cfg.run.dir)
    assert [r["kind"] for r in records] == ["collective"] and records[0]["blame"] == [], records
