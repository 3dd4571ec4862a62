"""hpcdist.planning.layouts: the step-time model against hand arithmetic, layout enumeration, ranking, auto, the CLI."""

from __future__ import annotations

import dataclasses

import pytest

from hpcdist import config as config_mod
from hpcdist.cli import main
from hpcdist.launch import load_cluster
from hpcdist.models.args import ModelArgs, flops_per_token, load_preset, num_params
from hpcdist.parallel.dims import parallel_dims
from hpcdist.planning.layouts import (
    HardwareConfig,
    Layout,
    apply_layout,
    choose,
    cluster_hardware,
    enumerate_layouts,
    estimate_step,
    layout_of,
    rank_layouts,
    resolve_auto,
)
from hpcdist.planning.memory import GIB, estimate_3d_memory, estimate_memory

# A model small enough to count by hand (see test_tiny_model_counts): 4 layers, dim 64, vocab 1000.
TINY = ModelArgs(vocab_size=1000, dim=64, n_layers=4, n_heads=4, ffn_dim=128)
# Round hardware numbers so every intermediate below is checkable on paper: 1e14 FLOP/s x 0.5 = 5e13 FLOP/s,
# 100 GB/s inside a node, a deliberately slow 1 GB/s across nodes (so overlap and exposure both show).
HW = HardwareConfig(
    gpu_mem_gb=80,
    bf16_peak_tflops=100,
    intra_node_busbw_gbps=100,
    inter_node_busbw_gbps=1,
    efficiency=0.5,
    margin_gib=0,
)
A100 = HardwareConfig(gpu_mem_gb=80, bf16_peak_tflops=312, intra_node_busbw_gbps=230, inter_node_busbw_gbps=190)
RATE, INTRA, INTER = 5e13, 1e11, 1e9
S = 128


def exposed(t: float, window: float, units: int) -> float:
    """The docstring's rule, restated: one unit's share always shows, the rest hides behind the window."""
    return t / units + max(0.0, t * (units - 1) / units - window)


def test_tiny_model_counts():
    # attention 4*64*64 = 16384, SwiGLU 3*64*128 = 24576, norms 2*64: 41088 per layer; tables 2 x 64000; final norm 64
    assert num_params(TINY) == 4 * 41088 + 2 * 64000 + 64 == 292_416
    # 6 * (292416 - 64000) + 12 * 4 layers * 64 * 128
    assert flops_per_token(TINY, S) == 6 * 228_416 + 12 * 4 * 64 * 128 == 1_763_712


def test_hand_computed_ddp_two_nodes():
    """DDP on 2 nodes x 8, micro batch 2, global batch 64: m = 64 / (2 x 16) = 2 micro-batches."""
    ddp = Layout(1, 16, 1, 2, False, dp_replicate=16)  # every dp rank a replica: the ddp row
    assert (ddp.strategy, ddp.dp_shard, ddp.dims.ddp_enabled) == ("ddp", 1, True)
    e = estimate_step(TINY, ddp, seq_len=S, global_batch_size=64, gpus_per_node=8, hw=HW)
    c_fwd = 2 * 128 * 1_763_712 / 3 / RATE  # = 3.01006848e-6 s
    c_bwd = 2 * c_fwd  # no checkpointing
    assert e.microbatches == 2
    assert e.compute_s == pytest.approx(2 * (c_fwd + c_bwd))
    # fp32 gradient all-reduce over 16 ranks spanning 2 nodes: 2 * 15/16 * 4 * 292416 B / 1 GB/s = 2.19312 ms
    allreduce = 2 * 15 / 16 * 4 * 292_416 / INTER
    assert allreduce == pytest.approx(2.19312e-3)
    assert e.dp_comm_s == pytest.approx(allreduce)
    # only the last micro-batch's backward carries it; 4 layers -> one layer's share (1/4) always shows
    assert e.dp_exposed_s == pytest.approx(allreduce / 4 + (allreduce * 3 / 4 - c_bwd))
    assert e.step_s == pytest.approx(2 * (c_fwd + c_bwd) + e.dp_exposed_s)
    assert e.step_s == pytest.approx(2.20516027e-3)  # the same sum done by hand on paper
    assert e.tokens_per_s_per_gpu == pytest.approx(64 * 128 / (e.step_s * 16))
    assert e.mfu == pytest.approx(e.tokens_per_s_per_gpu * 1_763_712 / 1e14)
    assert e.days(1e9) == pytest.approx(1e9 / (e.tokens_per_s_per_gpu * 16) / 86400)


def test_hand_computed_3d_pipeline_tensor_parallel():
    """pp=2 x dp=4 x tp=2 on 2 nodes x 8, micro batch 1, global batch 32 (m = 8), activation checkpointing on."""
    layout = Layout(pp=2, dp=4, tp=2, micro_batch_size=1, activation_checkpointing=True)
    e = estimate_step(TINY, layout, seq_len=S, global_batch_size=32, gpus_per_node=8, hw=HW, reduce_bytes=4)
    m, pp, layers = 8, 2, 2  # 4 layers over 2 stages
    c_fwd = 1 * 128 * 1_763_712 / 3 / (2 * 2) / RATE
    # backward (2x) + the recomputed blocks: the forward less the output head (2*V*D of its 1_763_712 / 3 per token)
    c_bwd = 2 * c_fwd + c_fwd * (1_763_712 / 3 - 2 * 1000 * 64) / (1_763_712 / 3)
    act = 1 * 128 * 64 * 2  # one bf16 hidden state: 16384 bytes
    t_tp = (4 + 2) * layers * (2 * 1 / 2) * act / INTRA  # 6 all-reduce volumes per layer, tp=2 in a node
    t_p2p = 2 * (act / 2) / (INTER / 8)  # 16 ranks span 2 nodes: one NIC's share of the node's bandwidth
    t_mb = c_fwd + c_bwd + t_tp + t_p2p
    assert e.tp_comm_s == pytest.approx(m * t_tp)
    assert e.p2p_s == pytest.approx(m * t_p2p)
    assert e.bubble_s == pytest.approx((pp - 1) * t_mb)  # bubble fraction (pp-1)/(m+pp-1) = 1/9 of the pipe
    # FSDP over dp=4 (dp*tp = 8 ranks: one node); the stage (2 blocks + head: 146240 params) / tp = 73120
    p_g = 73_120
    gather = 3 / 4 * 2 * p_g / INTRA  # once, in the first micro-batch's forward (stage kept gathered)
    scatter = 3 / 4 * 4 * p_g / INTRA  # fp32 reduce-scatter, once, in the last micro-batch's backward
    assert e.dp_comm_s == pytest.approx(gather + scatter)
    assert e.dp_exposed_s == pytest.approx(exposed(gather, c_fwd, layers) + exposed(scatter, c_bwd, layers))
    assert e.step_s == pytest.approx((m + pp - 1) * t_mb + e.dp_exposed_s)


def test_hand_computed_hsdp_and_zero1():
    # hsdp on 2 nodes x 8 (2 replicas x 8 shards), micro batch 4, global 64: m = 1
    hsdp = Layout(1, 16, 1, 4, False, dp_replicate=2)
    assert (hsdp.strategy, hsdp.dp_label, hsdp.dims.hsdp_enabled) == ("hsdp", "2x8", True)
    e = estimate_step(TINY, hsdp, seq_len=S, global_batch_size=64, gpus_per_node=8, hw=HW, reduce_bytes=4)
    c_fwd = 4 * 128 * 1_763_712 / 3 / RATE
    gather = 7 / 8 * 2 * 292_416 / INTRA  # inside the node
    last = 7 / 8 * 4 * 292_416 / INTRA + 2 * 1 / 2 * 4 * 292_416 / 8 / INTER  # + all-reduce of a shard, 2 replicas
    assert e.dp_comm_s == pytest.approx(2 * gather + last)
    assert e.dp_exposed_s == pytest.approx(exposed(gather, c_fwd, 4) + exposed(gather + last, 2 * c_fwd, 4))
    # zero1 in one node of 8, micro batch 8, global 64: RS in the backward, AG of bf16 params after the step
    z = estimate_step(
        TINY, Layout(1, 8, 1, 8, False, zero_stage=1), seq_len=S, global_batch_size=64, gpus_per_node=8, hw=HW
    )
    c_bwd = 2 * 8 * 128 * 1_763_712 / 3 / RATE
    rs = ag = 7 / 8 * 2 * 292_416 / INTRA
    assert z.dp_exposed_s == pytest.approx(exposed(rs, c_bwd, 4) + ag)  # nothing hides the after-step gather


def test_memory_3d_by_hand_and_reduces_to_fsdp_hsdp():
    e = estimate_3d_memory(
        TINY, tp=2, pp=2, dp=4, micro_batch_size=1, seq_len=S, activation_checkpointing=True, microbatches=8
    )
    p_s, unit = 73_120, 128_064 // 2  # stage / tp; largest FSDP unit (embeddings + head root) / tp
    assert e.params == 4 * p_s // 4 + 2 * unit + 2 * p_s  # + the stage kept gathered in bf16 under pp
    assert e.grads == 4 * p_s // 4 + 4 * unit + 4 * p_s  # + FSDP2's unsharded fp32 grads while accumulating
    assert e.optimizer == 8 * p_s // 4
    sbh = 128 * 64
    # one layer recomputed (no checkpointing's saved bytes per token, tp=2 with sequence parallelism): two norms
    # (4D + 2*2D each) / 2 + (roped q, k, v, SDPA out: 2D each + fp32 log-sum-exp 4H + SwiGLU's 4 x 2F) / 2
    layer = (2 * (4 * 64 + 4 * 64)) // 2 + (4 * 2 * 64 + 4 * 4 + 4 * 2 * 128) // 2
    head = 4 * 64 + 4 * 64 + 4 * 1000 // 2  # final norm + vocabulary-sharded fp32 log-softmax, per token
    first = 2 * 2 * (2 * sbh // 2) + 128 * layer  # 2 micro-batches in flight x 2 layers x inputs + 1 recomputed
    last = 2 * (2 * sbh // 2) + 128 * layer + 128 * head  # one in flight + the head
    assert e.activations == max(first, last) == last
    # tp = pp = 1 with one micro-batch is estimate_memory's fsdp / hsdp accounting exactly
    args, kw = ModelArgs(**load_preset("1.3b")), dict(micro_batch_size=2, seq_len=2048, activation_checkpointing=True)
    for replicate in (1, 4):
        ref = estimate_memory(
            args,
            strategy="hsdp" if replicate > 1 else "fsdp",
            world_size=32,
            gpus_per_node=8,
            fsdp_replicate=replicate,
            **kw,
        )
        got = estimate_3d_memory(args, tp=1, pp=1, dp=32, dp_shard=32 // replicate, **kw)
        assert dataclasses.astuple(got)[1:7] == dataclasses.astuple(ref)[1:7]


def test_enumeration_respects_the_rules():
    args = ModelArgs(**load_preset("13b"))
    layouts = enumerate_layouts(args, world_size=32, gpus_per_node=8, global_batch_size=256, seq_len=4096)
    assert {lay.strategy for lay in layouts} == {"ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp", "3d"}
    for lay in layouts:
        assert lay.world_size == 32 and 256 % (lay.micro_batch_size * lay.dp) == 0
        m = 256 // (lay.micro_batch_size * lay.dp)
        assert lay.pp == 1 or m >= lay.pp
        assert lay.tp in (1, 2, 4, 8) and 40 % lay.tp == 0 and lay.pp <= 40
        assert lay.strategy != "3d" or (lay.tp, lay.pp) != (1, 1)
    # one node: no hsdp; heads that tp=8 cannot split (12 heads) drop tp=8 rows
    one = ModelArgs(vocab_size=1000, dim=96, n_layers=4, n_heads=12, ffn_dim=256)
    small = enumerate_layouts(one, world_size=8, gpus_per_node=8, global_batch_size=16, seq_len=64)
    assert "hsdp" not in {lay.strategy for lay in small}
    assert {lay.tp for lay in small} == {1, 2, 4}
    with pytest.raises(ValueError, match="whole number of nodes"):
        enumerate_layouts(args, world_size=12, gpus_per_node=8, global_batch_size=48, seq_len=4096)


def test_13b_on_32_a100_top_row_fits_and_lands_near_published_numbers():
    args = ModelArgs(**load_preset("13b"))
    ranked = rank_layouts(args, world_size=32, gpus_per_node=8, global_batch_size=256, seq_len=4096, hw=A100)
    top = choose(ranked)
    assert top is ranked[0] and top.fits and top.memory.total <= 78 * GIB
    fitting = [e for e in ranked if e.fits]
    for group in ([e for e in fitting if not e.tight], [e for e in fitting if e.tight]):  # roomy rows, then tight
        assert [e.tokens_per_s_per_gpu for e in group] == sorted((e.tokens_per_s_per_gpu for e in group), reverse=True)
    assert fitting == sorted(fitting, key=lambda e: e.tight)
    assert all(not e.fits for e in ranked[len(fitting) :])
    # published 13B on 32-64 A100-80GB: 52-61% MFU, ~1,900-2,260 tokens/s/GPU (README "Planner")
    assert 0.50 <= top.mfu <= 0.65 and 1_800 <= top.tokens_per_s_per_gpu <= 2_400
    assert not any(e.fits for e in ranked if e.layout.strategy == "ddp")  # 16 bytes/param: 217 GiB


def test_nothing_fits_is_a_clear_error():
    args = ModelArgs(**load_preset("13b"))
    tiny_gpu = dataclasses.replace(A100, gpu_mem_gb=4, margin_gib=0)
    ranked = rank_layouts(args, world_size=8, gpus_per_node=8, global_batch_size=64, seq_len=4096, hw=tiny_gpu)
    with pytest.raises(ValueError, match=r"none of .* layouts fits"):
        choose(ranked)


def test_hardware_from_cluster_profiles():
    hw = cluster_hardware(load_cluster("a100_ib"))
    # one hardware type: the cluster profile's own block, checked for the planner
    assert hw == load_cluster("a100_ib").hardware
    assert (hw.gpu_mem_gb, hw.bf16_peak_tflops, hw.intra_node_busbw_gbps, hw.inter_node_busbw_gbps) == (
        80,
        312,
        230,
        190,
    )
    with pytest.raises(ValueError, match=r"hardware\.gpu_mem_gb.*a100_ib.yaml"):
        cluster_hardware(load_cluster("sandbox"))
    with pytest.raises(ValueError, match="efficiency: must be in"):
        cluster_hardware(load_cluster("a100_ib"), efficiency=1.5)


# --------------------------------------------------------------------------------------------------- auto


def load_13b(*overrides: str) -> config_mod.JobConfig:
    return config_mod.load("configs/train_13b.yaml", list(overrides))


def test_resolve_auto_returns_the_top_runnable_row_as_a_valid_config():
    cfg = load_13b("parallel.strategy=ddp", "train.micro_batch_size=1")
    new, reason = resolve_auto(cfg, 32, "a100_ib")
    assert config_mod.check(new) == []
    config_mod.check_world(new, 32, ranks_per_node=8)
    args = cfg.model_args()
    ranked = rank_layouts(args, world_size=32, gpus_per_node=8, global_batch_size=256, seq_len=4096, hw=A100)
    assert layout_of(new, 32) == ranked[0].layout
    assert reason.startswith("parallel.strategy=auto on 32 GPUs (a100_ib): row 1 of ")
    assert "tokens/s/GPU" in reason and "MFU" in reason
    assert cfg.parallel.strategy == "ddp"  # the input is left alone
    assert new.train.global_batch_size == cfg.train.global_batch_size and new.data.seq_len == cfg.data.seq_len


def test_resolve_auto_skips_rows_the_config_cannot_run(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(config_mod.rules, "STRATEGIES", ("ddp", "fsdp"))  # a build without zero and 3d
    new, reason = resolve_auto(load_13b("parallel.strategy=ddp"), 32, load_cluster("a100_ib"))
    assert new.parallel.strategy == "fsdp"
    assert "skipped higher rows" in reason and "zero3: parallel.strategy" in reason and "3d:" in reason


def test_resolve_auto_errors():
    cfg = load_13b("parallel.strategy=ddp")
    with pytest.raises(config_mod.ConfigError, match="gpus_per_node: 0"):
        resolve_auto(cfg, 2, "local")
    with pytest.raises(config_mod.ConfigError, match=r"none of .* layouts fits"):
        resolve_auto(cfg, 8, "a100_ib", hardware=dataclasses.replace(A100, gpu_mem_gb=4, margin_gib=0))


def test_apply_layout_sets_every_key_and_round_trips():
    cfg = load_13b("parallel.strategy=ddp")
    for layout in (
        Layout(1, 32, 1, 4, True, zero_stage=2),
        Layout(1, 32, 1, 2, True, dp_replicate=4),
        Layout(2, 8, 2, 1, False),
    ):
        new, missing = apply_layout(cfg, layout)
        assert missing == []
        assert layout_of(new, 32) == layout
        # the planner's layout is the trainer's: the config's ParallelDims has the layout's degrees
        assert parallel_dims(new, 32).describe() == layout.dims.describe()
    assert new.parallel.pp_schedule == "1F1B"


# --------------------------------------------------------------------------------------------------- CLI


def test_cli_plan_ranked_table(capsys: pytest.CaptureFixture[str]):
    assert main(["plan", "configs/train_13b.yaml", "--nodes", "4", "--gpus-per-node", "8", "--top", "5"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["rank", "strategy"])
    rows = [line.split() for line in lines[head + 1 : head + 6]]
    assert [r[0] for r in rows] == ["1", "2", "3", "4", "5"]
    assert all(r[8] == "yes" and float(r[7]) <= 78 for r in rows)
    speeds = [float(r[9].replace(",", "")) for r in rows]
    assert speeds == sorted(speeds, reverse=True)
    assert "days = time to train 262.1B tokens" in out  # default: steps x global batch x seq_len
    assert "auto would take row 1" in out and "as overrides:" in out


def test_cli_plan_options(capsys: pytest.CaptureFixture[str]):
    argv = ["plan", "configs/train_13b.yaml", "--nodes", "2", "--tokens", "1T", "--efficiency", "0.5", "--all"]
    assert main([*argv, "--mem-margin", "4", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "time to train 1.00T tokens" in out and "efficiency 0.50" in out and "(76 usable)" in out
    assert "   -  " in out  # --all lists rows that do not fit, unranked


@pytest.mark.parametrize(
    ("option", "value", "fragment"),
    [
        ("--tokens", "lots", "--tokens"),
        ("--efficiency", "1.5", "--efficiency"),
        ("--mem-margin", "-1", "--mem-margin"),
        ("--top", "0", "--top"),
    ],
)
def test_cli_plan_rejects_bad_options(capsys: pytest.CaptureFixture[str], option: str, value: str, fragment: str):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "configs/train_13b.yaml", f"{option}={value}"])
    assert exc.value.code == 2
    assert fragment in capsys.readouterr().err


def test_cli_plan_exits_1_when_nothing_fits(capsys: pytest.CaptureFixture[str]):
    argv = ["plan", "configs/train_13b.yaml", "--nodes", "1", "--gpus-per-node", "8", "--gpu-mem", "4"]
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert "0 fit" in out and "auto would take" not in out  # the tables still print
    assert err.count("\n") == 1 and err.startswith("hpcdist: plan: none of ")
    assert "fits: the smallest needs 35.2 GiB per GPU, 2 GiB usable" in err


def test_cli_plan_cluster_without_hardware(capsys: pytest.CaptureFixture[str]):
    assert main(["plan", "configs/train_13b.yaml", "--cluster", "sandbox"]) == 2
    assert "hardware.bf16_peak_tflops" in capsys.readouterr().err


def test_zero_counts_the_whole_fp32_model_it_builds_on_every_gpu() -> None:
    """hpcdist.parallel.parallelize.build_zero materializes the whole fp32 model on every GPU before DeepSpeed
    partitions it (4 bytes/param, however many ranks): 13B on 32 A100-40GB fits in the step, not in the build."""
    args = ModelArgs(**load_preset("13b"))
    p = num_params(args)
    common = {"world_size": 32, "gpus_per_node": 8, "micro_batch_size": 1, "seq_len": 4096}
    z3 = estimate_memory(args, strategy="zero3", activation_checkpointing="selective", **common)
    assert z3.build == 4 * p + GIB  # + the CUDA context, as the step's buffers count it
    assert z3.total < 38 * GIB < z3.build  # step 32 GiB, build 49.5 GiB
    assert z3.fits(80 * GIB) and not z3.fits(38 * GIB)
    for strategy in ("zero1", "zero2"):
        other = estimate_memory(args, strategy=strategy, activation_checkpointing="selective", **common)
        assert other.build == z3.build
    # sharded on meta before anything is allocated: the build never exceeds the step
    assert estimate_memory(args, strategy="fsdp", activation_checkpointing="full", **common).build == 0


def test_auto_never_picks_a_zero_layout_whose_build_does_not_fit() -> None:
    # 70B: the fp32 model alone is 280 GB, more than any GPU; the planner used to rank zero3 first here
    args = ModelArgs(**load_preset("70b"))
    ranked = rank_layouts(args, world_size=64, gpus_per_node=8, global_batch_size=512, seq_len=4096, hw=A100)
    zero = [e for e in ranked if e.layout.zero_enabled]
    assert zero and not any(e.fits for e in zero)
    assert any(e.memory.total <= A100.usable_bytes for e in zero)  # the step alone would have fitted
    assert ranked[0].fits and not ranked[0].layout.zero_enabled


def test_plan_shows_the_zero_build_peak_the_code_allocates(capsys) -> None:
    assert main(["plan", "configs/train_13b.yaml", "--nodes", "4", "--gpus-per-node", "8", "--gpu-mem", "40GB"]) == 0
    out = capsys.readouterr().out
    header = next(line.split("  ") for line in out.splitlines() if line.split()[:1] == ["strategy"])
    build_col = [c.strip() for c in header if c.strip()].index("build GiB")
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["zero3"], ["fsdp"])}
    want = (4 * num_params(ModelArgs(**load_preset("13b"))) + GIB) / GIB
    assert float(rows["zero3"][build_col]) == pytest.approx(want, abs=0.05)
    assert rows["zero3"][7] == "no"  # 40 GB: the step fits, the build does not
    assert rows["fsdp"][build_col] == "-"
