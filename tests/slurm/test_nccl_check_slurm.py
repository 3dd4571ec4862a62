"""`sbatch sbatch/nccl_check.sh` on the real two-node sandbox: both hosts reported, and a link throttled with
`tc tbf` (on the host side of node2's veth, i.e. everything sent to node2) named by the slow-node finder."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.slurm.conftest import REPO, Cluster, run_cmd, wait_job
from tests.slurm.harness import NCCL_CHECK

# The ethernet profile resolves GLOO_SOCKET_IFNAME=auto to eth0 inside each namespace (gloo across the two hosts
# needs it), as it does for training jobs. 2 ranks per node keep the 2-core machine from thrashing.
JOB_ENV = {"HPCDIST_NCCL_PROFILE": "ethernet", "OMP_NUM_THREADS": "1"}
SHAPE = ["--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1"]
THROTTLE = ["tbf", "rate", "100mbit", "burst", "64kb", "latency", "200ms"]


def submit(cluster: Cluster, out: Path, report: Path) -> tuple[str, str, dict]:
    """Run the batch script as a user would; -> (final state, job output, JSON report)."""
    args = [*SHAPE, f"--output={out}", str(REPO / "sbatch" / "nccl_check.sh"), *NCCL_CHECK, "--json", str(report)]
    proc = run_cmd(cluster, "sbatch", "--parsable", *args, cwd=REPO, env={**cluster.env, **JOB_ENV})
    state = wait_job(cluster, proc.stdout.strip().split(";")[0], timeout=300)
    return state, out.read_text() if out.exists() else "", json.loads(report.read_text()) if report.exists() else {}


def host_side_veth(node: dict) -> str:
    """The bridge-side end of a node's veth pair: the interface whose index eth0 in the namespace points at."""
    inner = subprocess.run(
        ["ip", "-n", node["netns"], "-o", "link", "show", node["ifname"]], capture_output=True, text=True, check=True
    ).stdout
    peer = re.search(r"@if(\d+):", inner)
    assert peer, inner
    for line in subprocess.run(
        ["ip", "-o", "link", "show"], capture_output=True, text=True, check=True
    ).stdout.splitlines():
        index, name = line.split(":")[:2]
        if index.strip() == peer.group(1):
            return name.strip().split("@")[0]
    raise AssertionError(f"no interface with index {peer.group(1)} for {node['name']}")


@contextmanager
def throttled(ifname: str) -> Iterator[None]:
    subprocess.run(["tc", "qdisc", "add", "dev", ifname, "root", *THROTTLE], check=True)
    try:
        yield
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", ifname, "root"], check=False)


def test_nccl_check_reports_both_hosts_and_names_a_throttled_one(slurm_cluster2: Cluster, tmp_path: Path) -> None:
    state, out, doc = submit(slurm_cluster2, tmp_path / "ok.txt", tmp_path / "ok.json")
    assert state == "COMPLETED", out[-6000:]
    assert doc["layout"]["hosts"] == ["node1", "node1", "node2", "node2"]
    assert "2 host(s) (node1: ranks 0-1, node2: ranks 2-3)" in out and "# Verdict: PASS" in out
    assert [t["scope"] for t in doc["sweep"]].count("inter-node") == 6 and doc["finder"]["outliers"] == []
    assert set(doc["finder"]["host_scores"]) == {"node1", "node2"}
    assert not [f for f in doc["audit"]["findings"] if f["severity"] == "error"]

    node2 = next(n for n in slurm_cluster2.nodes if n["name"] == "node2")
    with throttled(host_side_veth(node2)):
        state, out, doc = submit(slurm_cluster2, tmp_path / "slow.txt", tmp_path / "slow.json")
    assert state == "FAILED", out[-6000:]  # verdict FAIL -> exit 1 -> the job fails
    hosts = [o["name"] for o in doc["finder"]["outliers"] if o["kind"] == "host"]
    assert hosts == ["node2"], out[-6000:]
    links = doc["finder"]["links"]
    assert links["node1->node2"] < 0.1 * links["node2->node1"]
    assert "SLOW host node2" in out and "node2" in doc["verdict"]["exclude"] and "--exclude=" in out
    assert all(
        t["rows"] and all(r[p]["wrong"] == 0 for r in t["rows"] for p in ("out", "in") if p in r) for t in doc["sweep"]
    )
