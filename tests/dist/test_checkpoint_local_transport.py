"""The node-local tier's transport on 2 real gloo ranks, one ``send`` / ``recv`` pair at a time: a step's files
arrive byte-identical (several chunks, an empty file among them), and a byte altered on the way to the wire (the
sender's file no longer matches the manifest that travels with it) is refused, leaving nothing trusted behind."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from hpcdist.env import DistEnv
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist

STEP = 2
# bytes per file: several chunks of the 1000-byte CHUNK below, one shorter than a chunk, an empty one
SIZES = {"__0_0.distcp": 4321, "trainer_state.json": 0, "rng.pt": 999}


def _step_dir(root: Path) -> Path:
    """A step directory as the tier writes it: files and a manifest of their sizes and sha256 (no COMPLETE: it is
    never sent, the receiver writes its own)."""
    d = root / "rank-00000" / f"step-{STEP:08d}"
    d.mkdir(parents=True, mode=0o700)
    files = {}
    for name, size in SIZES.items():
        data = os.urandom(size) if name != "trainer_state.json" else b""
        (d / name).write_bytes(data)
        files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (d / "MANIFEST.json").write_text(json.dumps({"files": files, "step": STEP, "rank": 0}))
    return d


def _send_once(env: DistEnv, root: Path) -> dict:
    from hpcdist.checkpoint.local import transport
    from hpcdist.checkpoint.local.transport import PeerTransport

    transport.CHUNK = 1000  # several messages per file; the wire format is the same at any chunk size
    t = PeerTransport(env.rank, 2)  # the default group: the job's own two ranks
    if env.rank == 0:
        src = _step_dir(root / "node0")
        t.send(1, STEP, src, origin=0)
        return {"sent": {p.name: p.read_bytes() for p in src.iterdir()}}
    into = root / "node1" / "replica-of-rank-00000"
    into.mkdir(parents=True, mode=0o700)
    t.recv(0, STEP, into, origin=0)
    got = into / f"step-{STEP:08d}"
    return {
        "received": {p.name: p.read_bytes() for p in got.iterdir() if p.name != "COMPLETE"},
        "marker": json.loads((got / "COMPLETE").read_text()),
        "left": sorted(p.name for p in into.iterdir()),
    }


def _send_altered(env: DistEnv, root: Path) -> dict:
    from hpcdist.checkpoint.local import transport
    from hpcdist.checkpoint.local.transport import PeerTransport

    transport.CHUNK = 1000
    t = PeerTransport(env.rank, 2)
    into = root / "node1" / "replica-of-rank-00000"
    if env.rank == 0:
        src = _step_dir(root / "node0")
        shard = src / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[1234] ^= 0x01  # one bit of the second chunk, after the manifest was written
        shard.write_bytes(bytes(data))
        t.send(1, STEP, src, origin=0)
        return {}
    into.mkdir(parents=True, mode=0o700)
    try:
        t.recv(0, STEP, into, origin=0)
        return {"refused": None, "left": sorted(p.name for p in into.iterdir())}
    except ValueError as e:
        return {"refused": str(e), "left": sorted(p.name for p in into.iterdir())}


def test_a_steps_files_sent_from_rank_0_arrive_byte_identical_on_rank_1(tmp_path) -> None:
    sent, received = run_ranks(2, _send_once, tmp_path)
    assert received["received"] == sent["sent"]
    assert sorted(received["received"]) == sorted([*SIZES, "MANIFEST.json"])
    assert received["marker"] == {"step": STEP, "rank": 0, "world_size": 2}  # written by the receiver, last
    assert received["left"] == [f"step-{STEP:08d}"]  # no .partial left beside it


def test_a_byte_altered_before_the_wire_is_refused_and_nothing_is_trusted(tmp_path) -> None:
    _, received = run_ranks(2, _send_altered, tmp_path)
    assert received["refused"] == "__0_0.distcp: the copy does not match the manifest"
    assert received["left"] == []  # no step-N, no step-N.partial: the next copy starts clean
