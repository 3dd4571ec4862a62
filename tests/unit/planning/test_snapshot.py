"""The node-local tier's footprint per node: what ``hpcdist plan`` and the dry run show, and the dry run's refusal of
a tier in host memory that the node cannot hold."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcdist import config as config_mod
from hpcdist.cli import main
from hpcdist.config.cluster import HardwareConfig
from hpcdist.planning.snapshot import SHM_FRACTION, footprint
from tests.conftest import SMALL

GIB = float(1 << 30)
LOCAL = ["checkpoint.local.every_steps=1", "checkpoint.local.keep=2"]
FLAGSHIP_PLAN = ["plan", "configs/train_13b.yaml", "--nodes", "4", "checkpoint.local.every_steps=1"]


def _cfg(directory: str, keep: int = 2) -> config_mod.JobConfig:
    return config_mod.load(None, [*SMALL, f"checkpoint.local.dir={directory}", *LOCAL, f"checkpoint.local.keep={keep}"])


def test_a_node_holds_its_ranks_and_the_peers_copies_of_every_kept_step_and_one_more() -> None:
    hw = HardwareConfig(host_mem_gb=128)
    fp = footprint(_cfg("/dev/shm/t-{job_id}"), hw, per_rank_bytes=GIB, ranks_per_node=8, nodes=4)
    assert fp is not None and fp.in_memory
    assert fp.dir_bytes == GIB * 8 * 2 * 3  # 8 ranks, own + peer copy, keep 2 + the one being written
    assert fp.staging_bytes == GIB * 8
    assert fp.dir_bytes <= 128 * GIB * SHM_FRACTION and fp.problem is None
    one_node = footprint(_cfg("/dev/shm/t"), hw, per_rank_bytes=GIB, ranks_per_node=8, nodes=1)
    assert one_node is not None and one_node.dir_bytes == GIB * 8 * 3 and one_node.copy_s == 0.0  # no peer


def test_a_tier_past_dev_shm_or_the_ram_is_a_problem_a_local_disk_never_is() -> None:
    hw = HardwareConfig(host_mem_gb=64)
    over_shm = footprint(_cfg("/dev/shm/t", keep=4), hw, per_rank_bytes=GIB, ranks_per_node=4, nodes=2)
    assert over_shm is not None and over_shm.dir_bytes > 32 * GIB
    assert over_shm.problem and "checkpoint.local.keep (now 4)" in over_shm.problem
    assert "does NOT fit" in over_shm.line("/dev/shm/t")
    disk = footprint(_cfg("/local/nvme/t", keep=4), hw, per_rank_bytes=GIB, ranks_per_node=4, nodes=2)
    assert disk is not None and not disk.in_memory and disk.problem is None
    unknown = footprint(_cfg("/dev/shm/t", keep=4), HardwareConfig(), per_rank_bytes=GIB, ranks_per_node=4, nodes=2)
    assert unknown is not None and unknown.problem is None
    assert "no hardware.host_mem_gb" in unknown.line("/dev/shm/t")
    assert footprint(config_mod.load(None, SMALL), hw, per_rank_bytes=GIB, ranks_per_node=4, nodes=2) is None


def test_the_plan_shows_the_flagships_per_step_snapshot(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*FLAGSHIP_PLAN, "checkpoint.local.dir=/dev/shm/hpcdist-{job_id}"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "node-local checkpoint tier (/dev/shm/hpcdist-{job_id}):" in out
    assert "every step is practical" in out and "in host memory: fits in 1024 GiB" in out
    assert main([*FLAGSHIP_PLAN, "checkpoint.local.dir=/dev/shm/hpcdist-{job_id}", "checkpoint.local.keep=8"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "does NOT fit" in out and "more than /dev/shm's" in out


def test_the_dry_run_refuses_a_tier_the_nodes_memory_cannot_hold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = Path("hpcdist/resources/cluster/a100_ib.yaml").read_text()
    small = tmp_path / "small_ram.yaml"
    small.write_text(profile.replace("host_mem_gb: 1024", "host_mem_gb: 0.001"))
    argv = ["train", "configs/demo.yaml", "--dry-run", "--world-size", "4", *SMALL, "data.source=synthetic", *LOCAL]
    assert main([*argv, "--cluster", str(small), "checkpoint.local.dir=/dev/shm/t-{job_id}"]) == 1
    captured = capsys.readouterr()
    assert "more than /dev/shm's" in captured.err and "checkpoint.local.keep (now 2)" in captured.err
    assert main([*argv, "--cluster", str(small), "checkpoint.local.dir=/var/tmp/t-{job_id}"]) == 0  # a disk: shown
    assert "on a local disk" in capsys.readouterr().out
