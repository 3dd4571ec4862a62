"""hpcdist: train Llama-style language models on SLURM GPU clusters from one YAML config."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpcdist.launch.submit import submit, submit_chain
    from hpcdist.launch.sweep import submit_sweep

__version__ = "0.1.0"
__all__ = ["__version__", "submit", "submit_chain", "submit_sweep"]


def __getattr__(name: str) -> Any:
    # Lazy: `import hpcdist` stays cheap (no torch, no submitit) for the CLI and for tasks that only need
    # hpcdist.env; `hpcdist.submit(...)` imports the launcher on first use.
    if name in ("submit", "submit_chain"):
        import importlib

        # the module itself: the package hpcdist.launch binds the name ``submit`` to the function
        return getattr(importlib.import_module("hpcdist.launch.submit"), name)
    if name == "submit_sweep":
        from hpcdist.launch.sweep import submit_sweep

        return submit_sweep
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
