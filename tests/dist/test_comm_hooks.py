"""DDP gradient communication hooks on real gloo ranks: measured bytes, convergence, exact resume with PowerSGD."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpcdist import config as config_mod
from hpcdist.base.rundir import RunDir
from hpcdist.checkpoint.names import list_checkpoints
from hpcdist.checkpoint.state import RANK_DIR
from hpcdist.config import JobConfig
from hpcdist.env import DistEnv
from hpcdist.models import build_model
from tests.conftest import SMALL
from tests.dist.harness import run_ranks
from tests.training import train

TORCH_ALL_REDUCE = torch.distributed.all_reduce  # torch's own, before any hook replaced it


def _train_hooked(env: DistEnv, cfg: JobConfig, until: int | None = None) -> dict:
    """train, and whether torch.distributed.all_reduce is torch's own again once it has trained."""
    return train(
        env, cfg, until, after=lambda *_: {"all_reduce_is_torch_own": torch.distributed.all_reduce is TORCH_ALL_REDUCE}
    )


pytestmark = pytest.mark.dist

STEPS = 24
# every hook run: 2 ranks, global batch 8, the same data; PowerSGD compresses from step 3 on. dim 128 makes the
# smallest weight matrices 128 x 64 (GQA's wk/wv), so rank 2 compresses each >= 10x (128*64 / (2*(128+64)) = 21)
OVER = (
    f"train.steps={STEPS}",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "model.dim=128",
    "model.ffn_dim=256",
    "optim.warmup_steps=4",
    "checkpoint.save_final=false",
)
# bucket_cap_mb=1 splits the ~1.3 MB of gradients into 2 buckets: PowerSGD's collectives of two buckets in flight
# must reach gloo in the same order on every rank (comm_hooks.serialized)
POWERSGD = (
    "parallel.ddp.comm_hook=powersgd",
    "parallel.ddp.powersgd.rank=2",
    "parallel.ddp.powersgd.start_iter=2",
    "parallel.ddp.bucket_cap_mb=1",
)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in RunDir(run_dir).metrics.read_text().splitlines()]


def _losses(out: dict) -> list[float]:
    return [out["losses"][s] for s in sorted(out["losses"])]


@pytest.fixture(scope="module")
def hook_runs(tmp_path_factory: pytest.TempPathFactory, corpus_dir: Path) -> dict[str, tuple[dict, list[dict]]]:
    """One 24-step run per hook (none, allreduce, bf16, powersgd), reused by the assertions below."""
    runs = {}
    for name, extra in {
        "none": (),
        "allreduce": ("parallel.ddp.comm_hook=allreduce",),
        "bf16": ("parallel.ddp.comm_hook=bf16",),
        "powersgd": POWERSGD,
    }.items():
        run_dir = tmp_path_factory.mktemp(name)
        cfg = config_mod.load(
            None, [*SMALL, f"run.dir={run_dir}", "data.source=files", f"data.path={corpus_dir}", *OVER, *extra]
        )
        runs[name] = (run_ranks(2, _train_hooked, cfg)[0], _metrics(run_dir))
    return runs


def test_measured_bytes_per_step(hook_runs) -> None:
    """Bytes handed to all-reduce, counted at runtime: the fp32 hook sends every gradient element (4 bytes each),
    bf16 exactly half, PowerSGD (rank 2, after its 2 warm-up steps of plain all-reduce) >= 10x less."""
    by = {name: [m for m in metrics if "comm_bytes_per_step" in m] for name, (_, metrics) in hook_runs.items()}
    assert not by["none"]  # DDP's built-in all-reduce is not measured
    cfg = config_mod.load(None, [*SMALL, *OVER])
    n_params = sum(p.numel() for p in build_model(cfg.model_args(), device="meta").parameters())
    fp32 = by["allreduce"][-1]["comm_bytes_per_step"]
    assert fp32 == 4 * n_params
    assert all(m["comm_bytes_per_step"] == fp32 for m in by["allreduce"])
    assert by["bf16"][-1]["comm_bytes_per_step"] == fp32 / 2
    warmup = by["powersgd"][0]["comm_bytes_per_step"]  # step 1: start_iter=2, still plain all-reduce
    compressed = by["powersgd"][-1]["comm_bytes_per_step"]
    assert warmup == fp32
    assert fp32 / compressed >= 10, (fp32, compressed)
    for m in by["allreduce"] + by["powersgd"]:
        assert 0 < m["comm_share"] < 1


def test_the_byte_counter_is_undone_after_training(hook_runs) -> None:
    """The meter's wrapper of torch.distributed.all_reduce lives only inside each metered backward."""
    assert all(out["all_reduce_is_torch_own"] for out, _ in hook_runs.values())


def test_compressed_training_converges(hook_runs) -> None:
    """Same data, same steps: the hooks' final losses stay within 1% of DDP's built-in all-reduce (the issue's goal
    is 3%; measured here: bf16 +0.001%, PowerSGD rank 2 +0.15%), and PowerSGD really changed the training (its
    losses are not the uncompressed ones)."""
    ref = _losses(hook_runs["none"][0])
    assert ref[-1] < 0.8 * ref[0]  # it learns
    torch.testing.assert_close(_losses(hook_runs["allreduce"][0]), ref, rtol=1e-5, atol=0)
    for name in ("bf16", "powersgd"):
        final = _losses(hook_runs[name][0])[-1]
        assert abs(final - ref[-1]) / ref[-1] < 0.01, (name, final, ref[-1])
    assert _losses(hook_runs["powersgd"][0])[3:] != ref[3:]


def test_powersgd_exact_resume(small_cfg, hook_runs, tmp_path: Path) -> None:
    """Stop after 5 steps, resume: the losses after the resume equal the uninterrupted PowerSGD run's, bitwise. The
    error feedback differs per rank, so each rank restores its own file."""
    straight = hook_runs["powersgd"][0]
    cfg = small_cfg(*OVER, *POWERSGD, run_dir=tmp_path / "split")
    first = run_ranks(2, _train_hooked, cfg, 5)[0]
    ((step, path),) = list_checkpoints(cfg.checkpoint_dir)[0]
    assert step == 5
    own = [torch.load(path / RANK_DIR / f"rank-{r:05d}.pt", weights_only=True)["comm_hook"] for r in (0, 1)]
    assert own[0]["iter"] == own[1]["iter"] == 5 and len(own[0]["error"]) == len(own[0]["q"]) == 2  # two buckets
    assert any(not torch.equal(own[0]["error"][k], own[1]["error"][k]) for k in own[0]["error"])
    second = run_ranks(2, _train_hooked, cfg)[0]
    assert second["resumed"] and second["step"] == STEPS
    assert _losses(first) == _losses(straight)[:5]
    assert _losses(second) == _losses(straight)[5:]  # bitwise: == on floats
