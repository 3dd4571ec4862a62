"""The fake CUDA runtime behaves as CUDA does where the project's code depends on it (else its tests prove nothing)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from tests.fakecuda.harness import CudaLike, FakeCuda, fake_nccl


def test_cuda_tensors_hold_real_values_and_refuse_a_mixed_device_op(fake_cuda: FakeCuda) -> None:
    x = torch.randn(4, 4, device="cuda")
    assert isinstance(x, CudaLike) and x.is_cuda and x.device == torch.device("cuda", 0)
    host = x.cpu()
    assert type(host) is torch.Tensor and host.device.type == "cpu"
    torch.testing.assert_close((x @ x).sum().cpu(), (host @ host).sum())
    with pytest.raises(RuntimeError, match="same device"):
        x + torch.ones(4, 4)
    assert (x + torch.tensor(1.0)).is_cuda  # a CPU scalar is allowed, as on CUDA
    m = torch.nn.Linear(4, 4).to("cuda")
    with torch.no_grad():
        assert m(x).is_cuda and m.weight.is_cuda and isinstance(m.weight, torch.nn.Parameter)


def test_a_fused_kernel_refuses_a_cpu_step_count(fake_cuda: FakeCuda) -> None:
    p = torch.nn.Parameter(torch.ones(4, device="cuda"))
    opt = torch.optim.AdamW([p], fused=True)
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state[p]["step"].is_cuda  # torch's own fused AdamW keeps its step on the device
    opt.state[p]["step"] = torch.tensor(1.0)
    with pytest.raises(RuntimeError, match="same device"):
        opt.step()


def test_each_thread_has_its_own_current_device_and_contexts_are_recorded(fake_cuda: FakeCuda) -> None:
    torch.cuda.set_device(3)
    stream = torch.cuda.Stream(device="cuda:3")
    seen: list[int] = []
    made: list[torch.Tensor] = []

    def work() -> None:
        seen.append(torch.cuda.current_device())
        made.append(torch.ones(2).to("cuda", non_blocking=True))  # factories work in other threads too
        with torch.cuda.stream(stream):  # torch's own StreamContext: restores device 0's stream on exit
            pass

    t = threading.Thread(target=work, name="worker")
    t.start()
    t.join()
    assert seen == [0]  # a new thread starts on device 0, as in CUDA
    assert made[0].is_cuda and made[0].device.index == 0
    assert fake_cuda.contexts["worker"] == {0, 3}
    assert torch.cuda.current_device() == 3 and torch.empty(2, device="cuda").device.index == 3


def test_cuda_random_numbers_follow_the_seed_but_not_the_cpu_stream(fake_cuda: FakeCuda) -> None:
    torch.manual_seed(0)
    a = torch.randn(8, device="cuda").cpu()
    torch.manual_seed(0)
    b = torch.randn(8, device="cuda").cpu()
    torch.manual_seed(0)
    c = torch.randn(8)
    w = torch.empty(8, device="cuda")
    torch.manual_seed(0)
    torch.nn.init.normal_(w)
    assert torch.equal(a, b) and not torch.equal(a, c) and torch.equal(w.cpu(), a)


def test_pinned_memory_and_device_memory_are_accounted(fake_cuda: FakeCuda) -> None:
    assert torch.empty(4).pin_memory().is_pinned() and not torch.empty(4).is_pinned()
    assert torch.empty(4, pin_memory=True).is_pinned()
    base = torch.cuda.memory_allocated()
    big = torch.empty(1 << 20, device="cuda")
    assert torch.cuda.memory_allocated() == base + (4 << 20)
    view = big[:10]
    del big
    assert torch.cuda.memory_allocated() == base + (4 << 20)  # the view keeps the storage
    del view
    assert torch.cuda.memory_allocated() == base and torch.cuda.max_memory_allocated() >= base + (4 << 20)


def test_an_nccl_only_group_refuses_a_cpu_tensor_and_a_mixed_one_takes_both(fake_cuda: FakeCuda) -> None:
    fake_nccl()
    dist.init_process_group("cpu:gloo,cuda:fakenccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(2, device="cuda"))
        dist.all_reduce(torch.ones(2))
        nccl_only = dist.new_group([0], backend="fakenccl")
        dist.all_reduce(torch.ones(2, device="cuda"), group=nccl_only)
        with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
            dist.all_reduce(torch.ones(2), group=nccl_only)
    finally:
        dist.destroy_process_group()
