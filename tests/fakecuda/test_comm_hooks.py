"""DDP communication hooks' timing on a GPU rank: CUDA timing events on the streams the communication runs on, read
only when the meter is taken; CPU buckets keep the host's clock. (tests/gpu shows the numbers under real NCCL.)"""

from __future__ import annotations

import time

import pytest
import torch

from hpcdist.parallel.comm_hooks import CommMeter, mark
from tests.fakecuda.harness import FakeCuda


def test_a_cuda_bucket_is_timed_with_events_on_its_streams(fake_cuda: FakeCuda) -> None:
    torch.cuda.set_device(3)
    device = torch.device("cuda", 3)
    callbacks = torch.cuda.Stream(device=device)  # where a CUDA future runs its callbacks
    start = mark(device)  # in the hook: the stream the bucket's gradients were produced on
    time.sleep(0.01)
    with torch.cuda.stream(callbacks):
        end = mark(device)  # in the future's callback
    assert isinstance(start, torch.cuda.Event) and start.enable_timing and end.enable_timing
    assert start.stream == torch.cuda.current_stream(device) and end.stream == callbacks != start.stream
    meter = CommMeter(group=None)  # type: ignore[arg-type]  # the group only keys the byte counter
    meter.add_span(start, end)
    _, busy = meter.take()
    assert busy == pytest.approx(start.elapsed_time(end) / 1e3) and busy >= 0.01
    assert fake_cuda.devices_used() == {3}


def test_a_cpu_bucket_keeps_the_host_clock(fake_cuda: FakeCuda) -> None:
    before = time.perf_counter()
    t = mark(torch.device("cpu"))
    assert isinstance(t, float) and before <= t <= time.perf_counter()
