"""SIGSTOP one of two real gloo ranks mid-training: the other rank's hang watchdog fires, names the frozen rank and
its host, dumps its Python stacks to its log and exits 124 (which srun turns into the end of the step)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from hpcdist.config import JobConfig
from hpcdist.env import destroy_process_group, from_environ, init_process_group
from hpcdist.fault.failures import read_failures
from hpcdist.fault.hang import WATCHDOG_EXIT_CODE, collective_timeout_s, read_heartbeats
from hpcdist.run import train
from tests.dist.harness import free_port, rank_environ

pytestmark = pytest.mark.dist


def _rank(rank: int, world: int, port: int, cfg: JobConfig, log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)  # this rank's log: where the watchdog writes its report and the stacks
    sys.stderr = os.fdopen(2, "w", buffering=1)  # (pytest replaced sys.stderr in the parent we forked from)
    rank_environ(rank, world, port)
    env = from_environ(cuda_available=False)
    init_process_group(env, timeout_s=collective_timeout_s(cfg.fault.watchdog_timeout_s))
    try:
        train(cfg, env)
    finally:
        destroy_process_group()


def test_sigstop_one_rank_the_other_ranks_watchdog_fires(small_cfg, tmp_path: Path) -> None:
    run_dir = tmp_path / "hang"
    cfg = small_cfg(
        "train.steps=100000",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "fault.watchdog_timeout_s=5",
        "logging.straggler_every_steps=0",
        run_dir=run_dir,
    )
    ctx, port = mp.get_context("fork"), free_port()
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    procs = [ctx.Process(target=_rank, args=(r, 2, port, cfg, str(logs[r])), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 120
        while read_heartbeats(run_dir, 2).get(1, {}).get("step", 0) < 3:  # both ranks are training
            assert time.monotonic() < deadline and all(p.is_alive() for p in procs), logs[0].read_text()[-3000:]
            time.sleep(0.1)
        frozen = read_heartbeats(run_dir, 2)[1]
        assert frozen["pid"] == procs[1].pid
        os.kill(frozen["pid"], signal.SIGSTOP)
        procs[0].join(120)
        assert procs[0].exitcode == WATCHDOG_EXIT_CODE, logs[0].read_text()[-3000:]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()  # SIGKILL also ends a stopped process
            p.join(10)

    log0 = logs[0].read_text()
    assert "[hpcdist watchdog] rank 0" in log0 and "s, fault.watchdog_timeout_s=5) at step" in log0
    assert f"suspects: rank 1 on {frozen['host']}: no heartbeat for" in log0
    assert "Python stacks of rank 0 (all threads)" in log0 and "most recent call first" in log0
    assert 'File "' in log0 and "trainer.py" in log0  # the main thread's stack, inside the training loop
    (rec,) = [r for r in read_failures(run_dir) if r["kind"] == "watchdog"]
    assert rec["rank"] == 0 and rec["blame"] == [{"rank": 1, "host": frozen["host"]}]
    assert rec["cause"].startswith("no progress in ")
    assert (run_dir / "goodput.json").is_file()  # rank 0 flushed its accounting before exiting
