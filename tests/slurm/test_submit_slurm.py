"""hpcdist.submit() against the real sandbox: submitit renders the job, SLURM runs it, the handle follows it."""

from __future__ import annotations

from pathlib import Path

import pytest

import hpcdist
from tests.slurm.conftest import Cluster, job_info, release_requeue_hold, run_cmd
from tests.slurm.test_train_slurm import step_losses, tiny_overrides, wait_for_step


@pytest.fixture
def login_env(slurm_cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    """This test process acts as the login node: SLURM_CONF and PATH of the sandbox."""
    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    return slurm_cluster


def test_python_api_submits_and_follows_a_job(login_env: Cluster, corpus_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "api"
    job = hpcdist.submit(
        "configs/demo.yaml",
        tiny_overrides(run, corpus_dir, 5),
        cluster="sandbox",
        nodes=1,
        gpus_per_node=4,
        job_name="api test 'quoted' $(x)",
    )
    assert job.wait(timeout=240) == "COMPLETED", job.paths[0].stdout.read_text()[-3000:]
    assert job.done() and job.state == "COMPLETED"
    assert job.result()["step"] == 5
    assert sorted(step_losses(run)) == [1, 2, 3, 4, 5]
    info = job_info(login_env, job.job_id)
    assert info["NumTasks"] == "4" and info["JobName"] == "api test 'quoted' $(x)"
    assert "ranks by host" in job.paths[0].stdout.read_text()


def test_submitit_job_preempted_requeues_and_resumes(login_env: Cluster, corpus_dir: Path, tmp_path: Path) -> None:
    """submitit's own USR2 handler is replaced by the trainer's: all ranks save, rank 0 requeues."""
    run, steps = tmp_path / "pre", 60
    job = hpcdist.submit(
        "configs/demo.yaml", tiny_overrides(run, corpus_dir, steps), cluster="sandbox", nodes=1, gpus_per_node=4
    )
    wait_for_step(run, 5)
    run_cmd(login_env, "scancel", "--signal=USR2", job.job_id)  # --signal=USR2@lead reaches every task
    assert release_requeue_hold(login_env, job.job_id)["Restarts"] == "1"
    assert job.wait(timeout=300) == "COMPLETED", job.paths[0].stdout.read_text()[-3000:]
    assert sorted(step_losses(run)) == list(range(1, steps + 1))
    log0 = job.paths[0].stdout.read_text()
    assert "stop requested (TIME_LIMIT)" in log0 and "requeued job" in log0 and "resumed from" in log0
