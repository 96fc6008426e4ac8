#!/bin/bash
# A plain bash job run as a shard by `shardledger exec`: no SDK, no gRPC, no code for the ledger.
#
#   shardledger plan night-03 --manifest examples/jobs.jsonl
#   LINE=$(shardledger plan night-03 --manifest examples/jobs.jsonl --dry-run | head -1)
#   shardledger exec night-03 --plan-line "$LINE" \
#       --output counts=out/{shard}.counts.txt --output summary=out/{shard}.summary.json \
#       --hang-timeout 600 -- bash examples/shell_job.sh
#
# What the job sees (docs/exec.md):
#   $SHARDLEDGER_INPUT             the plan line's "input"
#   $SHARDLEDGER_OUTPUT_COUNTS     where to write the output "counts" (a temp path)
#   $SHARDLEDGER_OUTPUT_SUMMARY    where to write the output "summary"
# It writes each output to its temp path and exits 0; `shardledger exec` then checks
# them (not empty, valid JSON), renames them to out/... and records them. If the job
# dies, or exits 0 without them, nothing appears under out/ and the attempt is
# recorded failed(tag). Progress lines ("SHARDLEDGER_PROGRESS step=N ...") become
# heartbeats with metrics and keep the hang watchdog quiet.
#
# SHELL_JOB_FAULT injects one failure form, for the tests and the curious:
#   swallow  exit 0 without writing anything (a job that swallowed its error)
#   kill9    SIGKILL itself halfway through writing "counts"
#   empty    write an empty "summary" and exit 0
#   hang     stop making progress (sleep) without exiting
#   fail     exit 3 with an error on stderr
#   term     wait for the scheduler's SIGTERM (forwarded by exec) and die of it
#   oom      print an out-of-memory error and exit 1
set -euo pipefail

: "${SHARDLEDGER_INPUT:?run me through shardledger exec with a plan line (--plan-line/--plan-file)}"
: "${SHARDLEDGER_OUTPUT_COUNTS:?declare --output counts=PATH}"
: "${SHARDLEDGER_OUTPUT_SUMMARY:?declare --output summary=PATH}"
FAULT=${SHELL_JOB_FAULT:-}
STEP_SECONDS=${SHELL_JOB_STEP_SECONDS:-0.05}

progress() {  # progress STEP FRACTION [key=value ...]
    local step=$1 fraction=$2
    shift 2
    echo "SHARDLEDGER_PROGRESS step=${step} progress=${fraction} $*"
}

[ "$FAULT" = swallow ] && { echo "error: input unreadable (ignored)" >&2; exit 0; }
[ "$FAULT" = fail ] && { echo "fatal: renderer crashed on frame 17" >&2; exit 3; }
[ "$FAULT" = oom ] && { echo "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB" >&2; exit 1; }

words=$(tr -s '[:space:]' '\n' < "$SHARDLEDGER_INPUT" | grep -c . || true)
total=4
for step in 1 2 3 4; do
    sleep "$STEP_SECONDS"
    progress "$step" "$(awk "BEGIN { print $step / $total }")" "words=${words}"
    if [ "$FAULT" = kill9 ] && [ "$step" = 2 ]; then
        # Half a file on disk, then a kill nothing can catch.
        tr -s '[:space:]' '\n' < "$SHARDLEDGER_INPUT" | head -3 > "$SHARDLEDGER_OUTPUT_COUNTS"
        kill -9 $$
    fi
    if [ "$FAULT" = hang ] && [ "$step" = 2 ]; then
        sleep 3600 &
        wait $!
    fi
    if [ "$FAULT" = term ] && [ "$step" = 2 ]; then
        echo "waiting for SIGTERM" >&2
        sleep 3600 &
        wait $!
    fi
done

tr -s '[:space:]' '\n' < "$SHARDLEDGER_INPUT" | grep . | sort | uniq -c | sort -rn > "$SHARDLEDGER_OUTPUT_COUNTS"
if [ "$FAULT" = empty ]; then
    : > "$SHARDLEDGER_OUTPUT_SUMMARY"
else
    printf '{"input": "%s", "words": %d}\n' "$SHARDLEDGER_INPUT" "$words" > "$SHARDLEDGER_OUTPUT_SUMMARY"
fi
echo "done: ${words} words"
