"""Environment audit: what each rank sees (versions, GPUs, variables, HCAs, interfaces) and what is wrong with it.

:func:`collect_local` runs in every rank before any process group exists and returns a JSON-able record; rank 0
receives all records through the rendezvous store (so the audit is printed even when the process group then
fails to form) and :func:`findings` turns them into problems with a severity and a fix.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import platform
import re
import shutil
import socket
import struct
import subprocess
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpcdist import __version__ as hpcdist_version
from hpcdist.base.signals import parse_signal
from hpcdist.env import DistEnv

__all__ = ["Finding", "collect_local", "distinct", "field", "findings", "is_secret", "masked_environ"]

# Variables that shape communication. NCCL_*/GLOO_*/TORCH_NCCL_* are what the issue asks for; the others are
# the usual suspects next to them (libfabric and UCX transports, device visibility, the rendezvous).
_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "TORCH_CPP_LOG", "UCX_", "FI_", "HPCDIST_NCCL")
_NAMES = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
MASK = "****"
# Whole '_'-separated words, so NCCL_IB_PKEY (an InfiniBand partition key, not a secret) stays visible.
_SECRET_WORDS = {"TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS", "APIKEY", "PRIVATE"}
_SECRET_SUFFIXES = ("TOKEN", "SECRET", "PASSWORD", "APIKEY", "ACCESSKEY")
_TOPO_TIMEOUT_S = 10.0
_SIOCGIFADDR = 0x8915
_IFF_LOOPBACK = 0x8
# Findings about a version that differs between nodes: NCCL and torch must match (wire protocol, collective
# implementations); a different driver or Python usually works but is worth knowing.
_VERSION_SEVERITY = {"torch": "error", "cuda": "error", "nccl": "error", "hpcdist": "error", "driver": "warning"}
_VERSION_SEVERITY |= {"python": "warning"}


@dataclass(frozen=True)
class Finding:
    """One problem of the environment, with what to do about it."""

    severity: str  # "error" fails the verdict; "warning" and "info" are reported only
    code: str
    message: str
    fix: str
    hosts: tuple[str, ...] = ()


# ------------------------------------------------------------------------------------------------ collect


def is_secret(name: str) -> bool:
    """True for variable names that look like they hold a credential (HF_TOKEN, NCCL_X_API_KEY, ...)."""
    words = name.upper().split("_")
    return any(w in _SECRET_WORDS or (len(w) > 5 and w.endswith(_SECRET_SUFFIXES)) for w in words)


def masked_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The communication-related variables of ``environ``, secret-looking values replaced by ****."""
    out = {}
    for name in sorted(environ):
        if name.startswith(_PREFIXES) or name in _NAMES:
            out[name] = MASK if is_secret(name) else environ[name]
    return out


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def infiniband(sysfs_root: str | os.PathLike[str] = "/sys") -> list[dict[str, Any]]:
    """One entry per HCA port under <sysfs>/class/infiniband: state, physical state, rate, link layer."""
    root = Path(sysfs_root) / "class" / "infiniband"
    ports = []
    for hca in sorted(root.glob("*")) if root.is_dir() else []:
        for port in sorted((hca / "ports").glob("*")):
            ports.append(
                {
                    "hca": hca.name,
                    "port": port.name,
                    "state": _read(port / "state") or "",  # "4: ACTIVE"
                    "phys_state": _read(port / "phys_state") or "",  # "5: LinkUp"
                    "rate": _read(port / "rate") or "",  # "200 Gb/sec (4X HDR)"
                    "link_layer": _read(port / "link_layer") or "",  # "InfiniBand" or "Ethernet" (RoCE)
                }
            )
    return ports


def _ipv4(name: str) -> str | None:
    """Primary IPv4 address of an interface (SIOCGIFADDR), without needing the `ip` tool."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interfaces(
    sysfs_root: str | os.PathLike[str] = "/sys", ipv4: Callable[[str], str | None] = _ipv4
) -> list[dict[str, Any]]:
    """Network interfaces of this host (<sysfs>/class/net): state, MTU, speed, IPv4 address, loopback or not."""
    out = []
    net = Path(sysfs_root) / "class" / "net"
    for dev in sorted(net.glob("*")) if net.is_dir() else []:
        flags = _read(dev / "flags")
        speed = _read(dev / "speed")  # unreadable (EINVAL) for virtual links; -1 when down
        out.append(
            {
                "name": dev.name,
                "state": _read(dev / "operstate") or "",
                "mtu": int(_read(dev / "mtu") or 0),
                "speed_mbps": int(speed) if speed and speed.lstrip("-").isdigit() and int(speed) > 0 else None,
                "ipv4": ipv4(dev.name),
                "loopback": bool(int(flags, 16) & _IFF_LOOPBACK) if flags else dev.name == "lo",
            }
        )
    return out


def _resolve(host: str) -> list[str]:
    from hpcdist.launch.nccl import resolve_host  # lazy, like the profile: the core needs only hpcdist.env

    return resolve_host(host)


def _driver_version() -> str | None:
    text = _read(Path("/proc/driver/nvidia/version"))
    match = re.search(r"Kernel Module\s+(\S+)", text or "")
    return match.group(1) if match else None


def _nccl_version() -> str | None:
    if torch.version.cuda is None or not torch.distributed.is_nccl_available():
        return None
    try:
        version = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):
        return None
    return ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)


def _gpus(env: DistEnv) -> dict[str, Any]:
    info: dict[str, Any] = {"cuda_build": torch.version.cuda is not None, "count": 0, "names": [], "device": None}
    if not info["cuda_build"] or not torch.cuda.is_available():
        return info
    info["count"] = torch.cuda.device_count()
    info["names"] = [torch.cuda.get_device_name(i) for i in range(info["count"])]
    if env.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(env.torch_device())
        # the UUID tells two ranks that picked the same physical GPU apart from two that merely share an index
        info["device"] = {
            "name": props.name,
            "uuid": str(getattr(props, "uuid", "")),
            "memory_gb": props.total_memory / 1e9,
        }
    return info


def _nvidia_smi(*args: str) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        proc = subprocess.run([exe, *args], capture_output=True, text=True, timeout=_TOPO_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.rstrip() if proc.returncode == 0 else None


def collect_local(
    env: DistEnv,
    *,
    environ: Mapping[str, str] | None = None,
    sysfs_root: str | os.PathLike[str] = "/sys",
    profile: tuple[str, list[str]] | None = None,
    ipv4: Callable[[str], str | None] = _ipv4,
    resolve: Callable[[str], list[str]] = _resolve,
) -> dict[str, Any]:
    """What this rank sees, as a JSON-able record. Node-wide probes (nvidia-smi) run on local rank 0 only.

    ``sysfs_root``, ``ipv4`` (interface -> address) and ``resolve`` (host -> addresses) describe the host; tests
    give them a crafted host.
    """
    environ = os.environ if environ is None else environ
    node_probe = env.local_rank == 0
    physical = _nvidia_smi("-L") if node_probe else None
    return {
        "rank": env.rank,
        "local_rank": env.local_rank,
        "local_world_size": env.local_world_size,
        "node_rank": env.node_rank,
        "num_nodes": env.num_nodes,
        "hostname": env.hostname,
        "pid": os.getpid(),
        "backend": env.backend,
        "device": env.device,
        "master_addr": env.master_addr,
        "launcher": env.launcher,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "nccl": _nccl_version(),
            "driver": _driver_version(),
            "hpcdist": hpcdist_version,
        },
        "gpus": {**_gpus(env), "physical": len(physical.splitlines()) if physical else None},
        "env": masked_environ(environ),
        "profile": {"name": profile[0], "lines": profile[1]} if profile else None,
        "ib": infiniband(sysfs_root),
        "interfaces": interfaces(sysfs_root, ipv4),
        "hostname_addrs": resolve(env.hostname),
        "topo": _nvidia_smi("topo", "-m") if node_probe else None,
    }


# ----------------------------------------------------------------------------------------------- findings


def field(*path: str) -> Callable[[dict[str, Any]], Any]:
    """Getter of a nested record value: ``field("env", "NCCL_DEBUG")(rec)`` is ``rec["env"].get("NCCL_DEBUG")``."""

    def get(rec: dict[str, Any]) -> Any:
        value: Any = rec
        for part in path:
            value = value.get(part) if isinstance(value, dict) else None
        return value

    return get


def distinct(records: Iterable[dict[str, Any]], get: Callable[[dict[str, Any]], Any]) -> list[tuple[Any, list[int]]]:
    """[(value, ranks having it)] in order of first appearance; values compared by their repr."""
    groups: dict[str, tuple[Any, list[int]]] = {}
    for rec in records:
        value = get(rec)
        groups.setdefault(repr(value), (value, []))[1].append(rec["rank"])
    return list(groups.values())


def _by_host(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    hosts: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        hosts.setdefault(rec["hostname"], []).append(rec)
    return hosts


def _is_loopback_addr(addr: str) -> bool:
    if addr.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def _nccl_ifname_matches(value: str, names: list[str]) -> tuple[list[str], list[str]]:
    """NCCL_SOCKET_IFNAME semantics: prefixes, '=' exact names, '^' exclusions. -> (selected, unmatched items)."""
    exclude = value.startswith("^")
    body = value[1:] if exclude else value
    exact = body.startswith("=")
    items = [i for i in (body[1:] if exact else body).split(",") if i]

    def match(item: str, name: str) -> bool:
        return name == item if exact else name.startswith(item)

    if exclude:
        return [n for n in names if not any(match(i, n) for i in items)], []
    selected = [n for n in names if any(match(i, n) for i in items)]
    return selected, [i for i in items if not any(match(i, n) for n in names)]


def _signal_number(name: str) -> int | None:
    sig = parse_signal(name)
    return None if sig is None else int(sig)


def _versions(records: list[dict[str, Any]]) -> list[Finding]:
    out = []
    for key, severity in _VERSION_SEVERITY.items():
        groups = distinct(records, field("versions", key))
        if len(groups) < 2:
            continue
        hosts_of = {r["rank"]: r["hostname"] for r in records}
        parts = [f"{value or 'none'} on {', '.join(sorted({hosts_of[r] for r in ranks}))}" for value, ranks in groups]
        out.append(
            Finding(
                severity,
                f"{key}_version_mismatch",
                f"{key} version differs between nodes: {'; '.join(parts)}",
                f"run every node from the same software stack (container image or module set); {key} must match",
                tuple(sorted({r["hostname"] for r in records})),
            )
        )
    return out


def _ifnames(host: str, recs: list[dict[str, Any]], backend: str) -> list[Finding]:
    out: list[Finding] = []
    names = [i["name"] for i in recs[0]["interfaces"]]
    present = ", ".join(names) or "none"
    # gloo is used with NCCL too (nccl_check's control group, the trainer's CPU groups), so its variable always counts
    for var, used in (("NCCL_SOCKET_IFNAME", backend == "nccl"), ("GLOO_SOCKET_IFNAME", True)):
        for value, _ in distinct(recs, field("env", var)):
            if not value:
                continue
            if var.startswith("NCCL"):
                missing = _nccl_ifname_matches(value, names)[1]
            else:
                missing = [i for i in value.split(",") if i and i not in names]
            if not missing:
                continue
            # gloo raises on an unknown name; NCCL skips it and, with nothing left, fails at init.
            severity = "error" if used else "warning"
            out.append(
                Finding(
                    severity,
                    "ifname_missing",
                    f"{var}={value} on {host} names interface(s) {', '.join(missing)} that do not exist there "
                    f"(present: {present})",
                    f"set {var} to an interface present on every node (here: one of {present}), or unset it",
                    (host,),
                )
            )
    return out


def _loopback(host: str, recs: list[dict[str, Any]], backend: str, multi_host: bool) -> list[Finding]:
    if not multi_host:
        return []
    out = []
    ifaces = {i["name"]: i for i in recs[0]["interfaces"]}
    real = [i["name"] for i in ifaces.values() if not i["loopback"] and i["state"] in ("up", "unknown") and i["ipv4"]]
    suggest = real[0] if real else "<the interface that reaches the other nodes>"
    master = recs[0]["master_addr"]
    if _is_loopback_addr(master):
        out.append(
            Finding(
                "error",
                "loopback_master",
                f"MASTER_ADDR={master} on {host} in a multi-node job: ranks on other nodes look for the rendezvous on "
                "their own loopback",
                "let the launcher pick the master (srun: the first node of the step), or export MASTER_ADDR=<first "
                "node's hostname>",
                (host,),
            )
        )
    if not real:
        out.append(
            Finding(
                "error",
                "no_network",
                f"{host} has no non-loopback interface that is up with an IPv4 address",
                "check the node's network configuration (ip addr)",
                (host,),
            )
        )
    gloo = recs[0]["env"].get("GLOO_SOCKET_IFNAME", "")
    # gloo binds this way whatever the backend: NCCL jobs have gloo groups too (see _ifnames)
    listed = [i for i in gloo.split(",") if i]
    if listed and all(ifaces.get(i, {}).get("loopback", i == "lo") for i in listed):
        why = f"GLOO_SOCKET_IFNAME={gloo} is loopback only"
    elif not listed and not any(
        not _is_loopback_addr(a) and a in {i["ipv4"] for i in ifaces.values()} for a in recs[0]["hostname_addrs"]
    ):
        addrs = ", ".join(recs[0]["hostname_addrs"]) or "nothing"
        why = (
            f"GLOO_SOCKET_IFNAME is unset and hostname {host} resolves to {addrs}, not to a local non-loopback "
            "address, so gloo binds the loopback address"
        )
    else:
        why = ""
    if why:
        out.append(
            Finding(
                "error",
                "loopback_only",
                f"{why}: connections from other hosts will be refused",
                f"export GLOO_SOCKET_IFNAME={suggest} (the ethernet NCCL profile sets it per node)",
                (host,),
            )
        )
    nccl = recs[0]["env"].get("NCCL_SOCKET_IFNAME", "")
    if backend == "nccl" and nccl and not nccl.startswith("^"):
        selected, _ = _nccl_ifname_matches(nccl, list(ifaces))
        if selected and all(ifaces[n]["loopback"] for n in selected):
            out.append(
                Finding(
                    "error",
                    "loopback_only",
                    f"NCCL_SOCKET_IFNAME={nccl} selects only loopback on {host}",
                    f"export NCCL_SOCKET_IFNAME={suggest}",
                    (host,),
                )
            )
    return out


def _uuids(recs: list[dict[str, Any]]) -> list[str]:
    return [r["gpus"]["device"]["uuid"] for r in recs if r["gpus"].get("device") and r["gpus"]["device"]["uuid"]]


def _node_gpus(recs: list[dict[str, Any]]) -> int:
    """GPUs of one host: nvidia-smi's count, else what its ranks see (srun --gpus-per-task shows each rank only
    its own GPU, so distinct devices count too)."""
    physical = next((r["gpus"]["physical"] for r in recs if r["gpus"]["physical"] is not None), None)
    if physical is not None:
        return physical
    return max(max(r["gpus"]["count"] for r in recs), len(set(_uuids(recs))))


def _hcas_and_gpus(host: str, recs: list[dict[str, Any]], max_gpus: int) -> list[Finding]:
    out = []
    rec = recs[0]
    active = sorted({p["hca"] for p in rec["ib"] if "ACTIVE" in p["state"] and p["link_layer"] == "InfiniBand"})
    if active and rec["env"].get("NCCL_IB_DISABLE", "").strip() == "1":
        out.append(
            Finding(
                "warning",
                "ib_disabled",
                f"NCCL_IB_DISABLE=1 on {host} although InfiniBand HCAs are active ({', '.join(active)}): NCCL sends "
                "inter-node traffic over TCP sockets, typically 5-10x slower",
                "unset NCCL_IB_DISABLE (the ethernet NCCL profile sets it; use ib_a100 on InfiniBand clusters)",
                (host,),
            )
        )
    node_gpus = _node_gpus(recs)
    if active and 0 < len(active) < node_gpus:
        out.append(
            Finding(
                "warning",
                "few_hcas",
                f"{host} has {len(active)} active InfiniBand HCA(s) for {node_gpus} GPUs: GPUs share NICs and "
                "inter-node bandwidth per GPU drops accordingly",
                "check for HCAs whose port is down (ibstat) or missing from the node; on a rail-optimized fabric "
                "every GPU has its own HCA",
                (host,),
            )
        )
    if not rec["gpus"]["cuda_build"]:
        return out
    if node_gpus < max_gpus:
        out.append(
            Finding(
                "error",
                "gpu_missing",
                f"{host} shows {node_gpus} GPU(s), other nodes {max_gpus}",
                f"drain {host} and check it (nvidia-smi, dmesg for Xid / 'fallen off the bus')",
                (host,),
            )
        )
    for value, ranks in distinct(recs, lambda r: r["env"].get("CUDA_VISIBLE_DEVICES")):
        listed = [d for d in (value or "").split(",") if d.strip()]
        seen = min(r["gpus"]["count"] for r in recs if r["rank"] in ranks)
        if value is not None and len(listed) > seen:
            out.append(
                Finding(
                    "error",
                    "gpu_missing",
                    f"CUDA_VISIBLE_DEVICES={value} on {host} lists {len(listed)} GPU(s) but only {seen} are usable",
                    f"check the GPUs of {host} (nvidia-smi); a GPU that fell off the bus needs a node reboot",
                    (host,),
                )
            )
    if recs[0]["backend"] == "nccl" and len(recs) > node_gpus:
        out.append(
            Finding(
                "error",
                "gpu_missing",
                f"{len(recs)} ranks on {host} but only {node_gpus} GPU(s)",
                "start one task per GPU (srun --ntasks-per-node = --gpus-per-node)",
                (host,),
            )
        )
    uuids = _uuids(recs)
    if len(uuids) != len(set(uuids)):
        out.append(
            Finding(
                "error",
                "gpu_shared",
                f"two or more ranks on {host} use the same GPU",
                "bind one GPU per task (LOCAL_RANK -> cuda:LOCAL_RANK, or srun --gpus-per-task=1)",
                (host,),
            )
        )
    return out


def findings(
    records: list[dict[str, Any]], *, backend: str, requeue_signal: str = "USR2", expected_hosts: int = 1
) -> list[Finding]:
    """Problems in the joined ranks' records, errors first. ``expected_hosts`` counts hosts that never joined."""
    records = sorted(records, key=lambda r: r["rank"])
    hosts = _by_host(records)
    multi_host = max(len(hosts), expected_hosts, max((r["num_nodes"] for r in records), default=1)) > 1
    out = _versions(records)
    max_gpus = max((_node_gpus(recs) for recs in hosts.values()), default=0)
    want = _signal_number(requeue_signal)
    for host, recs in hosts.items():
        out += _ifnames(host, recs, backend)
        out += _loopback(host, recs, backend, multi_host)
        out += _hcas_and_gpus(host, recs, max_gpus)
        dump = recs[0]["env"].get("NCCL_PROXY_DUMP_SIGNAL")
        if dump and want is not None and _signal_number(dump) == want:
            out.append(
                Finding(
                    "error",
                    "proxy_dump_signal",
                    f"NCCL_PROXY_DUMP_SIGNAL={dump} on {host} is the requeue signal {requeue_signal} ({want}): NCCL's "
                    "proxy thread takes it, so the job misses its checkpoint-and-requeue warning",
                    "unset NCCL_PROXY_DUMP_SIGNAL or pick a signal SLURM does not send (e.g. SIGUSR1 when requeueing "
                    "on USR2)",
                    (host,),
                )
            )
    if records and not records[0]["gpus"]["cuda_build"]:
        out.append(Finding("info", "cpu_build", "torch is a CPU build: GPU, driver and NCCL checks are skipped", ""))
    order = {"error": 0, "warning": 1, "info": 2}
    return sorted(out, key=lambda f: order[f.severity])
