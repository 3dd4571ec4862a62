"""3D parallelism (pp x dp x tp) on real gloo ranks equals one process on the same global batch, for every layout
and pipeline schedule; its DCP checkpoints resume exactly on the same layout and reshard to other layouts, one
rank and DDP, and the data order survives a layout change (every sample id seen exactly once)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from hpcdist import config as config_mod
from hpcdist.checkpoint.names import list_checkpoints
from hpcdist.config import JobConfig
from hpcdist.env import DistEnv
from hpcdist.trainer import Trainer
from tests.conftest import SMALL
from tests.dist.harness import run_ranks, single
from tests.training import full_state, train

pytestmark = pytest.mark.dist

# past the 2 warmup steps at the full learning rate, an eval (step 2) between training steps
STEPS = 3
# fp32 on CPU: a layout differs from one process only in summation order (TP partial sums, reduce-scatters,
# micro-batch means); measured max relative loss difference over 5 Adam steps ~2e-7 for every layout and schedule.
# 1e-5 leaves ~50x margin and still catches any real error (a wrong scale, a skipped micro-batch: >= 1e-3).
RTOL = 1e-5
SELECTIVE_RTOL = 1e-6
# 4 layers: Interleaved / V schedules put 2 stages on each of pp=2 ranks, one block per stage at least
BASE = ("model.n_layers=4", "train.global_batch_size=8", "data.val_fraction=0.05", "train.eval_batches=1")
THREE_D = "parallel.strategy=3d"
EVAL = "train.eval_every_steps=2"  # step 2: training goes on after a forward-only pipeline step
NO_EVAL = "train.eval_every_steps=0"


def _train_recorded(env: DistEnv, cfg: JobConfig, until: int | None = None) -> dict:
    """train (the stage's params gathered over its dp x tp ranks), with each step's grad norm and sample ids."""
    norms: list[float] = []
    ids: dict[int, list[int]] = {}

    def record(trainer: Trainer) -> None:
        step_fn, next_batch = trainer.strategy.optimizer_step, trainer.loader.next_batch

        def record_norm(**kw: bool) -> torch.Tensor:
            norm = step_fn(**kw)
            norms.append(float(norm))
            return norm

        def record_ids() -> torch.Tensor:
            batch = next_batch()
            ids[trainer.step + 1] = trainer.loader.last_indices()
            return batch

        trainer.strategy.optimizer_step, trainer.loader.next_batch = record_norm, record_ids  # type: ignore[method-assign]

    def layout(trainer: Trainer, _: object) -> dict:
        return {"norms": norms, "ids": ids, "dp_rank": trainer.dp_rank, "dp": trainer.dims.dp}

    return train(env, cfg, until, params=True, before=record, after=layout)


def _init(env: DistEnv, cfg: JobConfig) -> dict[str, torch.Tensor]:
    return full_state(Trainer(cfg, env))


def _losses(out: dict) -> list[float]:
    return [out["losses"][s] for s in sorted(out["losses"])]


def _params(outs: list[dict]) -> dict[str, torch.Tensor]:
    """The whole model from the ranks' stages (each pipeline stage returns its own FQNs)."""
    merged: dict[str, torch.Tensor] = {}
    for out in outs:
        for name, p in out["params"].items():
            if name in merged:  # dp / tp peers of a stage gathered the same full tensor
                assert torch.equal(merged[name], p), name
            merged[name] = p
    return merged


def _layout(world: int, pp: int, dp: int, tp: int, *extra: str) -> tuple[int, tuple[str, ...]]:
    return world, (THREE_D, f"parallel.pp={pp}", f"parallel.dp={dp}", f"parallel.tp={tp}", *extra)


@pytest.fixture(scope="module")
def reference(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One process with DDP's path, the global batch of 8 in one micro-batch: the ground truth (built once)."""
    run_dir = tmp_path_factory.mktemp("reference")
    over = (f"train.steps={STEPS}", *BASE, "train.micro_batch_size=8", EVAL)
    base = [*SMALL, f"run.dir={run_dir}", "data.source=files", f"data.path={corpus_dir}"]
    return single(_train_recorded, config_mod.load(None, [*base, *over]))


def _check_equal(outs: list[dict], reference: dict, *, rtol: float = RTOL, norm_rtol: float = RTOL) -> None:
    ref = _losses(reference)
    assert len(ref) == STEPS and ref[-1] < ref[0]  # it learns, so equality is not trivially a constant
    for out in outs:  # every rank (every stage, every tp / dp peer) reports the same global loss and norm
        torch.testing.assert_close(_losses(out), ref, rtol=rtol, atol=0)
        torch.testing.assert_close(out["norms"], reference["norms"], rtol=norm_rtol, atol=0)
        if out["eval"]:  # V schedules cannot evaluate (config validation says so)
            torch.testing.assert_close(out["eval"], reference["eval"], rtol=rtol, atol=0)
    if rtol <= RTOL:  # parameters as in test_fsdp: Adam amplifies round-off for weights whose gradient is ~0
        params = _params(outs)
        assert params.keys() == reference["params"].keys()
        for name, p in params.items():
            torch.testing.assert_close(p, reference["params"][name], rtol=1e-4, atol=1e-5)


# Each layout with at least one schedule; each of GPipe, 1F1B, Interleaved1F1B on pp=2 and on pp=2 x dp=2 x tp=2.
# train.micro_batch_size sets the micro-batches per step: 8 / (micro x dp).
LAYOUTS = {
    "tp2": (*_layout(2, 1, 1, 2), "train.micro_batch_size=4"),  # no pp: 2 accumulated micro-batches
    "pp2-gpipe": (*_layout(2, 2, 1, 1, "parallel.pp_schedule=GPipe"), "train.micro_batch_size=2"),
    "pp2-1f1b": (*_layout(2, 2, 1, 1, "parallel.pp_schedule=1F1B"), "train.micro_batch_size=2"),
    "pp2-interleaved": (*_layout(2, 2, 1, 1, "parallel.pp_schedule=Interleaved1F1B"), "train.micro_batch_size=2"),
    "pp2-tp2-1f1b": (*_layout(4, 2, 1, 2, "parallel.pp_schedule=1F1B"), "train.micro_batch_size=4"),
    "pp2-dp2-gpipe": (*_layout(4, 2, 2, 1, "parallel.pp_schedule=GPipe"), "train.micro_batch_size=1"),
    "dp2-tp2": (*_layout(4, 1, 2, 2), "train.micro_batch_size=2"),
    "3d-gpipe": (*_layout(8, 2, 2, 2, "parallel.pp_schedule=GPipe"), "train.micro_batch_size=1"),
    "3d-1f1b": (*_layout(8, 2, 2, 2, "parallel.pp_schedule=1F1B"), "train.micro_batch_size=2"),
    # with activation checkpointing: the house order TP -> AC -> FSDP per stage. Selective's recompute re-runs tensor
    # parallelism's functional collectives (all-gathers, wo's reduce-scatter, their wait_tensor) outside torch's
    # caching modes (hpcdist.parallel.parallelize._save_ops_only); held to SELECTIVE_RTOL (measured: 1.0e-7)
    "3d-interleaved-ac": (
        *_layout(8, 2, 2, 2, "parallel.pp_schedule=Interleaved1F1B", "train.activation_checkpointing=full"),
        "train.micro_batch_size=1",
    ),
    "pp2-tp2-interleaved-sel": (
        *_layout(4, 2, 1, 2, "parallel.pp_schedule=Interleaved1F1B", "train.activation_checkpointing=selective"),
        "train.micro_batch_size=2",
    ),
    "dp2-tp2-sel": (*_layout(4, 1, 2, 2, "train.activation_checkpointing=selective"), "train.micro_batch_size=2"),
    # the other schedules torch ships, on the cheapest layout
    "pp2-loopedbfs": (*_layout(2, 2, 1, 1, "parallel.pp_schedule=LoopedBFS"), "train.micro_batch_size=2"),
    "pp2-zb": (*_layout(2, 2, 1, 1, "parallel.pp_schedule=InterleavedZeroBubble"), "train.micro_batch_size=2"),
    "pp2-zbv": (*_layout(2, 2, 1, 1, "parallel.pp_schedule=ZBVZeroBubble", NO_EVAL), "train.micro_batch_size=2"),
    "pp2-dualpipev": (*_layout(2, 2, 1, 1, "parallel.pp_schedule=DualPipeV", NO_EVAL), "train.micro_batch_size=2"),
    # HSDP on dp (2 replicas x 2 shards) under pp, with the replica check on every step
    "pp2-hsdp2x2": (
        *_layout(8, 2, 4, 1, "parallel.fsdp.replicate=2", "logging.replica_check_every_steps=1"),
        "train.micro_batch_size=1",
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_3d_matches_single_process(small_cfg, reference, tmp_path: Path, layout: str) -> None:
    world, over, micro = LAYOUTS[layout]
    cfg = small_cfg(f"train.steps={STEPS}", *BASE, micro, EVAL, *over, run_dir=tmp_path / "run")
    outs = run_ranks(world, _train_recorded, cfg)
    # the acceptance for selective checkpointing: losses within 1e-6 of the reference (fp32)
    _check_equal(outs, reference, rtol=SELECTIVE_RTOL if "activation_checkpointing=selective" in over else RTOL)
    if "replica_check" in " ".join(over):  # HSDP: the replicas of each shard stayed bitwise identical
        lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [m["replica_divergence"] for m in lines if "replica_divergence" in m] == [0.0] * STEPS


def test_bf16_parameters_follow_fp32(small_cfg, reference, tmp_path: Path) -> None:
    """FSDP's bf16 MixedPrecisionPolicy under pp x dp x tp: bf16 activations cross the stages; losses follow the
    fp32 run to bf16 precision."""
    world, over = _layout(8, 2, 2, 2, "parallel.fsdp.param_dtype=bf16")
    cfg = small_cfg(
        f"train.steps={STEPS}",
        *BASE,
        "train.micro_batch_size=2",
        EVAL,
        *over,
        run_dir=tmp_path / "bf16",
    )
    # measured: losses 2.2e-4, gradient norms (bf16 gradients) 2.7e-2
    _check_equal(run_ranks(world, _train_recorded, cfg), reference, rtol=5e-3, norm_rtol=0.1)


def test_init_equals_single_process(small_cfg, tmp_path: Path) -> None:
    """Every shard of every stage holds exactly the single-process init of the same seed (bitwise)."""
    over = (*BASE, "train.micro_batch_size=2")
    ref = single(_init, small_cfg(*over, run_dir=tmp_path / "ref"))
    world, layout = _layout(8, 2, 2, 2, "parallel.pp_schedule=Interleaved1F1B")
    full = _params([{"params": p} for p in run_ranks(world, _init, small_cfg(*over, *layout, run_dir=tmp_path / "3d"))])
    assert full.keys() == ref.keys()
    for name, p in ref.items():
        assert torch.equal(full[name], p), name


def _ids_per_step(outs: list[dict]) -> dict[int, list[int]]:
    """Global sample ids of each step: the dp ranks' slices in dp order; tp / pp peers must read the same slice."""
    by_step: dict[int, dict[int, list[int]]] = {}
    for out in outs:
        for step, ids in out["ids"].items():
            seen = by_step.setdefault(step, {})
            assert seen.setdefault(out["dp_rank"], ids) == ids, f"step {step}: peers of dp rank read different data"
    for step, slices in by_step.items():
        assert sorted(slices) == list(range(outs[0]["dp"])), step
    return {step: [i for r in sorted(slices) for i in slices[r]] for step, slices in by_step.items()}


def test_checkpoint_resumes_exactly_and_reshards(small_cfg, tmp_path: Path) -> None:
    """A checkpoint saved at (pp=2, dp=2, tp=2) after N steps resumes
    - on the same layout: the next N steps are bitwise those of an uninterrupted run;
    - at (pp=1, dp=4, tp=2), (pp=2, dp=1, tp=1), on one rank (3d) and under DDP: losses and final parameters equal
      the uninterrupted run's within round-off, and across the layout change every sample id of the 2N global
      batches is read exactly once, in the uninterrupted run's order."""
    n = 2  # a checkpoint after warmup and two steps past it: the same save, reshard and data-order paths as 3
    over = (f"train.steps={2 * n}", *BASE, "train.micro_batch_size=1")
    # interleaved: two stages per rank, so the checkpoint comes from the multi-stage view (model_view)
    world, saved_at = _layout(8, 2, 2, 2, "parallel.pp_schedule=Interleaved1F1B")
    straight = run_ranks(world, _train_recorded, small_cfg(*over, *saved_at, run_dir=tmp_path / "straight"))
    run_dir = tmp_path / "split"
    cfg = small_cfg(*over, *saved_at, run_dir=run_dir)
    first = run_ranks(world, _train_recorded, cfg, n)
    assert first[0]["step"] == n and [s for s, _ in list_checkpoints(cfg.checkpoint_dir)[0]] == [n]
    straight_ids = _ids_per_step(straight)
    assert _ids_per_step(first) == {s: straight_ids[s] for s in range(1, n + 1)}
    straight_params = _params(straight)

    # same layout: bitwise (== on floats, torch.equal on tensors)
    again = run_ranks(world, _train_recorded, cfg)
    assert again[0]["resumed"].endswith(f"step-{n:08d}") and again[0]["step"] == 2 * n
    assert all(_losses(o) == _losses(straight[0])[n:] for o in again)
    resumed_params = _params(again)
    for name, p in straight_params.items():
        assert torch.equal(resumed_params[name], p), name

    # other layouts (the checkpoint dir is untouched: the resumed runs save nothing, so each starts from step n)
    others = {
        "pp1-dp4-tp2": _layout(8, 1, 4, 2),
        # 2 ranks, not 8 (pp=2, dp=4, tp=1 before): the same reshard to a tp-less pipeline of another schedule and
        # another dp, for a quarter of the processes (each costs ~3 CPU-s of imports on the suite's 2 cores)
        "pp2-dp1-tp1": _layout(2, 2, 1, 1, "parallel.pp_schedule=GPipe"),
        "one-rank-3d": _layout(1, 1, 1, 1),
        "one-rank-ddp": (1, ()),
    }
    for name, (w, layout) in others.items():
        resume_cfg = small_cfg(*over, *layout, run_dir=run_dir)
        outs = run_ranks(w, _train_recorded, resume_cfg) if w > 1 else [single(_train_recorded, resume_cfg)]
        assert outs[0]["resumed"].endswith(f"step-{n:08d}"), name
        for out in outs:
            torch.testing.assert_close(_losses(out), _losses(straight[0])[n:], rtol=RTOL, atol=0, msg=name)
        params = _params(outs)
        assert params.keys() == straight_params.keys(), name
        for fqn, p in params.items():
            torch.testing.assert_close(p, straight_params[fqn], rtol=1e-4, atol=1e-5, msg=f"{name}: {fqn}")
        # the data: steps 1..n at dp=2, steps n+1..2n at this layout's dp; together every sample exactly once
        ids = {**_ids_per_step(first), **_ids_per_step(outs)}
        assert ids == straight_ids, name
        counts = Counter(i for step_ids in ids.values() for i in step_ids)
        assert len(counts) == 2 * n * 8 and set(counts.values()) == {1}, name
