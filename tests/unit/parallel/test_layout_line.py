"""The start-up log's ``layout:`` line (hpcdist.parallel.dims.describe_layout), one case per strategy."""

from __future__ import annotations

import pytest

from hpcdist import config as config_mod
from hpcdist.parallel.dims import describe_layout, parallel_dims


@pytest.mark.parametrize(
    ("world", "overrides", "expected"),
    [
        (4, ["parallel.strategy=ddp"], "ddp x 4 ranks"),
        (1, ["parallel.strategy=ddp"], "ddp x 1 rank"),
        (8, ["parallel.strategy=fsdp"], "fsdp x 8 ranks"),
        (4, ["parallel.strategy=fsdp", "parallel.fsdp.replicate=2"], "hsdp 2 x 2"),
        (4, ["parallel.strategy=fsdp", "parallel.fsdp.cpu_offload=true"], "fsdp x 4 ranks, cpu offload"),
        (4, ["parallel.strategy=zero", "parallel.zero.stage=1"], "zero1 x 4 ranks"),
        (
            4,
            ["parallel.strategy=zero", "parallel.zero.stage=3", "parallel.zero.offload_optimizer=true"],
            "zero3 x 4 ranks, offload optimizer",
        ),
        (
            4,
            [
                "parallel.strategy=zero",
                "parallel.zero.stage=3",
                "parallel.zero.offload_optimizer=true",
                "parallel.zero.offload_params=true",
            ],
            "zero3 x 4 ranks, offload optimizer and params",
        ),
        (
            8,
            ["parallel.strategy=3d", "parallel.pp=2", "parallel.tp=2", "parallel.pp_schedule=Interleaved1F1B"],
            "3d pp2 x dp2 x tp2, Interleaved1F1B, 4 stages",
        ),
        (
            8,
            ["parallel.strategy=3d", "parallel.pp=2", "parallel.tp=2", "parallel.pp_schedule=1F1B"],
            "3d pp2 x dp2 x tp2, 1F1B, 2 stages",
        ),
        (8, ["parallel.strategy=3d", "parallel.tp=2"], "3d pp1 x dp4 x tp2"),
        (16, ["parallel.strategy=3d", "parallel.tp=2", "parallel.fsdp.replicate=2"], "3d pp1 x dp8 (hsdp 2 x 4) x tp2"),
        # the name follows the degrees, not the alias: 3d without pp or tp runs as FSDP2 over dp
        (8, ["parallel.strategy=3d"], "fsdp x 8 ranks"),
    ],
    ids=[
        "ddp",
        "ddp-1",
        "fsdp",
        "hsdp",
        "fsdp-offload",
        "zero1",
        "zero3-offload",
        "zero3-offload-all",
        "3d-interleaved",
        "3d-1f1b",
        "3d-no-pp",
        "3d-hsdp",
        "3d-is-fsdp",
    ],
)
def test_describe_layout(world: int, overrides: list[str], expected: str) -> None:
    cfg = config_mod.load(None, ["model.preset=tiny", *overrides])
    assert describe_layout(cfg, parallel_dims(cfg, world)) == expected


def test_planner_row_dry_run_and_log_describe_a_layout_alike() -> None:
    """One describer: for every layout the planner enumerates, its row, the trainer's ParallelDims for the config
    the planner writes, and the start-up log line name the same kind and degrees (they were four describers)."""
    from hpcdist.planning.layouts import apply_layout, enumerate_layouts

    cfg = config_mod.load(None, ["model.preset=tiny", "train.global_batch_size=32"])
    layouts = enumerate_layouts(
        cfg.model_args(),
        world_size=16,
        gpus_per_node=8,
        global_batch_size=32,
        seq_len=cfg.data.seq_len,
        micro_batch_sizes=[1],
    )
    assert {lay.kind for lay in layouts} == set(config_mod.LayoutKind)  # every kind has a row here
    for lay in layouts:
        new, missing = apply_layout(cfg, lay)
        dims = parallel_dims(new, 16)
        assert not missing and dims.kind is lay.kind
        assert lay.describe().startswith(dims.describe() + ", micro batch 1")
        assert describe_layout(new, dims).startswith(dims.describe())
