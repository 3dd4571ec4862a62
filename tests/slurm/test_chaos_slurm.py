"""The fault campaign's short form: `tools/chaos --short --in-process` on the three-host sandbox.

One job (2 training hosts + a warm spare, in-process recovery) takes 6 faults of 6 kinds (SIGKILL, SIGSTOP -> the
frozen rank killed, a host's ranks killed, a damaged newest checkpoint, a host failing the health gate, the
time-limit signal -> one requeue) and must finish with every step's loss equal to an uninterrupted run of the same
layout; the tool prints the table. The first death of each attempt is recovered in-process by the warm spare (here:
the host's ranks, the frozen rank and the killed rank); the next one finds no spare and takes the in-job restart,
whose attempt has a spare again.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.slurm.conftest import REPO, Cluster


def test_chaos_short_form_loses_nothing(slurm_cluster2: Cluster, corpus_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    args = ["--short", "--in-process", "--seed", "6", "--data", str(corpus_dir), "--workdir", str(tmp_path / "w")]
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "chaos"), *args, "--json", str(out), "--timeout", "120"],
        cwd=REPO,
        env={**slurm_cluster2.env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert len(rows) >= 6 and len({r["kind"] for r in rows}) >= 5
    assert result["losses_equal"] and result["state"] == "COMPLETED"
    paths = [(r["kind"], r["path"]) for r in rows]
    assert dict(paths)["usr2"] == "requeue" and {p for _, p in paths} <= {"in-process", "in-job", "requeue"}, paths
    # seed 6's schedule: host, usr2, stop, damage, kill, gate. The first death of each attempt finds the warm spare
    # waiting: a host's ranks killed, a frozen rank (its supervisor kills it) and a killed rank recover in-process
    assert [p for k, p in paths if k in ("host", "stop", "kill")] == ["in-process"] * 3, paths
    for r in rows:
        assert r["recovery"].get("total") is not None, r
        if r["path"] == "in-process":  # a snapshot of every step: at most the failed step is computed again
            assert r["redone"] is not None and r["redone"] <= 1, r
        if r["kind"] == "gate" and r["path"] == "in-job":
            assert r["target"].split()[0] not in r["nodes"].split(","), r  # the spare took the failed host's place
    assert "losses equal to the uninterrupted run at every step: yes" in proc.stdout
