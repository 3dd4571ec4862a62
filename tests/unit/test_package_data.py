"""Presets and profiles ship inside the package (hpcdist.resources), so a wheel or ``pip install .`` can train.

The wheel test builds from a copy of the checkout's build inputs (tracked and not-ignored files), so the tree
gets no build/ directory and a stale build/lib cannot hide a missing package-data declaration.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hpcdist import resources
from hpcdist.config.cluster import cluster_names
from hpcdist.config.nccl_profiles import profile_names
from hpcdist.models.args import preset_names

REPO = Path(__file__).resolve().parents[2]
RESOURCES = Path(resources.__file__).resolve().parent
BUILD_INPUTS = ("pyproject.toml", "setup.cfg", "README.md", "hpcdist/")  # what setuptools reads to build the wheel


def _resource_files() -> list[Path]:
    """Every data file under hpcdist/resources/ (not the locator's own code or caches)."""
    files = (p for p in RESOURCES.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    return sorted(p for p in files if p.suffix not in (".py", ".pyc"))


# --------------------------------------------------------------------------------------------- locator


def test_resource_dirs_are_exactly_the_kinds() -> None:
    dirs = sorted(p.name for p in RESOURCES.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert dirs == sorted(resources.KINDS)


@pytest.mark.parametrize("kind", resources.KINDS)
def test_locator_finds_every_shipped_file(kind: resources.Kind) -> None:
    on_disk = [p for p in _resource_files() if p.parent.name == kind]
    assert on_disk, f"nothing shipped under {RESOURCES / kind}"
    # a file the locator cannot name (wrong suffix, e.g. .yml) would silently be unusable
    assert [p.name for p in on_disk] == [f"{n}{resources.SUFFIX}" for n in resources.names(kind)]
    for p in on_disk:
        assert resources.path(kind, p.stem).resolve() == p
    assert [p.resolve() for p in resources.paths(kind)] == on_disk


def test_every_loader_lists_the_shipped_names() -> None:
    assert preset_names() == resources.names("models") and "tiny" in preset_names()
    assert cluster_names() == resources.names("cluster") and "a100_ib" in cluster_names()
    assert profile_names() == resources.names("nccl") and "ib_a100" in profile_names()


def test_unknown_names_and_kinds_are_refused() -> None:
    with pytest.raises(KeyError, match="tiny"):  # the message lists the choices
        resources.path("models", "nope")
    with pytest.raises(KeyError):  # only listed names, never a path that escapes the kind's directory
        resources.path("models", "../cluster/a100_ib")
    with pytest.raises(ValueError, match="models, cluster, nccl"):
        resources.names("configs")  # type: ignore[arg-type]


def test_locator_works_from_a_zipped_install(tmp_path: Path) -> None:
    """A zip on sys.path (zipapp, some bundlers): files are extracted once and stay readable."""
    archive = tmp_path / "hpcdist.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.write(RESOURCES.parent / "__init__.py", "hpcdist/__init__.py")
        zf.write(RESOURCES / "__init__.py", "hpcdist/resources/__init__.py")
        for p in _resource_files():
            zf.write(p, p.relative_to(RESOURCES.parents[1]).as_posix())
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from hpcdist import resources; "
        "assert resources.__file__.startswith(sys.argv[1]), resources.__file__; "
        "p = resources.path('cluster', 'a100_ib'); import pathlib; assert isinstance(p, pathlib.Path), type(p); "
        "assert p.name == 'a100_ib.yaml' and 'hardware:' in p.read_text(), p; "
        "print(resources.names('models')); print(p)"
    )
    # -S: no site-packages, so neither the editable install nor an installed hpcdist can answer the import
    proc = subprocess.run([sys.executable, "-S", "-c", code, str(archive)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    listed, extracted = proc.stdout.splitlines()
    assert listed == str(resources.names("models"))
    assert not Path(extracted).exists(), "the extracted copy must be removed at exit"


def test_configs_holds_no_second_copy() -> None:
    """One source of truth: configs/ keeps user-facing examples only."""
    for kind in resources.KINDS:
        assert not (REPO / "configs" / kind).exists(), f"configs/{kind}/ is back: ship it in hpcdist/resources/{kind}/"


# --------------------------------------------------------------------------------------------- wheel


def _checkout_files() -> list[str]:
    """The build inputs git would commit: tracked or untracked-but-not-ignored, present on disk."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout")
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *BUILD_INPUTS],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sorted({f for f in out.split("\0") if f and (REPO / f).is_file()})


def test_wheel_contains_every_resource_file(tmp_path: Path) -> None:
    files = _checkout_files()
    src = tmp_path / "src"
    for rel in files:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, src / rel)
    out = tmp_path / "wheel"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = out.glob("hpcdist-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        in_wheel = set(zf.namelist())

    shipped = {f for f in files if f.startswith("hpcdist/resources/") and not f.endswith(".py")}
    assert shipped == {p.relative_to(RESOURCES.parents[1]).as_posix() for p in _resource_files()}
    missing = sorted(shipped - in_wheel)
    assert not missing, f"not in the wheel (declare them in setup.cfg [options.package_data]): {missing}"
    extra = sorted(f for f in in_wheel if f.startswith("hpcdist/resources/") and f not in files)
    assert not extra, f"in the wheel but not in the checkout: {extra}"
    # every module too: a package directory without __init__.py would silently be left out by find:
    modules = {f for f in files if f.endswith(".py")}
    assert modules <= in_wheel, sorted(modules - in_wheel)
    assert not [f for f in in_wheel if f.startswith("configs/")]


def test_shipped_examples_are_the_checkouts_configs() -> None:
    """hpcdist/resources/examples/ ships byte copies of configs/demo.yaml and train_13b.yaml: a test fails on drift."""
    assert resources.names("examples") == ["demo", "train_13b"]
    for name in resources.names("examples"):
        assert resources.path("examples", name).read_bytes() == (REPO / "configs" / f"{name}.yaml").read_bytes(), (
            f"cp configs/{name}.yaml hpcdist/resources/examples/"
        )


def test_a_shipped_example_is_named_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A wheel user has no configs/demo.yaml; `hpcdist train demo` names the shipped one (a file called
    demo in the directory would win), and a wrong name lists the examples."""
    from hpcdist import cli
    from hpcdist.launch.task import TrainTask

    monkeypatch.chdir(tmp_path)
    assert cli.main(["config", "demo", "train.steps=7"]) == 0
    out = capsys.readouterr().out
    assert "name: demo" in out and "steps: 7" in out
    assert TrainTask("demo").config_path == str(resources.path("examples", "demo"))  # what submit sends
    assert cli.main(["config", "dmeo"]) == 2
    assert "or a shipped example: demo, train_13b" in capsys.readouterr().err
    (tmp_path / "demo").write_text("run: {name: mine}\n")
    assert cli.main(["config", "demo"]) == 0 and "name: mine" in capsys.readouterr().out
