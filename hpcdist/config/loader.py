"""Generic typed-config loading: YAML files + ``section.key=value`` overrides -> nested dataclasses.

Nothing here knows the job schema: :mod:`hpcdist.config.job` applies it to :class:`~hpcdist.config.JobConfig`,
:mod:`hpcdist.config.cluster` to cluster profiles. Every problem (unreadable YAML, unknown key with the closest valid
one, wrong type) is collected, so a caller reports them all at once in one :class:`ConfigError` (submitit's
parameter check, litgpt's validation).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hpcdist import resources
from hpcdist.base import safe_yaml
from hpcdist.config.schema import RunConfig
from hpcdist.models.args import load_preset

__all__ = [
    "ConfigError",
    "build",
    "coerce",
    "echo",
    "load_tree",
    "merge",
    "parse_overrides",
    "raw_text",
    "read_yaml",
    "unknown_key",
]


# A report stays readable whatever the input: a value is shown up to ECHO_CHARS, a problem up to PROBLEM_CHARS, and
# at most SHOWN_PROBLEMS problems are listed (a generated file with a million bad keys must not print them all).
ECHO_CHARS = 80
PROBLEM_CHARS = 1000
SHOWN_PROBLEMS = 50


class ConfigError(ValueError):
    """A user-facing configuration problem. ``str()`` is a readable, one-paragraph report."""

    def __init__(self, problems: Sequence[str]):
        self.problems = [_clip(str(p), PROBLEM_CHARS) for p in problems]
        n = len(self.problems)
        head = f"Invalid configuration ({n} problem{'s' if n != 1 else ''}):"
        lines = [head, *(f"  - {p}" for p in self.problems[:SHOWN_PROBLEMS])]
        if n > SHOWN_PROBLEMS:
            lines.append(f"  ... and {n - SHOWN_PROBLEMS} more")
        super().__init__("\n".join(lines))


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit:,} more characters)"


def echo(value: Any) -> str:
    """A user's value as an error message shows it: ``repr`` for scalars, the type for lists and mappings (their
    repr walks every alias of a YAML document), cut to ECHO_CHARS; a huge int shows its digit count (``str`` of a
    5,000-digit int raises)."""
    if isinstance(value, _Typed):
        value = value.text
    if isinstance(value, (dict, list, tuple, set)):
        return f"a {'mapping' if isinstance(value, dict) else 'list'}"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"{'-' if value < 0 else ''}an integer of {len(f'{abs(value):x}') * 4} bits"
    text = repr(value)
    return text if len(text) <= ECHO_CHARS else f"{text[:ECHO_CHARS]}... ({len(text):,} characters)"


@dataclass(frozen=True)
class _Typed:
    """An override value as parsed by YAML plus the text the user typed: a str key takes the text, so
    ``run.name=2024-05-01`` stays a string instead of becoming a date (YAML 1.1 would also turn ``yes`` into True)."""

    value: Any
    text: str


def parse_overrides(overrides: Iterable[str]) -> tuple[dict[str, Any], list[str]]:
    """``["train.steps=10", "model.dim=64"]`` -> nested dict; values parsed as YAML scalars/lists."""
    tree, problems = _parse_typed(overrides)
    return _unwrap(tree), problems


def _unwrap(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _unwrap(v) for k, v in node.items()}
    return node.value if isinstance(node, _Typed) else node


def _parse_typed(overrides: Iterable[str]) -> tuple[dict[str, Any], list[str]]:
    """Like :func:`parse_overrides`, with each value kept as a :class:`_Typed` (YAML value + the text typed)."""
    tree: dict[str, Any] = {}
    problems: list[str] = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or "." not in key or any(not part for part in key.split(".")):
            problems.append(f"override {item!r}: expected section.key=value, e.g. train.steps=200")
            continue
        try:
            parsed = safe_yaml.load_text(raw) if raw.strip() else ""
        except safe_yaml.RefusedYAML as e:
            problems.append(f"override {key}: {e.problem}")
            continue
        except yaml.YAMLError:
            parsed = raw  # an unparsable value is taken as a plain string; type checking catches misuse
        value = _Typed(parsed, raw)
        node = tree
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                problems.append(f"override {item!r}: {p} is set both as a value and as a section")
                break
        else:
            node[leaf] = value
    return tree, problems


def merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, recursively for mappings present in both (neither is modified)."""
    out = dict(base)
    for k, v in top.items():
        out[k] = merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


def config_file(path: str | os.PathLike[str]) -> Path:
    """A job config argument -> its file: the path as given, or, when no such file exists and the argument is a bare
    name, the shipped example of that name (``demo``, ``train_13b``: hpcdist.resources ``examples``), so a wheel
    install without the checkout's configs/ can start from one. A file of that name in the directory wins."""
    try:
        p = Path(path).expanduser()
    except RuntimeError:  # ~user of no such user: the path as given, which then "does not exist"
        p = Path(path)
    name = str(path)
    if not p.exists() and name == p.name and name in resources.names("examples"):
        return resources.path("examples", name)
    return p


def read_yaml(path: Path) -> tuple[dict[str, Any], list[str]]:
    """A YAML mapping file -> (data, problems); a missing, unreadable, non-UTF-8, invalid or non-mapping file is a
    problem (worded "config file ...") and gives ``{}``; an empty file is ``{}``."""
    if path.is_dir():
        inside = sorted(str(p) for p in [*path.glob("*.yaml"), *path.glob("*.yml")])[:3]
        hint = f" inside it, e.g. {inside[0]}" if inside else ""
        return {}, [f"config file {str(path)!r} is a directory; pass a YAML file{hint}"]
    if not path.is_file():
        shipped = ", ".join(resources.names("examples"))
        return {}, [f"config file {str(path)!r} does not exist (pass a YAML file, or a shipped example: {shipped})"]
    try:
        data = safe_yaml.load_file(path)
    except safe_yaml.RefusedYAML as e:
        mark = e.problem_mark
        where = f" line {mark.line + 1}" if mark else ""
        return {}, [f"config file {str(path)!r}{where}: {e.problem}"]
    except UnicodeDecodeError:
        return {}, [f"config file {str(path)!r} is not UTF-8 text; save it as UTF-8"]
    except OSError as e:
        return {}, [f"config file {str(path)!r} cannot be read: {e.strerror}"]
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        return {}, [f"config file {str(path)!r} is not valid YAML{where}: {getattr(e, 'problem', e)}"]
    if data is None:  # every key its default: the demo's run.dir, silently shared with the demo's run
        return {}, [
            f"config file {str(path)!r} holds no settings (empty, or only comments): it would train the defaults "
            f"into run.dir {RunConfig.dir}; start from `hpcdist config demo --commented > {path}`"
        ]
    if not isinstance(data, dict):
        return {}, [
            f"config file {str(path)!r} must be a mapping of sections (run:, model:, ...), not {type(data).__name__}"
        ]
    return data, []


def _type_name(tp: Any) -> str:
    args = typing.get_args(tp)
    if args:
        return " or ".join("null" if a is type(None) else a.__name__ for a in args)
    return getattr(tp, "__name__", str(tp))


def coerce(key: str, value: Any, tp: Any) -> tuple[Any, str | None]:
    """Check ``value`` against a simple annotation (int, float, bool, str, X | None, list[str])."""
    if typing.get_origin(tp) is list:
        return _coerce_str_list(key, value)
    allowed = typing.get_args(tp) if isinstance(tp, types.UnionType) else (tp,)
    if isinstance(value, _Typed):
        # only a scalar YAML turned into something else (date, bool, number) falls back to the typed text;
        # a quoted string keeps YAML's unquoting, lists and mappings stay type errors
        text_wanted = str in allowed and not isinstance(value.value, (str, dict, list, type(None)))
        value = value.text if text_wanted else value.value
    if value is None:
        return (None, None) if type(None) in allowed else (None, f"{key}: must be {_type_name(tp)}, got null")
    for t in allowed:
        if t is bool and isinstance(value, bool):
            return value, None
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value, None
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value), None
            except OverflowError:
                return None, f"{key}: {echo(value)} is too large for a float"
        if t is float and isinstance(value, str):
            # YAML 1.1 reads "1e11" and "3e-4" (no dot) as strings: accept what is plainly a number
            try:
                return float(value), None
            except (ValueError, OverflowError):
                pass
        if t is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value), None
    shown = type(value).__name__ if isinstance(value, (dict, list)) else echo(value)
    return None, f"{key}: must be {_type_name(tp)}, got {shown}"


def _coerce_str_list(key: str, value: Any) -> tuple[list[str] | None, str | None]:
    """A list of names: YAML ``[a, b]`` (``key=[a,b]`` on the command line), or one name alone."""
    if isinstance(value, _Typed):
        value = value.value if isinstance(value.value, list) else value.text  # a bare name stays text
    items = [value] if isinstance(value, str) else value
    if isinstance(items, list) and all(isinstance(x, str) and x for x in items):
        return list(items), None
    shown = repr(value) if not isinstance(value, dict) else "a mapping"
    return None, f"{key}: must be a list of names like [alice, bob], got {shown}"


def unknown_key(key: str, name: str, valid: Sequence[str]) -> str:
    """The problem for an unknown ``key``: the closest valid name, if one is close, and every valid one."""
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{key}: unknown key; {hint}valid keys: {', '.join(valid)}"


def build(cls: type, data: Mapping[str, Any], prefix: str, problems: list[str]) -> Any:
    """Dataclass ``cls`` (nested dataclass fields become sections) from ``data``; every unknown key and bad value is
    appended to ``problems`` (keys shown as ``prefix + name``) and leaves that field at its default."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if not isinstance(name, str):  # YAML keys may be anything: `?` alone is a mapping with a null key
            problems.append(f"{prefix.rstrip('.') or 'the config'}: a key must be a name, got {echo(name)}")
            continue
        if name not in names:
            moved = getattr(cls, "MOVED_KEYS", {}).get(name)  # a section's ClassVar: its keys that moved elsewhere
            problems.append(f"{key}: moved to {moved}; set that instead" if moved else unknown_key(key, name, names))
            continue
        tp = hints[name]
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        if item is not None and dataclasses.is_dataclass(item):  # a list of sections: data.sources
            raw = value.value if isinstance(value, _Typed) else value
            if not isinstance(raw, list) or not all(isinstance(v, Mapping) for v in raw):
                keys = ", ".join(f.name for f in dataclasses.fields(item))
                problems.append(f"{key}: must be a list of mappings with keys {keys}, got {raw!r}")
                continue
            kwargs[name] = [build(item, v, f"{key}[{i}].", problems) for i, v in enumerate(raw)]
        elif dataclasses.is_dataclass(tp):
            if isinstance(value, _Typed) and isinstance(value.value, Mapping):
                value = value.value  # the flow-YAML form of an override, `logging.profile={steps: 3}`, as data.sources
            if not isinstance(value, Mapping):
                problems.append(f"{key}: must be a section (a mapping of keys), got {echo(value)}")
                continue
            kwargs[name] = build(tp, value, f"{key}.", problems)
        else:
            coerced, err = coerce(key, value, tp)
            if err:
                problems.append(err)
            else:
                kwargs[name] = coerced
    return cls(**kwargs)


def preset_shadows(path: str | os.PathLike[str]) -> str | None:
    """One line when the config file's explicit ``model:`` keys differ from its ``model.preset``'s values (explicit
    keys win, so the model is not the preset's: a starter config edited from ``preset: tiny`` to ``preset: 7b`` would
    still train tiny's shape); None when they agree, there is no preset, or the file or preset cannot be read (the
    loader reports those)."""
    data, problems = read_yaml(config_file(path))
    model = data.get("model")
    if problems or not isinstance(model, Mapping) or not isinstance(model.get("preset"), str):
        return None
    preset = model["preset"]
    try:
        values = load_preset(preset)
    except (ValueError, OSError, yaml.YAMLError):
        return None
    hidden = [(k, v) for k, v in model.items() if k in values and v != values[k]]
    if not hidden:
        return None
    shown = ", ".join(f"{k}={echo(v)} (preset: {echo(values[k])})" for k, v in hidden[:4])
    more = f" and {len(hidden) - 4} more" if len(hidden) > 4 else ""
    return (
        f"{path}: its model keys {shown}{more} win over model.preset {preset}, so the model is not {preset}; "
        "delete them from the file to take the preset's"
    )


def raw_text(value: Any) -> Any:
    """An override's value as the user typed it (text), any other value unchanged."""
    return value.text if isinstance(value, _Typed) else value


def load_tree(path: str | os.PathLike[str] | None, overrides: Iterable[str] = ()) -> tuple[dict[str, Any], list[str]]:
    """YAML file (optional) with ``section.key=value`` overrides merged over it -> (tree, problems).

    Override values stay typed (YAML value + text) until :func:`build` / :func:`coerce` see the field's type.
    """
    data: dict[str, Any] = {}
    problems: list[str] = []
    if path is not None:
        data, problems = read_yaml(config_file(path))
    over, over_problems = _parse_typed(overrides)
    return merge(data, over), problems + over_problems
