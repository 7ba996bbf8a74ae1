#!/usr/bin/env bash
# Convert one checkpoint on many storage nodes into one shared DST: a Slurm job array.
# Each array task converts a disjoint part of the shards (--part i/n); the task that finishes
# the last shard writes index, config, report and manifest. Re-submitting the array after a
# failure or preemption resumes: finished shards are kept.
#
#   sbatch --array=1-8 scripts/slurm_array.sh /shared/kimi-k3 /shared/kimi-k3-int4
#
#SBATCH --job-name=k3convert
#SBATCH --cpus-per-task=32
#SBATCH --mem=64G
#SBATCH --time=02:00:00
#SBATCH --output=k3convert-%A_%a.log
set -euo pipefail
SRC=${1:?usage: sbatch --array=1-N slurm_array.sh SRC DST}
DST=${2:?usage: sbatch --array=1-N slurm_array.sh SRC DST}
N=${SLURM_ARRAY_TASK_COUNT:?run as a job array}
I=$(( SLURM_ARRAY_TASK_ID - ${SLURM_ARRAY_TASK_MIN:-1} + 1 ))
# Exit codes: 2 bad input, 3 error threshold, 4 output/IO, 130 interrupted (resubmit to resume)
k3convert mxfp4-to-int4 "$SRC" -o "$DST" --part "$I/$N" --progress json
