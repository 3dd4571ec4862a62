"""Checkpoint integrity under faults, on real ranks: damaged files, a crash in the middle of a save, a full disk.

Each test damages or interrupts a real checkpoint the way a cluster does, then checks that resume never trusts
it and training goes on with the same losses as an undisturbed run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpcdist import config as config_mod
from hpcdist import run
from hpcdist.checkpoint.codec import KILL_WRITER_ENV
from hpcdist.checkpoint.manager import KILL_ENV
from hpcdist.checkpoint.manifest import MANIFEST
from hpcdist.checkpoint.names import DAMAGED, MARKER, list_checkpoints
from hpcdist.config import JobConfig
from hpcdist.env import DistEnv
from hpcdist.fault.stop import StopFlag, StopReason
from hpcdist.trainer import Trainer
from tests.conftest import small_config
from tests.dist.harness import free_port, run_ranks
from tests.training import train

pytestmark = pytest.mark.dist

# the same train.steps everywhere (the LR schedule depends on it); shorter runs stop early with until=
OVER = ("train.steps=8", "checkpoint.every_steps=2", "checkpoint.keep_last=5", "train.micro_batch_size=2")


def _torchrun_train(config_file: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``hpcdist train CONFIG`` under torchrun, 2 ranks, with ``env`` added (a test-only kill hook)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}"]
    cmd += ["-m", "hpcdist.cli", "train", str(config_file)]
    root = Path(__file__).resolve().parents[2]
    full = {**os.environ, **env, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=root, env=full, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def straight(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The undisturbed 2-rank run of OVER, trained once per module: the fault tests that compare losses with it only
    read it (it was retrained for each)."""
    return run_ranks(2, train, small_config(tmp_path_factory.mktemp("straight") / "run", corpus_dir, *OVER))[0]


def _train_and_stage(env: DistEnv, cfg: JobConfig) -> dict:
    """As train, with the staging need counted at start-up and the bytes the last save staged."""
    from hpcdist.checkpoint.staging import staging_bytes, staging_estimate

    counted: dict[str, int] = {}

    def count(trainer: Trainer) -> None:
        counted["estimate"] = staging_estimate(trainer.strategy.model)

    out = train(
        env, cfg, before=count, after=lambda trainer, _: {"staged": staging_bytes(trainer.strategy.dcp_state())}
    )
    return {"losses": out["losses"], "estimate": counted["estimate"], "staged": out["staged"]}


def _shard(ckpt: Path) -> Path:
    return sorted(ckpt.glob("*.distcp"))[-1]


@pytest.mark.parametrize("damage", ["truncate", "flip-byte", "delete"])
def test_damaged_newest_checkpoint_falls_back(small_cfg, straight: dict, tmp_path, capfd, damage: str) -> None:
    """Damage one shard of step 6; a resumed 8-step run must load step 4 (warning names the file), demote step 6,
    and redo steps 5-8 exactly like the straight run."""
    cfg = small_cfg(*OVER, run_dir=tmp_path / "run")
    run_ranks(2, train, cfg, 6)
    newest = cfg.checkpoint_dir / "step-00000006"
    victim = _shard(newest)
    manifest = json.loads((newest / MANIFEST).read_text())["files"]
    assert manifest[victim.name]["size"] == victim.stat().st_size  # the manifest covers the shards
    if damage == "truncate":
        os.truncate(victim, victim.stat().st_size // 2)
    elif damage == "flip-byte":  # same size: only the checksum sees it
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    else:
        victim.unlink()
    capfd.readouterr()

    resumed = run_ranks(2, train, cfg)[0]
    out = capfd.readouterr().out
    assert resumed["resumed"].endswith("step-00000004")
    assert "step-00000006 is damaged" in out and victim.name in out
    assert resumed["losses"] == {s: v for s, v in straight["losses"].items() if s > 4}
    assert (newest / MARKER).is_file()  # step 6 was saved again over the damaged one (which had been demoted)
    assert not (newest / DAMAGED).exists()
    (aside,) = cfg.checkpoint_dir.glob("step-00000006.damaged-*")  # the damaged one kept, not overwritten
    assert (aside / DAMAGED).is_file()


def test_explicit_resume_of_a_damaged_checkpoint_is_refused(small_cfg, tmp_path) -> None:
    cfg = small_cfg(*OVER, run_dir=tmp_path / "run")
    run_ranks(2, train, cfg, 2)
    ckpt = cfg.checkpoint_dir / "step-00000002"
    os.truncate(_shard(ckpt), 10)
    with pytest.raises(AssertionError, match=r"is damaged: __\d_0\.distcp: 10 bytes"):
        run_ranks(2, train, small_cfg(*OVER, f"checkpoint.resume={ckpt}", run_dir=tmp_path / "again"))


def test_killed_during_save_resumes_from_previous(small_cfg, straight: dict, tmp_path) -> None:
    """torchrun, 2 ranks: every rank is SIGKILLed after writing step 4's shards, before its manifest and marker
    (test-only hook). The next run ignores step 4, resumes from step 2 and matches the straight run."""
    cfg = small_cfg(*OVER, run_dir=tmp_path / "run")
    config_file = config_mod.save(cfg, tmp_path / "config.yaml")  # exactly small_cfg's resolved config
    r = _torchrun_train(config_file, {KILL_ENV: "4"})
    assert r.returncode != 0, r.stdout[-2000:]
    complete, incomplete = list_checkpoints(cfg.checkpoint_dir)
    assert [s for s, _ in complete] == [2]
    assert [d.name for d in incomplete] == ["step-00000004"] and list(incomplete[0].glob("*.distcp"))
    assert not (incomplete[0] / MANIFEST).exists()

    resumed = run_ranks(2, train, cfg)[0]
    assert resumed["resumed"].endswith("step-00000002")
    assert resumed["losses"] == {s: v for s, v in straight["losses"].items() if s > 2}
    assert [s for s, _ in list_checkpoints(cfg.checkpoint_dir)[0]] == [2, 4, 6, 8]


@pytest.mark.slow  # ~60 s on 2 busy cores: torchrun + 2 checkpoint processes spawned twice
def test_a_checkpoint_process_killed_while_writing_leaves_nothing_trusted(small_cfg, straight: dict, tmp_path) -> None:
    """Torchrun, 2 ranks, async save in checkpoint processes: both ranks' checkpoint processes are
    SIGKILLed after writing step 4's shards (test-only hook). Step 4 gets no marker and is removed; training goes
    on unharmed (same losses as a sync run), the next saves (6, 8) start new processes and are complete, and a
    resume takes step 8."""
    cfg = small_cfg(*OVER, "checkpoint.async_save=true", run_dir=tmp_path / "run")
    config_file = config_mod.save(cfg, tmp_path / "config.yaml")
    r = _torchrun_train(config_file, {KILL_WRITER_ENV: "4"})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "step-00000004 failed" in out and "Traceback" not in out, out[-3000:]
    complete, incomplete = list_checkpoints(cfg.checkpoint_dir)
    assert [s for s, _ in complete] == [2, 6, 8] and incomplete == []
    summary = json.loads((Path(cfg.run.dir) / "run_summary.json").read_text())
    assert summary["checkpoint"].endswith("step-00000008")
    logged = {int(m[0]): float(m[1]) for m in re.findall(r"step (\d+)/8 \| loss ([0-9.]+)", out)}
    assert logged == {s: round(v, 4) for s, v in straight["losses"].items()}  # training never noticed
    resumed = run_ranks(2, train, cfg)[0]
    assert resumed["resumed"].endswith("step-00000008") and resumed["step"] == 8


@contextlib.contextmanager
def _small_tmpfs(path: Path, size: str):
    path.mkdir(parents=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs (needs root / CAP_SYS_ADMIN): {r.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_disk_full_during_save_keeps_training_and_previous_checkpoint(small_cfg, tmp_path, capfd) -> None:
    """A 2 MB run directory holds one checkpoint (~1.3 MB) but not two: the save at step 4 fails with ENOSPC on
    the ranks, all ranks abandon it together, training finishes, and step 2 stays complete and verified."""
    with _small_tmpfs(tmp_path / "small", "2m") as small:
        cfg = small_cfg(*OVER, "train.steps=4", "checkpoint.keep_last=1", run_dir=small / "run")
        out = run_ranks(2, train, cfg)[0]
        log = capfd.readouterr().out
        assert out["step"] == 4 and sorted(out["losses"]) == [1, 2, 3, 4]
        assert "checkpoint at step 4 failed" in log and "MB free in" in log and "point stays" in log
        complete, incomplete = list_checkpoints(cfg.checkpoint_dir)
        assert [s for s, _ in complete] == [2] and incomplete == []  # the partial step 4 was removed
        again = run_ranks(2, train, cfg)[0]  # step 2 is loadable (verified against its manifest)
        assert again["resumed"].endswith("step-00000002")
        assert again["losses"] == {s: v for s, v in out["losses"].items() if s > 2}
        shutil.rmtree(cfg.run.dir, ignore_errors=True)


@pytest.mark.parametrize(("minutes", "saved"), [(1e-9, [2, 3, 4, 5]), (60.0, [])])
def test_every_minutes_saves_on_rank_0s_clock_on_every_rank_alike(small_cfg, tmp_path, minutes, saved) -> None:
    """checkpoint.every_minutes: rank 0's clock asks, the per-step agreement carries the request one
    step later, both ranks save the same step (a save is collective: a lone rank would hang). An interval already
    due at every step saves from step 2 on; one of an hour never does."""
    cfg = small_cfg(
        "train.steps=5",
        "checkpoint.every_steps=0",
        "checkpoint.save_final=false",
        "checkpoint.keep_last=10",
        f"checkpoint.every_minutes={minutes}",
        run_dir=tmp_path / "run",
    )
    run_ranks(2, train, cfg)
    complete, incomplete = list_checkpoints(cfg.checkpoint_dir)
    assert [s for s, _ in complete] == saved and incomplete == []


@pytest.mark.parametrize("strategy", [("parallel.strategy=ddp",), ("parallel.strategy=zero", "parallel.zero.stage=3")])
def test_async_save_hashes_on_every_rank_and_resumes(small_cfg, tmp_path, strategy) -> None:
    """An async save's manifest was hashed by rank 0 alone (for 13B: ~180 GB of sha256 on one host).
    Each rank now hashes the files it wrote, from its background thread; rank 0 merges the parts. The result is
    a complete, verifiable checkpoint that resumes exactly like a sync one. The staging need counted at
    start-up covers what a save stages (ZeRO-3's placeholders counted nothing; ZeRO 1-2 overcount, DDP is exact)."""
    over = (*OVER, "checkpoint.async_save=true", *strategy)
    straight = run_ranks(2, _train_and_stage, small_cfg(*over, run_dir=tmp_path / "straight"))[0]
    assert straight["estimate"] >= straight["staged"] >= 0.9 * straight["estimate"], straight
    cfg = small_cfg(*over, run_dir=tmp_path / "run")
    run_ranks(2, train, cfg, 6)
    newest = cfg.checkpoint_dir / "step-00000006"
    manifest = json.loads((newest / MANIFEST).read_text())
    assert (newest / MARKER).is_file() and not (newest / ".manifest").exists()
    by = {int(r): n for r, n in manifest["hashed_by"].items()}
    assert sorted(by) == [0, 1] and by[1] > 0 and by[0] > 0, by
    assert sum(by.values()) == sum(e["size"] for e in manifest["files"].values())
    resumed = run_ranks(2, train, cfg)[0]
    assert resumed["resumed"].endswith("step-00000006")
    assert {s: resumed["losses"][s] for s in (7, 8)} == {s: straight["losses"][s] for s in (7, 8)}


def _refusal(env: DistEnv, cfg: JobConfig) -> str:
    try:
        Trainer(cfg, env)
    except config_mod.ConfigError as e:
        return str(e)
    return "no refusal"


def test_a_step_dir_of_another_user_stops_every_rank_alike(small_cfg, tmp_path) -> None:
    """On real ranks: rank 0 checks the tree and tells the others, so every rank refuses with the same
    message (none waits in a collective) and the checkpoint is left as it is."""
    if os.getuid() != 0:
        pytest.skip("needs root to chown a file to another user (CI runs as root)")
    cfg = small_cfg(*OVER, run_dir=tmp_path / "run")
    run_ranks(2, train, cfg, 2)
    ckpt = cfg.checkpoint_dir / "step-00000002"
    os.chown(ckpt / "rng", 4242, 4242)  # a directory of theirs inside my step dir
    messages = run_ranks(2, _refusal, cfg, timeout=120)
    assert messages[0] == messages[1] and "belongs to uid 4242, not to you" in messages[0], messages
    assert f": {ckpt / 'rng'}." in messages[0], messages  # that directory alone: the files in it are mine
    assert (ckpt / MARKER).is_file() and not (ckpt / DAMAGED).exists()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_failed_final_save_exits_74_naming_the_resume_point(small_cfg, tmp_path, async_save: bool) -> None:
    """On a full disk the final save failed, yet the run printed "done", exited 0 and its
    run_summary.json named step 4; DCP's writer threads then printed their tracebacks. Now the exit status is 74,
    the last line names the resume point (step 2), run_summary.json and failures.jsonl say so, and no traceback is
    printed. An async save's failed directory is removed too (the summary and the record need the space)."""
    with _small_tmpfs(tmp_path / "small", "2m") as small:
        run_dir = small / "run"
        cfg = small_cfg(
            "train.steps=4",
            "checkpoint.every_steps=2",
            "checkpoint.keep_last=1",
            "train.micro_batch_size=4",
            "checkpoint.save_final=true",
            "checkpoint.write_threads=2",
            f"checkpoint.async_save={str(async_save).lower()}",
            run_dir=run_dir,
        )
        yaml = tmp_path / "cfg.yaml"
        config_mod.save(cfg, yaml)
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID"):
            env.pop(var, None)
        p = subprocess.run(
            [sys.executable, "-m", "hpcdist", "train", str(yaml)], capture_output=True, text=True, timeout=300, env=env
        )
        out = p.stdout + p.stderr
        assert p.returncode == 74, out[-3000:]
        assert "done:" not in out and "Traceback" not in out and "Exception in thread" not in out, out[-3000:]
        last = p.stderr.strip().splitlines()[-1]
        assert "step 4 of 4 trained, but its checkpoint FAILED" in last and "step-00000002" in last, last
        summary = json.loads((run_dir / "run_summary.json").read_text())
        assert summary["save_failed"] == 4 and summary["checkpoint"].endswith("step-00000002")
        (rec,) = [json.loads(line) for line in (run_dir / "failures.jsonl").read_text().splitlines()]
        assert rec["kind"] == "checkpoint" and rec["blame"] == [] and "step-00000002" in rec["cause"]
        assert [s for s, _ in list_checkpoints(cfg.checkpoint_dir)[0]] == [2]
        shutil.rmtree(run_dir, ignore_errors=True)


class _Scheduler:
    """The scheduler's side of a rank: a requeue after the stop checkpoint would return 0."""

    def before_start(self, cfg: JobConfig, env: DistEnv) -> None:
        return None

    def after_stop(self, cfg: JobConfig, env: DistEnv, reason: StopReason) -> int:
        return 0


def _stopped_for_a_requeue(env: DistEnv, cfg: JobConfig) -> dict:
    flag = StopFlag(rank=env.rank, device=torch.device("cpu"))
    flag.request(StopReason.TIME_LIMIT)  # as if USR2 came at step 1: agreed after step 2, save, requeue
    r = run.train(cfg, env, job=_Scheduler(), stop_flag=flag)
    return {"exit": r.exit_code, "failed": r.save_failed, "resume": r.resume_point, "stop": r.stop_reason.name}


def test_a_failed_stop_save_is_no_requeue_and_no_success(small_cfg, tmp_path) -> None:
    """The stop checkpoint before a requeue failing (disk full) must not report success: every rank
    exits 74 (the batch script's failure policy decides, blaming no node) instead of the scheduler's requeue."""
    with _small_tmpfs(tmp_path / "small", "2m") as small:
        (small / "filler").write_bytes(b"\0" * (1700 << 10))  # ~300 KB left: less than one checkpoint
        cfg = small_cfg(*OVER, run_dir=small / "run")
        outs = run_ranks(2, _stopped_for_a_requeue, cfg)
        assert outs == [{"exit": 74, "failed": 2, "resume": None, "stop": "TIME_LIMIT"}] * 2, outs
        shutil.rmtree(small / "run", ignore_errors=True)
