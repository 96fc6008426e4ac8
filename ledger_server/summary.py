# Over 400 lines on purpose: a shard's counters and the run summary that sums them are one definition; apart, they could drift.
"""What a run's shards add up to: duplicates and repairs, first-pass figures, the run summary.

Pure functions of shard records (and so of events): each shard contributes a
`Counter` that the server keeps summed per run in the same transaction as the
append, and a replay sums the same way. See docs/projections.md for every figure.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final

from ledger_server import field as figures
from ledger_server import ranks
from ledger_server.attempts import attempt_history
from ledger_server.errors import RunClosed, RunNotClosed
from ledger_server.events import Event, SubmissionClosed
from ledger_server.projections import (
    base_state,
    deadline_us,
    is_complete,
    live_state,
    required_outputs,
    verdicts_of,
)
from ledger_server.record import Attempt, ShardRecord
from ledger_server.states import (
    BASE_STATES,
    QueryState,
    ShardState,
    canonical_query,
    shown_state,
)
from shard_client.vocabulary import FailureTag

DUPLICATE_KINDS: Final = ("wasted", "nondeterministic", "zombie")
# The summed counter that holds the global sequence of the run's first verdict: the
# moment its first pass closed (0 while it is open). Not a shard's contribution.
PASS_CLOSED_KEY: Final = "pass:closed"
# The run's submission_closed events: the first one's global sequence (0 while none
# came, or since a reopen) and announced shard count (0: not stated), and the time the
# submission closes (the earliest any close named). Run-level counters like
# PASS_CLOSED_KEY, moved by closing_delta in the writer, the importer and a replay alike.
SUBMISSION_CLOSED_KEY: Final = "submission:closed"
SUBMISSION_CLOSED_US_KEY: Final = "submission:closed_us"
SUBMISSION_EXPECTED_KEY: Final = "submission:expected"
# The run's latest run_reopened event: its global sequence and receive time (0 while
# none came). A reopen sets the three close counters above back to 0, so the next close
# sets them afresh (reopening_delta).
SUBMISSION_REOPENED_KEY: Final = "submission:reopened"
SUBMISSION_REOPENED_US_KEY: Final = "submission:reopened_us"
# Every run counter a close or a reopen reads or moves.
CLOSING_KEYS: Final = (
    SUBMISSION_CLOSED_KEY,
    SUBMISSION_CLOSED_US_KEY,
    SUBMISSION_EXPECTED_KEY,
    SUBMISSION_REOPENED_KEY,
    SUBMISSION_REOPENED_US_KEY,
)


def _sound(record: ShardRecord, attempt: Attempt) -> bool:
    """Returns whether the attempt produced a result: every output committed, none failed."""
    return is_complete(record, attempt) and not any(
        v is not None and v[0] == "failed" for v in verdicts_of(record, attempt)
    )


def _seen_in_first_pass(record: ShardRecord, attempt: Attempt) -> bool:
    """Returns whether the attempt's complete set reached the ledger before its first pass closed.

    A commit drained late from a spool, after the run's first verdict, was not part
    of the night as first reconciled: the first pass never counts it, whatever a
    later verify finds, so the first-pass figures stay what they were.
    """
    if not is_complete(record, attempt):
        return False
    names = required_outputs(record, attempt) or tuple(attempt.artifacts)
    late = attempt.after_pass
    return not late or (
        all(n not in late for n in names)
        if required_outputs(record, attempt)
        else len(late) < len(names)
    )


def _verified(record: ShardRecord, attempt: Attempt) -> bool:
    """Returns whether the attempt's first-pass commits were all verified as passing."""
    return _seen_in_first_pass(record, attempt) and all(
        v is not None and v[0] == "passed" for v in verdicts_of(record, attempt)
    )


def _silent(record: ShardRecord, attempt: Attempt) -> bool:
    """Returns whether the attempt, as the first pass saw it, believed it succeeded and was wrong."""
    if attempt.failed_tag == FailureTag.INCOMPLETE and not attempt.failed_after_pass:
        return True
    return _seen_in_first_pass(record, attempt) and any(
        v is not None and v[0] == "failed" for v in verdicts_of(record, attempt)
    )


def _by_start(record: ShardRecord) -> list[Attempt]:
    return sorted(record.attempts.values(), key=lambda a: a.started_seq)


def duplicate_kinds(record: ShardRecord) -> list[str]:
    """Returns the kinds of duplicate the shard shows, sorted.

    A result is an attempt's complete set of outputs that no verdict failed
    (passed or not yet verified), whether or not a later commit replaced its files.
    A rerun that replaced a failed, corrupted or missing result is a repair, not a
    duplicate; only a second result is duplicated work.
    """
    return _duplicate_kinds(record, [a for a in record.attempts.values() if _sound(record, a)])


def _duplicate_kinds(record: ShardRecord, results: list[Attempt]) -> list[str]:
    """duplicate_kinds, given the attempts that produced a result."""
    kinds = set()
    if len(results) > 1:
        kinds.add("wasted")
        groups: dict[str, list[Attempt]] = {}
        for attempt in results:
            # Attempts that recorded no fingerprint are in no group: their environments may differ.
            if attempt.fingerprint_digest:
                groups.setdefault(attempt.fingerprint_digest, []).append(attempt)
        for group in groups.values():
            names = required_outputs(record) or sorted({n for a in group for n in a.artifacts})
            if any(len({a.artifacts[n][2] for a in group if n in a.artifacts}) > 1 for n in names):
                kinds.add("nondeterministic")
    if record.zombie_commits:
        kinds.add("zombie")
    return sorted(kinds)


def repaired(record: ShardRecord) -> bool:
    """Returns whether a later attempt produced the result an earlier attempt failed to."""
    attempts = _by_start(record)
    first_result = next((i for i, a in enumerate(attempts) if _sound(record, a)), None)
    return first_result is not None and first_result > 0


def first_pass_outcome(record: ShardRecord) -> str:
    """Returns the shard's first-pass outcome: verified, silent, missing or other.

    The first pass is every attempt that started before the run's first verdict;
    its outcome is judged by those attempts' own commits and the verdicts on them,
    so no rerun can change it.
    """
    attempts = [a for a in _by_start(record) if a.first_pass]
    if not attempts:
        return "missing"
    if any(_verified(record, a) for a in attempts):
        return "verified"
    if any(_silent(record, a) for a in attempts):
        return "silent"
    return "other"


def first_attempt_verified(record: ShardRecord) -> bool:
    """Returns whether the shard's very first attempt, in the first pass, was verified."""
    attempts = _by_start(record)
    return bool(attempts) and attempts[0].first_pass and _verified(record, attempts[0])


def recomputed(record: ShardRecord) -> bool:
    """Returns whether the shard ran more than once, or first ran after the first pass."""
    return len(record.attempts) > 1 or any(not a.first_pass for a in record.attempts.values())


def numeric_warning(attempt: Attempt | None) -> dict[str, Any] | None:
    """Returns the attempt's numeric-pollution warning (first step, metric names), if any."""
    if attempt is None or attempt.numeric_step < 0:
        return None
    return {"step": attempt.numeric_step, "metrics": sorted(attempt.numeric_metrics)}


def fingerprint_of(record: ShardRecord) -> str:
    """Returns the fingerprint digest of the shard's latest attempt ("" if none)."""
    latest = record.attempts.get(record.latest_attempt)
    return latest.fingerprint_digest if latest else ""


def contributions(record: ShardRecord) -> Counter[str]:
    """Returns the counters one shard adds to its run's summary (time-independent).

    The figures of `duplicate_kinds`, `repaired`, `first_pass_outcome`,
    `first_attempt_verified`, `recomputed` and `numeric_warning`, with each attempt
    judged once: the writer sums this for every shard a non-heartbeat event touches,
    and a rebuild for every shard of the night.
    """
    state, detail = base_state(record)
    out = {"submitted": 1, f"state:{state}": 1}
    if state == ShardState.FAILED:
        out[f"tag:{detail}"] = 1
        if detail == FailureTag.INCOMPLETE:
            out["silent"] = 1
    elif state == ShardState.VERIFY_FAILED:
        out[f"verify_failed:{detail}"] = 1
        out["silent"] = 1
    for tag in record.failures:
        key = f"attempt_tag:{tag}"
        out[key] = out.get(key, 0) + 1
    attempts = _by_start(record)
    sound = [_sound(record, a) for a in attempts]
    kinds = _duplicate_kinds(record, [a for a, ok in zip(attempts, sound, strict=True) if ok])
    for kind in kinds:
        out[f"dup:{kind}"] = 1
    if kinds:
        out["dup:any"] = 1
    if any(sound[1:]) and not sound[0]:  # repaired: the first result came from a rerun
        out["repaired"] = 1
    latest = record.attempts.get(record.latest_attempt)
    if latest is not None and latest.fingerprint_digest:
        out[f"fp:{latest.fingerprint_digest}"] = 1
    out["attempts"] = len(attempts)
    first_pass = [a for a in attempts if a.first_pass]
    verified = [_verified(record, a) for a in first_pass]
    first_silent = None
    if not first_pass:
        outcome = "missing"
    elif any(verified):
        outcome = "verified"
    elif (first_silent := next((a for a in first_pass if _silent(record, a)), None)) is not None:
        outcome = "silent"
    else:
        outcome = "other"
    out[f"first:{outcome}"] = 1
    first_attempt_verified = bool(attempts and attempts[0].first_pass and verified[0])
    if first_attempt_verified:
        out["first:attempt_verified"] = 1
    if any(a.numeric_step >= 0 for a in first_pass):
        out["first:numeric"] = 1
    if len(attempts) > 1 or len(first_pass) < len(attempts):
        out["recomputed"] = 1
    if latest is not None and latest.numeric_step >= 0:
        out["numeric"] = 1
    late = sum(1 for a in attempts if a.late)
    if late:
        out["late_attempts"] = late
    total = Counter(out)
    total.update(
        figures.contributions(
            record,
            first_outcome=outcome,
            first_attempt_verified=first_attempt_verified,
            first_silent=first_silent,
        )
    )
    return total


def closing_delta(
    current: Mapping[str, int], closed: SubmissionClosed, sequence: int, receive_us: int
) -> dict[str, int]:
    """Returns what a submission_closed event adds to the run counters it finds (current).

    The first close (the first since the run was last reopened) sets them; a later
    one changes only the close time, and only when it closes earlier (a planner that
    said "until 07:00" and is done at 05:00). The sequence and announced count stay
    the first close's.
    """
    effective = max(receive_us, closed.submitted_until_us)
    if not current.get(SUBMISSION_CLOSED_KEY, 0):
        out = {SUBMISSION_CLOSED_KEY: sequence, SUBMISSION_CLOSED_US_KEY: effective}
        if closed.expected_shards:
            out[SUBMISSION_EXPECTED_KEY] = closed.expected_shards
        return out
    now = current.get(SUBMISSION_CLOSED_US_KEY, 0)
    return {SUBMISSION_CLOSED_US_KEY: effective - now} if effective < now else {}


def check_reopen(current: Mapping[str, int], event: Event) -> None:
    """Raises RunNotClosed unless a close stands (one not undone by a later reopen).

    A close whose submitted_until is still ahead stands too: a reopen withdraws it.
    """
    if current.get(SUBMISSION_CLOSED_KEY, 0):
        return
    reopened = current.get(SUBMISSION_REOPENED_KEY, 0)
    since = (
        f"it was reopened at sequence {reopened}"
        f" ({_short_time(current.get(SUBMISSION_REOPENED_US_KEY, 0))}) and not closed since"
        if reopened
        else "it was never closed"
    )
    raise RunNotClosed(
        f"run {event.run_id} is not closed ({since}): there is nothing to reopen",
        namespace=event.namespace,
        run_id=event.run_id,
        reopened_at_sequence=reopened,
    )


def reopening_delta(current: Mapping[str, int], sequence: int, receive_us: int) -> dict[str, int]:
    """Returns what a run_reopened event adds to the run counters it finds: the close undone.

    The close's sequence, time and announced count go back to 0 (the next close sets
    them afresh) and the reopen's sequence and time are kept. check_reopen first.
    """
    return {
        SUBMISSION_CLOSED_KEY: -current.get(SUBMISSION_CLOSED_KEY, 0),
        SUBMISSION_CLOSED_US_KEY: -current.get(SUBMISSION_CLOSED_US_KEY, 0),
        SUBMISSION_EXPECTED_KEY: -current.get(SUBMISSION_EXPECTED_KEY, 0),
        SUBMISSION_REOPENED_KEY: sequence - current.get(SUBMISSION_REOPENED_KEY, 0),
        SUBMISSION_REOPENED_US_KEY: receive_us - current.get(SUBMISSION_REOPENED_US_KEY, 0),
    }


def check_new_shard(
    current: Mapping[str, int], event: Event, receive_us: int, *, submitted: int
) -> None:
    """Raises RunClosed when a plan of a shard the run lacks arrives after its close took effect.

    A closed run's count is final: a new shard would unsettle it in silence (a
    settled run back to missing work). Until a close with submitted_until takes
    effect shards may still be added, and so may the shards a close announced
    (expected_shards) while fewer than that are planned (``submitted``, the run's
    shards before this one).
    """
    closed = current.get(SUBMISSION_CLOSED_KEY, 0)
    closed_us = current.get(SUBMISSION_CLOSED_US_KEY, 0)
    expected = current.get(SUBMISSION_EXPECTED_KEY, 0)
    if not closed or receive_us < closed_us or submitted < expected:
        return
    raise RunClosed(
        f"run {event.run_id} was closed at sequence {closed} ({_short_time(closed_us)}):"
        " plan --reopen to add shards",
        namespace=event.namespace,
        run_id=event.run_id,
        shard_id=event.shard_id,
        closed_at_sequence=closed,
        closed_at=iso_time(closed_us),
        expected_shards=expected,
        submitted=submitted,
    )


def iso_time(us: int) -> str:
    """Returns a server time in microseconds as an RFC 3339 UTC string."""
    return datetime.fromtimestamp(us / 1_000_000, UTC).isoformat(timespec="microseconds")


def _short_time(us: int) -> str:
    """Returns a server time to the second, as messages show it ("2026-12-04T04:12:03Z")."""
    return datetime.fromtimestamp(us // 1_000_000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def lifecycle(
    counters: Counter[str],
    *,
    running: int,
    stale: int,
    unverified: int,
    last_event_us: int,
    now_us: int,
) -> dict[str, Any]:
    """Returns where the run is in its life at now_us: open, submission_closed or settled.

    A reopened run (run_reopened after its close) is open again until the next close;
    reopened_at_sequence says when it was reopened last.

    A run is settled once its submission is closed (and at least the announced
    number of shards is planned) and the ledger waits on none of its shards: none
    running or stale and no committed output awaiting verification; every planned
    shard is verified, failed, or never started. It is a function of the summed
    counters, the stale count, the run's last event time and the clock, all of which a
    restart recomputes, so a restarted server reports the same settled_at.
    """
    submitted = counters.get("submitted", 0)
    closing_seq = counters.get(SUBMISSION_CLOSED_KEY, 0)
    closed_us = counters.get(SUBMISSION_CLOSED_US_KEY, 0)
    # A close with submitted_until in the future leaves the run open until then.
    closed_seq = closing_seq if closing_seq and now_us >= closed_us else 0
    expected = counters.get(SUBMISSION_EXPECTED_KEY, 0)
    unplanned = max(0, expected - submitted)
    waiting = {
        "running": running,
        "stale": stale,
        "unverified": unverified,
        "unplanned": unplanned,
    }
    settled = closed_seq > 0 and not any(waiting.values())
    # The event that settled it is the run's latest one: shards only end by an event,
    # and a running shard turning stale does not settle the run.
    settled_us = max(closed_us, last_event_us) if settled else None
    reopened = counters.get(SUBMISSION_REOPENED_KEY, 0)
    reopened_us = counters.get(SUBMISSION_REOPENED_US_KEY, 0)
    return {
        "state": "settled" if settled else "submission_closed" if closed_seq else "open",
        "submission_closed": closed_seq > 0,
        "submission_closed_at": iso_time(closed_us) if closed_seq else None,
        "submission_closed_at_us": closed_us if closed_seq else None,
        "submission_closed_at_sequence": closed_seq or None,
        "submission_closes_at": iso_time(closed_us) if closing_seq and not closed_seq else None,
        "expected_shards": expected or None,
        "settled": settled,
        "settled_at": iso_time(settled_us) if settled_us is not None else None,
        "settled_at_us": settled_us,
        "waiting_on": waiting,
        # The latest reopen, whether or not a close came after it (history, like settled_at).
        "reopened_at_sequence": reopened or None,
        "reopened_at": iso_time(reopened_us) if reopened else None,
        "reopened_at_us": reopened_us if reopened else None,
    }


def _rate(n: int, submitted: int) -> float:
    return n / submitted if submitted else 0.0


def run_summary(
    counters: Counter[str],
    *,
    stale: int,
    run_id: str,
    namespace: str,
    last_event_us: int,
    now_us: int,
) -> dict[str, Any]:
    """Returns the run summary from the summed counters and the stale count at now_us.

    last_event_us is when the run's latest event was received: the settled time.
    """
    submitted = counters.get("submitted", 0)
    states = {s: counters.get(f"state:{s}", 0) for s in BASE_STATES}
    running = states[ShardState.RUNNING] - stale
    verified = states[ShardState.VERIFIED]
    failed = states[ShardState.FAILED] + states[ShardState.VERIFY_FAILED]

    def prefixed(prefix: str) -> dict[str, int]:
        return dict(
            sorted((k[len(prefix) :], v) for k, v in counters.items() if k.startswith(prefix) and v)
        )

    closed = counters.get(PASS_CLOSED_KEY, 0)
    first_verified = counters.get("first:verified", 0)
    first_silent = counters.get("first:silent", 0)
    first_attempt = counters.get("first:attempt_verified", 0)
    return {
        "namespace": namespace,
        "run_id": run_id,
        "submitted": submitted,
        "verified": verified,
        "failed": failed,
        "missing": states[ShardState.PLANNED],
        "unverified": states[ShardState.COMMITTED],
        "running": running,
        "stale": stale,
        "verify_failed": states[ShardState.VERIFY_FAILED],
        # The partition of submitted under the names `shards --state` takes, each word
        # the same set there and here: "failed" above counts verify_failed too (kept as
        # it was for the scripts that read it), by_state's "failed" does not.
        "by_state": {
            QueryState.VERIFIED.value: verified,
            QueryState.FAILED.value: states[ShardState.FAILED],
            QueryState.VERIFY_FAILED.value: states[ShardState.VERIFY_FAILED],
            QueryState.MISSING.value: states[ShardState.PLANNED],
            QueryState.RUNNING.value: running,
            QueryState.STALE.value: stale,
            QueryState.UNVERIFIED.value: states[ShardState.COMMITTED],
        },
        "completion_rate": _rate(verified, submitted),
        "silent_errors": counters.get("silent", 0),
        "silent_error_rate": _rate(counters.get("silent", 0), submitted),
        "failure_tags": prefixed("tag:"),
        "attempt_failure_tags": prefixed("attempt_tag:"),
        "verify_failures": prefixed("verify_failed:"),
        "duplicates": {k: counters.get(f"dup:{k}", 0) for k in DUPLICATE_KINDS},
        "duplicate_shards": counters.get("dup:any", 0),
        "repairs": counters.get("repaired", 0),
        "fingerprint_groups": prefixed("fp:"),
        "attempts": counters.get("attempts", 0),
        "unconfirmed": submitted - verified,
        "numeric": counters.get("numeric", 0),
        "late_attempts": counters.get("late_attempts", 0),
        "recomputed": counters.get("recomputed", 0),
        "recomputed_rate": _rate(counters.get("recomputed", 0), submitted),
        "first_pass": {
            "closed": closed > 0,
            "closed_at_sequence": closed or None,
            "verified": first_verified,
            "completion_rate": _rate(first_verified, submitted),
            "silent_errors": first_silent,
            "silent_error_rate": _rate(first_silent, submitted),
            "first_attempt_verified": first_attempt,
            "reconciliation_rate": _rate(first_attempt, submitted),
            "missing": counters.get("first:missing", 0),
            "numeric": counters.get("first:numeric", 0),
        },
        "lifecycle": lifecycle(
            counters,
            running=running,
            stale=stale,
            unverified=states[ShardState.COMMITTED],
            last_event_us=last_event_us,
            now_us=now_us,
        ),
    }


def matches(record: ShardRecord, query: str, now_us: int) -> bool:
    """Returns whether the shard belongs to a ``shards --state`` query (a shown name or alias)."""
    query = canonical_query(query)
    state, _ = live_state(record, now_us)
    if query == QueryState.LIVE:
        return state == ShardState.RUNNING
    if query == QueryState.DUPLICATE:
        return bool(duplicate_kinds(record))
    if query == QueryState.UNCONFIRMED:
        return state != ShardState.VERIFIED
    return shown_state(state) == query


def shard_view(record: ShardRecord, now_us: int) -> dict[str, Any]:
    """Returns the JSON view of one shard that `shards` prints."""
    state, detail = live_state(record, now_us)
    latest = record.attempts.get(record.latest_attempt)
    definition = json.loads(record.definition_json)
    return {
        "shard_id": record.shard_id,
        "plan_index": record.plan_index,
        "state": shown_state(state),
        "detail": detail,
        "input": definition.get("input_ref", ""),
        "plan": {
            "input_ref": definition.get("input_ref", ""),
            "input_bytes": int(definition.get("input_bytes", 0)),
            "input_blake3": definition.get("input_blake3", ""),
            "params_json": definition.get("params_json", "{}"),
            "expected_outputs": list(definition.get("expected_outputs", [])),
            "labels": dict(record.labels),
        },
        "attempts": len(record.attempts),
        "latest_attempt": record.latest_attempt,
        # Every attempt, not only the latest: a rerun shard's first-pass job is here.
        "attempt_history": attempt_history(record, now_us),
        "host": latest.host if latest else "",
        "pid": latest.pid if latest else None,
        "scheduler": dict(latest.scheduler) if latest else {},
        "process_start_ticks": latest.process_start_ticks if latest else 0,
        "deadline_us": deadline_us(record),
        "last_seen_us": latest.last_seen_us if latest else None,
        "last_step": latest.last_step if latest else None,
        "fingerprint": fingerprint_of(record),
        "artifacts": {
            n: {"path": v[0], "size_bytes": v[1], "blake3": v[2]}
            for n, v in latest.artifacts.items()
        }
        if latest
        else {},
        "duplicates": duplicate_kinds(record),
        "repaired": repaired(record),
        "failures": list(record.failures),
        "numeric": numeric_warning(latest),
        "first_pass": first_pass_outcome(record),
        **_ranks_view(latest, now_us),
    }


def _ranks_view(latest: Attempt | None, now_us: int) -> dict[str, Any]:
    """Returns the latest attempt's ranks for the view, only for a multi-rank attempt."""
    if latest is None or not ranks.is_ranked(latest):
        return {}
    rows = ranks.ranks_view(latest, now_us)
    return {
        "world_size": latest.world_size,
        "launch_id": latest.launch_id,
        "restart_count": latest.restart_count,
        "ranks_alive": sum(1 for r in rows if r["alive"]),
        "ranks": rows,
    }
