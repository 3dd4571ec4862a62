"""Unit tests for hpcdist.data: tokenizer, shard preparation, datasets, resumable sampler and batch loader."""

from __future__ import annotations

import json
import os
import pickle
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from hpcdist.config import ConfigError
from hpcdist.data import (
    BatchLoader,
    ByteTokenizer,
    ResumableSampler,
    SyntheticDataset,
    TokenDataset,
    prepare_shards,
    stdlib_corpus,
)
from hpcdist.data import prepare as prepare_mod
from hpcdist.data.prepare import PrepareRefused
from tests.conftest import REPO

TOK = ByteTokenizer()
DOCS = [b"hello world\n", "caf\u00e9 \u2603 \U0001f680\n".encode(), b"", b"\xff\xfe not utf-8 \x80", b"x" * 23]


def _write_docs(root: Path, docs: list[bytes] = DOCS) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, d in enumerate(docs):
        p = root / f"doc-{k:03d}.txt"
        p.write_bytes(d)
        paths.append(p)
    return paths


def _stream(docs: list[bytes] = DOCS) -> np.ndarray:
    """The token stream prepare_shards should produce, built independently of it."""
    out: list[int] = []
    for d in docs:
        out.extend(d)
        out.append(ByteTokenizer.eos_id)
    return np.array(out, dtype=np.int64)


def _read_shards(out: Path) -> tuple[dict, list[np.ndarray]]:
    meta = json.loads((out / "meta.json").read_text())
    dt = {"uint16": "<u2", "uint32": "<u4"}[meta["dtype"]]
    return meta, [np.fromfile(out / s["name"], dtype=dt).astype(np.int64) for s in meta["shards"]]


def _mtimes(out: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(out.iterdir())}


# ---------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("text", ["hello, world", "", "na\u00efve caf\u00e9 \u65e5\u672c\u8a9e \U0001f680 \u00df"])
def test_tokenizer_round_trip(text: str) -> None:
    ids = TOK.encode(text)
    assert ids.dtype == np.uint16
    assert len(ids) == len(text.encode("utf-8")) + 1  # one token per UTF-8 byte + EOS
    assert TOK.decode(ids) == text
    assert TOK.decode(ids.tolist()) == text


def test_tokenizer_bos_eos_and_bytes_input() -> None:
    assert TOK.encode("ab", bos=True).tolist() == [256, 97, 98, 257]
    assert TOK.encode("ab", eos=False).tolist() == [97, 98]
    assert TOK.encode(b"\x00\xff", bos=True, eos=False).tolist() == [256, 0, 255]
    assert TOK.decode([TOK.bos_id, 104, 105, TOK.eos_id, 33]) == "hi!"
    assert (TOK.vocab_size, TOK.bos_id, TOK.eos_id) == (258, 256, 257)


def test_tokenizer_decode_invalid_utf8_and_range() -> None:
    assert TOK.decode([0xFF, 0x41]) == "\ufffdA"
    cut = TOK.encode("\u00e9", eos=False)[:1]  # first byte of a 2-byte character
    assert TOK.decode(cut) == "\ufffd"
    with pytest.raises(ValueError, match="258"):
        TOK.decode([300])


# ---------------------------------------------------------------- stdlib corpus


def test_stdlib_corpus() -> None:
    files = stdlib_corpus()
    assert len(files) > 100
    assert files == sorted(files)
    assert all(f.suffix == ".py" and f.is_file() for f in files)
    assert not any({"site-packages", "dist-packages"} & set(f.parts) for f in files)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert all(f.is_relative_to(stdlib) for f in files)
    assert stdlib / "os.py" in files
    assert any(len(f.relative_to(stdlib).parts) > 1 for f in files)  # recursive


# ---------------------------------------------------------------- prepare_shards


def test_prepare_shards_splits_stream_and_writes_meta(tmp_path: Path) -> None:
    files = _write_docs(tmp_path / "src")
    out = prepare_shards(files, tmp_path / "ds", shard_tokens=7)
    assert out == tmp_path / "ds"
    meta, shards = _read_shards(out)
    stream = _stream()
    n_shards = -(-len(stream) // 7)
    assert [s["name"] for s in meta["shards"]] == [f"shard-{k:05d}.bin" for k in range(n_shards)]
    assert [s["tokens"] for s in meta["shards"]] == [7] * (n_shards - 1) + [len(stream) - 7 * (n_shards - 1)]
    np.testing.assert_array_equal(np.concatenate(shards), stream)
    assert (out / "shard-00000.bin").stat().st_size == 7 * 2  # raw uint16, no header
    assert meta["dtype"] == "uint16"
    assert meta["vocab_size"] == 258
    assert meta["num_tokens"] == len(stream)
    assert meta["num_documents"] == len(DOCS)
    assert isinstance(meta["fingerprint"], str) and len(meta["fingerprint"]) == 64
    assert not list(out.glob("*.tmp.*"))


def test_prepare_shards_uint32(tmp_path: Path) -> None:
    files = _write_docs(tmp_path / "src")
    out = prepare_shards(files, tmp_path / "ds", shard_tokens=1000, dtype="uint32")
    meta, shards = _read_shards(out)
    assert meta["dtype"] == "uint32"
    assert (out / "shard-00000.bin").stat().st_size == len(_stream()) * 4
    np.testing.assert_array_equal(shards[0], _stream())
    np.testing.assert_array_equal(TokenDataset(out, seq_len=4)[0], _stream()[:5])


def test_prepare_shards_rejects_bad_options(tmp_path: Path) -> None:
    class BigVocab(ByteTokenizer):
        vocab_size = 70_000

    files = _write_docs(tmp_path / "src")
    with pytest.raises(ValueError, match="uint32"):
        prepare_shards(files, tmp_path / "a", tokenizer=BigVocab())
    with pytest.raises(ValueError, match="int8"):
        prepare_shards(files, tmp_path / "b", dtype="int8")
    with pytest.raises(ValueError, match="shard_tokens") as err:
        prepare_shards([], tmp_path / "c", shard_tokens=0)
    assert "no input files" in str(err.value)  # every problem reported at once
    assert not (tmp_path / "a").exists()


def test_prepare_shards_max_tokens_caps_total(tmp_path: Path) -> None:
    files = _write_docs(tmp_path / "src")
    out = prepare_shards(files, tmp_path / "ds", shard_tokens=5, max_tokens=20)
    meta, shards = _read_shards(out)
    assert meta["num_tokens"] == 20
    assert sum(s["tokens"] for s in meta["shards"]) == 20
    np.testing.assert_array_equal(np.concatenate(shards), _stream()[:20])
    assert meta["num_documents"] == 2  # stopped reading after the document that hit the cap


def test_prepare_shards_is_idempotent(tmp_path: Path) -> None:
    files = _write_docs(tmp_path / "src")
    out = prepare_shards(files, tmp_path / "ds", shard_tokens=8)
    # Backdate the outputs so a rewrite would be visible even on coarse-mtime filesystems.
    for p in out.iterdir():
        os.utime(p, ns=(10**9, 10**9))
    before = _mtimes(out)
    prepare_shards(files, out, shard_tokens=8)
    assert _mtimes(out) == before

    # A changed input (different size) changes the fingerprint: a rebuild, which replaces the dataset only when asked
    files[0].write_bytes(b"changed!")
    with pytest.raises(PrepareRefused, match="--overwrite"):
        prepare_shards(files, out, shard_tokens=8)
    assert _mtimes(out) == before
    prepare_shards(files, out, shard_tokens=8, overwrite=True)
    assert _mtimes(out)["meta.json"] != before["meta.json"]
    _, shards = _read_shards(out)
    np.testing.assert_array_equal(np.concatenate(shards), _stream([b"changed!", *DOCS[1:]]))


def test_prepare_shards_options_change_fingerprint(tmp_path: Path) -> None:
    files = _write_docs(tmp_path / "src")
    out = prepare_shards(files, tmp_path / "ds", shard_tokens=8)
    fp = json.loads((out / "meta.json").read_text())["fingerprint"]
    prepare_shards(files, out, shard_tokens=8, max_tokens=10, overwrite=True)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["fingerprint"] != fp
    assert meta["num_tokens"] == 10
    assert sorted(p.name for p in out.glob("shard-*")) == ["shard-00000.bin", "shard-00001.bin"]  # stale removed


def test_leftover_temp_and_missing_meta_not_complete(tmp_path: Path) -> None:
    files = _write_docs(tmp_path / "src")
    out = tmp_path / "ds"
    out.mkdir()
    # What a crashed run leaves: a finished shard, a half-written temp file, no meta.json.
    (out / "shard-00000.bin").write_bytes(np.arange(8, dtype="<u2").tobytes())
    (out / ".shard-00001.bin.0123456789ab.tmp").write_bytes(b"\x01\x00")
    with pytest.raises(ConfigError, match="hpcdist prepare"):
        TokenDataset(out, seq_len=2)
    with pytest.raises(PrepareRefused, match="files prepare did not write"):  # no progress: not known to be ours
        prepare_shards(files, out, shard_tokens=8)
    prepare_shards(files, out, shard_tokens=8, overwrite=True)
    assert not list(out.glob(".*.tmp"))
    _, shards = _read_shards(out)
    np.testing.assert_array_equal(np.concatenate(shards), _stream())


def test_crash_mid_prepare_leaves_incomplete_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = _write_docs(tmp_path / "src")
    out = prepare_shards(files, tmp_path / "ds", shard_tokens=8)  # a complete older dataset
    real_write = prepare_mod.atomic_write
    calls = []

    def crash_on_second(path: Path, payload: bytes | memoryview, **kw: object) -> None:
        calls.append(path.name)
        if len(calls) == 2:
            raise OSError("simulated crash")
        real_write(path, payload, **kw)

    monkeypatch.setattr(prepare_mod, "atomic_write", crash_on_second)
    with pytest.raises(OSError, match="simulated"):
        prepare_shards(files, out, shard_tokens=4, overwrite=True)  # new options -> rebuild, dies after one shard
    # The old meta.json must be gone: it would otherwise describe shards that were overwritten.
    assert not (out / "meta.json").exists()
    with pytest.raises(ConfigError):
        TokenDataset(out, seq_len=2)
    monkeypatch.setattr(prepare_mod, "atomic_write", real_write)
    prepare_shards(files, out, shard_tokens=4)  # its own unfinished preparation: continued without --overwrite
    meta, shards = _read_shards(out)
    assert meta["shard_tokens"] == 4
    np.testing.assert_array_equal(np.concatenate(shards), _stream())


def test_truncated_shard_not_complete(tmp_path: Path) -> None:
    files = _write_docs(tmp_path / "src")
    out = prepare_shards(files, tmp_path / "ds", shard_tokens=8)
    with open(out / "shard-00001.bin", "r+b") as fh:
        fh.truncate(3)
    with pytest.raises(ConfigError, match="hpcdist prepare"):
        TokenDataset(out, seq_len=2)
    prepare_shards(files, out, shard_tokens=8)  # same fingerprint, but repaired
    assert (out / "shard-00001.bin").stat().st_size == 16


# ---------------------------------------------------------------- TokenDataset


def test_token_dataset_windows_match_stream(tmp_path: Path) -> None:
    files = _write_docs(tmp_path / "src")
    out = prepare_shards(files, tmp_path / "ds", shard_tokens=10)
    seq_len = 3
    stream = _stream()
    # Expected: per shard of 10 tokens, floor(len / 4) non-overlapping 4-token windows; tails unused.
    expected = []
    for s in range(0, len(stream), 10):
        chunk = stream[s : s + 10]
        expected += [chunk[j * 4 : (j + 1) * 4] for j in range(len(chunk) // 4)]
    ds = TokenDataset(out, seq_len)
    assert len(ds) == len(expected)
    assert ds.vocab_size == 258
    for i, want in enumerate(expected):
        got = ds[i]
        assert got.dtype == np.int64 and got.shape == (seq_len + 1,)
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(ds[-1], expected[-1])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_token_dataset_pickles_without_copying_maps(tmp_path: Path) -> None:
    out = prepare_shards(_write_docs(tmp_path / "src"), tmp_path / "ds", shard_tokens=10)
    ds = TokenDataset(out, 3)
    first = ds[0]
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._maps == {}
    np.testing.assert_array_equal(clone[0], first)


@pytest.mark.parametrize("val_fraction", [0.01, 0.25, 0.5])
def test_token_dataset_train_val_split(tmp_path: Path, val_fraction: float) -> None:
    out = prepare_shards(_write_docs(tmp_path / "src"), tmp_path / "ds", shard_tokens=10)
    full = TokenDataset(out, 1)
    train = TokenDataset(out, 1, split="train", val_fraction=val_fraction)
    val = TokenDataset(out, 1, split="val", val_fraction=val_fraction)
    assert len(val) >= 1
    assert len(train) + len(val) == len(full)
    assert len(val) == max(1, round(len(full) * val_fraction))
    # Train is a prefix, val the rest: together they are exactly the full sample list, in order, no overlap.
    joined = [train[i] for i in range(len(train))] + [val[i] for i in range(len(val))]
    np.testing.assert_array_equal(np.stack(joined), np.stack([full[i] for i in range(len(full))]))


def test_token_dataset_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="hpcdist prepare"):
        TokenDataset(tmp_path / "nope", 4)
    out = prepare_shards(_write_docs(tmp_path / "src"), tmp_path / "ds", shard_tokens=10)
    with pytest.raises(ValueError, match="too few"):
        TokenDataset(out, 10)  # needs 11-token windows, shards hold at most 10
    with pytest.raises(ValueError, match="val_fraction"):
        TokenDataset(out, 4, split="val")
    with pytest.raises(ValueError, match="split"):
        TokenDataset(out, 4, split="test")
    with pytest.raises(ValueError, match="val_fraction"):
        TokenDataset(out, 4, val_fraction=1.0)


# ---------------------------------------------------------------- SyntheticDataset


def test_synthetic_dataset_deterministic_per_index() -> None:
    a = SyntheticDataset(100, 16, 50, seed=3)
    b = SyntheticDataset(7, 16, 50, seed=3)  # different size, same (seed, i) -> same sample
    assert len(a) == 100 and len(b) == 7
    for i in range(7):
        np.testing.assert_array_equal(a[i], b[i])
    # Reading order does not matter.
    np.testing.assert_array_equal(a[5], SyntheticDataset(100, 16, 50, seed=3)[5])
    assert a[0].dtype == np.int64 and a[0].shape == (17,)
    assert not np.array_equal(a[0], a[1])
    assert not np.array_equal(a[0], SyntheticDataset(100, 16, 50, seed=4)[0])
    allv = np.stack([a[i] for i in range(100)])
    assert allv.min() >= 0 and allv.max() < 50
    with pytest.raises(IndexError):
        a[100]


# ---------------------------------------------------------------- ResumableSampler


def _epochs(ids: list[int], n: int) -> list[list[int]]:
    return [ids[k : k + n] for k in range(0, len(ids), n)]


def test_sampler_epoch_rollover_covers_every_id_once() -> None:
    s = ResumableSampler(10, seed=1)
    ids = []
    for _ in range(10):
        ids += s.next_indices(3)  # 30 ids: batches straddle epoch boundaries
    epochs = _epochs(ids, 10)
    assert len(epochs) == 3
    for e in epochs:
        assert sorted(e) == list(range(10))
    assert epochs[0] != epochs[1]  # a fresh permutation each epoch
    assert s.state_dict() == {"epoch": 3, "position": 0, "seed": 1, "num_samples": 10}
    # The documented order: torch.randperm seeded with seed + epoch.
    assert epochs[1] == torch.randperm(10, generator=torch.Generator().manual_seed(2)).tolist()


def test_sampler_no_shuffle_is_identity() -> None:
    s = ResumableSampler(5, shuffle=False)
    assert s.next_indices(12) == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    assert s.next_indices(0) == []
    with pytest.raises(ValueError):
        s.next_indices(-1)


def test_sampler_state_round_trip_resumes_identically() -> None:
    ref = ResumableSampler(13, seed=7)
    ref.next_indices(9)
    state = ref.state_dict()
    assert all(type(v) is int for v in state.values())
    state = json.loads(json.dumps(state))  # survives a JSON checkpoint
    resumed = ResumableSampler(13, seed=7)
    resumed.load_state_dict(state)
    assert resumed.next_indices(40) == ref.next_indices(40)
    assert resumed.state_dict() == ref.state_dict()


def test_sampler_rejects_mismatched_state() -> None:
    state = ResumableSampler(10, seed=0).state_dict()
    with pytest.raises(ValueError, match="11"):
        ResumableSampler(11, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        ResumableSampler(10, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="position"):
        ResumableSampler(10).load_state_dict({**state, "position": 11})
    with pytest.raises(ValueError, match="lacks"):
        ResumableSampler(10).load_state_dict({"epoch": 0})


# ---------------------------------------------------------------- BatchLoader


def _loaders(ds: SyntheticDataset, dp: int, gbs: int, state: dict | None = None, seed: int = 0) -> list[BatchLoader]:
    """One loader per data-parallel rank, each with its own sampler copy, as separate processes would have."""
    out = []
    for r in range(dp):
        loader = BatchLoader(ds, ResumableSampler(len(ds), seed=seed), global_batch_size=gbs, dp_rank=r, dp_size=dp)
        if state is not None:
            loader.load_state_dict(state)
        out.append(loader)
    return out


def _global_step(loaders: list[BatchLoader]) -> tuple[torch.Tensor, list[int]]:
    batches = [ld.next_batch() for ld in loaders]
    ids = [i for ld in loaders for i in ld.last_indices()]
    return torch.cat(batches), ids


def test_batch_loader_ranks_concat_to_single_rank_batch() -> None:
    ds = SyntheticDataset(40, 8, 100)
    (single,) = _loaders(ds, 1, 8)
    pair = _loaders(ds, 2, 8)
    for _ in range(7):
        want = single.next_batch()
        assert want.shape == (8, 9) and want.dtype == torch.int64
        got, ids = _global_step(pair)
        assert pair[0].last_indices() == single.last_indices()[:4]
        assert ids == single.last_indices()
        assert torch.equal(got, want)
    assert torch.equal(want[0], torch.from_numpy(ds[single.last_indices()[0]]))
    assert pair[0].state_dict() == pair[1].state_dict() == single.state_dict()


def test_batch_loader_validation() -> None:
    ds = SyntheticDataset(40, 8, 100)
    with pytest.raises(ValueError, match=r"global_batch_size=10.*dp_size=4"):
        BatchLoader(ds, ResumableSampler(40), global_batch_size=10, dp_rank=0, dp_size=4)
    with pytest.raises(ValueError, match="dp_rank"):
        BatchLoader(ds, ResumableSampler(40), global_batch_size=8, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="39"):
        BatchLoader(ds, ResumableSampler(39), global_batch_size=8, dp_rank=0, dp_size=2)


def test_batch_loader_resume_mid_epoch(tmp_path: Path) -> None:
    out = prepare_shards(_write_docs(tmp_path / "src", [bytes(range(256))] * 3), tmp_path / "ds", shard_tokens=100)
    ds = TokenDataset(out, 7)
    assert len(ds) == 92  # 7 shards x 12 windows + 8 from the 71-token tail: 23 steps per epoch
    (ref,) = _loaders(ds, 1, 4, seed=5)
    ref_batches = [ref.next_batch() for _ in range(30)]

    (first,) = _loaders(ds, 1, 4, seed=5)
    for k in range(10):
        assert torch.equal(first.next_batch(), ref_batches[k])
    state = json.loads(json.dumps(first.state_dict()))
    assert state["epoch"] == 0 and state["position"] == 40
    (resumed,) = _loaders(ds, 1, 4, state=state, seed=5)
    for k in range(10, 30):  # runs past the epoch boundary
        assert torch.equal(resumed.next_batch(), ref_batches[k])


@pytest.mark.parametrize("new_dp", [1, 4])
def test_batch_loader_resharding_resume(new_dp: int) -> None:
    n, gbs, k, m = 36, 8, 3, 10  # 36 % 8 != 0: some global batches straddle an epoch boundary
    ds = SyntheticDataset(n, 4, 1000)
    (ref,) = _loaders(ds, 1, gbs)
    ref_ids = []
    for _ in range(k + m):
        ref.next_batch()
        ref_ids += ref.last_indices()

    seen = []
    old = _loaders(ds, 2, gbs)
    for _ in range(k):
        seen += _global_step(old)[1]
    states = [ld.state_dict() for ld in old]
    assert all(s == states[0] for s in states)  # any rank's state describes the whole job
    new = _loaders(ds, new_dp, gbs, state=states[0])
    for _ in range(m):
        batch, ids = _global_step(new)
        assert batch.shape == (gbs, 5)
        seen += ids

    assert seen == ref_ids
    epochs = _epochs(seen, n)
    assert len(epochs) == 3  # (3 + 10) * 8 = 104 ids: two full epochs and part of a third
    for e in epochs[:-1]:
        assert sorted(e) == list(range(n))  # nothing skipped, nothing repeated
    assert len(set(epochs[-1])) == len(epochs[-1])


def test_the_package_imports_its_modules_on_first_use(tmp_path: Path) -> None:
    """Preparing, checking and job control read or write token data without a model: `hpcdist data prepare`, `data
    check` and hpcdist.data.array (`hpcdist status`) import no torch through the package; its names still resolve,
    each to its module's object."""
    import subprocess
    import sys

    import hpcdist.data as data

    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("hello world\n" * 50, encoding="utf-8")
    code = (
        "import sys, hpcdist.data.array\n"
        "from hpcdist import cli\n"
        "rc = cli.main(['data', 'prepare', 'texts', '--out', 'ds', '--workers', '1'])\n"
        "rc = rc or cli.main(['data', 'check', 'ds', '--full'])\n"
        "print('TORCH', 'torch' in sys.modules, 'RC', rc)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # this checkout's package, from the scratch directory
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert "TORCH False RC 0" in out.stdout, out.stdout + out.stderr
    for name in data.__all__:
        obj = getattr(data, name)
        assert obj.__module__.startswith("hpcdist.data.") and getattr(sys.modules[obj.__module__], name) is obj, name
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        data.missing  # noqa: B018
