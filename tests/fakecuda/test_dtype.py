"""``train.dtype: auto`` on GPUs of different compute capabilities (the fake runtime reports the capability)."""

from __future__ import annotations

import pytest
import torch

from hpcdist import config as config_mod
from hpcdist.parallel.parallelize import autocast_dtype, grad_scaler, train_dtype, zero_ds_config
from tests.fakecuda.harness import FakeCuda, install


@pytest.mark.parametrize(
    ("capability", "name", "want"),
    [
        ((7, 0), "Tesla V100-SXM2-32GB", torch.float16),  # no bf16 tensor cores; SDPA's fused kernels refuse bf16
        ((8, 0), "NVIDIA A100-SXM4-80GB", torch.bfloat16),
        ((9, 0), "NVIDIA H100 80GB HBM3", torch.bfloat16),
    ],
)
def test_auto_dtype_follows_the_gpus_compute_capability(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], name: str, want: torch.dtype
) -> None:
    ddp = config_mod.load(None, [])
    zero = config_mod.load(None, ["parallel.strategy=zero", "parallel.zero.stage=2"])
    assert ddp.train.dtype == zero.train.dtype == "auto"
    with install(FakeCuda(1, capability=capability, name=name), monkeypatch):
        device = torch.device("cuda", 0)
        assert autocast_dtype(train_dtype(ddp, device)) is want
        # fp16 trains with the dynamic loss scaler, bf16 without one
        scaler = grad_scaler(ddp, device)
        assert (scaler is not None) == (want is torch.float16)
        ds = zero_ds_config(zero, dp_size=8, device=device)
        assert ds["bf16"]["enabled"] == (want is torch.bfloat16)
        assert ds.get("fp16", {}).get("enabled", False) == (want is torch.float16)
        # tensor- and pipeline-parallel stages have no loss scaler (the config refuses fp16 there): bf16
        three_d = config_mod.load(None, ["parallel.strategy=3d", "parallel.tp=2"])
        assert train_dtype(three_d, device) == "bf16" and grad_scaler(three_d, device) is None
    # no autocast on the CPU
    assert train_dtype(ddp, torch.device("cpu")) == "fp32" and autocast_dtype("fp32") is None
