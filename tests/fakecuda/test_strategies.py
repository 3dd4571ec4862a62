"""The strategies' CUDA branches under fake CUDA: a process group made the way hpcdist.run makes it."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from hpcdist.config import JobConfig
from hpcdist.env import DistEnv, init_process_group
from hpcdist.models import build_model
from hpcdist.parallel.materialize import materialize
from hpcdist.parallel.parallelize import build_strategy
from hpcdist.rankfacts import rank_facts
from tests.fakecuda.harness import FakeCuda, fake_ranks


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
        init_process_group(env, timeout_s=60)
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
