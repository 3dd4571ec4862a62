"""Without SLURM: a corpus cut into N deterministic slices (jsonl by byte range on line boundaries,
multi-member jsonl.gz by member, parquet by row group), each prepared into its part, merged into one dataset whose
shards concatenated (and meta.json but for the shard list) equal the one-machine prepare, for any N."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from hpcdist.data import TokenDataset
from hpcdist.data import prepare as prepare_mod
from hpcdist.data.array import merge_parts, plan_prepare, prepare_part, prepare_status, write_plan
from hpcdist.data.check import check_dataset
from hpcdist.data.prepare import prepare_corpus
from hpcdist.data.slices import gzip_members, iter_piece, plan_slices

SHARD = 4096


def _lines(prefix: str, n: int, noise: int = 0) -> bytes:
    rng = np.random.default_rng(len(prefix) + n)  # noise: text gzip cannot shrink much
    return b"".join(
        json.dumps({"text": f"{prefix} {i} " + "x" * (i % 37) + rng.bytes(noise).hex()}).encode() + b"\n"
        for i in range(n)
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("corpus")
    (root / "a_big.jsonl").write_bytes(_lines("big", 1500))  # much larger than the rest
    members = [gzip.compress(_lines(f"member{k}", 60, noise=60)) for k in range(5)]
    (root / "b_multi.jsonl.gz").write_bytes(b"".join(members))  # five gzip members (cat a.gz b.gz ...)
    (root / "c_one.jsonl.gz").write_bytes(gzip.compress(_lines("small", 20)))
    (root / "d.txt").write_bytes(b"a whole text file\n" * 40)
    (root / "e_empty.jsonl").write_bytes(b"")
    files = [root / n for n in ("a_big.jsonl", "b_multi.jsonl.gz", "c_one.jsonl.gz", "d.txt", "e_empty.jsonl")]
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({"text": [f"parquet row {i}" for i in range(300)]})
        pq.write_table(table, root / "f.parquet", row_group_size=50)  # six row groups
        files.append(root / "f.parquet")
    except ImportError:
        pass
    return files


def _stream(out: Path) -> bytes:
    meta = json.loads((out / "meta.json").read_text())
    return b"".join((out / s["name"]).read_bytes() for s in meta["shards"])


def _meta_but_shards(out: Path) -> dict:
    return {k: v for k, v in json.loads((out / "meta.json").read_text()).items() if k != "shards"}


def test_gzip_members_and_slices_cover_every_document_once(corpus: list[Path]) -> None:
    gz = corpus[1]
    starts = gzip_members(gz)
    assert len(starts) == 5 and starts[0] == 0
    assert gzip_members(corpus[2]) == [0]
    whole = [d for f in corpus for d, _ in prepare_mod.corpora.iter_documents(f)]
    for n in (1, 2, 3, 7, 40):
        slices = plan_slices(corpus, n)
        assert len(slices) == n and slices == plan_slices(corpus, n)  # deterministic
        docs = [d for s in slices for p in s for d, _ in iter_piece(p)]
        assert docs == whole, n
    four = plan_slices(corpus, 4)
    kinds = {(p.path.rsplit("/", 1)[-1], p.kind) for s in four for p in s}
    assert ("a_big.jsonl", "jsonl") in kinds and ("b_multi.jsonl.gz", "jsonl.gz") in kinds
    assert sum(1 for s in four for p in s if p.path.endswith("a_big.jsonl")) > 1  # the big file is split
    assert sum(1 for s in four for p in s if p.path.endswith("b_multi.jsonl.gz")) > 1  # at member boundaries
    if corpus[-1].suffix == ".parquet":  # with 40 slices, the parquet file is larger than half a slice
        assert sum(1 for s in plan_slices(corpus, 40) for p in s if p.kind == "parquet") > 1


def test_parts_merged_equal_the_one_machine_prepare(corpus: list[Path], tmp_path: Path) -> None:
    one = prepare_corpus(corpus, tmp_path / "one", shard_tokens=SHARD).path
    for n in (1, 3, 4):
        out = tmp_path / f"cluster{n}"
        write_plan(out, plan_prepare(corpus, out, tasks=n, shard_tokens=SHARD))
        for i in range(n):
            prepare_part(out, i)
        meta = merge_parts(out)
        assert _stream(out) == _stream(one), n
        assert _meta_but_shards(out) == _meta_but_shards(one), n
        assert any(s.name.startswith(f"parts/{n - 1}/") for s in meta.shards) or n == 1
        assert check_dataset(out, full=True).ok
        ds = TokenDataset(out, seq_len=64)
        assert len(ds) > 0 and int(ds[len(ds) - 1].max()) < 258
        assert "done" in prepare_status(out) and "merged:" in prepare_status(out)


def test_killed_part_resumes_and_merge_refuses_missing_or_linked_parts(corpus: list[Path], tmp_path: Path) -> None:
    one = prepare_corpus(corpus, tmp_path / "one", shard_tokens=SHARD).path
    out = tmp_path / "c"
    write_plan(out, plan_prepare(corpus, out, tasks=2, shard_tokens=SHARD))

    class Killed(Exception):
        pass

    def die(n: int) -> None:
        raise Killed

    prepare_mod.AFTER_SHARD = die  # the process dies right after its first shard
    try:
        with pytest.raises(Killed):
            prepare_part(out, 0)
    finally:
        prepare_mod.AFTER_SHARD = None
    assert "running" in prepare_status(out)
    with pytest.raises(Exception, match="part 0"):
        merge_parts(out)  # part 0 unfinished, part 1 not started: refused, nothing written
    assert not (out / "meta.json").exists()
    assert prepare_part(out, 0).kept_shards == 1  # the task run again keeps its finished shard
    prepare_part(out, 1)
    merge_parts(out)
    assert _stream(out) == _stream(one)
    # a part directory replaced by a link is refused by every reader, never followed
    (out / "parts" / "1").rename(tmp_path / "moved")
    (out / "parts" / "1").symlink_to(tmp_path / "moved")
    report = check_dataset(out, full=True)
    assert report.problems and all("symbolic link" in p for p in report.problems)
    with pytest.raises(Exception, match="symbolic link"):
        TokenDataset(out, seq_len=64)
    np.testing.assert_equal(
        len(report.problems), len(json.loads((tmp_path / "moved" / "meta.json").read_text())["shards"])
    )


def test_cli_cluster_options_dry_run_and_status(
    corpus: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from hpcdist.cli import main

    out = tmp_path / "big"
    assert main(["prepare", str(corpus[0]), "--out", str(out), "--tasks", "2"]) == 2  # --tasks without --cluster
    assert "go with --cluster" in capsys.readouterr().err
    args = ["prepare", *map(str, corpus), "--out", str(out), "--cluster", "a100_ib"]
    assert main([*args, "--dry-run"]) == 2 and "give --tasks N" in capsys.readouterr().err
    assert main([*args, "--tasks", "3", "--max-tokens", "10", "--dry-run"]) == 2
    assert "--max-tokens is a one-machine option" in capsys.readouterr().err
    assert main([*args, "--tasks", "3", "--dry-run"]) == 0
    text = capsys.readouterr()
    assert "--array=0-2" in text.out and "afterok:<array job>" in text.out and "# task 2:" in text.err
    assert not out.exists()  # a dry run writes nothing
    write_plan(out, plan_prepare(corpus, out, tasks=2, shard_tokens=SHARD))
    prepare_part(out, 1)
    assert main(["status", "--run-dir", str(out)]) == 0
    table = capsys.readouterr().out
    assert "2 task(s)" in table and "waiting" in table and " done " in table and "merged: not yet" in table
