"""What each attempt at a shard came to: the per-attempt rows of `shards --attempts`.

A shard's view shows its latest attempt; a rerun shard's earlier attempts (the
first-pass job a preemption ended, say) are listed here, each with its own outcome,
host, scheduler job and times. Pure: a function of the shard's record and `now`.
"""

from __future__ import annotations

from typing import Any, Final

from ledger_server import ranks
from ledger_server.field import attempt_span
from ledger_server.projections import (
    clock_skew_us,
    delivery_gap_us,
    is_complete,
    is_intact,
    is_late,
    verdicts_of,
)
from ledger_server.record import Attempt, ShardRecord
from ledger_server.states import QueryState, ShardState
from shard_client.vocabulary import FailureTag

# An attempt that neither failed nor committed every output, while a newer attempt of
# the shard started: it ended unheard (or still runs, a zombie).
SUPERSEDED: Final = "superseded"
# Every outcome an attempt can show, in the order they are judged.
OUTCOMES: Final = (
    ShardState.FAILED.value,
    QueryState.VERIFIED.value,
    QueryState.VERIFY_FAILED.value,
    QueryState.UNVERIFIED.value,
    SUPERSEDED,
    QueryState.RUNNING.value,
    QueryState.STALE.value,
)


def attempt_outcome(record: ShardRecord, attempt: Attempt, now_us: int) -> tuple[str, str]:
    """Returns what the attempt came to at now_us, and a detail (failure tag or reason).

    A complete set of outputs is judged by its own verdicts, whatever happened to the
    process after it committed them; an attempt that read another input than the
    plan's counts as failed(input_changed), as its commits confirm nothing.
    """
    if attempt.input_changed:
        return ShardState.FAILED, FailureTag.INPUT_CHANGED
    if is_complete(record, attempt):
        verdicts = verdicts_of(record, attempt)
        failing = [v for v in verdicts if v is not None and v[0] == "failed"]
        if failing:
            return QueryState.VERIFY_FAILED, failing[0][1] or "unknown"
        if not is_intact(record, attempt):
            return QueryState.VERIFY_FAILED, "overwritten"
        if all(v is not None and v[0] == "passed" for v in verdicts):
            return QueryState.VERIFIED, ""
        return QueryState.UNVERIFIED, ""
    if attempt.failed_tag:
        return ShardState.FAILED, attempt.failed_tag
    if attempt.attempt_id != record.latest_attempt:
        return SUPERSEDED, ""
    if ranks.all_finished(attempt):  # every rank left cleanly, an output still missing
        return ShardState.FAILED, FailureTag.INCOMPLETE
    deadline = (
        ranks.deadline_us(attempt)
        if ranks.is_ranked(attempt)
        else attempt.last_seen_us + attempt.timeout_us
    )
    return (QueryState.STALE if deadline < now_us else QueryState.RUNNING), ""


def attempt_history(record: ShardRecord, now_us: int) -> list[dict[str, Any]]:
    """Returns one row per attempt of the shard, in the order they started."""
    rows = []
    for attempt in sorted(record.attempts.values(), key=lambda a: a.started_seq):
        outcome, detail = attempt_outcome(record, attempt, now_us)
        rows.append(
            {
                "attempt_id": attempt.attempt_id,
                "outcome": str(outcome),
                "detail": str(detail),
                "host": attempt.host,
                "pid": attempt.pid,
                "scheduler": dict(attempt.scheduler),
                "started_us": attempt.started_us or None,
                "ended_us": attempt.ended_us or None,
                # The job's own clock at its start and end; the span is read on it where
                # both ends carry it (span_clock "job"), else on the ledger's.
                "client_started_us": attempt.client_started_us or None,
                "client_ended_us": attempt.client_ended_us or None,
                "span_clock": attempt_span(attempt)[1],
                "delivery_gap_us": delivery_gap_us(attempt),
                "last_seen_us": attempt.last_seen_us,
                "fingerprint": attempt.fingerprint_digest,
                "clock_skew_us": clock_skew_us(attempt),
                "late": is_late(attempt),
            }
        )
    return rows
