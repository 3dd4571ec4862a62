"""Layering of hpcdist.config and hpcdist.models: torch-free config, and no imports from the layers above them."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "hpcdist"
LOWER = sorted([*(PACKAGE / "config").rglob("*.py"), *(PACKAGE / "models").rglob("*.py")])
ABOVE = ("hpcdist.parallel", "hpcdist.launch", "hpcdist.trainer")


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every module an ``import`` / ``from ... import`` names in ``path``, at any depth (functions included)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from hpcdist import launch` names the submodule in the alias
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return out


def test_import_config_does_not_import_torch() -> None:
    code = "import sys, hpcdist.config, hpcdist.models.args; assert 'torch' not in sys.modules, 'torch imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("path", LOWER, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_config_and_models_import_nothing_from_the_layers_above(path: Path) -> None:
    bad = [
        f"line {line}: {name}"
        for line, name in _imported_modules(path)
        if any(name == top or name.startswith(f"{top}.") for top in ABOVE)
    ]
    assert not bad, f"{path.relative_to(PACKAGE)} imports from {', '.join(ABOVE)}: {bad}"


def test_the_layering_test_sees_function_level_imports(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from hpcdist.parallel.dims import ParallelDims\n    from hpcdist import launch\n")
    assert [name for _, name in _imported_modules(probe)] == ["hpcdist.parallel.dims.ParallelDims", "hpcdist.launch"]
