"""RunDir owns the run-directory layout, and it is the layout README.md documents."""

from __future__ import annotations

import re
from pathlib import Path

from hpcdist.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]


def _readme_entries() -> set[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    block = text.split("### Run directory", 1)[1].split("```", 2)[1]
    # top-level entries: two-space indent, a name (a folder ends in /), then the description
    names = re.findall(r"^  ([A-Za-z0-9_.-]+/?)[ /]", block, re.M)
    return {n.rstrip("/") for n in names}


def test_every_run_dir_entry_is_documented_and_every_documented_entry_is_one() -> None:
    rd = RunDir("runs/demo")
    owned = {name: getattr(rd, name) for name in dir(RunDir) if isinstance(getattr(RunDir, name), property)}
    assert all(path.parent == rd.root for path in owned.values()), owned  # one level: names, not nested paths
    assert {p.name for p in owned.values()} == _readme_entries()


def test_the_error_log_is_named_as_documented() -> None:
    block = (REPO / "README.md").read_text(encoding="utf-8").split("### Run directory", 1)[1].split("```", 2)[1]
    assert RunDir("r").error_log("<time>", "<pid>").name in block  # type: ignore[arg-type]
