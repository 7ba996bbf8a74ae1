#!/usr/bin/env bash
# Convert one checkpoint on many storage nodes into one shared DST: a Slurm job array.
# The job file (TOML: any option of `k3convert mxfp4-to-int4`, see configs/jobs/) names SRC,
# DST and the rest. Array task k converts part k of n of the shards (--part k/n, round robin;
# n = the number of tasks); the task that finishes the last shard writes index, config,
# report and manifest. Re-submitting the same array after a failure or preemption resumes:
# finished shards are kept, so their tasks end in seconds.
#
#   sbatch --array=0-7 scripts/tools/slurm_array.sh configs/jobs/kimi-k3-slurm-array.toml [OPTION...]
#
# OPTIONs after the job file go to k3convert and win over the file (e.g. --overwrite).
# The array must be contiguous (0-7 or 1-8, a %limit is fine; not 0-14:2 or 1,3,5).
# K3CONVERT: the command to run [default: k3convert on PATH; sbatch exports the submitting
# shell's environment], e.g. K3CONVERT="/opt/k3/venv/bin/python -m converter" (no spaces in paths).
# Each task's log is k3convert-JOBID_TASKID.log in the submit directory; a failed task's log
# ends with a "k3convert: error:" line and this script's "failed" line.
#
#SBATCH --job-name=k3convert
#SBATCH --cpus-per-task=32
#SBATCH --mem=64G
#SBATCH --time=02:00:00
#SBATCH --output=k3convert-%A_%a.log
set -euo pipefail
JOB=${1:?usage: sbatch --array=0-N slurm_array.sh JOB.toml [k3convert option...]}
shift
N=${SLURM_ARRAY_TASK_COUNT:?run as a job array: sbatch --array=0-N slurm_array.sh JOB.toml}
I=$(( SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN + 1 ))
if (( I > N )); then
  echo "slurm_array.sh: task $SLURM_ARRAY_TASK_ID: the array must be contiguous (like 0-7), not stepped or a list" >&2
  exit 2
fi
read -r -a K3 <<< "${K3CONVERT:-k3convert}"
echo "slurm_array.sh: task $SLURM_ARRAY_TASK_ID on $(hostname -s): part $I/$N of $JOB" >&2
# Exit codes: 2 bad input, 3 error threshold, 4 output/IO, 130 interrupted (resubmit to resume)
rc=0
"${K3[@]}" mxfp4-to-int4 --config "$JOB" --part "$I/$N" "$@" || rc=$?
if (( rc != 0 )); then
  echo "slurm_array.sh: task $SLURM_ARRAY_TASK_ID (part $I/$N) failed with exit $rc; re-submit the array to resume" >&2
fi
exit "$rc"
