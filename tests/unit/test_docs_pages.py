"""The pages that quote the product: every line docs/TROUBLESHOOTING.md says hpcdist prints is a message in the
source, and every hpcdist key docs/MIGRATING.md and docs/STRATEGIES.md name is a key of the config."""

from __future__ import annotations

import ast
import re
from functools import cache

import pytest

from hpcdist.config.reference import keys
from tests.unit.harness import REPO

DOCS = REPO / "docs"
HOLE = "\x00"  # where an f-string formats a value


def _text_blocks(page: str) -> list[str]:
    """The lines of the page's ```text blocks: what it quotes the tool printing."""
    return [line for block in re.findall(r"```text\n(.*?)```", page, re.S) for line in block.splitlines() if line]


@cache
def _messages() -> tuple[str, ...]:
    """Every string literal of hpcdist/ (implicitly concatenated parts joined, as Python joins them), an f-string's
    formatted values as HOLE."""
    out: list[str] = []
    for path in sorted((REPO / "hpcdist").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.JoinedStr):
                out.append("".join(v.value if isinstance(v, ast.Constant) else HOLE for v in node.values))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.append(node.value)
    return tuple(out)


def _printed(quote: str) -> bool:
    """The quote, with `...` for any text, is one message of the source (its literal parts in order, in one
    string; a formatted value only where the quote has `...`)."""
    pattern = ".*?".join(re.escape(part) for part in quote.split("..."))  # HOLE never matches a literal part
    parts = [p for p in quote.split("...") if p.strip()]
    return any(re.search(pattern, m, re.S) and all(p in m for p in parts) for m in _messages())


QUOTES = _text_blocks((DOCS / "TROUBLESHOOTING.md").read_text(encoding="utf-8"))


def test_troubleshooting_has_the_symptoms_a_user_looks_for() -> None:
    page = (DOCS / "TROUBLESHOOTING.md").read_text(encoding="utf-8").lower()
    for symptom in ("rendezvous", "loopback", "nccl times out", "out of memory", "requeues", "refused", "vocabulary"):
        assert symptom in page, symptom
    assert len(QUOTES) >= 8


@pytest.mark.parametrize("quote", QUOTES, ids=lambda q: q[:60])
def test_every_quoted_line_is_printed_by_the_code(quote: str) -> None:
    assert _printed(quote), f"docs/TROUBLESHOOTING.md quotes a line no code prints: {quote!r}"


def test_the_quote_check_can_fail() -> None:
    assert _printed("failure loop: the same failure happened ... time(s) in a row")
    assert not _printed("failure loop: the same failure happened ... times in a row")
    assert not _printed("this sentence is printed nowhere in hpcdist at all")


def _doc_keys(page: str, column: int | None) -> list[str]:
    """The `section.key` names of a page: all backticked ones, or those of one table column."""
    cells: list[str] = []
    for line in page.splitlines():
        if column is not None and line.startswith("| ") and not line.startswith("|---"):
            row = [c.strip() for c in line.strip().strip("|").split(" | ")]
            if len(row) > column:
                cells.append(row[column])
        elif column is None:
            cells.append(line)
    sections = "run|model|data|optim|train|parallel|checkpoint|fault|logging"
    return [m for cell in cells for m in re.findall(rf"`((?:{sections})\.[a-z_.]+)", cell)]


def test_every_migration_row_maps_to_an_hpcdist_key() -> None:
    page = (DOCS / "MIGRATING.md").read_text(encoding="utf-8")
    rows = [line for line in page.splitlines() if line.startswith("| `") or line.startswith("| (")]
    assert len(rows) >= 15, f"{len(rows)} settings mapped; at least 15"
    valid = {k.key for k in keys()}
    named = _doc_keys(page, column=3)
    assert len(set(named)) >= 15
    unknown = sorted(set(named) - valid)
    assert not unknown, f"docs/MIGRATING.md names keys hpcdist does not have: {unknown}"


@pytest.mark.parametrize("page", ["STRATEGIES.md", "TROUBLESHOOTING.md", "FAULTS.md", "CLUSTER.md"])
def test_keys_named_on_a_page_exist(page: str) -> None:
    valid = {k.key for k in keys()}
    prefixes = {k.rsplit(".", 1)[0] for k in valid} | {k.split(".")[0] for k in valid}
    named = _doc_keys((DOCS / page).read_text(encoding="utf-8"), column=None)
    unknown = sorted({k for k in named if k not in valid and k not in prefixes})
    assert not unknown, f"docs/{page} names keys hpcdist does not have: {unknown}"
