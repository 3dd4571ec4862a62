"""FSDP2 / HSDP on real gloo ranks equal one DDP process on the same global batch; DCP checkpoints reshard
between world sizes and move between DDP and FSDP."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from hpcdist.checkpoint.names import list_checkpoints
from hpcdist.config import ConfigError, JobConfig, check_world
from hpcdist.env import DistEnv
from hpcdist.inference import load_for_inference
from hpcdist.trainer import Trainer
from tests.conftest import small_config
from tests.dist.harness import run_ranks, single
from tests.training import full_state, train, train_with_drift

pytestmark = pytest.mark.dist

_train_params = partial(train, params=True)  # and the whole weights

STEPS = 10
# fp32 on CPU: FSDP differs from one process only in summation order (reduce-scatter, per-rank means), so the
# losses agree to float32 round-off compounded over 10 Adam steps (measured ~1e-7); 1e-5 leaves ~100x margin.
RTOL = 1e-5
BATCH = ("train.global_batch_size=8",)
FSDP = "parallel.strategy=fsdp"


def _init(env: DistEnv, cfg: JobConfig) -> dict[str, torch.Tensor]:
    return full_state(Trainer(cfg, env))


def _losses(out: dict) -> list[float]:
    return [out["losses"][s] for s in sorted(out["losses"])]


@pytest.fixture(scope="module")
def reference(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One process with DDP's path, global batch 8 in one micro-batch: the ground truth (trained once per module;
    tests only read it)."""
    run_dir = tmp_path_factory.mktemp("fsdp_ref") / "run"
    return single(
        _train_params, small_config(run_dir, corpus_dir, f"train.steps={STEPS}", *BATCH, "train.micro_batch_size=8")
    )


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_init_equals_single_process(small_cfg, tmp_path: Path, tie: bool) -> None:
    """Sharded init gives exactly the unsharded weights of the same seed (DTensor random init would not)."""
    over = (*BATCH, "train.micro_batch_size=4", f"model.tie_embeddings={str(tie).lower()}")
    ref = single(_init, small_cfg(*over, run_dir=tmp_path / "ref"))
    full = run_ranks(2, _init, small_cfg(*over, FSDP, run_dir=tmp_path / "fsdp"))[0]
    assert full.keys() == ref.keys()
    for name, p in ref.items():
        assert torch.equal(full[name], p), name


@pytest.mark.parametrize(
    ("world", "micro", "replicate"),
    [(2, 4, 1), (2, 2, 1), (4, 2, 1), (4, 1, 1), (4, 2, 2)],
    ids=["2ranks", "2ranks-accum2", "4ranks", "4ranks-accum2", "hsdp-2x2"],
)
def test_fsdp_matches_single_process(
    small_cfg, reference, tmp_path: Path, world: int, micro: int, replicate: int
) -> None:
    cfg = small_cfg(
        f"train.steps={STEPS}",
        *BATCH,
        f"train.micro_batch_size={micro}",
        FSDP,
        f"parallel.fsdp.replicate={replicate}",
        run_dir=tmp_path / "run",
    )
    outs = run_ranks(world, _train_params, cfg)
    ref = _losses(reference)
    assert len(ref) == STEPS and ref[-1] < ref[0]
    for out in outs:  # every rank reports the same global loss
        torch.testing.assert_close(_losses(out), ref, rtol=RTOL, atol=0)
    # parameter tolerance as in test_ddp: Adam amplifies round-off for weights whose gradient is ~0
    for name, p in outs[0]["params"].items():
        torch.testing.assert_close(p, reference["params"][name], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "option",
    [
        "parallel.fsdp.cpu_offload=true",
        "parallel.fsdp.reshard_after_forward=false",
        "train.activation_checkpointing=selective",
        "parallel.fsdp.param_dtype=bf16",
    ],
)
def test_fsdp_options(small_cfg, reference, tmp_path: Path, option: str) -> None:
    """Offload, no resharding and (selective, op-level) activation checkpointing recompute the same fp32 math; bf16
    parameters (the MixedPrecisionPolicy) follow the fp32 run to bf16 precision."""
    cfg = small_cfg(f"train.steps={STEPS}", *BATCH, "train.micro_batch_size=2", FSDP, option, run_dir=tmp_path / "o")
    out = run_ranks(2, _train_params, cfg)[0]
    rtol = 3e-2 if "bf16" in option else RTOL
    torch.testing.assert_close(_losses(out), _losses(reference), rtol=rtol, atol=0)


RESHARD_N = 4
RESHARD = (f"train.steps={2 * RESHARD_N}", *BATCH, "train.micro_batch_size=2", FSDP)


@pytest.fixture(scope="module")
def reshard_straight(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted 2-rank run of RESHARD, trained once per module: every save/resume world pair of
    test_checkpoint_reshards compares with it and none changes it (it was retrained for each)."""
    return run_ranks(2, _train_params, small_config(tmp_path_factory.mktemp("reshard") / "run", corpus_dir, *RESHARD))[
        0
    ]


@pytest.mark.parametrize(("save_world", "resume_world"), [(2, 2), (2, 4), (4, 2)])
def test_checkpoint_reshards(
    small_cfg, reshard_straight: dict, tmp_path: Path, save_world: int, resume_world: int
) -> None:
    """An FSDP checkpoint saved on one world size loads the same parameters on another and continues like an
    uninterrupted run (the sampler counts global samples, so data needs no resharding). On the same world size
    the resumed run is bitwise the uninterrupted one."""
    n, over, straight = RESHARD_N, RESHARD, reshard_straight
    cfg = small_cfg(*over, run_dir=tmp_path / "split")
    first = run_ranks(save_world, _train_params, cfg, n)[0]
    assert first["step"] == n and [s for s, _ in list_checkpoints(cfg.checkpoint_dir)[0]] == [n]
    # one process without a process group reads the sharded checkpoint for inference (hpcdist generate / eval)
    model, _, _ = load_for_inference(cfg.run.dir)
    for name, p in first["params"].items():
        assert torch.equal(model.state_dict()[name], p), name
    loaded = run_ranks(resume_world, _train_params, cfg, n)[0]  # resumes at step n and trains nothing
    assert loaded["resumed"] and loaded["step"] == n and loaded["losses"] == {}
    for name, p in first["params"].items():
        assert torch.equal(loaded["params"][name], p), name
    second = run_ranks(resume_world, _train_params, cfg)[0]
    assert second["resumed"].endswith(f"step-{n:08d}") and second["step"] == 2 * n
    if save_world == resume_world == 2:  # the straight run's layout: exact
        assert {**first["losses"], **second["losses"]} == straight["losses"]
        for name, p in straight["params"].items():
            assert torch.equal(second["params"][name], p), name
        return
    torch.testing.assert_close(_losses(first), _losses(straight)[:n], rtol=RTOL, atol=0)
    torch.testing.assert_close(_losses(second), _losses(straight)[n:], rtol=RTOL, atol=0)


def test_ddp_checkpoint_resumes_under_fsdp(small_cfg, tmp_path: Path) -> None:
    """Checkpoint entries are the unwrapped model's FQNs, so a DDP checkpoint (model + AdamW state) loads into
    FSDP shards; training continues like the uninterrupted DDP run."""
    n = 4
    over = (f"train.steps={2 * n}", *BATCH, "train.micro_batch_size=2")
    straight = run_ranks(2, _train_params, small_cfg(*over, run_dir=tmp_path / "straight"))[0]
    run_dir = tmp_path / "split"
    run_ranks(2, _train_params, small_cfg(*over, run_dir=run_dir), n)
    second = run_ranks(2, _train_params, small_cfg(*over, FSDP, run_dir=run_dir))[0]
    assert second["resumed"].endswith(f"step-{n:08d}")
    torch.testing.assert_close(_losses(second), _losses(straight)[n:], rtol=RTOL, atol=0)
    for name, p in straight["params"].items():
        torch.testing.assert_close(second["params"][name], p, rtol=1e-4, atol=1e-5)


def test_world_checks(small_cfg) -> None:
    with pytest.raises(ConfigError, match=r"replicate \(3\) must divide the world size \(4\)"):
        check_world(small_cfg(*BATCH, "train.micro_batch_size=2", FSDP, "parallel.fsdp.replicate=3"), 4)
    with pytest.raises(ConfigError, match="needs more than one"):
        check_world(small_cfg(*BATCH, FSDP), 1)


def test_fsdp_config_section(small_cfg) -> None:
    cfg = small_cfg(FSDP, "parallel.fsdp.replicate=2", "parallel.fsdp.reshard_after_forward=false")
    assert cfg.parallel.fsdp.replicate == 2 and cfg.parallel.fsdp.reshard_after_forward is False
    with pytest.raises(ConfigError) as e:
        small_cfg("parallel.fsdp.param_dtype=fp16", "parallel.fsdp.reduce_dtype=auto", "parallel.fsdp.replicat=2")
    problems = "\n".join(e.value.problems)
    assert "parallel.fsdp.param_dtype" in problems and "parallel.fsdp.reduce_dtype" in problems
    assert "did you mean 'replicate'" in problems


def test_hsdp_replica_check_names_the_diverged_rank(
    small_cfg, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """HSDP 2 x 2: replicas of shard 1 are ranks 1 and 3. Rank 3 drifts behind FSDP's back after step 2; the check
    (per replica group) names it although rank 0's own group is intact, and rank 0's metric reports it."""
    cfg = small_cfg(
        "train.steps=4",
        *BATCH,
        "train.micro_batch_size=2",
        FSDP,
        "parallel.fsdp.replicate=2",
        "logging.replica_check_every_steps=1",
        run_dir=tmp_path / "drift",
    )
    divergence = run_ranks(4, train_with_drift, cfg, 3, 2)[0]
    assert divergence[1] == 0.0 and divergence[2] > 0.0
    assert "rank(s) [3] differ from the majority" in capfd.readouterr().out
