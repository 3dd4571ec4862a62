"""Unit tests for hpcdist.config: precedence, every shipped YAML, every error message, save/load, fuzzing."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given

from hpcdist import config as config_mod
from hpcdist import resources
from hpcdist.config import (
    ConfigError,
    DataError,
    JobConfig,
    check,
    check_data,
    check_world,
    load,
    parse_overrides,
    save,
)
from hpcdist.models.args import ModelArgs, load_preset, preset_names
from tests.unit.fuzz import DOCS, FIELDS, FUZZ, OVERRIDES, SECTIONS

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "configs"  # user-facing example jobs only; presets and profiles ship in hpcdist/resources/
# Collected at import time so a new YAML is tested without touching this file. Model presets are not job
# configs (their keys are ModelArgs fields, not sections): they are tested through model.preset below.
JOB_CONFIGS = sorted(CONFIGS.glob("*.yaml"))
PRESET_FILES = resources.paths("models")
SHIPPED_YAML = [p for kind in resources.KINDS for p in resources.paths(kind)]
ALL_YAML = sorted(CONFIGS.rglob("*.yaml")) + SHIPPED_YAML  # every YAML a user sees or the package ships


def _rel(p: Path) -> str:
    """Test id: the path in the checkout (or <kind>/<file> for a shipped file of an installed package)."""
    return p.relative_to(REPO).as_posix() if p.is_relative_to(REPO) else f"{p.parent.name}/{p.name}"


def _problems(path: str | os.PathLike[str] | None = None, overrides: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The problems of a config that must fail; also checks the report's header counts them."""
    with pytest.raises(ConfigError) as exc:
        load(path, overrides)
    problems = exc.value.problems
    assert problems, "a ConfigError must carry at least one problem"
    n = len(problems)
    assert str(exc.value).startswith(f"Invalid configuration ({n} problem{'s' if n != 1 else ''}):")
    for p in problems:
        assert p in str(exc.value)
    return problems


def _one_problem(overrides: list[str], *fragments: str, path: str | os.PathLike[str] | None = None) -> str:
    """Exactly one problem, containing every fragment (the key and the fix)."""
    problems = _problems(path, overrides)
    assert len(problems) == 1, problems
    for frag in fragments:
        assert frag in problems[0], f"{frag!r} not in {problems[0]!r}"
    return problems[0]


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# --------------------------------------------------------------------------------------------------- precedence


def test_defaults_without_a_file_are_valid() -> None:
    assert load() == JobConfig()
    assert load(None, []) == JobConfig()
    assert check(JobConfig()) == []


def test_empty_yaml_file_is_refused_naming_the_run_dir_it_would_use(tmp_path: Path) -> None:
    """Every key its default would train into the demo's run.dir: a file that says nothing is a mistake."""
    with pytest.raises(ConfigError, match=r"holds no settings .* run\.dir runs/demo"):
        load(_write(tmp_path / "empty.yaml", "# nothing here\n"))


def test_yaml_overrides_defaults_and_leaves_the_rest(tmp_path: Path) -> None:
    path = _write(tmp_path / "job.yaml", "train:\n  steps: 5\noptim:\n  lr: 0.01\n  schedule: linear\n")
    cfg = load(path)
    assert (cfg.train.steps, cfg.optim.lr, cfg.optim.schedule) == (5, 0.01, "linear")
    default = JobConfig()
    assert cfg.train.global_batch_size == default.train.global_batch_size
    assert cfg.optim.warmup_steps == default.optim.warmup_steps
    assert cfg.model == default.model


def test_cli_overrides_beat_yaml(tmp_path: Path) -> None:
    path = _write(tmp_path / "job.yaml", "train:\n  steps: 5\n  eval_batches: 2\n")
    cfg = load(path, ["train.steps=9", "optim.lr=0.5"])
    assert cfg.train.steps == 9  # CLI > YAML
    assert cfg.train.eval_batches == 2  # YAML > defaults
    assert cfg.optim.lr == 0.5  # CLI > defaults


def test_last_override_of_a_key_wins() -> None:
    assert load(None, ["train.steps=3", "train.steps=4"]).train.steps == 4


def test_preset_sits_between_yaml_and_defaults(tmp_path: Path) -> None:
    tiny = load_preset("tiny")
    assert tiny["n_heads"] != ModelArgs().n_heads and tiny["max_seq_len"] != ModelArgs().max_seq_len
    path = _write(tmp_path / "job.yaml", "model:\n  preset: tiny\n  max_seq_len: 512\n")

    cfg = load(path)
    assert cfg.model.n_heads == tiny["n_heads"]  # preset > defaults
    assert cfg.model.max_seq_len == 512  # YAML > preset
    assert cfg.model.preset == "tiny"

    cfg = load(path, ["model.max_seq_len=1024", "model.dim=512"])
    assert cfg.model.max_seq_len == 1024  # CLI > YAML
    assert cfg.model.dim == 512  # CLI > preset
    assert cfg.model.n_kv_heads == tiny["n_kv_heads"]


@pytest.mark.parametrize(
    "overrides",
    [["model.preset=tiny", "model.dim=512"], ["model.dim=512", "model.preset=tiny"]],
    ids=["after", "before"],
)
def test_cli_model_key_beats_cli_preset_in_any_order(overrides: list[str]) -> None:
    cfg = load(None, overrides)
    assert cfg.model.dim == 512
    assert cfg.model.n_heads == load_preset("tiny")["n_heads"]


def test_cli_preset_replaces_yaml_preset(tmp_path: Path) -> None:
    path = _write(tmp_path / "job.yaml", "model:\n  preset: tiny\n")
    cfg = load(path, ["model.preset=125m"])
    assert cfg.model.preset == "125m"
    assert cfg.model.dim == load_preset("125m")["dim"]


@pytest.mark.parametrize(
    ("override", "section", "key", "expected"),
    [
        ("train.steps=12", "train", "steps", 12),
        ("optim.lr=3e-4", "optim", "lr", 3e-4),  # YAML 1.1 reads "3e-4" as a string; a float field accepts it
        ("optim.lr=3.0e-4", "optim", "lr", 3e-4),
        ("optim.lr=1", "optim", "lr", 1.0),  # an int is a fine float
        ("optim.eps=1e-8", "optim", "eps", 1e-8),
        ("train.compile=true", "train", "compile", True),
        ("logging.tensorboard=false", "logging", "tensorboard", False),
        ("data.max_tokens=null", "data", "max_tokens", None),
        ("data.max_tokens=~", "data", "max_tokens", None),
        ("model.n_kv_heads=null", "model", "n_kv_heads", None),
        ("logging.peak_flops=1e11", "logging", "peak_flops", 1e11),
        ("run.name=my run", "run", "name", "my run"),
        ("run.name=123", "run", "name", "123"),  # a number is a fine string
        ("run.dir=runs/a=b", "run", "dir", "runs/a=b"),  # only the first '=' splits
    ],
)
def test_override_values_parse_as_yaml_scalars(override: str, section: str, key: str, expected: Any) -> None:
    value = getattr(getattr(load(None, [override]), section), key)
    assert value == expected
    assert type(value) is type(expected)


def test_parse_overrides_builds_a_nested_tree() -> None:
    tree, problems = parse_overrides(["train.steps=3", "model.preset=tiny", "train.compile=yes", "a.b.c=[1, 2]"])
    assert problems == []
    assert tree == {"train": {"steps": 3, "compile": True}, "model": {"preset": "tiny"}, "a": {"b": {"c": [1, 2]}}}


def test_parse_overrides_rejects_a_key_that_is_both_value_and_section() -> None:
    _, problems = parse_overrides(["train.steps=3", "train.steps.sub=1"])
    assert len(problems) == 1
    assert "train.steps.sub=1" in problems[0] and "steps" in problems[0]


# --------------------------------------------------------------------------------------------------- shipped YAMLs


def test_shipped_config_lists_are_not_empty() -> None:
    assert JOB_CONFIGS, f"no job configs found under {CONFIGS}"
    assert PRESET_FILES, "no model presets found by hpcdist.resources"
    assert (CONFIGS / "demo.yaml") in JOB_CONFIGS


@pytest.mark.parametrize("path", JOB_CONFIGS, ids=_rel)
def test_job_config_loads_and_validates(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # relative paths in configs (presets, data) are relative to the repo root
    cfg = load(path)
    assert isinstance(cfg, JobConfig)
    assert check(cfg) == []
    assert cfg.model_args().problems() == []
    # what the trainer saves beside the run must load back to the same config
    assert load(save(cfg, tmp_path / "resolved.yaml")) == cfg


@pytest.mark.parametrize("path", PRESET_FILES, ids=_rel)
def test_model_preset_file_is_valid(path: Path) -> None:
    fields = load_preset(str(path))
    valid = {f.name for f in dataclasses.fields(ModelArgs)}
    assert fields and set(fields) <= valid
    assert ModelArgs(**fields).problems() == []
    assert path.stem in preset_names()
    assert load_preset(path.stem) == fields


@pytest.mark.parametrize("path", PRESET_FILES, ids=_rel)
@pytest.mark.parametrize("by", ["name", "path"])
def test_model_preset_loads_through_model_preset_key(path: Path, by: str) -> None:
    ref = path.stem if by == "name" else str(path)
    cfg = load(None, [f"model.preset={ref}"])
    assert cfg.model.preset == ref
    for key, value in load_preset(str(path)).items():
        assert getattr(cfg.model, key) == value, key


def test_demo_uses_the_tiny_preset_and_its_batch_split() -> None:
    cfg = load(CONFIGS / "demo.yaml")
    assert cfg.model.preset == "tiny"
    assert cfg.model.dim == load_preset("tiny")["dim"]
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size) == (16, 2)


# ----------------------------------------------------------------------------------------------- errors: keys, types


def test_unknown_section_suggests_and_lists_sections() -> None:
    msg = _one_problem(["trian.steps=3"], "trian: unknown key", "did you mean 'train'?", "valid keys: ")
    for section in SECTIONS:
        assert section in msg


def test_unknown_section_in_yaml(tmp_path: Path) -> None:
    path = _write(tmp_path / "job.yaml", "optimizer:\n  lr: 0.1\n")
    _one_problem([], "optimizer: unknown key", "did you mean 'optim'?", "valid keys: run, model", path=path)


def test_unknown_key_suggests_close_match_and_lists_valid_keys() -> None:
    msg = _one_problem(["train.stepz=3"], "train.stepz: unknown key", "did you mean 'steps'?", "valid keys: ")
    for key in FIELDS["train"]:
        assert key in msg


def test_a_key_that_is_no_name_is_one_problem(tmp_path: Path) -> None:
    # YAML's `?` alone is a mapping with a null key; `{1: 2}` has an integer one
    _one_problem(["logging.wandb=?"], "logging.wandb: a key must be a name, got None")
    path = _write(tmp_path / "job.yaml", "train:\n  1: 2\n")
    _one_problem([], "train: a key must be a name, got 1", path=path)


def test_unknown_key_without_close_match_still_lists_valid_keys() -> None:
    msg = _one_problem(["optim.xyzzy=1"], "optim.xyzzy: unknown key", "valid keys: ")
    assert "did you mean" not in msg
    for key in FIELDS["optim"]:
        assert key in msg


def test_a_moved_key_is_refused_naming_its_new_place(tmp_path: Path) -> None:
    # parallel.bucket_cap_mb moved into parallel.ddp: one line that says where, from either source
    line = "parallel.bucket_cap_mb: moved to parallel.ddp.bucket_cap_mb; set that instead"
    assert _one_problem(["parallel.bucket_cap_mb=10"], line) == line
    path = _write(tmp_path / "job.yaml", "parallel:\n  bucket_cap_mb: 10\n")
    assert _one_problem([], line, path=path) == line
    assert config_mod.load(None, ["parallel.ddp.bucket_cap_mb=10"]).parallel.ddp.bucket_cap_mb == 10


def test_unknown_model_key_lists_model_fields() -> None:
    msg = _one_problem(["model.n_head=4"], "model.n_head: unknown key", "did you mean 'n_heads'?")
    assert "preset" in msg and "n_kv_heads" in msg


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        ("train.steps=ten", ("train.steps: must be int", "'ten'")),
        ("train.steps=true", ("train.steps: must be int", "True")),  # bool is not an int here
        ("train.steps=3.5", ("train.steps: must be int", "3.5")),
        ("train.steps=[1, 2]", ("train.steps: must be int", "list")),
        ("optim.lr=[1, 2]", ("optim.lr: must be float", "list")),
        ("optim.lr=fast", ("optim.lr: must be float", "'fast'")),
        ("optim.lr=false", ("optim.lr: must be float", "False")),
        ("train.compile=1", ("train.compile: must be bool", "1")),
        ("train.compile=maybe", ("train.compile: must be bool", "'maybe'")),
        ("run.name={a: 1}", ("run.name: must be str", "dict")),
        ("data.max_tokens=lots", ("data.max_tokens: must be int or null", "'lots'")),
        ("model.n_kv_heads=2.5", ("model.n_kv_heads: must be int or null", "2.5")),
    ],
)
def test_wrong_type_names_key_expected_type_and_value(override: str, fragments: tuple[str, ...]) -> None:
    _one_problem([override], *fragments)


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("train.steps=null", "train.steps: must be int, got null"),
        ("optim.lr=~", "optim.lr: must be float, got null"),
        ("run.dir=null", "run.dir: must be str, got null"),
        ("train.compile=null", "train.compile: must be bool, got null"),
    ],
)
def test_null_for_a_non_optional_key(override: str, fragment: str) -> None:
    _one_problem([override], fragment)


def test_wrong_type_in_yaml(tmp_path: Path) -> None:
    path = _write(tmp_path / "job.yaml", "train:\n  steps: [1, 2]\n  global_batch_size: '32'\n")
    problems = _problems(path)
    assert sorted(problems) == [
        "train.global_batch_size: must be int, got '32'",
        "train.steps: must be int, got list",
    ]


@pytest.mark.parametrize("value", ["5", "[1, 2]", "hello", "null"])
def test_section_given_as_scalar(tmp_path: Path, value: str) -> None:
    path = _write(tmp_path / "job.yaml", f"train: {value}\n")
    _one_problem([], "train: must be a section (a mapping of keys)", path=path)


@pytest.mark.parametrize("value", ["2024-05-01", "yes", "off"])
def test_string_key_takes_the_typed_text(value: str) -> None:
    assert load(None, [f"run.name={value}"]).run.name == value


# --------------------------------------------------------------------------------------------------- errors: files


def test_missing_config_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    _one_problem([], str(missing), "does not exist", "a shipped example: demo, train_13b", path=missing)


def test_directory_instead_of_config_file(tmp_path: Path) -> None:
    _one_problem([], str(tmp_path), "is a directory; pass a YAML file", path=tmp_path)


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("run:\n  name: x\ntrain:\n\tsteps: 3\n", 4),  # a tab cannot indent YAML
        ("train:\n  steps: 3\n  micro_batch_size: [1,\n", 4),  # unclosed flow list: found at end of stream
        ("train:\n  steps: 3\n oops: 1\n", 3),  # bad indentation
    ],
)
def test_invalid_yaml_names_file_and_line(tmp_path: Path, text: str, line: int) -> None:
    path = _write(tmp_path / "broken.yaml", text)
    _one_problem([], str(path), "is not valid YAML", f"at line {line},", path=path)


@pytest.mark.parametrize(("text", "kind"), [("- train\n- model\n", "list"), ("42\n", "int"), ("just text\n", "str")])
def test_yaml_top_level_must_be_a_mapping(tmp_path: Path, text: str, kind: str) -> None:
    path = _write(tmp_path / "list.yaml", text)
    _one_problem([], str(path), "must be a mapping of sections (run:, model:, ...)", f"not {kind}", path=path)


@pytest.mark.parametrize(
    "override", ["trainsteps=3", "=3", "train.=3", "train.steps", ".steps=3", "train..steps=3", " =3", ""]
)
def test_bad_override_syntax(override: str) -> None:
    _one_problem([override], repr(override), "expected section.key=value", "e.g. train.steps=200")


def test_unknown_preset_lists_available_presets() -> None:
    msg = _one_problem(["model.preset=tiny2"], "model.preset:", "'tiny2'")
    for name in preset_names():
        assert name in msg


def test_missing_preset_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    _one_problem([f"model.preset={missing}"], "model.preset:", str(missing), "does not exist")


def test_preset_file_with_job_keys_is_rejected() -> None:
    # a job config passed as a preset: its section names are not ModelArgs fields
    _one_problem([f"model.preset={CONFIGS / 'demo.yaml'}"], "model.preset:", "unknown model key(s)", "'train'")


# --------------------------------------------------------------------------------------------------- errors: values


@pytest.mark.parametrize(
    ("override", "key", "options"),
    [
        ("parallel.strategy=fsdp2", "parallel.strategy", config_mod.STRATEGIES),
        ("data.source=web", "data.source", config_mod.DATA_SOURCES),
        ("train.dtype=fp8", "train.dtype", config_mod.DTYPES),
        ("optim.schedule=step", "optim.schedule", config_mod.LR_SCHEDULES),
        ("data.dtype=int8", "data.dtype", ("uint16", "uint32")),
        ("run.log_level=LOUD", "run.log_level", ("DEBUG", "INFO", "WARNING", "ERROR")),
    ],
)
def test_invalid_choice_lists_the_options(override: str, key: str, options: tuple[str, ...]) -> None:
    bad = override.partition("=")[2]
    _one_problem([override], f"{key}: {bad!r} is not one of {', '.join(options)}")


@pytest.mark.parametrize(
    "override",
    [
        "train.steps=0",
        "train.steps=-5",
        "train.global_batch_size=0",
        "train.micro_batch_size=0",
        "train.eval_batches=0",
        "data.seq_len=0",
        "data.max_tokens=0",
        "data.synthetic_samples=-1",
        "optim.lr=0",
        "optim.lr=-0.001",
        "logging.every_steps=0",
        "checkpoint.keep_last=0",
        "parallel.ddp.bucket_cap_mb=0",
    ],
)
def test_non_positive_number(override: str) -> None:
    key, _, value = override.partition("=")
    _one_problem([override], f"{key}: must be > 0, got {value}")


@pytest.mark.parametrize(
    "override",
    [
        "optim.warmup_steps=-1",
        "optim.weight_decay=-0.1",
        "optim.grad_clip=-1.0",
        "optim.min_lr_ratio=-0.5",
        "checkpoint.every_steps=-1",
        "train.eval_every_steps=-10",
    ],
)
def test_negative_number_where_zero_is_allowed(override: str) -> None:
    key, _, value = override.partition("=")
    _one_problem([override], f"{key}: must be >= 0, got {value}")
    load(None, [f"{key}=0"])  # zero itself is fine (it means "off" for most of these)


@pytest.mark.parametrize("key", ["dim", "n_layers", "n_heads", "ffn_dim", "vocab_size", "max_seq_len", "n_kv_heads"])
def test_non_positive_model_shape(key: str) -> None:
    problems = _problems(None, [f"model.{key}=0"])
    assert all(f"model.{key}" in p for p in problems), problems
    assert any("positive" in p or "> 0" in p for p in problems), problems


def test_non_positive_model_shape_is_reported_once() -> None:
    assert len(_problems(None, ["model.dim=0"])) == 1


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (["model.dim=250", "model.n_heads=4"], ("model.dim=250", "model.n_heads=4", "pick n_heads dividing dim")),
        (["model.n_heads=4", "model.n_kv_heads=3"], ("model.n_heads=4", "model.n_kv_heads=3", "whole group")),
        (["model.n_heads=4", "model.n_kv_heads=8"], ("model.n_heads=4", "model.n_kv_heads=8")),
        (["model.dim=12", "model.n_heads=4"], ("dim // n_heads = 3", "odd", "even head dim")),
    ],
    ids=["dim%heads", "heads%kv", "kv>heads", "odd-head-dim"],
)
def test_model_divisibility(overrides: list[str], fragments: tuple[str, ...]) -> None:
    _one_problem(overrides, *fragments)


def test_valid_grouped_query_attention() -> None:
    cfg = load(None, ["model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "data.seq_len=32"])
    assert cfg.model_args().kv_heads == 2


def test_seq_len_longer_than_max_seq_len() -> None:
    _one_problem(
        ["data.seq_len=512", "model.max_seq_len=256"],
        "data.seq_len (512) exceeds model.max_seq_len (256)",
        "lower one or raise the other",
    )
    assert load(None, ["data.seq_len=256", "model.max_seq_len=256"]).data.seq_len == 256  # equal is fine


def test_global_batch_not_a_multiple_of_micro_batch() -> None:
    _one_problem(
        ["train.global_batch_size=20", "train.micro_batch_size=8"],
        "train.global_batch_size (20) must be a multiple of train.micro_batch_size (8)",
    )


def test_eval_needs_validation_data() -> None:
    _one_problem(
        ["train.eval_every_steps=10", "data.val_fraction=0"], "train.eval_every_steps", "data.val_fraction > 0"
    )
    # synthetic data evaluates on its own samples; periodic eval off needs no held-out data
    load(None, ["train.eval_every_steps=10", "data.val_fraction=0", "data.source=synthetic"])
    load(None, ["train.eval_every_steps=0", "data.val_fraction=0"])


@pytest.mark.parametrize("value", ["1.0", "1.5", "-0.1"])
def test_val_fraction_range(value: str) -> None:
    _one_problem([f"data.val_fraction={value}"], "data.val_fraction: must be in [0, 1)")


def test_min_lr_ratio_above_one() -> None:
    _one_problem(["optim.min_lr_ratio=1.5"], "optim.min_lr_ratio: must be <= 1, got 1.5")


def test_vocab_smaller_than_byte_tokenizer() -> None:
    # the one vocabulary check is the start-up check of hpcdist.config.vocab (tests/unit/config/test_vocab.py)
    with pytest.raises(config_mod.DataError, match=f"model.vocab_size=100 is smaller than the {config_mod.BYTE_VOCAB}"):
        config_mod.check_data(load(None, ["model.vocab_size=100"]))
    assert load(None, ["model.vocab_size=100", "data.source=synthetic"]).model.vocab_size == 100


def test_blank_run_dir() -> None:
    _one_problem(["run.dir=' '"], "run.dir: must name a directory", "run.dir=")


def test_files_source_needs_a_path(tmp_path: Path) -> None:
    _one_problem(["data.source=files"], "data.path: required when data.source=files", "hpcdist prepare")
    # a directory `hpcdist prepare` did not make (data.path=/etc was a FileNotFoundError traceback): the
    # config loads (a dry run plans a job whose data is not there yet), the start-up check refuses it in one line
    cfg = load(None, ["data.source=files", f"data.path={tmp_path}"])
    with pytest.raises(DataError, match=rf"data.path {tmp_path}: no prepared dataset there .*hpcdist prepare"):
        check_data(cfg)


def test_resume_from_missing_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a relative path: the message shows a long value shortened (a tmp_path under pytest-xdist is long enough)
    monkeypatch.chdir(tmp_path)
    missing = Path("step-00000100")
    _one_problem([f"checkpoint.resume={missing}"], "checkpoint.resume:", str(missing), "auto, none")
    missing.mkdir()  # a directory that is no checkpoint (/etc failed only after the process group)
    _one_problem([f"checkpoint.resume={missing}"], "is not a complete checkpoint (no COMPLETE marker")
    _one_problem([f"checkpoint.init_from={missing}"], "checkpoint.init_from:", "no COMPLETE marker")
    (missing / "COMPLETE").write_text("{}")
    assert load(None, [f"checkpoint.resume={missing}"]).checkpoint.resume == str(missing)
    assert load(None, ["checkpoint.resume=none"]).checkpoint.resume == "none"


@pytest.mark.parametrize("override", ["optim.lr=.nan", "optim.grad_clip=.nan", "logging.peak_flops=.nan"])
def test_nan_is_rejected(override: str) -> None:
    with pytest.raises(ConfigError):
        load(None, [override])


def test_huge_int_for_a_float_key_is_a_config_error() -> None:
    _one_problem(["optim.lr=1" + "0" * 400], "optim.lr")


def test_invalid_yaml_preset_file_is_a_config_error(tmp_path: Path) -> None:
    path = _write(tmp_path / "broken.yaml", "dim: [1,\n")
    _one_problem([f"model.preset={path}"], "model.preset:", str(path))


def test_non_utf8_config_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("run:\n  name: caf\u00e9\n".encode("latin-1"))
    _one_problem([], str(path), path=path)


# --------------------------------------------------------------------------------------------------- all at once


def test_every_problem_is_reported_in_one_error(tmp_path: Path) -> None:
    path = _write(tmp_path / "job.yaml", "bogus:\n  x: 1\ntrain:\n  steps: 10\n")
    overrides = [
        "train.stepz=1",  # unknown key
        "optim.lr=fast",  # wrong type
        "optim.schedule=step",  # bad choice
        "data.source=files",  # needs data.path
        "trainsteps=3",  # bad override syntax
        "train.global_batch_size=20",  # not a multiple of micro batch 8
        "model.dim=250",  # not divisible by n_heads 4
    ]
    problems = _problems(path, overrides)
    assert len(problems) == 8, problems  # the 7 overrides + the unknown YAML section
    expected = [
        "bogus:",
        "train.stepz:",
        "optim.lr:",
        "optim.schedule:",
        "data.path:",
        "'trainsteps=3'",
        "train.global_batch_size (20)",
        "model.dim=250",
    ]
    for frag in expected:
        assert sum(frag in p for p in problems) == 1, (frag, problems)


def test_missing_file_and_bad_overrides_are_reported_together(tmp_path: Path) -> None:
    problems = _problems(tmp_path / "nope.yaml", ["train.steps=x", "model.preset=nope"])
    assert len(problems) == 3, problems
    assert "does not exist" in problems[0]


# --------------------------------------------------------------------------------------------------- check_world


def test_check_world_accepts_divisible_world_sizes() -> None:
    cfg = load(CONFIGS / "demo.yaml")  # global 16, micro 2: the README runs it on 1, 4 (torchrun) and 8 (srun) ranks
    for world_size in (1, 2, 4, 8):
        check_world(cfg, world_size)
    assert config_mod.grad_accum_steps(cfg, 1) == 8
    assert config_mod.grad_accum_steps(cfg, 8) == 1


def test_check_world_suggests_a_valid_global_batch() -> None:
    cfg = load(CONFIGS / "demo.yaml")
    with pytest.raises(ConfigError) as exc:
        check_world(cfg, 3)
    (msg,) = exc.value.problems
    assert "train.global_batch_size (16)" in msg
    assert "train.micro_batch_size (2) x data-parallel size (3) = 6" in msg
    assert "e.g. train.global_batch_size=12" in msg
    check_world(load(CONFIGS / "demo.yaml", ["train.global_batch_size=12"]), 3)  # the suggestion works


@pytest.mark.parametrize("world_size", [3, 5, 6, 7, 16, 24, 64])
@pytest.mark.parametrize(("global_batch", "micro_batch"), [(16, 8), (256, 4), (1000, 2), (48, 3)])
def test_check_world_suggestion_always_passes(global_batch: int, micro_batch: int, world_size: int) -> None:
    cfg = load(None, [f"train.global_batch_size={global_batch}", f"train.micro_batch_size={micro_batch}"])
    try:
        check_world(cfg, world_size)
    except ConfigError as e:
        suggested = re.search(r"e\.g\. (train\.global_batch_size=\d+)", str(e))
        assert suggested, str(e)
        fixed = load(None, [suggested.group(1), f"train.micro_batch_size={micro_batch}"])
        check_world(fixed, world_size)
        assert fixed.train.global_batch_size % (micro_batch * world_size) == 0
    else:
        assert global_batch % (micro_batch * world_size) == 0


@pytest.mark.parametrize("world_size", [0, -1])
def test_check_world_rejects_non_positive_world_size(world_size: int) -> None:
    with pytest.raises(ConfigError, match="world"):
        check_world(load(CONFIGS / "demo.yaml"), world_size)


# --------------------------------------------------------------------------------------------------- save


def test_save_round_trips_and_leaves_no_temp_file(tmp_path: Path) -> None:
    resume = tmp_path / "step-00000010"
    resume.mkdir()
    (resume / "COMPLETE").write_text("{}")
    cfg = load(
        CONFIGS / "demo.yaml",
        [
            f"run.dir={tmp_path / 'run'}",
            f"checkpoint.resume={resume}",
            "data.max_tokens=null",
            "optim.eps=1e-9",
            "model.n_kv_heads=null",
            "train.compile=true",
            "logging.peak_flops=1e11",
        ],
    )
    out = tmp_path / "run" / "nested" / "config.yaml"
    assert save(cfg, out) == out
    assert load(out) == cfg
    assert os.listdir(out.parent) == ["config.yaml"]
    assert yaml.safe_load(out.read_text())["train"]["compile"] is True


def test_save_round_trips_strings_that_look_like_other_yaml_types(tmp_path: Path) -> None:
    cfg = JobConfig()
    for name in ("yes", "null", "123", "1.5", "2024-05-01", "~", "on", "3e-4"):
        cfg.run.name = name
        assert load(save(cfg, tmp_path / "config.yaml")).run.name == name


def test_save_overwrites_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "config.yaml"
    save(load(None, ["train.steps=1"]), out)
    save(load(None, ["train.steps=2"]), out)
    assert load(out).train.steps == 2
    assert os.listdir(tmp_path) == ["config.yaml"]

    # if the final rename never happens, readers still see the previous complete file
    def no_replace(src: Any, dst: Any) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", no_replace)
    with pytest.raises(OSError, match="disk gone"):
        save(load(None, ["train.steps=3"]), out)
    monkeypatch.undo()
    assert load(out).train.steps == 2


def test_dump_is_plain_yaml_of_every_section() -> None:
    cfg = load(CONFIGS / "demo.yaml")
    data = yaml.safe_load(config_mod.dump(cfg))
    assert list(data) == SECTIONS
    for section in SECTIONS:
        assert list(data[section]) == FIELDS[section]
    assert data == cfg.to_dict()


# --------------------------------------------------------------------------------------------------- fuzzing


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def _load_or_config_error(path: Path | None, overrides: list[str]) -> None:
    try:
        cfg = load(path, overrides)
    except ConfigError as e:
        assert e.problems and all(isinstance(p, str) and p for p in e.problems)
    else:
        assert isinstance(cfg, JobConfig)
        assert check(cfg) == []


@FUZZ
@given(overrides=OVERRIDES)
def test_fuzz_overrides_only_raise_config_error(overrides: list[str]) -> None:
    _load_or_config_error(None, overrides)


@FUZZ
@given(doc=DOCS, overrides=OVERRIDES)
def test_fuzz_yaml_documents_only_raise_config_error(fuzz_dir: Path, doc: dict[Any, Any], overrides: list[str]) -> None:
    path = fuzz_dir / "fuzz.yaml"
    path.write_text(yaml.safe_dump(doc))
    _load_or_config_error(path, overrides[:2])


def _validate_any(path: Path) -> None:
    """Load one YAML of configs/ or of the shipped resources with the loader of its kind; an unknown kind fails."""
    from hpcdist.config.nccl_profiles import load_profile
    from hpcdist.launch import load_cluster

    if path in SHIPPED_YAML:
        kind = path.parent.name
        if kind == "models":
            by_path, by_name = load(None, [f"model.preset={path}"]), load(None, [f"model.preset={path.stem}"])
            assert by_path.model_args() == by_name.model_args()
        elif kind == "cluster":
            assert load_cluster(path) == load_cluster(path.stem)
        elif kind == "nccl":
            assert load_profile(path.stem) == load_profile(str(path))
        elif kind == "examples":  # job configs, loaded by path and by the name `hpcdist train NAME` takes
            assert load(path) == load(path.stem)
        else:
            raise AssertionError(f"no validator for shipped resources of kind {kind!r}: add one here")
    elif path.parent == CONFIGS:
        load(path)
    else:
        rel = path.parent.relative_to(CONFIGS).as_posix()
        raise AssertionError(
            f"no validator for configs/{rel}/ (presets and cluster/NCCL profiles ship in hpcdist/resources/<kind>/)"
        )


@pytest.mark.parametrize("path", ALL_YAML, ids=_rel)
def test_every_yaml_in_configs_validates(path: Path) -> None:
    _validate_any(path)


def test_every_numeric_key_has_a_maximum() -> None:
    """A 400-digit train.steps was an OverflowError, run.seed=2**70 one inside torch. Every int / float
    key has a largest value (rules.MAXIMA) or both ends in the rules (BOUNDED_BY_RULES), and a value past it is one
    problem naming the key."""
    from hpcdist.config.rules import BOUNDED_BY_RULES, MAXIMA, _numeric_fields

    keys = {key for key, _ in _numeric_fields(JobConfig())} | {
        "logging.peak_flops",
        "parallel.pp_stages_per_rank",
        "data.max_tokens",
        "model.n_kv_heads",
    }  # None defaults
    assert keys - set(MAXIMA) - BOUNDED_BY_RULES == set(), "give each numeric key a range"
    assert set(MAXIMA) <= keys and not set(MAXIMA) & BOUNDED_BY_RULES
    for key, (top, _) in MAXIMA.items():
        over = top * 2 if isinstance(top, int) else top * 10
        problems = _problems(None, [f"{key}={over}"])
        assert any(p.startswith(f"{key}: must be at most ") for p in problems), (key, problems)
    _one_problem([f"train.steps={10**400}"], "train.steps: must be at most 1,000,000,000,000, got an integer of")


def test_a_section_override_takes_the_flow_yaml_form() -> None:
    """`data.sources=[{path: ..., weight: ...}]` worked where `logging.profile={steps: 2}` was refused."""
    cfg = load(None, ["logging.profile={steps: 2, start_step: 3}"])
    assert (cfg.logging.profile.steps, cfg.logging.profile.start_step) == (2, 3)
    with pytest.raises(ConfigError, match=r"logging\.profile\.stepz: unknown key"):
        load(None, ["logging.profile={stepz: 2}"])
    with pytest.raises(ConfigError, match=r"logging\.profile: must be a section"):
        load(None, ["logging.profile=3"])


@pytest.mark.parametrize("value", ["auto", "30", "0", "1.5"])
def test_every_minutes_takes_minutes_or_auto(value: str, tmp_path: Path) -> None:
    """checkpoint.every_minutes: a number of minutes, or auto (the goodput model's interval), on the command line
    and in YAML alike."""
    expected = value if value == "auto" else float(value)
    assert load(None, [f"checkpoint.every_minutes={value}"]).checkpoint.every_minutes == expected
    path = _write(tmp_path / "job.yaml", f"checkpoint:\n  every_minutes: {value}\n")
    assert load(path).checkpoint.every_minutes == expected


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("Auto", "'Auto' is neither a number of minutes nor auto; give minutes (0 = off) or auto"),
        ("fast", "'fast' is neither a number of minutes nor auto"),
        ("''", "'' is neither a number of minutes nor auto"),
        ("true", "'true' is neither a number of minutes nor auto"),
        ("-1", "must be >= 0, got -1"),
        ("[1]", "must be float or str, got list"),
    ],
)
def test_every_minutes_refuses_anything_else_with_one_problem(value: str, fragment: str) -> None:
    _one_problem([f"checkpoint.every_minutes={value}"], "checkpoint.every_minutes: ", fragment)
