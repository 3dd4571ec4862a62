"""Per-device health: can this rank allocate on its device, and does a matmul there agree with the CPU?

A GPU with failing memory or a wedged context often still joins NCCL and then hangs or corrupts collectives;
checking it alone first tells "this GPU is broken" apart from "the network is broken".
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["device_health"]

MATMUL_N = 256
ALLOC_BYTES = 64 << 20
# fp32 on the device vs float64 on the CPU; TF32 (when a user enabled it) keeps ~1e-3 relative.
_TOLERANCE = 1e-2


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_health(device: torch.device | str, *, seed: int = 1234, alloc_bytes: int = ALLOC_BYTES) -> dict[str, Any]:
    """{"ok", "device", "name", "max_rel_err", "seconds", "error"} for one device; never raises."""
    device = torch.device(device)
    out: dict[str, Any] = {"ok": False, "device": str(device), "name": "cpu", "max_rel_err": None, "error": None}
    start = time.perf_counter()
    try:
        if device.type == "cuda":
            out["name"] = torch.cuda.get_device_name(device)
        # allocate, write and read back a block: catches out-of-memory (a leftover process) and bad memory
        block = torch.full((alloc_bytes // 4,), 3.0, device=device)
        _sync(device)
        if float(block.sum().item()) != 3.0 * block.numel():
            raise RuntimeError("a 64 MiB block filled with 3.0 does not sum to 3.0 * its length")
        del block
        gen = torch.Generator().manual_seed(seed)
        a = torch.randn(MATMUL_N, MATMUL_N, generator=gen)
        b = torch.randn(MATMUL_N, MATMUL_N, generator=gen)
        ref = a.double() @ b.double()
        got = (a.to(device) @ b.to(device)).cpu().double()
        _sync(device)
        err = float(((got - ref).abs().max() / ref.abs().max()).item())
        out["max_rel_err"] = err
        if not err <= _TOLERANCE:  # also catches NaN
            raise RuntimeError(f"matmul differs from the CPU reference by {err:.3g} (relative, max)")
        out["ok"] = True
    except Exception as err:  # a broken device raises anything: CUDA errors, OOM, NaN checks
        out["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    out["seconds"] = time.perf_counter() - start
    return out
