"""Records someone else may have written, read as such: every JSON and JSONL record of a run directory or a
prepare directory (restarts.json, failures.jsonl, goodput.json, run_summary.json, metrics.jsonl, ranks.json, a
prepare's jobs.json and meta.json), and the one way their text is printed.

A run directory is shared: a colleague runs ``hpcdist report`` on it, a batch script's after-step reads it while
another job writes it, and anyone with write access there can leave a FIFO, a link, a sparse terabyte file, a
record nested 200,000 levels deep or one whose fields have the wrong types. The bytes are read through
hpcdist.base.atomic (never through a link, never blocking on a FIFO, never more than a bound), then parsed here:
JSON constants that are no numbers (NaN, Infinity) and floats out of range (1e999) are refused, nesting is
bounded, and whatever is wrong with the file (a link, not a regular file, too large, not UTF-8 JSON, too deep) is
one :class:`DamagedRecord`, a ValueError naming the file and why: callers catch that one error, never
RecursionError, OverflowError or a TypeError from a value of the wrong type (each caller validates the fields it
uses). JSONL records are read here only: :func:`read_jsonl` (the newest records of a file appended to: metrics,
failures) and :func:`parse_jsonl` (bytes read another way, such as a trusted jobs.jsonl) drop a line that does not
parse (the one being appended, or cut by a crash) and keep the rest; :func:`read_jsonl_prefix` (a log read to resume
from it, a preparation's progress.jsonl) keeps the records before the first such line.

:func:`one_line` is how untrusted text reaches a terminal or a job log: one line, printable, bounded, so a
record's ``\\x1b[2J`` or ``\\nFAKE LINE`` is shown as the escape it is instead of clearing the screen or forging a
line. Standard library only: every layer uses it.
"""

from __future__ import annotations

import json
import os
from typing import Any

from hpcdist.base.atomic import UntrustedFile, read_bounded, read_head, read_tail

__all__ = [
    "MAX_DEPTH",
    "DamagedRecord",
    "one_line",
    "parse",
    "parse_jsonl",
    "read_json",
    "read_jsonl",
    "read_jsonl_prefix",
]

MAX_DEPTH = 32
"""Nesting (objects and arrays) a record may have: hpcdist's deepest record has 4 levels."""

_SHOWN = 200  # characters of untrusted text one_line keeps by default


class DamagedRecord(ValueError):
    """A record that cannot be used: a link, not a regular file, larger than its bound, not JSON, nested deeper
    than :data:`MAX_DEPTH`, or (raised by the record's owner) a field of the wrong type or value."""


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text[:20]} is out of a float's range")
    return value


def _check_depth(doc: Any, limit: int = MAX_DEPTH) -> None:
    """ValueError when ``doc`` nests deeper than ``limit``; iterative, so a deep document cannot exhaust the stack of
    the code that walks it later (json.dumps when a ledger is saved again, a report's table)."""
    todo: list[tuple[Any, int]] = [(doc, 0)]
    while todo:
        value, depth = todo.pop()
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth >= limit:
            raise ValueError(f"nested deeper than {limit} levels")
        todo.extend((child, depth + 1) for child in children)


def parse(data: bytes | str) -> Any:
    """One JSON document from untrusted bytes: ValueError (never RecursionError) for anything that is not a JSON
    document of plain numbers nested at most :data:`MAX_DEPTH` levels."""
    try:
        doc = json.loads(data, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:  # the C scanner's own stack bound: far deeper than MAX_DEPTH
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels") from None
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    _check_depth(doc)
    return doc


def _why(path: str | os.PathLike[str], e: OSError) -> str:
    return str(e) if isinstance(e, UntrustedFile) else f"{path}: {e.strerror or e}"  # UntrustedFile names the file


def read_json(path: str | os.PathLike[str], max_bytes: int) -> Any:
    """The JSON document in ``path``; None when there is no such file. DamagedRecord for every other reason it
    cannot be read (see the module docstring); its type is the caller's to check."""
    try:
        data = read_bounded(path, max_bytes)
    except FileNotFoundError:
        return None
    except OSError as e:  # a link, a FIFO, a directory, too large, unreadable
        raise DamagedRecord(_why(path, e)) from None
    try:
        return parse(data)
    except ValueError as e:
        raise DamagedRecord(f"{path} is not a readable record ({e})") from None


def parse_jsonl(data: bytes | str) -> list[dict[str, Any]]:
    """The JSON objects of the lines of ``data``, in order. A line that does not parse (see :func:`parse`), or is
    no object, is skipped: a line being appended, a torn tail, a line cut by a bound."""
    out = []
    # at newlines only: JSON allows a carriage return between tokens and U+2028 in a string (splitlines cuts both)
    for line in data.split(b"\n") if isinstance(data, bytes) else data.split("\n"):
        if not line.strip():
            continue
        try:
            rec = parse(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def read_jsonl(path: str | os.PathLike[str], max_bytes: int) -> list[dict[str, Any]]:
    """The JSON objects of the last ``max_bytes`` of ``path``, in order (:func:`parse_jsonl`); [] when there is no
    such file. DamagedRecord when the file itself cannot be read (a link, a FIFO, a directory)."""
    try:
        data = read_tail(path, max_bytes + 1)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise DamagedRecord(_why(path, e)) from None
    if len(data) > max_bytes:
        data = data.split(b"\n", 1)[1] if b"\n" in data else b""  # the bound cut the first line
    return parse_jsonl(data)


def read_jsonl_prefix(path: str | os.PathLike[str], max_bytes: int) -> list[tuple[dict[str, Any], int]]:
    """The leading records of a log that is only appended to, read from its start to resume from it: (object, the
    offset just past its line) for each complete line of the first ``max_bytes`` up to the first one that does not
    parse or is no object (a blank line too). What follows a bad line is not trusted to continue the log, and the
    part after the last newline is a line still being written (or cut by a crash or by the bound). [] when there is
    no such file; DamagedRecord when the file itself cannot be read (a link, a FIFO, a directory)."""
    try:
        data = read_head(path, max_bytes)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise DamagedRecord(_why(path, e)) from None
    out: list[tuple[dict[str, Any], int]] = []
    at = 0
    while (end := data.find(b"\n", at)) >= 0:
        try:
            rec = parse(data[at:end])
        except ValueError:
            break
        if not isinstance(rec, dict):
            break
        at = end + 1
        out.append((rec, at))
    return out


def one_line(value: Any, limit: int = _SHOWN) -> str:
    """``value`` as text fit to print among hpcdist's own lines: every character that is not printable (newlines,
    tabs, terminal escapes, bidirectional controls) written as its Python escape, at most ``limit`` characters."""
    text = value if isinstance(value, str) else str(value)
    if len(text) > 4 * limit:  # never escape a huge value whole only to cut it
        text = text[: 4 * limit]
    shown = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
    return shown if len(shown) <= limit else shown[: max(0, limit - 3)] + "..."
