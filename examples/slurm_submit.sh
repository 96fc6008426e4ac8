#!/bin/bash
# Submits examples/slurm_array.sbatch with every task's log under the night's output,
# never in the directory sbatch runs in (a checkout, when run from the repository root).
#
# Slurm writes a task's output where --output points and does not create that directory
# (a missing one loses the log); this script creates $LOG_DIR and points --output there:
#   $LOG_DIR/<job name>-<array job id>_<task>.out      (default LOG_DIR: $OUT/logs)
# Slurm's own lines land in the same file: a cancellation, a time limit reached.
#
# Settings, from the environment (the template's; it reads the same ones, passed with
# --export=ALL):
#   RUN, PLAN_LINES        required: the run id and the output of `plan --dry-run`
#   OUT                    output root (default out); LOG_DIR (default $OUT/logs)
#   THROTTLE               tasks at once when the whole plan is submitted (default 64)
# Arguments go to sbatch as they are. Without --array every plan line is one task,
# 0..N-1 with %THROTTLE; a rerun passes the resume list's ranges:
#   RUN=night-01 PLAN_LINES=plan-lines.jsonl OUT=/scratch/night-01 examples/slurm_submit.sh
#   ARRAY=$(shardledger resume night-01 --format slurm-array --exit-zero)
#   [ -z "$ARRAY" ] || RUN=night-01 PLAN_LINES=plan-lines.jsonl OUT=/scratch/night-01 \
#       examples/slurm_submit.sh --array="${ARRAY}%64"
# A cluster without GPU gres, or a CPU-only job: add --gres=none --cpus-per-task=2.
# Prints the job id (sbatch --parsable); exits with sbatch's status, 2 for a bad setting.
set -euo pipefail

: "${RUN:?set RUN (the run id)}"
: "${PLAN_LINES:?set PLAN_LINES (the output of plan --dry-run)}"
if [ ! -r "$PLAN_LINES" ]; then
    echo "PLAN_LINES=$PLAN_LINES is not a readable file" >&2
    exit 2
fi
OUT=${OUT:-out}
LOG_DIR=${LOG_DIR:-$OUT/logs}
if ! mkdir -p "$LOG_DIR"; then
    echo "cannot create the log directory LOG_DIR=$LOG_DIR" >&2
    exit 2
fi
export RUN PLAN_LINES OUT

array=()
given_array=no
for arg in "$@"; do
    case "$arg" in
        --array=* | --array | -a | -a*) given_array=yes ;;
    esac
done
if [ "$given_array" = no ]; then
    lines=$(wc -l <"$PLAN_LINES")
    if [ "$lines" -eq 0 ]; then
        echo "PLAN_LINES=$PLAN_LINES has no plan line: nothing to submit" >&2
        exit 2
    fi
    array=(--array="0-$((lines - 1))%${THROTTLE:-64}")
fi

exec sbatch --parsable --export=ALL --output="$LOG_DIR/%x-%A_%a.out" "${array[@]}" "$@" \
    "$(dirname "$0")/slurm_array.sbatch"
