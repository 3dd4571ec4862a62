"""Hostile names on the real cluster path: a run directory named like a shell injection goes through sbatch,
the batch script, srun and every rank as one plain argument."""

from __future__ import annotations

from pathlib import Path

from tests.slurm.conftest import REPO, Cluster, wait_job
from tests.slurm.harness import step_losses, submit, tiny_overrides


def test_hostile_run_dir_through_sbatch(slurm_cluster: Cluster, corpus_dir: Path, tmp_path: Path) -> None:
    name = 'it\'s a "run" $(touch PWNED) `touch PWNED2`; touch PWNED3'
    run = tmp_path / name
    job = submit(
        slurm_cluster,
        "train.sh",
        ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=2"],
        ["configs/demo.yaml", *tiny_overrides(run, corpus_dir, 2, "checkpoint.save_final=true")],
        tmp_path / "out.txt",
    )
    state = wait_job(slurm_cluster, job, timeout=240)
    out = (tmp_path / "out.txt").read_text()
    assert state == "COMPLETED", out[-4000:]
    assert sorted(step_losses(run)) == [1, 2]  # written into exactly that directory
    assert (run / "checkpoints" / "step-00000002" / "COMPLETE").is_file()
    for where in (tmp_path, REPO, Path.home()):
        assert not list(where.glob("PWNED*")), where
