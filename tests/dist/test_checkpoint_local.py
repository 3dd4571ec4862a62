"""The node-local checkpoint tier (checkpoint.local) on 2 real ranks, each its own "node" (its
DistEnv's host name): a lost node's files come back from its peer's copy, and with both copies gone the shared
checkpoint resumes, every loss equal to an uninterrupted run's."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from hpcdist.base.rundir import RunDir
from hpcdist.checkpoint.local.layout import run_key
from hpcdist.checkpoint.names import MARKER
from hpcdist.config import JobConfig
from hpcdist.env import DistEnv
from hpcdist.launch.records import checkpoint_tiers_text
from hpcdist.report.rundata import RunData
from hpcdist.trainer import Trainer
from tests.dist.harness import run_ranks
from tests.training import train

pytestmark = pytest.mark.dist

# 6 steps: the shared tier saves step 3 (and 6), the local tier steps 2 and 4: a kill after step 5 leaves the
# local tier one step ahead of the shared one
OVER = ("train.steps=6", "checkpoint.every_steps=3", "checkpoint.keep_last=5", "train.micro_batch_size=2")


class _Killed(Exception):
    """Stands for a SIGKILL after a step: nothing of that step is saved."""


def _run(env: DistEnv, cfg: JobConfig, kill_after: int | None = None) -> dict:
    env = dataclasses.replace(env, hostname=f"node{env.rank}")  # two nodes: the peer copy crosses between them
    built: list[Trainer] = []

    def kill(trainer: Trainer) -> None:
        built.append(trainer)
        if kill_after is None:
            return
        should_save = trainer.ckpt.manager.should_save

        def killed(step: int, **kw: bool) -> bool:
            if step == kill_after:
                raise _Killed
            return should_save(step, **kw)

        trainer.ckpt.manager.should_save = killed  # type: ignore[method-assign]

    try:
        out = train(env, cfg, before=kill)
    except _Killed:
        return {"resumed": built[0].resumed_from, "killed": True}
    return {"resumed": out["resumed"], "losses": out["losses"]}


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
    # each rank's own steps 2 and 4, and the other node's copy of them, in the run's own subdirectory
    (key,) = {p.name for p in (*node0.iterdir(), *node1.iterdir())}
    assert key == run_key(cfg.run.dir)
    for node, own, copy in (
        (node0 / key, "rank-00000", "replica-of-rank-00001"),
        (node1 / key, "rank-00001", "replica-of-rank-00000"),
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
    assert first[0]["resumed"] == str(node0 / key / "rank-00000" / "step-00000004")
    assert first[1]["resumed"] == str(node1 / key / "rank-00001" / "step-00000004")  # fetched back from node 0's copy
    assert _logged(cfg.run.dir)[5] == straight[5]

    shutil.rmtree(node0)
    shutil.rmtree(node1)  # both copies gone: the shared checkpoint of step 3
    last = run_ranks(2, _run, cfg)[0]
    assert last["resumed"] == str(cfg.checkpoint_dir / "step-00000003")
    assert last["losses"] == {s: v for s, v in straight.items() if s > 3}


def _copy_in_background(env: DistEnv, root: Path, record: Path, snapshot: Path) -> dict:
    """Two "nodes" save steps 2 and 4 through the tier itself; step 4's peer copy is held after its first chunk
    (the sender's next read waits on a gate): what the loop waits for, what the record says meanwhile, and the
    disk as a kill at that moment would leave it (copied aside), restored later."""
    import threading
    import time

    import torch

    from hpcdist.checkpoint.local import layout as cl_layout
    from hpcdist.checkpoint.local import tier as cl
    from hpcdist.checkpoint.local import transport as cl_transport
    from tests.checkpointing import TinyState

    me = root / f"node{env.rank}"
    tier = cl.LocalTier(
        cl_layout.open_local_dir(me),
        rank=env.rank,
        world_size=2,
        hosts=["node0", "node1"],
        keep=2,
        record=record if env.rank == 0 else None,
    )
    # step 4's copy is held after its first chunk (512 bytes: a copy of several chunks), until the gate opens;
    # step 6's fails there (a file shorter than listed: the sender's read raises)
    gate, chunks = threading.Event(), cl_transport._chunks

    def held(src: Path | None, files: Any) -> Any:
        for i, chunk in enumerate(chunks(src, files)):
            if i == 1 and src is not None and src.name == "step-00000004":
                gate.wait(8)
            if i == 1 and src is not None and src.name == "step-00000006":
                raise OSError("shorter than listed")
            yield chunk

    cl_transport._chunks, cl_transport.CHUNK = held, 512
    st = TinyState()
    torch.manual_seed(0)  # the same weights on both ranks (the restore below checks them)
    st.w.reset_parameters()
    weights = {}
    for step in (2, 4):
        with torch.no_grad():
            st.w.weight.fill_(float(step))
        st.step = step
        weights[step] = st.w.weight.detach().clone()
        t0 = time.perf_counter()
        assert tier.save(step, st.checkpointable())
        tier.staging_fence()  # what the loop does before its optimizer step changes the weights
        out = {"loop_s": time.perf_counter() - t0}
    peer = 1 - env.rank
    copy = me / f"replica-of-rank-{peer:05d}"
    out["copy_complete_at_return"] = (copy / "step-00000004" / MARKER).is_file()
    if env.rank == 0:
        out["record_at_return"] = json.loads(record.read_text())
    assert not out["copy_complete_at_return"], f"save returned after the peer copy ({out['loop_s']:.1f} s)"
    # the copy's first chunk has landed in a .partial directory: a kill now leaves this disk
    partial = copy / "step-00000004.partial"
    deadline = time.monotonic() + 30
    while not (partial.is_dir() and any(p.stat().st_size for p in partial.iterdir())):
        assert time.monotonic() < deadline, "the copy wrote nothing"
        time.sleep(0.01)
    # this rank's own files are complete while the copy is held: the step counts on every rank's own files
    out["own_complete_during_copy"] = (me / f"rank-{env.rank:05d}" / "step-00000004" / MARKER).is_file()
    shutil.copytree(me, snapshot / f"node{env.rank}")
    # the peer's copy to this node is held by the peer's gate: released only once both disks are copied aside
    torch.distributed.barrier()
    gate.set()
    out["copied"] = tier.wait()
    out["copy_complete_after_wait"] = (copy / "step-00000004" / MARKER).is_file()
    if env.rank == 0:
        out["record_after_wait"] = json.loads(record.read_text())
    # a copy that fails in the background: the step stays (every rank's own files), without a copy
    assert tier.save(6, st.checkpointable())
    out["failed_copy"] = tier.wait()
    out["failed_copy_left"] = sorted(p.name for p in copy.glob("step-00000006*"))
    if env.rank == 0:
        out["record_after_failure"] = json.loads(record.read_text())
    cl_transport._chunks, cl_transport.CHUNK = chunks, 16 << 20

    # the restart after that kill, on node 1's replacement (its own files gone): step 4 is complete for rank 0
    # only, rank 1's copy of it is a .partial: step 2 resumes, rank 1's files from node 0's copy
    if env.rank == 1:
        shutil.rmtree(snapshot / "node1" / "rank-00001")
    again = cl.LocalTier(snapshot / f"node{env.rank}", rank=env.rank, world_size=2, hosts=["node0", "node1"], keep=2)
    fresh = TinyState()
    path = again.restore(fresh.checkpointable(), shared_step=None)
    out["restored"] = str(path)
    out["restored_weights_of_step_2"] = fresh.step == 2 and torch.equal(fresh.w.weight, weights[2])
    return out


def test_the_peer_copy_runs_in_the_background_and_a_kill_during_it_leaves_nothing_trusted(tmp_path) -> None:
    """``save`` returns once the snapshot started; its files and the copy to the peer are written on a thread
    (``wait`` joins it); the record says peer_copies only once it is complete; a kill while it runs leaves a
    .partial copy that no restore trusts; a copy that fails leaves no copy of its step, the step itself stays."""
    root, record, snapshot = tmp_path / "local", tmp_path / "local_checkpoints.json", tmp_path / "killed"
    out = run_ranks(2, _copy_in_background, root, record, snapshot)
    for r in out:
        assert r["own_complete_during_copy"]
        assert not r["copy_complete_at_return"] and r["loop_s"] < 4, r  # the loop did not wait for the copy
        assert r["copied"] and r["copy_complete_after_wait"]
        assert r["failed_copy"] is False and r["failed_copy_left"] == []
    assert (out[0]["record_at_return"]["step"], out[0]["record_at_return"]["peer_copies"]) == (2, True)
    assert (out[0]["record_after_wait"]["step"], out[0]["record_after_wait"]["peer_copies"]) == (4, True)
    assert (out[0]["record_after_failure"]["step"], out[0]["record_after_failure"]["peer_copies"]) == (6, False)
    assert out[0]["restored"] == str(snapshot / "node0" / "rank-00000" / "step-00000002")
    assert out[1]["restored"] == str(snapshot / "node1" / "rank-00001" / "step-00000002")  # from node 0's copy
    assert all(r["restored_weights_of_step_2"] for r in out)


# 12 steps: local steps every 2 (keep 2), shared every 6: a kill after step 11 leaves local 8 and 10, shared 6
LONG = ("train.steps=12", "checkpoint.keep_last=5", "train.micro_batch_size=2", "checkpoint.local.every_steps=2")


def _step_dirs(node: Path, tier_dir: str, step: int) -> list[Path]:
    """The tier's directories of ``step`` under ``tier_dir`` (rank-*/replica-of-rank-*) on a node, wherever the
    tier keys them."""
    return sorted(node.rglob(f"{tier_dir}/step-{step:08d}"))


def _flip(step_dir: Path) -> None:
    shard = next(step_dir.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def _set_aside(node: Path, tier_dir: str, step: int) -> list[Path]:
    return sorted(p for p in node.rglob(f"{tier_dir}/step-{step:08d}.*") if not p.name.endswith(".partial"))


def _run_or_error(env: DistEnv, cfg: JobConfig, kill_after: int | None = None) -> dict:
    try:
        return _run(env, cfg, kill_after)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


@pytest.fixture(scope="module")
def straight12(tmp_path_factory, corpus_dir) -> dict[int, float]:
    from tests.conftest import small_config

    tmp = tmp_path_factory.mktemp("straight12")
    cfg = small_config(tmp / "run", corpus_dir, *LONG, "checkpoint.every_steps=6", f"checkpoint.local.dir={tmp}/l")
    return run_ranks(2, _run, cfg)[0]["losses"]


@pytest.mark.parametrize("copies_damaged", [False, True])
def test_a_damaged_newest_local_step_falls_back_to_the_next_intact_one(
    small_cfg, tmp_path, straight12, copies_damaged
) -> None:
    """Rank 0's own files of local step 10 damaged: its peer copy on node 1 restores step 10; that copy damaged
    too: local step 8 (newer than the shared step 6). The damaged directories are set aside, never deleted, and
    every loss equals the uninterrupted run's."""
    local = tmp_path / "local-{host}"
    cfg = small_cfg(*LONG, "checkpoint.every_steps=6", f"checkpoint.local.dir={local}", run_dir=tmp_path / "run")
    node0, node1 = tmp_path / "local-node0", tmp_path / "local-node1"
    run_ranks(2, _run, cfg, 11)
    (own,) = _step_dirs(node0, "rank-00000", 10)
    (copy,) = _step_dirs(node1, "replica-of-rank-00000", 10)
    _flip(own)
    if copies_damaged:
        _flip(copy)
    out = run_ranks(2, _run, cfg)
    want = 8 if copies_damaged else 10
    assert out[0]["resumed"] is not None and out[0]["resumed"].endswith(f"rank-00000/step-{want:08d}"), out[0]
    assert out[0]["losses"] == {s: v for s, v in straight12.items() if s > want}
    assert len(_set_aside(node0, "rank-00000", 10)) == 1  # kept, renamed
    assert len(_set_aside(node1, "replica-of-rank-00000", 10)) == (1 if copies_damaged else 0)


def test_without_a_shared_checkpoint_a_damaged_local_step_is_never_a_fresh_start(small_cfg, tmp_path) -> None:
    """checkpoint.every_steps=0: the local tier is the only resume point. Step 10 damaged on both nodes: step 8
    resumes and step 10 is kept aside; every local step damaged: the run refuses to start from step 0 and deletes
    nothing."""
    local = tmp_path / "local-{host}"
    over = (*LONG, "checkpoint.every_steps=0", "checkpoint.save_final=false", f"checkpoint.local.dir={local}")
    straight_cfg = small_cfg(*over[:-1], f"checkpoint.local.dir={tmp_path}/s", run_dir=tmp_path / "straight")
    straight = run_ranks(2, _run, straight_cfg)[0]["losses"]
    cfg = small_cfg(*over, run_dir=tmp_path / "run")
    node0, node1 = tmp_path / "local-node0", tmp_path / "local-node1"
    run_ranks(2, _run, cfg, 11)
    for d in (*_step_dirs(node0, "rank-00000", 10), *_step_dirs(node1, "replica-of-rank-00000", 10)):
        _flip(d)
    out = run_ranks(2, _run_or_error, cfg)
    assert out[0].get("resumed", "").endswith("rank-00000/step-00000008"), out[0]
    assert out[0]["losses"] == {s: v for s, v in straight.items() if s > 8}
    assert _set_aside(node0, "rank-00000", 10) and _set_aside(node1, "replica-of-rank-00000", 10)

    # the same kill on another tier directory; now every step of rank 0 (its own files and the copy) is damaged
    local2 = tmp_path / "local2-{host}"
    cfg2 = small_cfg(*over[:-1], f"checkpoint.local.dir={local2}", run_dir=tmp_path / "run2")
    node0 = tmp_path / "local2-node0"
    run_ranks(2, _run, cfg2, 11)
    for step in (8, 10):
        for d in (
            *_step_dirs(node0, "rank-00000", step),
            *_step_dirs(tmp_path / "local2-node1", "replica-of-rank-00000", step),
        ):
            _flip(d)
    before = sorted(p.name for p in (tmp_path / "local2-node0").rglob("step-*"))
    out = run_ranks(2, _run_or_error, cfg2)
    assert "error" in out[0] and "ConfigError" in out[0]["error"] and "damaged" in out[0]["error"], out[0]
    assert "checkpoint.resume=none" in out[0]["error"]
    after = sorted(p.name for p in node0.rglob("step-*"))
    assert len(after) == len(before) and [n[:13] for n in after] == [n[:13] for n in before]  # renamed, kept


def test_two_runs_on_one_local_dir_keep_their_own_steps(small_cfg, tmp_path) -> None:
    """Two runs (another run.dir each) on one checkpoint.local.dir, as the /dev/shm/hpcdist-{job_id} template gives
    every run outside SLURM: run B's saves do not replace or prune run A's steps, and A resumes from its own."""
    local = tmp_path / "local-{host}"
    over = (*LONG, "checkpoint.every_steps=6", f"checkpoint.local.dir={local}", "train.steps=10")
    a, b = small_cfg(*over, run_dir=tmp_path / "a"), small_cfg(*over, "run.seed=7", run_dir=tmp_path / "b")
    straight_cfg = small_cfg(*over[:-2], f"checkpoint.local.dir={tmp_path}/s", "train.steps=10", run_dir=tmp_path / "s")
    straight = run_ranks(2, _run, straight_cfg)[0]["losses"]
    run_ranks(2, _run, a, 9)  # A: local 6 and 8, shared 6
    run_ranks(2, _run, b)  # B: local steps 2..10, pruned to its newest two
    out = run_ranks(2, _run, a)
    assert out[0]["resumed"] is not None and out[0]["resumed"].endswith("rank-00000/step-00000008"), out[0]
    assert out[0]["losses"] == {s: v for s, v in straight.items() if s > 8}


def _prune_fails(env: DistEnv, root: Path, record: Path) -> dict:
    """Two "nodes" save step 2; the prune after its (complete) peer copy fails on rank 0 (its disk errs)."""
    import logging

    from hpcdist.checkpoint.local import layout as cl_layout
    from hpcdist.checkpoint.local import tier as cl
    from tests.checkpointing import TinyState

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, r: logging.LogRecord) -> None:
            lines.append(r.getMessage())

    logging.getLogger("hpcdist").addHandler(Keep())
    logging.getLogger("hpcdist").setLevel(logging.INFO)
    hosts = ["node0", "node1"]
    tier = cl.LocalTier(
        cl_layout.open_local_dir(root / f"node{env.rank}"),
        rank=env.rank,
        world_size=2,
        hosts=hosts,
        keep=2,
        record=record,
    )
    if env.rank == 0:

        def broken() -> None:
            raise OSError(5, "Input/output error")

        tier._prune = broken  # type: ignore[method-assign]
    assert tier.save(2, TinyState().checkpointable())
    copied = tier.wait()
    return {"copied": copied, "lines": lines, "record": json.loads(record.read_text()) if env.rank == 0 else None}


def test_a_failure_after_the_peer_copy_is_not_called_a_copy_failure(tmp_path) -> None:
    out = run_ranks(2, _prune_fails, tmp_path / "local", tmp_path / "local_checkpoints.json")
    lines = out[0]["lines"]
    assert all(r["copied"] for r in out)  # the copies themselves are complete
    assert not any("peer copies of step 2 failed" in line for line in lines), lines
    assert any("pruning after step 2 failed" in line and "Input/output error" in line for line in lines), lines
    assert any("step 2 complete with peer copies" in line for line in lines), lines
    assert out[0]["record"]["peer_copies"] is True


def test_the_newest_intact_step_of_either_tier_resumes(small_cfg, tmp_path, straight12) -> None:
    """Shared steps 4 and 8, local steps 6 and 10 (killed after step 11). Local 10 damaged on both nodes and shared 8
    damaged: local 6 resumes (newer than the intact shared 4), exact losses."""
    local = tmp_path / "local-{host}"
    cfg = small_cfg(*LONG, "checkpoint.every_steps=4", f"checkpoint.local.dir={local}", run_dir=tmp_path / "run")
    node0, node1 = tmp_path / "local-node0", tmp_path / "local-node1"
    run_ranks(2, _run, cfg, 11)
    for d in (*_step_dirs(node0, "rank-00000", 10), *_step_dirs(node1, "replica-of-rank-00000", 10)):
        _flip(d)
    _flip(cfg.checkpoint_dir / "step-00000008")
    out = run_ranks(2, _run, cfg)
    assert out[0]["resumed"] is not None and out[0]["resumed"].endswith("rank-00000/step-00000006"), out[0]
    assert out[0]["losses"] == {s: v for s, v in straight12.items() if s > 6}
