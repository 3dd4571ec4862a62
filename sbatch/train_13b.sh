#!/usr/bin/env bash
# Llama-2-13B shape on 4 nodes x 8 A100-80GB (32 ranks), InfiniBand NCCL profile: configs/train_13b.yaml.
#   sbatch sbatch/train_13b.sh          # as configured: prepare data/llama2-corpus first (configs/train_13b.yaml)
#   sbatch sbatch/train_13b.sh train.steps=100 run.dir=runs/13b-try   # overrides go to the trainer
#   sbatch --nodes=1 --ntasks-per-node=4 --gpus-per-node=4 sbatch/train_13b.sh model.preset=tiny data.source=stdlib ...  # smaller
# The 300 s signal lead covers one checkpoint of the 13B model (goal < 2 min) with margin.
#SBATCH --job-name=hpcdist-13b
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=16
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --requeue
#SBATCH --signal=B:USR2@300
#SBATCH --time=48:00:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append

source "${SLURM_SUBMIT_DIR:-.}/sbatch/common.sh"
hpcdist_train configs/train_13b.yaml "$@"
