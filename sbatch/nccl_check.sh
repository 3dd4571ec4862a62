#!/usr/bin/env bash
# Communication check of an allocation (tools/nccl_check): environment audit, device health, nccl-tests-style
# sweep of every collective with result checks, slow node / link finder, PASS/FAIL (the job's exit status).
#   sbatch sbatch/nccl_check.sh                                       # 2 nodes x 8 GPUs, a100_ib expectations
#   sbatch --nodes=8 sbatch/nccl_check.sh --json runs/nccl_check/8n.json
#   sbatch --nodes=2 sbatch/nccl_check.sh --max-bytes 8G --cluster none --expect-inter 180
# Arguments go to nccl_check (tools/nccl_check --help). The report names the ranks, hosts or links at fault and
# ends with a suggested --exclude=... for the next sbatch. The NCCL profile ($HPCDIST_NCCL_PROFILE, default
# ib_a100, as for training) is applied inside every task first, so the check sees what training will see.
#SBATCH --job-name=nccl_check
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=16
#SBATCH --exclusive
#SBATCH --time=00:30:00
#SBATCH --output=%x-%j.out

source "${SLURM_SUBMIT_DIR:-.}/sbatch/common.sh"
hpcdist_srun "$HPCDIST_PYTHON" tools/nccl_check "$@"
