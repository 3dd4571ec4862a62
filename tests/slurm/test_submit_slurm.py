"""hpcdist.submit() against the real sandbox: submitit renders the job, SLURM runs it, the handle follows it.

Both jobs (2 ranks each: rank 0's part and every rank's part both show) run side by side, driven by one module
fixture (conftest.side_by_side)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

import hpcdist
from tests.slurm.conftest import Cluster, job_info, release_requeue_hold, run_cmd, side_by_side
from tests.slurm.harness import step_losses, tiny_overrides, wait_for_step


@pytest.fixture(scope="module")
def driven(slurm_cluster: Cluster, corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Both scenarios at once; this test process acts as the login node (SLURM_CONF and PATH of the sandbox) for
    hpcdist.submit and the handles, from the drives' threads too."""
    root = tmp_path_factory.mktemp("submit")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in slurm_cluster.env.items():
            mp.setenv(key, value)
        with side_by_side(
            follows=lambda: _drive_follows(corpus_dir, root / "api"),
            preempted=lambda: _drive_preempted(slurm_cluster, corpus_dir, root / "pre"),
        ) as futures:
            yield futures


def _drive_follows(corpus: Path, run: Path) -> tuple[Any, str, Path]:  # the handle, its final state, the run
    job = hpcdist.submit(
        "configs/demo.yaml",
        tiny_overrides(run, corpus, 5),
        cluster="sandbox",
        nodes=1,
        gpus_per_node=2,
        job_name="api test 'quoted' $(x)",
    )
    return job, job.wait(timeout=240), run


def test_python_api_submits_and_follows_a_job(slurm_cluster: Cluster, driven: dict[str, Future]) -> None:
    job, state, run = driven["follows"].result()
    assert state == "COMPLETED", job.paths[0].stdout.read_text()[-3000:]
    assert job.done() and job.state == "COMPLETED"
    assert job.result()["step"] == 5
    assert sorted(step_losses(run)) == [1, 2, 3, 4, 5]
    info = job_info(slurm_cluster, job.job_id)
    assert info["NumTasks"] == "2" and info["JobName"] == "api test 'quoted' $(x)"
    assert "ranks by host" in job.paths[0].stdout.read_text()


PREEMPT_STEPS = 60


def _drive_preempted(cluster: Cluster, corpus: Path, run: Path) -> tuple[Any, str, Path]:
    job = hpcdist.submit(
        "configs/demo.yaml", tiny_overrides(run, corpus, PREEMPT_STEPS), cluster="sandbox", nodes=1, gpus_per_node=2
    )
    wait_for_step(run, 5)
    run_cmd(cluster, "scancel", "--signal=USR2", job.job_id)  # --signal=USR2@lead reaches every task
    assert release_requeue_hold(cluster, job.job_id)["Restarts"] == "1"
    return job, job.wait(timeout=300), run


def test_submitit_job_preempted_requeues_and_resumes(driven: dict[str, Future]) -> None:
    """submitit's own USR2 handler is replaced by the trainer's: all ranks save, rank 0 requeues."""
    job, state, run = driven["preempted"].result()
    assert state == "COMPLETED", job.paths[0].stdout.read_text()[-3000:]
    assert sorted(step_losses(run)) == list(range(1, PREEMPT_STEPS + 1))
    log0 = job.paths[0].stdout.read_text()
    assert "stop requested (TIME_LIMIT)" in log0 and "requeued job" in log0 and "resumed from" in log0
