"""logging.profile: a torch.profiler trace of a few steps on every rank, and on CUDA an allocator memory snapshot.

Files (``RunDir.profile``): ``trace-rank-<r>.json``, Chrome trace format (open in https://ui.perfetto.dev or
chrome://tracing); ``memory-rank-<r>.pickle`` (CUDA, logging.profile.memory; open in https://pytorch.org/memory_viz).
docs/PROFILING.md explains them, and the NCCL flight-recorder dumps the hang watchdog writes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from hpcdist.base.logging_utils import get_logger
from hpcdist.base.rundir import RunDir

log = get_logger(__name__)


class StepProfiler:
    """Profiles steps ``start_step`` .. ``start_step + steps - 1`` (1-based); every call is a no-op outside them."""

    def __init__(self, run_dir: Path, *, rank: int, device: torch.device, start_step: int, steps: int, memory: bool):
        self.dir, self.rank, self.device = RunDir(run_dir).profile, rank, device
        self.first, self.last, self.memory = start_step, start_step + steps - 1, memory
        self.enabled = steps > 0
        self._prof: profile | None = None
        self._cuda_memory = memory and device.type == "cuda"

    def before_step(self, step: int) -> None:
        """Called with the number of the step about to run."""
        if not self.enabled or step != self.first or self._prof is not None:
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._prof = profile(activities=activities, profile_memory=self.memory, record_shapes=self.memory)
        if self._cuda_memory:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._prof.start()

    def after_step(self, step: int) -> None:
        """Called with the number of the step that just ended."""
        if self._prof is not None and step >= self.last:
            self.close()

    def close(self) -> None:
        """Stop and write the files (also when the run stops inside the window: what was recorded is kept)."""
        prof, self._prof = self._prof, None
        if prof is None:
            return
        prof.stop()
        self.dir.mkdir(parents=True, exist_ok=True)
        trace = self.dir / f"trace-rank-{self.rank:05d}.json"
        prof.export_chrome_trace(str(trace))  # written once, read by people only: no atomic replace needed
        if self._cuda_memory:
            torch.cuda.memory._dump_snapshot(str(self.dir / f"memory-rank-{self.rank:05d}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        if self.rank == 0:
            log.info("profile of steps %d-%d: %s (open in https://ui.perfetto.dev)", self.first, self.last, trace)
