"""Helpers the unit tests of the product's face share: the documentation a user reads, and the command line's
argparse tree."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"


def user_docs() -> list[Path]:
    """Every page a user reads: README.md, CONTRIBUTING.md, docs/**/*.md."""
    return [README, REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").rglob("*.md"))]


def prose_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of ``path`` outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def parsers(parser: argparse.ArgumentParser, path: str = "hpcdist") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(command path, parser) of ``parser`` and every subcommand under it, depth first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, f"{path} {name}")


def help_texts(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str]]:
    """(where, text) of every description, epilog, subcommand help and option help of the whole tree."""
    for path, p in parsers(parser):
        for kind, text in (("description", p.description), ("epilog", p.epilog)):
            if text:
                yield f"{path} ({kind})", text
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    yield f"{path} {choice.dest} (help)", choice.help or ""
            elif action.help and action.help is not argparse.SUPPRESS:
                yield f"{path} {'/'.join(action.option_strings) or action.dest}", action.help
