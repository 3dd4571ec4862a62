"""Every README and docs/ command runs, the local ones that train or start ranks: in the order a
reader meets them, one after another in ONE checkout-like scratch directory, so a command runs on what the earlier
ones left (the usage examples after the quick start, generate on the quick start's run), with the tiny overrides
tests/readme_commands.py lists for it. Each must change the directory (a run, a file) or say why not
(``Check.unchanged``): a command that silently does nothing fails here."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

from tests.readme_commands import (
    as_run,
    assert_output,
    check_for,
    local_env,
    reading_order,
    run_bash,
    tree_state,
    workdir,
)

pytestmark = pytest.mark.slow


# One test per document: a reader reads README.md top to bottom in one directory, and each docs/ page on its own
# (they can then run side by side under pytest-xdist). A page that uses what the README's quick start left (docs/HF.md
# reads runs/demo) gets the quick start first, as its reader has run it.
SOURCES = sorted({c.source for c in reading_order("local")}, key=lambda s: (s != "README.md", s))
QUICK_START = reading_order("local")[0]  # README's first command: `hpcdist train configs/demo.yaml`


def _needs_quick_start(commands: list) -> bool:
    return any("runs/demo" in c.text for c in commands)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("source", SOURCES)
def test_local_commands_in_reading_order(tmp_path: Path, source: str) -> None:
    cwd = workdir(tmp_path)
    commands = [c for c in reading_order("local") if c.source == source]
    if source != "README.md" and _needs_quick_start(commands):
        commands = [QUICK_START, *commands]
    for command in commands:
        check = check_for(command.text)
        where = f"{command.source} line {command.line}"
        print(f"[{time.strftime('%H:%M:%S')}] {where}: {command.text.splitlines()[0][:100]}", flush=True)
        before = tree_state(cwd)
        if command.kind == "python":  # a snippet: this interpreter, in the scratch directory
            proc = run_bash(f"{sys.executable} - <<'PY'\n{command.text}\nPY", cwd, env=local_env(), timeout=300)
            shown = "python block"
        else:
            shown = as_run(command.text, check)
            proc = run_bash(shown, cwd, timeout=300)
        assert_output(f"{where}: {shown}", proc, check)
        changed = tree_state(cwd) != before
        if check.unchanged:
            assert not changed or "dry run" not in check.unchanged, f"{where}: `{shown}` wrote files in a dry run"
        else:
            assert changed, f"{where}: `{shown}` changed nothing:\n{proc.stdout[-2000:]}"
        trains = shown.startswith(("hpcdist train configs/demo.yaml", "torchrun ")) and "--dry-run" not in shown
        if trains and "already finished" not in proc.stdout:
            # the run dir the command names, else configs/demo.yaml's, relative to where it ran
            run = cwd / (re.findall(r"run\.dir=(\S+)", shown) or ["runs/demo"])[-1]
            assert (run / "checkpoints" / "step-00000002" / "COMPLETE").is_file(), proc.stdout[-3000:]
            assert len((run / "metrics.jsonl").read_text().splitlines()) >= 1
