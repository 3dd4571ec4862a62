"""``scontrol requeue`` a SLURM job, and keep it off excluded nodes (ExcNodeList) while it is pending.

Called by rank 0 after a time-limit stop (hpcdist.launch.restarts.after_stop) and by the batch script's failure
path (hpcdist.launch.restarts after-step). The trainer never requeues: it returns why it stopped.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterable

from hpcdist.logging_utils import get_logger

__all__ = ["requeue"]

log = get_logger(__name__)


def requeue(job_id: str, *, exclude: Iterable[str] = ()) -> int:
    """Requeue ``job_id``, then exclude ``exclude`` from its next start. 0 when requeued, else 4 (said why)."""
    scontrol = shutil.which("scontrol")
    fallback = (
        f"resubmit a follow-up that starts when this one ends: sbatch --dependency=afterany:{job_id} <same script>; "
        "it resumes from the checkpoint just written"
    )
    if scontrol is None:
        log.error("cannot requeue job %s: scontrol is not on PATH; %s", job_id, fallback)
        return 4
    try:
        p = subprocess.run([scontrol, "requeue", job_id], capture_output=True, text=True, timeout=60, check=False)
    except subprocess.TimeoutExpired:
        log.error("scontrol requeue %s timed out; %s", job_id, fallback)
        return 4
    if p.returncode != 0:
        log.error("scontrol requeue %s failed (%s); %s", job_id, (p.stderr or p.stdout).strip(), fallback)
        return 4
    log.info("requeued job %s; the next run resumes from the checkpoint just written", job_id)
    exclude = sorted(set(exclude))
    if exclude:
        # ExcNodeList can only change while the job is pending, i.e. now; SLURM holds a requeued job for a while
        # (BeginTime) before it may start again, so the update lands before the next start
        arg = f"ExcNodeList={','.join(exclude)}"
        try:
            p = subprocess.run(
                [scontrol, "update", f"jobid={job_id}", arg], capture_output=True, text=True, timeout=60, check=False
            )
            ok, why = p.returncode == 0, (p.stderr or p.stdout).strip()
        except subprocess.TimeoutExpired:
            ok, why = False, "timed out"
        if ok:
            log.info("job %s will avoid %s", job_id, ",".join(exclude))
        else:
            log.warning(
                "scontrol update jobid=%s %s failed (%s); the job may run on those nodes again", job_id, arg, why
            )
    return 0
