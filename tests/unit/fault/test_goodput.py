"""Goodput accounting across attempts: train, checkpoint, restore, startup, lost (redone steps and an unclean end),
queue wait; the ratio."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from hpcdist.fault.goodput import (
    CATEGORIES,
    Goodput,
    InProcessRecovery,
    mark_attempt_end,
    process_start_time,
    summarize,
)
from hpcdist.trainer import Trainer
from tests.dist.harness import single
from tests.training import after_step_hook, train


def test_summarize_splits_every_second() -> None:
    attempts = [
        # failed: 100 s of wall; its end after the last flush is unaccounted -> lost
        {"start": 0, "end": 100, "startup_s": 10, "restore_s": 0, "train_s": 60, "checkpoint_save_s": 5, "lost_s": 15},
        # requeued after 20 s; stopped cleanly: its unaccounted rest is "other"
        {"start": 120, "end": 200, "clean": True, "startup_s": 8, "restore_s": 2, "train_s": 60, "other_s": 4},
    ]
    g = summarize(attempts)
    assert g["total_s"] == 200 and g["queue_wait"] == 20 and g["train"] == 120 and g["goodput"] == 0.6
    assert g["lost"] == 15 + 10 and g["other"] == 4 + 6 and g["checkpoint_save"] == 5 and g["restore"] == 2
    assert sum(g[k] for k in CATEGORIES) == pytest.approx(g["total_s"])


def test_two_attempts_with_a_failure_and_a_resume(tmp_path: Path) -> None:
    t0 = time.time()
    first = Goodput(tmp_path, enabled=True, start=t0 - 5.0)
    first.begin(None)
    for step in range(1, 11):
        first.step(step, 0.5)
        if step == 6:
            first.add("checkpoint_save", 0.25)  # a save inside step 6: not train time
    first.flush()  # ... and then the rank was killed: no clean end
    mark_attempt_end(tmp_path, when=time.time())  # the batch script's after-step

    second = Goodput(tmp_path, enabled=True, start=time.time() + 0.0)
    second.add("restore", 0.5)
    second.begin(resumed_step=6)  # steps 7..10 of the first attempt are computed again
    for step in range(7, 11):
        second.step(step, 0.5)
    second.flush(clean=True)

    a, b = json.loads((tmp_path / "goodput.json").read_text())["attempts"]
    assert a["lost_steps"] == 4 and a["first_step"] == 0 and a["last_step"] == 10
    assert a["train_s"] + a["lost_s"] == pytest.approx(10 * 0.5 - 0.25)  # the save stays checkpoint time
    assert a["lost_s"] == pytest.approx(4 * (4.75 / 10))
    assert a["startup_s"] == pytest.approx(5.0, abs=0.5) and not a.get("clean")
    assert b["first_step"] == 6 and b["restore_s"] == 0.5 and b["clean"] and b["train_s"] == pytest.approx(2.0)
    g = second.summary()
    assert g["attempts"] == 2 and g["train"] == pytest.approx(a["train_s"] + 2.0)
    assert g["goodput"] == pytest.approx(g["train"] / g["total_s"])


def test_an_in_process_generation_is_an_attempt_from_the_peers_death(tmp_path: Path) -> None:
    """A generation after an in-process recovery runs in the process the first one started: counted from the
    process's start, its startup and its unaccounted time held the whole first generation again (the categories
    overlapped the first one's). It starts at the peer's death; the generation before ends there."""
    t0 = time.time() - 10.0
    first = Goodput(tmp_path, enabled=True, start=t0, restart=0)
    first.begin(None)
    for step in range(1, 7):
        first.step(step, 0.5)
    first.flush()  # a peer died during step 7: PeerRankDied, no clean end
    failed_at = time.time() - 0.5  # the regroup and the restore below took that long
    second = Goodput(tmp_path, enabled=True, restart=0, in_process=InProcessRecovery(1, failed_at, regroup_s=0.25))
    second.add("restore", 0.125)
    second.begin(resumed_step=5)  # the newest snapshot every rank holds: step 6 is computed again
    for step in range(6, 9):
        second.step(step, 0.5)
    second.flush(clean=True)

    a, b = json.loads((tmp_path / "goodput.json").read_text())["attempts"]
    assert a["end"] == failed_at and a["lost_steps"] == 1 and "generation" not in a
    assert b["start"] == failed_at and b["generation"] == 1 and b["restart"] == 0 and b["first_step"] == 5
    rec = b["recovery"]
    assert rec["path"] == "in-process" and rec["regroup"] == 0.25 and rec["checkpoint_load"] == 0.125
    assert rec["total"] == pytest.approx(b["first_step_at"] - failed_at, abs=1e-3)
    assert rec["total"] >= rec["regroup"] + rec["checkpoint_load"] + rec["init"] - 1e-3
    # the two attempts do not overlap: the second's start-up is its own, from the death to its loop
    assert a["end"] <= b["start"] and b["startup_s"] + b["restore_s"] == pytest.approx(b["loop_start"] - failed_at)
    assert second.summary()["attempts"] == 2
    assert [r["generation"] for r in second.recoveries()] == [1]


def test_disabled_on_other_ranks(tmp_path: Path) -> None:
    g = Goodput(tmp_path, enabled=False)
    g.begin(None)
    g.step(1, 1.0)
    g.flush(clean=True)
    assert not (tmp_path / "goodput.json").exists()


def test_process_start_time_is_in_the_past() -> None:
    assert time.time() - 3600 * 24 * 365 < process_start_time() <= time.time()


def test_the_record_never_says_an_attempt_got_less_far_than_its_checkpoint(small_cfg) -> None:
    """goodput.json is written at most once a second, and the save after step N's optimizer step wrote it before
    step N was booked: a rank killed within that second left last_step N-1 beside checkpoint N (the next attempt
    then resumed from a step its predecessor had never reached). Read here as a kill right after the save would
    leave it."""
    cfg = small_cfg("train.steps=4", "checkpoint.every_steps=3")
    seen: list[int] = []

    def read_record(trainer: Trainer) -> None:  # step 4's optimizer step: the save of step 3 is behind
        seen.append(json.loads((Path(cfg.run.dir) / "goodput.json").read_text())["attempts"][-1]["last_step"])

    single(lambda env: train(env, cfg, before=after_step_hook(0, 4, read_record)))
    assert seen and seen[0] >= 3
