"""A rank killed mid-run, seen from its peer: `hpcdist train` on 2 real gloo ranks (each its own process, as srun
starts them), rank 1 SIGKILLed after a few steps. The survivor ends in one clear line, "a peer rank died", with
the exit status the attempt loop restarts on (1), never "unexpected error ... please report it"; its failure
record is a ``collective`` one, blamed on nobody."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcdist import config as config_mod
from hpcdist.fault.failures import read_failures
from hpcdist.rundir import RunDir
from tests.dist.harness import free_port

pytestmark = pytest.mark.dist


def _rank(rank: int, port: int, config_file: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "hpcdist.cli", "train", str(config_file)]
    return subprocess.Popen(cmd, cwd=root, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)


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
    procs = [_rank(r, port, config_file, logs[r]) for r in (0, 1)]
    try:
        deadline = time.monotonic() + 120
        while _trained_steps(Path(cfg.run.dir)) < 3:
            assert all(p.poll() is None for p in procs), logs[0].read_text()[-3000:]
            assert time.monotonic() < deadline, "no step 3 within 120 s"
            time.sleep(0.1)
        procs[1].send_signal(signal.SIGKILL)
        rc = procs[0].wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = logs[0].read_text()
    last = [line for line in out.splitlines() if line.startswith("hpcdist: ")]
    assert "unexpected error" not in out and "please report it" not in out, out[-3000:]
    assert last and last[-1].startswith("hpcdist: a peer rank died or stopped answering after step "), out[-3000:]
    assert "a restart resumes from the last checkpoint" in last[-1]
    assert rc == 1
    records = read_failures(cfg.run.dir)
    assert [r["kind"] for r in records] == ["collective"] and records[0]["blame"] == [], records
