"""train.dtype=fp16: dynamic loss scaling (hpcdist.parallel.parallelize.grad_scaler), one process on CPU (torch 2.13
runs fp16 autocast on CPU, ~30x slower than fp32 for matmuls: fine for the tiny model)."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from hpcdist.config import ConfigError
from hpcdist.parallel.zero import deepspeed_config
from hpcdist.trainer import Trainer
from tests.dist.harness import single
from tests.training import train

OVERFLOW = "HPCDIST_TEST_FP16_OVERFLOW_AT"


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _fp16_compute(trainer: Trainer) -> None:
    assert trainer.strategy.autocast_dtype is torch.float16  # fp16 compute, not fp32 with a scaler


def _scaler_and_params(trainer: Trainer, _: object) -> dict[str, Any]:
    params = {n: p.detach().clone() for n, p in trainer.strategy.module.named_parameters()}
    return {"scaler": trainer.strategy.scaler_state(), "params": params}


_train_fp16 = partial(train, before=_fp16_compute, after=_scaler_and_params)


def test_fp16_overflow_is_a_scaler_skip_and_resume_is_exact(small_cfg, tmp_path: Path, monkeypatch) -> None:
    """An injected overflow at step 1 is skipped by the scaler (scale halved, counted in metrics and the log line,
    no non-finite stop under the default train.nonfinite=stop); a run stopped after step 2 (one clean step into the
    growth interval) and resumed ends bitwise where the straight run does, scaler state included."""
    over = ("train.dtype=fp16", "train.steps=4", "train.micro_batch_size=4", "checkpoint.every_steps=0")
    monkeypatch.setenv(OVERFLOW, "1")
    straight = single(_train_fp16, small_cfg(*over, run_dir=tmp_path / "straight"))
    cfg = small_cfg(*over, run_dir=tmp_path / "split")
    first = single(_train_fp16, cfg, 2)
    monkeypatch.delenv(OVERFLOW)  # the resumed process's own step 1 is step 3: no injection there
    state = json.loads(next((tmp_path / "split" / "checkpoints").glob("step-00000002/trainer_state.json")).read_text())
    assert state["grad_scaler"] == {"scale": 32768.0, "growth_tracker": 1, "overflow_steps": 1}
    second = single(_train_fp16, cfg)

    assert straight["scaler"] == {"scale": 32768.0, "growth_tracker": 3, "overflow_steps": 1}
    assert second["scaler"] == straight["scaler"]
    assert {**first["losses"], **second["losses"]} == straight["losses"]
    for name, p in straight["params"].items():
        assert torch.equal(second["params"][name], p), name
    rows = _metrics(tmp_path / "straight")
    assert [r["scaler_skips"] for r in rows if "scaler_skips" in r] == [1.0, 1.0, 1.0, 1.0]
    assert [r["loss_scale"] for r in rows if "loss_scale" in r] == [32768.0] * 4


def test_the_skipped_step_leaves_the_weights_and_the_schedule(small_cfg, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(OVERFLOW, "1")
    cfg = small_cfg(
        "train.dtype=fp16",
        "train.steps=1",
        "train.micro_batch_size=4",
        "checkpoint.every_steps=0",
        "checkpoint.save_final=false",
    )

    def run(env: Any, c: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float, float]:
        trainer = Trainer(c, env)
        before = {n: p.detach().clone() for n, p in trainer.strategy.module.named_parameters()}
        lr = trainer.strategy.lr
        trainer.train()
        after = {n: p.detach().clone() for n, p in trainer.strategy.module.named_parameters()}
        return before, after, lr, trainer.strategy.lr

    before, after, lr0, lr1 = single(run, cfg)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert lr0 == lr1


def test_fp16_line_shows_the_skips() -> None:
    from hpcdist.metrics.logger import format_line

    assert "skips 2 (scale 1.64e+04)" in format_line(3, 9, {"loss": 1.0, "scaler_skips": 2.0, "loss_scale": 16384.0})


def test_fp16_refused_with_tp_pp_and_zero_on_cpu(small_cfg) -> None:
    with pytest.raises(ConfigError, match=r"train\.dtype=fp16 with parallel\.tp > 1 or parallel\.pp > 1"):
        small_cfg("train.dtype=fp16", "parallel.strategy=3d", "parallel.pp=2")
    with pytest.raises(ConfigError, match=r"train\.nonfinite_triage with train\.dtype=fp16"):
        small_cfg("train.dtype=fp16", "train.nonfinite_triage=true")
    cfg = small_cfg("train.dtype=fp16", "parallel.strategy=zero", "parallel.zero.stage=2")
    with pytest.raises(ConfigError, match=r"train\.dtype=fp16 with parallel\.strategy=zero needs GPUs"):
        single(lambda env, c: Trainer(c, env), cfg)


def test_deepspeed_fp16_mode_is_dynamic_loss_scaling() -> None:
    common: dict[str, Any] = {
        "stage": 3,
        "micro_batch_size": 1,
        "grad_accum": 1,
        "dp_size": 2,
        "grad_clip": 1.0,
        "bf16": False,
        "offload_optimizer": False,
        "offload_params": False,
        "overlap_comm": True,
        "buckets": (1, 1),
    }
    assert "fp16" not in deepspeed_config(**common)
    fp16 = deepspeed_config(**common, fp16=True)["fp16"]
    assert fp16["enabled"] and fp16["loss_scale"] == 0 and fp16["initial_scale_power"] == 16


def _ds_scaler() -> Any:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    return DynamicLossScaler(
        init_scale=2.0**16, scale_window=3, min_scale=1, delayed_shift=2, consecutive_hysteresis=False
    )


def _ds_fields(scaler: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(scaler).items() if k != "dtype"}


def test_deepspeed_loss_scaler_state_round_trips_exactly(monkeypatch) -> None:
    """ZeRO's fp16 resume: a real DeepSpeed DynamicLossScaler stepped through overflows (hysteresis 2, window 3),
    saved through JSON as trainer_state.json holds it and loaded into a fresh scaler built from the same config:
    every field equal, and the two then scale the same over further overflows and growths."""
    import deepspeed.runtime.fp16.loss_scaler as ds_ls

    from hpcdist.parallel.zero import load_loss_scaler_state, loss_scaler_state

    monkeypatch.setattr(ds_ls.dist, "get_rank", lambda: 0)  # its overflow log line asks for the rank: one process
    pattern = [False, True, False, True, True, False, False, False, False, True, False]
    saved = _ds_scaler()
    for overflow in pattern:
        saved.update_scale(overflow)
    assert saved.cur_scale == 2.0**15 and saved.cur_hysteresis == 1 and saved.last_overflow_iter == 9
    state = json.loads(json.dumps(loss_scaler_state(saved)))
    resumed = _ds_scaler()
    assert _ds_fields(resumed) != _ds_fields(saved)  # a fresh scaler is not already where the saved one is
    load_loss_scaler_state(resumed, state)
    assert _ds_fields(resumed) == _ds_fields(saved)
    for overflow in [False] * 4 + [True, True, False]:
        saved.update_scale(overflow)
        resumed.update_scale(overflow)
        assert _ds_fields(resumed) == _ds_fields(saved)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("scale", "65536", "grad_scaler.scale must be a finite number"),
        ("scale", float("inf"), "grad_scaler.scale must be a finite number"),
        ("scale", 0.5, "grad_scaler.scale must be a finite number >= the minimum loss scale 1"),
        ("iter", -1, "grad_scaler.iter must be a non-negative integer"),
        ("iter", True, "grad_scaler.iter must be a non-negative integer"),
        ("last_overflow_iter", 7, r"grad_scaler.last_overflow_iter must be an integer in \[-1, iter=7\)"),
        ("last_overflow_iter", -2, "grad_scaler.last_overflow_iter must be an integer"),
        ("hysteresis", 3, r"grad_scaler.hysteresis must be an integer in \[1, 2\]"),
        ("hysteresis", 0, "grad_scaler.hysteresis must be an integer"),
        ("hysteresis", 1.0, "grad_scaler.hysteresis must be an integer"),
    ],
)
def test_deepspeed_loss_scaler_state_is_validated_before_any_is_set(key: str, value: Any, message: str) -> None:
    from hpcdist.parallel.zero import load_loss_scaler_state

    scaler = _ds_scaler()
    before = _ds_fields(scaler)
    state = {"scale": 1024.0, "iter": 7, "last_overflow_iter": 4, "hysteresis": 1, key: value}
    with pytest.raises(ValueError, match=message):
        load_loss_scaler_state(scaler, state)
    assert _ds_fields(scaler) == before


def test_loss_scales_cross_between_torch_and_deepspeed_checkpoints(small_cfg, tmp_path: Path) -> None:
    """A ddp fp16 checkpoint's GradScaler state into DeepSpeed's scaler and back: the scale carries over, the growth
    interval starts afresh (the two count clean steps differently), nothing is refused."""
    from hpcdist.parallel.zero import load_loss_scaler_state, loss_scaler_state

    ds = _ds_scaler()
    load_loss_scaler_state(ds, {"scale": 512.0, "growth_tracker": 17, "overflow_steps": 3})
    assert ds.cur_scale == 512.0 and ds.cur_iter == 0 and ds.last_overflow_iter == -1
    trainer = single(lambda env, c: Trainer(c, env), small_cfg("train.dtype=fp16", run_dir=tmp_path / "ddp"))
    trainer.strategy.load_scaler_state({**loss_scaler_state(ds), "overflow_steps": 3})
    assert trainer.strategy.scaler_state() == {"scale": 512.0, "growth_tracker": 0, "overflow_steps": 3}
