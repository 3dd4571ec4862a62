"""The shared tier's decisions on its step directories (listing, markers, demotion, set-aside, pruning, the refusal
when only damaged steps are left) against a POSIX directory and the in-memory storage alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcdist.checkpoint.names import DAMAGED, MARKER, step_dir
from hpcdist.checkpoint.storage import (
    MemoryStorage,
    PosixStorage,
    Storage,
    damaged_steps,
    nearly_full,
    prune,
    refuse_if_only_damaged,
)
from hpcdist.config.loader import ConfigError


def _make(kind: str, root: Path) -> Storage:
    if kind == "posix":
        root.mkdir()
        return PosixStorage(root)
    return MemoryStorage(root)


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


@pytest.fixture(params=["posix", "memory"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    return _make(request.param, tmp_path / "ckpt")


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
