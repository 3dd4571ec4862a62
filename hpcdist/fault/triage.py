"""NaN triage (``train.nonfinite_triage``): re-run a non-finite step once to tell bad data from bad hardware
and from a diverged model.

The step's update was dropped (``optimizer_step(skip_nonfinite=True)``: parameters, optimizer and LR state are
untouched, gradients zeroed; Strategy._update), so forward and backward run again on the same inputs, on the same
rank, from the state before the step. The re-run's gradient norm is global, so every rank sees the same outcome:

* non-finite again, from parameters that are themselves non-finite or huge (beyond ``PARAM_LIMIT``), with every
  sample's loss finite (only the gradients overflow: inputs reach the model through its forward alone), or with
  every sample of the batch non-finite on its own from the same parameters: **model** (a diverged run, e.g. a far
  too high optim.lr). No sample is named or skipped; the run stops pointing at the optimizer settings.
* otherwise non-finite again (reproducible): **data**. The suspects are the samples whose own loss is non-finite
  (each row run alone, every strategy but a pipeline: Strategy.sample_losses), else the batches of the ranks whose
  loss was, else the whole step's batch. With ``train.nonfinite=skip`` they are skipped from then on (the sampler
  passes over them) and listed in <run.dir>/skipped_samples.json, read at start-up, so a resume skips them too
  (``checkpoint.resume=none`` sets the list aside: it belongs to its line of training); with ``stop`` the run stops
  naming them.
* finite (not reproducible): **hardware**. The ranks with their own evidence of the first attempt (a non-finite
  local loss, else non-finite local gradients where not every rank has them: DDP's reduce spreads one rank's NaN)
  are blamed in one ``hardware`` record in failures.jsonl, so the restart policy excludes their hosts; the run stops.

One all-reduce (MAX) of a small int vector carries every rank's flags and suspect ids, so all ranks reach the same
verdict and leave the triage together. Anchor: Megatron-Core's rerun state machine (re-run on the same GPU).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpcdist.agree import world_group, worst
from hpcdist.base.atomic import UntrustedFile, atomic_write, read_trusted
from hpcdist.base.logging_utils import get_logger
from hpcdist.base.rundir import RunDir
from hpcdist.fault import failures
from hpcdist.fault.nonfinite import NonFiniteError

__all__ = ["HardwareFault", "ModelDiverged", "SkippedSamples", "Triage", "TriageVerdict"]

log = get_logger(__name__)

_MAX_FILE_BYTES = 1 << 20  # ~50k ids: far more than max_nonfinite_skips ever lets a run collect
_MAX_ID = 1 << 62  # a blend's ids are global positions: large, never this large
_LOSS, _GRADS = 1, 2  # flag bits, first attempt
_LOSS2 = 4  # flag bit, re-run
_PARAMS = 8  # flag bit: this rank's parameters are non-finite or beyond PARAM_LIMIT
# |parameter| beyond which the model, not a sample, is the cause: trained transformer weights stay within a few
# hundred (norm gains, embedding outliers); a diverged run's grow by orders of magnitude (lr=1e4: ~5e9 after 3 steps)
PARAM_LIMIT = 1e5


class TriageVerdict:
    def __init__(self, kind: str, ids: list[int], blamed: list[int], why: str):
        self.kind, self.ids, self.blamed, self.why = kind, ids, blamed, why


class SkippedSamples:
    """<run.dir>/skipped_samples.json: ``{"num_samples": N, "ids": [...], "why": {id: text}}``, written by rank 0,
    read by every rank at start-up. Another user could have written it: read only if trusted (hpcdist.base.atomic),
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

    def set_aside(self, *, is_main: bool) -> None:
        """Collective, at a fresh start (``checkpoint.resume=none``): the list belongs to the line of training that
        made it, as its checkpoints do, so rank 0 renames it ``skipped_samples.json.abandoned-<time>`` (kept) before
        any rank reads it, and the new line trains on every sample. ValueError (every rank) when it cannot."""
        err = [""]
        if is_main and os.path.lexists(self.path):
            aside = self.path.with_name(f"{self.path.name}.abandoned-{time.strftime('%Y%m%d-%H%M%S')}")
            try:
                os.rename(self.path, aside)
                log.warning(
                    "checkpoint.resume=none starts a new line of training: %s is set aside as %s (kept; the "
                    "samples it lists are trained on)",
                    self.path.name,
                    aside.name,
                )
            except OSError as e:
                err[0] = f"{self.path} could not be set aside ({e.strerror}); move it away to start afresh"
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(err, src=0)
        if err[0]:
            raise ValueError(err[0])

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
        flags |= _PARAMS if _param_peak(self.strategy.local_params()) > PARAM_LIMIT else 0
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
        group = world_group() if self.world_size > 1 else None
        agreed = worst(vec.tolist(), group, device=self.device)  # NCCL reduces device tensors only
        rank_flags = agreed[: self.world_size]
        narrowed = [v - 1 for v in agreed[self.world_size : self.world_size + self.global_batch_size] if v]
        whole = [v - 1 for v in agreed[self.world_size + self.global_batch_size :] if v]
        if reproduced:
            model = _model_cause(rank_flags, narrowed, whole)
            if model:
                return TriageVerdict("model", [], [], model), norm2
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


def _param_peak(params: Sequence[torch.Tensor]) -> float:
    """The largest |value| of this rank's parameter shards (inf when one is NaN/Inf)."""
    peak = 0.0
    for t in params:
        if t.numel():
            m = float(t.detach().abs().max())
            peak = max(peak, m if m == m else float("inf"))  # NaN compares false: as bad as inf
    return peak


def _model_cause(rank_flags: Sequence[int], narrowed: Sequence[int], whole: Sequence[int]) -> str:
    """Why a reproduced non-finite step is the model's state rather than its samples ("" when it is not)."""
    if any(f & _PARAMS for f in rank_flags):
        return f"the parameters themselves are non-finite or beyond {PARAM_LIMIT:g} in magnitude (a diverged model)"
    if not any(f & _LOSS2 for f in rank_flags):
        return (
            "the re-run's loss is finite on every rank, only the gradients are not: no input is non-finite through "
            "the forward, the parameters' backward overflows"
        )
    if len(whole) > 1 and set(narrowed) == set(whole):
        return f"all {len(whole)} samples of the batch are non-finite one by one from the same parameters"
    return ""


class ModelDiverged(NonFiniteError):
    """A non-finite step that the NaN triage traced to the model's state (not a sample, not the hardware)."""


class HardwareFault(NonFiniteError):
    """A non-finite step that a re-run did not reproduce: the run stops; failures.jsonl holds the blame."""

    failure_kind = "nonfinite"  # the hardware record already blames the host; this exception blames nobody
