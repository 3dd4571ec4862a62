"""hpcdist.base.atomic.atomic_write: the one way hpcdist replaces a file, and the rule that nothing else does it."""

from __future__ import annotations

import ast
import os
import stat
from pathlib import Path

import pytest

from hpcdist.base.atomic import atomic_write

PACKAGE = Path(__file__).resolve().parents[2] / "hpcdist"


def test_replaces_the_whole_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "state.json"  # the parent is created
    atomic_write(target, "old")
    atomic_write(target, b"new bytes")
    atomic_write(tmp_path / "view.bin", memoryview(b"abc"), durable=False)
    assert target.read_bytes() == b"new bytes"
    assert (tmp_path / "view.bin").read_bytes() == b"abc"
    assert sorted(p.name for p in target.parent.iterdir()) == ["state.json"]


def test_follows_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        atomic_write(tmp_path / "f", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == 0o640


def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path: Path) -> None:
    target = tmp_path / "f"
    target.write_text("old")

    with pytest.raises(TypeError):
        atomic_write(target, 12345)  # type: ignore[arg-type]  # not writable: fails inside the write
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


def test_a_symlink_target_is_replaced_not_written_through(tmp_path: Path) -> None:
    """A link planted at the target's name is replaced by the new file; the file it pointed to is untouched."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "out").symlink_to(victim)
    atomic_write(tmp_path / "out", "data")
    assert victim.read_text() == "precious"
    assert not (tmp_path / "out").is_symlink() and (tmp_path / "out").read_text() == "data"


def _replace_calls(source: str) -> list[int]:
    """Lines calling ``os.replace(a, b)`` or ``<path>.replace(target)`` (one positional, non-literal argument:
    ``str.replace`` takes two, ``dataclasses.replace`` / ``datetime.replace`` take keywords)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "replace"):
            continue
        owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
        path_replace = (
            owner != "dataclasses"
            and len(node.args) == 1
            and not isinstance(node.args[0], ast.Constant)
            and not node.keywords
        )
        if owner == "os" or path_replace:
            lines.append(node.lineno)
    return lines


def test_the_replace_finder_sees_both_spellings() -> None:
    source = "import os\nos.replace(a, b)\ntmp.replace(target)\ns.replace('a', 'b')\ndataclasses.replace(c, x=1)\n"
    assert _replace_calls(source) == [2, 3]


def test_no_other_module_replaces_files_by_itself() -> None:
    """One atomic write: a module calling os.replace / Path.replace on its own would bypass O_EXCL and fsync."""
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != PACKAGE / "base" / "atomic.py"
        for line in _replace_calls(path.read_text())
    ]
    assert not offenders, f"files replaced outside hpcdist.base.atomic: {offenders}"
