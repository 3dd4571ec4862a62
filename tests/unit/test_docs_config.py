"""Every config key is discoverable from the tool: ``hpcdist config --reference`` and docs/CONFIG.md list each key
of the schema with its real default; the starter config does not hide its preset; an empty config is refused."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from hpcdist.config.schema import JobConfig
from tests.unit.harness import REPO


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The schema's defaults as {section.key: value}, from an instance (not from the reference's own walk)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


DEFAULTS = _flat(dataclasses.asdict(JobConfig()))


def _yaml(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()


def _hpcdist(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hpcdist", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_the_reference_lists_every_key_with_its_default() -> None:
    proc = _hpcdist("config", "--reference")
    assert proc.returncode == 0, proc.stderr
    lines = {line.split()[0]: line for line in proc.stdout.splitlines() if line.startswith("  ") and "default" in line}
    missing = sorted(set(DEFAULTS) - set(lines))
    assert not missing, f"keys missing from `hpcdist config --reference`: {missing}"
    wrong = [k for k, v in DEFAULTS.items() if f"default {_yaml(v)})" not in lines[k]]
    assert not wrong, f"defaults that differ from the schema's: {[lines[k] for k in wrong]}"
    assert len(DEFAULTS) >= 120


def test_the_reference_of_one_section_and_an_unknown_one() -> None:
    proc = _hpcdist("config", "--reference", "optim")
    assert proc.returncode == 0 and "optim.lr" in proc.stdout and "train.steps" not in proc.stdout
    bad = _hpcdist("config", "--reference", "optimizer")
    assert bad.returncode == 2 and "one of run, model, data" in bad.stderr


def test_config_md_lists_every_key_with_its_default_and_is_current() -> None:
    page = (REPO / "docs" / "CONFIG.md").read_text(encoding="utf-8")
    rows = {r.split(" | ")[0].strip("| `"): r for r in page.splitlines() if r.startswith("| `")}
    missing = sorted(set(DEFAULTS) - set(rows))
    assert not missing, f"keys missing from docs/CONFIG.md (run tools/docs/config_reference): {missing}"
    wrong = [k for k, v in DEFAULTS.items() if f"| `{_yaml(v)}` |" not in rows[k]]
    assert not wrong, f"docs/CONFIG.md defaults differ from the schema's (run tools/docs/config_reference): {wrong}"
    empty = [k for k, r in rows.items() if r.rstrip().endswith("|  |")]
    assert not empty, f"keys without a meaning (add a docstring under the field in schema.py): {empty}"
    check = subprocess.run([sys.executable, "tools/docs/config_reference", "--check"], cwd=REPO, capture_output=True)
    assert check.returncode == 0, check.stdout


def _starter_with_preset(tmp_path: Path, commented: bool) -> Path:
    args = ("config", "demo", *(["--commented"] if commented else []))
    starter = _hpcdist(*args)
    assert starter.returncode == 0, starter.stderr
    assert "preset: tiny" in starter.stdout
    mine = tmp_path / "my.yaml"
    mine.write_text(starter.stdout.replace("preset: tiny", "preset: 7b"), encoding="utf-8")
    return mine


def test_the_commented_starter_takes_an_edited_preset(tmp_path: Path) -> None:
    mine = _starter_with_preset(tmp_path, commented=True)
    assert "# Peak learning rate" in mine.read_text(encoding="utf-8")
    proc = _hpcdist("config", str(mine))
    assert proc.returncode == 0, proc.stderr
    model = yaml.safe_load(proc.stdout)["model"]
    assert (model["dim"], model["n_layers"], model["preset"]) == (4096, 32, "7b")
    assert "warning" not in proc.stderr


def test_model_keys_that_hide_the_preset_are_named_in_one_line(tmp_path: Path) -> None:
    mine = _starter_with_preset(tmp_path, commented=False)  # the resolved dump: tiny's shape, explicitly
    proc = _hpcdist("config", str(mine))
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "win over model.preset 7b" in line]
    assert len(warnings) == 1, proc.stderr
    assert "dim=256 (preset: 4096)" in warnings[0] and "delete them" in warnings[0]
    unchanged = _hpcdist("config", "demo")
    assert "win over model.preset" not in unchanged.stderr


@pytest.mark.parametrize("text", ["", "# only a comment\n"])
def test_an_empty_config_is_refused_naming_the_run_dir(tmp_path: Path, text: str) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text(text, encoding="utf-8")
    proc = _hpcdist("train", str(empty), cwd=tmp_path)  # were it to train, it would write here
    assert proc.returncode == 2
    assert "holds no settings" in proc.stderr and "run.dir runs/demo" in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists()


def test_a_directory_as_the_config_is_named_as_a_directory(tmp_path: Path) -> None:
    (tmp_path / "job.yaml").write_text("train:\n  steps: 2\n", encoding="utf-8")
    proc = _hpcdist("config", str(tmp_path))
    assert proc.returncode == 2 and "is a directory; pass a YAML file inside it" in proc.stderr, proc.stderr
    assert "job.yaml" in proc.stderr
