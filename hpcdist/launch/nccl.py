"""NCCL / torch.distributed environment profiles resolved in each task (read by :mod:`hpcdist.config.nccl_profiles`).

A profile maps variables to a value and a one-line reason. The value ``auto`` is resolved where the task
runs, because interface and HCA names differ between hosts of one job:

- ``NCCL_IB_HCA=auto``: the HCAs under ``/sys/class/infiniband`` with an active InfiniBand port;
- ``NCCL_SOCKET_IFNAME=auto`` / ``GLOO_SOCKET_IFNAME=auto``: the interface whose route reaches the master.

A variable already set (non-empty) in the environment always wins: the user knows their fabric. The submitted
job names the profile in ``HPCDIST_NCCL_PROFILE``; ``hpcdist train`` applies it before the process group exists.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import socket
import stat
import struct
import subprocess
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from hpcdist.config.nccl_profiles import AUTO, load_profile

__all__ = ["PROFILE_ENV", "IbPort", "NetLookup", "apply_to_environ", "ib_ports", "resolve_env", "resolve_host"]

PROFILE_ENV = "HPCDIST_NCCL_PROFILE"
_IP_TIMEOUT_S = 5.0

# --------------------------------------------------------------------------------------------- network


def resolve_host(host: str) -> list[str]:
    """Addresses of ``host``, IPv4 first (NCCL and gloo bootstrap prefer it); [] if it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return []
    addrs = [str(info[4][0]) for info in infos if info[0] == socket.AF_INET]
    addrs += [str(info[4][0]).split("%")[0] for info in infos if info[0] == socket.AF_INET6]
    return list(dict.fromkeys(addrs))


def _run_ip(*args: str) -> str | None:
    exe = shutil.which("ip")
    if exe is None:
        return None
    try:
        proc = subprocess.run([exe, *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def parse_route_get(text: str) -> str | None:
    """Interface of ``ip -o route get ADDR`` output ("10.0.0.7 via 10.0.0.1 dev ib0 src ...")."""
    match = re.search(r"\bdev\s+(\S+)", text)
    return match.group(1) if match else None


def parse_proc_net_route(text: str, addr: str) -> str | None:
    """Interface of the most specific up route to IPv4 ``addr`` in /proc/net/route text (lowest metric on ties)."""
    try:
        target = int(ipaddress.IPv4Address(addr))
    except ValueError:
        return None
    best: tuple[int, int, str] | None = None  # (-prefix length, metric, iface): min() is the best route
    for line in text.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 8:
            continue
        try:
            # the kernel prints the network-order u32 as a host-order (little-endian) hex number
            dest, flags, metric, mask = (int(cols[i], 16) for i in (1, 3, 6, 7))
        except ValueError:
            continue
        if not flags & 0x1:  # RTF_UP
            continue
        dest_ip = int(ipaddress.IPv4Address(struct.pack("<I", dest)))
        mask_ip = int(ipaddress.IPv4Address(struct.pack("<I", mask)))
        if target & mask_ip == dest_ip & mask_ip:
            key = (-bin(mask_ip).count("1"), metric, cols[0])
            best = key if best is None or key < best else best
    return best[2] if best else None


def route_iface(addr: str) -> str | None:
    """Interface the kernel routes ``addr`` through: ``ip -o route get``, else /proc/net/route (IPv4)."""
    out = _run_ip("-o", "route", "get", addr)
    if out:
        return parse_route_get(out)
    try:
        return parse_proc_net_route(Path("/proc/net/route").read_text(), addr)
    except OSError:
        return None


def default_iface() -> str | None:
    """Interface of the IPv4 default route, if there is one."""
    try:
        return parse_proc_net_route(Path("/proc/net/route").read_text(), "0.0.0.0")
    except OSError:
        out = _run_ip("-o", "route", "show", "default")
        return parse_route_get(out) if out else None


def parse_ip_addr(text: str) -> dict[str, str]:
    """address -> interface from ``ip -o addr show`` output ("4: eth0    inet 10.0.0.2/24 brd ...")."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        match = re.match(r"\s*\d+:\s+(\S+?)(?:@\S+)?\s+inet6?\s+([^/\s]+)", line)
        if match:
            out.setdefault(match.group(2), match.group(1))
    return out


def iface_owning(addr: str) -> str | None:
    """The local interface that carries ``addr``; None when ``addr`` is not an address of this host."""
    out = _run_ip("-o", "addr", "show")
    if out is not None:
        return parse_ip_addr(out).get(addr)
    # No `ip` tool: ask the kernel for each interface's IPv4 address (SIOCGIFADDR).
    try:
        import fcntl

        packed = socket.inet_aton(addr)
    except (ImportError, OSError):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                if fcntl.ioctl(s.fileno(), 0x8915, req)[20:24] == packed:
                    return name
            except OSError:
                continue
    return None


@dataclass(frozen=True)
class NetLookup:
    """How interfaces are found; tests replace the pieces with fakes."""

    resolve: Callable[[str], list[str]] = resolve_host
    local_iface: Callable[[str], str | None] = iface_owning
    route_iface: Callable[[str], str | None] = route_iface
    default_iface: Callable[[], str | None] = default_iface


_LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")


def _is_loopback_literal(host: str) -> bool:
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def auto_ifname(master_addr: str, net: NetLookup) -> tuple[str | None, str]:
    """(interface that reaches ``master_addr`` from this host, or None; a note saying how it was found)."""
    addrs = net.resolve(master_addr)
    if not addrs:
        return None, f"master {master_addr!r} does not resolve on this host"
    addr = addrs[0]
    shown = master_addr if addr == master_addr else f"{master_addr} ({addr})"
    if ipaddress.ip_address(addr).is_loopback:
        if _is_loopback_literal(master_addr):
            return net.local_iface(addr) or "lo", f"master {shown} is loopback: a single-host job"
        # Debian maps the own hostname to 127.0.1.1: this host is the master, but other hosts reach it through
        # a real interface. Binding to loopback would refuse them (gloo's "Using the loopback address").
        iface = net.default_iface()
        if iface:
            return iface, f"master {shown} is this host via loopback; using the default-route interface"
        return "lo", f"master {shown} is this host via loopback and there is no default route: single host only"
    owner = net.local_iface(addr)
    if owner:
        return owner, f"master {shown} is this host's address on {owner}"
    iface = net.route_iface(addr)
    if iface:
        return iface, f"route to master {shown} goes through {iface}"
    return None, f"no route to master {shown}"


_SYSFS_VALUE_BYTES = 256  # a sysfs attribute such as "4: ACTIVE" or "InfiniBand" is a few bytes
_MAX_HCAS = 256  # a node has a handful; a planted tree of thousands is not walked


@dataclass(frozen=True)
class IbPort:
    """One port of an HCA as sysfs describes it: ``state`` reads ``4: ACTIVE``; ``link_layer`` is ``InfiniBand``
    or ``Ethernet`` (RoCE); "" when the attribute could not be read. ``port`` is None for an HCA without a
    ports directory (an unknown layout)."""

    hca: str
    port: str | None
    state: str
    link_layer: str

    @property
    def active(self) -> bool:
        return "ACTIVE" in self.state

    @property
    def infiniband(self) -> bool:
        """An InfiniBand port, or one whose link layer sysfs does not say (kept: NCCL decides)."""
        return self.link_layer in ("InfiniBand", "")


def _within(path: Path, root: Path) -> bool:
    """Whether ``path``, its links resolved, stays inside ``root`` (/sys/class/infiniband/X links into
    /sys/devices/...: followed; a link out of the sysfs tree: not)."""
    try:
        return path.resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError):  # a link loop
        return False


def _read_sysfs_value(path: Path, root: Path) -> str:
    """One short sysfs attribute, stripped; "" when it is missing, outside ``root``, not a regular file (a FIFO
    in a fake tree never blocks: O_NONBLOCK) or unreadable. Never more than _SYSFS_VALUE_BYTES."""
    if not _within(path, root):
        return ""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        return os.read(fd, _SYSFS_VALUE_BYTES).decode("ascii", "replace").strip()
    except OSError:
        return ""
    finally:
        os.close(fd)


def ib_ports(sysfs_root: str | os.PathLike[str] = "/sys") -> list[IbPort]:
    """Every port of every HCA under ``<sysfs_root>/class/infiniband`` (sorted; [] when there is none), read
    boundedly, never following a link out of ``sysfs_root``. An HCA without a ports directory is one
    ``IbPort(port=None)`` with empty state."""
    root = Path(sysfs_root)
    base = root / "class" / "infiniband"
    if not base.is_dir():
        return []
    out: list[IbPort] = []
    for dev in sorted(base.iterdir())[:_MAX_HCAS]:
        if not _within(dev, root):
            continue
        ports_dir = dev / "ports"
        names = sorted(p.name for p in ports_dir.iterdir())[:_MAX_HCAS] if ports_dir.is_dir() else []
        if not names:
            out.append(IbPort(dev.name, None, "", ""))
        for name in names:
            port = ports_dir / name
            state, layer = (_read_sysfs_value(port / attr, root) for attr in ("state", "link_layer"))
            out.append(IbPort(dev.name, name, state, layer))
    return out


def auto_hcas(sysfs_root: str | os.PathLike[str] = "/sys") -> tuple[str | None, str]:
    """(NCCL_IB_HCA value naming the HCAs with an active InfiniBand port, or None; a note)."""
    root = Path(sysfs_root) / "class" / "infiniband"
    ports = ib_ports(sysfs_root)
    if not ports:
        return None, f"no HCAs under {root}"
    by_hca: dict[str, list[IbPort]] = {}
    for port in ports:
        by_hca.setdefault(port.hca, []).append(port)
    chosen, skipped = [], []
    for hca, its in by_hca.items():
        # a port reads "4: ACTIVE"; link_layer "InfiniBand" or "Ethernet" (RoCE). Unknown layouts are kept.
        usable = any(p.port is None or (p.active and p.infiniband) for p in its)
        (chosen if usable else skipped).append(hca)
    note = f"active InfiniBand HCAs under {root}"
    if skipped:
        note += f" (skipped, no active IB port: {', '.join(skipped)})"
    if not chosen:
        return None, note
    # '=' makes NCCL match names exactly: without it "mlx5_1" also selects mlx5_10, mlx5_11, ...
    return "=" + ",".join(chosen), note


# --------------------------------------------------------------------------------------------- resolution


def resolve_env(
    profile: Mapping[str, tuple[str, str]],
    environ: Mapping[str, str],
    *,
    master_addr: str,
    sysfs_root: str | os.PathLike[str] = "/sys",
    net: NetLookup | None = None,
) -> tuple[dict[str, str], list[str]]:
    """The variables to set for ``profile`` in a task whose environment is ``environ``, and log lines.

    Values already set (non-empty) in ``environ`` are kept and reported; ``auto`` values that cannot be
    determined are left unset with a note, so NCCL's own detection takes over.
    """
    net = net or NetLookup()
    to_set: dict[str, str] = {}
    lines: list[str] = []
    ifname: tuple[str | None, str] | None = None  # computed once for NCCL and gloo
    for var, (value, why) in profile.items():
        current = environ.get(var, "")
        if current.strip():
            lines.append(f"{var}={current} (kept from the environment; the profile says {value}: {why})")
            continue
        note = ""
        if value == AUTO and var == "NCCL_IB_HCA":
            found, note = auto_hcas(sysfs_root)
        elif value == AUTO:
            ifname = ifname or auto_ifname(master_addr, net)
            found, note = ifname
            if found and var == "NCCL_SOCKET_IFNAME":
                found = "=" + found  # exact match: "eth1" would also select eth10
        else:
            found = value
        if found is None:
            lines.append(f"{var} left unset: {note}")
            continue
        to_set[var] = found
        lines.append(f"{var}={found} ({note + '; ' if note else ''}{why})")
    return to_set, lines


def apply_to_environ(
    profile_name: str | None,
    *,
    master_addr: str,
    environ: MutableMapping[str, str] = os.environ,
    sysfs_root: str | os.PathLike[str] = "/sys",
    net: NetLookup | None = None,
) -> list[str]:
    """Resolve ``profile_name`` for this task and set the result in ``environ``; returns log lines.

    A no-op for None or "" (no profile requested). Must run in every task, before the process group is
    created: NCCL and gloo read these variables at init, and each host may name its interfaces differently.
    """
    if not profile_name:
        return []
    to_set, lines = resolve_env(
        load_profile(profile_name), environ, master_addr=master_addr, sysfs_root=sysfs_root, net=net
    )
    environ.update(to_set)
    return [f"nccl profile {profile_name}: {len(to_set)} variable(s) set on {socket.gethostname()}", *lines]
