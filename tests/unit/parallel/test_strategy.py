"""A Strategy is built whole: its constructor receives the optimizer builder and returns with the optimizer and LR
schedule set (they used to be assigned by the caller afterwards, except ZeRO's); the optimizer's hyper-parameters
are hpcdist.optim's business, the replica check hpcdist.parallel.replicas', not the seam's."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from hpcdist.config import OptimConfig
from hpcdist.models import ModelArgs
from hpcdist.models.llama import build_model
from hpcdist.optim import optim_hparams, optimizer_builder, set_optim_hparams
from hpcdist.parallel.base import Strategy
from hpcdist.parallel.ddp import DDPStrategy

PARALLEL = Path(__file__).resolve().parents[3] / "hpcdist" / "parallel"


def _ddp(steps: int = 10, **optim: float) -> DDPStrategy:
    model = build_model(ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=64, ffn_dim=64), device="cpu")
    return DDPStrategy(
        model,
        bucket_cap_mb=25,
        device=torch.device("cpu"),
        grad_accum=1,
        micro_batch_size=2,
        grad_clip=1.0,
        autocast_dtype=None,
        dp_group=None,
        build_optimizer=optimizer_builder(OptimConfig(**optim), steps),
    )


def test_the_constructor_returns_a_strategy_with_its_optimizer() -> None:
    s = _ddp(lr=1e-3, warmup_steps=2)
    assert s.scheduler.optimizer is s.optimizer
    assert {id(p) for g in s.optimizer.param_groups for p in g["params"]} == {id(p) for p in s.model.parameters()}
    s.forward_backward(torch.randint(0, 64, (2, 9)))
    s.optimizer_step()
    assert s.lr == pytest.approx(1e-3)  # warmup step 2 of 2: the peak


def test_every_strategy_attaches_its_optimizer_in_its_constructor() -> None:
    """Each Strategy subclass in hpcdist/parallel calls ``_attach_optimizer`` from its own ``__init__``."""
    found = {}
    for path in sorted(PARALLEL.glob("*.py")):
        for cls in ast.walk(ast.parse(path.read_text())):
            if isinstance(cls, ast.ClassDef) and any(getattr(b, "id", None) == "Strategy" for b in cls.bases):
                init = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
                calls = [
                    c.func.attr for c in ast.walk(init) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                ]
                found[cls.name] = "_attach_optimizer" in calls
    assert found == {"DDPStrategy": True, "MeshStrategy": True, "ZeroStrategy": True}
    assert not hasattr(Strategy, "set_optim_hparams") and not hasattr(Strategy, "replica_checksums")


def test_changed_hyperparameters_apply_and_the_schedule_keeps_its_step() -> None:
    s = _ddp(lr=1e-3, warmup_steps=4)
    for _ in range(2):
        s.forward_backward(torch.randint(0, 64, (2, 9)))
        s.optimizer_step()
    factor = s.lr / 1e-3  # 3 / 4 of the warmup
    set_optim_hparams(s.optimizer, s.scheduler, lr=2e-3, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.2)
    assert optim_hparams(s.optimizer, s.scheduler) == {
        "optim.lr": 2e-3,
        "optim.beta1": 0.8,
        "optim.beta2": 0.9,
        "optim.eps": 1e-6,
        "optim.weight_decay": 0.2,
    }
    assert s.lr == pytest.approx(2e-3 * factor)
    assert s.optimizer.param_groups[1]["weight_decay"] == 0.0  # never the norms
