"""`hpcdist report` on run directories a real run leaves while it trains or after it crashed: partial files.

The fault-run end to end (a preemption and a killed rank, real ranks) is tests/dist/test_report.py; here the files
are written with the run's own writers (MetricsLogger, Goodput, failures.record) and then cut the way a crash
cuts them.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from hpcdist import cli
from hpcdist import config as config_mod
from hpcdist.base.rundir import RunDir
from hpcdist.fault import failures
from hpcdist.fault.goodput import Goodput
from hpcdist.metrics.logger import MetricsLogger
from hpcdist.report.page import render_page
from hpcdist.report.rundata import RunData

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _running_run(root: Path, steps: int = 6) -> None:
    """What a run has written after ``steps`` steps while still training: no end in goodput.json, no summary."""
    g = Goodput(root, enabled=True, start=time.time() - 5)
    g.begin(None)
    with MetricsLogger(root, enabled=True, tensorboard=False) as m:
        for step in range(1, steps + 1):
            m.log(
                step,
                {
                    "loss": 5.0 - 0.1 * step,
                    "tokens_per_s": 1000.0 + step,
                    "mfu": 0.01,
                    "tokens_seen": 256.0 * step,
                    "mem_rss_gib": 0.5,
                },
            )
            g.step(step, 0.01)
        m.log(3, {"loss": 4.9}, prefix="eval")
    g.flush()
    RunDir(root).ranks.write_text(json.dumps({"hosts": ["n1", "n1", "n2", "n2"]}))


def test_a_crashed_run_with_a_truncated_last_line_is_reported(tmp_path: Path) -> None:
    _running_run(tmp_path)
    with RunDir(tmp_path).metrics.open("a") as f:
        f.write('{"step": 7, "loss": 4.')  # the line being written when the node died
    failures.record(tmp_path, kind="killed", cause="rank 2 (pid 9) was killed by SIGKILL", rank=2, host="n2")
    with RunDir(tmp_path).failures.open("a") as f:
        f.write('{"time": 1, "kind": "exc')

    ledger = {
        "job_id": "42",
        "attempts": {
            "0": {"restart": 0, "start": time.time() - 4, "requeued": "time_limit"},
            "1": {"restart": 1, "start": time.time() - 2},
        },
    }
    RunDir(tmp_path).restarts.write_text(json.dumps(ledger))
    data = RunData.load(tmp_path)
    assert [r["step"] for r in data.train] == [1, 2, 3, 4, 5, 6]  # the cut line is skipped, the rest kept
    assert [f["kind"] for f in data.failures] == ["killed"]
    assert len(data.attempts) == 1 and data.attempts[0].outcome == "running or crashed"
    assert data.ranks_by_host() == {"n1": [0, 1], "n2": [2, 3]}

    assert cli.main(["report", str(tmp_path)]) == 0
    page = RunDir(tmp_path).report.read_text()
    assert "<td>attempt 1</td>" in page and "running or crashed" in page and "<td>killed</td>" in page
    assert "<td>n2</td><td>2</td><td>2, 3</td>" in page
    assert "<td>job 42 restart 0</td>" in page and "<td>time_limit</td>" in page  # the SLURM ledger
    assert "no config.yaml yet" in page and "Stragglers: nothing recorded yet" in page
    drawn = sorted(p.name for p in RunDir(tmp_path).report_images.glob("*.png"))
    assert drawn == ["goodput.png", "loss.png", "memory.png", "throughput.png", "timeline.png"]
    assert all(p.read_bytes()[:8] == PNG_SIGNATURE for p in RunDir(tmp_path).report_images.glob("*.png"))


def test_resumed_steps_keep_their_last_line(tmp_path: Path) -> None:
    """metrics.jsonl is appended across attempts: a step computed again after a restart counts once, last wins."""
    with MetricsLogger(tmp_path, enabled=True, tensorboard=False) as m:
        for step, loss in ((1, 3.0), (2, 2.0), (3, 1.0), (2, 2.5), (3, 1.5)):
            m.log(step, {"loss": loss})
    assert [(r["step"], r["loss"]) for r in RunData.load(tmp_path).train] == [(1, 3.0), (2, 2.5), (3, 1.5)]


def test_an_empty_directory_gives_a_page_that_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "elsewhere" / "r.html"
    assert cli.main(["report", str(tmp_path), "--out", str(out)]) == 0
    assert "none (nothing recorded)" in capsys.readouterr().out
    assert "not started its training loop" in out.read_text()
    assert not list((tmp_path / "elsewhere").glob("r/*.png"))


def test_not_a_directory_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["report", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a directory" in err


def test_without_matplotlib_the_report_says_how_to_install_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _running_run(tmp_path, steps=2)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert cli.main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'hpcdist[plot]'" in err


def test_the_report_loads_no_torch(tmp_path: Path) -> None:
    """A login node's `hpcdist report` starts fast: the run dir is read and drawn without importing torch."""
    import subprocess

    RunDir(tmp_path).metrics.write_text('{"step": 1, "loss": 2.0, "tokens_seen": 64}\n')
    code = (
        f"import sys; from hpcdist import cli; rc = cli.main(['report', {str(tmp_path)!r}]); "
        "sys.exit(rc or ('torch' in sys.modules) * 7)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_the_report_shows_the_goodput_models_prediction_from_the_runs_measurements(tmp_path: Path) -> None:
    """Beside the measured goodput: the model fed the run's step time, stall per shared save (goodput.json's per-tier
    counts), cadence and nodes, at the MTBF of the run's parallel.auto_cluster profile."""
    config_mod.save(config_mod.load(None, ["checkpoint.every_steps=3"]), RunDir(tmp_path).config)
    g = Goodput(tmp_path, enabled=True, start=time.time() - 60)
    g.begin(None)
    with MetricsLogger(tmp_path, enabled=True, tensorboard=False) as m:
        for step in range(1, 7):
            m.log(step, {"loss": 3.0, "step_time_s": 2.0})
            g.step(step, 2.0)
            if step % 3 == 0:
                g.add("checkpoint_save", 0.5, tier="shared")
    g.flush(clean=True)
    RunDir(tmp_path).ranks.write_text(json.dumps({"hosts": ["n1", "n1", "n2", "n2"]}))
    data = RunData.load(tmp_path)
    assert data.saves == {"saves_shared": 2, "save_shared_s": 1.0}
    page = render_page(tmp_path, data, {})
    section = page[page.index("Goodput: measured and predicted") :]
    assert "<td>measured (goodput.json)</td>" in section
    assert "<td>predicted at the run&#x27;s cadence</td>" in section
    assert "<td>predicted, recommended cadence</td>" in section
    assert "step 2.000 s, shared save stall 0.50 s (2 saves)" in section
    assert "2 node(s) at a node MTBF of 5,696 h (cluster a100_ib)" in section
    assert "assumed: no failure measured yet" in section


def test_the_report_says_why_it_has_no_prediction(tmp_path: Path) -> None:
    _running_run(tmp_path)  # no config.yaml, no save
    page = render_page(tmp_path, RunData.load(tmp_path), {})
    # the measured inputs come first: a run dir without them needs no config parsed (it may be anyone's)
    assert "no prediction yet: the run has not measured a step and a shared checkpoint save" in page
