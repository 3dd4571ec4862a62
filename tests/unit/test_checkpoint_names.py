"""The checkpoint package loads no torch until a caller asks for the checkpoint code, and its names module
(step-N names, the COMPLETE marker, the listing) is what every reader of a checkpoint directory uses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpcdist.checkpoint.names import DAMAGED, MARKER, latest, list_checkpoints, parse_step, step_dir, step_of

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", ["hpcdist.checkpoint", "hpcdist.checkpoint.names", "hpcdist.checkpoint.local"])
def test_the_package_and_its_names_import_no_torch(module: str) -> None:
    code = f"import sys, {module}; assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_step_names_round_trip(tmp_path: Path) -> None:
    assert step_dir(tmp_path, 1234).name == "step-00001234"
    assert step_of(step_dir(tmp_path, 1234)) == 1234 and parse_step("step-00000000") == 0
    for other in ("step-1234", "step-000012345", "step-00001234.damaged-1", "xstep-00001234", "step-0000123a"):
        assert parse_step(other) is None, other
    with pytest.raises(ValueError, match="not a step-N"):
        step_of(tmp_path / "step-12")


def test_listing_counts_only_marked_step_directories(tmp_path: Path) -> None:
    for step, marker in ((1, MARKER), (3, MARKER), (4, DAMAGED), (5, None)):
        d = step_dir(tmp_path, step)
        d.mkdir()
        if marker:
            (d / marker).write_text("{}")
    (tmp_path / "step-00000009.abandoned-1").mkdir()
    (tmp_path / "step-00000008").write_text("a file, not a checkpoint")
    complete, incomplete = list_checkpoints(tmp_path)
    assert [s for s, _ in complete] == [1, 3] and [p.name for p in incomplete] == ["step-00000004", "step-00000005"]
    assert latest(tmp_path, warn=False) == step_dir(tmp_path, 3)
    assert latest(tmp_path / "missing") is None
