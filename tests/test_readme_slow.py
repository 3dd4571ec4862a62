"""Every README command runs (issue 11), the local ones that train or start ranks: each runs with bash in a
checkout-like scratch directory, with the tiny overrides tests/readme_commands.py lists for it appended."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.readme_commands import as_run, assert_output, check_for, command_id, run_bash, runnable, workdir

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("text", runnable("local"), ids=command_id)
def test_local_command(text: str, tmp_path: Path) -> None:
    cwd = workdir(tmp_path)
    check = check_for(text)
    command = as_run(text, check)
    proc = run_bash(command, cwd, timeout=300)
    assert_output(command, proc, check)
    if text.startswith(("hpcdist train configs/demo.yaml", "torchrun ")) and "--dry-run" not in text:
        # the run dir the command names, else configs/demo.yaml's, relative to where it ran: metrics, final checkpoint
        run = cwd / (re.findall(r"run\.dir=(\S+)", text) or ["runs/demo"])[-1]
        assert (run / "checkpoints" / "step-00000002" / "COMPLETE").is_file(), proc.stdout[-3000:]
        assert len((run / "metrics.jsonl").read_text().splitlines()) >= 1
