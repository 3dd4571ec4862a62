"""Components own their cadence (metrics, checkpoints, evaluation) and the watchdog's phases are context managers."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hpcdist.checkpoint import cadence, policy
from hpcdist.checkpoint.manager import CheckpointManager
from hpcdist.checkpoint.policy import SavePolicy
from hpcdist.evaluate import Evaluator
from hpcdist.fault.hang import HangWatchdog
from hpcdist.metrics.logger import MetricsLogger


def test_metrics_checkpoints_and_evaluation_say_when_they_are_due(tmp_path: Path) -> None:
    ml = MetricsLogger(tmp_path, enabled=False, every_steps=5)
    assert [s for s in range(1, 13) if ml.due(s, last=12)] == [1, 5, 10, 12]  # first, every 5th, the last
    ckpt = CheckpointManager(tmp_path / "ckpt", rank=0, world_size=1, every_steps=4)
    assert [s for s in range(1, 13) if ckpt.should_save(s, last_step=False)] == [4, 8, 12]
    never = CheckpointManager(tmp_path / "c2", rank=0, world_size=1)
    assert not any(never.should_save(s, last_step=False) for s in range(1, 13))
    ev = Evaluator(list(range(8)), every_steps=3, batches=1, global_batch_size=2, seed=0, dp_rank=0, dp_size=1)
    assert [s for s in range(1, 10) if ev.due(s)] == [3, 6, 9]
    no_val = Evaluator(None, every_steps=3, batches=1, global_batch_size=2, seed=0, dp_rank=0, dp_size=1)
    assert not any(no_val.due(s) for s in range(1, 10))


def test_a_slow_phase_is_timed_on_exit_and_its_next_run_gets_four_times_that(tmp_path: Path) -> None:
    w = HangWatchdog(rank=0, world_size=1, host="h", run_dir=tmp_path, timeout_s=0.5, slow_phase_s=100)
    with w.phase(1, "checkpoint save", slow=True):
        assert w.current_phase == "checkpoint save" and w._allow == 100  # its first time: the slow allowance
        time.sleep(0.3)
    time.sleep(0.4)  # after the phase: not part of its duration (the next beat no longer adds it)
    w.beat(1, "step")
    assert 0.3 <= w._seen["checkpoint save"] < 0.6
    with w.phase(2, "checkpoint save", slow=True):
        assert w._allow == max(0.5, 4 * w._seen["checkpoint save"])


def test_the_checkpoint_decides_every_save_of_the_loop_in_one_place(tmp_path: Path) -> None:
    """Every N steps, the agreed every-M-minutes request, the final step (checkpoint.save_final) and a
    stop are one decision, ``CheckpointManager.should_save``; a step already saved is never saved twice."""
    ckpt = CheckpointManager(tmp_path / "c", rank=0, world_size=1, every_steps=4, save_final=False, total_steps=10)
    assert [s for s in range(1, 11) if ckpt.should_save(s, last_step=s == 10)] == [4, 8]  # no final save
    assert ckpt.should_save(5, last_step=False, stop_requested=True)  # a signal: the resume point
    assert ckpt.should_save(6, last_step=True)  # train(until=6) ends before train.steps: an interruption saves
    assert ckpt.should_save(5, last_step=False, timed=True)  # checkpoint.every_minutes, agreed by every rank
    assert ckpt.should_save(10, last_step=True, timed=True)  # the timed request still saves the run's end
    assert not ckpt.should_save(10, last_step=True, stop_requested=True, timed=True)  # a stop there: save_final
    assert not ckpt.final_save_due(10) and ckpt.final_save_due(9)
    final = CheckpointManager(tmp_path / "f", rank=0, world_size=1, save_final=True, total_steps=10)
    assert [s for s in range(1, 11) if final.should_save(s, last_step=s == 10)] == [10]
    final.saved_step = 10  # saved (or its save failed): never twice
    assert not final.should_save(10, last_step=True, stop_requested=True, timed=True)


def test_rank_0s_clock_asks_for_the_timed_save_once_per_interval(tmp_path: Path) -> None:
    """checkpoint.every_minutes: rank 0's clock asks (the stop agreement carries the request to every rank); the
    other ranks never ask; an every-N save at the same step restarts the clock instead."""
    ckpt = CheckpointManager(tmp_path / "c", rank=0, world_size=1, every_minutes=1e-9, every_steps=3)
    other = CheckpointManager(tmp_path / "o", rank=1, world_size=2, every_minutes=1e-9)
    time.sleep(0.001)
    assert ckpt.timed_save_due(1) and not other.timed_save_due(1)
    assert not ckpt.timed_save_due(3)  # step 3 saves anyway: the clock starts again there
    hour = CheckpointManager(tmp_path / "h", rank=0, world_size=1, every_minutes=60)
    assert not any(hour.timed_save_due(s) for s in range(1, 5))


def test_the_loop_asks_the_checkpoint_once_per_step() -> None:
    """The loop's every save goes through one ``should_save`` decision (was: ``ckpt.due``, the trainer's timed-save
    clock, ``stop_flag.checkpoint_due`` and the post-loop final-save rule, four places). The loop asks its one
    checkpoint collaborator three things and writes none of its fields: the timed requests for the stop agreement,
    the fence before the optimizer step, and the after-step save of either tier (which holds the one decision)."""
    import ast
    import inspect
    import textwrap

    from hpcdist.checkpoint.checkpointer import Checkpointer
    from hpcdist.trainer import Trainer

    loop = ast.parse(textwrap.dedent(inspect.getsource(Trainer._loop)))
    body = next(n for n in ast.walk(loop) if isinstance(n, ast.While))
    calls = [n.func for n in ast.walk(body) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    asked = [f.attr for f in calls if isinstance(f.value, ast.Attribute) and f.value.attr == "ckpt"]
    assert sorted(asked) == ["after_step", "fence", "requests"]
    named = {  # every member of the checkpoint the whole loop names, called or not
        n.attr
        for n in ast.walk(loop)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "ckpt"
    }
    assert named == {"after_step", "fence", "requests"}
    stores = [n for n in ast.walk(loop) if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign))]
    targets = [t for n in stores for t in (n.targets if isinstance(n, ast.Assign) else [n.target])]
    assert not [t for t in targets for a in ast.walk(t) if isinstance(a, ast.Attribute) and a.attr == "ckpt"]
    own = [f.attr for f in calls if isinstance(f.value, ast.Name) and f.value.id == "self"]  # e.g. _triage
    assert not [a for a in own if "save" in a or "checkpoint" in a]
    after = ast.parse(textwrap.dedent(inspect.getsource(Checkpointer.after_step)))
    decided = [n.func.attr for n in ast.walk(after) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    # the node-local tier asks the same owner, in the same place; prepare_staging makes the async save's buffers
    # once (it decides nothing about saves)
    assert sorted(a for a in decided if a.endswith("_due") or a.startswith("should")) == [
        "local_save_due",
        "should_save",
    ]
    assert "prepare_staging" in decided


def test_the_node_local_tier_saves_at_its_own_cadence_decided_by_the_same_owner(tmp_path: Path) -> None:
    """checkpoint.local.every_steps / every_minutes: ``local_save_due`` (never at a step saved already by either
    tier); rank 0's clock asks for the timed one like checkpoint.every_minutes."""
    ckpt = CheckpointManager(tmp_path / "c", rank=0, world_size=1, every_steps=4, local_every_steps=2)
    assert [s for s in range(1, 9) if ckpt.local_save_due(s)] == [2, 4, 6, 8]
    ckpt.saved_step, ckpt.local_saved_step = 4, 6
    assert not ckpt.local_save_due(4) and not ckpt.local_save_due(6) and ckpt.local_save_due(5, timed=True)
    timed = CheckpointManager(tmp_path / "t", rank=0, world_size=1, local_every_minutes=1e-9, local_every_steps=3)
    other = CheckpointManager(tmp_path / "o", rank=1, world_size=2, local_every_minutes=1e-9)
    time.sleep(0.001)
    assert timed.timed_local_save_due(1) and not other.timed_local_save_due(1)
    assert not timed.timed_local_save_due(3) and not timed.timed_save_due(1)  # the shared clock is another one


class _Clock:
    """A stand-in for the policy's perf_counter: the test moves time."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_auto_every_minutes_is_the_goodput_models_interval_from_measured_step_and_save(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """checkpoint.every_minutes=auto: 30 minutes until a shared save is measured; then rank 0's cadence checks (one
    per step) give the step time (plain intervals) and the save's stall (the interval holding it, less a step), and
    the interval becomes Daly's optimum for the job's MTBF, counted save start to save start."""
    clock = _Clock()
    monkeypatch.setattr(policy.time, "perf_counter", clock)
    p = SavePolicy(rank=0, every_steps=5, every_minutes="auto")
    p.expect_failures(node_mtbf_hours=5696, nodes=4)
    assert p.every_minutes == cadence.AUTO_DEFAULT_MINUTES
    for step in range(1, 7):
        clock.t += 10.0  # the step
        p.timed_save_due(step)
        if step == 5:  # every_steps saves it: 20 s of stall
            p.saving(5)
            clock.t += 20.0
    assert p.auto is not None and p.auto.step_s == 10.0 and p.auto.save_s == pytest.approx(20.0)
    mtbf = 5696 * 3600 / 4
    expected = cadence.every_minutes(cadence.optimal_interval(20.0, mtbf), 20.0)
    assert p.every_minutes == pytest.approx(expected) and 200 < expected < 300  # about 4 hours at 4 nodes
    p.local_saved_step = 6  # a node-local save's interval is neither a step nor a shared save
    clock.t += 50.0
    p.timed_save_due(7)
    assert p.auto.step_s == 10.0 and p.auto.save_s == pytest.approx(20.0)


def test_auto_every_minutes_without_an_mtbf_keeps_its_default_and_the_local_tier_lengthens_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clock = _Clock()
    monkeypatch.setattr(policy.time, "perf_counter", clock)

    def measured(p: SavePolicy) -> float:
        for step in range(1, 5):
            clock.t += 10.0
            p.timed_save_due(step)
            if step == 3:
                p.saving(3)
                clock.t += 20.0
        return p.every_minutes

    unknown = SavePolicy(rank=0, every_minutes="auto")
    with caplog.at_level("WARNING", logger="hpcdist"):
        unknown.expect_failures(node_mtbf_hours=None, nodes=4)
    assert "gives no hardware.node_mtbf_hours" in caplog.text
    assert measured(unknown) == cadence.AUTO_DEFAULT_MINUTES
    alone = SavePolicy(rank=0, every_minutes="auto")
    alone.expect_failures(node_mtbf_hours=100, nodes=64)
    tiered = SavePolicy(rank=0, every_minutes="auto")
    tiered.expect_failures(node_mtbf_hours=100, nodes=64, local_coverage=0.9)  # 10% of failures need the shared tier
    assert measured(tiered) == pytest.approx(measured(alone) * 10**0.5, rel=0.05)  # sqrt(2 C M): M x 10
    fixed = SavePolicy(rank=0, every_minutes=12)
    fixed.expect_failures(node_mtbf_hours=100, nodes=64)  # a number stays that number
    assert fixed.auto is None and fixed.every_minutes == 12.0
