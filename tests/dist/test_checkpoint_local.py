"""The node-local checkpoint tier (checkpoint.local, issue 28.3) on 2 real ranks, each its own "node" (its
DistEnv's host name): a lost node's files come back from its peer's copy, and with both copies gone the shared
checkpoint resumes, every loss equal to an uninterrupted run's."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from hpcdist.checkpoint import MARKER
from hpcdist.config import JobConfig
from hpcdist.env import DistEnv
from hpcdist.launch.records import checkpoint_tiers_text
from hpcdist.report.rundata import RunData
from hpcdist.rundir import RunDir
from hpcdist.trainer import Trainer
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist

# 6 steps: the shared tier saves step 3 (and 6), the local tier steps 2 and 4: a kill after step 5 leaves the
# local tier one step ahead of the shared one
OVER = ("train.steps=6", "checkpoint.every_steps=3", "checkpoint.keep_last=5", "train.micro_batch_size=2")


class _Killed(Exception):
    """Stands for a SIGKILL after a step: nothing of that step is saved."""


def _run(env: DistEnv, cfg: JobConfig, kill_after: int | None = None) -> dict:
    env = dataclasses.replace(env, hostname=f"node{env.rank}")  # two nodes: the peer copy crosses between them
    trainer = Trainer(cfg, env)
    if kill_after is not None:
        should_save = trainer.ckpt.should_save

        def killed(step: int, **kw: bool) -> bool:
            if step == kill_after:
                raise _Killed
            return should_save(step, **kw)

        trainer.ckpt.should_save = killed  # type: ignore[method-assign]
    try:
        result = trainer.train()
    except _Killed:
        return {"resumed": trainer.resumed_from, "killed": True}
    return {"resumed": result.resumed_from, "losses": result.losses}


def _logged(run_dir: Path) -> dict[int, float]:
    """Each step's loss as last logged in metrics.jsonl (a killed run returns none)."""
    out = {}
    for line in RunDir(run_dir).metrics.read_text().splitlines():
        r = json.loads(line)
        if r.get("split", "train") == "train" and "loss" in r:
            out[int(r["step"])] = r["loss"]
    return out


def test_a_lost_nodes_files_come_from_its_peer_and_both_lost_falls_back_to_shared(small_cfg, tmp_path) -> None:
    straight = run_ranks(2, _run, small_cfg(*OVER, run_dir=tmp_path / "straight"))[0]["losses"]
    local = tmp_path / "local-{host}"
    cfg = small_cfg(*OVER, f"checkpoint.local.dir={local}", "checkpoint.local.every_steps=2", run_dir=tmp_path / "run")
    node0, node1 = tmp_path / "local-node0", tmp_path / "local-node1"
    run_ranks(2, _run, cfg, 5)
    # each rank's own steps 2 and 4, and the other node's copy of them
    for node, own, copy in (
        (node0, "rank-00000", "replica-of-rank-00001"),
        (node1, "rank-00001", "replica-of-rank-00000"),
    ):
        for d in (own, copy):
            assert sorted(p.name for p in (node / d).glob("step-*")) == ["step-00000002", "step-00000004"], node
            assert (node / d / "step-00000004" / MARKER).is_file()
    assert json.loads(RunDir(cfg.run.dir).local_checkpoints.read_text())["step"] == 4
    # what `hpcdist status` and the report show of both tiers
    status = checkpoint_tiers_text(cfg.run.dir)
    assert status.startswith(
        f"checkpoints: shared step 3 ({cfg.checkpoint_dir}); node-local step 4 (with peer copies, "
    )
    tiers = RunData.load(cfg.run.dir).checkpoints
    assert (tiers["shared_step"], tiers["local_step"], tiers["local_copies"]) == (3, 4, True)

    shutil.rmtree(node1)  # node 1 replaced: its disk is empty
    first = run_ranks(2, _run, cfg, 5)
    assert first[0]["resumed"] == str(node0 / "rank-00000" / "step-00000004")
    assert first[1]["resumed"] == str(node1 / "rank-00001" / "step-00000004")  # fetched back from node 0's copy
    assert _logged(cfg.run.dir)[5] == straight[5]

    shutil.rmtree(node0)
    shutil.rmtree(node1)  # both copies gone: the shared checkpoint of step 3
    last = run_ranks(2, _run, cfg)[0]
    assert last["resumed"] == str(cfg.checkpoint_dir / "step-00000003")
    assert last["losses"] == {s: v for s, v in straight.items() if s > 3}
