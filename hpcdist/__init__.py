"""hpcdist: train Llama-style language models on SLURM GPU clusters from one YAML config."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpcdist.launch.submit import submit

__version__ = "0.1.0"
__all__ = ["__version__", "submit"]


def __getattr__(name: str) -> Any:
    # Lazy: `import hpcdist` stays cheap (no torch, no submitit) for the CLI and for tasks that only need
    # hpcdist.env; `hpcdist.submit(...)` imports the launcher on first use.
    if name == "submit":
        from hpcdist.launch.submit import submit

        return submit
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
