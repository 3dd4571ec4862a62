"""Helpers the unit tests of the product's face share: the documentation a user reads, the command line's
argparse tree, and ``python -m hpcdist`` run as a user runs it."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
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


# a stray rank layout in the caller's environment must not change what the CLI does
_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def hpcdist(
    *args: str | os.PathLike[str], timeout: float = 120, environ: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m hpcdist ARGS`` in the repo, without the caller's SLURM/launcher variables (plus ``environ``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in _LAUNCHER_VARS}
    env.update(environ or {})
    return subprocess.run(
        [sys.executable, "-m", "hpcdist", *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
