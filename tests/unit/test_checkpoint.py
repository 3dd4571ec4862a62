"""Checkpoint layout, completion marker, pruning and resume rules (one process, real DCP files)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from hpcdist.base import atomic
from hpcdist.checkpoint import codec as ckpt_codec
from hpcdist.checkpoint import errors as ckpt_errors
from hpcdist.checkpoint import load as ckpt_load
from hpcdist.checkpoint import manifest as ckpt_manifest
from hpcdist.checkpoint import names as ckpt_names
from hpcdist.checkpoint import staging as ckpt_staging
from hpcdist.checkpoint import state as ckpt_state
from hpcdist.checkpoint.manager import CheckpointManager
from hpcdist.checkpoint.manifest import MANIFEST
from hpcdist.checkpoint.names import MARKER, latest, list_checkpoints
from hpcdist.checkpoint.state import STATE_FILE
from hpcdist.checkpoint.storage import prune
from hpcdist.config import ConfigError
from hpcdist.trainer import Trainer
from tests.dist.harness import single
from tests.training import train


def _build(env, cfg):
    return Trainer(cfg, env)


def _train(env, cfg, until=None):
    """(the trainer, its TrainResult): this module's tests read both."""
    out = train(env, cfg, until, after=lambda t, r: {"trainer": t, "result": r})
    return out["trainer"], out["result"]


def test_layout_marker_and_keep_last(small_cfg) -> None:
    cfg = small_cfg("train.steps=5", "checkpoint.every_steps=1", "checkpoint.keep_last=2", "train.micro_batch_size=4")
    single(_train, cfg)
    complete, incomplete = list_checkpoints(cfg.checkpoint_dir)
    assert [s for s, _ in complete] == [4, 5] and not incomplete
    d = complete[-1][1]
    assert d.name == "step-00000005"
    assert (d / ".metadata").is_file() and list(d.glob("*.distcp"))
    assert json.loads((d / STATE_FILE).read_text())["step"] == 5
    assert json.loads((d / MARKER).read_text())["step"] == 5
    rng = torch.load(d / "rng" / "rank-00000.pt", weights_only=True)  # plain tensors: no pickle needed
    assert rng["cpu"].dtype == torch.uint8
    assert (Path(cfg.run.dir) / "config.yaml").is_file()


def test_incomplete_checkpoint_is_ignored_with_warning(small_cfg, capsys: pytest.CaptureFixture[str]) -> None:
    over = ("train.steps=6", "checkpoint.every_steps=2", "checkpoint.keep_last=5", "train.micro_batch_size=4")
    cfg = small_cfg(*over)
    _, straight = single(_train, cfg)
    newest = cfg.checkpoint_dir / "step-00000006"
    (newest / MARKER).unlink()  # as if the job died while writing step 6
    capsys.readouterr()

    assert latest(cfg.checkpoint_dir) == cfg.checkpoint_dir / "step-00000004"
    _, result = single(_train, cfg)
    out = capsys.readouterr().out
    assert "ignoring" in out and "step-00000006" in out and MARKER in out
    assert result.resumed_from.endswith("step-00000004")
    assert result.losses == {s: v for s, v in straight.losses.items() if s > 4}  # redone exactly
    assert (newest / MARKER).is_file()  # the save at step 6 replaced the broken directory


def test_explicit_resume_of_incomplete_checkpoint_is_refused(small_cfg) -> None:
    cfg = small_cfg("train.steps=2", "checkpoint.every_steps=2", "train.micro_batch_size=4")
    single(_train, cfg)
    d = cfg.checkpoint_dir / "step-00000002"
    (d / MARKER).unlink()
    mgr = CheckpointManager(cfg.checkpoint_dir, rank=0, world_size=1)
    with pytest.raises(ValueError, match="incomplete"):
        mgr.resolve(str(d))
    assert mgr.resolve("none") is None
    assert mgr.resolve("auto") is None


def test_resume_none_starts_fresh_and_auto_without_checkpoints(small_cfg) -> None:
    cfg = small_cfg("train.steps=2", "train.micro_batch_size=4", "checkpoint.resume=none")
    _, r = single(_train, cfg)
    assert r.resumed_from is None and r.step == 2


def test_prune_never_deletes_before_newer_complete(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    for step in (1, 2, 3):
        d = root / f"step-{step:08d}"
        d.mkdir(parents=True)
        if step < 3:
            (d / MARKER).write_text("{}")
    mgr = CheckpointManager(root, rank=0, world_size=1, keep_last=1)
    prune(mgr.storage, mgr.keep_last)
    complete, incomplete = list_checkpoints(root)
    # step 3 is incomplete, so step 2 is still the newest usable one and must survive
    assert [s for s, _ in complete] == [2] and [d.name for d in incomplete] == ["step-00000003"]
    shutil.rmtree(root)
    assert latest(root) is None


def test_manifest_round_trip_hashes_like_sha256(tmp_path: Path) -> None:
    """The manifest's sha256 is hashlib's over the whole file, across chunk boundaries (this failed on Python 3.10
    while the manifest used hashlib.file_digest, 3.11+: every save failed and training went on without any)."""
    chunk = atomic._HASH_CHUNK  # the one file hash (hpcdist.base.atomic.file_sha256) reads in these chunks
    sizes = {"empty": 0, "one": 1, "below": chunk - 1, "exact": chunk, "above": chunk + 1, "many": 5 * chunk // 2}
    d = tmp_path / "step-00000001"
    (d / "sub").mkdir(parents=True)
    for i, (name, size) in enumerate(sizes.items()):
        (d / "sub" / f"{name}.bin").write_bytes((bytes(range(i, 251)) * (size // 200 + 1))[:size])
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1)
    mgr._write_manifest(d, distributed=True)  # one rank: no process group, its own part is the whole
    files = json.loads((d / MANIFEST).read_text())["files"]
    assert sorted(files) == sorted(f"sub/{name}.bin" for name in sizes)
    for rel, entry in files.items():
        data = (d / rel).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert mgr.verify(d, "checksum") == [] and mgr.verify(d, "size") == []
    altered = bytearray((d / "sub/above.bin").read_bytes())
    altered[chunk] ^= 1  # one bit in the second chunk: same size, other digest
    (d / "sub/above.bin").write_bytes(bytes(altered))
    assert mgr.verify(d, "size") == []
    assert mgr.verify(d, "checksum") == ["sub/above.bin: sha256 differs from the manifest (altered)"]


def _linear_state(model: torch.nn.Module, step: int = 1) -> ckpt_state.Checkpointable:
    return ckpt_state.Checkpointable(
        dcp_state=lambda: {"model": model.state_dict()},
        load_dcp_state=lambda s: None,
        trainer_state=lambda: {"step": step},
        load_trainer_state=lambda s: None,
    )


# one process without a process group: DCP warns about that from its async worker thread, where no
# single_process_dcp() can scope it (the sync calls are scoped in hpcdist.checkpoint)
ASYNC_ONE_PROCESS = pytest.mark.filterwarnings(
    "ignore:torch.distributed is .*assuming the intent is to save in a single process:UserWarning"
)


@ASYNC_ONE_PROCESS
def test_async_wait_returns_only_after_manifest_and_marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """wait() means complete: the caller requeues or exits right after it. CPython wakes a future's
    result() waiters before its done-callbacks run, and the callback writes MANIFEST and COMPLETE: hashing a large
    state takes long, so a slow manifest makes the race certain here."""
    real = CheckpointManager._write_manifest

    def slow_manifest(self: CheckpointManager, path: Path, *, distributed: bool) -> None:
        time.sleep(0.5)
        real(self, path, distributed=distributed)

    monkeypatch.setattr(CheckpointManager, "_write_manifest", slow_manifest)
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1, async_save=True)
    path = mgr.save(1, _linear_state(torch.nn.Linear(8, 8)))
    assert path is not None
    mgr.wait()
    assert (path / MANIFEST).is_file() and (path / MARKER).is_file(), sorted(p.name for p in path.iterdir())
    assert latest(tmp_path) == path


@ASYNC_ONE_PROCESS
def test_async_save_that_fails_to_complete_is_reported_by_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A manifest/marker failure in the background is known when wait() returns (logged; no marker, not resumed)."""

    def broken_manifest(self: CheckpointManager, path: Path, *, distributed: bool) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(CheckpointManager, "_write_manifest", broken_manifest)
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1, async_save=True)
    path = mgr.save(1, _linear_state(torch.nn.Linear(8, 8)))
    assert path is not None
    assert mgr.wait() is False
    assert not (path / MARKER).exists() and latest(tmp_path) is None


def _flip_a_byte(ckpt: Path) -> None:
    shard = sorted(ckpt.glob("*.distcp"))[-1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def test_all_checkpoints_damaged_refuses_to_start_fresh_and_deletes_nothing(small_cfg) -> None:
    """Every checkpoint damaged used to mean a silent restart from step 0, and the new run's saves then
    deleted the damaged directories (the docs say they are kept)."""
    over = ("train.steps=4", "checkpoint.every_steps=2", "checkpoint.keep_last=1", "train.micro_batch_size=4")
    cfg = small_cfg(*over, "checkpoint.keep_last=5")
    single(_train, cfg)
    for step in (2, 4):
        _flip_a_byte(cfg.checkpoint_dir / f"step-{step:08d}")

    with pytest.raises(ConfigError) as err:
        single(_train, small_cfg(*over, "train.steps=6"))
    text = str(err.value)
    assert "step-00000002" in text and "step-00000004" in text and "checkpoint.resume=none" in text
    assert all((cfg.checkpoint_dir / f"step-{s:08d}" / ckpt_names.DAMAGED).is_file() for s in (2, 4))

    # the explicit override starts fresh; the damaged directories survive its saves and its pruning (keep_last=1)
    _, fresh = single(_train, small_cfg(*over, "train.steps=6", "checkpoint.resume=none"))
    assert fresh.resumed_from is None and fresh.step == 6
    kept = sorted(p.name for p in cfg.checkpoint_dir.iterdir() if (p / ckpt_names.DAMAGED).is_file())
    assert [name.split(".")[0] for name in kept] == ["step-00000002", "step-00000004"], kept
    assert [s for s, _ in list_checkpoints(cfg.checkpoint_dir)[0]] == [6]
    # and a damaged directory is never taken for a complete one again
    assert latest(cfg.checkpoint_dir) == cfg.checkpoint_dir / "step-00000006"


def _two_checkpoints(small_cfg, *extra: str):
    over = ("train.steps=4", "checkpoint.every_steps=2", "checkpoint.keep_last=5", "train.micro_batch_size=4", *extra)
    cfg = small_cfg(*over)
    single(_train, cfg)
    return cfg, cfg.checkpoint_dir / "step-00000004"


@pytest.mark.parametrize(
    "damage",
    ["manifest-key-flipped", "manifest-not-json", "manifest-deleted-and-shard-altered", "trainer-state-garbage"],
)
def test_any_problem_verifying_or_loading_falls_back_to_the_previous(
    small_cfg, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A malformed manifest crashed every resume (KeyError); a deleted one turned verification off, so
    an altered shard loaded; a garbage trainer_state.json crashed with UnicodeDecodeError. Each must demote the
    checkpoint with a warning and resume from the previous one."""
    verify = ["checkpoint.verify=none"] if damage == "trainer-state-garbage" else []  # only loading can see it
    _, newest = _two_checkpoints(small_cfg, *verify)
    manifest = newest / MANIFEST
    if damage == "manifest-key-flipped":
        manifest.write_text(manifest.read_text().replace('"size"', '"rize"', 1))
    elif damage == "manifest-not-json":
        manifest.write_bytes(b"\xff\xfe not json")
    elif damage == "manifest-deleted-and-shard-altered":
        manifest.unlink()
        _flip_a_byte(newest)
    else:
        (newest / STATE_FILE).write_bytes(b"\x80\x81\x82 garbage")
    capsys.readouterr()

    _, resumed = single(
        _train,
        small_cfg(
            "train.steps=6", "checkpoint.every_steps=2", "train.micro_batch_size=4", "checkpoint.keep_last=5", *verify
        ),
    )
    out = capsys.readouterr().out
    assert resumed.resumed_from.endswith("step-00000002"), out[-2000:]
    assert "step-00000004 is damaged" in out
    assert resumed.step == 6


@pytest.mark.parametrize(
    ("change", "says", "key"),
    [
        (
            "model.n_layers=1",
            "layers.1.attention.wq.weight: in the checkpoint, not in this model",
            "model.n_layers=2 (now 1)",
        ),
        ("model.n_layers=3", "layers.2.attention.wq.weight: not in the checkpoint", "model.n_layers=2 (now 3)"),
        ("model.ffn_dim=256", "checkpoint [128, 64], this model [256, 64]", "model.ffn_dim=128 (now 256)"),
    ],
)
def test_a_different_model_is_refused_and_its_checkpoint_kept(small_cfg, change: str, says: str, key: str) -> None:
    """2 layers -> 1 used to "resume" silently, dropping a layer and its optimizer state. The refusal
    names the parameters and the config keys that differ (the checkpoint carries its config); the intact
    checkpoint is not demoted; the message points at checkpoint.init_from."""
    over = ("train.steps=2", "checkpoint.every_steps=2", "train.micro_batch_size=4")
    cfg = small_cfg(*over)
    single(_train, cfg)
    with pytest.raises(ckpt_errors.CheckpointMismatch, match="holds a different model") as err:
        single(_train, small_cfg(*over, "train.steps=4", change))
    assert says in str(err.value) and f"it was saved with {key}" in str(err.value)
    assert "checkpoint.init_from=" in str(err.value)
    assert (cfg.checkpoint_dir / "step-00000002" / MARKER).is_file()
    assert (
        json.loads((cfg.checkpoint_dir / "step-00000002" / STATE_FILE).read_text())["config"]["model"]["n_layers"] == 2
    )


@pytest.mark.parametrize("change", ["optim.lr=0.001", "optim.weight_decay=0.05", "optim.beta2=0.99"])
def test_a_changed_optimizer_hyperparameter_applies_on_resume_and_is_said(small_cfg, tmp_path, caplog, change) -> None:
    """The checkpoint's optimizer state used to override a changed optim.lr (or betas, weight decay)
    silently. Now the config's value applies: the resumed optimizer's groups equal those of a run that used the new
    value from the start, at the same step, and one warning names the change."""
    over = ("train.steps=8", "checkpoint.every_steps=4", "train.micro_batch_size=4", "optim.warmup_steps=2")
    single(_train, small_cfg(*over), 4)  # lr 0.003 (SMALL), weight decay 0.1, betas (0.9, 0.95)
    reference, _ = single(_train, small_cfg(*over, change, run_dir=tmp_path / "ref"), 4)
    with caplog.at_level("WARNING", logger="hpcdist"):
        resumed = single(_build, small_cfg(*over, change))
    assert resumed.step == 4
    key, value = change.split("=")
    assert f"{key} " in caplog.text and f"-> {float(value):g}" in caplog.text and "from step 5" in caplog.text
    hyper = ("lr", "initial_lr", "betas", "eps", "weight_decay")
    got = [{k: g[k] for k in hyper} for g in resumed.strategy.optimizer.param_groups]
    want = [{k: g[k] for k in hyper} for g in reference.strategy.optimizer.param_groups]
    assert got == want and resumed.strategy.scheduler.base_lrs == reference.strategy.scheduler.base_lrs


def test_init_from_starts_a_different_model_from_the_matching_weights(small_cfg, tmp_path, caplog) -> None:
    """The explicit way to load weights into another model (here one layer more): matching weights are
    loaded, the rest keep their initialization and are listed; step, optimizer and data start fresh. Once the new
    run saved, a requeue resumes its own checkpoint, not init_from."""
    over = ("train.steps=2", "checkpoint.every_steps=2", "train.micro_batch_size=4")
    src, _ = single(_train, small_cfg(*over, run_dir=tmp_path / "src"))
    src_ckpt = tmp_path / "src" / "checkpoints" / "step-00000002"
    bigger = small_cfg(*over, "model.n_layers=3", f"checkpoint.init_from={src_ckpt}", run_dir=tmp_path / "big")
    fresh = single(_build, small_cfg(*over, "model.n_layers=3", run_dir=tmp_path / "fresh"))
    with caplog.at_level("INFO", logger="hpcdist"):
        big = single(_build, bigger)
    assert big.step == 0 and big.resumed_from is None
    assert f"starting fresh from the weights of {src_ckpt}" in caplog.text
    assert "not in it, kept their initialization: layers.2." in caplog.text
    mine, theirs, init = (dict(t.strategy.model.named_parameters()) for t in (big, src, fresh))
    for name, p in mine.items():
        expected = init[name] if name.startswith("layers.2.") else theirs[name]
        assert torch.equal(p, expected), name
    big.train()
    caplog.clear()
    with caplog.at_level("INFO", logger="hpcdist"):
        again = single(
            _build,
            small_cfg(
                *over, "train.steps=4", "model.n_layers=3", f"checkpoint.init_from={src_ckpt}", run_dir=tmp_path / "big"
            ),
        )
    assert again.step == 2 and again.resumed_from.endswith("big/checkpoints/step-00000002")
    assert "starting fresh from the weights" not in caplog.text


def _failing_state(exc: BaseException) -> ckpt_state.Checkpointable:
    def trainer_state() -> dict:
        raise exc

    return dataclasses.replace(_linear_state(torch.nn.Linear(8, 8)), trainer_state=trainer_state)


def test_a_save_that_fails_with_a_bug_stops_and_a_full_disk_does_not(tmp_path: Path) -> None:
    """A save failing with a bug used to be logged as "checkpoint I/O failed" and training went on, never to
    checkpoint again (every later save hits the same bug): hours of work unprotected. Now only storage errors
    are survived; anything else raises on every rank after the same clean-up."""
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1)
    with pytest.raises(ckpt_errors.CheckpointSaveError, match=r"not I/O .*TypeError: bad field") as err:
        mgr.save(1, _failing_state(TypeError("bad field")))
    assert isinstance(err.value.__cause__, TypeError)
    assert not (tmp_path / "step-00000001").exists()  # cleaned up like any failed save
    assert mgr.save(2, _failing_state(OSError(28, "No space left on device"))) is None  # training goes on
    assert mgr.save(3, _failing_state(RuntimeError("[enforce fail] PytorchStreamWriter failed writing file"))) is None
    assert mgr.save(4, _linear_state(torch.nn.Linear(8, 8))) is not None


def test_resuming_an_older_step_sets_the_newer_line_aside(small_cfg, capsys: pytest.CaptureFixture[str]) -> None:
    """After checkpoint.resume=<step 2> of a run that reached step 6, the next auto-resume jumped back
    to step 6 of the abandoned line. Now the newer checkpoints are renamed step-N.abandoned-<time> (kept, said), and
    auto continues the new line."""
    over = (
        "checkpoint.every_steps=2",
        "checkpoint.keep_last=5",
        "train.micro_batch_size=4",
        "checkpoint.save_final=true",
    )
    cfg = small_cfg("train.steps=6", *over)
    single(_train, cfg)
    root = cfg.checkpoint_dir
    six = sorted((root / "step-00000006").rglob("*"))
    capsys.readouterr()

    _, branch = single(_train, small_cfg("train.steps=3", f"checkpoint.resume={root / 'step-00000002'}", *over))
    assert branch.resumed_from.endswith("step-00000002") and branch.step == 3
    out = capsys.readouterr().out
    assert "turned back from step 4: the newer step-00000004 is set aside as step-00000004.abandoned-" in out
    assert "step-00000006 is set aside as step-00000006.abandoned-" in out
    assert [s for s, _ in list_checkpoints(root)[0]] == [2, 3]
    (aside6,) = root.glob("step-00000006.abandoned-*")
    assert [p.name for p in sorted(aside6.rglob("*"))] == [p.name for p in six] and (aside6 / MARKER).is_file()

    _, after = single(_train, small_cfg("train.steps=4", *over))  # auto: the new line, not the abandoned step 6
    assert after.resumed_from.endswith("step-00000003") and after.step == 4
    assert len(list(root.glob("step-*.abandoned-*"))) == 2  # never pruned, never deleted


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_resume_none_over_an_earlier_run_sets_it_aside_and_never_mixes_the_two(
    small_cfg, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checkpoint.resume=none in a run dir holding checkpoints 2, 4, 6 used to rmtree the old step 2 at
    the new run's first save, prune the new run's own step 2 (the old 4 and 6 counted as newer), and the next auto
    resume took the OLD step 6. Now the old line is set aside (step-N.abandoned-<time>, byte for byte), the new run's
    checkpoints are the only resume candidates, and nothing is deleted."""
    over = (
        "checkpoint.every_steps=2",
        "checkpoint.keep_last=3",
        "train.micro_batch_size=4",
        "checkpoint.save_final=true",
    )
    single(_train, small_cfg("train.steps=6", *over))
    root = small_cfg().checkpoint_dir
    old = {s: _tree(d) for s, d in list_checkpoints(root)[0]}
    assert sorted(old) == [2, 4, 6]
    capsys.readouterr()

    _, fresh = single(_train, small_cfg("train.steps=3", "checkpoint.resume=none", *over))
    out = capsys.readouterr().out
    assert fresh.resumed_from is None and fresh.step == 3
    assert "no complete checkpoint" not in out
    assert "checkpoint.resume=none" in out and "set aside as step-00000006.abandoned-" in out
    assert [s for s, _ in list_checkpoints(root)[0]] == [2, 3]  # the new line only, the new step 2 kept
    for step, files in old.items():  # the old line, whole and untouched
        (aside,) = root.glob(f"step-{step:08d}.abandoned-*")
        assert _tree(aside) == files

    _, after = single(_train, small_cfg("train.steps=4", *over))  # auto: continues the new run, not the old step 6
    assert after.resumed_from.endswith("step-00000003") and after.step == 4


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ("data.seq_len=16", "data.seq_len=32 (now 16)"),
        ("data.val_fraction=0.2", "data.val_fraction=0.01 (now 0.2)"),
        ("run.seed=7", "run.seed="),
    ],
)
def test_a_changed_data_config_is_a_refusal_and_every_checkpoint_stays_complete(
    small_cfg, capsys: pytest.CaptureFixture[str], change: str, key: str
) -> None:
    """Resuming with data.seq_len (or val_fraction, max_tokens, re-prepared data) changed made the
    sampler raise ValueError, which restore() took for damage: every intact checkpoint was renamed DAMAGED in turn
    and the log called them interrupted saves. Now it is one refusal naming the changed key and the options; every
    checkpoint keeps its COMPLETE marker."""
    over = ("train.steps=4", "checkpoint.every_steps=2", "checkpoint.keep_last=5", "train.micro_batch_size=4")
    cfg = small_cfg(*over)
    single(_train, cfg)
    capsys.readouterr()
    with pytest.raises(ckpt_errors.CheckpointMismatch) as err:
        single(_train, small_cfg(*over, "train.steps=6", change))
    text, out = str(err.value), capsys.readouterr().out
    assert key in text, text
    assert "run.dir" in text and "checkpoint.resume=none" in text and "checkpoint.init_from=" in text, text
    assert "damaged" not in out and "interrupted save" not in out, out[-2000:]
    for step in (2, 4):
        d = cfg.checkpoint_dir / f"step-{step:08d}"
        assert (d / MARKER).is_file() and not (d / ckpt_names.DAMAGED).exists()


@pytest.mark.parametrize("error", [OSError(5, "Input/output error"), MemoryError()], ids=["EIO", "MemoryError"])
@pytest.mark.parametrize("failures", [2, 100], ids=["then-reads", "persists"])
def test_a_transient_read_error_is_retried_then_refused_never_recorded_as_damage(
    small_cfg, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], error: BaseException, failures: int
) -> None:
    """An EIO on NFS or a MemoryError while loading used to demote every checkpoint in turn
    (COMPLETE -> DAMAGED, permanently). Now it is retried a bounded number of times; if it persists the run is
    refused (CheckpointUnavailable, exit 74 at the CLI) and every checkpoint keeps its COMPLETE marker."""
    cfg, newest = _two_checkpoints(small_cfg)
    monkeypatch.setattr(ckpt_load, "READ_RETRY_DELAYS_S", (0.0, 0.0, 0.0))
    real = torch.distributed.checkpoint.FileSystemReader.read_metadata
    calls = []

    def flaky(self):  # the storage fails the first `failures` reads, as a flaky mount would
        calls.append(1)
        if len(calls) <= failures:
            raise error
        return real(self)

    monkeypatch.setattr(torch.distributed.checkpoint.FileSystemReader, "read_metadata", flaky)
    over = ("train.steps=6", "checkpoint.every_steps=2", "checkpoint.keep_last=5", "train.micro_batch_size=4")
    if failures == 2:
        resumed = single(_build, small_cfg(*over))
        assert resumed.resumed_from == str(newest) and resumed.step == 4
        assert len(calls) == 2 + 2  # two failed reads, then ours and DCP's read of the same metadata
    else:
        with pytest.raises(ckpt_errors.CheckpointUnavailable, match=f"{type(error).__name__}.*not marked damaged"):
            single(_build, small_cfg(*over))
        assert len(calls) == 4  # one read and three retries, then the refusal; the older step 2 is not tried
        if isinstance(error, OSError):  # through the CLI: one line, exit 74, a record that blames no node
            from hpcdist import cli
            from hpcdist import config as config_mod

            yaml = Path(cfg.run.dir).parent / "again.yaml"
            config_mod.save(small_cfg(*over), yaml)
            capsys.readouterr()
            assert cli.main(["train", str(yaml)]) == 74
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and "not marked damaged" in err, err
            records = [json.loads(x) for x in (Path(cfg.run.dir) / "failures.jsonl").read_text().splitlines()]
            assert [(r["kind"], r["blame"]) for r in records] == [("checkpoint", [])], records
    for step in (2, 4):
        d = cfg.checkpoint_dir / f"step-{step:08d}"
        assert (d / MARKER).is_file() and not (d / ckpt_names.DAMAGED).exists()


def test_a_dcp_checkpoint_exception_from_init_from_is_one_line_and_recorded(
    small_cfg, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCP's CheckpointException derives from BaseException, so an error inside ``dcp.load`` of
    checkpoint.init_from=HF_DIR passed every `except Exception`: a 60-line traceback, exit 1 and no failures.jsonl
    record. Now it is one line naming init_from, exit 2, and a record for the restart policy. (A wrongly shaped
    tensor no longer gets that far: the Hugging Face directory check refuses it at config load; here the
    read itself fails inside DCP, as an I/O error on a network file system would.)"""
    import errno

    from hpcdist import cli
    from hpcdist import config as config_mod
    from hpcdist.hf.import_ import HFWeights

    over = ("train.steps=2", "train.micro_batch_size=4")
    single(_train, small_cfg(*over, "checkpoint.save_final=true", run_dir=tmp_path / "src"))
    hf = tmp_path / "hf"
    assert cli.main(["export", str(tmp_path / "src"), "--out", str(hf), "--dtype", "fp32"]) == 0
    run_dir = tmp_path / "new"
    yaml = tmp_path / "cfg.yaml"
    config_mod.save(small_cfg(*over, f"checkpoint.init_from={hf}", run_dir=run_dir), yaml)
    capsys.readouterr()

    def eio(self: HFWeights, fqn: str) -> torch.Tensor:
        raise OSError(errno.EIO, "Input/output error", str(hf / "model.safetensors"))

    monkeypatch.setattr(HFWeights, "tensor", eio)  # inside dcp.load: DCP wraps it in its CheckpointException
    code = cli.main(["train", str(yaml)])
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "checkpoint.init_from" in lines[0] and "Traceback" not in err, err[-3000:]
    records = [json.loads(line) for line in (run_dir / "failures.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["exception"] and "checkpoint.init_from" in records[0]["cause"]


def test_a_save_never_deletes_a_complete_checkpoint_of_its_step(tmp_path: Path) -> None:
    """A save used to rmtree whatever held its step's name, a complete checkpoint included. Now only a
    crashed save's leftover is removed; a complete one is moved aside (step-N.abandoned-<time>), byte for byte."""
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1)
    first = mgr.save(5, _linear_state(torch.nn.Linear(8, 8), step=5))
    files = _tree(first)
    second = mgr.save(5, _linear_state(torch.nn.Linear(8, 8), step=5))
    assert second == first and (second / MARKER).is_file()
    (aside,) = tmp_path.glob("step-00000005.abandoned-*")
    assert _tree(aside) == files


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_the_manifest_hashes_the_shards_while_writing_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    """The manifest's sha256 of every shard was a second pass over the files after DCP wrote them
    (~20% of a 125m save). Now the writer hashes what it writes: no shard is read back, and the digests are the
    files' own."""
    read_back: list[str] = []
    real = ckpt_manifest.digest

    def counting(file: Path, checksum: bool) -> dict:
        read_back.append(file.name)
        return real(file, checksum)

    monkeypatch.setattr(ckpt_manifest, "digest", counting)
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1, async_save=async_save, write_threads=2)
    path = mgr.save(1, _linear_state(torch.nn.Linear(64, 64)))
    assert path is not None and mgr.wait()
    assert not [n for n in read_back if n.endswith(".distcp")], read_back
    files = json.loads((path / MANIFEST).read_text())["files"]
    shards = sorted(p.name for p in path.glob("*.distcp"))
    assert len(shards) == 2 and set(shards) <= set(files)
    for rel, entry in files.items():  # every digest is the file's, as a re-read computes it
        assert entry == {"size": (path / rel).stat().st_size, "sha256": atomic.file_sha256(path / rel)}, rel
    assert mgr.verify(path) == []


def test_async_staging_that_cannot_fit_is_refused_at_start_up(small_cfg, monkeypatch: pytest.MonkeyPatch) -> None:
    """The staging buffers an async save allocates at its first save are counted up front (model +
    AdamW's two moments, which do not exist before the first step) and a need above the host's available memory is
    refused at start-up in one line naming both, never an OOM kill mid-run."""
    from hpcdist.env import from_environ

    cfg = small_cfg("checkpoint.async_save=true", "train.steps=1", "checkpoint.save_final=false")
    env = from_environ({}, cuda_available=False)
    t = Trainer(cfg, env)  # fits here
    before = ckpt_staging.staging_estimate(t.strategy.model)
    t.train()
    staged = ckpt_staging.staging_bytes(t.strategy.dcp_state())  # what a save stages, AdamW's moments now there
    assert before >= staged >= 0.97 * before, (before, staged)  # (the estimate counts the RoPE buffers too)
    t.ckpt.manager.close()

    monkeypatch.setattr(ckpt_staging, "available_memory", lambda: before // 2)
    with pytest.raises(ConfigError) as e:
        Trainer(cfg, env)
    (line,) = [ln.strip(" -") for ln in str(e.value).splitlines() if "checkpoint.async_save" in ln]
    assert line.startswith("checkpoint.async_save: staging a checkpoint needs") and "available host memory" in line
    size = ckpt_staging.size_text
    assert f"needs {size(before)} of host memory per rank" in line and f"than the {size(before // 2)} of" in line


def test_rerunning_a_finished_run_says_so_and_changes_nothing(
    tmp_path: Path, corpus_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same command again after the last step resumed, trained nothing, exited 0 in silence, booked
    the time between the runs as queue wait and overwrote run_summary.json. Now: one line, nothing rewritten."""
    from hpcdist import run
    from tests.conftest import SMALL

    over = [*SMALL, f"run.dir={tmp_path}", "data.source=files", f"data.path={corpus_dir}", "train.steps=2"]
    over.append("checkpoint.save_final=true")
    assert run.main(None, over).step == 2
    kept = {name: (tmp_path / name).read_bytes() for name in ("run_summary.json", "goodput.json", "metrics.jsonl")}
    capsys.readouterr()
    time.sleep(0.05)  # a rerun that booked its gap would change goodput.json
    again = run.main(None, over)
    assert (again.step, again.exit_code, again.losses) == (2, 0, {})
    assert "already finished at step 2 (train.steps=2); train.steps=4 to continue" in capsys.readouterr().out
    assert {name: (tmp_path / name).read_bytes() for name in kept} == kept


def test_a_resume_reads_each_shard_once_and_hashes_it_while_loading(small_cfg, monkeypatch: pytest.MonkeyPatch) -> None:
    """With verify=checksum a load read every shard twice: verify hashed each file whole, then DCP read it
    again (load was 0.25 of a sequential read). Now the shards' sha256 is taken while DCP reads them: no shard is
    hashed by a separate pass, and the digests the load took are the manifest's."""
    _, newest = _two_checkpoints(small_cfg, "checkpoint.write_threads=2")
    hashed_apart: list[str] = []
    real = ckpt_manifest.digest

    def counting(file: Path, checksum: bool) -> dict:
        if checksum:
            hashed_apart.append(file.name)
        return real(file, checksum)

    monkeypatch.setattr(ckpt_manifest, "digest", counting)
    readers: list = []
    real_read = ckpt_codec.HashingReader.read_data

    def spy(self, plan, planner):
        readers.append(self)
        return real_read(self, plan, planner)

    monkeypatch.setattr(ckpt_codec.HashingReader, "read_data", spy)
    over = ("train.steps=4", "checkpoint.every_steps=2", "checkpoint.keep_last=5", "train.micro_batch_size=4")
    resumed = single(_build, small_cfg(*over, "checkpoint.write_threads=2"))
    assert resumed.resumed_from == str(newest) and resumed.step == 4
    assert not [n for n in hashed_apart if n.endswith(".distcp")], hashed_apart
    (reader,) = readers
    manifest = json.loads((newest / MANIFEST).read_text())["files"]
    shards = sorted(p.name for p in newest.glob("*.distcp"))
    assert len(shards) == 2 and sorted(reader.digests) == shards
    for rel in shards:
        assert reader.digests[rel] == manifest[rel], rel


def test_a_shard_damaged_inside_a_tensor_is_loaded_then_replaced_whole_by_the_previous_checkpoint(
    small_cfg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The verdict on the shards now comes after DCP has read them into the model and optimizer. A byte
    flipped inside a tensor's data loads without error; the verdict must still demote the checkpoint, and the
    fallback must load the older one whole: every loss equals a run resumed from the older checkpoint."""
    cfg, newest = _two_checkpoints(small_cfg)
    ref_dir = tmp_path / "ref"
    shutil.copytree(cfg.run.dir, ref_dir)
    shutil.rmtree(small_cfg(run_dir=ref_dir).checkpoint_dir / newest.name)  # the reference resumes from step 2

    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(newest)).read_metadata().storage_data
    biggest = max(storage.values(), key=lambda info: info.length)  # a big tensor record: its middle is data
    shard = newest / biggest.relative_path
    data = bytearray(shard.read_bytes())
    data[biggest.offset + biggest.length // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    loaded_from: list[str] = []
    real_read = ckpt_codec.HashingReader.read_data

    def spy(self, plan, planner):
        loaded_from.append(Path(self.path).name)
        return real_read(self, plan, planner)

    monkeypatch.setattr(ckpt_codec.HashingReader, "read_data", spy)
    capsys.readouterr()

    over = ("train.steps=6", "checkpoint.every_steps=2", "checkpoint.keep_last=5", "train.micro_batch_size=4")
    _, resumed = single(_train, small_cfg(*over))
    out = capsys.readouterr().out
    assert loaded_from == ["step-00000004", "step-00000002"]  # step 4's tensors were read in before its verdict
    assert "step-00000004 is damaged" in out and f"{shard.name}: sha256 differs" in out, out[-2000:]
    assert resumed.resumed_from.endswith("step-00000002")
    _, reference = single(_train, small_cfg(*over, run_dir=ref_dir))
    assert reference.resumed_from.endswith("step-00000002")
    assert resumed.losses == reference.losses and sorted(resumed.losses) == [3, 4, 5, 6]


def test_a_damaged_load_whose_fallback_lacks_a_part_refuses_rather_than_keep_its_values(tmp_path: Path) -> None:
    """The shards' verdict comes after DCP wrote them into the live tensors. When the previous checkpoint
    has no optimizer state (a weights-only one), the moments read from the damaged checkpoint would have stayed:
    the resume refuses instead (CheckpointTainted), keeps the fallback complete, and a new process resumes from it."""
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1, keep_last=5)
    weights, moments = torch.zeros(256), torch.zeros(1 << 16)

    def state(with_optim: bool, step: int) -> ckpt_state.Checkpointable:
        return ckpt_state.Checkpointable(
            dcp_state=lambda: {"model": {"w": weights}, **({"optim": {"m": moments}} if with_optim else {})},
            load_dcp_state=lambda s: None,
            trainer_state=lambda: {"step": step},
            load_trainer_state=lambda s: None,
        )

    mgr.save(1, state(False, 1))  # weights only
    moments.fill_(1.0)
    newest = mgr.save(2, state(True, 2))
    moments.fill_(7.0)
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(newest)).read_metadata().storage_data
    info = max(storage.values(), key=lambda i: i.length)  # the moments' record
    shard = newest / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length // 2] ^= 0x40
    shard.write_bytes(bytes(data))

    with pytest.raises(ckpt_errors.CheckpointTainted, match="holds no 'optim' state"):
        CheckpointManager(tmp_path, rank=0, world_size=1).restore("auto", state(True, 0))
    assert (newest / ckpt_names.DAMAGED).is_file() and (tmp_path / "step-00000001" / MARKER).is_file()
    moments.fill_(7.0)  # a new process: nothing read before; the weights-only checkpoint loads, the moments stay
    assert CheckpointManager(tmp_path, rank=0, world_size=1).restore("auto", state(True, 0)).name == "step-00000001"
    assert bool((moments == 7.0).all())
