"""A NaN/Inf gradient norm: stop before any checkpoint of that state, or skip the update, naming the
step. An LR of 1e20 turns every parameter NaN in the first update, so step 2 is the first bad step, every time."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpcdist.checkpoint.names import list_checkpoints
from hpcdist.config import ConfigError
from hpcdist.fault.nonfinite import NonFiniteError
from tests.conftest import REPO, SMALL
from tests.dist.harness import single
from tests.training import train

BLOW_UP = ("train.steps=6", "optim.lr=1e20", "optim.warmup_steps=0", "optim.grad_clip=0", "train.micro_batch_size=4")


def _open_files() -> set[Path]:
    """The files this process has open (/proc/self/fd)."""
    paths = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own fd is gone by now
            paths.add(Path(os.readlink(f"/proc/self/fd/{fd}")))
    return paths


def test_stop_names_the_step_and_never_checkpoints_it(small_cfg) -> None:
    cfg = small_cfg(*BLOW_UP, "checkpoint.every_steps=1", "checkpoint.keep_last=1", "logging.every_steps=3")
    with pytest.raises(NonFiniteError, match=r"^step 2: the gradient norm was NaN/Inf") as err:
        single(train, cfg)
    assert "step-00000001, is finite" in str(err.value)
    complete, incomplete = list_checkpoints(cfg.checkpoint_dir)
    # step 2 went bad: steps 2 and 3 (when the log line noticed) were never saved, and step 1 was not pruned
    assert [s for s, _ in complete] == [1] and not incomplete
    state = torch.load(complete[0][1] / "rng" / "rank-00000.pt", weights_only=True)
    assert state  # the checkpoint is whole
    lines = (Path(cfg.run.dir) / "metrics.jsonl").read_text().splitlines()
    norms = [json.loads(line).get("grad_norm") for line in lines]
    assert norms[:1] and norms[0] is not None  # step 1's norm was finite
    # the raising Trainer closed its sinks: `err` keeps its frames (and the Trainer) alive, as any caller that holds
    # the error does; before, metrics.jsonl stayed open (and TensorBoard's writer thread ran) until garbage collection
    assert (Path(cfg.run.dir) / "metrics.jsonl").resolve() not in _open_files(), "metrics.jsonl left open"


def test_skip_drops_updates_and_stops_after_too_many_in_a_row(small_cfg) -> None:
    cfg = small_cfg(*BLOW_UP, "train.nonfinite=skip", "train.max_nonfinite_skips=3")
    with pytest.raises(NonFiniteError, match=r"^step 5: 4 updates in a row were non-finite and skipped"):
        single(train, cfg)
    lines = (Path(cfg.run.dir) / "metrics.jsonl").read_text().splitlines()
    skips = [json.loads(line).get("nonfinite_skips") for line in lines]
    assert skips[:4] == [0.0, 1.0, 2.0, 3.0]


def test_a_model_that_overflowed_with_a_finite_norm_is_not_saved(small_cfg) -> None:
    """Step 1's update has a finite norm but overflows the weights (an LR past float32's range): the parameters are
    checked before every save."""
    cfg = small_cfg(*BLOW_UP, "optim.lr=1e39", "train.nonfinite=skip", "checkpoint.every_steps=1")
    with pytest.raises(NonFiniteError, match=r"^step 1: the model's parameters are NaN/Inf"):
        single(train, cfg)
    assert list_checkpoints(cfg.checkpoint_dir) == ([], [])


def test_skip_is_refused_with_zero(small_cfg) -> None:
    with pytest.raises(ConfigError, match=r"train\.nonfinite=skip: DeepSpeed applies the update"):
        small_cfg("parallel.strategy=zero", "train.nonfinite=skip")
    with pytest.raises(ConfigError, match=r"train\.nonfinite: .*stop, skip"):
        small_cfg("train.nonfinite=ignore")


def test_the_cli_says_it_once_and_exits_1(tmp_path: Path, corpus_dir: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "hpcdist",
        "train",
        "configs/demo.yaml",
        *SMALL,
        *BLOW_UP,
        "data.source=files",
        f"data.path={corpus_dir}",
        f"run.dir={tmp_path / 'run'}",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "hpcdist: step 2: the gradient norm was NaN/Inf" in proc.stderr and "Traceback" not in proc.stderr
    assert "done:" not in proc.stdout


def test_the_model_verdict_needs_the_models_evidence() -> None:
    """NaN triage's model verdict (hpcdist.fault.triage): the parameters, a finite forward with a non-finite
    backward, or every sample bad on its own; one bad sample of several stays the data's."""
    from hpcdist.fault.triage import _LOSS2, _PARAMS, _model_cause, _param_peak

    assert "parameters themselves" in _model_cause([_LOSS2, _LOSS2 | _PARAMS], [1], [1, 2, 3, 4])
    assert "only the gradients" in _model_cause([0, 0], [], [1, 2, 3, 4])
    assert "all 4 samples" in _model_cause([_LOSS2, 0], [1, 2, 3, 4], [1, 2, 3, 4])
    assert _model_cause([_LOSS2, 0], [3], [1, 2, 3, 4]) == ""  # one bad row: the data
    assert _model_cause([_LOSS2], [7], [7]) == ""  # a batch of one: its sample, unless the parameters say otherwise
    assert _param_peak([torch.tensor([1.0, -3.0])]) == 3.0
    assert _param_peak([torch.tensor([1.0, float("nan")])]) == float("inf")
