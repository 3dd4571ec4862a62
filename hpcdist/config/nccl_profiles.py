"""NCCL environment profiles (``hpcdist/resources/nccl/*.yaml`` or a path) read and checked, and signal names.

Torch-free and scheduler-free: cluster profiles (:mod:`hpcdist.config.cluster`) check the profile they name and
the preemption signal with it; :mod:`hpcdist.launch.nccl` resolves a profile in each task.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import yaml

from hpcdist import resources
from hpcdist.base import safe_yaml
from hpcdist.base.signals import parse_signal
from hpcdist.config.loader import ConfigError

__all__ = ["AUTO", "AUTO_VARS", "Profile", "expects_infiniband", "load_profile", "profile_names", "signal_conflict"]

AUTO = "auto"
AUTO_VARS = ("NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
_VAR_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")

Profile = dict[str, tuple[str, str]]
"""VAR -> (value, why)."""


# --------------------------------------------------------------------------------------------- profiles


def profile_names() -> list[str]:
    """Profiles shipped in hpcdist/resources/nccl/."""
    return resources.names("nccl")


def _profile_path(name: str) -> Path | None:
    if name in profile_names():
        return resources.path("nccl", name)
    path = Path(name).expanduser()
    return path if path.suffix in (".yaml", ".yml") or path.is_file() else None


def _read_profile(name: str, problems: list[str]) -> Profile:
    where = f"nccl profile {name!r}"
    path = _profile_path(name)
    if path is None:
        problems.append(f"{where}: unknown; choose one of {', '.join(profile_names())} or give a path to a YAML file")
        return {}
    try:
        data = safe_yaml.load_file(path)
    except OSError as e:
        problems.append(f"{where}: cannot read {str(path)!r}: {e.strerror}")
        return {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        problems.append(f"{where}: {str(path)!r} is not valid YAML: {getattr(e, 'problem', e)}")
        return {}
    if data is None:
        return {}
    if not isinstance(data, dict):
        problems.append(f"{where}: must be a mapping VAR: {{value: ..., why: ...}}, not {type(data).__name__}")
        return {}
    out: Profile = {}
    for var, entry in data.items():
        key = f"{where}: {var}"
        if not isinstance(var, str) or not _VAR_NAME.fullmatch(var):
            problems.append(f"{key}: not an environment variable name (upper case, digits, _)")
            continue
        if not isinstance(entry, dict):
            problems.append(f"{key}: must be a mapping {{value: ..., why: ...}}, got {entry!r}")
            continue
        unknown = sorted(str(k) for k in entry if k not in ("value", "why"))
        if unknown:
            problems.append(f"{key}: unknown key(s) {', '.join(unknown)}; valid keys: value, why")
        value, why = entry.get("value"), entry.get("why")
        # bool is refused: YAML turns `yes`/`on` into True, which would be exported as the string "True"
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            problems.append(f"{key}.value: must be a string or a number, got {value!r}")
            continue
        if not isinstance(why, str) or not why.strip():
            problems.append(f"{key}.why: give a one-line reason for the setting")
            continue
        text = str(value)
        if any(c in text for c in "\n\r\0"):
            problems.append(f"{key}.value: must be one line")
            continue
        if text == AUTO and var not in AUTO_VARS:
            problems.append(f"{key}.value: 'auto' is only understood for {', '.join(AUTO_VARS)}")
            continue
        out[var] = (text, why.strip())
    return out


def load_profile(name: str) -> Profile:
    """Read a profile by name (``profile_names()``) or path; ``"a,b"`` merges b over a.

    Raises :class:`hpcdist.config.ConfigError` listing every problem.
    """
    problems: list[str] = []
    merged: Profile = {}
    parts = [p.strip() for p in str(name).split(",")]
    if not any(parts):
        raise ConfigError([f"nccl profile {name!r}: empty name; choose one of {', '.join(profile_names())}"])
    for part in parts:
        if part:
            merged.update(_read_profile(part, problems))
    if problems:
        raise ConfigError(problems)
    return merged


def expects_infiniband(profile: Profile, environ: Mapping[str, str] | None = None) -> bool:
    """Whether a job run with ``profile`` relies on InfiniBand: the profile (or the job's environment, which wins
    as it does when the profile is applied) names NCCL_IB_HCA, and NCCL_IB_DISABLE is not 1. The health gate
    checks the IB ports only then: on an Ethernet cluster a DOWN port is nobody's concern."""
    env = environ or {}

    def value(var: str) -> str | None:
        if env.get(var, "").strip():
            return env[var].strip()
        return profile[var][0] if var in profile else None

    return value("NCCL_IB_DISABLE") != "1" and value("NCCL_IB_HCA") is not None


# --------------------------------------------------------------------------------------------- signals


def signal_conflict(proxy_dump_signal: str | None, preempt_signal: str | None) -> str | None:
    """Warning text when NCCL_PROXY_DUMP_SIGNAL is the preemption signal (NCCL would eat the warning)."""
    if not proxy_dump_signal or not preempt_signal:
        return None
    proxy, ours = parse_signal(proxy_dump_signal), parse_signal(preempt_signal)
    if proxy is None or proxy != ours:
        return None
    return (
        f"NCCL_PROXY_DUMP_SIGNAL={proxy_dump_signal} is the preemption signal {preempt_signal} ({ours}): NCCL's "
        "proxy thread would dump its state on it and the job may miss its checkpoint warning; use another signal"
    )
