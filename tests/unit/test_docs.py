"""The pages a user reads: a short README that links every page, lines a terminal shows whole, links that
resolve, and no process history (how or where the project was built) in docs, configs or help texts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hpcdist.cli import _parser
from tests.unit.harness import README, REPO, help_texts, prose_lines, user_docs

# What the product must not say about itself: tracker numbers, dates of events (a log line's timestamp, followed by
# `T`, is an example of output and stays), the build machine's load, design notes kept outside the repository.
HISTORY = re.compile(
    r"\bissues? \d|\b20\d\d-\d\d-\d\d(?!T)|load average|(?-i:\bDESIGN(\.md)?\b|\bFACTS(\.md)?\b)|build machine|"
    r"other sessions|found in review|found by (the campaign|tools/)",
    re.IGNORECASE,
)


def _configs() -> list[Path]:
    """The example configs, in the checkout and as shipped inside the package."""
    shipped = REPO / "hpcdist" / "resources" / "examples"
    return sorted(p for d in (REPO / "configs", shipped) for p in d.rglob("*") if p.is_file())


def test_readme_is_short_and_links_every_page() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; at most 150 (move detail into docs/)"
    text = "\n".join(lines)
    pages = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))
    unlinked = [p for p in pages if f"]({p})" not in text]
    assert not unlinked, f"docs pages not linked from README.md: {unlinked}"
    assert "](CONTRIBUTING.md)" in text


@pytest.mark.parametrize("path", user_docs(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_prose_lines_fit_a_terminal(path: Path) -> None:
    long = [f"line {n}: {len(line)} chars" for n, line in prose_lines(path) if len(line) > 200 and "|" not in line]
    if path == README:  # the README's tables too: it is the package's long description
        long += [f"line {n}: {len(line)} chars" for n, line in prose_lines(path) if len(line) > 200 and "|" in line]
    assert not long, f"{path.name}: prose lines over 200 characters: {long}"


def _readme_links() -> list[str]:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text(encoding="utf-8"))
    return sorted({link for link in links if "://" not in link})


# The fake-CUDA tier's page is written with that tier; until it is in the checkout its link is reported, not failed.
@pytest.mark.parametrize("link", _readme_links())
def test_readme_links_resolve(link: str) -> None:
    assert (REPO / link).exists(), f"README.md links to {link}, which does not exist"


@pytest.mark.parametrize("path", [*user_docs(), *_configs()], ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_process_history_in_docs_and_configs(path: Path) -> None:
    hits = [
        f"line {n}: {m.group(0)!r} in {line.strip()[:120]!r}"
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        for m in [HISTORY.search(line)]
        if m
    ]
    assert not hits, f"{path.relative_to(REPO)} speaks of how the project was made, not of the product:\n" + "\n".join(
        hits
    )


# In the code the same rule, less the dates (a date is also a value code parses) and the load (a hang report prints
# the node's): tracker numbers and notes kept outside the repository.
CODE_HISTORY = re.compile(r"\bissues? \d|(?-i:\bDESIGN\.md\b|\bFACTS\.md\b)|found in review", re.IGNORECASE)


def _code() -> list[Path]:
    """The package, the batch scripts and the tools a user runs (the benchmarks print what they measured where)."""
    files = [p for d in ("hpcdist", "sbatch") for p in (REPO / d).rglob("*") if p.suffix in {".py", ".sh"}]
    tools = [p for d in ("tools", "tools/docs") for p in (REPO / d).glob("*") if p.is_file()]
    return sorted(files + tools)


@pytest.mark.parametrize("path", _code(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_tracker_numbers_in_the_code(path: Path) -> None:
    text = path.read_text(encoding="utf-8", errors="replace").splitlines()
    hits = [f"line {n}: {line.strip()[:120]!r}" for n, line in enumerate(text, start=1) if CODE_HISTORY.search(line)]
    assert not hits, f"{path.relative_to(REPO)} gives history where a reason belongs:\n" + "\n".join(hits)


def test_no_process_history_in_help_texts() -> None:
    hits = [f"{where}: {m.group(0)!r}" for where, text in help_texts(_parser()) for m in [HISTORY.search(text)] if m]
    assert not hits, "\n".join(hits)


def test_the_history_pattern_catches_what_it_should() -> None:
    for said in ("see issue 31", "(issues 11 and 31)", "on 2026-11-26", "load average 9-25", "DESIGN.md"):
        assert HISTORY.search(said), said
    for fine in ("[hpcdist 2026-11-25T19:30:01 INFO r0]", "issue the all-reduce", "a design choice", "rank facts"):
        assert not HISTORY.search(fine), fine
