"""The house rules of docs/ARCHITECTURE.md, checked on the source: no import cycles, the trainer knows no scheduler
and no planner, only the SLURM package (hpcdist.schedulers.slurm) names SLURM_* variables or SlurmJob or runs a
SLURM tool, hpcdist.launch (scheduler-neutral) names no SLURM tool in its code, and a scheduler's package is
reached through the scheduler table only.

Imports are read from the AST of every hpcdist module, function-level ones included: a cycle hidden by an import
inside a function is still a cycle (it only moves the failure to run time). ``if TYPE_CHECKING:`` blocks never run
and are left out. Importing ``hpcdist.a.b`` also runs ``hpcdist/a/__init__.py``, so it counts as an edge to
``hpcdist.a`` too (not to the root package, whose only import is its lazy ``hpcdist.submit``).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "hpcdist"

# Third-party modules hpcdist imports inside functions on purpose (optional or heavy: the module works, or imports
# fast, without them). Any other lazy third-party import fails the test: say why and add it here.
LAZY_THIRD_PARTY = {
    "deepspeed",  # optional: only parallel.strategy=zero
    "submitit",  # only when a job is rendered or submitted, never on the nodes' import path
    "tensorboard",
    "torch",  # hpcdist.launch.task / nccl_check / the supervisor start without it
    "wandb",
    "mlflow",
    "prometheus_client",
    "matplotlib",  # the run report's PNGs
    "yaml",
    "numpy",
    "transformers",
    "safetensors",
    "huggingface_hub",
    "sentencepiece",
    "tiktoken",
    "pyarrow",  # optional (hpcdist[data]): only when a parquet corpus is prepared
    "datasets",  # optional (hpcdist[data]): only when a Hugging Face datasets directory is prepared
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _walk(tree: ast.AST) -> Iterator[tuple[ast.AST, bool]]:
    """(import node, inside a function) for every import outside ``if TYPE_CHECKING:``."""

    def visit(node: ast.AST, in_function: bool) -> Iterator[tuple[ast.AST, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    yield from visit(sub, in_function)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, in_function
            yield from visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    yield from visit(tree, False)


def _resolve(module: str, node: ast.AST) -> list[str]:
    """The modules an import statement names (``from . import x`` and ``from pkg import submodule`` resolved)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:
        package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        out.append(sub if sub in MODULES else base)
    return out


def _edges() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> hpcdist modules it imports, module -> third-party top-level names it imports inside functions)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    lazy: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for node, in_function in _walk(ast.parse(path.read_text(), str(path))):
            for target in _resolve(module, node):
                if target.split(".")[0] != "hpcdist":
                    top = target.split(".")[0]
                    if in_function and top not in sys.stdlib_module_names:
                        lazy[module].add(top)
                    continue
                while target not in MODULES and "." in target:  # `import hpcdist.x.y as z` of an attribute
                    target = target.rpartition(".")[0]
                graph[module].add(target)
                # importing hpcdist.a.b runs hpcdist/a/__init__.py first (the root package excepted, see above;
                # and a package's own modules, which Python imports only once their package has started)
                parent = target.rpartition(".")[0]
                while parent.count(".") >= 1:
                    if not module.startswith(f"{parent}."):
                        graph[module].add(parent)
                    parent = parent.rpartition(".")[0]
        graph[module].discard(module)
    return graph, lazy


# Modules of a package that are their own unit in the package graph: standard-library leaves that layers below
# their package read (config's rules and the run report read the checkpoint names without the checkpoint code).
# Each may import only the standard library and LEAF_MAY_IMPORT; its package's __init__ must import nothing.
LEAF_MODULES = {"hpcdist.checkpoint.names"}
LEAF_MAY_IMPORT = {"hpcdist.base", "hpcdist.base.logging_utils"}  # the package: a docstring only


def _package(module: str) -> str:
    """hpcdist.launch.task -> hpcdist.launch; hpcdist.run -> hpcdist.run (a top-level module is its own unit);
    a leaf module (LEAF_MODULES) is its own unit too."""
    return module if module in LEAF_MODULES else ".".join(module.split(".")[:2])


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one node (Tarjan), as a readable path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return [_path_through(graph, comp) for comp in components]


def _path_through(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """A shortest cycle through the component's first node, e.g. [a, b, c, a]."""
    members, start = set(comp), comp[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
                if w not in previous:
                    previous[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def _describe(cycles: list[list[str]]) -> str:
    return "\n".join("  " + " -> ".join(c) for c in cycles)


def test_no_import_cycle_between_modules() -> None:
    graph, _ = _edges()
    cycles = _cycles(graph)
    assert not cycles, f"import cycles (function-level imports included):\n{_describe(cycles)}"


def test_no_import_cycle_between_packages() -> None:
    graph, _ = _edges()
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        if module == "hpcdist":
            continue  # the root's lazy hpcdist.submit is a facade, not a dependency of everything below it
        # a leaf's empty package __init__ (run first by Python, see above) is no dependency on the package
        leaf_parents = {t.rpartition(".")[0] for t in targets & LEAF_MODULES}
        packages.setdefault(_package(module), set()).update(
            _package(t)
            for t in targets
            if t != "hpcdist" and _package(t) != _package(module) and not (t in leaf_parents and not graph[t])
        )
    cycles = _cycles(packages)
    assert not cycles, f"import cycles between packages / top-level modules:\n{_describe(cycles)}"


def test_leaf_modules_are_leaves() -> None:
    """A leaf module (LEAF_MODULES) imports the standard library and LEAF_MAY_IMPORT only, and its package's
    __init__ imports nothing: a torch-free caller below the package reaches no more than the leaf."""
    graph, _ = _edges()
    for leaf in LEAF_MODULES:
        assert graph[leaf] <= LEAF_MAY_IMPORT | {leaf.rpartition(".")[0]}, (leaf, graph[leaf])
        assert not graph[leaf.rpartition(".")[0]], leaf.rpartition(".")[0]
        tree = ast.parse(MODULES[leaf].read_text())
        third = {n.split(".")[0] for node, _ in _walk(tree) for n in _resolve(leaf, node)} - {"hpcdist", "__future__"}
        assert third <= set(sys.stdlib_module_names), (leaf, third)


def test_function_level_imports_are_optional_dependencies_only() -> None:
    _, lazy = _edges()
    unexpected = {m: sorted(names - LAZY_THIRD_PARTY) for m, names in lazy.items() if names - LAZY_THIRD_PARTY}
    assert not unexpected, f"third-party imports inside functions, not on the allow-list: {unexpected}"


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph[todo.pop()]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def test_nothing_imports_the_cli() -> None:
    """Hpcdist.cli is the top (argparse, dispatch, the one error wrapper); a command body or a library
    that imports it would put a command back in the CLI. Refusals go through hpcdist.base.errors, a leaf."""
    graph, _ = _edges()
    importers = sorted(m for m, targets in graph.items() if "hpcdist.cli" in targets and m != "hpcdist.__main__")
    assert not importers, f"modules importing hpcdist.cli: {importers}"
    assert graph["hpcdist.base.errors"] <= {"hpcdist.base.atomic", "hpcdist.base.rundir"}, graph["hpcdist.base.errors"]


@pytest.mark.parametrize("forbidden", ["hpcdist.launch", "hpcdist.planning"])
def test_the_trainer_knows_no_scheduler_and_no_planner(forbidden: str) -> None:
    graph, _ = _edges()
    direct = {t for t in graph["hpcdist.trainer"] if t == forbidden or t.startswith(f"{forbidden}.")}
    assert not direct, f"hpcdist.trainer imports {sorted(direct)}"
    # nor through the modules it builds on (fault, parallel, checkpoint, ...)
    reached = {t for t in _reachable(graph, "hpcdist.trainer") if t == forbidden or t.startswith(f"{forbidden}.")}
    assert not reached, f"hpcdist.trainer reaches {sorted(reached)} through its imports"


def _code_strings(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """String constants that are code, not documentation: docstrings are left out (comments are not in the AST)."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            docstrings.add(id(node.value))  # attribute docstrings and other bare string statements
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


# The modules that may know SLURM: its package (job facts, client, step command, sbatch rendering, its table row).
SLURM_PACKAGE = "hpcdist.schedulers.slurm"
SLURM_MODULES = {m for m in MODULES if m == SLURM_PACKAGE or m.startswith(f"{SLURM_PACKAGE}.")}
# Modules that know one scheduler (each row of the scheduler table); everything else reaches them through the table.
SCHEDULER_MODULES = {m for m in MODULES if m.startswith("hpcdist.schedulers.") and m != "hpcdist.schedulers.base"}
# SLURM's programs. Their names in code (a string, an identifier) outside the SLURM package mean running or
# rendering them there; in documentation (docstrings, comments) and help texts they are words.
SLURM_TOOLS = ("srun", "sbatch", "salloc", "scontrol", "sinfo", "squeue", "sacct", "scancel")


def _launch(module: str) -> bool:
    return module == "hpcdist.launch" or module.startswith("hpcdist.launch.")


def _identifiers(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Every name the code defines or uses: imports, names, attributes, definitions, arguments, keywords."""
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [node.name]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        elif isinstance(node, ast.keyword):
            names = [node.arg or ""]
        elif isinstance(node, ast.alias):
            names = [node.name, node.asname or ""]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        for name in names:
            if name:
                yield getattr(node, "lineno", 0), name


def _slurm_mentions(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Code that names SLURM: strings naming a ``SLURM_`` variable, and any identifier (import, name, attribute,
    definition, argument) naming ``SlurmJob``; documentation (docstrings, comments) is left out."""
    for line, text in _code_strings(tree):
        if "SLURM_" in text:
            yield line, text
    for line, name in _identifiers(tree):
        if "SlurmJob" in name:
            yield line, name


def _slurm_tool_mentions(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Code that names a SLURM tool: a string or an identifier containing one (``"srun"``, ``render_sbatch``)."""
    for line, text in [*_code_strings(tree), *_identifiers(tree)]:
        if any(tool in text for tool in SLURM_TOOLS):
            yield line, text


def _slurm_tool_runs(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Code that runs a SLURM tool: a string that is a tool's name (``shutil.which("scontrol")``, an argv)."""
    for line, text in _code_strings(tree):
        if text.strip() in SLURM_TOOLS:
            yield line, text


def test_only_the_slurm_package_names_slurm() -> None:
    """The job's facts reach the trainer, hpcdist.fault and hpcdist.launch as DistEnv.job / job_facts()
    (scheduler-neutral JobFacts); SLURM's variables are read in hpcdist.schedulers.slurm only."""
    assert "hpcdist.schedulers.slurm.client" in SLURM_MODULES, sorted(SLURM_MODULES)
    offenders = [
        f"{path.relative_to(REPO)}:{line}: {text[:80]!r}"
        for module, path in MODULES.items()
        if module not in SLURM_MODULES
        for line, text in _slurm_mentions(ast.parse(path.read_text()))
    ]
    assert not offenders, (
        "SLURM_* or SlurmJob outside hpcdist.schedulers.slurm (read the job's facts from DistEnv.job, or "
        "hpcdist.schedulers.job_facts where no DistEnv is at hand):\n" + "\n".join(offenders)
    )


def test_only_the_slurm_package_runs_slurm_tools() -> None:
    """One client with timeouts runs srun, scontrol, sinfo, squeue, sacct and scancel: hpcdist.schedulers.slurm's."""
    offenders = [
        f"{path.relative_to(REPO)}:{line}: {text[:80]!r}"
        for module, path in MODULES.items()
        if module not in SLURM_MODULES
        for line, text in _slurm_tool_runs(ast.parse(path.read_text()))
    ]
    assert not offenders, "SLURM tools run outside hpcdist.schedulers.slurm:\n" + "\n".join(offenders)


def test_launch_is_scheduler_neutral() -> None:
    """hpcdist.launch orchestrates (submit, attempts, restarts, records, sweep, snapshot) through the scheduler's
    Launcher: its code names no SLURM tool and no SLURM_* variable; a message that must say ``sbatch`` or ``srun``
    takes the word from the Launcher (submit_command, step_tool)."""
    offenders = [
        f"{path.relative_to(REPO)}:{line}: {text[:80]!r}"
        for module, path in MODULES.items()
        if _launch(module)
        for line, text in _slurm_tool_mentions(ast.parse(path.read_text()))
    ]
    assert not offenders, "SLURM tools named in hpcdist.launch's code:\n" + "\n".join(offenders)


def test_a_scheduler_module_is_reached_through_the_table_only() -> None:
    """A new scheduler (PBS, Kubernetes) is a package in hpcdist.schedulers plus its row in the table: nothing in
    env, the trainer, fault, parallel, data or launch imports a scheduler's package by name."""
    assert SCHEDULER_MODULES >= SLURM_MODULES
    graph, _ = _edges()
    offenders = {
        module: sorted(graph[module] & SCHEDULER_MODULES)
        for module in MODULES
        if graph[module] & SCHEDULER_MODULES and not module.startswith("hpcdist.schedulers")
    }
    assert not offenders, f"scheduler modules imported outside hpcdist.schedulers: {offenders}"


def test_the_slurm_check_sees_code_not_documentation() -> None:
    tree = ast.parse(
        '"""SLURM_JOB_ID and SlurmJob in a docstring, srun too."""\n'
        "from hpcdist.env import SlurmJob as J  # SLURM_X in a comment, scontrol too\n"
        'x = os.environ["SLURM_RESTART_COUNT"]\n'
        "def f(job: J) -> None:\n    return SlurmJob.from_environ()\n"
        'y = shutil.which("scontrol")\n'
        "def render_sbatch() -> None:\n    pass\n"
    )
    assert sorted(_slurm_mentions(tree)) == [(2, "SlurmJob"), (3, "SLURM_RESTART_COUNT"), (5, "SlurmJob")]
    assert sorted(_slurm_tool_runs(tree)) == [(6, "scontrol")]
    assert sorted(_slurm_tool_mentions(tree)) == [(6, "scontrol"), (7, "render_sbatch")]


def test_the_checks_see_hidden_cycles_and_lazy_imports(tmp_path: Path) -> None:
    """The checker itself: a function-level import closes a cycle; ``from . import x`` resolves to the module."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert _cycles(graph) == [["a", "b", "a"]]
    tree = ast.parse("import os\nif TYPE_CHECKING:\n    import x\ndef f():\n    from . import run\n    import yaml\n")
    found = [(type(n).__name__, f) for n, f in _walk(tree)]
    assert found == [("Import", False), ("ImportFrom", True), ("Import", True)]
    assert _resolve("hpcdist.launch.task", next(n for n, _ in _walk(tree) if isinstance(n, ast.ImportFrom))) == [
        "hpcdist.launch"
    ]
    assert "hpcdist.launch" in MODULES and "hpcdist.run" in MODULES


# ----------------------------------------------------------------------------------------- layout vocabulary

# parallel.strategy values and layout kind names. Only hpcdist.config.layout (the alias functions: requested_kind,
# strategy_degrees, strategy_of, needs_planner, LayoutKind.named) compares them; everyone else asks the degrees,
# the ZeRO stage or a LayoutKind member (docs/ARCHITECTURE.md, "one layout vocabulary").
LAYOUT_OWNER = "hpcdist.config.layout"
_KIND_NAMES = {"ddp", "zero", "zero1", "zero2", "zero3", "fsdp", "hsdp", "3d"}


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def _vocab(node: ast.AST, *, about_strategy: bool) -> list[str]:
    """The layout words a comparison operand (a string, or a tuple / list / set of them) holds. "auto" is a word
    of many settings (dtypes, resume, executors), so it counts only beside a name that says strategy."""
    words = _KIND_NAMES | ({"auto"} if about_strategy else set())
    elts = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str) and e.value in words]


def strategy_switches(source: str) -> list[tuple[int, str]]:
    """(line, what) for every comparison, ``match`` case or ``startswith`` against a layout word in ``source``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            about = any("strategy" in n.lower() for op in operands for n in _names(op))
            words = [w for op in operands for w in _vocab(op, about_strategy=about)]
            if words:
                found.append((node.lineno, f"compares with {words}"))
        elif isinstance(node, ast.Match):
            about = any("strategy" in n.lower() for n in _names(node.subject))
            for case in node.cases:
                values = [p.value for p in ast.walk(case.pattern) if isinstance(p, ast.MatchValue)]
                words = [w for v in values for w in _vocab(v, about_strategy=about)]
                if words:
                    found.append((case.pattern.lineno, f"match case {words}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith":
            words = [w for a in node.args for w in _vocab(a, about_strategy=False)]
            if words:
                found.append((node.lineno, f"startswith {words}"))
    return sorted(found)


def test_only_the_layout_module_compares_strategy_strings() -> None:
    """parallel.strategy is user input turned into degrees once (hpcdist.config.layout); a new ``strategy ==
    "zero"`` elsewhere is a second owner of the layout vocabulary. Ask ``ParallelDims`` / ``LayoutKind`` instead."""
    offenders = [
        f"{path.relative_to(REPO)}:{line}: {what}"
        for module, path in MODULES.items()
        if module != LAYOUT_OWNER
        for line, what in strategy_switches(path.read_text())
    ]
    assert not offenders, "layout strings compared outside hpcdist.config.layout:\n" + "\n".join(offenders)


def test_the_strategy_scan_sees_every_form() -> None:
    """The scanner itself: each way of switching on a strategy string is found; other uses of the words are not."""
    source = (
        'if cfg.parallel.strategy == "zero": pass\n'
        'if strategy in ("ddp", "fsdp"): pass\n'
        'if cfg.parallel.strategy != "auto": pass\n'
        'match par.strategy:\n    case "3d": pass\n    case "hsdp" | "zero1": pass\n'
        'ok = name.startswith("zero")\n'
        # not switches: another setting's "auto", a mesh key, a LayoutKind member
        'if dtype == "auto": pass\nmesh = meshes["fsdp"]\nif kind is LayoutKind.DDP: pass\n'
    )
    assert [line for line, _ in strategy_switches(source)] == [1, 2, 3, 5, 6, 7]


# what the training loop may touch besides its own plain fields (cfg, step, tokens_seen, ...): model/strategy step,
# data, checkpoint, the observability entry point, stop and fault guards (torchtitan's loop has ~5)
LOOP_COLLABORATORS = {"strategy", "loader", "ckpt", "observer", "stop_flag", "watchdog", "nonfinite"}
LOOP_OWN = {"cfg", "step", "tokens_seen", "tokens_per_step", "save", "local_save", "_triage"}  # _triage: NaN re-run


def _loop_collaborators(source: str) -> set[str]:
    """The ``self.<name>`` that ``Trainer._loop`` reaches, its own fields and methods left out."""
    tree = ast.parse(source)
    loop = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_loop")
    names = {
        n.attr
        for n in ast.walk(loop)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
    }
    return names - LOOP_OWN


def test_the_training_loop_talks_to_one_observer_and_few_collaborators() -> None:
    """The loop talked to 13 collaborators each step (profiler, throughput, Prometheus, metrics,
    evaluator, stragglers, goodput, ...); observability now has one per-step entry point, ``Observer.step``."""
    assert _loop_collaborators((PACKAGE / "trainer.py").read_text()) <= LOOP_COLLABORATORS
    old = "def _loop(self):\n    self.profiler.before_step(1)\n    self.prom.step(1)\n    self.step += 1\n"
    assert _loop_collaborators(old) == {"profiler", "prom"}  # the check sees what it should refuse


def test_observability_is_one_package_whose_summary_loads_no_torch() -> None:
    """metrics.py, trackers.py, prometheus_metrics.py, run_summary.py and profiling.py were five top-level rooms;
    hpcdist/metrics/ holds them, and its __init__ imports nothing, so the summary (standard library) stays light."""
    rooms = {"trackers", "prometheus_metrics", "run_summary", "profiling", "metrics"}
    assert not [r for r in rooms if (PACKAGE / f"{r}.py").exists()]
    assert {"observer", "throughput", "logger", "trackers", "prometheus", "summary", "profiling"} <= {
        m.rpartition(".")[2] for m in MODULES if m.startswith("hpcdist.metrics.")
    }
    init = ast.parse((PACKAGE / "metrics" / "__init__.py").read_text())
    assert not [n for n, _ in _walk(init)]
    graph, _ = _edges()
    light = {
        "hpcdist.base",  # the package: a docstring only
        "hpcdist.base.atomic",
        "hpcdist.base.rundir",
        "hpcdist.base.untrusted",
        "hpcdist.metrics",
    }  # standard library only
    assert graph["hpcdist.metrics.summary"] <= light
    assert graph["hpcdist.base.untrusted"] <= {"hpcdist.base", "hpcdist.base.atomic"}


def test_base_is_a_leaf_every_layer_may_import() -> None:
    # hpcdist.base holds the standard-library leaves (atomic writes, trust, safe YAML, signals, errors, logging, run-dir
    # names, the bounded record reader): any layer imports them, so they import nothing of hpcdist outside the folder
    # and no third-party package but PyYAML (the safe loader), not even lazily
    base = {m for m in MODULES if m == "hpcdist.base" or m.startswith("hpcdist.base.")}
    assert len(base) > 5
    for module in sorted(base):
        for node, _ in _walk(ast.parse(MODULES[module].read_text())):
            for target in _resolve(module, node):
                top = target.split(".")[0]
                if top == "hpcdist":
                    assert target in base, (module, target)
                else:
                    assert top in sys.stdlib_module_names or top == "yaml", (module, target)
