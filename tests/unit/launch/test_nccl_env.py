"""NCCL environment profiles (hpcdist/resources/nccl/*.yaml) and their resolution inside a task.

Nothing here touches the real network or /sys: the HCA lookup reads a fake sysfs tree (``sysfs_root``) and
the interface lookup goes through a fake :class:`NetLookup`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcdist import resources
from hpcdist.base.signals import parse_signal
from hpcdist.config import ConfigError
from hpcdist.config import nccl_profiles as profiles
from hpcdist.config.nccl_profiles import load_profile
from hpcdist.launch import nccl
from hpcdist.launch.nccl import NetLookup, apply_to_environ, auto_hcas, resolve_env

PROFILES = resources.paths("nccl")


def fake_net(
    *,
    addrs: dict[str, list[str]] | None = None,
    local: dict[str, str] | None = None,
    routes: dict[str, str] | None = None,
    default: str | None = "eth0",
) -> NetLookup:
    """Name resolution, local addresses, routes and the default route of an imaginary host."""
    addrs, local, routes = addrs or {}, local or {}, routes or {}
    return NetLookup(
        resolve=lambda host: addrs.get(host, [host] if host[0].isdigit() else []),
        local_iface=local.get,
        route_iface=routes.get,
        default_iface=lambda: default,
    )


def make_hca(root: Path, name: str, ports: dict[str, tuple[str, str]] | None) -> None:
    """A fake /sys/class/infiniband/<name>; ports maps port number -> (state, link_layer); None = no ports dir."""
    dev = root / "class" / "infiniband" / name
    dev.mkdir(parents=True)
    for port, (state, layer) in (ports or {}).items():
        (dev / "ports" / port).mkdir(parents=True)
        (dev / "ports" / port / "state").write_text(f"{state}\n")
        (dev / "ports" / port / "link_layer").write_text(f"{layer}\n")


# --------------------------------------------------------------------------------------------- profiles


def test_shipped_profiles_are_found() -> None:
    assert {"ib_a100", "ethernet", "debug"} <= set(profiles.profile_names())


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.stem)
def test_every_shipped_profile_loads_with_a_reason_for_each_variable(path: Path) -> None:
    profile = load_profile(path.stem)
    assert profile
    assert load_profile(str(path)) == profile  # by name and by path alike
    for var, (value, why) in profile.items():
        assert var.isupper() and value and "\n" not in value
        assert len(why) > 15, f"{path.stem}: {var} needs a real reason"


def test_ethernet_profile_sets_the_gloo_interface_the_sandbox_needs() -> None:
    # two hosts in network namespaces: gloo works across them only with GLOO_SOCKET_IFNAME
    profile = load_profile("ethernet")
    assert profile["GLOO_SOCKET_IFNAME"][0] == "auto"
    assert profile["NCCL_SOCKET_IFNAME"][0] == "auto"
    assert profile["NCCL_IB_DISABLE"][0] == "1"


def test_ib_profile_picks_hcas_and_interfaces_automatically() -> None:
    profile = load_profile("ib_a100")
    assert {profile[v][0] for v in ("NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")} == {"auto"}


def test_profiles_merge_left_to_right() -> None:
    merged = load_profile("ib_a100, debug")
    assert merged["NCCL_DEBUG"][0] == "INFO"  # debug wins
    assert merged["NCCL_IB_HCA"][0] == "auto"  # ib_a100 kept
    assert merged["TORCH_DISTRIBUTED_DEBUG"][0] == "DETAIL"


def test_bad_profile_reports_every_problem(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "lower_case: {value: 1, why: some reason here}\n"
        "NCCL_DEBUG: {value: INFO}\n"
        "NCCL_IB_DISABLE: {value: yes, why: YAML turns yes into a boolean}\n"
        "NCCL_ALGO: {value: auto, why: auto is not understood for this one}\n"
        "NCCL_PROTO: {value: Simple, why: reason given, typo: 1}\n"
        "NCCL_BUFFSIZE: 4194304\n"
    )
    with pytest.raises(ConfigError) as exc:
        load_profile(str(path))
    text = str(exc.value)
    assert "6 problems" in text
    for fragment in (
        "lower_case",
        "NCCL_DEBUG.why",
        "NCCL_IB_DISABLE.value",
        "only understood for",
        "unknown key(s) typo",
        "NCCL_BUFFSIZE: must be a mapping",
    ):
        assert fragment in text


@pytest.mark.parametrize("name", ["nope", "", " , "])
def test_unknown_profile_lists_the_shipped_ones(name: str) -> None:
    with pytest.raises(ConfigError, match="ib_a100"):
        load_profile(name)


# --------------------------------------------------------------------------------------------- HCAs


def test_auto_hcas_keeps_active_infiniband_ports_only(tmp_path: Path) -> None:
    make_hca(tmp_path, "mlx5_0", {"1": ("4: ACTIVE", "InfiniBand")})
    make_hca(tmp_path, "mlx5_1", {"1": ("1: DOWN", "InfiniBand"), "2": ("4: ACTIVE", "InfiniBand")})
    make_hca(tmp_path, "mlx5_2", {"1": ("1: DOWN", "InfiniBand")})  # cable out
    make_hca(tmp_path, "mlx5_3", {"1": ("4: ACTIVE", "Ethernet")})  # RoCE storage NIC
    make_hca(tmp_path, "mlx5_10", None)  # unknown layout: kept, NCCL decides
    value, note = auto_hcas(tmp_path)
    # '=' for exact names: a plain "mlx5_1" would also select mlx5_10
    assert value == "=mlx5_0,mlx5_1,mlx5_10"
    assert "mlx5_2" in note and "mlx5_3" in note


def test_auto_hcas_without_infiniband(tmp_path: Path) -> None:
    value, note = auto_hcas(tmp_path)
    assert value is None and "no HCAs" in note
    make_hca(tmp_path, "mlx5_0", {"1": ("1: DOWN", "InfiniBand")})
    assert auto_hcas(tmp_path)[0] is None


# --------------------------------------------------------------------------------------------- interfaces

IB_PROFILE = {
    "NCCL_IB_HCA": ("auto", "hcas"),
    "NCCL_SOCKET_IFNAME": ("auto", "bootstrap"),
    "GLOO_SOCKET_IFNAME": ("auto", "gloo"),
    "NCCL_DEBUG": ("WARN", "quiet"),
}


def test_resolve_env_follows_the_route_to_the_master(tmp_path: Path) -> None:
    make_hca(tmp_path, "mlx5_0", {"1": ("4: ACTIVE", "InfiniBand")})
    net = fake_net(addrs={"gpu001": ["10.1.0.1"]}, routes={"10.1.0.1": "ib0"})
    to_set, lines = resolve_env(IB_PROFILE, {}, master_addr="gpu001", sysfs_root=tmp_path, net=net)
    assert to_set == {
        "NCCL_IB_HCA": "=mlx5_0",
        "NCCL_SOCKET_IFNAME": "=ib0",  # NCCL: exact match
        "GLOO_SOCKET_IFNAME": "ib0",  # gloo takes plain names
        "NCCL_DEBUG": "WARN",
    }
    assert len(lines) == 4
    assert any("route to master gpu001 (10.1.0.1) goes through ib0" in line for line in lines)


def test_user_environment_wins_and_is_logged(tmp_path: Path) -> None:
    net = fake_net(addrs={"gpu001": ["10.1.0.1"]}, routes={"10.1.0.1": "ib0"})
    environ = {"NCCL_SOCKET_IFNAME": "=eth7", "NCCL_DEBUG": "INFO", "GLOO_SOCKET_IFNAME": ""}
    to_set, lines = resolve_env(IB_PROFILE, environ, master_addr="gpu001", sysfs_root=tmp_path, net=net)
    assert "NCCL_SOCKET_IFNAME" not in to_set and "NCCL_DEBUG" not in to_set
    assert to_set["GLOO_SOCKET_IFNAME"] == "ib0"  # an empty variable counts as unset
    assert "NCCL_IB_HCA" not in to_set  # no HCAs in the fake tree: NCCL's own detection decides
    text = "\n".join(lines)
    assert "NCCL_SOCKET_IFNAME==eth7 (kept from the environment" in text
    assert "NCCL_DEBUG=INFO (kept from the environment; the profile says WARN" in text
    assert "NCCL_IB_HCA left unset" in text


def test_master_on_this_host_uses_the_interface_that_carries_its_address() -> None:
    # the master node of a multi-node job: `ip route get` would answer "local ... dev lo", which peers cannot reach
    net = fake_net(addrs={"node1": ["10.9.0.11"]}, local={"10.9.0.11": "eth0"}, routes={"10.9.0.11": "lo"})
    to_set, _ = resolve_env(IB_PROFILE, {}, master_addr="node1", sysfs_root="/nonexistent", net=net)
    assert to_set["GLOO_SOCKET_IFNAME"] == "eth0"


def test_loopback_only_when_the_master_is_local() -> None:
    net = fake_net(addrs={"localhost": ["127.0.0.1"]}, local={"127.0.0.1": "lo"})
    to_set, _ = resolve_env(IB_PROFILE, {}, master_addr="localhost", sysfs_root="/nonexistent", net=net)
    assert to_set["GLOO_SOCKET_IFNAME"] == "lo"
    # Debian maps the own hostname to 127.0.1.1: this host is the master, peers reach it via a real interface
    net = fake_net(addrs={"node1": ["127.0.1.1"]}, local={"127.0.1.1": "lo"}, default="ens3")
    to_set, lines = resolve_env(IB_PROFILE, {}, master_addr="node1", sysfs_root="/nonexistent", net=net)
    assert to_set["GLOO_SOCKET_IFNAME"] == "ens3"
    assert any("default-route interface" in line for line in lines)
    net = fake_net(addrs={"node1": ["127.0.1.1"]}, default=None)
    assert resolve_env(IB_PROFILE, {}, master_addr="node1", net=net)[0]["GLOO_SOCKET_IFNAME"] == "lo"


def test_unresolvable_master_leaves_interfaces_to_nccl() -> None:
    to_set, lines = resolve_env(IB_PROFILE, {}, master_addr="ghost", sysfs_root="/nonexistent", net=fake_net())
    assert set(to_set) == {"NCCL_DEBUG"}
    assert any("GLOO_SOCKET_IFNAME left unset: master 'ghost' does not resolve" in line for line in lines)


def test_apply_to_environ_sets_variables_and_is_a_noop_without_profile(tmp_path: Path) -> None:
    environ: dict[str, str] = {"NCCL_DEBUG": "TRACE"}
    assert apply_to_environ(None, master_addr="x", environ=environ) == []
    assert apply_to_environ("", master_addr="x", environ=environ) == []
    assert environ == {"NCCL_DEBUG": "TRACE"}
    net = fake_net(addrs={"n1": ["192.0.2.10"]}, routes={"192.0.2.10": "veth3"})
    lines = apply_to_environ("ethernet", master_addr="n1", environ=environ, sysfs_root=tmp_path, net=net)
    assert environ["GLOO_SOCKET_IFNAME"] == "veth3"
    assert environ["NCCL_SOCKET_IFNAME"] == "=veth3"
    assert environ["NCCL_IB_DISABLE"] == "1"
    assert environ["NCCL_DEBUG"] == "TRACE"  # the user's value survives
    assert lines[0].startswith("nccl profile ethernet: 6 variable(s) set")


# --------------------------------------------------------------------------------------------- parsers


def test_parse_route_get() -> None:
    assert nccl.parse_route_get("10.0.0.7 via 10.0.0.1 dev ib0 src 10.0.0.5 uid 0 \\    cache") == "ib0"
    assert nccl.parse_route_get("local 127.0.0.1 dev lo src 127.0.0.1 uid 0") == "lo"
    assert nccl.parse_route_get("RTNETLINK answers: Network is unreachable") is None


PROC_NET_ROUTE = """Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eth0\t00000000\t010200C0\t0003\t0\t0\t100\t00000000\t0\t0\t0
eth0\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
ib0\t0000010A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0
ib1\t0000010A\t00000000\t0001\t0\t0\t5\t0000FFFF\t0\t0\t0
down0\t0001010A\t00000000\t0000\t0\t0\t0\t00FFFFFF\t0\t0\t0
"""


@pytest.mark.parametrize(
    ("addr", "iface"),
    [("10.1.1.7", "ib0"), ("192.0.2.9", "eth0"), ("8.8.8.8", "eth0"), ("0.0.0.0", "eth0"), ("::1", None)],
)
def test_parse_proc_net_route_takes_the_most_specific_up_route(addr: str, iface: str | None) -> None:
    # 10.1.1.7: the /24 on down0 is more specific but not up; of the two /16s the lower metric wins
    assert nccl.parse_proc_net_route(PROC_NET_ROUTE, addr) == iface


def test_parse_ip_addr() -> None:
    text = (
        "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever\n"
        "4: eth0    inet 192.0.2.2/24 brd 192.0.2.255 scope global eth0\\       valid_lft forever\n"
        "5: veth1@if6    inet 10.9.0.11/24 scope global veth1\n"
        "4: eth0    inet6 fd00::2/64 scope global nodad \\       valid_lft forever\n"
    )
    assert nccl.parse_ip_addr(text) == {
        "127.0.0.1": "lo",
        "192.0.2.2": "eth0",
        "10.9.0.11": "veth1",
        "fd00::2": "eth0",
    }


# --------------------------------------------------------------------------------------------- signals


def test_signal_conflict() -> None:
    assert parse_signal("USR2") == parse_signal("SIGUSR2") == parse_signal(" usr2 ") == parse_signal("12") == 12
    assert parse_signal("12", numbers=False) is None and parse_signal("NOPE") is None and parse_signal("999") is None
    assert profiles.signal_conflict("12", "USR2") is not None
    assert "NCCL_PROXY_DUMP_SIGNAL=12" in (profiles.signal_conflict("12", "SIGUSR2") or "")
    assert profiles.signal_conflict("10", "USR2") is None  # USR1
    assert profiles.signal_conflict(None, "USR2") is None
