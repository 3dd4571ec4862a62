"""Quantities as a person reads them in a log line or a plan (stdlib only: the planner prints them without torch)."""

from __future__ import annotations

__all__ = ["size_text"]


def size_text(n: float) -> str:
    """Bytes for a person: GB from 0.1 GB up, MB below."""
    return f"{n / 1e9:,.2f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"
