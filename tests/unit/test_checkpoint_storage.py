"""The shared tier's decisions on its step directories (listing, markers, demotion, set-aside, pruning, the refusal
when only damaged steps are left) against a POSIX directory and the in-memory storage alike: the Storage methods
themselves, and the CheckpointManager running on each storage (save, list, restore, prune, set aside, demote,
trust). With MemoryStorage the DCP shards are still written by path (see hpcdist.checkpoint.storage); every other
file of a step lives in the storage only."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from hpcdist.checkpoint.errors import CheckpointSaveError, UntrustedCheckpoint
from hpcdist.checkpoint.manager import CheckpointManager
from hpcdist.checkpoint.manifest import MANIFEST
from hpcdist.checkpoint.names import DAMAGED, MARKER, step_dir
from hpcdist.checkpoint.state import STATE_FILE
from hpcdist.checkpoint.storage import (
    MemoryStorage,
    PosixStorage,
    Storage,
    damaged_steps,
    nearly_full,
    prune,
    read_step_record,
    refuse_if_only_damaged,
)
from hpcdist.config.loader import ConfigError
from tests.checkpointing import STORAGES, TinyState, make_storage


def _add(storage: Storage, step: int, *files: str) -> Path:
    """A step directory holding ``files`` (each written through the storage, MARKER last, as a save does)."""
    d = step_dir(storage.root, step)
    storage.create(d)
    for name in sorted(set(files) - {MARKER}):
        with storage.open_writer(d, name) as f:
            f.write(b"{}")
    if MARKER in files:
        storage.write_marker(d, {"step": step})
    return d


@pytest.fixture(params=STORAGES)
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    return make_storage(request.param, tmp_path / "ckpt")


def test_steps_list_complete_and_incomplete_directories(storage: Storage) -> None:
    for step in (3, 1):
        _add(storage, step, MARKER, "x.distcp")
    crashed = _add(storage, 5, "x.distcp")
    assert [s for s, _ in storage.steps()[0]] == [1, 3] and storage.steps()[1] == [crashed]
    assert storage.has(step_dir(storage.root, 3), MARKER) and not storage.has(crashed, MARKER)


def test_a_demoted_step_is_listed_incomplete_and_kept_by_pruning(storage: Storage) -> None:
    for step in (1, 2, 3, 4):
        _add(storage, step, MARKER)
    storage.demote(step_dir(storage.root, 2))
    assert damaged_steps(storage) == [step_dir(storage.root, 2)]
    _add(storage, 0, "x.distcp")  # a crashed save older than the newest complete one: garbage
    prune(storage, keep_last=2)
    assert [s for s, _ in storage.steps()[0]] == [3, 4]
    assert storage.steps()[1] == [step_dir(storage.root, 2)] and storage.has(step_dir(storage.root, 2), DAMAGED)


def test_a_step_set_aside_is_no_step_any_more(storage: Storage) -> None:
    d = _add(storage, 7, MARKER)
    aside = storage.set_aside(d, "abandoned")
    assert aside.name.startswith("step-00000007.abandoned-") and storage.exists(aside) and not storage.exists(d)
    assert storage.steps() == ([], [])


def test_only_damaged_steps_refuse_a_fresh_start(storage: Storage) -> None:
    refuse_if_only_damaged(storage)  # nothing at all: a fresh start is fine
    storage.demote(_add(storage, 4, MARKER))
    with pytest.raises(ConfigError, match=r"only damaged ones \(step-00000004;"):
        refuse_if_only_damaged(storage)


def test_a_full_disk_is_the_storages_problem(tmp_path: Path) -> None:
    assert nearly_full(MemoryStorage(tmp_path, free=1 << 20)) and nearly_full(MemoryStorage(tmp_path, free=None))
    assert not nearly_full(MemoryStorage(tmp_path)) and not nearly_full(PosixStorage(tmp_path))


def test_a_record_is_written_whole_or_not_at_all_and_read_bounded(storage: Storage) -> None:
    d = _add(storage, 1)
    with storage.open_writer(d, "rng/rank-00000.pt") as f:
        f.write(b"first")
    with pytest.raises(RuntimeError), storage.open_writer(d, "rng/rank-00000.pt") as f:
        f.write(b"half of the second")
        raise RuntimeError("the writer died")
    assert read_step_record(storage, d, "rng/rank-00000.pt") == b"first"  # the failed write left no trace
    assert storage.has(d, "rng/rank-00000.pt") and not storage.has(d, "rng/rank-00001.pt")
    with pytest.raises(ValueError, match="more than the 4 "):
        read_step_record(storage, d, "rng/rank-00000.pt", limit=4)
    with pytest.raises(FileNotFoundError):
        read_step_record(storage, d, STATE_FILE)
    with pytest.raises(FileExistsError):
        storage.create(d)


def test_a_posix_record_is_never_read_through_a_link(tmp_path: Path) -> None:
    storage = make_storage("posix", tmp_path / "ckpt")
    d = _add(storage, 1)
    (tmp_path / "elsewhere.json").write_text("{}")
    (d / STATE_FILE).symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(ValueError, match="is a link"):
        read_step_record(storage, d, STATE_FILE)


# ------------------------------------------------------------------------------ the manager on each storage


def _manager(storage: Storage, **kw: object) -> CheckpointManager:
    return CheckpointManager(storage.root, rank=0, world_size=1, verify="checksum", storage=storage, **kw)


def _save(mgr: CheckpointManager, *steps: int) -> dict[int, torch.Tensor]:
    """Save ``steps`` of a tiny model whose weights differ at each; {step: its weights}."""
    tiny, weights = TinyState(), {}
    for step in steps:
        tiny.step = step
        with torch.no_grad():
            tiny.w.weight.fill_(float(step))
        assert mgr.save(step, tiny.checkpointable()) == step_dir(mgr.root, step)
        weights[step] = tiny.w.weight.detach().clone()
    return weights


def _restore(mgr: CheckpointManager, resume: str = "auto") -> tuple[Path | None, TinyState]:
    tiny = TinyState()
    return mgr.restore(resume, tiny.checkpointable()), tiny


def _complete_steps(storage: Storage) -> list[int]:
    return [s for s, _ in storage.steps()[0]]


def test_the_manager_saves_lists_restores_and_prunes_through_the_storage(storage: Storage) -> None:
    mgr = _manager(storage, keep_last=2)
    weights = _save(mgr, 1, 2, 3)
    assert _complete_steps(storage) == [2, 3] and storage.steps()[1] == []  # step 1 pruned by the save of 3
    three = step_dir(storage.root, 3)
    records = (STATE_FILE, "rng/rank-00000.pt", MANIFEST, MARKER)
    assert all(storage.has(three, rel) for rel in records)  # the step's records: written through the storage
    if isinstance(storage, MemoryStorage):  # ... and only there: on disk, the DCP files alone
        assert not any((three / rel).exists() for rel in records) and (three / ".metadata").is_file()
    assert json.loads(read_step_record(storage, three, MARKER))["step"] == 3
    assert mgr.resolve("auto") == three
    path, tiny = _restore(_manager(storage))
    assert path == three and tiny.step == 3 and torch.equal(tiny.w.weight, weights[3])


def test_resuming_an_older_step_sets_the_newer_ones_aside_in_the_storage(
    storage: Storage, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    mgr = _manager(storage, keep_last=5)
    weights = _save(mgr, 1, 2, 3)
    capsys.readouterr()
    path, tiny = _restore(_manager(storage), str(step_dir(storage.root, 1)))
    assert path == step_dir(storage.root, 1) and tiny.step == 1 and torch.equal(tiny.w.weight, weights[1])
    out = capsys.readouterr().out + caplog.text  # the logger's stdout handler, or pytest's when it propagates
    assert "the newer step-00000002 is set aside as step-00000002.abandoned-" in out
    assert _complete_steps(storage) == [1] and not storage.exists(step_dir(storage.root, 3))
    weights |= _save(mgr, 2)  # the new line's step 2: no clash with the one set aside
    assert _complete_steps(storage) == [1, 2]
    path, tiny = _restore(_manager(storage))
    assert path == step_dir(storage.root, 2) and torch.equal(tiny.w.weight, weights[2])


def test_resume_none_sets_every_complete_step_aside_in_the_storage(storage: Storage) -> None:
    mgr = _manager(storage, keep_last=5)
    _save(mgr, 1, 2)
    assert _restore(_manager(storage), "none")[0] is None  # a fresh start: every complete step set aside
    assert storage.steps() == ([], []) and _restore(_manager(storage))[0] is None
    assert not storage.exists(step_dir(storage.root, 1)) and not storage.exists(step_dir(storage.root, 2))


def test_a_damaged_record_demotes_its_step_and_auto_resumes_the_previous(storage: Storage) -> None:
    mgr = _manager(storage, keep_last=5)
    weights = _save(mgr, 1, 2)
    two = step_dir(storage.root, 2)
    with storage.open_writer(two, STATE_FILE) as f:
        f.write(b'{"step": 2, "config"')  # torn: not JSON any more
    path, tiny = _restore(_manager(storage))
    assert path == step_dir(storage.root, 1) and torch.equal(tiny.w.weight, weights[1])
    assert storage.has(two, DAMAGED) and not storage.has(two, MARKER)
    assert damaged_steps(storage) == [two]
    _save(mgr, 2)  # a new save of the damaged step keeps the old one aside, as evidence
    assert _complete_steps(storage) == [1, 2] and damaged_steps(storage) == []
    storage.demote(step_dir(storage.root, 1))
    storage.demote(two)
    with pytest.raises(ConfigError, match="only damaged ones"):
        _restore(_manager(storage))


def test_a_failed_save_leaves_nothing_in_the_storage(storage: Storage) -> None:
    mgr = _manager(storage)
    _save(mgr, 1)

    def full() -> dict:
        raise OSError(28, "No space left on device")

    def bug() -> dict:
        raise TypeError("bad field")

    broken = TinyState().checkpointable()
    assert mgr.save(2, dataclasses.replace(broken, trainer_state=full)) is None  # training goes on
    assert not storage.exists(step_dir(storage.root, 2))
    with pytest.raises(CheckpointSaveError, match="not I/O"):
        mgr.save(3, dataclasses.replace(broken, trainer_state=bug))
    assert not storage.exists(step_dir(storage.root, 3)) and _complete_steps(storage) == [1]


def test_a_step_the_storage_does_not_trust_is_refused_and_kept(
    storage: Storage, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(_manager(storage), 1)
    monkeypatch.setattr(storage, "trust_problems", lambda path, trusted: [(str(path), "writable by others")])
    with pytest.raises(UntrustedCheckpoint, match="writable by others"):
        _restore(_manager(storage))
    with pytest.raises(UntrustedCheckpoint):
        _manager(storage).named(step_dir(storage.root, 1), "checkpoint.init_from")
    assert _complete_steps(storage) == [1] and damaged_steps(storage) == []  # not ours: never demoted
