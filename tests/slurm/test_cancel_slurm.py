"""`hpcdist cancel` on the SLURM sandbox: it says "cancelled" only once the controller says the job ended, and the
job's task is gone by then (the SLURM half; the local-executor half:
tests/unit/launch/test_launch.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.slurm.conftest import Cluster, job_info, sbatch, wait_job


def test_cancel_waits_until_the_job_has_ended(slurm_cluster: Cluster, tmp_path: Path) -> None:
    marker = tmp_path / "started"
    # srun: the task is a job step, as the trainer's are; it would run for ten minutes
    job = sbatch(slurm_cluster, "--ntasks=1", script=f"srun sh -c 'echo $$ > {marker}; exec sleep 600'\n")
    wait_job(slurm_cluster, job, timeout=120, states=("RUNNING",))
    for _ in range(300):
        if marker.exists() and marker.read_text().strip():
            break
        subprocess.run(["sleep", "0.1"], check=True)
    assert marker.exists(), "the job's task did not start"
    task = int(marker.read_text())
    proc = subprocess.run(
        [sys.executable, "-m", "hpcdist", "cancel", job],
        env={**slurm_cluster.env, "PYTHONPATH": str(Path(__file__).parents[2])},  # this checkout's hpcdist
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"cancelled job {job}: CANCELLED"
    assert job_info(slurm_cluster, job)["JobState"] == "CANCELLED"  # said after the fact, not before
    assert not _running(task), f"the job's task (pid {task}) still runs"


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False
