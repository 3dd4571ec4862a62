"""nccl_check on real gloo ranks: the sweep's numbers and checks, and the whole tool (its --nproc launcher forks
real ranks from this process, torchrun-style) finding injected faults: a wrong result, a slow rank, a rank that
never joins, a rank that stops inside the sweep. The fault switches are the tool's TEST-ONLY variables."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hpcdist.diagnostics import cli, collectives
from hpcdist.diagnostics.faults import Faults
from hpcdist.env import DistEnv
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]
SIZES = collectives.message_sizes(8, 4096, 4)  # 8 B .. 2 KiB: every rounding case, milliseconds per op
# Small and quick. The finder's threshold is far below the noise of a shared 2-core machine (a 64 KiB exchange takes
# 0.1-5 ms here, the best of 6 far less), and the injected delay far above it (200 ms per transfer).
QUICK = ["--iters", "2", "--warmup", "1", "--finder-bytes", "64K", "--finder-iters", "6", "--slow-threshold", "0.05"]
FAULTS = ("INJECT_WRONG_RANK", "DELAY_RANK", "DELAY_S", "HANG_RANK", "HANG_AT", "HANG_S")


def _sweep(env: DistEnv, wrong_rank: int | None) -> dict[str, list[dict[str, Any]]]:
    faults = Faults(wrong_rank=wrong_rank)
    return {
        op: collectives.sweep_op(
            op,
            dist.group.WORLD,
            SIZES,
            dtype=torch.float32,
            device=torch.device("cpu"),
            iters=2,
            warmup=1,
            rank=env.rank,
            faults=faults,
            step=lambda name: contextlib.nullcontext(),
        )
        for op in collectives.OPS
    }


def test_sweep_checks_every_operation_and_computes_busbw() -> None:
    per_rank = run_ranks(4, _sweep, None)
    for op in collectives.OPS:
        rows = collectives.group_table(op, [r[op] for r in per_rank], [0, 1, 2, 3], torch.float32)
        assert [r["size"] for r in rows] == [r["count"] * 4 for r in rows] and rows[-1]["size"] <= 2048
        for row in rows:
            for placement in collectives.PLACEMENTS[op]:
                res = row[placement]
                assert res["wrong"] == 0, (op, row)
                seconds = res["time_us"] / 1e6
                assert res["algbw"] == pytest.approx(row["size"] / seconds / 1e9)
                assert res["busbw"] == pytest.approx(res["algbw"] * collectives.busbw_factor(op, 4))


def test_sweep_counts_a_wrong_result_on_the_rank_that_has_it() -> None:
    per_rank = run_ranks(4, _sweep, 1)
    for op in collectives.OPS:
        rows = collectives.group_table(op, [r[op] for r in per_rank], [0, 1, 2, 3], torch.float32)
        for row in rows:
            for placement in collectives.PLACEMENTS[op]:
                assert row[placement]["wrong_by_rank"] == {"1": 1}, (op, row)


# ----------------------------------------------------------------------------------------- the tool


@pytest.fixture
def tool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]):
    """Run the real CLI with --nproc 4 (ranks forked from here); -> (exit code, stdout, JSON, seconds)."""
    for name in FAULTS:
        monkeypatch.delenv(f"HPCDIST_NCCL_CHECK_{name}", raising=False)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_STEP_ID", "HPCDIST_NCCL_PROFILE"):
        monkeypatch.delenv(name, raising=False)

    def run(*args: str, faults: dict[str, str] | None = None, env: dict[str, str] | None = None):
        for name, value in {**(env or {}), **{f"HPCDIST_NCCL_CHECK_{k}": v for k, v in (faults or {}).items()}}.items():
            monkeypatch.setenv(name, value)
        out = tmp_path / "report.json"
        out.unlink(missing_ok=True)
        capfd.readouterr()
        start = time.monotonic()
        code = cli.main(["--nproc", "4", "--json", str(out), *args])
        seconds = time.monotonic() - start
        text = capfd.readouterr()
        doc = json.loads(out.read_text()) if out.exists() else None
        return code, text.out + text.err, doc, seconds

    return run


def test_healthy_run_passes_with_every_number_in_the_json(tool, tmp_path: Path) -> None:
    import matplotlib.image

    png = tmp_path / "nccl.png"
    code, text, doc, _ = tool(
        "--max-bytes",
        "4K",
        *QUICK,
        "--expect-intra",
        "2",
        "--plot",
        str(png),
        env={"NCCL_TEST_TOKEN": "hunter2", "NCCL_SOCKET_IFNAME": "nosuch0"},
    )
    assert code == 0, text
    # --plot: a valid PNG (busbw per collective, the expected line, the finder's 4 x 4 rank matrix)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"# plot: {png}" in text
    assert matplotlib.image.imread(png).shape[0] > 300
    assert len(doc["finder"]["rank_pairs"]) == 6  # every pair of 4 ranks, drawn as the heat map
    assert doc["verdict"]["passed"] and "# Verdict: PASS" in text
    # rank 0 (the store's host) left while a rank was still reading its "bye": c10d's stack trace
    assert "Exception raised from" not in text and "Connection reset by peer" not in text, text
    assert doc["layout"]["world_size"] == 4 and len(doc["health"]) == 4 and all(h["ok"] for h in doc["health"])
    assert [t["op"] for t in doc["sweep"]] == list(collectives.OPS)
    for table in doc["sweep"]:
        assert table["scope"] == "intra-node" and table["rows"]
        for row in table["rows"]:
            for placement in collectives.PLACEMENTS[table["op"]]:
                res = row[placement]
                assert res["wrong"] == 0 and len(res["time_us_by_rank"]) == 4
                assert res["busbw"] == pytest.approx(res["algbw"] * collectives.busbw_factor(table["op"], 4))
    assert len(doc["finder"]["rank_scores"]) == 4 and doc["finder"]["outliers"] == []
    # the audit: secret masked everywhere, the misnamed interface flagged (a warning: gloo does not use it)
    assert "hunter2" not in text and "hunter2" not in json.dumps(doc)
    warning = [f for f in doc["audit"]["findings"] if f["code"] == "ifname_missing"]
    assert warning and warning[0]["severity"] == "warning" and "nosuch0" in warning[0]["message"]
    assert "# all_reduce, intra-node: 4 ranks on" in text and "#wrong" in text


def test_wrong_result_fails_the_verdict_naming_the_rank(tool) -> None:
    code, text, doc, _ = tool("--max-bytes", "64", "--no-finder", *QUICK, faults={"INJECT_WRONG_RANK": "1"})
    assert code == 1, text
    assert not doc["verdict"]["passed"] and "# Verdict: FAIL" in text
    assert "TEST-ONLY FAULT ACTIVE: rank 1 corrupts" in text
    wrong = [r for r in doc["verdict"]["reasons"] if "wrong elements" in r]
    assert len(wrong) == len(collectives.OPS) and all("on rank 1 (" in r for r in wrong)
    for table in doc["sweep"]:
        for row in table["rows"]:
            for placement in collectives.PLACEMENTS[table["op"]]:
                assert set(row[placement]["wrong_by_rank"]) == {"1"}
                assert row[placement]["wrong"] > 0


def test_slow_rank_is_named_by_the_finder(tool) -> None:
    code, text, doc, _ = tool("--no-sweep", *QUICK, "--finder-iters", "3", faults={"DELAY_RANK": "2", "DELAY_S": "0.2"})
    assert code == 1, text
    slow = [o for o in doc["finder"]["outliers"] if o["kind"] == "rank"]
    assert "2" in [o["name"] for o in slow], text
    scores = doc["finder"]["rank_scores"]
    assert min(scores, key=scores.get) == "2"
    assert any(r.startswith("slow rank 2") for r in doc["verdict"]["reasons"]) and "SLOW rank 2" in text


def test_rank_that_never_joins_is_named_and_the_tool_exits(tool) -> None:
    code, text, doc, seconds = tool("--join-timeout", "3", faults={"HANG_RANK": "3", "HANG_AT": "join"})
    assert code == 1, text
    assert doc["join"]["missing"] == [{"rank": 3, "host": os.uname().nodename}]
    assert "rank 3 (expected on" in text and "never joined" in doc["verdict"]["reasons"][0]
    assert seconds < 3 + 20  # the join deadline plus start-up and the launcher's grace, not the 3600 s hang


def test_rank_stuck_before_a_collective_is_named_and_every_rank_exits(tool) -> None:
    code, text, doc, seconds = tool("--timeout", "3", "--max-bytes", "64", *QUICK, faults={"HANG_RANK": "2"})
    assert code == 1, text
    hang = doc["hang"]
    assert [b["rank"] for b in hang["behind"]] == [2] and hang["dead"] == []
    assert hang["step"].startswith("intra-node all_reduce")
    assert "rank 2 on" in text and "never arrived" in text
    assert any("hung: rank 2 (" in r for r in doc["verdict"]["reasons"])
    assert seconds < 3 + 20  # the step timeout plus the diagnosis, not the 3600 s hang


def test_the_executable_runs_two_local_ranks(tmp_path: Path) -> None:
    """tools/nccl_check as a user runs it: a fresh interpreter from a checkout, --nproc 2."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPCDIST_NCCL_CHECK_", "RANK", "WORLD_SIZE"))}
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "nccl_check"),
            "--nproc",
            "2",
            "--ops",
            "all_reduce,sendrecv",
            "--max-bytes",
            "1K",
            "--no-finder",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# Verdict: PASS" in proc.stdout and json.loads(out.read_text())["layout"]["world_size"] == 2
