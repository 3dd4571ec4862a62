"""`hpcdist report` on a run that survived a preemption and a killed rank: real ranks, real faults, real files.

One run directory, three attempts (module fixture, ~20 s on 2 idle cores):
  1. 2 ranks (fork); SIGTERM on rank 1 during step 3 (what SLURM sends on preemption): every rank stops after
     step 4 with a checkpoint;
  2. torchrun, 2 ranks, each under the per-rank supervisor (as srun starts them): resumes from 4; every rank is
     SIGKILLed in the middle of step 6's save (the checkpoint module's test hook); the supervisors record the deaths
     in failures.jsonl and the batch script's after-step stamps the attempt's end in goodput.json;
  3. 2 ranks (fork) resume from step 4 (step 6 is incomplete) and finish at step 8.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

from hpcdist import cli
from hpcdist import config as config_mod
from hpcdist.checkpoint.manager import KILL_ENV
from hpcdist.fault.goodput import mark_attempt_end
from tests.conftest import SMALL
from tests.dist.harness import free_port, run_ranks
from tests.training import signal_at, train

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory: pytest.TempPathFactory, corpus_dir: Path) -> Path:
    run = tmp_path_factory.mktemp("report") / "run"
    over = [
        *SMALL,
        f"run.dir={run}",
        "data.source=files",
        f"data.path={corpus_dir}",
        "train.steps=8",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "checkpoint.every_steps=2",
        "checkpoint.keep_last=5",
        "train.eval_every_steps=4",
        "logging.straggler_every_steps=2",
    ]
    cfg = config_mod.load(None, over)

    first = run_ranks(2, partial(train, before=signal_at(1, 3, signal.SIGTERM)), cfg)
    assert [o["step"] for o in first] == [4, 4]

    config_file = config_mod.save(cfg, run.parent / "config.yaml")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--master-port={free_port()}",
        "--no-python",
        sys.executable,
        "-m",
        "hpcdist.fault.supervise",
        "--",
        sys.executable,
        "-m",
        "hpcdist.cli",
        "train",
        str(config_file),
    ]
    env = {**os.environ, KILL_ENV: "6", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0, r.stdout[-2000:]
    mark_attempt_end(run)  # what the batch script's after-step does once srun failed

    third = run_ranks(2, train, cfg)
    assert third[0]["step"] == 8 and third[0]["resumed"].endswith("step-00000004")
    return run


def test_report_of_a_preempted_and_killed_run(faulty_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import matplotlib.image

    killed = [json.loads(line) for line in (faulty_run / "failures.jsonl").read_text().splitlines()]
    # both ranks kill themselves right after the same collective; torchrun may stop the second one (SIGTERM, which
    # its supervisor does not record) first on a busy machine, so at least one record, each naming a rank
    killed_ranks = {f["rank"] for f in killed if f["kind"] == "killed"}
    assert killed_ranks and killed_ranks <= {0, 1}, killed

    assert cli.main(["report", str(faulty_run)]) == 0
    assert "wrote" in capsys.readouterr().out
    page = (faulty_run / "report.html").read_text()
    pngs = sorted((faulty_run / "report").glob("*.png"))
    # every figure has data in this run: loss (with eval), throughput, memory (per rank too), goodput, timeline,
    # stragglers
    assert [p.stem for p in pngs] == sorted(["loss", "throughput", "memory", "goodput", "timeline", "stragglers"])
    for png in pngs:
        assert png.read_bytes()[:8] == PNG_SIGNATURE, png
        image = matplotlib.image.imread(png)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100, (png, image.shape)
    assert page.count('src="data:image/png;base64,') == len(pngs)  # self-contained: no file referenced
    for n in (1, 2, 3):
        assert f"<td>attempt {n}</td>" in page
    assert page.count("<td>attempt ") == 3
    assert "<td>killed</td>" in page and "stopped cleanly" in page and "failed" in page
    assert "model:" in page and "n_kv_heads: 2" in page  # the resolved config is shown
    hosts = json.loads((faulty_run / "ranks.json").read_text())["hosts"]
    assert f"<td>{hosts[0]}</td><td>2</td><td>0, 1</td>" in page

    summary = json.loads((faulty_run / "run_summary.json").read_text())
    assert (summary["step"], summary["total_steps"], summary["attempts"]) == (8, 8, 3)
    evals = [json.loads(x) for x in (faulty_run / "metrics.jsonl").read_text().splitlines()]
    best = min(e["loss"] for e in evals if e.get("split") == "eval")
    assert summary["best_eval_loss"] == pytest.approx(best)
    assert summary["checkpoint"].endswith("step-00000008")
