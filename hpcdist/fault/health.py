"""The health gate's protocol, torch-free, for both of its sides: the command line the attempt loop runs once per
node (hpcdist.launch.attempts), the verdicts it reads back from srun's output, and the failures.jsonl record of an
unhealthy node. The checks themselves are hpcdist.diagnostics.gate (``hpcdist health``); this module sits below
both packages so the launcher can run the gate without importing the diagnostics (which import the launcher's NCCL
environment)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from hpcdist.base.untrusted import parse_jsonl
from hpcdist.fault.failures import record
from hpcdist.schedulers import JobFacts

__all__ = [
    "DEFAULT_DEVICE_TIMEOUT_S",
    "DEFAULT_TIMEOUT_S",
    "gate_wall_s",
    "health_argv",
    "read_verdicts",
    "record_unhealthy",
]

# The fast checks (tools, sysfs, disk) answer in well under a second on a healthy node: 30 s is generous.
DEFAULT_TIMEOUT_S = 30.0
# The device checks import torch and start CUDA first: from Lustre/GPFS, with every node of the job reading the same
# files at once, a cold import alone can take a minute; a healthy node must not fail for it.
DEFAULT_DEVICE_TIMEOUT_S = 120.0


def gate_wall_s(timeout_s: float = DEFAULT_TIMEOUT_S, device_timeout_s: float = DEFAULT_DEVICE_TIMEOUT_S) -> float:
    """The longest the gate itself can take on a node: its fast and its device checks run side by side."""
    return max(timeout_s, device_timeout_s)


def record_unhealthy(
    run_dir: str | os.PathLike[str], host: str, reasons: Sequence[str], *, job: JobFacts | None = None
) -> dict[str, Any]:
    """Append the gate's verdict on ``host`` to <run_dir>/failures.jsonl: kind ``health``, blaming the host (not a
    rank: none started there), so the restart policy excludes it and ``hpcdist status`` shows why."""
    cause = "failed the health gate: " + ("; ".join(reasons) or "no reason given")
    return record(run_dir, kind="health", cause=cause, host=host, blame=[{"rank": None, "host": host}], job=job)


def health_argv(
    *,
    gpus: int | None = None,
    run_dir: str | os.PathLike[str] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    device_timeout_s: float = DEFAULT_DEVICE_TIMEOUT_S,
    python: str = sys.executable,
) -> list[str]:
    """The gate's command line for one task per node (``srun --ntasks-per-node=1 <this>``), with ``--json``.
    ``gpus``: the GPUs the job asked the scheduler for on each node (None: it asked for none)."""
    argv = [python, "-m", "hpcdist", "health", "--json", "--timeout", f"{timeout_s:g}"]
    argv += ["--device-timeout", f"{device_timeout_s:g}"]
    if gpus is not None:
        argv += ["--gpus", str(gpus)]
    if run_dir is not None:
        argv += ["--run-dir", str(run_dir)]
    return argv


_VERDICT_BYTES = 1 << 20  # one JSON line per node; srun's own lines and the tasks' stderr in between


def read_verdicts(output: str, hosts: Sequence[str]) -> dict[str, list[str]]:
    """host -> reasons ([] = healthy) from the JSON lines ``srun ... hpcdist health --json`` printed (untrusted:
    other lines, cut lines and odd values are skipped). A host of ``hosts`` with no verdict is unhealthy: its
    gate did not answer (the node is down, srun could not start it, or it was killed at srun's time limit)."""
    verdicts: dict[str, list[str]] = {}
    for doc in parse_jsonl(output[-_VERDICT_BYTES:]):
        if not isinstance(doc.get("host"), str) or not isinstance(doc.get("ok"), bool):
            continue
        reasons = doc.get("reasons")
        reasons = [str(r)[:500] for r in reasons[:20]] if isinstance(reasons, list) else []
        verdicts[doc["host"]] = [] if doc["ok"] else (reasons or ["the health gate said unhealthy, without a reason"])
    return {
        host: verdicts.get(host, ["no verdict from the health gate (node down, not started or timed out)"])
        for host in hosts
    }
