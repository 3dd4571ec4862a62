#!/usr/bin/env bash
# Generic training job: sbatch [sbatch options] sbatch/train.sh CONFIG [section.key=value ...]
# Defaults below are one 8-GPU node; override any of them on the sbatch command line, e.g.
#   sbatch --nodes=2 --time=2:00:00 sbatch/train.sh configs/demo.yaml train.steps=1000
#SBATCH --job-name=hpcdist
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=16
#SBATCH --requeue
#SBATCH --signal=B:USR2@300
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append

source "${SLURM_SUBMIT_DIR:-.}/sbatch/common.sh"
if [ $# -lt 1 ]; then
  echo "usage: sbatch sbatch/train.sh CONFIG [section.key=value ...]" >&2
  exit 2
fi
hpcdist_train "$@"
