"""logging.profile: a 3-step profile writes a Chrome trace per rank that parses and holds the training's events."""

from __future__ import annotations

import json

from hpcdist.base.rundir import RunDir
from tests.dist.harness import single
from tests.training import train


def test_three_step_profile_writes_a_trace_that_loads(small_cfg, tmp_path) -> None:
    cfg = small_cfg(
        "train.steps=5",
        "logging.profile.steps=3",
        "logging.profile.start_step=2",
        "checkpoint.save_final=false",
        run_dir=tmp_path / "run",
    )
    assert single(train, cfg)["step"] == 5
    files = sorted(p.name for p in RunDir(tmp_path / "run").profile.iterdir())
    assert files == ["trace-rank-00000.json"]  # no memory snapshot without CUDA
    trace = json.loads((RunDir(tmp_path / "run").profile / files[0]).read_text())
    events = trace["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert len(events) > 100
    # the profiled steps ran the model: its matmuls and the optimizer step are in the trace
    assert any(n.startswith("aten::mm") or n.startswith("aten::addmm") for n in names), sorted(names)[:20]
    assert any("Optimizer.step" in n for n in names)
