"""train.activation_checkpointing none | full | selective: the same losses, and the planner's saved bytes match what
the model keeps (measured on CPU: glibc's live heap bytes before and after one forward)."""

from __future__ import annotations

import copy
import ctypes
import gc

import pytest
import torch

from hpcdist.config import ConfigError, load
from hpcdist.models.args import ModelArgs, load_preset
from hpcdist.models.llama import build_model, precompute_rope
from hpcdist.parallel.base import cross_entropy
from hpcdist.parallel.parallelize import apply_activation_checkpointing
from hpcdist.planning.memory import saved_activation_bytes
from tests.training import train

MODES = ("none", "full", "selective")


def _losses(model: torch.nn.Module, tokens: torch.Tensor, steps: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for _ in range(steps):
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def test_every_mode_trains_to_the_same_losses_fp32():
    torch.manual_seed(0)
    args = ModelArgs(**load_preset("tiny"))  # grouped-query attention: repeat_kv runs too
    base = build_model(args, "cpu")
    tokens = torch.randint(0, args.vocab_size, (2, 33))
    losses = {}
    for mode in MODES:
        model = copy.deepcopy(base)
        apply_activation_checkpointing(model, mode)
        losses[mode] = _losses(model, tokens, 3)
    assert losses["none"][-1] < losses["none"][0]  # it trains
    for mode in ("full", "selective"):
        assert losses[mode] == pytest.approx(losses["none"], abs=1e-6), mode


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def _heap_bytes() -> int:
    """Bytes malloc has handed out and not taken back (torch's CPU allocator is malloc): arena + mmapped blocks."""
    gc.collect()
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd


try:
    _LIBC = ctypes.CDLL("libc.so.6")
    _LIBC.mallinfo2.restype = _MallInfo2
except (OSError, AttributeError):  # not glibc >= 2.33
    _LIBC = None


@pytest.mark.skipif(_LIBC is None, reason="needs glibc's mallinfo2 to measure live heap bytes")
def test_saved_bytes_match_the_planner_on_125m():
    """125m (12 layers, dim 768, untied 32k vocab) at seq 64, fp32: what one forward leaves alive for backward,
    per mode, within 10% of planning.memory.saved_activation_bytes (the model scales linearly in tokens)."""
    torch.manual_seed(0)
    args = ModelArgs(**load_preset("125m"))
    seq = 64
    tokens = torch.randint(0, args.vocab_size, (1, seq + 1))
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    measured, planned = {}, {}
    model = build_model(args)  # meta; the values do not change the bytes: zeros, not the (slow) real init
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.rope_cache = precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta)
    blocks = dict(model.layers.named_children())
    with torch.no_grad():
        model(inputs)  # warm-up: the one-time allocations (kernel scratch, thread pools) are not activations
    for mode in MODES:
        for name, block in blocks.items():  # one model, re-wrapped per mode
            model.layers.register_module(name, block)
        apply_activation_checkpointing(model, mode)
        before = _heap_bytes()
        loss = cross_entropy(model(inputs), targets)
        measured[mode] = _heap_bytes() - before
        del loss  # drops the graph and what it saved: no backward needed (125M gradients are slow here)
        planned[mode] = saved_activation_bytes(
            args, micro_batch_size=1, seq_len=seq, activation_checkpointing=mode, element_bytes=4
        )
    for mode in MODES:
        assert measured[mode] == pytest.approx(planned[mode], rel=0.10), (mode, measured, planned)
    assert measured["full"] < measured["selective"] < measured["none"]


@pytest.mark.parametrize(
    ("value", "mode"), [("true", "full"), ("false", "none"), ("selective", "selective"), ("none", "none")]
)
def test_booleans_still_accepted(value, mode):
    assert load("configs/demo.yaml", [f"train.activation_checkpointing={value}"]).train.activation_checkpointing == mode


def test_a_wrong_mode_is_refused_naming_the_key_and_the_choices():
    with pytest.raises(ConfigError) as e:
        load("configs/demo.yaml", ["train.activation_checkpointing=partial"])
    assert "train.activation_checkpointing: 'partial' is not one of none, full, selective" in str(e.value)


def test_trainer_runs_selective_and_logs_the_first_step_with_its_watchdog_allowance(small_cfg, caplog) -> None:
    """The trainer's own path (parallelize -> DDP strategy) with selective checkpointing; the first step's time
    (torch.compile's, with train.compile) is logged with the allowance the watchdog gives it."""
    from tests.dist.harness import single

    cfg = small_cfg(
        "train.steps=2",
        "train.micro_batch_size=4",
        "train.activation_checkpointing=selective",
        "fault.watchdog_slow_phase_s=321",
        "checkpoint.every_steps=0",
        "checkpoint.save_final=false",
    )
    with caplog.at_level("INFO", logger="hpcdist"):
        losses = single(train, cfg)["losses"]
    assert sorted(losses) == [1, 2]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("first step of this attempt")]
    assert len(lines) == 1 and "(warm-up; the watchdog allows up to 321 s for it" in lines[0], lines


@pytest.mark.parametrize("wrap", ["compile", "full", "selective"])
def test_a_wrapped_whole_model_materializes_like_the_plain_one(wrap):
    """ZeRO's path: the whole model is wrapped (compile, checkpointing) and then materialized as its own reference.
    Wrapping is lazy (nothing compiles until a forward), so this runs in milliseconds."""
    from hpcdist.parallel.materialize import materialize
    from hpcdist.parallel.mesh import clean_fqn
    from hpcdist.parallel.parallelize import apply_compile

    args = ModelArgs(**load_preset("tiny"))
    model = build_model(args)
    if wrap == "compile":
        apply_compile(model)
    else:
        apply_activation_checkpointing(model, wrap)
    materialize([model], reference=model, device=torch.device("cpu"), seed=7)
    torch.manual_seed(7)
    plain = build_model(args, "cpu")
    got = {clean_fqn(n): p for n, p in model.named_parameters()}
    for name, p in plain.named_parameters():
        assert torch.equal(got[name], p), name


def test_selective_recompute_may_run_ops_its_forward_did_not():
    """What a block dispatches can differ between the forward and the recompute (ZeRO-3 all-gathers a parameter in
    the recompute that its forward found fetched already): torch's own SAC modes refuse that, hpcdist's run every
    op but the saved ones plainly, and the gradient is the plain one."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from hpcdist.parallel.parallelize import _save_expensive_ops, _selective_context_fn

    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    calls = []

    def block(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        v = w.clone() if len(calls) % 2 == 0 else w  # the "gather": only in the recompute
        return torch.relu(x @ v).sin().sum()

    (want,) = torch.autograd.grad(torch.relu(x @ w).sin().sum(), w)
    out = checkpoint(block, x, use_reentrant=False, context_fn=_selective_context_fn)
    (got,) = torch.autograd.grad(out, w)
    assert torch.equal(got, want) and len(calls) == 2
    out = checkpoint(
        block, x, use_reentrant=False, context_fn=lambda: create_selective_checkpoint_contexts(_save_expensive_ops)
    )
    with pytest.raises(RuntimeError, match="not found in storage"):
        torch.autograd.grad(out, w)


def test_selective_with_tensor_parallelism_is_accepted_and_planned():
    """Selective checkpointing under tp was refused (a rank segfaulted once in CI); it runs now
    (tests/dist/test_3d.py's -sel layouts: pp2 x tp2 interleaved and dp2 x tp2 equal one process within 1e-6), so the
    config accepts it and the planner offers it at every tp."""
    over = ["parallel.strategy=3d", "parallel.tp=2", "train.activation_checkpointing=selective"]
    cfg = load("configs/demo.yaml", over)
    assert cfg.train.activation_checkpointing == "selective" and cfg.parallel.tp == 2
    from hpcdist.planning.layouts import enumerate_layouts

    rows = enumerate_layouts(
        ModelArgs(**load_preset("125m")),
        world_size=8,
        gpus_per_node=8,
        global_batch_size=16,
        seq_len=1024,
        strategies=["3d"],
    )
    assert {r.activation_checkpointing for r in rows if r.tp == 1} == {"none", "full", "selective"}
    assert {r.activation_checkpointing for r in rows if r.tp > 1} == {"none", "full", "selective"}
