"""Every config key with its type, default and meaning, read from the schema itself (the dataclasses' fields and the
docstring under each): ``hpcdist config --reference [SECTION]``, docs/CONFIG.md and the commented starter config
(``hpcdist config demo --commented``) all come from here, so none of them can miss a key or show another default.

Torch-free; the schema's sources are parsed with :mod:`ast` (never imported twice, never executed)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any

import yaml

from hpcdist.config.schema import JobConfig

SECTIONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(JobConfig))


@dataclass(frozen=True)
class Key:
    """One config key: ``section.key`` (nested: ``parallel.ddp.powersgd.rank``), its type, default and meaning."""

    key: str
    type: str
    default: Any
    doc: str

    @property
    def section(self) -> str:
        return self.key.split(".", 1)[0]


@cache
def field_docs(cls: type) -> dict[str, str]:
    """{field name: the docstring under it} of a dataclass and its bases (a subclass's docstring wins)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, after in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _nested(cls: type, name: str) -> type | None:
    """The dataclass type of field ``name`` of ``cls`` when it is a nested section, else None."""
    hint = typing.get_type_hints(cls).get(name)
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def keys(section: str | None = None) -> list[Key]:
    """Every key of the schema in schema order (nested sections flattened with dots); of one section if given."""
    out: list[Key] = []

    def walk(cls: type, prefix: str) -> None:
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            sub = _nested(cls, f.name)
            if sub is not None:
                walk(sub, f"{prefix}{f.name}.")
            else:
                out.append(Key(f"{prefix}{f.name}", str(f.type), _default(f), docs.get(f.name, "")))

    for f in dataclasses.fields(JobConfig):
        if section is None or f.name == section:
            walk(_nested(JobConfig, f.name), f"{f.name}.")  # type: ignore[arg-type]
    return out


def shown(value: Any) -> str:
    """A default as a user writes it in YAML: ``null``, ``true``, ``3.0e-4``, ``[]``."""
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)  # type: ignore[arg-type]
    if isinstance(value, list):
        value = [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value]  # type: ignore[arg-type]
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()


def text(section: str | None = None) -> str:
    """The reference for a terminal: per section, each key's type and default, then its meaning, wrapped."""
    lines: list[str] = []
    current = ""
    for k in keys(section):
        if k.section != current:
            current = k.section
            lines += [*([""] if lines else []), f"{current}:"]
        lines.append(f"  {k.key}  ({k.type}, default {shown(k.default)})")
        lines += textwrap.wrap(k.doc, 110, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines) + "\n"


def markdown() -> str:
    """docs/CONFIG.md: one table per section (key, type, default, meaning)."""
    out = [
        "# Config reference",
        "",
        "Every key of a job config, generated from `hpcdist/config/schema.py` (`hpcdist config --reference [SECTION]`",
        "prints the same in a terminal; `python tools/docs/config_reference` rewrites this page). A config is a YAML",
        "file of these sections; `section.key=value` on the command line overrides it. Precedence: command line > YAML",
        "> model preset > these defaults.",
        "",
    ]
    for section in SECTIONS:
        out += [f"## `{section}`", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for k in keys(section):
            cells = [f"`{k.key}`", f"`{k.type}`", f"`{shown(k.default)}`", k.doc]
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        out.append("")
    return "\n".join(out)


def commented(tree: dict[str, Any]) -> str:
    """A starter config: the sections of ``tree`` as YAML, each key preceded by the first sentence of its meaning.
    The caller leaves out of ``tree`` what a preset decides, so editing the preset changes the model."""
    docs = {k.key: k.doc for k in keys()}
    lines: list[str] = []

    def first_sentence(doc: str) -> str:
        head = doc.split(". ")[0].rstrip(".")
        return head if len(head) <= 114 else head[: head.rfind(" ", 0, 110)] + " ..."

    def emit(mapping: dict[str, Any], prefix: str, indent: int) -> None:
        for name, value in mapping.items():
            key = f"{prefix}{name}"
            pad = " " * indent
            if isinstance(value, dict) and value:
                lines.append(f"{pad}{name}:")
                emit(value, f"{key}.", indent + 2)
                continue
            doc = docs.get(key, "")
            if doc:
                lines.append(f"{pad}# {first_sentence(doc)}")
            lines.append(f"{pad}{name}: {shown(value)}")

    for section, body in tree.items():
        lines.append(f"{section}:")
        emit(body, f"{section}.", 2)
        lines.append("")
    return "\n".join(lines)
