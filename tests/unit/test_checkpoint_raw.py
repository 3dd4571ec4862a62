"""The shards' tensors as raw bytes (no torch.save record), read straight into the model's tensors; the
encoding recorded in the manifest; old (torch.save'd) checkpoints still load; a wrong size is damage. One process,
plain tensors: each test takes well under a second."""

from __future__ import annotations

import hashlib
import json
import pickle
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hpcdist.checkpoint import codec as ckpt_codec
from hpcdist.checkpoint import manifest as ckpt_manifest
from hpcdist.checkpoint import staging as ckpt_staging
from hpcdist.checkpoint.manager import CheckpointManager
from hpcdist.checkpoint.manifest import MANIFEST, TENSOR_ENCODING
from hpcdist.checkpoint.names import DAMAGED, MARKER
from hpcdist.checkpoint.state import Checkpointable


def _state(tensors: dict[str, dict[str, Any]], step: int = 0) -> Checkpointable:
    return Checkpointable(
        dcp_state=lambda: tensors,
        load_dcp_state=lambda s: None,
        trainer_state=lambda: {"step": step},
        load_trainer_state=lambda s: None,
    )


def _tensors(seed: int) -> dict[str, dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(64, 32, generator=g),
            "h": torch.randn(7, 5, generator=g).to(torch.bfloat16),
            "empty": torch.zeros(0, 4),
        },
        "optim": {"step": torch.tensor(float(seed)), "m": torch.randn(4096, generator=g), "lr": 0.5 + seed},
    }


def _zeros_like(tensors: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        part: {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0.0 for k, v in d.items()}
        for part, d in tensors.items()
    }


def _assert_equal(got: dict[str, dict[str, Any]], want: dict[str, dict[str, Any]]) -> None:
    for part, d in want.items():
        for k, v in d.items():
            if isinstance(v, torch.Tensor):
                assert got[part][k].dtype == v.dtype and torch.equal(got[part][k], v), (part, k)
            else:
                assert got[part][k] == v, (part, k)


def test_tensors_are_written_as_raw_bytes_and_read_straight_into_the_model(tmp_path: Path) -> None:
    """Each tensor item of a shard is the tensor's own bytes at the offset DCP's metadata records (it was a
    torch.save zip record), the manifest says so, and a load fills the model's own tensors in place."""
    saved = _tensors(1)
    path = CheckpointManager(tmp_path, rank=0, world_size=1).save(1, _state(saved, 1))
    assert path is not None
    assert json.loads((path / MANIFEST).read_text())[TENSOR_ENCODING] == "raw"
    storage = dcp.FileSystemReader(str(path)).read_metadata().storage_data
    w = next(info for index, info in storage.items() if index.fqn == "model.w")
    shard = (path / w.relative_path).read_bytes()
    assert shard[w.offset : w.offset + w.length] == saved["model"]["w"].numpy().tobytes()

    dest = _zeros_like(saved)
    pointers = {k: v.data_ptr() for k, v in dest["model"].items()}
    assert CheckpointManager(tmp_path, rank=0, world_size=1).restore("auto", _state(dest)) == path
    _assert_equal(dest, saved)
    assert {k: v.data_ptr() for k, v in dest["model"].items()} == pointers  # in place, no new tensors


def test_a_checkpoint_written_with_torch_save_records_still_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A checkpoint from before the raw encoding: DCP's own writer (torch.save per tensor), a manifest without
    the encoding field. It loads, exactly (the field's absence says torch_save; the bytes are never guessed from)."""
    saved = _tensors(2)
    with monkeypatch.context() as m:  # the writer as it was: DCP's FileSystemWriter's data path
        m.setattr(ckpt_codec.HashingWriter, "_write_data", dcp.FileSystemWriter._write_data)
        path = CheckpointManager(tmp_path, rank=0, world_size=1).save(1, _state(saved, 1))
    assert path is not None
    manifest = json.loads((path / MANIFEST).read_text())
    del manifest[TENSOR_ENCODING]  # as written before the field existed
    (path / MANIFEST).write_text(json.dumps(manifest))
    dest = _zeros_like(saved)
    assert CheckpointManager(tmp_path, rank=0, world_size=1).restore("auto", _state(dest)) == path
    _assert_equal(dest, saved)
    assert not (path / DAMAGED).exists()


def _rewrite_metadata(path: Path, change: Any) -> None:
    """Alter .metadata (our own test file: unpickling it is fine) and give the manifest its new digest, so only the
    reader's own checks can catch the change."""
    meta_file = path / ".metadata"
    metadata = pickle.loads(meta_file.read_bytes())
    change(metadata)
    meta_file.write_bytes(pickle.dumps(metadata))
    manifest = json.loads((path / MANIFEST).read_text())
    data = meta_file.read_bytes()
    manifest["files"][".metadata"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("damage", ["length-short", "length-long", "shape", "truncated", "encoding"])
def test_a_raw_item_whose_size_does_not_match_is_damage_and_the_previous_checkpoint_loads(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Sizes from the file are checked against the metadata's dtype and shape and the destination before anything is
    read or allocated: an item's length that disagrees, a shape that disagrees, a shard cut short inside a raw
    item, an unknown encoding: each demotes the checkpoint (never a crash, never an allocation from the file), and
    the previous one loads whole."""
    older, newer = _tensors(3), _tensors(4)
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1, keep_last=5, verify="none")
    mgr.save(1, _state(older, 1))
    path = mgr.save(2, _state(newer, 2))
    assert path is not None
    storage = dcp.FileSystemReader(str(path)).read_metadata().storage_data
    m = next(index for index in storage if index.fqn == "optim.m")

    if damage in ("length-short", "length-long"):
        delta = -4 if damage == "length-short" else 1 << 40  # the second: an allocation of a terabyte if trusted

        def change(md: Any) -> None:
            md.storage_data[m].length += delta

        _rewrite_metadata(path, change)
    elif damage == "shape":

        def change(md: Any) -> None:
            md.state_dict_metadata["optim.m"].chunks[0].sizes = torch.Size([2048])

        _rewrite_metadata(path, change)
    elif damage == "truncated":
        info = storage[m]
        shard = path / info.relative_path
        shard.write_bytes(shard.read_bytes()[: info.offset + info.length // 2])
    else:
        manifest = json.loads((path / MANIFEST).read_text())
        manifest[TENSOR_ENCODING] = "raw-v9"
        (path / MANIFEST).write_text(json.dumps(manifest))

    dest = _zeros_like(older)
    loaded = CheckpointManager(tmp_path, rank=0, world_size=1, keep_last=5, verify="none").restore("auto", _state(dest))
    assert loaded is not None and loaded.name == "step-00000001", caplog.text
    assert (path / DAMAGED).is_file() and not (path / MARKER).exists()
    _assert_equal(dest, older)


def test_staging_copies_on_threads_in_chunks_and_is_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """The async save's staging copy runs on several threads, big tensors split in chunks; every kind
    of tensor (bf16, a scalar, an empty one, a non-contiguous view) lands exactly, and a later stage refills the same
    buffers (no new allocation)."""
    monkeypatch.setattr(ckpt_staging.Staging, "CHUNK", 256)  # bytes: the 64 x 32 fp32 tensor becomes 32 chunks
    stager = ckpt_staging.Staging(threads=3)
    try:
        state = _tensors(5)
        state["model"]["t"] = torch.randn(16, 8).t()  # non-contiguous
        staged = stager.stage(state)
        _assert_equal(staged, state)
        buffers = {k: v.data_ptr() for k, v in staged["model"].items() if v.numel()}
        for part in state.values():
            for v in part.values():
                if isinstance(v, torch.Tensor) and v.numel():
                    v.add_(1)
        again = stager.stage(state)
        _assert_equal(again, state)
        assert {k: v.data_ptr() for k, v in again["model"].items() if v.numel()} == buffers
    finally:
        stager.close()


def test_staging_buffers_are_allocated_before_the_first_async_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shared-memory staging buffers cost seconds per GB to allocate (every page faulted in). The trainer calls
    ``prepare_staging`` after its first optimizer step: the allocation then runs beside the following steps (the
    call returns while it is still going on; a save that comes first waits for it), the save allocates nothing
    more, and what it wrote is the state."""
    allocations: list[int] = []
    real, release = ckpt_staging._host_buffers, threading.Event()

    def held(*args: Any, **kwargs: Any) -> Any:
        allocations.append(1)
        assert release.wait(60)  # the allocation goes on while the caller trains
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt_staging, "_host_buffers", held)
    saved = _tensors(6)
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1, async_save=True)
    try:
        preparing = mgr.prepare_staging(_state(saved, 1).dcp_state)
        assert preparing is not None and not preparing.done()  # returned before the buffers exist
        assert mgr.prepare_staging(_state(saved, 1).dcp_state) is None  # once
        release.set()
        assert preparing.result(timeout=60) > 0 and allocations == [1]
        path = mgr.save(1, _state(saved, 1))
        assert mgr.wait() and path is not None and allocations == [1]
    finally:
        mgr.close()
    dest = _zeros_like(saved)
    assert CheckpointManager(tmp_path, rank=0, world_size=1).restore("auto", _state(dest)) == path
    _assert_equal(dest, saved)


def test_an_async_saves_copy_runs_beside_the_next_step_and_holds_the_saved_step(
    small_cfg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An async save blocked the loop for its whole staging copy (0.06-0.11 of a sync save, the copy's
    memory bandwidth). The copy now runs beside the next step's forward and backward, which change none of the
    state, and the loop waits for it only before its optimizer step (``staging_fence``, torchtitan's
    ``maybe_wait_for_staging``). With the copy slowed to 1 s: no save blocks the loop for it, the loop waits at
    the fence instead, and every step's checkpoint holds exactly that step's state (a sync run's shard bytes), not
    the next step's: the fence comes before the optimizer step changes it."""
    from hpcdist.env import from_environ
    from hpcdist.trainer import Trainer

    over = ("train.steps=3", "checkpoint.every_steps=2", "checkpoint.save_final=true", "checkpoint.write_threads=1")
    env = from_environ({}, cuda_available=False)
    sync = Trainer(small_cfg(*over, run_dir=tmp_path / "sync"), env)
    sync.train()
    sync.ckpt.manager.close()

    slow_copy, real_copy = 1.0, ckpt_staging._copy_all
    monkeypatch.setattr(
        ckpt_staging, "_copy_all", lambda pairs, stream: (time.sleep(slow_copy), real_copy(pairs, stream))
    )
    trainer = Trainer(small_cfg(*over, "checkpoint.async_save=true", run_dir=tmp_path / "async"), env)
    saves: list[float] = []
    fences: list[float] = []
    save, fence = trainer.ckpt.manager.save, trainer.ckpt.manager.staging_fence

    def timed_save(step: int, state: Checkpointable) -> Path | None:
        t0 = time.perf_counter()
        path = save(step, state)
        saves.append(time.perf_counter() - t0)
        return path

    def recorded_fence() -> float:
        fences.append(fence())
        return fences[-1]

    monkeypatch.setattr(trainer.ckpt.manager, "save", timed_save)
    monkeypatch.setattr(trainer.ckpt.manager, "staging_fence", recorded_fence)
    trainer.train()
    trainer.ckpt.manager.close()
    # the buffers were made after step 1 (prepare_staging); step 3's save first waits for step 2's to be complete
    assert len(saves) == 2 and saves[0] < slow_copy, saves
    assert max(fences) >= slow_copy / 2, fences  # step 3 waited for step 2's copy before its optimizer step
    for step in (2, 3):
        shards = {}
        for name in ("sync", "async"):
            files = json.loads((tmp_path / name / "checkpoints" / f"step-{step:08d}" / MANIFEST).read_text())["files"]
            shards[name] = {rel: e["sha256"] for rel, e in files.items() if rel.endswith(".distcp")}
        assert shards["sync"] and shards["async"] == shards["sync"], step


@pytest.mark.parametrize("name", [MANIFEST, "trainer_state.json"])
def test_an_oversized_record_in_a_checkpoint_is_damage_found_without_reading_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Standards (bound every read): a 3 GB sparse MANIFEST.json was read whole (3 GB allocated, 8 s, then
    "unparsable"), a 3 GB trainer_state.json hashed whole before its size was compared with the manifest's (8.7 s);
    a 1 TB one would have run the node out of memory or time. Now the manifest is read only up to its cap and a file
    whose size differs from the manifest's is not hashed: the step is demoted at once and the previous one loads."""
    reads: list[int] = []
    real_sha = ckpt_manifest.file_sha256
    monkeypatch.setattr(ckpt_manifest, "file_sha256", lambda p: (reads.append(Path(p).stat().st_size), real_sha(p))[1])
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1)
    first = mgr.save(1, _state(_tensors(1), 1))
    second = mgr.save(2, _state(_tensors(2), 2))
    assert first is not None and second is not None
    (second / name).unlink()
    with open(second / name, "wb") as f:
        f.truncate(1 << 40)  # 1 TB, sparse: nothing of it may be read
    dest = _zeros_like(_tensors(0))
    t0 = time.perf_counter()
    assert CheckpointManager(tmp_path, rank=0, world_size=1).restore("auto", _state(dest)) == first
    assert time.perf_counter() - t0 < 30 and max(reads, default=0) < 1 << 30, reads
    _assert_equal(dest, _tensors(1))
    assert (second / DAMAGED).is_file()
