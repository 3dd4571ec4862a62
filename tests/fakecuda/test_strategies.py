"""The strategies' CUDA branches under fake CUDA: a process group made the way hpcdist.run makes it, one step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from hpcdist.config import JobConfig
from hpcdist.env import DistEnv, init_process_group
from hpcdist.models import build_model
from hpcdist.parallel.materialize import materialize
from hpcdist.parallel.parallelize import build_strategy
from hpcdist.rankfacts import rank_facts
from hpcdist.run import process_group_env
from tests.fakecuda.harness import FakeCuda, fake_ranks


def _offload_step(env: DistEnv, fc: FakeCuda, cfg: JobConfig) -> dict[str, Any]:
    """One FSDP2 step with CPU offload on cuda:rank: gradients given by hand (no autograd under fake CUDA)."""
    facts = rank_facts(cfg, env)
    strategy = build_strategy(cfg, env, build_model(cfg.model_args(), device="meta"), facts.dims)
    params = list(strategy.model.parameters())
    for p in params:
        p.grad = torch.ones_like(p)  # a DTensor on the host, like p
    norm = strategy.optimizer_step(skip_nonfinite=True)
    return {
        "params": {(type(p).__name__, p.device.type) for p in params},
        "rope": str(strategy.model.rope_cache.device),
        "norm": float(norm),
        "skipped": strategy.last_step_skipped,
    }


def test_fsdp_cpu_offload_steps_on_an_nccl_job(small_cfg, tmp_path: Path) -> None:
    cfg = small_cfg(
        "parallel.strategy=fsdp",
        "parallel.fsdp.cpu_offload=true",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
    )

    def rank(env: DistEnv, fc: FakeCuda) -> dict[str, Any]:
        env = process_group_env(cfg, env)
        init_process_group(env, timeout_s=60)
        return _offload_step(env, fc, cfg)

    results = fake_ranks(2, rank)
    n = sum(p.numel() for p in build_model(cfg.model_args(), device="meta").parameters())
    for r in results:
        assert r["params"] == {("DTensor", "cpu")}  # offloaded: sharded master weights on the host
        assert r["rope"] == f"cuda:{results.index(r)}"  # the buffers stay on the rank's GPU
        assert not r["skipped"] and r["norm"] == pytest.approx(n**0.5)  # every rank's shard of ones, summed over ranks


def _cpu_reference(cfg: JobConfig) -> dict[str, torch.Tensor]:
    """One process on the CPU: the weights every layout must start from for cfg's seed."""
    torch.manual_seed(cfg.run.seed)
    return build_model(cfg.model_args(), device="cpu").state_dict()


def test_a_whole_model_on_cuda_starts_from_the_cpu_weights_of_its_seed(small_cfg, fake_cuda: FakeCuda) -> None:
    """DDP's and ZeRO's path (nothing sharded, one process here): the same weights as on the CPU for one seed."""
    cfg = small_cfg()
    want = _cpu_reference(cfg)
    model = build_model(cfg.model_args(), device="meta")
    materialize([model], reference=model, device=torch.device("cuda", 0), seed=cfg.run.seed)
    got = model.state_dict()
    assert set(got) == set(want) and all(v.is_cuda for v in got.values())
    for name, value in want.items():
        assert torch.equal(got[name].cpu(), value), name
    assert model.rope_cache.is_cuda


def test_ddp_and_fsdp_start_from_the_same_weights_on_cuda(small_cfg) -> None:
    """The sharded path on cuda:rank (FSDP2 over 2 ranks): rank 0's shards are the CPU reference's first rows, the
    whole-model path's values (the test above). fakenccl moves no data, so only the drawing rank 0 is compared."""
    cfg = small_cfg("parallel.strategy=fsdp", "train.global_batch_size=4", "train.micro_batch_size=2")
    want = _cpu_reference(cfg)

    def rank(env: DistEnv, fc: FakeCuda) -> dict[str, torch.Tensor]:
        init_process_group(process_group_env(cfg, env), timeout_s=60)
        strategy = build_strategy(cfg, env, build_model(cfg.model_args(), device="meta"), rank_facts(cfg, env).dims)
        shards = {}
        for name, p in strategy.model.named_parameters():
            assert isinstance(p, DTensor) and p.device == torch.device(env.device)
            shards[name] = p.to_local().cpu()
        return shards

    shards = fake_ranks(2, rank)[0]
    assert set(shards) == {n for n in want if n != "output.weight" or not cfg.model.tie_embeddings}
    for name, local in shards.items():
        assert torch.equal(local, want[name][: local.shape[0]]), name
