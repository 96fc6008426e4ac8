# Over 400 lines on purpose: the fold (check + apply) and the state, deadline and resume reason it implies, run alike by server and replay.
"""Pure folds from events to read models: shard state, duplicates, summary, resume.

Every function here is a function of events and ``now`` only, so the server's
incrementally maintained projections and a fresh replay compute the same
thing. No grpc, protobuf, SQL or clocks.

Life cycle of one shard (see docs/projections.md):

    planned ─started─▶ running ─commit all─▶ committed ─verify pass─▶ verified
                         │  │                    └──verify fail──▶ verify_failed
                         │  └─ failed(tag) ─▶ failed
                         └─ silent past heartbeat timeout ─▶ stale (time-dependent)
"""

from __future__ import annotations

import json
from typing import Any, Final

from ledger_server import ranks
from ledger_server.errors import LifecycleViolation, PlanConflict
from ledger_server.events import (
    ArtifactCommitted,
    ArtifactVerified,
    AttemptFailed,
    AttemptStarted,
    CheckpointSaved,
    Event,
    Heartbeat,
    RecordedEvent,
    ShardPlanned,
)
from ledger_server.inputs import input_change, planned_identity, revision_change
from ledger_server.record import Attempt, ShardRecord, plan_line_for
from ledger_server.states import QueryState, ShardState
from shard_client.canonical import canonical_json, legacy_json
from shard_client.vocabulary import VERIFIER_REASONS, FailureTag

# --- the fold ---------------------------------------------------------------


def check(record: ShardRecord | None, event: Event) -> bool:
    """Returns whether the event is to be appended: False for a plan identical to the stored one.

    Raises PlanConflict or LifecycleViolation when the event may not follow the
    shard's history; the writer and the importer both ask here before fold().
    """
    if isinstance(event.payload, ShardPlanned):
        return check_plan(record, event)
    check_lifecycle(record, event)
    return True


def fold(record: ShardRecord | None, rec: RecordedEvent, *, first_pass: bool = True) -> ShardRecord:
    """Folds one accepted event into the shard's record (a plan creates it); returns the record.

    The one fold of the writer, the importer and the replay; check() has already
    said the event may follow, so a plan here is always the shard's first.
    ``first_pass`` says whether the run's first pass is still open (no verdict in
    the run yet); it matters only to a started event, whose attempt it marks.
    """
    if isinstance(rec.event.payload, ShardPlanned):
        if record is None:
            return new_record(rec)
        if rec.event.payload.input_revision:
            revise_input(record, rec)
        return record  # otherwise a stored plan identical to the first (older ledgers)
    assert record is not None, "check() refuses an event of a shard never planned"
    apply(record, rec, first_pass=first_pass)
    return record


def check_plan(record: ShardRecord | None, event: Event) -> bool:
    """Returns True when the plan is new, False when identical; raises PlanConflict otherwise."""
    assert isinstance(event.payload, ShardPlanned)
    if event.payload.input_revision:
        return _check_revision(record, event)
    if record is None:
        return True
    definition = canonical_json(event.payload.definition())
    if record.definition_json != definition and not same_definition(
        record.definition_json, definition
    ):
        raise PlanConflict(
            f"shard {event.shard_id} was planned with a different definition",
            shard_id=event.shard_id,
            existing_sequence=record.planned_seq,
        )
    return False


def _check_revision(record: ShardRecord | None, event: Event) -> bool:
    """Returns whether a revision of the shard's input is new; raises when it may not be one."""
    p = event.payload
    assert isinstance(p, ShardPlanned)
    if record is None:
        raise LifecycleViolation(
            f"shard {event.shard_id} of run {event.run_id} was never planned: a revision of"
            " its input needs the plan it revises",
            reason="SHARD_NOT_PLANNED",
            shard_id=event.shard_id,
        )
    stored = json.loads(record.definition_json)
    sent = p.definition()
    kept = ("input_ref", "params_json", "expected_outputs")
    stored["params_json"] = _params_meaning(stored["params_json"])
    sent["params_json"] = _params_meaning(sent["params_json"])
    differ = [name for name in kept if stored[name] != sent[name]]
    if differ:
        raise PlanConflict(
            f"shard {event.shard_id}: a revision may change only its input's content and"
            f" identity, not its {', '.join(differ)}",
            shard_id=event.shard_id,
            existing_sequence=record.planned_seq,
        )
    same_content = int(stored["input_bytes"]) == p.input_bytes and (
        stored["input_blake3"] == p.input_blake3
    )
    return not (same_content and record.input_identity == planned_identity(p))


def revise_input(record: ShardRecord, rec: RecordedEvent) -> None:
    """Folds a revision of the shard's input: the plan's input is the revision's from now on.

    If the bytes changed, every earlier attempt computed on other bytes: it may not
    commit any more, and nothing it committed confirms the shard.
    """
    p = rec.event.payload
    assert isinstance(p, ShardPlanned)
    changed = revision_change(record.definition_json, p)
    record.definition_json = canonical_json(p.definition())
    record.input_identity = planned_identity(p)
    if p.plan_line:
        record.plan_line = plan_line_for(rec.event.shard_id, p)
    record.state_memo = None
    if changed:
        for attempt in record.attempts.values():
            if not attempt.input_changed:
                attempt.input_changed = f"the plan's input was revised at sequence {rec.sequence}"


def _params_meaning(params_json: str) -> str:
    value = json.loads(params_json)
    try:
        return canonical_json(value)
    except ValueError:  # an integer past 2**53 in a plan of row format 1: exact digits
        return legacy_json(value)


def same_definition(stored_json: str, definition_json: str) -> bool:
    """Returns whether two definitions' JSON say the same, their params compared by meaning.

    A plan stored in row format 1 holds its params in Python's encoding ({"lr":1.0}); the
    same plan sent again is normalized to RFC 8785 ({"lr":1}) and is the same plan.
    """
    stored, sent = json.loads(stored_json), json.loads(definition_json)
    stored["params_json"] = _params_meaning(stored["params_json"])
    sent["params_json"] = _params_meaning(sent["params_json"])
    return bool(stored == sent)


def check_lifecycle(record: ShardRecord | None, event: Event) -> None:
    """Raises LifecycleViolation when the event may not follow the shard's history."""
    p = event.payload
    if record is None:
        raise LifecycleViolation(
            f"shard {event.shard_id} of run {event.run_id} was never planned",
            reason="SHARD_NOT_PLANNED",
            shard_id=event.shard_id,
        )
    attempt = record.attempts.get(event.attempt_id)
    if isinstance(p, AttemptStarted):
        if attempt is not None:
            ranks.check_join(attempt, event, p)  # another rank of the attempt, or refused
        return
    if isinstance(p, ArtifactVerified):
        if not _was_committed(record, event.attempt_id, p):
            raise LifecycleViolation(
                f"no artifact {p.name!r} at {p.path} with digest {p.blake3_hex} was committed",
                reason="ARTIFACT_NOT_COMMITTED",
                shard_id=event.shard_id,
                name=p.name,
            )
        return
    if attempt is None:
        raise LifecycleViolation(
            f"attempt {event.attempt_id} of shard {event.shard_id} never started",
            reason="ATTEMPT_NOT_STARTED",
            attempt_id=event.attempt_id,
        )
    if attempt.failed_tag:
        raise LifecycleViolation(
            f"attempt {event.attempt_id} already ended with failed({attempt.failed_tag})",
            reason="ATTEMPT_ENDED",
            attempt_id=event.attempt_id,
        )
    if attempt.input_changed and isinstance(p, (ArtifactCommitted, CheckpointSaved)):
        # Nothing computed on other bytes than the plan's is recorded as the shard's.
        raise LifecycleViolation(
            f"attempt {event.attempt_id} of shard {event.shard_id} did not read the planned"
            f" input ({attempt.input_changed}): record failed(input_changed) and rerun",
            reason="INPUT_CHANGED",
            attempt_id=event.attempt_id,
        )
    ranks.check_rank(attempt, event)


def _was_committed(record: ShardRecord, attempt_id: str, p: ArtifactVerified) -> bool:
    # A verdict that names its attempt is about that attempt's current commit of the
    # name, exactly: (name, path, digest). One without an attempt (verifiers before
    # record version 2) names a commit of the shard: what an attempt holds now as its
    # commit of the name, or an earlier commit of the name overwritten in place (the
    # digest was committed for the name, and the path is where an attempt holds the
    # name now: a verifier that read the file after it was replaced).
    if attempt_id:
        attempt = record.attempts.get(attempt_id)
        held = attempt.artifacts.get(p.name) if attempt is not None else None
        return held is not None and (held[0], held[2]) == (p.path, p.blake3_hex)
    current = [a.artifacts[p.name] for a in record.attempts.values() if p.name in a.artifacts]
    if any((path, digest) == (p.path, p.blake3_hex) for path, _, digest in current):
        return True
    return any(path == p.path for path, _, _ in current) and any(
        p.blake3_hex in digests
        for group, digests in record.commit_digests.items()
        if group.partition("\x00")[0] == p.name
    )


def new_record(rec: RecordedEvent) -> ShardRecord:
    """Returns the record a planned event creates."""
    p = rec.event.payload
    assert isinstance(p, ShardPlanned)
    return ShardRecord(
        shard_id=rec.event.shard_id,
        plan_index=p.plan_index,
        plan_line=plan_line_for(rec.event.shard_id, p),
        definition_json=canonical_json(p.definition()),
        expected_outputs=p.expected_outputs,
        planned_seq=rec.sequence,
        labels=dict(p.labels),
        input_identity=planned_identity(p),
    )


def apply(record: ShardRecord, rec: RecordedEvent, *, first_pass: bool = True) -> None:
    """Folds one accepted, non-plan event into the shard's record."""
    event, p, now = rec.event, rec.event.payload, rec.receive_time_us
    if not isinstance(p, (Heartbeat, CheckpointSaved)) or ranks.changes_state(p):
        record.state_memo = None  # only these two never change the base state
    if isinstance(p, AttemptStarted):
        joined = record.attempts.get(event.attempt_id)
        if joined is not None:
            # Another rank of a multi-rank attempt: the attempt stays what it is.
            ranks.join_rank(joined, p, now)
            joined.late = joined.late or arrived_late(joined, event.client_time_us, now)
            joined.gpus += p.gpu_count
            if not joined.input_changed:  # one rank that read other bytes taints the attempt
                joined.input_changed = input_change(
                    record.definition_json, record.input_identity, p
                )
            return
        attempt = record.attempts[event.attempt_id] = Attempt(
            attempt_id=event.attempt_id,
            started_seq=rec.sequence,
            host=p.host,
            pid=p.pid,
            timeout_us=p.heartbeat_timeout_us,
            fingerprint_digest=p.fingerprint_digest,
            last_seen_us=now,
            first_pass=first_pass,
            scheduler=dict(p.scheduler),
            process_start_ticks=p.process_start_ticks,
            started_us=now,
            client_started_us=event.client_time_us,
            gpus=p.gpu_count,
            labels=dict(p.labels),
            input_changed=input_change(record.definition_json, record.input_identity, p),
        )
        ranks.open_ranks(attempt, p, now)
        record.latest_attempt = event.attempt_id
        return
    if isinstance(p, ArtifactVerified):
        _fold_verdict(record, event.attempt_id, p)
        return
    if isinstance(p, Heartbeat):
        fold_beat(record, event.attempt_id, now, p.step)
        attempt = record.attempts[event.attempt_id]
        attempt.late = attempt.late or arrived_late(attempt, event.client_time_us, now)
        if ranks.is_ranked(record.attempts[event.attempt_id]):
            ranks.fold_rank_event(record.attempts[event.attempt_id], p, now)
        if p.nonfinite_metrics:
            fold_numeric(record.attempts[event.attempt_id], p.step, p.nonfinite_metrics)
        return
    attempt = record.attempts[event.attempt_id]
    attempt.last_seen_us = max(attempt.last_seen_us, now)
    if ranks.is_ranked(attempt):
        ranks.fold_rank_event(attempt, p, now)
    attempt.late = attempt.late or arrived_late(attempt, event.client_time_us, now)
    if isinstance(p, CheckpointSaved):
        if ranks.fold_checkpoint_part(attempt, p):  # a sharded one counts once whole
            attempt.last_step = max(attempt.last_step, p.step)
            attempt.last_checkpoint = p.path
            attempt.saved_us = max(attempt.saved_us, now)
            if p.write_us > 0:
                attempt.checkpoint_writes.append(p.write_us)
    elif isinstance(p, ArtifactCommitted):
        if p.path in record.path_heads or any(
            held[0] == p.path and held[2] != p.blake3_hex
            for other in record.attempts.values()
            for name, held in other.artifacts.items()
            if not (other is attempt and name == p.name)
        ):
            record.path_heads[p.path] = p.blake3_hex  # other bytes were committed there
        attempt.artifacts[p.name] = (p.path, p.size_bytes, p.blake3_hex)
        if attempt.first_pass and not first_pass and p.name not in attempt.after_pass:
            attempt.after_pass.append(p.name)  # the first pass never saw this commit
        attempt.verdicts.pop(p.name, None)  # a new commit is unverified until verified itself
        group = f"{p.name}\x00{attempt.fingerprint_digest}"
        digests = record.commit_digests.setdefault(group, [])
        if p.blake3_hex not in digests:
            digests.append(p.blake3_hex)
        # A commit from an attempt that a newer one superseded is a zombie's.
        if event.attempt_id != record.latest_attempt:
            record.zombie_commits += 1
            attempt.zombie = True
        if not attempt.failed_tag:  # an attempt that ends cleanly ends at its last commit
            attempt.ended_us, attempt.client_ended_us = now, event.client_time_us
    elif isinstance(p, AttemptFailed):
        if not attempt.failed_tag:
            attempt.ended_us, attempt.client_ended_us = now, event.client_time_us
        attempt.failed_tag = p.tag
        attempt.failed_message = p.message
        attempt.failed_after_pass = attempt.first_pass and not first_pass
        record.failures.append(p.tag)


def _fold_verdict(record: ShardRecord, attempt_id: str, p: ArtifactVerified) -> None:
    """Hands a verdict to the commit it is about: one attempt's, or (unnamed) every holder's."""
    if p.reason in VERIFIER_REASONS:
        return
    holders = [record.attempts[attempt_id]] if attempt_id else record.attempts.values()
    for attempt in holders:
        held = attempt.artifacts.get(p.name)
        if held is not None and (held[0], held[2]) == (p.path, p.blake3_hex):
            attempt.verdicts[p.name] = (p.result, p.reason)


def fold_numeric(attempt: Attempt, step: int, names: tuple[str, ...]) -> None:
    """Records non-finite metrics: the first step they were seen at, and every name seen."""
    if attempt.numeric_step < 0 or step < attempt.numeric_step:
        attempt.numeric_step = max(step, 0)
    for name in names:
        if name not in attempt.numeric_metrics:
            attempt.numeric_metrics.append(name)


def arrived_late(attempt: Attempt, made_us: int, receive_us: int) -> bool:
    """Returns whether the event took longer to reach the ledger than the attempt's started
    event did, or the started event longer than it, by more than the heartbeat timeout.

    Such an event waited in a spool, and the ledger showed the attempt wrong meanwhile
    (stale, or its figures behind). Each event's transit, receive time less client
    time, mixes two clocks, the ledger's and the job's: the difference of two transits
    of one attempt does not, so a job clock that is ten minutes off makes no attempt
    late and hides no late one. What it cannot see is an attempt whose every event
    waited alike, all of it shorter than its heartbeat timeout (nothing tells that
    wait from a skew). The ranks of one attempt are taken to share a clock (NTP).
    """
    if made_us <= 0 or attempt.client_started_us <= 0:
        return False
    transit = receive_us - made_us
    anchor = attempt.started_us - attempt.client_started_us
    return abs(transit - anchor) > attempt.timeout_us


def clock_skew_us(attempt: Attempt) -> int | None:
    """Returns the job's clock less the ledger's, from the attempt's most promptly delivered
    event among its start and its end (exact but for that event's transit); None unknown."""
    transits = []
    if attempt.client_started_us > 0:
        transits.append(attempt.started_us - attempt.client_started_us)
    if attempt.client_ended_us > 0 and attempt.ended_us > 0:
        transits.append(attempt.ended_us - attempt.client_ended_us)
    return -min(transits) if transits else None


# A start and an end of one process whose transits differ by this much did not both
# travel at once: one of them waited (the SDK spools after 5 s of an unreachable ledger).
LATE_GAP_US: Final = 5_000_000


def delivery_gap_us(attempt: Attempt) -> int | None:
    """Returns how much longer the attempt's start took to reach the ledger than its end.

    Positive: the start waited (a spool drained it after the job had moved on);
    negative: the end did. Both transits mix the job's clock and the ledger's, and the
    difference cancels them, as in arrived_late. None: either end carries no client
    time, or the attempt has several processes (their clocks need not agree).
    """
    if attempt.client_started_us <= 0 or attempt.client_ended_us <= 0 or attempt.ended_us <= 0:
        return None
    if attempt.world_size > 1:
        return None
    start = attempt.started_us - attempt.client_started_us
    return start - (attempt.ended_us - attempt.client_ended_us)


def is_late(attempt: Attempt) -> bool:
    """Returns whether some of the attempt's events reached the ledger late (from a spool).

    Late: an event waited longer than its start by more than the heartbeat timeout
    (arrived_late: the ledger showed the attempt wrong meanwhile), or its start and
    its end, which both carry the job's clock, arrived LATE_GAP_US or more apart
    relative to when they were made (the ledger's receive time of the start is then
    not when the job started: `shards --attempts` shows both).
    """
    gap = delivery_gap_us(attempt)
    return attempt.late or (gap is not None and abs(gap) >= LATE_GAP_US)


def marks_late(record: ShardRecord | None, event: Event, now_us: int) -> bool:
    """Returns whether folding the event turns its attempt late (so the counters move)."""
    attempt = record.attempts.get(event.attempt_id) if record is not None else None
    if attempt is None or attempt.late or isinstance(event.payload, ArtifactVerified):
        return False
    return arrived_late(attempt, event.client_time_us, now_us)


def fold_live_beat(record: ShardRecord | None, event: Event, now_us: int) -> bool:
    """Folds a plain heartbeat of the shard's latest live attempt; False: not that case.

    The writer's fast path for most of a night's events. Its contract, which the
    property test checks on random histories: when it returns True the record is
    what check() and fold() make of the same event (which they accept); when it
    returns False it changed nothing and the event takes the generic path. Any
    heartbeat the generic fold treats differently (non-finite metrics flag the
    shard; an older attempt's beat rewrites the whole row) stays out of it.
    """
    p = event.payload
    if record is None or type(p) is not Heartbeat or p.nonfinite_metrics:
        return False
    if p.rank or p.rank_finished or event.attempt_id != record.latest_attempt:
        return False
    attempt = record.attempts.get(event.attempt_id)
    # A rank of a multi-rank attempt keeps its own liveness in the record: generic fold.
    # So does an attempt that committed its outputs: its steps count in the field figures.
    # The tests inline what is_ranked and marks_late decide, and ask is_complete only of an
    # attempt with artifacts (none: never complete): this runs for most events of a night.
    if (
        attempt is None
        or attempt.failed_tag
        or attempt.world_size > 1
        or (attempt.artifacts and is_complete(record, attempt))
        # The attempt turns late: its counters move.
        or (not attempt.late and arrived_late(attempt, event.client_time_us, now_us))
    ):
        return False
    fold_beat(record, event.attempt_id, now_us, p.step)
    return True


def fold_beat(record: ShardRecord, attempt_id: str, now_us: int, step: int) -> None:
    """Folds a heartbeat: the attempt was seen at now_us and reached step (both by max)."""
    attempt = record.attempts[attempt_id]
    if now_us > attempt.last_seen_us:
        attempt.last_seen_us = now_us
    if step > attempt.last_step:
        attempt.last_step = step


# --- derived views ----------------------------------------------------------


def required_outputs(record: ShardRecord, attempt: Attempt | None = None) -> tuple[str, ...]:
    """Returns the plan's expected outputs; for an attempt, each ``{rank}`` name once per rank."""
    if attempt is None:
        return record.expected_outputs
    return ranks.expand_outputs(record.expected_outputs, attempt.world_size)


def _evidence(record: ShardRecord) -> list[Attempt]:
    """Returns the attempts whose commits can vouch for the shard: those that read its input."""
    return [a for a in record.attempts.values() if not a.input_changed]


def is_complete(record: ShardRecord, attempt: Attempt) -> bool:
    required = required_outputs(record, attempt)
    if required:
        return all(name in attempt.artifacts for name in required)
    return bool(attempt.artifacts)


def is_intact(record: ShardRecord, attempt: Attempt) -> bool:
    """Returns whether every artifact of the attempt is still its path's latest commit."""
    heads = record.path_heads
    return not heads or all(
        heads.get(path, digest) == digest for path, _, digest in attempt.artifacts.values()
    )


def verdicts_of(record: ShardRecord, attempt: Attempt) -> list[tuple[str, str] | None]:
    names = required_outputs(record, attempt) or tuple(sorted(attempt.artifacts))
    return [attempt.verdicts.get(name) for name in names]


def confirmed_attempt(record: ShardRecord) -> Attempt | None:
    """Returns an attempt whose full artifact set was committed, is intact and verified, if any."""
    for attempt in sorted(_evidence(record), key=lambda a: -a.started_seq):
        if is_complete(record, attempt) and is_intact(record, attempt):
            verdicts = verdicts_of(record, attempt)
            if all(v is not None and v[0] == "passed" for v in verdicts):
                return attempt
    return None


def base_state(record: ShardRecord) -> tuple[ShardState, str]:
    """Returns the shard's time-independent state and a detail (tag or reason)."""
    if record.state_memo is None:
        record.state_memo = _base_state(record)
    return record.state_memo


def _base_state(record: ShardRecord) -> tuple[ShardState, str]:
    if confirmed_attempt(record) is not None:
        return ShardState.VERIFIED, ""
    latest = record.attempts.get(record.latest_attempt)
    if latest is None:
        return ShardState.PLANNED, ""
    if (
        not latest.failed_tag
        and not latest.input_changed  # it may not commit: it has ended, in effect
        and not is_complete(record, latest)
        and not ranks.all_finished(latest)  # every rank gone with an output missing
    ):
        return ShardState.RUNNING, ""
    complete = [a for a in _evidence(record) if is_complete(record, a)]
    complete.sort(key=lambda a: -a.started_seq)
    intact = [a for a in complete if is_intact(record, a)]
    for attempt in intact:
        verdicts = verdicts_of(record, attempt)
        if all(v is None or v[0] == "passed" for v in verdicts):
            return ShardState.COMMITTED, ""
    for attempt in intact:
        failing = [v for v in verdicts_of(record, attempt) if v is not None and v[0] == "failed"]
        if failing:
            return ShardState.VERIFY_FAILED, failing[0][1] or "unknown"
    if len(intact) < len(complete):
        # A finished set whose file another commit replaced (two attempts renaming onto
        # one path): what it vouched for is no longer on disk.
        return ShardState.VERIFY_FAILED, "overwritten"
    # Every rank of the latest attempt finished cleanly, an expected output still missing
    # (or it read another input than the plan's).
    if latest.input_changed and not latest.failed_tag:
        return ShardState.FAILED, FailureTag.INPUT_CHANGED
    return ShardState.FAILED, latest.failed_tag or "incomplete"


def deadline_us(record: ShardRecord) -> int | None:
    """Returns when a running shard turns stale (server clock), or None."""
    if base_state(record)[0] != ShardState.RUNNING:
        return None
    latest = record.attempts[record.latest_attempt]
    if ranks.is_ranked(latest):
        return ranks.deadline_us(latest)  # the first rank to fall silent makes it stale
    return latest.last_seen_us + latest.timeout_us


def row_columns(record: ShardRecord) -> dict[str, Any]:
    """Returns the stored columns of a shard's projection row (every store, every writer)."""
    state, detail = base_state(record)
    return {
        "plan_index": record.plan_index,
        "state": state.value,  # a plain str: a driver binds it as text
        "detail": detail,
        "deadline_us": deadline_us(record),
        "plan_line": record.plan_line,
        "record": record.to_json().encode(),
    }


def live_state(record: ShardRecord, now_us: int) -> tuple[str, str]:
    """Returns the shard's state at now_us: base state, with stale split from running."""
    state, detail = base_state(record)
    if state == ShardState.RUNNING:
        deadline = deadline_us(record)
        assert deadline is not None
        if deadline < now_us:
            return QueryState.STALE, ""
    return state, detail


RESUME_REASONS: Final[dict[str, str]] = {
    ShardState.PLANNED: "missing",
    ShardState.RUNNING: "running",
    QueryState.STALE: "stale",
    ShardState.COMMITTED: "unverified",
}
# These two carry the shard's detail (the failure tag, the verification reason) after them.
RESUME_DETAIL_PREFIXES: Final[dict[str, str]] = {
    ShardState.FAILED: "failed:",
    ShardState.VERIFY_FAILED: "verify_failed:",
}


def resume_reason(record: ShardRecord, now_us: int) -> str | None:
    """Returns why the shard must run again, or None when it is confirmed."""
    state, detail = live_state(record, now_us)
    if state == ShardState.VERIFIED:
        return None
    prefix = RESUME_DETAIL_PREFIXES.get(state)
    return prefix + detail if prefix is not None else RESUME_REASONS[state]
