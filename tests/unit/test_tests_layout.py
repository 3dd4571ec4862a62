"""The test suite's own layout: test modules share helpers through harness and conftest modules, never by importing
one another, and the one training helper (tests/training.py) is not rewritten in each module."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _test_modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts)


def _all_modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _is_test_module(name: str) -> bool:
    return name.rsplit(".", 1)[-1].startswith("test_")


def _imported_test_modules(tree: ast.AST) -> list[str]:
    """Every ``tests.<...>.test_x`` module that ``tree`` imports, at any depth (function-level imports included)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tests":
            if _is_test_module(node.module) or any(_is_test_module(a.name) for a in node.names):
                found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "tests" and _is_test_module(a.name)]
    return found


def _calls(fn: ast.AST) -> set[str]:
    """Names called in ``fn``: ``Trainer(...)`` gives "Trainer", ``x.train(...)`` gives ".train"."""
    names = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name):
                names.add(node.func.id)
            elif isinstance(node.func, ast.Attribute):
                names.add("." + node.func.attr)
    return names


def _training_helpers(tree: ast.Module) -> list[str]:
    """Top-level non-test functions that build a Trainer and train it: what tests/training.py's train() is for."""
    return [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and not node.name.startswith("test_")
        and {"Trainer", ".train"} <= _calls(node)
    ]


def test_no_module_imports_a_test_module() -> None:
    """Helpers two modules need live in a harness (tests/<tier>/harness.py, tests/training.py) or a conftest."""
    offenders = {
        str(p.relative_to(TESTS.parent)): mods
        for p in _all_modules()
        if (mods := _imported_test_modules(ast.parse(p.read_text(encoding="utf-8"))))
    }
    assert offenders == {}, offenders


def test_training_helpers_are_the_shared_one() -> None:
    """A test module trains through tests/training.py's train() (options, hooks or a small wrapper on it), not a
    Trainer-building helper of its own."""
    offenders = {}
    for p in _test_modules():
        if helpers := _training_helpers(ast.parse(p.read_text(encoding="utf-8"))):
            offenders[str(p.relative_to(TESTS.parent))] = helpers
    assert offenders == {}, offenders


def test_no_helper_name_is_defined_by_two_test_modules() -> None:
    """The same top-level ``_train``-style helper in two test modules is one helper copied: share it instead."""
    where: dict[str, list[str]] = defaultdict(list)
    for p in _test_modules():
        for node in ast.parse(p.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith(("_train", "train")):
                where[node.name].append(str(p.relative_to(TESTS.parent)))
    assert {name: mods for name, mods in where.items() if len(mods) > 1} == {}


def test_the_checks_see_what_they_forbid() -> None:
    """The checks above on a module that breaks each rule: a vacuous check would pass anything."""
    tree = ast.parse(
        "from tests.slurm.test_train_slurm import submit\n"
        "def f():\n"
        "    from tests.unit import test_cli\n"
        "def _train(env, cfg):\n"
        "    return Trainer(cfg, env).train()\n"
    )
    assert _imported_test_modules(tree) == ["tests.slurm.test_train_slurm", "tests.unit"]
    assert _training_helpers(tree) == ["_train"]
