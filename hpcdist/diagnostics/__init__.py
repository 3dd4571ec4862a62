"""nccl_check's core: a communication diagnostic that says what is wrong and where.

Modules, in the order a run uses them:

- ``audit``       what each rank sees (versions, GPUs, NCCL/GLOO variables, HCAs, interfaces) and findings
- ``rendezvous``  joining through rank 0's TCPStore under a deadline, naming ranks that never arrive
- ``watchdog``    progress markers + a thread that reports which ranks a hung step is waiting for
- ``health``      allocate + matmul per device against a CPU reference
- ``collectives`` nccl-tests' sweep (time, algbw, busbw, #wrong) through torch.distributed
- ``finder``      pairwise transfers ranking ranks and hosts by bandwidth; the --exclude list
- ``verdict``     expected busbw of a cluster profile; PASS/FAIL with every reason
- ``report``      human tables and the JSON document
- ``plot``        the sweep's bandwidth curves and the finder's heat maps as one PNG (``--plot``)
- ``runner``      one rank from start to verdict; ``cli`` the command line and local launcher
- ``faults``      TEST-ONLY fault injection (HPCDIST_NCCL_CHECK_* variables)
- ``names``       the torch-free names the parser offers (collectives, dtypes), so ``--help`` imports no torch
- ``gate``        the per-node health gate (``hpcdist health``): GPUs, ``health``'s matmul, ECC/Xid, IB ports, disk

Needs only ``hpcdist.env`` (and, when an NCCL profile is named, ``hpcdist.launch.nccl`` to apply it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpcdist.diagnostics.names import OPS

if TYPE_CHECKING:
    from hpcdist.diagnostics.collectives import bandwidths, busbw_factor
    from hpcdist.diagnostics.runner import Options, run_rank

__all__ = ["OPS", "Options", "bandwidths", "busbw_factor", "run_rank"]
_LAZY = {"bandwidths": "collectives", "busbw_factor": "collectives", "Options": "runner", "run_rank": "runner"}


def __getattr__(name: str) -> Any:
    # Lazy: importing the package (as `nccl_check --help` does for its parser) must not import torch.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"hpcdist.diagnostics.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
