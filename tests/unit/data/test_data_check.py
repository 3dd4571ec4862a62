"""A prepared dataset is checked against what its meta.json records: cheaply at start-up (meta + sizes)
and by ``hpcdist data check DIR [--full]`` (every shard read: sha256, largest id), one line naming each bad shard."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hpcdist.cli import main
from hpcdist.config.dataset_meta import DataError
from hpcdist.data import TokenDataset
from hpcdist.data.check import check_dataset
from hpcdist.data.prepare import prepare_corpus


def _dataset(tmp_path: Path) -> Path:
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"text": f"document number {i} " * 3}) + "\n" for i in range(8)))
    out = tmp_path / "ds"
    prepare_corpus([src], out, shard_tokens=64)
    return out


def _damage(out: Path) -> None:
    """Shard 0 gets an id past the vocabulary, shard 1 a flipped byte, shard 2 is truncated."""
    a = np.fromfile(out / "shard-00000.bin", dtype="<u2")
    a[5] = 300  # vocab is 258
    a.tofile(out / "shard-00000.bin")
    b = bytearray((out / "shard-00001.bin").read_bytes())
    b[6] ^= 0x01  # a low byte: the id stays inside the vocabulary
    (out / "shard-00001.bin").write_bytes(bytes(b))
    c = (out / "shard-00002.bin").read_bytes()
    (out / "shard-00002.bin").write_bytes(c[:-2])


def test_data_check_names_each_damaged_shard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _dataset(tmp_path)
    assert main(["data", "check", str(out), "--full"]) == 0
    assert "intact" in capsys.readouterr().out
    _damage(out)
    # the cheap check (what start-up does): only the truncated file shows without reading
    assert main(["data", "check", str(out)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and "shard-00002.bin holds 126 bytes" in lines[0], lines
    assert main(["data", "check", str(out), "--full", "--workers", "2"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()[:-1]  # the last line is the summary
    by_shard = {n: [x for x in lines if f"shard-0000{n}.bin" in x] for n in range(4)}
    assert any("token id 300" in x and "vocab_size=258" in x for x in by_shard[0]), lines
    assert any("sha256" in x for x in by_shard[1]) and not any("token id" in x for x in by_shard[1]), lines
    assert any("truncated" in x for x in by_shard[2]), lines
    assert by_shard[3] == [], lines  # the intact shard is not named
    # training refuses at start-up, one line naming a shard, never an IndexError mid-run
    with pytest.raises(DataError, match=r"shard-0000[02]\.bin"):
        TokenDataset(out, seq_len=8)


def test_data_check_meta_max_id_past_vocab_and_old_datasets(tmp_path: Path) -> None:
    out = _dataset(tmp_path)
    meta = json.loads((out / "meta.json").read_text())
    meta["shards"][1]["max_id"] = 258
    (out / "meta.json").write_text(json.dumps(meta))
    report = check_dataset(out)
    assert not report.ok and "shards[1] (shard-00001.bin) records token ids up to 258" in report.problems[0]
    with pytest.raises(DataError, match=r"shard-00001\.bin\) records token ids up to 258"):
        TokenDataset(out, seq_len=8)
    # a dataset from before checksums were recorded: sizes and ids are checked, with a warning that contents are not
    for s in meta["shards"]:
        del s["sha256"], s["max_id"]
    (out / "meta.json").write_text(json.dumps(meta))
    report = check_dataset(out, full=True)
    assert report.ok and "only sizes and token ids" in report.warnings[0]
    b = bytearray((out / "shard-00001.bin").read_bytes())
    b[0] ^= 0x01  # a same-size edit within the vocabulary cannot be seen without a checksum
    (out / "shard-00001.bin").write_bytes(bytes(b))
    assert check_dataset(out, full=True).ok
    np.array([0, 1, 400], dtype="<u2").tofile(out / "shard-00003.bin")  # the wrong size and an id past it
    report = check_dataset(out, full=True)
    assert len(report.problems) == 1 and "shard-00003.bin holds 6 bytes" in report.problems[0]


def test_data_check_refuses_links_and_a_missing_dataset(tmp_path: Path) -> None:
    out = _dataset(tmp_path)
    target = tmp_path / "elsewhere.bin"
    target.write_bytes((out / "shard-00001.bin").read_bytes())
    (out / "shard-00001.bin").unlink()
    (out / "shard-00001.bin").symlink_to(target)
    report = check_dataset(out, full=True)
    assert len(report.problems) == 1 and "shard-00001.bin is a symbolic link" in report.problems[0]
    report = check_dataset(tmp_path / "nothing")
    assert len(report.problems) == 1 and "no prepared dataset there" in report.problems[0]
