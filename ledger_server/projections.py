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

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

from ledger_server.chain import event_from_parsed, parse_row
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
from ledger_server.states import BASE_STATES, QueryState, ShardState
from shard_client.canonical import canonical_json

DUPLICATE_KINDS: Final = ("wasted", "nondeterministic", "zombie")


@dataclass(slots=True)
class Attempt:
    """One attempt at a shard, as far as the events tell."""

    attempt_id: str
    started_seq: int
    host: str
    pid: int
    timeout_us: int
    fingerprint_digest: str
    last_seen_us: int
    failed_tag: str = ""
    failed_message: str = ""
    # name -> (path, size_bytes, blake3_hex) of the latest commit of that name.
    artifacts: dict[str, tuple[str, int, str]] = field(default_factory=dict)
    last_step: int = -1
    last_checkpoint: str = ""


@dataclass(slots=True)
class ShardRecord:
    """Everything the projections know about one shard."""

    shard_id: str
    plan_index: int
    plan_line: str
    definition_json: str
    expected_outputs: tuple[str, ...]
    planned_seq: int
    attempts: dict[str, Attempt] = field(default_factory=dict)
    latest_attempt: str = ""
    # (name, fingerprint digest) -> set of digests committed: non-determinism.
    commit_digests: dict[str, list[str]] = field(default_factory=dict)
    commit_count: dict[str, int] = field(default_factory=dict)
    zombie_commits: int = 0
    # (path, blake3) -> (result, reason) of the latest verification.
    verdicts: dict[str, tuple[str, str]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    # path -> blake3 of the latest commit there, kept only for paths that two commits
    # (of any attempts or names) gave different bytes: on every other path each holder's
    # digest is the latest. An artifact is intact only while it is still its path's bytes.
    path_heads: dict[str, str] = field(default_factory=dict)
    # base_state's answer, kept until apply() folds an event that may change it; not stored.
    state_memo: tuple[ShardState, str] | None = field(default=None, compare=False, repr=False)

    def to_json(self) -> str:
        """Returns the record as canonical JSON for storage."""
        data: dict[str, Any] = {
            "shard_id": self.shard_id,
            "plan_index": self.plan_index,
            "plan_line": self.plan_line,
            "definition_json": self.definition_json,
            "expected_outputs": list(self.expected_outputs),
            "planned_seq": self.planned_seq,
            "attempts": {
                k: {
                    "attempt_id": a.attempt_id,
                    "started_seq": a.started_seq,
                    "host": a.host,
                    "pid": a.pid,
                    "timeout_us": a.timeout_us,
                    "fingerprint_digest": a.fingerprint_digest,
                    "last_seen_us": a.last_seen_us,
                    "failed_tag": a.failed_tag,
                    "failed_message": a.failed_message,
                    "artifacts": {n: list(v) for n, v in a.artifacts.items()},
                    "last_step": a.last_step,
                    "last_checkpoint": a.last_checkpoint,
                }
                for k, a in self.attempts.items()
            },
            "latest_attempt": self.latest_attempt,
            "commit_digests": self.commit_digests,
            "commit_count": self.commit_count,
            "zombie_commits": self.zombie_commits,
            "verdicts": {k: list(v) for k, v in self.verdicts.items()},
            "failures": self.failures,
        }
        if self.path_heads:  # absent until a path is overwritten: older records read the same
            data["path_heads"] = self.path_heads
        return canonical_json(data)

    @classmethod
    def from_json(cls, text: str | bytes) -> ShardRecord:
        """Parses a record stored by to_json."""
        import json

        d = json.loads(text)
        attempts = {}
        for k, a in d["attempts"].items():
            a["artifacts"] = {n: (v[0], v[1], v[2]) for n, v in a["artifacts"].items()}
            attempts[k] = Attempt(**a)
        return cls(
            shard_id=d["shard_id"],
            plan_index=d["plan_index"],
            plan_line=d["plan_line"],
            definition_json=d["definition_json"],
            expected_outputs=tuple(d["expected_outputs"]),
            planned_seq=d["planned_seq"],
            attempts=attempts,
            latest_attempt=d["latest_attempt"],
            commit_digests=d["commit_digests"],
            commit_count=d["commit_count"],
            zombie_commits=d["zombie_commits"],
            verdicts={k: (v[0], v[1]) for k, v in d["verdicts"].items()},
            failures=d["failures"],
            path_heads=d.get("path_heads", {}),
        )


def record_from_row(record: str | bytes, beat_us: int | None, beat_step: int | None) -> ShardRecord:
    """Parses a stored record and folds in the heartbeat columns written after it.

    A heartbeat of the latest attempt only moves that attempt's last_seen_us and
    last_step, so the writer stores those two numbers (and the deadline) instead of
    re-encoding the whole record; both fold by max, exactly as apply() does.
    """
    out = ShardRecord.from_json(record)
    if beat_us is not None:
        latest = out.attempts.get(out.latest_attempt)
        if latest is not None:
            latest.last_seen_us = max(latest.last_seen_us, beat_us)
            latest.last_step = max(latest.last_step, beat_step if beat_step is not None else -1)
    return out


def plan_line_for(shard_id: str, plan: ShardPlanned) -> str:
    """Returns the plan line handed back in resume lists (the original one when given)."""
    if plan.plan_line:
        return plan.plan_line
    import json

    return canonical_json(
        {
            "shard_id": shard_id,
            "input_ref": plan.input_ref,
            "input_bytes": plan.input_bytes,
            "input_blake3": plan.input_blake3,
            "params": json.loads(plan.params_json),
            "expected_outputs": list(plan.expected_outputs),
        }
    )


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


def fold(record: ShardRecord | None, rec: RecordedEvent) -> ShardRecord:
    """Folds one accepted event into the shard's record (a plan creates it); returns the record.

    The one fold of the writer, the importer and the replay; check() has already
    said the event may follow, so a plan here is always the shard's first.
    """
    if isinstance(rec.event.payload, ShardPlanned):
        return new_record(rec)
    assert record is not None, "check() refuses an event of a shard never planned"
    apply(record, rec)
    return record


def check_plan(record: ShardRecord | None, event: Event) -> bool:
    """Returns True when the plan is new, False when identical; raises PlanConflict otherwise."""
    assert isinstance(event.payload, ShardPlanned)
    if record is None:
        return True
    if record.definition_json != canonical_json(event.payload.definition()):
        raise PlanConflict(
            f"shard {event.shard_id} was planned with a different definition",
            shard_id=event.shard_id,
            existing_sequence=record.planned_seq,
        )
    return False


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
            raise LifecycleViolation(
                f"attempt {event.attempt_id} already started",
                reason="ATTEMPT_ALREADY_STARTED",
                attempt_id=event.attempt_id,
                existing_sequence=attempt.started_seq,
            )
        return
    if isinstance(p, ArtifactVerified):
        if not _was_committed(record, p):
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


def _was_committed(record: ShardRecord, p: ArtifactVerified) -> bool:
    # A verdict names a commit of the shard: what an attempt holds now as its commit of
    # the name (name, path, digest), or an earlier commit of the name overwritten in
    # place (the digest was committed for the name, and the path is where an attempt
    # holds the name now: a verifier that read the file after it was replaced). A path
    # no attempt holds is refused: verdicts are keyed by (path, digest), so one on such
    # a path would confirm a later commit of it that nobody verified.
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
    )


def apply(record: ShardRecord, rec: RecordedEvent) -> None:
    """Folds one accepted, non-plan event into the shard's record."""
    event, p, now = rec.event, rec.event.payload, rec.receive_time_us
    if not isinstance(p, (Heartbeat, CheckpointSaved)):
        record.state_memo = None  # only these two never change the base state
    if isinstance(p, AttemptStarted):
        record.attempts[event.attempt_id] = Attempt(
            attempt_id=event.attempt_id,
            started_seq=rec.sequence,
            host=p.host,
            pid=p.pid,
            timeout_us=p.heartbeat_timeout_us,
            fingerprint_digest=p.fingerprint_digest,
            last_seen_us=now,
        )
        record.latest_attempt = event.attempt_id
        return
    if isinstance(p, ArtifactVerified):
        record.verdicts[f"{p.path}\x00{p.blake3_hex}"] = (p.result, p.reason)
        return
    if isinstance(p, Heartbeat):
        fold_beat(record, event.attempt_id, now, p.step)
        return
    attempt = record.attempts[event.attempt_id]
    attempt.last_seen_us = max(attempt.last_seen_us, now)
    if isinstance(p, CheckpointSaved):
        attempt.last_step = max(attempt.last_step, p.step)
        attempt.last_checkpoint = p.path
    elif isinstance(p, ArtifactCommitted):
        if p.path in record.path_heads or any(
            held[0] == p.path and held[2] != p.blake3_hex
            for other in record.attempts.values()
            for name, held in other.artifacts.items()
            if not (other is attempt and name == p.name)
        ):
            record.path_heads[p.path] = p.blake3_hex  # other bytes were committed there
        attempt.artifacts[p.name] = (p.path, p.size_bytes, p.blake3_hex)
        record.commit_count[p.name] = record.commit_count.get(p.name, 0) + 1
        group = f"{p.name}\x00{attempt.fingerprint_digest}"
        digests = record.commit_digests.setdefault(group, [])
        if p.blake3_hex not in digests:
            digests.append(p.blake3_hex)
        # A commit from an attempt that a newer one superseded is a zombie's.
        if event.attempt_id != record.latest_attempt:
            record.zombie_commits += 1
    elif isinstance(p, AttemptFailed):
        attempt.failed_tag = p.tag
        attempt.failed_message = p.message
        record.failures.append(p.tag)


def fold_beat(record: ShardRecord, attempt_id: str, now_us: int, step: int) -> None:
    """Folds a heartbeat: the attempt was seen at now_us and reached step (both by max)."""
    attempt = record.attempts[attempt_id]
    if now_us > attempt.last_seen_us:
        attempt.last_seen_us = now_us
    if step > attempt.last_step:
        attempt.last_step = step


# --- derived views ----------------------------------------------------------


def _required(record: ShardRecord) -> tuple[str, ...]:
    return record.expected_outputs


def _complete(record: ShardRecord, attempt: Attempt) -> bool:
    required = _required(record)
    if required:
        return all(name in attempt.artifacts for name in required)
    return bool(attempt.artifacts)


def _intact(record: ShardRecord, attempt: Attempt) -> bool:
    """Returns whether every artifact of the attempt is still its path's latest commit."""
    heads = record.path_heads
    return not heads or all(
        heads.get(path, digest) == digest for path, _, digest in attempt.artifacts.values()
    )


def _verdicts(record: ShardRecord, attempt: Attempt) -> list[tuple[str, str] | None]:
    names = _required(record) or tuple(sorted(attempt.artifacts))
    out = []
    for name in names:
        path, _size, digest = attempt.artifacts[name]
        out.append(record.verdicts.get(f"{path}\x00{digest}"))
    return out


def confirmed_attempt(record: ShardRecord) -> Attempt | None:
    """Returns an attempt whose full artifact set was committed, is intact and verified, if any."""
    for attempt in sorted(record.attempts.values(), key=lambda a: -a.started_seq):
        if _complete(record, attempt) and _intact(record, attempt):
            verdicts = _verdicts(record, attempt)
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
    if not latest.failed_tag and not _complete(record, latest):
        return ShardState.RUNNING, ""
    complete = [a for a in record.attempts.values() if _complete(record, a)]
    complete.sort(key=lambda a: -a.started_seq)
    intact = [a for a in complete if _intact(record, a)]
    for attempt in intact:
        verdicts = _verdicts(record, attempt)
        if all(v is None or v[0] == "passed" for v in verdicts):
            return ShardState.COMMITTED, ""
    for attempt in intact:
        failing = [v for v in _verdicts(record, attempt) if v is not None and v[0] == "failed"]
        if failing:
            return ShardState.VERIFY_FAILED, failing[0][1] or "unknown"
    if len(intact) < len(complete):
        # A finished set whose file another commit replaced (two attempts renaming onto
        # one path): what it vouched for is no longer on disk.
        return ShardState.VERIFY_FAILED, "overwritten"
    return ShardState.FAILED, latest.failed_tag


def deadline_us(record: ShardRecord) -> int | None:
    """Returns when a running shard turns stale (server clock), or None."""
    if base_state(record)[0] != ShardState.RUNNING:
        return None
    latest = record.attempts[record.latest_attempt]
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


def duplicate_kinds(record: ShardRecord) -> list[str]:
    """Returns the kinds of duplicate the shard shows, sorted."""
    kinds = set()
    if any(n > 1 for n in record.commit_count.values()):
        kinds.add("wasted")
    # Attempts that recorded no fingerprint are in no group: their environments may differ.
    if any(len(d) > 1 for g, d in record.commit_digests.items() if not g.endswith("\x00")):
        kinds.add("nondeterministic")
    if record.zombie_commits:
        kinds.add("zombie")
    return sorted(kinds)


def fingerprint_of(record: ShardRecord) -> str:
    """Returns the fingerprint digest of the shard's latest attempt ("" if none)."""
    latest = record.attempts.get(record.latest_attempt)
    return latest.fingerprint_digest if latest else ""


def contributions(record: ShardRecord) -> Counter[str]:
    """Returns the counters one shard adds to its run's summary (time-independent)."""
    state, detail = base_state(record)
    out: Counter[str] = Counter({"submitted": 1, f"state:{state}": 1})
    if state == ShardState.FAILED:
        out[f"tag:{detail}"] += 1
        if detail == "incomplete":
            out["silent"] += 1
    if state == ShardState.VERIFY_FAILED:
        out[f"verify_failed:{detail}"] += 1
        out["silent"] += 1
    for tag in record.failures:
        out[f"attempt_tag:{tag}"] += 1
    kinds = duplicate_kinds(record)
    for kind in kinds:
        out[f"dup:{kind}"] += 1
    if kinds:
        out["dup:any"] += 1
    fp = fingerprint_of(record)
    if fp:
        out[f"fp:{fp}"] += 1
    out["attempts"] += len(record.attempts)
    return out


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
    ShardState.PLANNED: "never-started",
    ShardState.RUNNING: "running",
    QueryState.STALE: "stale",
    ShardState.COMMITTED: "unverified",
}
# These two carry the shard's detail (the failure tag, the verification reason) after them.
RESUME_DETAIL_PREFIXES: Final[dict[str, str]] = {
    ShardState.FAILED: "failed:",
    ShardState.VERIFY_FAILED: "verify-failed:",
}


def resume_reason(record: ShardRecord, now_us: int) -> str | None:
    """Returns why the shard must run again, or None when it is confirmed."""
    state, detail = live_state(record, now_us)
    if state == ShardState.VERIFIED:
        return None
    prefix = RESUME_DETAIL_PREFIXES.get(state)
    return prefix + detail if prefix is not None else RESUME_REASONS[state]


def summary(counters: Counter[str], *, stale: int, run_id: str, namespace: str) -> dict[str, Any]:
    """Returns the run summary from the summed counters and the stale count at some instant."""
    submitted = counters.get("submitted", 0)
    states = {s: counters.get(f"state:{s}", 0) for s in BASE_STATES}
    running = states[ShardState.RUNNING] - stale
    verified = states[ShardState.VERIFIED]
    failed = states[ShardState.FAILED] + states[ShardState.VERIFY_FAILED]

    def prefixed(prefix: str) -> dict[str, int]:
        return dict(
            sorted((k[len(prefix) :], v) for k, v in counters.items() if k.startswith(prefix) and v)
        )

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
        "completion_rate": verified / submitted if submitted else 0.0,
        "silent_errors": counters.get("silent", 0),
        "silent_error_rate": counters.get("silent", 0) / submitted if submitted else 0.0,
        "failure_tags": prefixed("tag:"),
        "attempt_failure_tags": prefixed("attempt_tag:"),
        "verify_failures": prefixed("verify_failed:"),
        "duplicates": {k: counters.get(f"dup:{k}", 0) for k in DUPLICATE_KINDS},
        "duplicate_shards": counters.get("dup:any", 0),
        "fingerprint_groups": prefixed("fp:"),
        "attempts": counters.get("attempts", 0),
        "unconfirmed": submitted - verified,
    }


def matches(record: ShardRecord, query: str, now_us: int) -> bool:
    """Returns whether the shard belongs to a ``shards --state`` query."""
    state, _ = live_state(record, now_us)
    if query == QueryState.MISSING:
        return state == ShardState.PLANNED
    if query == QueryState.LIVE:
        return state == ShardState.RUNNING
    if query == QueryState.DUPLICATE:
        return bool(duplicate_kinds(record))
    if query == QueryState.UNCONFIRMED:
        return state != ShardState.VERIFIED
    return state == query


def shard_view(record: ShardRecord, now_us: int) -> dict[str, Any]:
    """Returns the JSON view of one shard that `shards` prints."""
    state, detail = live_state(record, now_us)
    latest = record.attempts.get(record.latest_attempt)
    return {
        "shard_id": record.shard_id,
        "plan_index": record.plan_index,
        "state": state,
        "detail": detail,
        "attempts": len(record.attempts),
        "latest_attempt": record.latest_attempt,
        "host": latest.host if latest else "",
        "pid": latest.pid if latest else None,
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
        "failures": list(record.failures),
    }


# --- replay -----------------------------------------------------------------


@dataclass(slots=True)
class RunReplay:
    """Projections of one run rebuilt from its events alone."""

    records: dict[str, ShardRecord] = field(default_factory=dict)

    def feed(self, rec: RecordedEvent) -> None:
        """Folds one stored event (already accepted by the server)."""
        shard_id = rec.event.shard_id
        if isinstance(rec.event.payload, ShardPlanned):
            # A stored plan is the shard's first, or one identical to it.
            if shard_id not in self.records:
                self.records[shard_id] = fold(None, rec)
            return
        fold(self.records[shard_id], rec)

    def feed_row(self, sequence: int, row: bytes, row_hash: bytes) -> None:
        """Folds one stored row; what feed(recorded(...)) does, without building a heartbeat.

        Heartbeats are most of a night's events and only move two numbers, so
        their rows are folded from the parsed JSON; every other kind is decoded
        into its event and folded by feed().
        """
        outer = parse_row(row)
        data = outer["event"]
        if data["kind"] == Heartbeat.KIND:
            fold_beat(
                self.records[data["shard_id"]],
                data["attempt_id"],
                outer["receive_time_us"],
                data["payload"]["step"],
            )
            return
        event, run_sequence, receive_us = event_from_parsed(outer)
        self.feed(RecordedEvent(event, sequence, run_sequence, receive_us, row_hash))

    def counters(self) -> Counter[str]:
        """Returns the summed summary counters."""
        total: Counter[str] = Counter()
        for record in self.records.values():
            total.update(contributions(record))
        return total

    def stale_count(self, now_us: int) -> int:
        """Returns how many shards are stale at now_us."""
        return sum(1 for r in self.records.values() if live_state(r, now_us)[0] == QueryState.STALE)

    def ordered(self) -> Iterator[ShardRecord]:
        """Yields the records in plan order."""
        yield from sorted(self.records.values(), key=lambda r: (r.plan_index, r.shard_id))


def replay(events: Iterable[RecordedEvent]) -> RunReplay:
    """Rebuilds a run's projections from its events."""
    out = RunReplay()
    for rec in events:
        out.feed(rec)
    return out
