"""The SLURM sandbox itself: fake GPUs, srun ranks, requeue with the hold released, two hosts talking gloo.

These prove the cluster that the trainer's SLURM tests run on; they do not touch hpcdist.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

from tests.slurm.conftest import (
    SANDBOX,
    Cluster,
    job_info,
    job_output,
    release_requeue_hold,
    run_cmd,
    sbatch,
    wait_job,
)

PY = sys.executable


# ------------------------------------------------------------------------------------------- one node


def test_one_node_is_idle_with_8_gpus(slurm_cluster: Cluster) -> None:
    out = run_cmd(slurm_cluster, "sinfo", "-h", "-N", "-o", "%N %T %G %P").stdout.split()
    assert out == ["node1", "idle", "gpu:8", "debug*"]
    assert slurm_cluster.node_names == ["node1"]
    assert slurm_cluster.nodes[0]["gpus"] == 8
    st = slurm_cluster.dir.lstat()  # the munge key and slurm.conf live here: root's alone
    assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o700, os.getuid())


def test_batch_job_gets_all_8_gpus(slurm_cluster: Cluster) -> None:
    job = sbatch(
        slurm_cluster,
        "--ntasks-per-node=8",
        "--gpus-per-node=8",
        "--wrap",
        "echo CVD=$CUDA_VISIBLE_DEVICES; srun hostname",
    )
    assert wait_job(slurm_cluster, job, timeout=60) == "COMPLETED", job_info(slurm_cluster, job)
    lines = job_output(slurm_cluster, job).split()
    assert "CVD=0,1,2,3,4,5,6,7" in lines
    assert Counter(ln for ln in lines if not ln.startswith("CVD=")) == {"node1": 8}
    assert job_info(slurm_cluster, job)["ExitCode"] == "0:0"


def test_srun_gives_each_task_its_rank(slurm_cluster: Cluster) -> None:
    code = "import os; print(os.environ['SLURM_PROCID'], os.environ['SLURM_NTASKS'])"
    out = run_cmd(slurm_cluster, "srun", "-N1", "-n2", PY, "-c", code, timeout=60).stdout
    assert sorted(out.splitlines()) == ["0 2", "1 2"]


def test_requeue_restarts_the_job_with_restart_count(slurm_cluster: Cluster) -> None:
    job = sbatch(
        slurm_cluster,
        "--requeue",
        "--open-mode=append",  # keep the first run's lines when the requeued run reopens the file
        script="echo restart=${SLURM_RESTART_COUNT:-0}\nsleep 300\n",
    )
    try:
        assert wait_job(slurm_cluster, job, timeout=60, states=("RUNNING",)) == "RUNNING"
        _wait_for_line(slurm_cluster, job, "restart=0")
        run_cmd(slurm_cluster, "scontrol", "requeue", job)
        info = release_requeue_hold(slurm_cluster, job)
        assert info["Restarts"] == "1"
        _wait_for_line(slurm_cluster, job, "restart=1")
        # (slurmstepd also writes "*** JOB n ON node1 CANCELLED ... DUE TO JOB REQUEUE ***" in between)
        lines = job_output(slurm_cluster, job).split()
        assert [ln for ln in lines if ln.startswith("restart=")] == ["restart=0", "restart=1"]
    finally:
        run_cmd(slurm_cluster, "scancel", job, check=False)


def test_start_refuses_a_running_sandbox(slurm_cluster: Cluster) -> None:
    proc = _sandbox("start", "--dir", str(slurm_cluster.dir))
    assert proc.returncode != 0
    assert "already running" in proc.stderr
    assert _sandbox("status", "--dir", str(slurm_cluster.dir)).returncode == 0
    env = _sandbox("env", "--dir", str(slurm_cluster.dir)).stdout
    assert f"export SLURM_CONF={slurm_cluster.slurm_conf}" in env.splitlines()


# ------------------------------------------------------------------------------------------ two nodes

ALL_REDUCE = textwrap.dedent(
    """
    import os, socket
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    addr = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    dist.init_process_group("gloo", init_method=addr, rank=rank, world_size=world)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    print(f"rank={rank} host={socket.gethostname()} sum={t.item():g}", flush=True)
    dist.destroy_process_group()
    """
)


def test_two_nodes_run_four_tasks_each(slurm_cluster2: Cluster) -> None:
    assert slurm_cluster2.node_names == ["node1", "node2", "node3"]  # the third: the spare of the in-job tests
    out = run_cmd(slurm_cluster2, "srun", "-N2", "--ntasks-per-node=4", "hostname", timeout=60).stdout
    assert Counter(out.split()) == {"node1": 4, "node2": 4}


def test_gloo_all_reduce_across_two_hosts(slurm_cluster2: Cluster, tmp_path: Path) -> None:
    (tmp_path / "all_reduce.py").write_text(ALL_REDUCE)
    ifname = {n["ifname"] for n in slurm_cluster2.nodes}
    assert len(ifname) == 1, "both nodes name their interface the same"
    # Like a real sbatch script: the batch step runs on node1 (inside its namespace), and srun fans out.
    script = f"""\
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
export MASTER_PORT=29517
export GLOO_SOCKET_IFNAME={ifname.pop()}
srun --kill-on-bad-exit=1 {PY} all_reduce.py
"""
    job = sbatch(slurm_cluster2, "--time=3", script=script, cwd=tmp_path)
    state = wait_job(slurm_cluster2, job, timeout=170)
    out = (tmp_path / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED", out
    results = sorted(ln.split() for ln in out.splitlines() if ln.startswith("rank="))
    expected = sorted([f"rank={r}", f"host=node{1 + r // 4}", "sum=36"] for r in range(8))
    assert results == expected, out


def test_stop_removes_everything_it_started(slurm_cluster2: Cluster) -> None:
    state = json.loads((slurm_cluster2.dir / "state.json").read_text())
    daemons = [rec["pid"] for rec in state["pids"].values()] + [state["supervisor"]["pid"]]
    assert sorted(state["netns"]) == ["hpcd-n1", "hpcd-n2", "hpcd-n3"]
    assert "node2" in Path("/etc/hosts").read_text()

    proc = _sandbox("stop", "--dir", str(slurm_cluster2.dir))
    assert proc.returncode == 0, proc.stderr

    alive = [pid for pid in daemons if _running(pid)]
    assert not alive, f"still running: {alive}"
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert not set(state["netns"]) & set(netns)
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    names = {ln.split(": ")[1].split("@")[0] for ln in links.splitlines()}  # "3: hpcd-v1@if6: <...>"
    assert state["links"] and not set(state["links"]) & names
    hosts = Path("/etc/hosts").read_text().splitlines()
    assert not [ln for ln in hosts if "slurm_sandbox" in ln or ln.split()[1:] in (["node1"], ["node2"], ["node3"])]
    # The next test that asks for a cluster gets a fresh one (the autouse fixture restarts it).


# ------------------------------------------------------------------------------------------- helpers


def _sandbox(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SANDBOX), *args], capture_output=True, text=True, timeout=120)


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def _wait_for_line(cluster: Cluster, job: str, line: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while line not in job_output(cluster, job).split():
        assert time.monotonic() < deadline, f"no {line!r} from job {job}: {job_info(cluster, job)}"
        time.sleep(0.2)
