"""NaN triage (``train.nonfinite_triage``): re-run a non-finite step once to tell bad data from bad hardware.

The step's update was dropped (``optimizer_step(skip_nonfinite=True)``: parameters, optimizer and LR state are
untouched, gradients zeroed; Strategy._update), so forward and backward run again on the same inputs, on the same
rank, from the state before the step. The re-run's gradient norm is global, so every rank sees the same outcome:

* non-finite again (reproducible): **data**. The suspects are the samples whose own loss is non-finite (each row
  run alone, every strategy but a pipeline: Strategy.sample_losses), else the batches of the ranks whose loss was,
  else the whole step's batch. With ``train.nonfinite=skip`` they are skipped from then on (the sampler passes over
  them) and listed in <run.dir>/skipped_samples.json, read at start-up, so a resume skips them too; with ``stop``
  the run stops naming them.
* finite (not reproducible): **hardware**. The ranks with their own evidence of the first attempt (a non-finite
  local loss, else non-finite local gradients where not every rank has them: DDP's reduce spreads one rank's NaN)
  are blamed in one ``hardware`` record in failures.jsonl, so the restart policy excludes their hosts; the run stops.

One all-reduce (MAX) of a small int vector carries every rank's flags and suspect ids, so all ranks reach the same
verdict and leave the triage together. Anchor: Megatron-Core's rerun state machine (re-run on the same GPU).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpcdist.atomic import UntrustedFile, atomic_write, read_trusted
from hpcdist.fault import failures
from hpcdist.fault.nonfinite import NonFiniteError
from hpcdist.logging_utils import get_logger
from hpcdist.rundir import RunDir

__all__ = ["SkippedSamples", "Triage", "TriageVerdict"]

log = get_logger(__name__)

_MAX_FILE_BYTES = 1 << 20  # ~50k ids: far more than max_nonfinite_skips ever lets a run collect
_MAX_ID = 1 << 62  # a blend's ids are global positions: large, never this large
_LOSS, _GRADS = 1, 2  # flag bits, first attempt
_LOSS2 = 4  # flag bit, re-run


class TriageVerdict:
    def __init__(self, kind: str, ids: list[int], blamed: list[int], why: str):
        self.kind, self.ids, self.blamed, self.why = kind, ids, blamed, why


class SkippedSamples:
    """<run.dir>/skipped_samples.json: ``{"num_samples": N, "ids": [...], "why": {id: text}}``, written by rank 0,
    read by every rank at start-up. Another user could have written it: read only if trusted (hpcdist.atomic),
    bounded, every id validated; a file made for other data is refused naming the fix."""

    def __init__(self, run_dir: str | os.PathLike[str]):
        self.path = RunDir(run_dir).skipped_samples

    def load(self, num_samples: int) -> dict[int, str]:
        try:
            raw = read_trusted(self.path, _MAX_FILE_BYTES)
        except UntrustedFile as e:
            raise ValueError(f"{e}; remove it to train on every sample") from None
        if raw is None:
            return {}
        fix = f"{self.path}: remove it (the samples it lists are then trained on again)"
        try:
            doc = json.loads(raw)
        except ValueError:
            raise ValueError(f"{fix}: not JSON") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("ids"), list):
            raise ValueError(f"{fix}: expected an object with an 'ids' list")
        if doc.get("num_samples") != num_samples:
            raise ValueError(
                f"{self.path} lists samples of a dataset of {doc.get('num_samples')!r} samples, this run's has "
                f"{num_samples}: the data changed since; {fix.split(': ', 1)[1]}"
            )
        why = doc.get("why") if isinstance(doc.get("why"), dict) else {}
        out: dict[int, str] = {}
        for i in doc["ids"]:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < _MAX_ID:
                raise ValueError(f"{fix}: {i!r} is not a sample id")
            out[i] = str(why.get(str(i), ""))[:300]
        return out

    def save(self, num_samples: int, skipped: dict[int, str]) -> None:
        doc = {"num_samples": num_samples, "ids": sorted(skipped), "why": {str(i): w for i, w in skipped.items()}}
        atomic_write(self.path, json.dumps(doc, indent=1) + "\n")


class Triage:
    def __init__(
        self,
        *,
        strategy: Any,
        rank: int,
        world_size: int,
        dp_rank: int,
        global_batch_size: int,
        hosts: Sequence[str],
        device: torch.device,
        run_dir: Path,
    ):
        self.strategy, self.rank, self.world_size, self.dp_rank = strategy, rank, world_size, dp_rank
        self.global_batch_size, self.hosts, self.device, self.run_dir = global_batch_size, hosts, device, run_dir

    def rerun(
        self, step: int, batch: torch.Tensor, ids: Sequence[int], loss: torch.Tensor
    ) -> tuple[TriageVerdict, Any]:
        """Called on every rank when ``optimizer_step(skip_nonfinite=True)`` skipped ``step``. Returns the verdict
        and the re-run's gradient norm (the re-run's update is applied when it was finite)."""
        flags = (0 if bool(torch.isfinite(loss)) else _LOSS) | (0 if self.strategy.last_local_grads_finite else _GRADS)
        loss2 = self.strategy.forward_backward(batch)
        norm2 = self.strategy.optimizer_step(skip_nonfinite=True)
        reproduced = self.strategy.last_step_skipped  # the norm is global: the same on every rank
        local = len(ids)
        # [flags per rank | narrowed suspects (id + 1) | this rank's whole batch (id + 1)], reduced with MAX
        vec = torch.zeros(self.world_size + 2 * self.global_batch_size, dtype=torch.int64)
        lo = self.dp_rank * local
        if reproduced:  # every rank alike: a sharded strategy's per-row forward is a collective
            per_row = self.strategy.sample_losses(batch)
            if not bool(torch.isfinite(loss2)):
                flags |= _LOSS2
                bad_rows = [j for j in range(local) if per_row is not None and not bool(torch.isfinite(per_row[j]))]
                for j in bad_rows or range(local):
                    vec[self.world_size + lo + j] = int(ids[j]) + 1
        for j in range(local):
            vec[self.world_size + self.global_batch_size + lo + j] = int(ids[j]) + 1
        vec[self.rank] = flags
        if dist.is_initialized() and self.world_size > 1:
            vec = vec.to(self.device)
            dist.all_reduce(vec, op=dist.ReduceOp.MAX)
            vec = vec.cpu()
        rank_flags = vec[: self.world_size].tolist()
        narrowed = [int(v) - 1 for v in vec[self.world_size : self.world_size + self.global_batch_size] if v]
        whole = [int(v) - 1 for v in vec[self.world_size + self.global_batch_size :] if v]
        if reproduced:
            if narrowed:
                why = "the loss of these samples is non-finite again when the step is re-run on the same inputs"
            else:
                why = "the gradient norm is non-finite again when the step is re-run on the same inputs"
            return TriageVerdict("data", sorted(set(narrowed or whole)), [], why), norm2
        by_loss = [r for r, f in enumerate(rank_flags) if f & _LOSS]
        by_grads = [r for r, f in enumerate(rank_flags) if f & _GRADS]
        if by_loss:
            blamed, evidence = by_loss, "its loss was non-finite"
        elif by_grads and (len(by_grads) < self.world_size or self.world_size == 1):
            blamed, evidence = by_grads, "its gradients were non-finite"
        else:
            blamed, evidence = [], "no rank's own values show where (the gradient reduce spread it)"
        why = f"the re-run of the same step on the same inputs is finite; {evidence}"
        return TriageVerdict("hardware", [], blamed, why), norm2

    def record_hardware(self, step: int, verdict: TriageVerdict) -> None:
        """Rank 0 appends the one ``hardware`` record (the restart policy excludes the blamed hosts)."""
        if self.rank != 0:
            return
        blame = [{"rank": r, "host": self.hosts[r] if r < len(self.hosts) else None} for r in verdict.blamed]
        where = ", ".join(f"rank {b['rank']} on {b['host']}" for b in blame) or "no rank in particular"
        failures.record(
            self.run_dir,
            kind="hardware",
            cause=f"step {step}: non-finite gradient norm not reproduced on re-run ({where}): {verdict.why}",
            rank=verdict.blamed[0] if verdict.blamed else None,
            host=blame[0]["host"] if blame else None,
            blame=blame,
            step=step,
        )


class HardwareFault(NonFiniteError):
    """A non-finite step that a re-run did not reproduce: the run stops; failures.jsonl holds the blame."""

    failure_kind = "nonfinite"  # the hardware record already blames the host; this exception blames nobody
