"""On real ranks: the export is the same whatever strategy and world size wrote the checkpoint, and a
Hugging Face directory starts an FSDP run (checkpoint.init_from: HF_DIR) with the original model's loss."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hpcdist import cli
from hpcdist.config import JobConfig
from hpcdist.env import DistEnv
from hpcdist.trainer import Trainer
from tests.dist.harness import run_ranks, single
from tests.training import train

pytestmark = pytest.mark.dist

BATCH = ("train.global_batch_size=8", "train.micro_batch_size=4")


def _save_initial(env: DistEnv, cfg: JobConfig) -> None:
    """Collective: the seeded initial weights saved as step 0 by this layout (every layout inits bitwise alike)."""
    Trainer(cfg, env).save()


def _first_loss(env: DistEnv, cfg: JobConfig) -> float:
    return train(env, cfg, 1)["losses"][1]


def _export(ckpt_dir: str, out: Path, *extra: str) -> bytes:
    assert cli.main(["export", ckpt_dir, "--out", str(out), "--dtype", "fp32", *extra]) == 0
    return (out / "model.safetensors").read_bytes()


def test_export_is_the_same_from_ddp_zero3_and_3d(small_cfg, tmp_path: Path) -> None:
    """The same initial weights saved by DDP (2 ranks), ZeRO-3 (2 ranks: DCP views of each rank's flat partition)
    and 3d pp2 x tp2 (4 ranks: each stage's DTensor shards) export to byte-identical safetensors."""
    layouts: dict[str, tuple[int, tuple[str, ...]]] = {
        "ddp": (2, ("parallel.strategy=ddp",)),
        "zero3": (2, ("parallel.strategy=zero", "parallel.zero.stage=3")),
        "3d": (
            4,
            ("parallel.strategy=3d", "parallel.pp=2", "parallel.dp=1", "parallel.tp=2", "parallel.pp_schedule=1F1B"),
        ),
    }
    exported = {}
    for name, (world, over) in layouts.items():
        cfg = small_cfg(*BATCH, *over, run_dir=tmp_path / name)
        run_ranks(world, _save_initial, cfg)
        exported[name] = _export(str(cfg.checkpoint_dir), tmp_path / f"hf-{name}")
    assert len(exported["ddp"]) > 100_000
    assert exported["zero3"] == exported["ddp"]
    assert exported["3d"] == exported["ddp"]


def test_init_from_hf_dir_under_fsdp_starts_with_the_original_loss(small_cfg, tmp_path: Path) -> None:
    """A model trained 2 steps, exported; a new 2-rank FSDP run with checkpoint.init_from=HF_DIR: its first loss equals
    the loss of the original weights on the same batch, computed by one process from the original checkpoint."""
    trained = small_cfg(*BATCH, "train.steps=2", "checkpoint.save_final=true", run_dir=tmp_path / "orig")
    single(train, trained)
    hf = tmp_path / "hf"
    _export(str(tmp_path / "orig"), hf)
    step = f"{trained.checkpoint_dir}/step-00000002"
    want = single(_first_loss, small_cfg(*BATCH, f"checkpoint.init_from={step}", run_dir=tmp_path / "ref"))
    fsdp = small_cfg(*BATCH, "parallel.strategy=fsdp", f"checkpoint.init_from={hf}", run_dir=tmp_path / "fsdp")
    got: list[Any] = run_ranks(2, _first_loss, fsdp)
    assert got[0] == pytest.approx(want, rel=1e-5, abs=0)
    # and not merely the loss of any model: a fresh FSDP run starts elsewhere
    fresh = run_ranks(2, _first_loss, small_cfg(*BATCH, "parallel.strategy=fsdp", run_dir=tmp_path / "fresh"))
    assert abs(fresh[0] - want) > 1e-3
