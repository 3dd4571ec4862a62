"""Prepare never replaces a dataset it was not asked to; a prepared directory edited or
damaged in any of 30 ways is refused in one line by every command that reads it (train, eval, config, prepare
--tokenizer, generate --tokenizer) before a step, never a traceback, never a hang; hostile corpora are one line;
prepare with several workers stopped early by --max-tokens never hangs (50 runs in a row).

Every command runs in this process through ``hpcdist.cli.main`` (a subprocess per case would import torch each
time), each under a SIGALRM bound, with fd-level capture: a traceback written anywhere would be seen.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from hpcdist.cli import main
from hpcdist.config.dataset_meta import load_meta, withdraw_meta, write_meta
from hpcdist.data import TokenDataset, prepare_shards, stdlib_corpus
from tests.conftest import SMALL

ROOT = Path(__file__).resolve().parents[3]
SHARD = 1024  # tokens per shard: 31 windows of seq_len + 1 = 33 tokens; token 1023 of each shard is in no window
RUN_BOUND_S = int(os.environ.get("HPCDIST_TEST_RUN_BOUND_S", "60"))  # no command may take longer on any input


class PastBound(BaseException):
    """Raised by SIGALRM in the main thread (a blocking open() of a FIFO is interrupted too). A BaseException: no
    reader's ``except Exception`` / ``except OSError`` (TimeoutError is an OSError) can turn it into a message."""


@contextlib.contextmanager
def _bounded(seconds: int = RUN_BOUND_S) -> Iterator[None]:
    """Raise PastBound past `seconds`."""

    def expire(signum: int, frame: object) -> None:
        raise PastBound(f"ran past {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _cli(capfd: pytest.CaptureFixture[str], *argv: str | os.PathLike[str]) -> tuple[int, str, float]:
    """(exit status, stdout + stderr, seconds) of ``hpcdist ARGV`` in this process, under the run bound."""
    capfd.readouterr()
    t0 = time.perf_counter()
    try:
        with _bounded():
            rc = main([str(a) for a in argv])
    except PastBound:
        rc = -1  # reported by the caller as a run past the bound
    out, err = capfd.readouterr()
    return rc, out + err, time.perf_counter() - t0


def _train_args(run_dir: Path, data: Path, *extra: str) -> list[str]:
    return [
        "train",
        str(ROOT / "configs/demo.yaml"),
        *SMALL,
        f"run.dir={run_dir}",
        "data.source=files",
        f"data.path={data}",
        "train.steps=1",
        "train.global_batch_size=4",
        "train.micro_batch_size=4",
        "data.val_fraction=0",
        "train.eval_every_steps=0",
        *extra,
    ]


@pytest.fixture(scope="session")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 shards of 1024 byte-level tokens (stdlib text), prepared by the tool."""
    root = tmp_path_factory.mktemp("base")
    return prepare_shards(stdlib_corpus()[:40], root / "ds", shard_tokens=SHARD, max_tokens=4 * SHARD)


@pytest.fixture(scope="session")
def checkpoint(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-step run on `base` with its final checkpoint: what eval and generate load."""
    run = tmp_path_factory.mktemp("ckpt") / "run"
    assert main(_train_args(run, base, "checkpoint.save_final=true")) == 0
    return run


def _copy(base: Path, dest: Path) -> Path:
    shutil.copytree(base, dest)
    return dest


def _meta(d: Path) -> dict:
    return json.loads((d / "meta.json").read_text())


def _put_meta(d: Path, meta: object) -> None:
    (d / "meta.json").write_text(json.dumps(meta))


def _edit_meta(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        meta = _meta(d)
        fn(meta)
        _put_meta(d, meta)

    return edit


def _set_token(d: Path, shard: int, index: int, value: int, dtype: str = "<u2") -> None:
    f = d / f"shard-{shard:05d}.bin"
    ids = np.fromfile(f, dtype=dtype)
    ids[index] = value
    f.write_bytes(ids.tobytes())  # the same size: only a content check sees it


def _strip_checksums(meta: dict) -> None:
    """What a dataset prepared by an older hpcdist looks like."""
    meta.pop("max_id", None)
    for s in meta["shards"]:
        s.pop("sha256", None)
        s.pop("max_id", None)


def _as_uint32(meta: dict) -> None:
    """meta.json says uint32 over the uint16 shards, every count halved so the sizes agree."""
    meta["dtype"] = "uint32"
    meta["shard_tokens"] //= 2
    for s in meta["shards"]:
        s["tokens"] //= 2
        s.pop("max_id", None)
    meta["num_tokens"] = sum(s["tokens"] for s in meta["shards"])


def _shard_link(d: Path) -> None:
    target = d.parent / f"{d.name}-elsewhere.bin"
    shutil.copy(d / "shard-00001.bin", target)
    (d / "shard-00001.bin").unlink()
    (d / "shard-00001.bin").symlink_to(target)


def _replace(name: str, make: Callable[[Path], None]) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        (d / name).unlink()
        make(d / name)

    return edit


def _append(f: Path, data: bytes) -> None:
    with open(f, "ab") as fh:
        fh.write(data)


def _deep(n: int) -> str:
    return "[" * n + "]" * n


BOTH, NONE, TRAIN = {"train", "eval"}, set(), {"train"}  # eval also wants the run's own tokenizer
# name -> (edit, which of train and eval accept it, a fragment their refusal names)
EDITS: dict[str, tuple[Callable[[Path], None], set[str], str]] = {
    "intact": (lambda d: None, BOTH, ""),
    "extra-unknown-key": (_edit_meta(lambda m: m.update(comment="hand-made")), BOTH, ""),
    "no-checksums (older hpcdist)": (_edit_meta(_strip_checksums), BOTH, ""),
    "truncated shard": (lambda d: os.truncate(d / "shard-00002.bin", 100), NONE, "shard-00002.bin holds 100 bytes"),
    "grown shard": (lambda d: _append(d / "shard-00001.bin", b"\0\0"), NONE, "shard-00001.bin holds"),
    "same-size byte flip": (lambda d: _set_token(d, 2, 5, 97), NONE, "shard-00002.bin: its sha256"),
    "id 60000 where no window reads": (lambda d: _set_token(d, 3, SHARD - 1, 60000), NONE, "token id 60000"),
    "id past vocab, no checksums": (
        lambda d: (_edit_meta(_strip_checksums)(d), _set_token(d, 0, 7, 300)),
        NONE,
        "token id 300",
    ),
    "uint32 meta over uint16 shards": (_edit_meta(_as_uint32), NONE, "past vocab_size=258"),
    "dtype int8": (_edit_meta(lambda m: m.update(dtype="int8")), NONE, "dtype='int8'"),
    "negative count": (_edit_meta(lambda m: m["shards"][0].update(tokens=-5)), NONE, "shards[0].tokens=-5"),
    "huge count": (_edit_meta(lambda m: m["shards"][0].update(tokens=2**62)), NONE, "shards[0].tokens"),
    "num_tokens wrong": (_edit_meta(lambda m: m.update(num_tokens=10**9)), NONE, "num_tokens=1000000000"),
    "count edited to fit": (_edit_meta(lambda m: m["shards"][0].update(tokens=SHARD // 2)), NONE, "shard_tokens"),
    "missing shard": (lambda d: (d / "shard-00003.bin").unlink(), NONE, "shard-00003.bin"),
    "shard is a symlink": (_shard_link, NONE, "shard-00001.bin is a symbolic link"),
    "shard is a FIFO": (_replace("shard-00002.bin", os.mkfifo), NONE, "shard-00002.bin is a FIFO"),
    "shard is a directory": (_replace("shard-00000.bin", Path.mkdir), NONE, "shard-00000.bin is a directory"),
    "shard name escapes": (_edit_meta(lambda m: m["shards"][0].update(name="../../etc/passwd")), NONE, "plain file"),
    "duplicate shard": (_edit_meta(lambda m: m["shards"].__setitem__(1, m["shards"][0])), NONE, "twice"),
    "max_id past vocab": (_edit_meta(lambda m: m["shards"][1].update(max_id=70000)), NONE, "up to 70000"),
    "sha256 garbage": (_edit_meta(lambda m: m["shards"][1].update(sha256="xyz")), NONE, "sha256='xyz'"),
    "meta garbage bytes": (lambda d: (d / "meta.json").write_bytes(os.urandom(512)), NONE, "not valid JSON"),
    "meta huge": (lambda d: os.truncate(d / "meta.json", 2**30), NONE, "larger than"),
    "meta deeply nested": (lambda d: (d / "meta.json").write_text(_deep(100_000)), NONE, "not valid JSON"),
    "meta a list": (lambda d: _put_meta(d, [1, 2]), NONE, "JSON list"),
    "meta wrong types": (_edit_meta(lambda m: m.update(vocab_size="258", shards={"a": 1})), NONE, "vocab_size='258'"),
    "meta vocab_size 0": (_edit_meta(lambda m: m.update(vocab_size=0)), NONE, "vocab_size=0"),
    "vocab past dtype": (_edit_meta(lambda m: m.update(vocab_size=70000)), NONE, "does not fit dtype=uint16"),
    "bos past vocab": (_edit_meta(lambda m: m.update(bos_id=999)), NONE, "bos_id=999"),
    "format 2": (_edit_meta(lambda m: m.update(format=2)), NONE, "format=2"),
    "no shards": (_edit_meta(lambda m: m.update(shards=[], num_tokens=0)), NONE, "too few"),
    "meta is a FIFO": (_replace("meta.json", os.mkfifo), NONE, "meta.json is a FIFO"),
    "meta is a symlink": (_replace("meta.json", lambda p: p.symlink_to("/etc/hostname")), NONE, "symbolic link"),
    "meta is a directory": (_replace("meta.json", Path.mkdir), NONE, "meta.json is a directory"),
    "tokenizer kind unknown": (_edit_meta(lambda m: m["tokenizer"].update(kind="evil")), TRAIN, ""),
    "tokenizer file escapes": (
        _edit_meta(lambda m: m["tokenizer"].update(kind="hf", files={"../../../etc/passwd": "0" * 64})),
        TRAIN,
        "",
    ),
}


@pytest.fixture(scope="session")
def edited(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("edited")
    out = {}
    for k, (name, (edit, _, _)) in enumerate(EDITS.items()):
        d = _copy(base, root / f"case{k:02d}")
        edit(d)
        out[name] = d
    return out


def test_edited_datasets_through_every_reader(
    edited: dict[str, Path], checkpoint: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """At least 25 edited datasets x train, eval, config, prepare --tokenizer, generate --tokenizer: exit 0 or one
    line with exit 2; never a traceback or 'unexpected error', never past the bound; the accepted ones train and
    evaluate, the damaged ones are refused by train and eval naming the problem."""
    assert len(EDITS) >= 25
    (tmp_path / "in.txt").write_text("some text to prepare " * 20)
    slowest = (0.0, "")
    failures = []
    for k, (name, d) in enumerate(edited.items()):
        _, accepts, fragment = EDITS[name]
        config = ["config", ROOT / "configs/demo.yaml", *SMALL, "data.source=files", f"data.path={d}"]
        readers = {
            "train": _train_args(tmp_path / f"run{k}", d),
            "eval": ["eval", checkpoint, "--data", d, "--batches", "1", "--batch-size", "2"],
            "config": [*config, "model.vocab_size=auto"],
            "prepare": ["prepare", tmp_path / "in.txt", "--tokenizer", d, "--out", tmp_path / f"p{k}", "--workers=1"],
            "generate": ["generate", checkpoint, "--prompt", "x", "--max-new-tokens", "2", "--tokenizer", d],
        }
        for reader, argv in readers.items():
            rc, text, seconds = _cli(capfd, *argv)
            slowest = max(slowest, (seconds, f"{reader} on {name!r}"))
            problem = None
            if rc == -1:
                problem = f"ran past {RUN_BOUND_S} s"
            elif "Traceback" in text or "unexpected error" in text:
                problem = "a traceback"
            elif rc not in (0, 2):
                problem = f"exit {rc}"
            elif rc == 2 and len([ln for ln in text.splitlines() if ln.startswith("hpcdist:")]) != 1:
                problem = "not one line"
            elif reader in ("train", "eval") and (rc == 0) != (reader in accepts):
                problem = f"{'refused' if rc else 'accepted'} (exit {rc})"
            elif reader in ("train", "eval") and rc and not accepts and fragment not in text:
                problem = f"the message does not say {fragment!r}"
            if problem:
                failures.append(f"{reader} on {name!r}: {problem}: {text.strip()[-400:]}")
    assert not failures, "\n".join(failures)
    print(f"{len(EDITS)} edited datasets x 5 readers; slowest {slowest[0]:.1f} s ({slowest[1]})")


# ------------------------------------------------------------------------------------------------- item 5


def test_prepare_refuses_to_replace_another_dataset(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """`prepare B --out DIR_OF_A` deleted dataset A (a new fingerprint removed meta.json and every
    shard). Now: refused in one line, A untouched; the same preparation continues; --overwrite replaces it."""
    (tmp_path / "a.txt").write_text("aaaa " * 2000)
    (tmp_path / "b.txt").write_text("bbbb " * 3000)
    out = tmp_path / "A"
    assert _cli(capfd, "prepare", tmp_path / "a.txt", "--out", out, "--workers", "1")[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    rc, text, _ = _cli(capfd, "prepare", tmp_path / "b.txt", "--out", out, "--workers", "1")
    assert rc == 2 and "--overwrite" in text and "is not empty" in text and "Traceback" not in text, text
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before  # dataset A as it was
    rc, text, _ = _cli(capfd, "prepare", tmp_path / "a.txt", "--out", out, "--workers", "1")
    assert rc == 0 and "already up to date" in text
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("precious")
    rc, text, _ = _cli(capfd, "prepare", tmp_path / "a.txt", "--out", tmp_path / "mine", "--workers", "1")
    assert rc == 2 and "notes.txt" in text, text
    (tmp_path / "left").mkdir()
    (tmp_path / "left" / "tokenizer").mkdir()  # what an earlier prepare leaves before its first shard: no one's
    assert _cli(capfd, "prepare", tmp_path / "a.txt", "--out", tmp_path / "left", "--workers", "1")[0] == 0
    rc, text, _ = _cli(capfd, "prepare", tmp_path / "b.txt", "--out", out, "--workers", "1", "--overwrite")
    assert rc == 0, text
    assert _meta(out)["num_tokens"] == 15001


def test_an_interrupted_preparation_continues_but_another_one_is_refused(tmp_path: Path) -> None:
    from hpcdist.data import prepare as prepare_mod
    from hpcdist.data.prepare import PrepareRefused

    (tmp_path / "a.txt").write_text("a" * 5000)
    (tmp_path / "b.txt").write_text("b" * 5000)
    out = tmp_path / "ds"
    real = prepare_mod.atomic_write
    calls = []

    def die_on_third_shard(path: Path, data: object, **kw: object) -> Path:
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(path, data, **kw)

    prepare_mod.atomic_write = die_on_third_shard
    try:
        with pytest.raises(KeyboardInterrupt):
            prepare_shards([tmp_path / "a.txt"], out, shard_tokens=1000)
    finally:
        prepare_mod.atomic_write = real
    with pytest.raises(PrepareRefused, match="unfinished preparation"):
        prepare_shards([tmp_path / "b.txt"], out, shard_tokens=1000)
    prepare_shards([tmp_path / "a.txt"], out, shard_tokens=1000)  # its own: continued
    assert _meta(out)["num_tokens"] == 5001


# ------------------------------------------------------------------------------------------------- item 6


def test_prepare_records_each_shards_sha256_and_largest_id(base: Path) -> None:
    meta = _meta(base)
    for s in meta["shards"]:
        ids = np.fromfile(base / s["name"], dtype="<u2")
        assert s["sha256"] == hashlib.sha256(ids.tobytes()).hexdigest()
        assert s["max_id"] == int(ids.max()) < meta["vocab_size"]


def test_meta_json_is_written_by_the_module_that_reads_it(base: Path, tmp_path: Path) -> None:
    """One module owns meta.json: what a preparation writes is what the readers accept, and a document
    they would refuse is never written (a writer's bug shows at once, not on every rank at the next run)."""
    doc = _meta(base)
    written = write_meta(tmp_path, {k: v for k, v in doc.items() if k != "format"})
    assert _meta(tmp_path) == doc  # the same bytes' worth: format first, the fields as given
    assert load_meta(tmp_path).shards == written.shards
    bad = {**doc, "num_tokens": doc["num_tokens"] + 1}
    bad.pop("format")
    withdraw_meta(tmp_path)
    with pytest.raises(ValueError, match=r"refusing to write an invalid meta\.json.*num_tokens"):
        write_meta(tmp_path, bad)
    assert not (tmp_path / "meta.json").exists()


def test_a_tokenizer_producing_ids_past_its_vocabulary_writes_no_shard(tmp_path: Path) -> None:
    """An id past the vocabulary is refused where it is made too (a uint16 shard would wrap it silently)."""
    from hpcdist.data import ByteTokenizer

    class Liar(ByteTokenizer):
        def encode(self, text, *, bos=False, eos=True):  # type: ignore[no-untyped-def]
            return super().encode(text, bos=bos, eos=eos).astype(np.int64) + 65_536

    (tmp_path / "t.txt").write_text("hello")  # the largest id: "o" (111) + 65,536
    with pytest.raises(ValueError, match="produced token id 65647, past its vocab_size=258"):
        prepare_shards([tmp_path / "t.txt"], tmp_path / "ds", tokenizer=Liar())
    assert not list((tmp_path / "ds").glob("shard-*"))


def test_a_bad_id_in_a_window_never_drawn_is_named_before_step_1(
    base: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Id 60000 in a byte-level shard (vocab 258) where no window reads it trained with exit 0."""
    d = _copy(base, tmp_path / "ds")
    _set_token(d, 3, SHARD - 1, 60000)  # token 1023: past the shard's last 33-token window
    run = tmp_path / "run"
    rc, text, _ = _cli(capfd, *_train_args(run, d, "train.steps=2"))
    assert rc == 2, text
    lines = [ln for ln in text.splitlines() if ln.startswith("hpcdist:")]
    assert len(lines) == 1 and "shard-00003.bin" in lines[0] and "token id 60000" in lines[0], text
    metrics = run / "metrics.jsonl"
    assert not metrics.exists() or '"step"' not in metrics.read_text()  # not one step trained


def test_eval_names_the_bad_shard_instead_of_an_index_error(
    base: Path, checkpoint: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """`hpcdist eval` on such a shard died with `unexpected error: IndexError`."""
    d = _copy(base, tmp_path / "ds")
    _set_token(d, 0, 3, 60000)  # in the first window eval reads
    rc, text, _ = _cli(capfd, "eval", checkpoint, "--data", d, "--batches", "1", "--batch-size", "2")
    assert rc == 2 and "unexpected error" not in text, text
    assert "shard-00000.bin" in text and "token id 60000" in text


def test_uint32_meta_over_uint16_shards_is_refused(base: Path, tmp_path: Path) -> None:
    """A meta.json saying uint32 over uint16 shards (counts adjusted) read garbage ids."""
    d = _copy(base, tmp_path / "ds")
    _edit_meta(_as_uint32)(d)
    from hpcdist.config import DataError

    with pytest.raises(DataError, match="past vocab_size=258"):
        TokenDataset(d, 32)


def test_a_dataset_without_checksums_still_loads_with_a_note(
    base: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    d = _copy(base, tmp_path / "ds")
    _edit_meta(_strip_checksums)(d)
    with caplog.at_level("WARNING", logger="hpcdist"):
        ds = TokenDataset(d, 32)
    assert len(ds) == 4 * (SHARD // 33)
    assert "before hpcdist recorded shard checksums" in caplog.text


def test_a_shard_changed_after_the_check_never_reaches_the_model(base: Path, tmp_path: Path) -> None:
    """The defence behind the start-up check: each window's ids are compared with the vocabulary when read."""
    from hpcdist.config import DataError

    d = _copy(base, tmp_path / "ds")
    ds = TokenDataset(d, 32)
    f = d / "shard-00000.bin"
    with open(f, "r+b") as fh:  # in place: the mapping sees it
        fh.seek(2 * 5)
        fh.write(np.array([60000], dtype="<u2").tobytes())
    with pytest.raises(DataError, match="token id 60000"):
        ds[0]


def test_a_large_dataset_checks_each_shard_when_first_mapped(
    base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over EAGER_VERIFY_BYTES the start-up check reads nothing (sizes and meta.json only); each shard is read and
    checked the first time it is mapped, before any of its windows is returned."""
    from hpcdist.config import DataError
    from hpcdist.data import shards

    monkeypatch.setattr(shards, "EAGER_VERIFY_BYTES", 0)
    d = _copy(base, tmp_path / "ds")
    _set_token(d, 2, SHARD - 1, 60000)  # in no window, but shard 2 is bad
    ds = TokenDataset(d, 32)  # no content read yet
    per_shard = SHARD // 33
    assert ds[0].max() < 258 and ds[per_shard].max() < 258  # shards 0 and 1 check out
    with pytest.raises(DataError, match=r"shard-00002\.bin: holds token id 60000"):
        ds[2 * per_shard]


def test_verification_cost(tmp_path: Path) -> None:
    """What the start-up check costs: every shard read once (sha256 + max), reported in MB/s."""
    from hpcdist.data import shards

    d = tmp_path / "ds"
    rng = np.random.default_rng(0)
    (tmp_path / "t.bin").write_bytes(rng.integers(0, 256, size=32 << 20, dtype=np.uint8).tobytes())
    prepare_shards([tmp_path / "t.bin"], d, shard_tokens=4 << 20)
    shards._VERIFIED.clear()
    t0 = time.perf_counter()
    TokenDataset(d, 1024)
    seconds = time.perf_counter() - t0
    mb = sum(p.stat().st_size for p in d.glob("shard-*.bin")) / 1e6
    print(f"start-up verification: {mb:.0f} MB in {seconds:.2f} s = {mb / seconds:.0f} MB/s")
    t0 = time.perf_counter()
    TokenDataset(d, 1024)  # the same files again in this process: remembered
    assert time.perf_counter() - t0 < seconds / 5


# ------------------------------------------------------------------------------------------------- item 9


def _truncated_gz(root: Path) -> list[str]:
    data = gzip.compress("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(5000)).encode())
    (root / "t.jsonl.gz").write_bytes(data[: len(data) // 2])
    return [str(root / "t.jsonl.gz")]


def _deep_json(root: Path) -> list[str]:
    (root / "d.jsonl").write_text(_deep(100_000) + "\n")
    return [str(root / "d.jsonl")]


def _surrogate(root: Path) -> list[str]:
    (root / "s.jsonl").write_text('{"text": "a\\ud800b"}\n')
    return [str(root / "s.jsonl")]


def _fake_datasets_dir(root: Path) -> list[str]:
    (root / "fake").mkdir()
    (root / "fake" / "state.json").write_text("{}")
    (root / "fake" / "dataset_info.json").write_text("{}")
    return [str(root / "fake")]


def _absolute_glob(root: Path) -> list[str]:
    (root / "x.txt").write_text("x")
    return [str(root), "--glob", "/etc/*"]


def _long_line(root: Path) -> list[str]:
    from hpcdist.data import corpora

    with open(root / "l.jsonl", "wb") as fh:  # no newline within the bound
        fh.write(b'{"text": "' + b"a" * (corpora.MAX_LINE_BYTES + 10))
    return [str(root / "l.jsonl")]


@pytest.mark.parametrize(
    "make, fragment",
    [
        (_truncated_gz, "truncated gzip"),
        (_deep_json, "nested too deeply"),
        (_fake_datasets_dir, "not a readable datasets directory"),
        (_absolute_glob, "--glob '/etc/*'"),
        (_long_line, "a line longer than 256 MiB"),
    ],
    ids=["truncated-gz", "nested-100000", "fake-datasets-dir", "absolute-glob", "line-past-bound"],
)
def test_hostile_corpora_are_one_line(
    make: Callable[[Path], list[str]], fragment: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Each of these printed "unexpected error ... please report it"."""
    rc, text, _ = _cli(capfd, "prepare", *make(tmp_path), "--out", tmp_path / "out", "--workers", "1")
    assert rc == 2 and "unexpected error" not in text and fragment in text, text


@pytest.mark.parametrize("tokenizer", ["byte", "hf"])
def test_a_lone_surrogate_becomes_a_replacement_character(
    tokenizer: str, tmp_path: Path, bpe_corpus_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A "\\ud800" in a JSON line made the HF tokenizer raise TypeError ("unexpected error")."""
    spec = "byte" if tokenizer == "byte" else str(bpe_corpus_dir)
    rc, text, _ = _cli(
        capfd, "prepare", *_surrogate(tmp_path), "--tokenizer", spec, "--out", tmp_path / "o", "--workers", "1"
    )
    assert rc == 0, text
    if tokenizer == "byte":
        ids = np.fromfile(tmp_path / "o" / "shard-00000.bin", dtype="<u2")
        assert bytes(ids[:-1].astype(np.uint8)).decode() == "a\ufffdb"


def test_tiny_shards_cost_linear_time(tmp_path: Path) -> None:
    """--shard-tokens 1 ran past 60 s: progress.json was rewritten whole after every shard (quadratic)
    and every shard was fsynced. 5,000 one-token shards now take a few seconds."""
    (tmp_path / "t.txt").write_text("x" * 10_000)
    t0 = time.perf_counter()
    with _bounded(60):
        prepare_shards([tmp_path / "t.txt"], tmp_path / "ds", shard_tokens=1, max_tokens=5_000)
    seconds = time.perf_counter() - t0
    assert len(_meta(tmp_path / "ds")["shards"]) == 5_000
    assert seconds < 20, f"{seconds:.1f} s"
    print(f"5,000 one-token shards in {seconds:.1f} s")


_STRESS = textwrap.dedent(
    """
    import faulthandler, json, sys, time
    from pathlib import Path
    from hpcdist.data import ByteTokenizer, prepare as P
    P.BATCH_BYTES = 96 << 10  # several batches, each larger than a pipe holds (64 KiB): the deadlock's condition
    root = Path(sys.argv[1])
    src = root / "in.jsonl"
    src.write_text("".join(json.dumps({"text": f"doc {i} " * 2000}) + "\\n" for i in range(40)))
    times = []
    for i in range(50):
        faulthandler.dump_traceback_later(20, exit=True)  # a hang: the stacks, then exit 1
        t = time.perf_counter()
        P.prepare_corpus([src], root / f"o{i}", tokenizer=ByteTokenizer(), shard_tokens=50_000,
                         max_tokens=120_000, workers=2)
        times.append(time.perf_counter() - t)
        faulthandler.cancel_dump_traceback_later()
    print(f"50 runs, slowest {max(times):.2f} s, total {sum(times):.1f} s")
    """
)


def test_prepare_with_workers_stopped_by_max_tokens_never_hangs(tmp_path: Path) -> None:
    """--workers 2 --max-tokens hung about 1 run in 6 (Pool.terminate() with batches in flight). 50 runs
    in a row, each batch bigger than a pipe holds and several in flight when --max-tokens stops the reading."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _STRESS, str(tmp_path)], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout.strip())
