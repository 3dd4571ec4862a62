"""TEST-ONLY fault injection for nccl_check, read from the environment here and nowhere else.

These variables exist so the tests can prove that the tool names a faulty rank; never set them on a real job.
Every rank reads them; a fault applies to the rank whose number is given:

    HPCDIST_NCCL_CHECK_INJECT_WRONG_RANK=R   rank R adds 1 to the first element of every result it checks
    HPCDIST_NCCL_CHECK_DELAY_RANK=R          rank R sleeps HPCDIST_NCCL_CHECK_DELAY_S (default 0.02) before each
                                             timed collective and each slow-node-finder transfer
    HPCDIST_NCCL_CHECK_HANG_RANK=R           rank R stops at HPCDIST_NCCL_CHECK_HANG_AT (join: before the
                                             rendezvous; sweep: before its first collective of the sweep) and
                                             sleeps HPCDIST_NCCL_CHECK_HANG_S (default 3600)

An active fault is printed in the report header and listed in the JSON, so a result produced with one is never
mistaken for a real measurement.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

__all__ = ["PREFIX", "Faults"]

PREFIX = "HPCDIST_NCCL_CHECK_"
HANG_POINTS = ("join", "sweep")


@dataclass(frozen=True)
class Faults:
    """The injected faults of one run (all None: none)."""

    wrong_rank: int | None = None
    delay_rank: int | None = None
    delay_s: float = 0.02
    hang_rank: int | None = None
    hang_at: str = "sweep"
    hang_s: float = 3600.0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Faults:
        """Parse the HPCDIST_NCCL_CHECK_* variables; a malformed value raises ValueError naming it."""
        env = os.environ if environ is None else environ

        def number(name: str, kind: Callable[[str], float | int], default: float | int | None) -> float | int | None:
            raw = env.get(PREFIX + name, "").strip()
            if not raw:
                return default
            try:
                value = kind(raw)
            except ValueError:
                raise ValueError(f"{PREFIX}{name}={raw!r} is not a valid {kind.__name__}") from None
            if value < 0:
                raise ValueError(f"{PREFIX}{name}={raw!r} must be >= 0")
            return value

        hang_at = env.get(PREFIX + "HANG_AT", "").strip() or "sweep"
        if hang_at not in HANG_POINTS:
            raise ValueError(f"{PREFIX}HANG_AT={hang_at!r} must be one of {', '.join(HANG_POINTS)}")
        return cls(
            wrong_rank=number("INJECT_WRONG_RANK", int, None),  # type: ignore[arg-type]
            delay_rank=number("DELAY_RANK", int, None),  # type: ignore[arg-type]
            delay_s=float(number("DELAY_S", float, 0.02)),  # type: ignore[arg-type]
            hang_rank=number("HANG_RANK", int, None),  # type: ignore[arg-type]
            hang_at=hang_at,
            hang_s=float(number("HANG_S", float, 3600.0)),  # type: ignore[arg-type]
        )

    def describe(self) -> list[str]:
        """One line per active fault (empty when none)."""
        out = []
        if self.wrong_rank is not None:
            out.append(f"rank {self.wrong_rank} corrupts every checked result (INJECT_WRONG_RANK)")
        if self.delay_rank is not None:
            out.append(f"rank {self.delay_rank} sleeps {self.delay_s:g} s before each timed operation (DELAY_RANK)")
        if self.hang_rank is not None:
            out.append(f"rank {self.hang_rank} hangs at {self.hang_at} for {self.hang_s:g} s (HANG_RANK)")
        return out

    def hang(self, rank: int, where: str) -> None:
        """Block this rank when it is the one told to hang at ``where``."""
        if self.hang_rank == rank and self.hang_at == where:
            time.sleep(self.hang_s)

    def delayed(self, rank: int, fn: Callable[[], object]) -> Callable[[], object]:
        """``fn`` itself, or on the delayed rank ``fn`` preceded by a sleep (chosen once: no cost when unused)."""
        if self.delay_rank != rank:
            return fn
        delay = self.delay_s

        def slow() -> object:
            time.sleep(delay)
            return fn()

        return slow

    def corrupt(self, rank: int, result: torch.Tensor) -> None:
        """On the wrong rank, change one element of a result before it is checked."""
        if self.wrong_rank == rank and result.numel():
            flat = result.view(-1)
            flat[0] += 1
