"""One name, one meaning: a function or class defined at the top level of two hpcdist modules must do the same thing
under that name (a protocol), or be renamed to say what each does. The scan is of the source (AST), so it costs no
imports."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "hpcdist"

# name -> why defining it in several modules is right. Anything else defined twice fails the test.
ALLOWED: dict[str, str] = {
    "main": "an entry point's protocol: the function `python -m MODULE` / a console script calls",
    "__getattr__": "PEP 562's module attribute hook (lazy imports), a protocol of the language",
}


def defined(source: str) -> list[str]:
    """The top-level ``def`` / ``async def`` / ``class`` names of a module's source."""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)

    def overload(node: ast.stmt) -> bool:  # typing.overload's stubs declare one function's signatures
        return any(
            getattr(d, "id", getattr(d, "attr", None)) == "overload" for d in getattr(node, "decorator_list", [])
        )

    return [node.name for node in ast.parse(source).body if isinstance(node, kinds) and not overload(node)]


def top_level_names() -> dict[str, list[str]]:
    """Every top-level name of hpcdist -> the modules that define it."""
    where: dict[str, list[str]] = defaultdict(list)
    for path in sorted(ROOT.rglob("*.py")):
        for name in defined(path.read_text(encoding="utf-8")):
            where[name].append(str(path.relative_to(ROOT.parent)))
    return where


def test_no_name_is_defined_in_two_modules_unless_allowed() -> None:
    doubled = {name: files for name, files in top_level_names().items() if len(files) > 1}
    unexplained = {name: files for name, files in doubled.items() if name not in ALLOWED}
    assert not unexplained, (
        "defined in several modules (rename each to say what it does, or import one owner's; a protocol goes in "
        f"ALLOWED with its reason): {unexplained}"
    )
    # an entry whose name is no longer doubled is stale: it would let a future duplicate through unexamined
    assert not (set(ALLOWED) - set(doubled)), f"ALLOWED names no longer defined twice: {set(ALLOWED) - set(doubled)}"


def test_the_scan_sees_top_level_definitions_only() -> None:
    # methods and nested functions are no module's names; classes and async functions are
    assert defined("class A:\n    def m(self): ...\nasync def f():\n    def inner(): ...\nx = 1\n") == ["A", "f"]
    assert defined("@overload\ndef g(x: int) -> int: ...\ndef g(x): ...\n") == ["g"]
    assert len(top_level_names()["main"]) > 1  # the scan reaches the package (several entry points)


def test_every_dotted_hpcdist_name_in_the_source_resolves() -> None:
    """A docstring or comment naming ``hpcdist.module.Name`` names something that exists there (a moved class
    left such names behind: run.py named hpcdist.launch.task.SlurmEnvironment, which lives in launch/job.py)."""
    import importlib

    pattern = re.compile(r"\bhpcdist(?:\.[A-Za-z_]\w*)+")
    missing: dict[str, list[str]] = defaultdict(list)
    for path in sorted(ROOT.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        strings = [n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant)]
        comments = [line.split("#", 1)[1] for line in source.splitlines() if "#" in line]
        for text in [s for s in strings if isinstance(s, str)] + comments:
            for dotted in pattern.findall(text):
                parts = dotted.split(".")
                for i in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
                    if "__main__" in parts[:i]:
                        continue  # importing it would run a command
                    try:
                        obj: object = importlib.import_module(".".join(parts[:i]))
                        break
                    except ImportError:
                        continue
                for attr in parts[i:]:
                    if not hasattr(obj, attr):
                        missing[dotted].append(str(path.relative_to(ROOT.parent)))
                        break
                    obj = getattr(obj, attr)
    assert not missing, f"named in hpcdist's text but not defined there: {dict(missing)}"


def test_a_package_docstring_that_lists_its_modules_lists_them_all() -> None:
    # a package whose docstring is a list of its modules (``- ``name``: ...``) names every one of them
    unlisted = {}
    for init in sorted(ROOT.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        if not re.search(r"^- ``\w+``", doc, re.MULTILINE):
            continue
        modules = {p.stem for p in init.parent.glob("*.py") if not p.stem.startswith("__")}
        named = set(re.findall(r"``(\w+)``", doc))
        if modules - named:
            unlisted[str(init.relative_to(ROOT.parent))] = sorted(modules - named)
    assert not unlisted, f"modules missing from their package's list: {unlisted}"


def test_models_exports_each_name_from_its_own_module_and_the_package_only() -> None:
    """``hpcdist.models`` is the one facade; ``models.llama`` exports what it defines, not args' names again (one
    import path per name besides the package's, so a caller cannot pull torch in for a torch-free name)."""
    import hpcdist.models as models
    from hpcdist.models import args, llama

    for module in (args, llama):
        tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
        targets = [t for n in tree.body if isinstance(n, ast.Assign) for t in n.targets]
        targets += [n.target for n in tree.body if isinstance(n, ast.AnnAssign)]
        own = set(defined(ast.unparse(tree))) | {t.id for t in targets if isinstance(t, ast.Name)}
        assert set(module.__all__) <= own, f"{module.__name__} re-exports {sorted(set(module.__all__) - own)}"
    assert set(models.__all__) <= set(args.__all__) | set(llama.__all__)
