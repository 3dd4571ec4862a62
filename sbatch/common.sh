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

# hpcdist_srun CMD...: one task per GPU through srun, with the batch shell forwarding SLURM's signals.
#   --signal=B:USR2@<lead> delivers USR2 to this shell only; srun relays it to every task, whose trainer sets a
#   flag, agrees with the other ranks at the next step boundary, checkpoints, and rank 0 requeues the job.
#   --kill-on-bad-exit=1: if one rank dies the others are killed instead of waiting forever in a collective.
hpcdist_srun() {
  srun --kill-on-bad-exit=1 --unbuffered "$@" &
  local srun_pid=$! rc=0
  trap 'hpcdist_log "got USR2: forwarding to the tasks"; kill -USR2 "$srun_pid" 2>/dev/null || true' USR2
  trap 'hpcdist_log "got TERM: forwarding to the tasks"; kill -TERM "$srun_pid" 2>/dev/null || true' TERM
  while :; do
    # `wait` returns early (status > 128) whenever a trap runs: keep waiting until srun itself has exited
    wait "$srun_pid" && rc=0 || rc=$?
    kill -0 "$srun_pid" 2>/dev/null || break
  done
  trap - USR2 TERM
  hpcdist_log "srun exited with status $rc"
  return "$rc"
}

# hpcdist_train CONFIG [section.key=value ...]: the training step, then the failure policy if it failed.
#   Every task runs under `python -m hpcdist.fault.supervise`, which records a rank killed by a signal (OOM killer,
#   segfault) in <run.dir>/failures.jsonl before srun can notice. If srun fails, `hpcdist.launch.restarts
#   after-step` attributes the failure (rank, host, cause), excludes the host (ExcNodeList, within limits) and
#   requeues the job, or stops with the reason (fault.max_failures, fault.max_same_failure). It exits 0 after a
#   requeue (SLURM ends this run and starts the next) and with srun's status otherwise (the job ends FAILED).
hpcdist_train() {
  local rc=0
  hpcdist_srun "$HPCDIST_PYTHON" -m hpcdist.fault.supervise -- "$HPCDIST_PYTHON" -m hpcdist train "$@" || rc=$?
  if [ "$rc" -ne 0 ]; then
    "$HPCDIST_PYTHON" -m hpcdist.launch.restarts after-step --exit-code "$rc" -- "$@" && rc=0 || rc=$?
  fi
  return "$rc"
}
