"""The one JSONL reader (hpcdist.base.untrusted): records appended by others are read bounded and never through a
link or a FIFO; a torn or hostile line is dropped (read_jsonl, parse_jsonl) or ends a log read to resume from
(read_jsonl_prefix), whose byte offsets say where the intact part ends."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hpcdist.base.untrusted import DamagedRecord, parse_jsonl, read_jsonl, read_jsonl_prefix

GOOD = b'{"a": 1}\n{"a": 2}\n'


def test_bad_lines_are_dropped_and_the_rest_kept_in_order() -> None:
    hostile = b'[1, 2]\n{"a": NaN}\n\n{"a": ' + b"[" * 99 + b"]" * 99 + b"}\n"  # no object, NaN, blank, too deep
    data = b'{"a": 1}\n' + hostile + b'{"a": 2}\r\n{"a": "\xe2\x80\xa8"}\n{"a": 3'  # CRLF, U+2028 in a string, torn
    assert parse_jsonl(data) == [{"a": 1}, {"a": 2}, {"a": "\u2028"}]
    assert parse_jsonl(data.decode("utf-8", errors="replace")) == [{"a": 1}, {"a": 2}, {"a": "\u2028"}]


def test_read_jsonl_keeps_the_newest_lines_within_the_bound(tmp_path: Path) -> None:
    p = tmp_path / "metrics.jsonl"
    p.write_bytes(b'{"a": 0}\n' + GOOD)
    assert read_jsonl(p, len(GOOD) + 3) == [{"a": 1}, {"a": 2}]  # the cut first line is dropped
    assert read_jsonl(tmp_path / "missing.jsonl", 100) == []


def test_a_resumed_log_ends_at_its_first_bad_line_with_the_offsets_of_the_good_ones(tmp_path: Path) -> None:
    p = tmp_path / "progress.jsonl"
    p.write_bytes(GOOD + b"\n" + b'{"a": 3}\n{"a": 4')  # a blank line: what follows is not this log's
    assert read_jsonl_prefix(p, 1 << 20) == [({"a": 1}, 9), ({"a": 2}, 18)]
    p.write_bytes(GOOD + b'{"a": 3')  # torn while appended
    assert read_jsonl_prefix(p, 1 << 20) == [({"a": 1}, 9), ({"a": 2}, 18)]
    assert read_jsonl_prefix(p, 12) == [({"a": 1}, 9)]  # the bound cuts the second line: not read
    assert read_jsonl_prefix(tmp_path / "missing.jsonl", 100) == []


@pytest.mark.parametrize("reader", [read_jsonl, read_jsonl_prefix])
def test_a_link_or_a_fifo_is_a_damaged_record_and_never_blocks(tmp_path: Path, reader) -> None:
    target = tmp_path / "elsewhere.jsonl"
    target.write_bytes(GOOD)
    (tmp_path / "link.jsonl").symlink_to(target)
    os.mkfifo(tmp_path / "fifo.jsonl")
    for name in ("link.jsonl", "fifo.jsonl"):
        with pytest.raises(DamagedRecord):
            reader(tmp_path / name, 1 << 20)
