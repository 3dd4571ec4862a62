"""ParallelDims and the 3d layout rules (no process group), the stage split, the data coordinate of each rank,
and the meta-device path a dry run takes (fake process group: nothing allocated)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from hpcdist import config as config_mod
from hpcdist.config import ConfigError, check_world
from hpcdist.data import BatchLoader, ResumableSampler
from hpcdist.models import build_model
from hpcdist.models.args import ModelArgs
from hpcdist.parallel.dims import SCHEDULES, ParallelDims, layout_problems, parallel_dims, resolve_degrees
from hpcdist.parallel.pp import part_costs, split_layers, split_model, stage_ids

THREE_D = [
    "parallel.strategy=3d",
    "model.n_layers=4",
    "model.dim=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=128",
    "data.seq_len=32",
    "train.global_batch_size=8",
    "train.micro_batch_size=1",
]


def _cfg(*over: str) -> config_mod.JobConfig:
    return config_mod.load(None, [*THREE_D, "data.source=synthetic", *over])


def _world_problems(world: int, *over: str, ranks_per_node: int | None = None) -> list[str]:
    with pytest.raises(ConfigError) as e:
        check_world(_cfg(*over), world, ranks_per_node=ranks_per_node)
    return e.value.problems


# --------------------------------------------------------------------------------------------------- degrees


@pytest.mark.parametrize(
    ("degrees", "world", "expected"),
    [((2, -1, 2), 8, (2, 2, 2)), ((-1, 2, 2), 8, (2, 2, 2)), ((1, 1, -1), 4, (1, 1, 4)), ((1, -1, 1), 1, (1, 1, 1))],
)
def test_fill_resolves_the_remaining_ranks(degrees: tuple[int, int, int], world: int, expected: tuple) -> None:
    dims = ParallelDims(*degrees, world_size=world)
    assert (dims.pp, dims.dp, dims.tp) == expected
    assert dims.pp_enabled == (expected[0] > 1) and dims.dp_enabled == (expected[1] > 1)
    assert dims.tp_enabled == (expected[2] > 1) and not dims.hsdp_enabled


@pytest.mark.parametrize(
    ("degrees", "world", "fragments"),
    [
        ((2, 3, 2), 8, ("parallel.pp=2 x parallel.dp=3 x parallel.tp=2 = 12 ranks", "world size is 8", "-1")),
        ((-1, -1, 2), 8, ("at most one degree may be -1",)),
        ((3, -1, 1), 8, ("multiply to 3", "does not divide the world size 8")),
        ((0, 2, 2), 8, ("parallel.pp=0: must be a positive integer or -1",)),
    ],
)
def test_impossible_degrees_name_every_degree_and_the_rule(degrees: tuple, world: int, fragments: tuple) -> None:
    with pytest.raises(ValueError) as e:
        ParallelDims(*degrees, world_size=world)
    for fragment in fragments:
        assert fragment in str(e.value)
    assert resolve_degrees(*degrees, world)[1]  # the same problems, as a list, for config validation


def test_tp_is_innermost_so_tp_groups_are_consecutive_ranks() -> None:
    dims = ParallelDims(pp=2, dp=2, tp=2, world_size=8)
    assert [dims.coords(r)["tp"] for r in range(8)] == [0, 1] * 4  # ranks 2k, 2k+1: one tp pair (one node)
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]  # tp peers read the same batch slice
    assert [dims.coords(r)["pp"] for r in range(8)] == [0] * 4 + [1] * 4  # pp outermost: stages across nodes
    with pytest.raises(ValueError, match="outside"):
        dims.coords(8)


def test_hsdp_splits_dp() -> None:
    dims = ParallelDims(pp=2, dp=4, tp=1, world_size=8, dp_replicate=2)
    assert dims.hsdp_enabled and dims.dp_shard == 2
    with pytest.raises(ValueError, match=r"replicate=3 must divide parallel.dp=4"):
        ParallelDims(pp=2, dp=4, tp=1, world_size=8, dp_replicate=3)


# --------------------------------------------------------------------------------------------------- layout rules


@pytest.mark.parametrize(
    ("over", "degrees", "kind"),
    [
        (("parallel.strategy=ddp",), (1, 8, 1, 8), "ddp"),
        (("parallel.strategy=fsdp",), (1, 8, 1, 1), "fsdp"),
        (("parallel.strategy=fsdp", "parallel.fsdp.replicate=2"), (1, 8, 1, 2), "hsdp"),
        (("parallel.dp=-1",), (1, 8, 1, 1), "fsdp"),  # 3d with pp = tp = 1 is fsdp: the same degrees
        (("parallel.pp=2", "parallel.dp=-1", "parallel.tp=2", "parallel.fsdp.replicate=2"), (2, 2, 2, 2), "hsdp"),
        (("parallel.strategy=zero",), (1, 8, 1, 1), "zero"),  # DeepSpeed partitions; no FSDP, no mesh
    ],
)
def test_every_strategy_is_degrees_of_one_parallel_dims(over: tuple[str, ...], degrees: tuple, kind: str) -> None:
    """parallel.strategy is an alias for degrees (one function); what runs follows from the degrees alone."""
    dims = parallel_dims(_cfg(*over), 8)
    assert (dims.pp, dims.dp, dims.tp, dims.dp_replicate) == degrees
    flags = {
        "ddp": dims.ddp_enabled,
        "fsdp": dims.fsdp_enabled and not dims.hsdp_enabled,
        "hsdp": dims.hsdp_enabled,
        "zero": dims.zero_enabled,
    }
    assert [k for k, on in flags.items() if on] == [kind]
    assert dims.needs_mesh == (kind not in ("ddp", "zero"))


@pytest.mark.parametrize("over", [("parallel.strategy=fsdp",), ("parallel.dp=-1",)])
def test_replicate_equal_to_dp_is_ddp_and_refused_under_fsdp_options(over: tuple[str, ...]) -> None:
    """HSDP with one-rank shard groups is pure replication, which runs as DDP: the fsdp options would not apply."""
    problems = _world_problems(4, *over, "parallel.fsdp.replicate=4")
    assert any("parallel.fsdp.replicate (4) equals" in p and "parallel.strategy=ddp" in p for p in problems)


def test_config_rejects_impossible_layouts_with_every_problem_at_once() -> None:
    # at load (no world size yet): the rules that need only the degrees and the model
    with pytest.raises(ConfigError) as e:
        _cfg("parallel.pp=2", "parallel.tp=8", "model.n_layers=1", "model.tie_embeddings=true")
    text = "\n".join(e.value.problems)
    for fragment in (
        "parallel.tp=8 does not divide model.n_heads=4",
        "parallel.tp=8 does not divide model.n_kv_heads=2",
        "parallel.pp=2 x parallel.pp_stages_per_rank=1 = 2 pipeline stages but model.n_layers=1",
        "model.tie_embeddings=true with parallel.pp=2",
    ):
        assert fragment in text, (fragment, e.value.problems)
    # with the world size: the product, the node, the micro-batches and the batch split, together
    problems = _world_problems(8, "parallel.pp=2", "parallel.dp=2", "parallel.tp=1")
    assert problems == [
        "parallel.pp=2 x parallel.dp=2 x parallel.tp=1 = 4 ranks, but the world size is 8: pp x dp x tp must equal "
        "the world size; set one degree to -1 to fill the rest, e.g. parallel.dp=-1"
    ]
    problems = _world_problems(
        8, "parallel.pp=2", "parallel.tp=2", "train.global_batch_size=9", "train.micro_batch_size=3", ranks_per_node=1
    )
    text = "\n".join(problems)
    for fragment in (
        "parallel.tp=2 does not fit inside one node of 1 ranks",
        "train.global_batch_size (9) must be divisible by train.micro_batch_size (3) x data-parallel size (2)",
    ):
        assert fragment in text, (fragment, problems)
    problems = _world_problems(4, "parallel.pp=2", "train.global_batch_size=2")
    assert any("parallel.pp_schedule=1F1B needs at least 2 micro-batches per step" in p for p in problems)


@pytest.mark.parametrize(
    ("over", "fragment"),
    [
        (("parallel.tp=8",), "parallel.tp=8 does not divide model.n_heads=4"),
        (("parallel.tp=2", "data.seq_len=33", "model.max_seq_len=64"), "does not divide data.seq_len=33"),
        (("parallel.pp=2", "parallel.pp_schedule=Pipedream"), "parallel.pp_schedule: 'Pipedream' is not one of"),
        (("parallel.pp=4", "parallel.pp_schedule=Interleaved1F1B"), "= 8 pipeline stages but model.n_layers=4"),
        (("parallel.pp=2", "parallel.pp_schedule=1F1B", "parallel.pp_stages_per_rank=2"), "exactly one stage per"),
        (("parallel.pp=2", "parallel.pp_schedule=DualPipeV", "parallel.pp_stages_per_rank=3"), "stages_per_rank=2"),
        (("parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble", "train.eval_every_steps=5"), "forward-only"),
        (("parallel.fsdp.cpu_offload=true",), "parallel.fsdp.cpu_offload: not supported"),
    ],
)
def test_static_layout_rules_fail_at_load(over: tuple[str, ...], fragment: str) -> None:
    with pytest.raises(ConfigError) as e:
        _cfg(*over)
    assert any(fragment in p for p in e.value.problems), e.value.problems


@pytest.mark.parametrize(
    ("schedule", "world", "over", "fragment"),
    [
        ("1F1B", 4, ("parallel.pp=4", "train.micro_batch_size=4"), "needs at least 4 micro-batches"),
        ("DualPipeV", 2, ("parallel.pp=2", "train.micro_batch_size=4"), "needs at least 4 micro-batches per step (4"),
        ("Interleaved1F1B", 2, ("parallel.pp=2", "train.global_batch_size=5"), "in rounds of parallel.pp=2"),
    ],
)
def test_micro_batches_per_schedule(schedule: str, world: int, over: tuple[str, ...], fragment: str) -> None:
    problems = _world_problems(world, f"parallel.pp_schedule={schedule}", *over)
    assert any(fragment in p for p in problems), problems


def test_valid_layouts_pass_and_tp_across_nodes_is_opt_in() -> None:
    check_world(_cfg("parallel.pp=2", "parallel.tp=2"), 8, ranks_per_node=8)
    check_world(_cfg("parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B"), 4, ranks_per_node=4)
    problems = _world_problems(4, "parallel.tp=4", "model.n_kv_heads=4", ranks_per_node=2)
    assert any("set parallel.tp_across_nodes=true" in p for p in problems)
    check_world(_cfg("parallel.tp=4", "model.n_kv_heads=4", "parallel.tp_across_nodes=true"), 4, ranks_per_node=2)


def test_every_schedule_has_complete_rules() -> None:
    for name, info in SCHEDULES.items():
        spr = 2 if info.multi_stage else 1
        args = dict(pp=2, dp=1, tp=1, world_size=2, n_layers=4, n_heads=4, n_kv_heads=4, dim=64, ffn_dim=128)
        ok = layout_problems(
            **args,
            seq_len=32,
            tie_embeddings=False,
            schedule=name,
            stages_per_rank=spr,
            global_batch_size=8,
            micro_batch_size=2,
        )
        assert ok == [], (name, ok)


# --------------------------------------------------------------------------------------------------- stages


def test_split_layers_balances_embedding_and_head() -> None:
    assert [len(s) for s in split_layers(8, 2)] == [4, 4]
    assert [len(s) for s in split_layers(5, 2)] == [3, 2]
    # a heavy head moves layers off the last stage; ranges stay contiguous and cover every layer once
    stages = split_layers(8, 4, first_cost=0.5, last_cost=1.5)
    assert [len(s) for s in stages] == [2, 3, 2, 1] and [i for s in stages for i in s] == list(range(8))
    llama7b = ModelArgs(dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, vocab_size=32000)
    embed, head = part_costs(llama7b, 4096)
    assert 0.5 < embed < 0.8 and 0.4 < head < 0.7  # 131M-param table vs 202M per block
    assert [len(s) for s in split_layers(32, 4, first_cost=embed, last_cost=head)] == [8, 8, 8, 8]
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 stages"):
        split_layers(2, 3)


def test_stage_ids_loop_and_v() -> None:
    assert [stage_ids(r, 2, 2, style="loop") for r in range(2)] == [[0, 2], [1, 3]]
    assert [stage_ids(r, 4, 2, style="v") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]


def test_split_model_keeps_fqns() -> None:
    model = build_model(ModelArgs(dim=64, n_layers=4, n_heads=4, ffn_dim=128), device="meta")
    first = split_model(model, [0, 1], first=True, last=False)
    last = split_model(model, [2, 3], first=False, last=True)
    assert first.norm is None and first.output is None and last.tok_embeddings is None
    names = set(first.state_dict()) | set(last.state_dict())
    assert names == set(model.state_dict()) and not set(first.state_dict()) & set(last.state_dict())
    assert len(model.layers) == 4  # the original stays whole (the reference for names and shapes)


# --------------------------------------------------------------------------------------------------- data


def test_batches_reshard_without_skips_or_repeats() -> None:
    """Six global batches: three read at (pp=2, dp=2, tp=2), then the sampler state moves to (pp=1, dp=4, tp=2) for
    three more. Every rank's slice comes from its dp coordinate; together every sample is read exactly once."""

    class Ids:
        def __len__(self) -> int:
            return 100

        def __getitem__(self, i: int) -> np.ndarray:
            return np.array([i])

    def read(dims: ParallelDims, state: dict | None, steps: int) -> tuple[list[int], dict]:
        seen, end_state = [], {}
        for rank in range(dims.world_size):
            sampler = ResumableSampler(100, seed=3)
            if state:
                sampler.load_state_dict(state)
            loader = BatchLoader(Ids(), sampler, global_batch_size=8, dp_rank=dims.dp_rank(rank), dp_size=dims.dp)
            batches = [loader.next_batch().flatten().tolist() for _ in range(steps)]
            if dims.coords(rank)["tp"] == 0 and dims.coords(rank)["pp"] == 0:  # one reader per dp slice
                seen += [i for b in batches for i in b]
            end_state = loader.state_dict()
        return seen, end_state

    before, state = read(ParallelDims(pp=2, dp=2, tp=2, world_size=8), None, 3)
    after, _ = read(ParallelDims(pp=1, dp=4, tp=2, world_size=8), state, 3)
    counts = Counter(before + after)
    assert len(counts) == 48 and set(counts.values()) == {1}
    straight, _ = read(ParallelDims(pp=1, dp=1, tp=1, world_size=1), None, 6)
    assert sorted(before + after) == sorted(straight)


# --------------------------------------------------------------------------------------------------- dry run


def test_plan_applies_on_meta_with_a_fake_process_group() -> None:
    """What `hpcdist train --dry-run` needs: meshes, stage split, TP and FSDP on a meta model for any rank of a
    large world, with no real peers and nothing allocated."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hpcdist.parallel.fsdp import apply_fsdp
    from hpcdist.parallel.tp import apply_tp

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=13, world_size=16)
    try:
        dims = ParallelDims(pp=2, dp=-1, tp=4, world_size=16)
        meshes = dims.build_meshes("cpu")
        assert dims.build_meshes("cpu") is meshes  # built once
        assert dims.coords(13) == {"pp": 1, "dp": 1, "tp": 1}
        args = ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=128, vocab_size=256)
        model = build_model(args, device="meta")
        layers = split_layers(4, 2, first_cost=part_costs(args, 32)[0], last_cost=part_costs(args, 32)[1])
        stage = split_model(model, layers[1], first=False, last=True)
        apply_tp(stage, meshes["tp"], loss_parallel=True)
        apply_fsdp(
            stage,
            meshes["fsdp"],
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32,
            reshard_after_forward=False,
            cpu_offload=False,
        )
        wq = stage.layers["2"].attention.wq.weight
        assert isinstance(wq, DTensor) and wq.is_meta and wq.shape == (64, 64)
        assert wq.to_local().shape == (8, 64)  # 64 rows / tp 4 / dp 2
        assert stage.output.weight.to_local().shape == (32, 64)  # vocabulary 256 / 4 / 2
    finally:
        dist.destroy_process_group()
