"""docs/CLUSTER.md's walkthrough (prepare -> plan -> dry run -> submit -> logs and status -> report) is what the
tool prints: tools/docs/cluster_blocks runs the page's commands in order on the two-node sandbox, one small job
(configs/cluster_demo.yaml, one rank on each of two nodes, four steps), and every output block must agree with
what was printed under the tool's one masking rule (job ids, times, paths, measured numbers)."""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

from tests.slurm.conftest import REPO, Cluster

TOOL = REPO / "tools" / "docs" / "cluster_blocks"
PAGE = REPO / "docs" / "CLUSTER.md"
# the walkthrough's stages, in the order a first job needs them
STAGES = ("hpcdist prepare", "hpcdist plan", "--dry-run", "hpcdist submit", "hpcdist logs", "hpcdist status", "report")


@cache
def _tool() -> ModuleType:
    """The executable tools/docs/cluster_blocks as a module (it has no .py suffix)."""
    loader = importlib.machinery.SourceFileLoader("cluster_blocks", str(TOOL))
    spec = importlib.util.spec_from_loader("cluster_blocks", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("cluster_blocks", module)  # dataclasses look their module up while the class is built
    loader.exec_module(module)
    return module


def test_the_page_walks_a_job_from_data_to_report() -> None:
    steps = [step for block in _tool().blocks(PAGE.read_text(encoding="utf-8")) for step in block.steps]
    commands = [step.command for step in steps]
    at = [next((i for i, c in enumerate(commands) if stage in c), -1) for stage in STAGES]
    assert -1 not in at and at == sorted(at), f"stages {STAGES} not all on the page, in order: {commands}"
    silent = [step.command for step in steps if not any(line.strip() for line in step.shown)]
    assert not silent, f"commands shown without their output (tools/docs/cluster_blocks --write): {silent}"


def test_a_block_that_differs_is_named_and_what_varies_is_not() -> None:
    tool = _tool()
    page_blocks = tool.blocks(PAGE.read_text(encoding="utf-8"))
    printed = [tool.excerpt([], tool.mask("\n".join(s.shown)).splitlines()) for b in page_blocks for s in b.steps]
    assert tool.differences(page_blocks, printed) == []
    steps = [s.command for b in page_blocks for s in b.steps]
    submit = next(i for i, c in enumerate(steps) if c.startswith("hpcdist submit") and "--dry-run" not in c)
    varied = [list(lines) for lines in printed]
    # another run: another job id, time, path and throughput, the same output under the mask
    raw = "submitted job 4711 (slurm, 2 ranks)\n  at 2031-01-02T03:04:05 in /tmp/x/runs: 12.5 s, 9,999 tokens/s"
    assert tool.mask(raw, Path("/tmp/x")) == tool.mask(
        "submitted job 7 (slurm, 2 ranks)\n  at 2026-12-02T07:43:54 in ~/project/runs: 0.3 s, 17 tokens/s"
    )
    varied[submit] = [*varied[submit], "one line the page does not show"]
    found = tool.differences(page_blocks, varied)
    assert len(found) == 1 and "docs/CLUSTER.md line" in found[0] and "+one line the page does not show" in found[0]
    assert not tool.agrees(["a", "...", "z"], ["a", "z", "y"]) and tool.agrees(["a", "...", "z"], ["a", "b", "z"])


def test_the_page_shows_what_the_sandbox_prints(slurm_cluster2: Cluster, tmp_path: Path) -> None:
    tool = _tool()
    page_blocks = tool.blocks(PAGE.read_text(encoding="utf-8"))
    project = tmp_path / "project"
    project.mkdir()
    printed = tool.run(page_blocks, tool.scratch(project), tool.environment(slurm_cluster2.env))
    found = tool.differences(page_blocks, printed)
    assert not found, (
        "docs/CLUSTER.md shows output the sandbox did not print (tools/docs/cluster_blocks --write on a sandbox "
        "rewrites the blocks):\n\n" + "\n\n".join(found)
    )
