"""DeepSpeed ZeRO 1/2/3 on real gloo ranks equals one process (DDP path) on the same global batch."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from hpcdist.config import ConfigError, JobConfig
from hpcdist.env import DistEnv
from hpcdist.parallel.zero import deepspeed_config
from hpcdist.trainer import Trainer, TrainResult
from tests.conftest import small_config
from tests.dist.harness import run_ranks, single
from tests.training import train

pytestmark = pytest.mark.dist

STEPS = 10
RTOL = 1e-5  # fp32 on CPU: only the summation order differs from the single-process reference
NO_CKPT = ("checkpoint.every_steps=0", "checkpoint.save_final=false", "checkpoint.resume=none")


def _full_weights(strategy: Any) -> dict[str, torch.Tensor]:
    """Collective: the whole fp32 weights, keyed by FQN (ZeRO: the master, gathered only for the test)."""
    if not hasattr(strategy, "ds_optimizer"):
        return {k: v.detach().clone() for k, v in get_model_state_dict(strategy.module).items()}
    from deepspeed.utils import safe_get_full_fp32_param

    return {
        n: safe_get_full_fp32_param(p).detach().clone().reshape(getattr(p, "ds_shape", p.shape))
        for n, p in strategy.module.named_parameters()
    }


def _trained(env: DistEnv, cfg: JobConfig, until: int | None = None) -> dict:
    return train(env, cfg, until, after=lambda trainer, _: {"model": _full_weights(trainer.strategy)})


def _metrics(run_dir: Path, key: str) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r]


def _losses(out: dict) -> list[float]:
    return [out["losses"][s] for s in sorted(out["losses"])]


@pytest.fixture(scope="module")
def ref(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The single-process reference, trained once per module: the ZeRO variants compare with it, none changes it
    (it was retrained for each)."""
    run_dir = tmp_path_factory.mktemp("zero_ref") / "run"
    cfg = small_config(
        run_dir, corpus_dir, f"train.steps={STEPS}", "train.global_batch_size=8", "train.micro_batch_size=8"
    )
    return {**single(_trained, cfg), "run_dir": Path(cfg.run.dir)}


# Every stage once, then what changes each stage's code path: gradient accumulation (stage 1 and 2 share DeepSpeed's
# stage_1_and_2 optimizer, stage 3 has its own) and a wider partition (4 ranks) on the stage that partitions the most.
LAYOUTS = [(1, 2, 4), (2, 2, 4), (3, 2, 4), (2, 2, 2), (3, 2, 2), (3, 4, 2)]


@pytest.mark.parametrize(
    ("stage", "world", "micro"), LAYOUTS, ids=["2ranks-1", "2ranks-2", "2ranks-3", "accum2-2", "accum2-3", "4ranks-3"]
)
def test_zero_matches_single_process(small_cfg, ref, tmp_path: Path, stage: int, world: int, micro: int) -> None:
    cfg = small_cfg(
        f"train.steps={STEPS}",
        "train.global_batch_size=8",
        f"train.micro_batch_size={micro}",
        "parallel.strategy=zero",
        f"parallel.zero.stage={stage}",
        *NO_CKPT,
        run_dir=tmp_path / "zero",
    )
    outs = run_ranks(world, _trained, cfg)
    expected = _losses(ref)
    assert len(expected) == STEPS and expected[-1] < expected[0]
    for out in outs:
        torch.testing.assert_close(_losses(out), expected, rtol=RTOL, atol=0)
    # DeepSpeed reports the pre-clip global gradient norm and steps the hpcdist LR schedule, like the reference
    for key in ("grad_norm", "lr"):
        got, want = _metrics(tmp_path / "zero", key), _metrics(ref["run_dir"], key)
        assert len(got) == STEPS
        torch.testing.assert_close(got, want, rtol=1e-4, atol=0, msg=key)
    for name, p in outs[0]["model"].items():
        torch.testing.assert_close(p, ref["model"][name], rtol=0, atol=1e-4, msg=name)


def _keys(trainer: Trainer, _: object) -> dict:
    state = trainer.strategy.dcp_state()
    return {"keys": (sorted(state["model"]), sorted(state["optim"]["state"]))}


def test_zero3_selective_checkpointing_matches_single_process(small_cfg, ref, tmp_path: Path) -> None:
    """configs/train_13b.yaml's combination: op-level checkpointing wraps the blocks before DeepSpeed partitions them;
    ZeRO-3 gathers each block's parameters again for the recompute and the fp32 losses stay the reference's. Its
    checkpoint names the parameters as the plain model does (no wrapper components: a run without checkpointing,
    with compile, or on another strategy loads it)."""
    cfg = small_cfg(
        f"train.steps={STEPS}",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "parallel.strategy=zero",
        "parallel.zero.stage=3",
        "train.activation_checkpointing=selective",
        *NO_CKPT,
        run_dir=tmp_path / "zero",
    )
    out = run_ranks(2, partial(train, after=_keys), cfg)[0]
    torch.testing.assert_close(_losses(out), _losses(ref), rtol=RTOL, atol=0)
    plain = sorted(ref["model"])  # the single-process reference: a plain model's FQNs
    assert out["keys"] == (plain, plain)


@pytest.mark.parametrize(
    "offload",
    [
        ("parallel.zero.stage=2", "parallel.zero.offload_optimizer=true"),
        ("parallel.zero.stage=3", "parallel.zero.offload_optimizer=true", "parallel.zero.offload_params=true"),
    ],
    ids=["zero2-offload-optimizer", "zero3-offload-all"],
)
def test_offload_matches_single_process(small_cfg, ref, tmp_path: Path, offload: tuple[str, ...]) -> None:
    """ZeRO-Offload / -Infinity code paths (host-side fp32 partitions stepped by torch's AdamW, no cpu_adam build)
    train exactly like the reference. On this CPU machine "offloaded" memory is the same RAM; the path is real."""
    cfg = small_cfg(
        f"train.steps={STEPS}",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "parallel.strategy=zero",
        *offload,
        *NO_CKPT,
        run_dir=tmp_path / "zero",
    )
    outs = run_ranks(2, _trained, cfg)
    for out in outs:
        torch.testing.assert_close(_losses(out), _losses(ref), rtol=RTOL, atol=0)


def test_deepspeed_config_batch_arithmetic() -> None:
    c = deepspeed_config(
        stage=2,
        micro_batch_size=4,
        grad_accum=3,
        dp_size=2,
        grad_clip=1.0,
        bf16=False,
        offload_optimizer=False,
        offload_params=False,
        overlap_comm=True,
        buckets=(100, 200),
    )
    assert c["train_batch_size"] == 24 and c["gradient_accumulation_steps"] == 3
    assert c["zero_optimization"]["stage"] == 2 and c["zero_optimization"]["allgather_bucket_size"] == 200
    assert c["bf16"] == {"enabled": False} and "optimizer" not in c  # no DS optimizer: no fused_adam build


def _engine_dtypes(trainer: Trainer, result: TrainResult) -> dict[str, Any]:
    engine = trainer.strategy.engine
    return {
        "communication": engine.communication_data_type,
        "model_and_accumulation": engine.get_data_types(),
        "optimizer": type(trainer.strategy.ds_optimizer).__name__,
        "finite": all(math.isfinite(v) for v in result.losses.values()),
    }


def _deepspeed_dtypes(env: DistEnv, cfgs: list[JobConfig]) -> list[dict[str, Any]]:
    """Per config: what DeepSpeed's engine reduces and accumulates gradients in, after one bf16 step through it."""
    out = []
    for cfg in cfgs:
        out.append(train(env, cfg, 1, after=_engine_dtypes))
    return out


def test_bf16_engine_reduces_gradients_in_fp32(small_cfg, tmp_path: Path) -> None:
    stages = (1, 2, 3)
    cfgs = [
        small_cfg(
            "parallel.strategy=zero",
            f"parallel.zero.stage={s}",
            "train.dtype=bf16",
            *NO_CKPT,
            run_dir=tmp_path / f"{s}",
        )
        for s in stages
    ]
    for per_rank in run_ranks(2, _deepspeed_dtypes, cfgs):
        for stage, got in zip(stages, per_rank, strict=True):
            assert got["communication"] == torch.float32 and got["finite"], (stage, got)
            # fp32 accumulation where DeepSpeed keeps its ZeRO optimizer (stage 1 would switch to BF16_Optimizer,
            # whose partitions hpcdist's checkpoints do not read)
            accumulation = torch.bfloat16 if stage == 1 else torch.float32
            assert got["model_and_accumulation"] == (torch.bfloat16, accumulation), (stage, got)
            assert got["optimizer"] == ("DeepSpeedZeroOptimizer_Stage3" if stage == 3 else "DeepSpeedZeroOptimizer")


def test_zero_config_validation(small_cfg) -> None:
    with pytest.raises(ConfigError, match=re.escape("parallel.zero.stage: must be 1, 2 or 3, got 4")):
        small_cfg("parallel.strategy=zero", "parallel.zero.stage=4")
    with pytest.raises(ConfigError, match=re.escape("offload_params: needs parallel.zero.stage=3")):
        small_cfg("parallel.strategy=zero", "parallel.zero.stage=2", "parallel.zero.offload_params=true")


RESUME_STEPS = 6
# the resume tests' layout: 2 ranks, 2 micro-batches of 2 per step, no periodic checkpoint (each split run saves at
# its `until` step and at its end)
RESUME = (
    f"train.steps={RESUME_STEPS}",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "parallel.strategy=zero",
    "checkpoint.every_steps=0",
)


@pytest.fixture(scope="module")
def straight(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict]:
    """The uninterrupted 2-rank run of RESUME per ZeRO stage (and extra overrides), trained once per module and
    shared by the resume tests that compare with it (exact resume, elastic 2-4-2): the same config computes the same
    losses and weights. It writes no checkpoint (every_steps=0, and SMALL has no final save), so whether saves are
    asynchronous changes nothing in it: the async-save split is compared with the synchronous straight run."""
    cache: dict[tuple[int, tuple[str, ...]], dict] = {}

    def get(stage: int, extra: tuple[str, ...] = ()) -> dict:
        if (stage, extra) not in cache:
            run_dir = tmp_path_factory.mktemp(f"zero{stage}_straight") / "run"
            cfg = small_config(run_dir, corpus_dir, *RESUME, f"parallel.zero.stage={stage}", *extra)
            cache[stage, extra] = run_ranks(2, _trained, cfg)[0]
        return cache[stage, extra]

    return get


@pytest.mark.parametrize(
    ("stage", "extra"),
    [(2, ()), (3, ("train.activation_checkpointing=selective", "parallel.zero.overlap_comm=true"))],
    ids=["zero2", "zero3-selective-overlap"],
)
def test_exact_resume(
    small_cfg, straight: Callable[..., dict], tmp_path: Path, stage: int, extra: tuple[str, ...]
) -> None:
    """N steps, checkpoint, a new job resumes: bitwise the same losses and weights as 2N uninterrupted steps.
    The fp32 master partitions, Adam moments and step count in DCP are what make it exact. ZeRO-3 runs with the
    flagship's selective checkpointing and overlap_comm: after the load, the resumed job's recompute all-gathers
    parameters its forward had not (torch's SAC modes refused that: "c10d._allgather_base_.default encountered
    during backward but not found in storage", the SLURM flagship test of 2026-11-26)."""
    n = RESUME_STEPS // 2
    cfg = small_cfg(*RESUME, f"parallel.zero.stage={stage}", *extra, run_dir=tmp_path / "split")
    first = run_ranks(2, _trained, cfg, n)[0]
    assert first["step"] == n and first["resumed"] is None
    assert not (Path(cfg.checkpoint_dir) / f"step-{n:08d}" / "native").exists()  # one DCP write, nothing else
    second = run_ranks(2, _trained, cfg)[0]
    assert second["resumed"].endswith(f"step-{n:08d}") and second["step"] == 2 * n
    losses = {**first["losses"], **second["losses"]}
    ref = straight(stage, extra)
    assert losses == ref["losses"]  # exact equality, every step
    for name, p in ref["model"].items():
        assert torch.equal(second["model"][name], p), name


ELASTIC_RTOL = 1e-5  # fp32: 2 and 4 ranks reduce gradients in a different order, nothing else differs


def _no_gather(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("a ZeRO-3 checkpoint gathered the whole model (_zero3_consolidated_16bit_state_dict)")


def _assert_losses(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want)
    torch.testing.assert_close(
        [got[s] for s in sorted(got)], [want[s] for s in sorted(want)], rtol=ELASTIC_RTOL, atol=0
    )


OFFLOAD = ("parallel.zero.offload_optimizer=true", "parallel.zero.offload_params=true")


@pytest.mark.parametrize(
    ("stage", "async_save", "extra"),
    # stage 2 saves and loads what stage 1 does (the same optimizer class, partitioned fp32 master and moments)
    [(1, False, ()), (3, False, ()), (3, True, ()), (3, False, OFFLOAD)],
    ids=["zero1", "zero3", "zero3-async", "zero3-offload"],
)
def test_elastic_resume_2_4_2(
    small_cfg,
    straight: Callable[..., dict],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    stage: int,
    async_save: bool,
    extra: tuple[str, ...],
) -> None:
    """2 steps on 2 ranks, resumed on 4 for 2 steps, resumed on 2 to the end: the same losses and fp32
    weights as an uninterrupted 2-rank run (each rank saved and loaded only its own partition, no gather; the async
    save stages the local fragments)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    monkeypatch.setattr(DeepSpeedEngine, "_zero3_consolidated_16bit_state_dict", _no_gather)  # forked ranks too
    over = (*RESUME, f"parallel.zero.stage={stage}", f"checkpoint.async_save={str(async_save).lower()}", *extra)
    cfg = small_cfg(*over, run_dir=tmp_path / "split")
    first = run_ranks(2, _trained, cfg, 2)[0]
    second = run_ranks(4, _trained, cfg, 4)[0]
    third = run_ranks(2, _trained, cfg)[0]
    assert second["resumed"].endswith("step-00000002") and third["resumed"].endswith("step-00000004")
    ref = straight(stage, extra)
    _assert_losses({**first["losses"], **second["losses"], **third["losses"]}, ref["losses"])
    for name, p in ref["model"].items():
        torch.testing.assert_close(third["model"][name], p, rtol=ELASTIC_RTOL, atol=1e-7, msg=name)


ZERO3 = ("parallel.strategy=zero", "parallel.zero.stage=3")
CROSS = ("train.steps=4", "train.global_batch_size=8", "train.micro_batch_size=2", "checkpoint.every_steps=0")


@pytest.fixture(scope="module")
def zero3_cross(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """CROSS under ZeRO-3 on 2 ranks, trained once for both torch strategies that continue it: the uninterrupted run
    and a run stopped at step 2 (its checkpoint is only read by them)."""
    root = tmp_path_factory.mktemp("zero3_cross")
    straight = run_ranks(2, _trained, small_config(root / "straight", corpus_dir, *CROSS, *ZERO3))[0]
    cfg = small_config(root / "zero", corpus_dir, *CROSS, *ZERO3)
    first = run_ranks(2, _trained, cfg, 2)[0]
    return {"straight": straight, "first": first, "step2": f"{cfg.checkpoint_dir}/step-00000002"}


@pytest.mark.parametrize("other", [("parallel.strategy=ddp",), ("parallel.strategy=fsdp",)], ids=["ddp", "fsdp"])
def test_zero3_checkpoint_resumed_by_torch_strategies(
    small_cfg, zero3_cross: dict, tmp_path: Path, other: tuple[str, ...]
) -> None:
    """A ZeRO-3 checkpoint holds the fp32 master and AdamW moments by FQN: DDP and FSDP continue it with the losses
    ZeRO-3 itself would have had (weights and moments kept, not restarted)."""
    resume = f"checkpoint.resume={zero3_cross['step2']}"
    then = run_ranks(2, _trained, small_cfg(*CROSS, *other, resume, run_dir=tmp_path / "other"))[0]
    assert then["resumed"] and then["step"] == 4
    _assert_losses({**zero3_cross["first"]["losses"], **then["losses"]}, zero3_cross["straight"]["losses"])


def test_ddp_checkpoint_resumed_by_zero3(small_cfg, tmp_path: Path) -> None:
    """The other way: ZeRO-3 (refused before) loads a DDP checkpoint on another world size, moments kept."""
    straight = run_ranks(2, _trained, small_cfg(*CROSS, "parallel.strategy=ddp", run_dir=tmp_path / "straight"))[0]
    cfg = small_cfg(*CROSS, "parallel.strategy=ddp", run_dir=tmp_path / "ddp")
    first = run_ranks(2, _trained, cfg, 2)[0]
    resume = f"checkpoint.resume={cfg.checkpoint_dir}/step-00000002"
    then = run_ranks(4, _trained, small_cfg(*CROSS, *ZERO3, resume, run_dir=tmp_path / "zero"))[0]
    assert then["resumed"] and then["step"] == 4
    _assert_losses({**first["losses"], **then["losses"]}, straight["losses"])


@pytest.mark.parametrize("stage", [2, 3])
def test_a_different_model_is_refused_before_deepspeed_loads(small_cfg, tmp_path: Path, stage: int) -> None:
    """On the ZeRO path: the DeepSpeed-native load used to meet another model inside DeepSpeed (an
    error there demoted the intact checkpoint as damaged). The shapes are now checked first, without gathering
    (stage 3: ds_shape), and the checkpoint is refused by name and kept."""
    over = (
        "train.steps=2",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        "parallel.strategy=zero",
        f"parallel.zero.stage={stage}",
        "checkpoint.every_steps=2",
    )
    cfg = small_cfg(*over, run_dir=tmp_path / "run")
    run_ranks(2, _trained, cfg)
    with pytest.raises(AssertionError, match=r"holds a different model \(layers\.1\..*model\.n_layers=2 \(now 1\)"):
        run_ranks(2, _trained, small_cfg(*over, "train.steps=4", "model.n_layers=1", run_dir=tmp_path / "run"))
    assert (Path(cfg.checkpoint_dir) / "step-00000002" / "COMPLETE").is_file()  # not demoted


def test_deepspeeds_deprecated_collective_calls_print_nothing(
    tmp_path: Path, corpus_dir: Path, recwarn: pytest.WarningsRecorder
) -> None:
    """A 3-step ZeRO-3 run printed 50 FutureWarnings: DeepSpeed calls torch's deprecated
    all_gather_into_tensor / reduce_scatter_tensor. One process (hpcdist.run makes and destroys its 1-rank group)."""
    from hpcdist import run
    from tests.conftest import SMALL

    over = [*SMALL, f"run.dir={tmp_path}", "data.source=files", f"data.path={corpus_dir}", *ZERO3, *NO_CKPT]
    assert run.main(None, [*over, "train.steps=2", "train.global_batch_size=8", "train.micro_batch_size=8"]).step == 2
    # what Python shows a user by default: not DeprecationWarning (hidden outside __main__; deepspeed's import has one)
    shown = [w for w in recwarn if not issubclass(w.category, DeprecationWarning)]
    assert not [str(w.message) for w in shown if "is deprecated" in str(w.message)]
