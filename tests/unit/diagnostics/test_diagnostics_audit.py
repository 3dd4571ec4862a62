"""nccl_check's environment audit on crafted hosts: a fake sysfs tree (interfaces, HCAs), crafted variables,
addresses and name resolution, collected by the real collector and judged by the real findings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hpcdist.diagnostics import audit
from hpcdist.diagnostics.audit import MASK, collect_local, findings, is_secret, masked_environ
from hpcdist.diagnostics.report import audit_text
from hpcdist.env import DistEnv


def make_host(root: Path, ifaces: dict[str, str], hcas: dict[str, tuple[str, str]] | None = None) -> None:
    """A fake /sys: interfaces name -> operstate (lo is the loopback), HCAs name -> (port state, link layer)."""
    for name, state in ifaces.items():
        dev = root / "class" / "net" / name
        dev.mkdir(parents=True)
        (dev / "operstate").write_text(f"{state}\n")
        (dev / "mtu").write_text("65536\n" if name == "lo" else "1500\n")
        (dev / "flags").write_text("0x9\n" if name == "lo" else "0x1003\n")
        if name != "lo":
            (dev / "speed").write_text("100000\n")
    for name, (state, layer) in (hcas or {}).items():
        port = root / "class" / "infiniband" / name / "ports" / "1"
        port.mkdir(parents=True)
        (port / "state").write_text(f"{state}\n")
        (port / "phys_state").write_text("5: LinkUp\n")
        (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
        (port / "link_layer").write_text(f"{layer}\n")


def record(
    tmp_path: Path,
    host: str,
    rank: int = 0,
    *,
    environ: dict[str, str] | None = None,
    world: int = 2,
    nodes: int = 2,
    ifaces: dict[str, str] | None = None,
    addrs: dict[str, str] | None = None,
    resolves_to: list[str] | None = None,
    hcas: dict[str, tuple[str, str]] | None = None,
    master: str = "node-a",
) -> dict[str, Any]:
    """The real collector's record of rank ``rank`` on a crafted host ``host`` (one rank per node by default)."""
    root = tmp_path / f"sys-{host}-{rank}"
    make_host(root, ifaces or {"eth0": "up", "lo": "unknown"}, hcas)
    addrs = addrs if addrs is not None else {"eth0": f"10.0.0.{rank + 1}", "lo": "127.0.0.1"}
    env = DistEnv(
        rank=rank,
        local_rank=0,
        world_size=world,
        local_world_size=world // nodes,
        node_rank=rank * nodes // world,
        num_nodes=nodes,
        master_addr=master,
        master_port=29500,
        device="cpu",
        backend="gloo",
        launcher="slurm",
        job_id="7",
        hostname=host,
    )
    resolved = resolves_to if resolves_to is not None else [addrs.get("eth0", "127.0.1.1")]
    return collect_local(env, environ=environ or {}, sysfs_root=root, ipv4=addrs.get, resolve=lambda h: resolved)


def codes(found: list[audit.Finding], severity: str | None = None) -> list[str]:
    return [f.code for f in found if severity is None or f.severity == severity]


# ----------------------------------------------------------------------------------------------- secrets


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("HF_TOKEN", True),
        ("NCCL_TEST_TOKEN", True),
        ("AWS_SECRET_ACCESS_KEY", True),
        ("FI_EFA_API_KEY", True),
        ("GLOO_PASSWORD", True),
        ("WANDB_APIKEY", True),
        ("NCCL_IB_PKEY", False),
        ("NCCL_SOCKET_IFNAME", False),
        ("NCCL_KEYS_TO_DUMP", False),
        ("TORCH_NCCL_DUMP_ON_TIMEOUT", False),
    ],
)
def test_secret_looking_names(name: str, secret: bool) -> None:
    assert is_secret(name) is secret


def test_collected_variables_mask_secrets_and_skip_unrelated_ones() -> None:
    env = {
        "NCCL_DEBUG": "WARN",
        "NCCL_TEST_TOKEN": "hunter2",
        "GLOO_SOCKET_IFNAME": "eth0",
        "FI_PROVIDER": "efa",
        "TORCH_NCCL_BLOCKING_WAIT": "1",
        "NCCL_IB_PKEY": "0x8001",
        "HOME": "/root",
        "AWS_SECRET_ACCESS_KEY": "x",
    }
    shown = masked_environ(env)
    assert shown["NCCL_TEST_TOKEN"] == MASK and "hunter2" not in shown.values()
    assert shown["NCCL_IB_PKEY"] == "0x8001" and shown["GLOO_SOCKET_IFNAME"] == "eth0"
    assert "HOME" not in shown and "AWS_SECRET_ACCESS_KEY" not in shown  # not a communication variable at all


def test_printed_audit_masks_secrets_and_prints_each_value_once(tmp_path: Path) -> None:
    env = {"NCCL_TEST_TOKEN": "hunter2", "NCCL_DEBUG": "WARN", "GLOO_SOCKET_IFNAME": "eth0"}
    recs = [record(tmp_path, "node-a", 0, environ=env), record(tmp_path, "node-b", 1, environ=env)]
    recs[1]["env"]["NCCL_DEBUG"] = "INFO"
    lines = audit_text(recs, findings(recs, backend="gloo")).splitlines()
    assert not any("hunter2" in ln for ln in lines)
    token = next(ln for ln in lines if "NCCL_TEST_TOKEN" in ln)
    assert MASK in token and token.endswith("all ranks")
    # a value shared by all ranks is printed once; differing values once each, with who has them
    assert sum("GLOO_SOCKET_IFNAME" in ln for ln in lines) == 1
    i = next(i for i, ln in enumerate(lines) if "NCCL_DEBUG" in ln)
    assert "WARN" in lines[i] and lines[i].endswith("ranks 0 (node-a)")
    assert "INFO" in lines[i + 1] and lines[i + 1].endswith("ranks 1 (node-b)")


# ------------------------------------------------------------------------------------------------ collect


def test_collector_reads_interfaces_and_hcas_from_sysfs(tmp_path: Path) -> None:
    rec = record(tmp_path, "node-a", hcas={"mlx5_0": ("4: ACTIVE", "InfiniBand"), "mlx5_1": ("1: DOWN", "Ethernet")})
    eth0 = next(i for i in rec["interfaces"] if i["name"] == "eth0")
    lo = next(i for i in rec["interfaces"] if i["name"] == "lo")
    assert eth0 == {
        "name": "eth0",
        "state": "up",
        "mtu": 1500,
        "speed_mbps": 100000,
        "ipv4": "10.0.0.1",
        "loopback": False,
    }
    assert lo["loopback"] and lo["ipv4"] == "127.0.0.1"
    assert [(p["hca"], p["state"], p["rate"], p["link_layer"]) for p in rec["ib"]] == [
        ("mlx5_0", "4: ACTIVE", "200 Gb/sec (4X HDR)", "InfiniBand"),
        ("mlx5_1", "1: DOWN", "200 Gb/sec (4X HDR)", "Ethernet"),
    ]
    assert rec["versions"]["torch"] and rec["hostname"] == "node-a"


def test_a_consistent_two_host_setup_has_no_errors(tmp_path: Path) -> None:
    env = {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth"}
    recs = [record(tmp_path, "node-a", 0, environ=env), record(tmp_path, "node-b", 1, environ=env)]
    assert codes(findings(recs, backend="gloo"), "error") == []


# ----------------------------------------------------------------------------------------------- findings


def test_mismatched_versions_are_errors_naming_the_hosts(tmp_path: Path) -> None:
    recs = [record(tmp_path, "node-a", 0), record(tmp_path, "node-b", 1)]
    recs[1]["versions"]["torch"] = "2.12.0+cu121"
    recs[1]["versions"]["driver"] = "535.104.05"
    found = findings(recs, backend="gloo")
    torch_f = next(f for f in found if f.code == "torch_version_mismatch")
    assert torch_f.severity == "error" and "node-b" in torch_f.message and "2.12.0+cu121" in torch_f.message
    assert next(f for f in found if f.code == "driver_version_mismatch").severity == "warning"


def test_socket_ifname_naming_a_missing_interface(tmp_path: Path) -> None:
    env = {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "=bond0"}
    recs = [record(tmp_path, "node-a", 0, environ=env), record(tmp_path, "node-b", 1, environ=env)]
    found = [f for f in findings(recs, backend="gloo") if f.code == "ifname_missing"]
    gloo = [f for f in found if "GLOO_SOCKET_IFNAME" in f.message]
    nccl = [f for f in found if "NCCL_SOCKET_IFNAME" in f.message]
    assert {f.severity for f in gloo} == {"error"} and {f.hosts for f in gloo} == {("node-a",), ("node-b",)}
    assert {f.severity for f in nccl} == {"warning"}  # NCCL is not what this run uses
    assert "present: eth0, lo" in gloo[0].message and "GLOO_SOCKET_IFNAME" in gloo[0].fix


@pytest.mark.parametrize(
    ("value", "missing"), [("eth", False), ("^docker,lo", False), ("=eth", True), ("ib,eth", True)]
)
def test_nccl_socket_ifname_follows_nccl_prefix_rules(tmp_path: Path, value: str, missing: bool) -> None:
    recs = [record(tmp_path, "node-a", 0, environ={"NCCL_SOCKET_IFNAME": value})]
    assert ("ifname_missing" in codes(findings(recs, backend="nccl"))) is missing


def test_loopback_only_gloo_across_hosts(tmp_path: Path) -> None:
    lo = {"GLOO_SOCKET_IFNAME": "lo"}
    recs = [record(tmp_path, "node-a", 0, environ=lo), record(tmp_path, "node-b", 1, environ=lo)]
    found = [f for f in findings(recs, backend="gloo") if f.code == "loopback_only"]
    assert len(found) == 2 and all(f.severity == "error" and "GLOO_SOCKET_IFNAME=eth0" in f.fix for f in found)
    # the same on one host is fine: loopback is exactly right there
    single = [record(tmp_path, "solo", 0, environ=lo, world=1, nodes=1)]
    assert "loopback_only" not in codes(findings(single, backend="gloo"))


def test_unset_gloo_ifname_with_hostname_on_loopback(tmp_path: Path) -> None:
    """Debian's /etc/hosts maps the hostname to 127.0.1.1: gloo then binds loopback (FACTS: sandbox failure)."""
    recs = [record(tmp_path, h, r, resolves_to=["127.0.1.1"]) for r, h in enumerate(("node-a", "node-b"))]
    found = [f for f in findings(recs, backend="gloo") if f.code == "loopback_only"]
    assert found and "127.0.1.1" in found[0].message
    ok = [record(tmp_path, h, r) for r, h in enumerate(("node-c", "node-d"))]  # resolves to its eth0 address
    assert "loopback_only" not in codes(findings(ok, backend="gloo"))


def test_loopback_master_in_a_multi_node_job(tmp_path: Path) -> None:
    recs = [record(tmp_path, "node-a", 0, master="127.0.0.1", environ={"GLOO_SOCKET_IFNAME": "eth0"})]
    found = findings(recs, backend="gloo", expected_hosts=2)  # node-b never joined: it looked for 127.0.0.1
    assert "loopback_master" in codes(found, "error")


def test_ib_disabled_while_hcas_are_active(tmp_path: Path) -> None:
    hcas = {"mlx5_0": ("4: ACTIVE", "InfiniBand")}
    on = [record(tmp_path, "node-a", 0, environ={"NCCL_IB_DISABLE": "1"}, hcas=hcas)]
    assert "ib_disabled" in codes(findings(on, backend="nccl"), "warning")
    roce = [record(tmp_path, "node-b", 0, environ={"NCCL_IB_DISABLE": "1"}, hcas={"mlx5_0": ("4: ACTIVE", "Ethernet")})]
    assert "ib_disabled" not in codes(findings(roce, backend="nccl"))


@pytest.mark.parametrize(("value", "hit"), [("12", True), ("SIGUSR2", True), ("USR2", True), ("10", False)])
def test_proxy_dump_signal_equal_to_the_requeue_signal(tmp_path: Path, value: str, hit: bool) -> None:
    recs = [record(tmp_path, "node-a", 0, environ={"NCCL_PROXY_DUMP_SIGNAL": value})]
    assert ("proxy_dump_signal" in codes(findings(recs, backend="nccl", requeue_signal="USR2"), "error")) is hit


def _as_gpu_node(rec: dict[str, Any], gpus: int) -> dict[str, Any]:
    """What the collector records on a CUDA build with ``gpus`` GPUs (nvidia-smi -L lines) on the node."""
    rec["gpus"] = {
        "cuda_build": True,
        "count": gpus,
        "names": ["NVIDIA A100-SXM4-80GB"] * gpus,
        "device": None,
        "physical": gpus,
    }
    rec["backend"] = "nccl"
    return rec


def test_fewer_hcas_than_gpus(tmp_path: Path) -> None:
    hcas = {f"mlx5_{i}": ("4: ACTIVE", "InfiniBand") for i in range(4)}
    recs = [_as_gpu_node(record(tmp_path, "node-a", 0, hcas=hcas), 8)]
    found = next(f for f in findings(recs, backend="nccl") if f.code == "few_hcas")
    assert found.severity == "warning" and "4 active InfiniBand HCA(s) for 8 GPUs" in found.message


def test_a_missing_gpu(tmp_path: Path) -> None:
    recs = [_as_gpu_node(record(tmp_path, "node-a", 0), 8), _as_gpu_node(record(tmp_path, "node-b", 1), 7)]
    found = [f for f in findings(recs, backend="nccl") if f.code == "gpu_missing"]
    assert [f.hosts for f in found] == [("node-b",)] and found[0].severity == "error"
    visible = [_as_gpu_node(record(tmp_path, "node-c", 0, environ={"CUDA_VISIBLE_DEVICES": "0,1,2,3"}), 3)]
    assert "lists 4 GPU(s) but only 3" in next(
        f.message for f in findings(visible, backend="nccl") if f.code == "gpu_missing"
    )


def test_cpu_build_skips_gpu_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A CPU build whatever torch this machine has (Python 3.10/3.13 venvs get PyPI's CUDA build, which runs on CPU)
    monkeypatch.setattr(torch.version, "cuda", None)
    recs = [record(tmp_path, "node-a", 0, environ={"CUDA_VISIBLE_DEVICES": "0,1"})]  # the sandbox's fake GPUs
    found = findings(recs, backend="gloo")
    assert "gpu_missing" not in codes(found) and "cpu_build" in codes(found, "info")
