"""parallel.ddp.comm_hook: refused with the reason where it cannot apply; the meter's busy time is a union."""

from __future__ import annotations

import re

import pytest

from hpcdist import config


@pytest.mark.parametrize(
    ("strategy", "reason"),
    [("zero", "1-bit Adam"), ("fsdp", "parallel.fsdp.reduce_dtype=bf16"), ("3d", "parallel.fsdp.reduce_dtype=bf16")],
)
def test_comm_hook_refused_outside_ddp(strategy: str, reason: str) -> None:
    with pytest.raises(ValueError) as e:
        config.load(None, [f"parallel.strategy={strategy}", "parallel.ddp.comm_hook=powersgd"])
    line = next(x for x in str(e.value).splitlines() if "parallel.ddp.comm_hook" in x)
    assert "applies to parallel.strategy=ddp only" in line and reason in line


def test_comm_hook_choices_and_powersgd_bounds() -> None:
    assert config.load(None, ["parallel.ddp.comm_hook=bf16"]).parallel.ddp.comm_hook == "bf16"
    with pytest.raises(ValueError, match=re.escape("parallel.ddp.comm_hook: 'int8' is not one of none, allreduce")):
        config.load(None, ["parallel.ddp.comm_hook=int8"])
    with pytest.raises(ValueError, match=re.escape("parallel.ddp.powersgd.start_iter: must be >= 2 with")):
        config.load(None, ["parallel.ddp.comm_hook=powersgd", "parallel.ddp.powersgd.start_iter=1"])
    with pytest.raises(ValueError, match=re.escape("parallel.ddp.powersgd.rank: must be >= 1")):
        config.load(None, ["parallel.ddp.powersgd.rank=0"])
    # torch's own rule: without error feedback and warm start, compression may start at once
    off = ["parallel.ddp.powersgd.use_error_feedback=false", "parallel.ddp.powersgd.warm_start=false"]
    assert config.load(None, [*off, "parallel.ddp.powersgd.start_iter=0"]).parallel.ddp.powersgd.start_iter == 0


def test_meter_busy_time_is_the_union_of_spans() -> None:
    from hpcdist.parallel.comm_hooks import CommMeter

    m = CommMeter(group=None)  # type: ignore[arg-type]  # the group only keys the byte counter
    m.add_bytes(100)
    for span in [(0.0, 1.0), (0.5, 2.0), (3.0, 3.5)]:  # two overlapping buckets, then a later one
        m.add_span(*span)
    assert m.take() == (100, 2.5)
    assert m.take() == (0, 0.0)  # taken: reset


def test_the_all_reduce_counter_is_installed_only_inside_its_window() -> None:
    """The meter counts what the hooks hand to ``dist.all_reduce``; that wrapper exists only while the strategy's
    backward runs (``CommHook.counting``), never process-wide for the rest of the process's life."""
    import torch
    import torch.distributed as dist

    from hpcdist.parallel.comm_hooks import CommHook

    original = dist.all_reduce
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        hook = CommHook("allreduce")
        assert dist.all_reduce is original  # building the hook patches nothing
        with hook.counting():
            assert dist.all_reduce is not original
            dist.all_reduce(torch.ones(10), group=hook.group)  # the hook's group: 40 bytes
            dist.all_reduce(torch.ones(7))  # the default group: not the hook's traffic
        assert dist.all_reduce is original  # undone
        assert hook.meter.take()[0] == 40
        dist.all_reduce(torch.ones(10), group=hook.group)
        assert hook.meter.take()[0] == 0  # outside the window nothing is counted
        with pytest.raises(RuntimeError), hook.counting():
            raise RuntimeError("a failed backward")
        assert dist.all_reduce is original  # undone on the way out of an error too
    finally:
        dist.destroy_process_group()
