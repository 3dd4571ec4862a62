"""Every parallel strategy trains under a real srun: through the batch script and through ``hpcdist.submit()``.

srun gives its tasks SLURM_PROCID / SLURM_LOCALID, not torchrun's RANK / LOCAL_RANK; libraries such as DeepSpeed
read the latter (every ZeRO rank died with "DeepSpeed requires the LOCAL_RANK environment variable"),
and the tests/dist tier cannot see that because its launcher sets torchrun's variables itself.

All jobs are submitted at once by one module fixture and run side by side on the sandbox's 8 fake GPUs (a few
steps of a tiny model each); every test then waits for its own job. The whole file takes 1.5-2 minutes on 2 cores.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import hpcdist
from tests.conftest import SMALL
from tests.slurm.conftest import REPO, Cluster, job_info, wait_job
from tests.slurm.harness import step_losses, submit

STEPS = 3
DEMO = str(REPO / "configs" / "demo.yaml")
# name -> (ranks, overrides). Global batch 4 of micro-batches of 1: gradient accumulation on every layout, and
# 4 micro-batches for the 2-stage pipeline (1F1B needs at least pp of them).
STRATEGIES: dict[str, tuple[int, tuple[str, ...]]] = {
    "ddp": (2, ("parallel.strategy=ddp",)),
    "fsdp": (2, ("parallel.strategy=fsdp",)),
    # stage 2 starts, sets up and saves like stage 1 under srun (DeepSpeed's one stage_1_and_2 optimizer); its
    # numerics are tests/dist/test_zero.py's
    "zero1": (2, ("parallel.strategy=zero", "parallel.zero.stage=1")),
    "zero3": (2, ("parallel.strategy=zero", "parallel.zero.stage=3")),
    # DeepSpeed in one process still wants LOCAL_RANK and a process group
    "zero3-1rank": (1, ("parallel.strategy=zero", "parallel.zero.stage=3")),
    # pipeline x tensor parallel (dp=1): send/recv between stages, DTensor collectives inside each stage
    "3d-pp2-tp2": (4, ("parallel.strategy=3d", "parallel.pp=2", "parallel.tp=2", "parallel.dp=1")),
}


# The Python API's path differs from the batch script's in how the job starts (submitit's pickled call, routed through
# the attempt loop), not in how a strategy runs once srun has started the ranks: one strategy of each family (torch
# DDP, DeepSpeed ZeRO, the DTensor mesh with a pipeline) goes through it; every strategy goes through the script.
API_STRATEGIES = ("ddp", "zero3", "3d-pp2-tp2")


def overrides(run_dir: Path, extra: tuple[str, ...]) -> list[str]:
    return [
        *SMALL,
        f"run.dir={run_dir}",
        "data.source=synthetic",
        f"train.steps={STEPS}",
        "train.global_batch_size=4",
        "train.micro_batch_size=1",
        "train.eval_every_steps=0",
        "train.activation_checkpointing=false",
        "checkpoint.async_save=false",
        "checkpoint.save_final=true",
        # a rank that crashes ends the job FAILED at once instead of requeueing it (fault.* restart policy)
        "fault.max_failures=0",
        *extra,
    ]


@dataclass
class Job:
    run_dir: Path
    ranks: int
    strategy: str
    job_id: str
    out: Path | None = None  # the batch script's output file
    handle: Any = None  # hpcdist.submit's JobHandle


@pytest.fixture(scope="module")
def jobs(slurm_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str], Job]]:
    """Submit every (path, strategy) job before any test waits, so they run concurrently."""
    root = tmp_path_factory.mktemp("strategies")
    submitted: dict[tuple[str, str], Job] = {}
    with pytest.MonkeyPatch.context() as mp:
        # hpcdist.submit and JobHandle talk to SLURM from this process: act as the sandbox's login node
        for key, value in slurm_cluster.env.items():
            mp.setenv(key, value)
        for name, (ranks, extra) in STRATEGIES.items():
            strategy = extra[0].partition("=")[2]
            run, out = root / f"sbatch-{name}", root / f"sbatch-{name}.out"
            # train.sh's defaults are one real 8-GPU node with 16 CPUs per task; submit() adds the sandbox's job
            # environment (ethernet NCCL profile: gloo on CPU, one thread per rank)
            args = [
                f"--job-name=sb-{name}",
                "--nodes=1",
                f"--ntasks-per-node={ranks}",
                f"--gpus-per-node={ranks}",
                "--cpus-per-task=1",
            ]
            job_id = submit(slurm_cluster, "train.sh", args, [DEMO, *overrides(run, extra)], out)
            submitted["sbatch", name] = Job(run, ranks, strategy, job_id, out=out)
            if name not in API_STRATEGIES:
                continue
            run = root / f"api-{name}"
            handle = hpcdist.submit(
                DEMO, overrides(run, extra), cluster="sandbox", nodes=1, gpus_per_node=ranks, job_name=f"api-{name}"
            )
            submitted["api", name] = Job(run, ranks, strategy, handle.job_id, handle=handle)
        yield submitted


def assert_trained(job: Job, log: str) -> None:
    assert f"{job.strategy} on {job.ranks} rank(s)" in log, log[-3000:]
    assert sorted(step_losses(job.run_dir)) == list(range(1, STEPS + 1)), log[-3000:]
    assert (job.run_dir / "checkpoints" / f"step-{STEPS:08d}" / "COMPLETE").is_file(), log[-3000:]


@pytest.mark.slurm
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_batch_script_trains(slurm_cluster: Cluster, jobs: dict[tuple[str, str], Job], name: str) -> None:
    """`sbatch --ntasks-per-node=N --gpus-per-node=N sbatch/train.sh configs/demo.yaml <strategy> ...`"""
    job = jobs["sbatch", name]
    state = wait_job(slurm_cluster, job.job_id, timeout=420)
    log = job.out.read_text(errors="replace") if job.out and job.out.exists() else ""
    assert state == "COMPLETED", log[-4000:]
    assert_trained(job, log)


@pytest.mark.slurm
@pytest.mark.parametrize("name", API_STRATEGIES)
def test_python_api_trains(slurm_cluster: Cluster, jobs: dict[tuple[str, str], Job], name: str) -> None:
    """`hpcdist.submit(configs/demo.yaml, [<strategy> ...], cluster="sandbox", gpus_per_node=N)`"""
    job = jobs["api", name]
    state = wait_job(slurm_cluster, job.job_id, timeout=420)
    log = "\n".join(p.stdout.read_text(errors="replace") for p in job.handle.paths if p.stdout.exists())
    errors = "\n".join(p.stderr.read_text(errors="replace")[-2000:] for p in job.handle.paths if p.stderr.exists())
    assert state == "COMPLETED", (log + errors)[-4000:]
    assert job_info(slurm_cluster, job.job_id)["NumTasks"] == str(job.ranks)
    assert_trained(job, log)
    assert [r["step"] for r in job.handle.results(timeout=60)] == [STEPS] * job.ranks


@pytest.mark.slurm
def test_every_layout_trains_alike(slurm_cluster: Cluster, jobs: dict[tuple[str, str], Job]) -> None:
    """Same model, seed, data and global batch: every strategy and launch path computes the same losses (fp32
    round-off apart), so each one did real data-parallel / sharded / pipelined work, not just some steps."""
    for job in jobs.values():
        wait_job(slurm_cluster, job.job_id, timeout=420)
    ref = step_losses(jobs["sbatch", "ddp"].run_dir)
    assert sorted(ref) == list(range(1, STEPS + 1))
    for (path, name), job in jobs.items():
        got = step_losses(job.run_dir)
        assert sorted(got) == sorted(ref), f"{path} {name}: steps {sorted(got)}"
        torch.testing.assert_close(
            [got[s] for s in sorted(ref)], [ref[s] for s in sorted(ref)], rtol=1e-5, atol=0, msg=f"{path} {name}"
        )
