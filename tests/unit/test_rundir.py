"""RunDir owns the run-directory layout, and it is the layout docs/OBSERVABILITY.md documents."""

from __future__ import annotations

import re
from pathlib import Path

from hpcdist.base.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]


def _block() -> str:
    """The layout block of the run-directory section of the page that documents it."""
    text = (REPO / "docs" / "OBSERVABILITY.md").read_text(encoding="utf-8")
    return text.split("## The run directory", 1)[1].split("```", 2)[1]


def _documented_entries() -> set[str]:
    block = _block()
    # top-level entries: two-space indent, a name (a folder ends in /), then the description
    names = re.findall(r"^  ([A-Za-z0-9_.-]+/?)[ /]", block, re.M)
    return {n.rstrip("/") for n in names}


def test_every_run_dir_entry_is_documented_and_every_documented_entry_is_one() -> None:
    rd = RunDir("runs/demo")
    owned = {name: getattr(rd, name) for name in dir(RunDir) if isinstance(getattr(RunDir, name), property)}
    assert all(path.parent == rd.root for path in owned.values()), owned  # one level: names, not nested paths
    assert {p.name for p in owned.values()} == _documented_entries()


def test_the_error_log_is_named_as_documented() -> None:
    block = _block()
    assert RunDir("r").error_log("<time>", "<pid>").name in block  # type: ignore[arg-type]
