"""The one training helper every tier shares: build a Trainer from (DistEnv, JobConfig), train, and return what the
tests compare, as a plain picklable dict (forked ranks send it back to the parent).

Variants are options, not copies: ``params=True`` adds the whole weights, ``before`` patches the built trainer (a
signal at a step, a slow data source, a drifting replica), ``after`` adds what one module alone reads from it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hpcdist.config import JobConfig
from hpcdist.env import DistEnv
from hpcdist.models import Transformer
from hpcdist.trainer import Trainer, TrainResult

# NaN triage on, one micro-batch per step, prefetching data (the triage re-runs a step on the inputs it had)
TRIAGE = ("train.nonfinite_triage=true", "train.global_batch_size=4", "train.micro_batch_size=4", "data.prefetch=2")


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """DTensor shards -> the whole tensor (a collective: every rank calls it in the same order); a copy."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def full_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Collective: the model's whole state_dict, sharded entries gathered."""
    return {k: full_tensor(v) for k, v in trainer.strategy.module.state_dict().items()}


def train(
    env: DistEnv,
    cfg: JobConfig,
    until: int | None = None,
    *,
    params: bool = False,
    before: Callable[[Trainer], None] | None = None,
    after: Callable[[Trainer, TrainResult], dict[str, Any]] | None = None,
    model: Transformer | None = None,
) -> dict[str, Any]:
    """Train ``Trainer(cfg, env)`` until step ``until`` (None: train.steps).

    Returns losses, eval (losses), step, resumed, reason, code; ``params`` adds the whole weights (a collective);
    ``before(trainer)`` runs once it is built; ``after(trainer, result)``'s dict is merged in (and wins) once it has
    trained; ``model``: the Trainer's meta model, built ahead (a warm spare's).
    """
    trainer = Trainer(cfg, env, model=model)
    if before is not None:
        before(trainer)
    result = trainer.train(until=until)
    out: dict[str, Any] = {
        "losses": result.losses,
        "eval": result.eval_losses,
        "step": result.step,
        "resumed": result.resumed_from,
        "reason": result.stop_reason,
        "code": result.exit_code,
    }
    if params:
        out["params"] = full_state(trainer)
    if after is not None:
        out.update(after(trainer, result))
    return out


def signal_at(rank: int, at_step: int, sig: int) -> Callable[[Trainer], None]:
    """A ``before`` hook: on ``rank``, deliver ``sig`` to this process in the middle of step ``at_step`` (after the
    backward). The handler only sets a flag; the step still completes."""

    def patch(trainer: Trainer) -> None:
        step_fn = trainer.strategy.optimizer_step

        def step_and_maybe_signal(**kw: Any) -> Any:
            if trainer.env.rank == rank and trainer.step + 1 == at_step:
                os.kill(os.getpid(), sig)
            return step_fn(**kw)

        trainer.strategy.optimizer_step = step_and_maybe_signal  # type: ignore[method-assign]

    return patch


def replica_divergence(run_dir: Path) -> dict[int, float | None]:
    """Each training step's replica_divergence from ``run_dir``'s metrics.jsonl (None where it was not checked)."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: m.get("replica_divergence") for m in lines if "split" not in m}


def train_with_drift(env: DistEnv, cfg: JobConfig, rank: int, after_step: int) -> dict[int, float | None]:
    """Train, perturbing one weight on ``rank`` after step ``after_step``'s optimizer step, behind the strategy's
    back (FSDP: this rank's shard): the replica check must name it. Each step's replica_divergence (None where it
    was not checked)."""

    def drift(trainer: Trainer) -> None:
        with torch.no_grad():
            p = next(trainer.strategy.module.parameters())
            (p.to_local() if hasattr(p, "to_local") else p).view(-1)[0] += 1e-3

    train(env, cfg, before=after_step_hook(rank, after_step, drift))
    lines = [json.loads(x) for x in (Path(cfg.run.dir) / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: m.get("replica_divergence") for m in lines if "split" not in m}


def after_step_hook(rank: int, step: int, action: Callable[[Trainer], None]) -> Callable[[Trainer], None]:
    """A ``before`` hook: on ``rank``, run ``action(trainer)`` right after the optimizer step of step ``step``."""

    def patch(trainer: Trainer) -> None:
        step_fn = trainer.strategy.optimizer_step

        def step_then_act(**kw: Any) -> Any:
            norm = step_fn(**kw)
            if trainer.env.rank == rank and trainer.step + 1 == step:
                action(trainer)
            return norm

        trainer.strategy.optimizer_step = step_then_act  # type: ignore[method-assign]

    return patch


def poison(trainer: Trainer, tokens: torch.Tensor) -> None:
    """Bad data: the embedding of any row whose input is exactly this sample's turns NaN (the same every time)."""
    emb = trainer.strategy.module.tok_embeddings

    def hook(_mod: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
        rows = (args[0] == tokens[: args[0].shape[1]].to(args[0].device)).all(dim=1)
        return torch.where(rows[:, None, None], torch.full_like(out, float("nan")), out)

    if emb is not None:  # a pipeline's first stage only
        emb.register_forward_hook(hook)
