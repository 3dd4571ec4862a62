"""The names nccl_check's command line offers, without torch: collectives and element types.

The parser (and so `nccl_check --help`) needs only these strings; the modules that run them map each name to
torch (``collectives.OPS`` is this tuple, ``runner.DTYPES`` maps these names to torch dtypes).
"""

from __future__ import annotations

__all__ = ["DTYPE_NAMES", "OPS"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "sendrecv")
DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")
