"""DDP on real gloo ranks equals one process on the same global batch; resume is exact."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch

from hpcdist.checkpoint.names import MARKER, list_checkpoints
from tests.conftest import small_config
from tests.dist.harness import run_ranks, single
from tests.training import train, train_with_drift

pytestmark = pytest.mark.dist

_train_params = partial(train, params=True)  # and the whole weights

STEPS = 10
# fp32 on CPU: 1 rank vs 2 ranks differ only in summation order (DDP's all-reduce, per-rank means), so losses
# agree to float32 round-off compounded over 10 Adam steps; 1e-5 relative is ~100x that round-off.
RTOL = 1e-5


def _losses(out: dict) -> list[float]:
    return [out["losses"][s] for s in sorted(out["losses"])]


@pytest.fixture(scope="module")
def reference(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One process, global batch 8 in one micro-batch: the ground truth (trained once per module, only read)."""
    run_dir = tmp_path_factory.mktemp("ddp_ref") / "run"
    cfg = small_config(
        run_dir, corpus_dir, f"train.steps={STEPS}", "train.global_batch_size=8", "train.micro_batch_size=8"
    )
    return single(_train_params, cfg)


@pytest.mark.parametrize(
    ("world", "micro"),
    [(2, 4), (2, 2), (4, 2), (1, 2)],
    ids=["2ranks", "2ranks-accum2", "4ranks", "1rank-accum4"],
)
def test_ddp_matches_single_process(small_cfg, reference, tmp_path: Path, world: int, micro: int) -> None:
    cfg = small_cfg(
        f"train.steps={STEPS}",
        "train.global_batch_size=8",
        f"train.micro_batch_size={micro}",
        run_dir=tmp_path / f"w{world}",
    )
    outs = run_ranks(world, _train_params, cfg) if world > 1 else [single(_train_params, cfg)]
    ref = _losses(reference)
    assert len(ref) == STEPS and ref[-1] < ref[0]  # it learns, so equality below is not trivially constant
    for out in outs:  # every rank reports the same global loss
        torch.testing.assert_close(_losses(out), ref, rtol=RTOL, atol=0)
    # Adam divides by sqrt(v): for a weight whose gradient is ~0, round-off in the gradient moves the update by
    # up to ~lr * 1e-3, hence an absolute tolerance on parameters (still 100x below one step's typical change)
    for name, p in outs[0]["params"].items():
        torch.testing.assert_close(p, reference["params"][name], rtol=1e-4, atol=1e-5)


def test_exact_resume_two_ranks(small_cfg, tmp_path: Path) -> None:
    """2N steps straight == N steps, stop, resume to 2N: bitwise identical losses and parameters on CPU."""
    n = 4
    over = (f"train.steps={2 * n}", "train.global_batch_size=8", "train.micro_batch_size=2")
    straight = run_ranks(2, _train_params, small_cfg(*over, run_dir=tmp_path / "straight"))[0]

    split_cfg = small_cfg(*over, run_dir=tmp_path / "split")
    first = run_ranks(2, _train_params, split_cfg, n)[0]
    assert first["step"] == n and first["resumed"] is None
    assert [s for s, _ in list_checkpoints(split_cfg.checkpoint_dir)[0]] == [n]
    second = run_ranks(2, _train_params, split_cfg)[0]
    assert second["resumed"].endswith(f"step-{n:08d}") and second["step"] == 2 * n

    assert _losses(first) == _losses(straight)[:n]
    assert _losses(second) == _losses(straight)[n:]  # bitwise: == on floats, no tolerance
    for name, p in straight["params"].items():
        assert torch.equal(second["params"][name], p), name


def test_async_checkpoint_resume(small_cfg, tmp_path: Path) -> None:
    over = (
        "train.steps=6",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "checkpoint.async_save=true",
        "checkpoint.every_steps=2",
        "checkpoint.keep_last=2",
    )
    straight = run_ranks(2, _train_params, small_cfg(*over, run_dir=tmp_path / "a"))[0]
    cfg = small_cfg(*over, run_dir=tmp_path / "b")
    run_ranks(2, _train_params, cfg, 3)  # saves at 2 (async) and at the interruption at 3
    complete, incomplete = list_checkpoints(cfg.checkpoint_dir)
    assert [s for s, _ in complete] == [2, 3] and not incomplete
    assert json.loads((complete[-1][1] / MARKER).read_text())["world_size"] == 2
    resumed = run_ranks(2, _train_params, cfg)[0]
    assert _losses(resumed) == _losses(straight)[3:]
    # keep_last=2: after saves at 4 and 6 only those remain, deleted only once newer ones were complete
    assert [s for s, _ in list_checkpoints(cfg.checkpoint_dir)[0]] == [4, 6]


@pytest.mark.parametrize(
    "option",
    ["train.activation_checkpointing=true", "train.activation_checkpointing=selective", "train.dtype=bf16"],
)
def test_training_options_on_two_ranks(small_cfg, reference, tmp_path: Path, option: str) -> None:
    """Activation checkpointing, full or selective, recomputes the same math (fp32: equal to round-off); bf16 autocast
    trains too
    (its losses follow the fp32 run to bf16 precision)."""
    cfg = small_cfg(
        f"train.steps={STEPS}",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        option,
        run_dir=tmp_path / "opt",
    )
    out = run_ranks(2, _train_params, cfg)[0]
    rtol = RTOL if "checkpointing" in option else 3e-2
    torch.testing.assert_close(_losses(out), _losses(reference), rtol=rtol, atol=0)


def test_replica_check_names_a_diverged_rank(small_cfg, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    cfg = small_cfg(
        "train.steps=4",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "logging.replica_check_every_steps=1",
        run_dir=tmp_path / "drift",
    )
    divergence = run_ranks(2, train_with_drift, cfg, 1, 2)[0]
    assert divergence[1] == 0.0 and divergence[2] > 0.0  # identical replicas, then rank 1 drifted after step 2
    assert "rank(s) [1] differ from the majority" in capfd.readouterr().out
