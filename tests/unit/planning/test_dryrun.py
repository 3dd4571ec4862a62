"""hpcdist.planning.dryrun / `hpcdist train --dry-run`: the parallel plan applied on meta tensors and a fake process
group."""

from __future__ import annotations

import math
import time

import pytest
import torch.distributed as dist

from hpcdist import config as config_mod
from hpcdist.cli import main
from hpcdist.models import build_model, num_params
from hpcdist.planning.dryrun import dry_run, parse_ranks
from tests.conftest import SMALL

# the tiny shapes of the other unit tests: dim 64, 2 layers, 4 heads / 2 kv heads, vocab 258
BASE = [*SMALL, "data.source=synthetic", "train.global_batch_size=16", "train.micro_batch_size=1"]


def cfg(*overrides: str) -> config_mod.JobConfig:
    return config_mod.load(None, [*BASE, *overrides])


@pytest.fixture(autouse=True)
def no_process_group_left():
    yield
    assert not dist.is_initialized(), "the dry run must destroy its fake process group"


@pytest.mark.parametrize("world", [4, 8])
def test_fsdp_shards_add_up_to_the_model(world: int):
    c = cfg("parallel.strategy=fsdp")
    report = dry_run(c, world, cluster="a100_ib", ranks=range(world))
    total = num_params(c.model_args())
    assert report.total_params == total
    assert [r.coords for r in report.counts] == [f"shard {r}" for r in range(world)]
    assert sum(r.params for r in report.counts) == total  # FSDP2 shards dim 0; padding is not counted
    assert all(r.optimizer_params == r.params and "FSDP2" in r.how for r in report.counts)


def test_hsdp_each_replica_holds_the_model_once():
    report = dry_run(cfg("parallel.strategy=fsdp", "parallel.fsdp.replicate=2"), 4, ranks=range(4))
    total = report.total_params
    assert [r.coords for r in report.counts] == [f"replicate {i // 2}, shard {i % 2}" for i in range(4)]
    assert sum(r.params for r in report.counts[:2]) == sum(r.params for r in report.counts[2:]) == total
    assert "layout: hsdp 2 x 2;" in report.text()  # the one describer (config.layout.LayoutDegrees)


def test_ddp_and_zero_counts():
    ddp = dry_run(cfg("parallel.strategy=ddp"), 4)
    total = ddp.total_params
    assert [r.rank for r in ddp.counts] == [0, 2, 3]  # default: first, middle, last
    assert all(r.params == r.optimizer_params == total for r in ddp.counts)
    sizes = [p.numel() for p in build_model(cfg().model_args()).parameters()]
    z3 = dry_run(
        cfg("parallel.strategy=zero", "parallel.zero.stage=3", "parallel.zero.param_persistence_threshold=0"), 4
    )
    assert all(r.params == r.optimizer_params == sum(math.ceil(n / 4) for n in sizes) for r in z3.counts)
    z1 = dry_run(cfg("parallel.strategy=zero", "parallel.zero.stage=1"), 4)
    assert all(r.params == total and r.optimizer_params == math.ceil(total / 4) for r in z1.counts)
    assert "DeepSpeed's partitioning rule" in z1.text()


def test_3d_counts_differ_by_stage_and_cover_the_model():
    c = cfg("parallel.strategy=3d", "parallel.pp=2", "parallel.tp=2", "parallel.dp=2")
    report = dry_run(c, 8, ranks=range(8))
    by_stage = {r.rank: r for r in report.counts}
    assert by_stage[0].coords == "pp 0, dp 0, tp 0" and by_stage[7].coords == "pp 1, dp 1, tp 1"
    assert "stage 0 (layer 0 + embedding)" in by_stage[0].how and "stage 1 (layer 1 + head)" in by_stage[4].how
    args = c.model_args()
    # every TP/FSDP-sharded tensor sums to its size over a stage's 4 ranks; the RMSNorm weights are replicated
    # over tp (sequence parallel), so they count tp = 2 times
    norms = (2 * args.n_layers + 1) * args.dim
    assert sum(r.params for r in report.counts) == num_params(args) + norms
    assert "layout: 3d pp2 x dp2 x tp2, 1F1B, 2 stages;" in report.text()
    default = dry_run(c, 8)  # first, middle, last and the first rank of every stage
    assert [r.rank for r in default.counts] == [0, 4, 7]


def test_auto_is_resolved_by_the_planner_first():
    c = cfg("parallel.strategy=ddp")
    c.parallel.strategy = "auto"  # what config validation will accept once auto is wired in
    report = dry_run(c, 8, cluster="a100_ib")
    assert report.cfg.parallel.strategy in ("ddp", "zero", "fsdp", "3d")
    assert any(n.startswith("parallel.strategy=auto on 8 GPUs (a100_ib): row ") for n in report.notes)


def test_invalid_layouts_fail_before_any_process_group():
    with pytest.raises(config_mod.ConfigError, match="global_batch_size"):
        dry_run(cfg("parallel.strategy=fsdp"), 3)
    with pytest.raises(config_mod.ConfigError, match="parallel"):
        dry_run(cfg("parallel.strategy=3d", "parallel.pp=2", "parallel.tp=4", "parallel.dp=1"), 16)
    with pytest.raises(ValueError, match="outside"):
        dry_run(cfg(), 4, ranks=[4])


def test_refuses_to_run_inside_a_process_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(RuntimeError, match="outside torchrun/srun"):
            dry_run(cfg(), 2)
    finally:
        dist.destroy_process_group()


def test_parse_ranks():
    assert parse_ranks(None, 32) == [0, 16, 31]
    assert parse_ranks("all", 3) == [0, 1, 2]
    assert parse_ranks("7, 0,7", 8) == [0, 7]
    for bad in ("x", "8", "", "-1"):
        with pytest.raises(ValueError, match="--ranks"):
            parse_ranks(bad, 8)


# --------------------------------------------------------------------------------------------------- CLI


def test_cli_dry_run_13b_on_32_gpus(capsys: pytest.CaptureFixture[str]):
    start = time.perf_counter()
    assert main(["train", "configs/train_13b.yaml", "--dry-run", "--world-size", "32"]) == 0
    out = capsys.readouterr().out
    assert "13.02B params (13,015,864,320) on 32 ranks (4 node(s) x 8)" in out
    assert "-> fits in 78 GiB" in out and "planner prediction (a100_ib" in out
    elapsed = time.perf_counter() - start
    print(f"13B dry run at 32 ranks: {elapsed:.1f} s")  # shown with -s; the bound lives in the issue, not here


def test_cli_dry_run_3d_lists_every_pipeline_stage(capsys: pytest.CaptureFixture[str]):
    argv = ["train", "configs/demo.yaml", "parallel.strategy=3d", "parallel.pp=4", "train.micro_batch_size=1"]
    assert main([*argv, "--dry-run", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    ranks = [int(line.split()[0]) for line in out.splitlines() if "sharded on meta" in line]
    assert ranks == [0, 2, 4, 6, 7]  # first rank of each of the 4 stages, plus first / middle / last
    assert "2.9M params (2,903,296)" in out and "stage 3 (layer 3 + head)" in out


def test_cli_dry_run_exit_status_and_errors(capsys: pytest.CaptureFixture[str]):
    # 13B under DDP is 217 GiB per GPU: the report prints, then exit status 1 says it does not fit
    assert main(["train", "configs/train_13b.yaml", "parallel.strategy=ddp", "--dry-run", "--world-size", "32"]) == 1
    captured = capsys.readouterr()
    assert "does NOT fit" in captured.out and "does not fit; see hpcdist plan" in captured.err
    assert main(["train", "configs/demo.yaml", "--world-size", "4"]) == 2
    assert "--world-size applies only with --dry-run" in capsys.readouterr().err
    assert main(["train", "configs/demo.yaml", "--dry-run", "--ranks", "9"]) == 2
    assert "--ranks '9'" in capsys.readouterr().err


def test_the_dry_run_shows_the_async_checkpoint_staging_need():
    """The host memory an async save stages into is shown before the run (the trainer refuses it at
    start-up when the node cannot hold it): fp32 weights + AdamW's two moments of what each rank holds."""
    from hpcdist.base.units import size_text

    report = dry_run(cfg("parallel.strategy=fsdp", "checkpoint.async_save=true"), 4)
    per_rank = max(4 * c.params + 8 * c.optimizer_params for c in report.counts)
    assert (
        "async checkpoint staging (host shared memory, allocated once after the first step): up to "
        f"{size_text(per_rank)} per rank" in report.text()
    )
    assert "async checkpoint staging" not in dry_run(cfg("parallel.strategy=fsdp"), 4).text()


def test_the_dry_run_shows_the_node_local_tiers_bytes_per_node():
    """What checkpoint.local keeps on each node's disk: the ranks' own step and the peer node's copy,
    times the steps kept (plus the one being written)."""
    from hpcdist.base.units import size_text

    local = ("checkpoint.local.dir=/dev/shm/x-{job_id}", "checkpoint.local.every_steps=10", "checkpoint.local.keep=2")
    report = dry_run(cfg("parallel.strategy=fsdp", *local), 4)
    per_rank = max(4 * c.params + 8 * c.optimizer_params for c in report.counts)
    ranks = min(report.gpus_per_node, 4)
    copies = 2 if ranks < 4 else 1
    text = report.text()
    assert f"node-local checkpoint tier (/dev/shm/x-{{job_id}}): {size_text(per_rank)} per rank per step" in text
    assert f"up to {size_text(per_rank * ranks * copies * 3)} per node (checkpoint.local.keep=2" in text
