# Sourced by every hpcdist batch script: environment, NCCL profile, and the signal forwarding that turns
# SLURM's time-limit warning into one collective checkpoint + requeue inside the trainer.
#
# Run batch scripts from the repository root (`sbatch sbatch/train.sh ...`): SLURM copies the script to its
# spool directory, so paths are taken relative to $SLURM_SUBMIT_DIR, not to the script.

set -euo pipefail

HPCDIST_ROOT=${HPCDIST_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
cd "$HPCDIST_ROOT"

# Interpreter with hpcdist installed (the submitting shell's environment is exported to the job by default).
HPCDIST_PYTHON=${HPCDIST_PYTHON:-python3}
# NCCL/GLOO variables come from hpcdist/resources/nccl/<profile>.yaml, resolved inside each task (interfaces and HCAs
# can differ per node). Anything already exported by the user wins and is logged.
export HPCDIST_NCCL_PROFILE=${HPCDIST_NCCL_PROFILE:-ib_a100}
export PYTHONUNBUFFERED=1
# One intra-op thread pool per task, sized to the task's CPUs instead of every core of the node.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}

hpcdist_log() { echo "[hpcdist sbatch $(date +%H:%M:%S)] $*"; }

hpcdist_log "job ${SLURM_JOB_ID:-?} (${SLURM_JOB_NAME:-?}) restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST:-?}:" \
  "${SLURM_NNODES:-?} nodes x ${SLURM_NTASKS_PER_NODE:-?} tasks, NCCL profile $HPCDIST_NCCL_PROFILE"

# hpcdist_forward CMD...: run CMD with the batch shell forwarding SLURM's signals to it.
#   --signal=B:USR2@<lead> delivers USR2 to this shell only; CMD (srun, or the attempt loop, which passes it on to
#   its srun) relays it to every task, whose trainer sets a flag, agrees with the other ranks at the next step
#   boundary, checkpoints, and rank 0 requeues the job.
hpcdist_forward() {
  "$@" &
  local child=$! rc=0
  trap 'hpcdist_log "got USR2: forwarding to the tasks"; kill -USR2 "$child" 2>/dev/null || true' USR2
  trap 'hpcdist_log "got TERM: forwarding to the tasks"; kill -TERM "$child" 2>/dev/null || true' TERM
  while :; do
    # `wait` returns early (status > 128) whenever a trap runs: keep waiting until the child itself has exited
    wait "$child" && rc=0 || rc=$?
    kill -0 "$child" 2>/dev/null || break
  done
  trap - USR2 TERM
  return "$rc"
}

# hpcdist_srun CMD...: one task per GPU through srun, signals forwarded.
#   --kill-on-bad-exit=1: if one rank dies the others are killed instead of waiting forever in a collective.
hpcdist_srun() {
  local rc=0
  hpcdist_forward srun --kill-on-bad-exit=1 --unbuffered "$@" || rc=$?
  hpcdist_log "srun exited with status $rc"
  return "$rc"
}

# hpcdist_train CONFIG [section.key=value ...]: the training step under the attempt loop (hpcdist.launch.attempts).
#   Every task runs under `python -m hpcdist.fault.supervise`, which records a rank killed by a signal (OOM killer,
#   segfault) in <run.dir>/failures.jsonl before srun can notice. The loop gates the nodes (health check), starts
#   the step on the chosen ones, and if it fails applies the failure policy (hpcdist.launch.restarts): attribute the
#   failure (rank, host, cause), then restart in the allocation (fault.spare_nodes, fault.min_nodes), requeue with
#   the bad hosts excluded (ExcNodeList, within limits), or stop with the reason (fault.max_failures,
#   fault.max_same_failure). It exits 0 after a requeue (SLURM ends this run and starts the next) and with srun's
#   status otherwise (the job ends FAILED).
hpcdist_train() {
  local rc=0
  hpcdist_forward "$HPCDIST_PYTHON" -m hpcdist.launch.attempts "$@" -- \
    srun --kill-on-bad-exit=1 --unbuffered \
    "$HPCDIST_PYTHON" -m hpcdist.fault.supervise -- "$HPCDIST_PYTHON" -m hpcdist train "$@" || rc=$?
  hpcdist_log "the attempt loop exited with status $rc"
  return "$rc"
}
