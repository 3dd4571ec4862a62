"""The node-local tier's decisions (hpcdist.checkpoint.local) as pure functions, and its one-process save, checks
and restore: which step a resume agrees on, who keeps whose copy, and what in a node-local directory (another job
may have used the node) is never trusted."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from hpcdist import config as config_mod
from hpcdist.base.atomic import file_sha256
from hpcdist.checkpoint.local.layout import agree_step, expand_dir, open_local_dir, own_dir, peers, rounds, run_key
from hpcdist.checkpoint.local.tier import LocalTier
from hpcdist.checkpoint.local.transport import _Sink
from hpcdist.checkpoint.manifest import MANIFEST
from hpcdist.checkpoint.names import MARKER, step_name
from hpcdist.config.loader import ConfigError
from tests.checkpointing import TinyState


def test_agreement_takes_the_newest_step_complete_for_every_rank_counting_peer_copies() -> None:
    # rank 1's own files of step 4 are gone; rank 0 keeps its copy: step 4, rank 1's files from rank 0
    inventories = [{0: [2, 4], 1: [2, 4]}, {1: [2], 0: [2, 4]}]
    plan = agree_step(inventories, 2, shared=3)
    assert (plan.step, plan.sources) == (4, {0: 0, 1: 0})
    # rank 1's step 4 nowhere: step 2, but the shared step 3 is newer
    plan = agree_step([{0: [2, 4], 1: [2]}, {1: [2]}], 2, shared=3)
    assert plan.step is None and "older than the shared checkpoint of step 3" in plan.why
    assert agree_step([{0: [2, 4], 1: [2]}, {1: [2]}], 2, shared=None).step == 2
    assert agree_step([{0: [4]}, {1: [4]}], 2, shared=4).step == 4  # as new as the shared one: the local one
    plan = agree_step([{0: [4]}, {}], 2, shared=None)
    assert plan.step is None and "rank(s) 1" in plan.why
    assert agree_step([{}, {}], 2, shared=None).why == "it holds no complete step"
    assert agree_step([{0: [6], 5: [8]}], 1, shared=None).step == 6  # a rank beyond this world: ignored


def test_each_node_copies_to_the_next_and_one_node_has_no_peer() -> None:
    assert peers(["a", "a", "b", "b"]) == [2, 3, 0, 1]
    assert peers(["a", "b", "c"]) == [1, 2, 0]
    assert peers(["a", "a", "b"]) == [2, 2, 0]  # the smaller node keeps both of node a's copies
    assert peers(["a", "a"]) == [-1, -1]
    # a ring is one round; two senders to one receiver are two
    assert rounds([(0, 2), (1, 3), (2, 0), (3, 1)]) == [[(0, 2), (1, 3), (2, 0), (3, 1)]]
    assert rounds([(0, 2), (1, 2), (2, 0)]) == [[(0, 2), (2, 0)], [(1, 2)]]


def test_the_tier_config_is_checked_one_line_per_mistake() -> None:
    with pytest.raises(ConfigError) as e:
        config_mod.load(None, ["checkpoint.local.dir=rel/{node}"])
    assert e.value.problems == [
        "checkpoint.local.dir: 'rel/{node}' is relative; give an absolute path on the node's own disk, e.g. "
        "/dev/shm/hpcdist-{job_id}",
        "checkpoint.local.dir: unknown placeholder {node} in 'rel/{node}'; use only {job_id}, {user}, {host}",
        "checkpoint.local: no cadence; set checkpoint.local.every_steps or checkpoint.local.every_minutes (or drop "
        "checkpoint.local.dir)",
    ]
    with pytest.raises(ConfigError, match=r"every_steps / every_minutes set without checkpoint\.local\.dir"):
        config_mod.load(None, ["checkpoint.local.every_minutes=5"])
    cfg = config_mod.load(None, ["checkpoint.local.dir=/dev/shm/x-{job_id}-{host}", "checkpoint.local.every_steps=2"])
    assert expand_dir(cfg.checkpoint.local.dir, host="n1", job_id="77") == Path("/dev/shm/x-77-n1")


def test_the_directory_must_be_yours_and_reached_through_no_link(tmp_path: Path) -> None:
    made = open_local_dir(tmp_path / "a" / "b")
    assert os.stat(made).st_mode & 0o777 == 0o700
    (tmp_path / "link").symlink_to(tmp_path / "a")
    with pytest.raises(ConfigError, match=r"is a link .* never follows links"):
        open_local_dir(tmp_path / "link" / "b")
    os.chmod(made, 0o777)
    with pytest.raises(ConfigError, match="writable by others"):
        open_local_dir(made)


def test_a_directory_above_the_tier_that_others_can_write_is_refused_unless_sticky(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # anyone could rename the tier's directory away and put theirs in its place
    with pytest.raises(ConfigError, match=r"'.*shared', above the tier's directory, is writable by others"):
        open_local_dir(shared / "tier")
    assert not (shared / "tier").exists()
    os.chmod(shared, 0o1777)  # sticky, as /dev/shm and /tmp: only an entry's owner renames it
    assert open_local_dir(shared / "tier") == shared / "tier"


def _tier(root: Path) -> LocalTier:
    return LocalTier(open_local_dir(root), rank=0, world_size=1, hosts=["a"], keep=2)


def _saved(root: Path, steps: list[int]) -> tuple[LocalTier, dict[int, torch.Tensor]]:
    tier, st, weights = _tier(root), TinyState(), {}
    for s in steps:
        with torch.no_grad():
            st.w.weight.fill_(float(s))
        st.step = s
        assert tier.save(s, st.checkpointable())
        assert tier.wait()  # the snapshot's files are written in the background
        weights[s] = st.w.weight.detach().clone()
    return tier, weights


def test_a_save_restores_and_only_keep_steps_stay(tmp_path: Path) -> None:
    tier, weights = _saved(tmp_path / "local", [2, 4, 6])
    mine = own_dir(tier.root, 0)
    assert sorted(p.name for p in mine.iterdir()) == ["step-00000004", "step-00000006"]
    assert json.loads((mine / step_name(6) / MANIFEST).read_text())["files"]  # size + sha256 of every file
    fresh = TinyState()
    path = tier.restore(fresh.checkpointable(), shared_step=5)
    assert path == mine / step_name(6) and fresh.step == 6 and torch.equal(fresh.w.weight, weights[6])
    assert tier.restore(TinyState().checkpointable(), shared_step=7) is None  # the shared one is newer
    # resumed at step 4 (from the shared tier, say): step 6 is of the line the run turned back from
    (tier.root / "not-the-tiers" / "step-00000009").mkdir(parents=True)
    tier.discard_newer(4)
    assert sorted(p.name for p in mine.iterdir()) == ["step-00000004"]
    assert (tier.root / "not-the-tiers" / "step-00000009").is_dir()  # only the tier's own directories


@pytest.mark.parametrize("damage", ["flip-byte", "link", "foreign-file", "no-marker", "other-run"])
def test_a_local_step_that_fails_its_checks_is_never_loaded(tmp_path: Path, damage: str) -> None:
    tier, _ = _saved(tmp_path / "local", [4])
    step = own_dir(tier.root, 0) / step_name(4)
    shard = next(step.glob("*.distcp"))
    if damage == "flip-byte":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "link":  # another job's planted link, where a file was
        target = tmp_path / "elsewhere"
        target.write_bytes(shard.read_bytes())
        shard.unlink()
        shard.symlink_to(target)
    elif damage == "foreign-file":
        (step / "extra.pt").write_bytes(b"x")
    elif damage == "no-marker":
        (step / MARKER).unlink()
    fresh = TinyState(run_dir="another" if damage == "other-run" else "r")
    before = fresh.w.weight.detach().clone()
    assert tier.restore(fresh.checkpointable(), shared_step=2) is None  # an older shared checkpoint resumes
    assert fresh.step == 0 and torch.equal(fresh.w.weight, before)  # nothing of it was loaded
    aside = sorted(p.name for p in own_dir(tier.root, 0).iterdir())
    if damage in ("flip-byte", "link", "foreign-file"):  # damaged: kept aside, never deleted, never tried again
        assert len(aside) == 1 and aside[0].startswith("step-00000004.damaged-"), aside
        assert tier.damaged_steps() == [4]
        with pytest.raises(ConfigError, match=r"only damaged local steps \(4, .*checkpoint\.resume=none"):
            tier.restore(fresh.checkpointable(), shared_step=None)  # and no shared one: never a silent step 0
    else:  # not complete, or not this run's: left as it is
        assert aside == ["step-00000004"] and tier.damaged_steps() == []


@pytest.mark.parametrize(
    "header",
    [
        {"origin": 0, "step": 4, "files": [["../../escape", 3]]},
        {"origin": 0, "step": 4, "files": [["a", 2]]},  # announces 2 bytes of 3
        {"origin": 9, "step": 4, "files": [["a", 3]]},  # no such rank
        {"origin": 0, "step": 5, "files": [["a", 3]]},  # another step
    ],
)
def test_a_copy_with_a_bad_file_list_writes_nothing_but_takes_every_byte(tmp_path: Path, header: Any) -> None:
    sink = _Sink(lambda origin: tmp_path / f"replica-of-rank-{origin:05d}", json.dumps(header).encode(), 3, 4, 2, 0)
    sink.write(b"abc")  # drained, not written
    with pytest.raises((ValueError, OSError)):
        sink.finish()
    assert not list(tmp_path.rglob("*a*")) and not (tmp_path.parent / "escape").exists()


def test_a_copy_that_does_not_match_its_manifest_is_not_kept(tmp_path: Path) -> None:
    manifest = json.dumps({"files": {"a": {"size": 3, "sha256": "0" * 64}}}).encode()
    header = {"origin": 1, "step": 4, "files": [[MANIFEST, len(manifest)], ["a", 3]]}
    sink = _Sink(lambda o: tmp_path / f"r{o}", json.dumps(header).encode(), len(manifest) + 3, 4, 2, 1)
    sink.write(manifest + b"abc")
    with pytest.raises(ValueError, match="does not match the manifest"):
        sink.finish()
    assert not any((tmp_path / "r1").iterdir())


def test_a_damaged_newest_step_gives_the_next_intact_one(tmp_path: Path) -> None:
    tier, weights = _saved(tmp_path / "local", [4, 6])
    shard = next((own_dir(tier.root, 0) / step_name(6)).glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    fresh = TinyState()
    assert tier.restore(fresh.checkpointable(), shared_step=None) == own_dir(tier.root, 0) / step_name(4)
    assert fresh.step == 4 and torch.equal(fresh.w.weight, weights[4])
    tier.discard_newer(4)  # the damaged step 6 is no step of the tier any more: kept
    assert [p.name[:22] for p in own_dir(tier.root, 0).iterdir() if p.name != step_name(4)] == [
        "step-00000006.damaged-"
    ]


@pytest.mark.parametrize(
    "marker",
    [{"step": 4, "rank": False, "world_size": True}, {"step": 4.0, "rank": 0, "world_size": 1}, "[" * 100_000],
)
def test_a_marker_of_other_types_is_no_marker(tmp_path: Path, marker: Any) -> None:
    tier, _ = _saved(tmp_path / "local", [4])
    (own_dir(tier.root, 0) / step_name(4) / MARKER).write_text(
        marker if isinstance(marker, str) else json.dumps(marker)
    )
    assert tier.inventory() == {}


def _rewrite_with_manifest(step: Path, name: str, data: bytes) -> None:
    """Our own file written as ``data``, with a manifest that matches it (damage the hashes cannot see)."""
    (step / name).write_bytes(data)
    manifest = json.loads((step / MANIFEST).read_text())
    manifest["files"][name] = {"size": len(data), "sha256": file_sha256(step / name)}
    (step / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "name, data",
    [
        ("trainer_state.json", b"[" * 100_000),
        (".metadata", pickle.dumps({"x": 1})),  # unpickles, but is no DCP metadata
        (".metadata", b"not a pickle"),
    ],
    ids=["deep-trainer-state", "metadata-unpickles-to-a-dict", "metadata-not-a-pickle"],
)
def test_a_record_that_does_not_parse_is_damage_not_a_crash(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], name: str, data: bytes
) -> None:
    tier, weights = _saved(tmp_path / "local", [4, 6])
    _rewrite_with_manifest(own_dir(tier.root, 0) / step_name(6), name, data)
    capfd.readouterr()
    fresh = TinyState()
    assert tier.restore(fresh.checkpointable(), shared_step=None) == own_dir(tier.root, 0) / step_name(4)
    assert fresh.step == 4 and torch.equal(fresh.w.weight, weights[4])
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err  # the damage is one warning line, not torch's tracebacks before it


def test_a_step_that_is_a_link_is_moved_aside_not_followed(tmp_path: Path) -> None:
    tier, _ = _saved(tmp_path / "local", [4])
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_text("x")
    link = own_dir(tier.root, 0) / step_name(6)
    link.symlink_to(target)
    st = TinyState()
    st.step = 6
    assert tier.save(6, st.checkpointable()) and tier.wait()  # saved where the link was; the link kept aside,
    # its target intact
    assert (link / MARKER).is_file() and not link.is_symlink() and (target / "keep").read_text() == "x"
    assert [p.name[:20] for p in own_dir(tier.root, 0).glob("step-00000006.*")] == ["step-00000006.moved-"]


def test_each_run_dir_has_its_own_key(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    key = run_key(tmp_path / "a")
    assert key == run_key(tmp_path / "a" / ".." / "a") and key != run_key(tmp_path / "b")
    (tmp_path / "a").rename(tmp_path / "old")
    (tmp_path / "a").mkdir()  # made again at the same path: another run (another inode)
    assert run_key(tmp_path / "a") != key or os.stat(tmp_path / "a").st_ino == os.stat(tmp_path / "old").st_ino
