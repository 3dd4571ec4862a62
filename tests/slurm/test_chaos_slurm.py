"""The fault campaign's short form: `tools/chaos --short` on the three-host sandbox.

One job (2 training hosts + a spare) takes 6 faults of 6 kinds (SIGKILL, SIGSTOP -> watchdog, a host's ranks
killed, a damaged newest checkpoint, a host failing the health gate, the time-limit signal -> one requeue) and must
finish with every step's loss equal to an uninterrupted run of the same layout; the tool prints the table.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.slurm.conftest import REPO, Cluster


def test_chaos_short_form_loses_nothing(slurm_cluster2: Cluster, corpus_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    args = ["--workdir", str(tmp_path / "w"), "--json", str(out), "--timeout", "120"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "chaos"), "--short", "--seed", "1", "--data", str(corpus_dir), *args],
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
    paths = {r["kind"]: r["path"] for r in rows}
    assert paths["usr2"] == "requeue" and all(p == "in-job" for k, p in paths.items() if k != "usr2"), paths
    gate = next(r for r in rows if r["kind"] == "gate")
    assert gate["target"].split()[0] not in gate["nodes"].split(","), gate  # the spare took the failed host's place
    damage = next(r for r in rows if r["kind"] == "damage")
    assert damage["redone"] is not None and damage["redone"] > 2, damage  # resumed from the checkpoint before it
    assert all(r["recovery"].get("total") is not None for r in rows), rows
    assert "losses equal to the uninterrupted run at every step: yes" in proc.stdout
