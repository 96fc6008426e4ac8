"""Incremental projections == a fresh replay == an independent reference model.

The reference model below is written from the definitions (DESIGN.md and the
projection rules), not from projections.py: it keeps every accepted event per
shard and recomputes each view from scratch, so a shortcut in the incremental
fold, or in the fold itself, shows up as a disagreement.
"""

from __future__ import annotations

import contextlib
import copy
import json
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import event as label
from hypothesis import strategies as st

from ledger_server import projections as proj
from ledger_server import rebuild
from ledger_server.compact import CompactRecords
from ledger_server.errors import LedgerError
from ledger_server.events import (
    ArtifactCommitted,
    ArtifactVerified,
    AttemptFailed,
    AttemptStarted,
    CheckpointSaved,
    Event,
    Heartbeat,
    Payload,
    RunReopened,
    ShardPlanned,
    SubmissionClosed,
)
from ledger_server.record import record_from_row
from ledger_server.replay import RunReplay, replay_run
from ledger_server.service import LedgerService
from ledger_server.states import QUERY_STATES
from ledger_server.store.sqlite import SqliteStore
from ledger_server.summary import run_summary, shard_view
from shard_client.canonical import canonical_json, fingerprint_digest

RUN = "r1"
T0 = 1_000_000
DATA = Path(__file__).resolve().parents[1] / "data"
SHARDS = ("s0", "s1", "s2", "s3")
PLAN_INDEX = (2, 0, 2, 1)  # ties on purpose: plan order is (plan_index, shard_id)
DIGESTS = tuple(c * 64 for c in "abc")
# No fingerprint (no group), then two maps with the digests the ledger computes for them.
FINGERPRINTS = ("", fingerprint_digest({"fp": "1"}), fingerprint_digest({"fp": "2"}))
NAMES = ("a", "b", "c")
TAGS = ("oom", "timeout", "incomplete")
REASONS = ("size_mismatch", "digest_mismatch", "missing", "outside_root")


# --- the reference model ----------------------------------------------------


class Refused(Exception):
    """The definitions say the server must refuse the batch."""


@dataclass
class MAttempt:
    host: str
    pid: int
    timeout: int
    fingerprint: str
    seen: int
    failed: str = ""
    commits: list[tuple[str, str, int, str]] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    first_pass: bool = True
    numeric: dict[str, int] = field(default_factory=dict)  # metric -> first step seen NaN/Inf
    # What reached the ledger only after the first pass closed: commits by name, the failure.
    late_names: set[str] = field(default_factory=set)
    failed_late: bool = False

    def warning(self) -> dict[str, Any] | None:
        if not self.numeric:
            return None
        return {"step": max(min(self.numeric.values()), 0), "metrics": sorted(self.numeric)}

    def outputs(self) -> dict[str, tuple[str, int, str]]:
        # The latest commit of a name is the one that counts.
        return {name: (path, size, digest) for name, path, size, digest in self.commits}


@dataclass
class MShard:
    shard_id: str
    index: int
    line: str
    definition: tuple[Any, ...]
    expected: tuple[str, ...]
    attempts: dict[str, MAttempt] = field(default_factory=dict)  # in start order
    # (attempt named or "", name, path, digest, result, reason, commits recorded before it)
    verdicts: list[tuple[str, str, str, str, str, str, int]] = field(default_factory=list)
    commits: list[tuple[str, str, str, str, bool]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def verdict(self, attempt_id: str, name: str) -> tuple[str, str] | None:
        # A verdict is about one commit: the attempt's latest commit of the name. It counts
        # if it names that attempt (or none, as old verifiers did) and came after the commit.
        mine = [i for i, c in enumerate(self.commits) if c[:2] == (attempt_id, name)]
        if not mine:
            return None
        _, _, path, digest, _ = self.commits[mine[-1]]
        found = [
            (result, why)
            for who, n, p, d, result, why, before in self.verdicts
            if who in ("", attempt_id) and (n, p, d) == (name, path, digest) and before > mine[-1]
        ]
        return found[-1] if found else None

    def complete(self, a: MAttempt) -> bool:
        outs = a.outputs()
        return all(n in outs for n in self.expected) if self.expected else bool(outs)

    def intact(self, a: MAttempt) -> bool:
        # Each output is still what its path holds: the latest commit there, by anyone.
        latest = {path: digest for _, _, path, digest, _ in self.commits}
        return all(latest[path] == digest for path, _, digest in a.outputs().values())

    def output_verdicts(self, a: MAttempt) -> list[tuple[str, str] | None]:
        names = self.expected or tuple(sorted(a.outputs()))
        attempt_id = next(k for k, v in self.attempts.items() if v is a)
        return [self.verdict(attempt_id, n) for n in names]

    def sound(self, a: MAttempt) -> bool:
        # A result: every output committed and no verdict on them failed (files replaced or not).
        return self.complete(a) and not any(v and v[0] == "failed" for v in self.output_verdicts(a))

    def seen_first(self, a: MAttempt) -> bool:
        # The first pass judges only the commits that reached the ledger before it closed.
        outs = a.outputs()
        if not self.complete(a):
            return False
        if self.expected:
            return not any(n in a.late_names for n in self.expected)
        return any(n not in a.late_names for n in outs)

    def verified_alone(self, a: MAttempt) -> bool:
        verdicts = self.output_verdicts(a)
        return self.seen_first(a) and all(v and v[0] == "passed" for v in verdicts)

    def silent(self, a: MAttempt) -> bool:
        failing = any(v and v[0] == "failed" for v in self.output_verdicts(a))
        return (a.failed == "incomplete" and not a.failed_late) or (self.seen_first(a) and failing)

    def first_pass(self) -> str:
        attempts = [a for a in self.attempts.values() if a.first_pass]
        if not attempts:
            return "missing"
        if any(self.verified_alone(a) for a in attempts):
            return "verified"
        return "silent" if any(self.silent(a) for a in attempts) else "other"

    def first_verify_failure(self) -> str | None:
        # Why the first pass's silent result failed verification: its first failed verdict.
        if self.first_pass() != "silent":
            return None
        a = next(a for a in self.attempts.values() if a.first_pass and self.silent(a))
        reasons = [v[1] for v in self.output_verdicts(a) if v and v[0] == "failed"]
        return reasons[0] if reasons and self.seen_first(a) else None

    def repaired(self) -> bool:
        results = [i for i, a in enumerate(self.attempts.values()) if self.sound(a)]
        return bool(results) and results[0] > 0

    def state(self) -> tuple[str, str]:
        finished = [a for a in reversed(self.attempts.values()) if self.complete(a)]
        done = [a for a in finished if self.intact(a)]
        if any(all(v and v[0] == "passed" for v in self.output_verdicts(a)) for a in done):
            return "verified", ""
        if not self.attempts:
            return "planned", ""
        latest = list(self.attempts.values())[-1]
        if not latest.failed and not self.complete(latest):
            return "running", ""
        if any(all(v is None or v[0] == "passed" for v in self.output_verdicts(a)) for a in done):
            return "committed", ""
        for a in done:
            failing = [v for v in self.output_verdicts(a) if v and v[0] == "failed"]
            if failing:
                return "verify_failed", failing[0][1]
        if len(done) < len(finished):
            return "verify_failed", "overwritten"
        return "failed", latest.failed

    def live(self, now: int) -> tuple[str, str]:
        state, detail = self.state()
        latest = list(self.attempts.values())[-1] if self.attempts else None
        if state == "running" and latest and latest.seen + latest.timeout < now:
            return "stale", ""
        return state, detail

    def duplicates(self) -> list[str]:
        # Only a second result is duplicated work; a rerun that replaced a failed,
        # corrupted or missing one is a repair.
        kinds = set()
        results = [a for a in self.attempts.values() if self.sound(a)]
        if len(results) > 1:
            kinds.add("wasted")
        digests: dict[tuple[str, str], set[str]] = {}
        for a in results:
            for name, (_path, _size, digest) in a.outputs().items():
                if a.fingerprint and (name in self.expected or not self.expected):
                    digests.setdefault((name, a.fingerprint), set()).add(digest)
        if any(len(d) > 1 for d in digests.values()):
            kinds.add("nondeterministic")
        if any(c[4] for c in self.commits):
            kinds.add("zombie")
        return sorted(kinds)

    def view(self, now: int) -> dict[str, Any]:
        state, detail = self.live(now)
        latest_id = list(self.attempts)[-1] if self.attempts else ""
        latest = self.attempts.get(latest_id)
        return {
            "shard_id": self.shard_id,
            "plan_index": self.index,
            # Outputs name the stored states as the run summary does (docs/concepts.md).
            "state": {"planned": "missing", "committed": "unverified"}.get(state, state),
            "detail": detail,
            "attempts": len(self.attempts),
            "latest_attempt": latest_id,
            "host": latest.host if latest else "",
            "pid": latest.pid if latest else None,
            "scheduler": {},
            "process_start_ticks": 0,
            "deadline_us": latest.seen + latest.timeout
            if latest and self.state()[0] == "running"
            else None,
            "last_seen_us": latest.seen if latest else None,
            "last_step": max(latest.steps, default=-1) if latest else None,
            "fingerprint": latest.fingerprint if latest else "",
            "artifacts": {
                n: {"path": p, "size_bytes": s, "blake3": d}
                for n, (p, s, d) in (latest.outputs() if latest else {}).items()
            },
            "duplicates": self.duplicates(),
            "repaired": self.repaired(),
            "failures": list(self.failures),
            "numeric": latest.warning() if latest else None,
            "first_pass": self.first_pass(),
        }


@dataclass
class Model:
    ids: dict[str, Event] = field(default_factory=dict)
    shards: dict[str, MShard] = field(default_factory=dict)
    count: int = 0
    # The run's first verdict (one about an artifact) closes its first pass.
    pass_closed: int = 0
    # The run's first submission_closed event: its sequence, time and announced count
    # (the first since the latest run_reopened, which sets them back to 0).
    closed: int = 0
    closed_at: int = 0
    expected: int = 0
    # The run's latest run_reopened event: its sequence and time.
    reopened: int = 0
    reopened_at: int = 0
    # When the run's latest stored event arrived.
    last_at: int = 0

    def append(self, events: list[Event], at: int) -> bool:
        """Applies a batch atomically; returns False (changing nothing) when it must be refused."""
        trial = copy.deepcopy(self)
        batch: dict[str, Event] = {}
        try:
            if any(isinstance(e.payload, Heartbeat) and e.payload.progress > 1 for e in events):
                raise Refused("invalid field")
            for event in events:
                trial.one(event, batch, at)
        except Refused:
            return False
        self.ids, self.shards, self.count = trial.ids, trial.shards, trial.count
        self.pass_closed = trial.pass_closed
        self.closed, self.closed_at, self.expected = trial.closed, trial.closed_at, trial.expected
        self.reopened, self.reopened_at = trial.reopened, trial.reopened_at
        self.last_at = trial.last_at
        return True

    def one(self, e: Event, batch: dict[str, Event], at: int) -> None:
        # A retried event id is acknowledged and stored once; with other content it is refused.
        if e.event_id in batch or e.event_id in self.ids:
            if batch.get(e.event_id, self.ids.get(e.event_id)) != e:
                raise Refused("event id reused with other content")
            return
        batch[e.event_id] = e
        p, shard = e.payload, self.shards.get(e.shard_id)
        if e.run_id != RUN or (not self.shards and not isinstance(p, ShardPlanned)):
            raise Refused("unknown run")
        if isinstance(p, SubmissionClosed):
            # Run-level: the first close sets sequence and count; the earliest close time stands.
            effective = max(at, p.submitted_until_us)
            if not self.closed:
                self.closed, self.closed_at, self.expected = (
                    self.count + 1,
                    effective,
                    p.expected_shards,
                )
            self.closed_at = min(self.closed_at, effective)
        elif isinstance(p, RunReopened):
            # Only a close that stands (in effect or still ahead) can be undone.
            if not self.closed:
                raise Refused("reopen of a run that is not closed")
            self.closed = self.closed_at = self.expected = 0
            self.reopened, self.reopened_at = self.count + 1, at
        elif isinstance(p, ShardPlanned):
            definition = (
                p.input_ref,
                p.input_bytes,
                p.input_blake3,
                p.params_json,
                p.expected_outputs,
            )
            if shard is not None:
                if shard.definition != definition:
                    raise Refused("conflicting plan")
                return  # the same plan again: nothing stored
            # A new shard once the close took effect: only those it announced still come.
            if self.closed and at >= self.closed_at and len(self.shards) >= self.expected:
                raise Refused("new shard of a closed run")
            line = p.plan_line or default_plan_line(e.shard_id, p)
            self.shards[e.shard_id] = MShard(
                e.shard_id, p.plan_index, line, definition, p.expected_outputs
            )
        elif shard is None:
            raise Refused("shard never planned")
        elif isinstance(p, AttemptStarted):
            if e.attempt_id in shard.attempts:
                raise Refused("attempt started twice")
            shard.attempts[e.attempt_id] = MAttempt(
                p.host, p.pid, p.heartbeat_timeout_us, p.fingerprint_digest, at
            )
            shard.attempts[e.attempt_id].first_pass = not self.pass_closed
        elif isinstance(p, ArtifactVerified):
            # A verdict naming its attempt is about that attempt's latest commit of the name,
            # exactly. One naming none names an attempt's latest commit of the name, or an
            # earlier commit of the name overwritten at a path an attempt holds now.
            if e.attempt_id:
                named = shard.attempts.get(e.attempt_id)
                held = named.outputs().get(p.name) if named else None
                if held is None or (held[0], held[2]) != (p.path, p.blake3_hex):
                    raise Refused("verdict on a commit the attempt does not hold")
            else:
                held_all = [
                    a.outputs()[p.name] for a in shard.attempts.values() if p.name in a.outputs()
                ]
                latest = any((h[0], h[2]) == (p.path, p.blake3_hex) for h in held_all)
                overwritten = any(h[0] == p.path for h in held_all) and any(
                    (c[1], c[3]) == (p.name, p.blake3_hex) for c in shard.commits
                )
                if not (latest or overwritten):
                    raise Refused("verdict on an artifact never committed")
            if p.reason != "outside_root":  # about the verifier, not the artifact
                shard.verdicts.append(
                    (
                        e.attempt_id,
                        p.name,
                        p.path,
                        p.blake3_hex,
                        p.result,
                        p.reason,
                        len(shard.commits),
                    )
                )
                self.pass_closed = self.pass_closed or self.count + 1
        else:
            attempt = shard.attempts.get(e.attempt_id)
            if attempt is None or attempt.failed:
                raise Refused("attempt not started or already ended")
            attempt.seen = max(attempt.seen, at)
            if isinstance(p, Heartbeat | CheckpointSaved):
                attempt.steps.append(p.step)
            if isinstance(p, Heartbeat):
                for metric in p.nonfinite_metrics:
                    attempt.numeric[metric] = min(attempt.numeric.get(metric, p.step), p.step)
            elif isinstance(p, ArtifactCommitted):
                attempt.commits.append((p.name, p.path, p.size_bytes, p.blake3_hex))
                if attempt.first_pass and self.pass_closed:
                    attempt.late_names.add(p.name)
                zombie = e.attempt_id != list(shard.attempts)[-1]
                shard.commits.append((e.attempt_id, p.name, p.path, p.blake3_hex, zombie))
            elif isinstance(p, AttemptFailed):
                attempt.failed = p.tag
                attempt.failed_late = attempt.first_pass and bool(self.pass_closed)
                shard.failures.append(p.tag)
        self.ids[e.event_id] = e
        self.count += 1
        self.last_at = at

    def ordered(self) -> list[MShard]:
        return sorted(self.shards.values(), key=lambda s: (s.index, s.shard_id))

    def resume(self, now: int) -> list[tuple[str, int, str, str]]:
        out = []
        for s in self.ordered():
            state, detail = s.live(now)
            reason = {
                "planned": "missing",
                "running": "running",
                "stale": "stale",
                "committed": "unverified",
                "failed": f"failed:{detail}",
                "verify_failed": f"verify_failed:{detail}",
            }.get(state)
            if reason:
                out.append((s.shard_id, s.index, s.line, reason))
        return out

    def summary(self, now: int) -> dict[str, Any]:
        live = {s.shard_id: s.live(now) for s in self.shards.values()}
        states = Counter(state for state, _ in live.values())
        n = len(self.shards)
        silent = states["verify_failed"] + sum(
            1 for v in live.values() if v == ("failed", "incomplete")
        )
        latest = [list(s.attempts.values())[-1] for s in self.shards.values() if s.attempts]
        dups = [s.duplicates() for s in self.shards.values()]
        first = Counter(s.first_pass() for s in self.shards.values())
        first_attempt = sum(
            1
            for s in self.shards.values()
            if s.attempts
            and (a := next(iter(s.attempts.values()))).first_pass
            and s.verified_alone(a)
        )
        recomputed = sum(
            1
            for s in self.shards.values()
            if len(s.attempts) > 1 or any(not a.first_pass for a in s.attempts.values())
        )
        return {
            "namespace": "default",
            "run_id": RUN,
            "submitted": n,
            "verified": states["verified"],
            "failed": states["failed"] + states["verify_failed"],
            "missing": states["planned"],
            "unverified": states["committed"],
            "running": states["running"],
            "stale": states["stale"],
            "verify_failed": states["verify_failed"],
            "by_state": {
                "verified": states["verified"],
                "failed": states["failed"],
                "verify_failed": states["verify_failed"],
                "missing": states["planned"],
                "running": states["running"],
                "stale": states["stale"],
                "unverified": states["committed"],
            },
            "completion_rate": states["verified"] / n if n else 0.0,
            "silent_errors": silent,
            "silent_error_rate": silent / n if n else 0.0,
            "failure_tags": _sorted_counts(d for s, d in live.values() if s == "failed"),
            "attempt_failure_tags": _sorted_counts(
                t for s in self.shards.values() for t in s.failures
            ),
            "verify_failures": _sorted_counts(d for s, d in live.values() if s == "verify_failed"),
            "duplicates": {
                k: sum(k in d for d in dups) for k in ("wasted", "nondeterministic", "zombie")
            },
            "duplicate_shards": sum(1 for d in dups if d),
            "repairs": sum(1 for s in self.shards.values() if s.repaired()),
            "fingerprint_groups": _sorted_counts(a.fingerprint for a in latest if a.fingerprint),
            "attempts": sum(len(s.attempts) for s in self.shards.values()),
            "unconfirmed": n - states["verified"],
            "numeric": sum(1 for a in latest if a.warning()),
            "late_attempts": 0,
            "recomputed": recomputed,
            "recomputed_rate": recomputed / n if n else 0.0,
            "first_pass": {
                "closed": bool(self.pass_closed),
                "closed_at_sequence": self.pass_closed or None,
                "verified": first["verified"],
                "completion_rate": first["verified"] / n if n else 0.0,
                "silent_errors": first["silent"],
                "silent_error_rate": first["silent"] / n if n else 0.0,
                "first_attempt_verified": first_attempt,
                "reconciliation_rate": first_attempt / n if n else 0.0,
                "missing": first["missing"],
                "numeric": sum(
                    1
                    for s in self.shards.values()
                    if any(a.first_pass and a.numeric for a in s.attempts.values())
                ),
                "verify_failures": _sorted_counts(
                    r for s in self.shards.values() if (r := s.first_verify_failure())
                ),
            },
            "lifecycle": self.lifecycle(states, now),
        }

    def lifecycle(self, states: Counter[str], now: int) -> dict[str, Any]:
        waiting = {
            "running": states["running"],
            "stale": states["stale"],
            "unverified": states["committed"],
            "unplanned": max(0, self.expected - len(self.shards)),
        }
        closed = bool(self.closed) and now >= self.closed_at
        settled = closed and not any(waiting.values())
        at = max(self.closed_at, self.last_at) if settled else None

        def iso(us: int) -> str:
            return datetime.fromtimestamp(us / 1e6, UTC).isoformat(timespec="microseconds")

        return {
            "state": "settled" if settled else "submission_closed" if closed else "open",
            "submission_closed": closed,
            "submission_closed_at": iso(self.closed_at) if closed else None,
            "submission_closed_at_us": self.closed_at if closed else None,
            "submission_closed_at_sequence": self.closed if closed else None,
            "submission_closes_at": iso(self.closed_at) if self.closed and not closed else None,
            "expected_shards": self.expected or None,
            "settled": settled,
            "settled_at": iso(at) if at is not None else None,
            "settled_at_us": at,
            "waiting_on": waiting,
            "reopened_at_sequence": self.reopened or None,
            "reopened_at": iso(self.reopened_at) if self.reopened else None,
            "reopened_at_us": self.reopened_at if self.reopened else None,
        }

    def query(self, state: str, now: int) -> list[str]:
        def keep(s: MShard) -> bool:
            live = s.live(now)[0]
            return {
                "missing": live == "planned",
                "unverified": live == "committed",
                "live": live == "running",
                "duplicate": bool(s.duplicates()),
                "unconfirmed": live != "verified",
            }.get(state, live == state)

        return [s.shard_id for s in self.ordered() if keep(s)]


def default_plan_line(shard_id: str, p: ShardPlanned) -> str:
    """The plan line a plan without one gets back in resume lists."""
    return canonical_json(
        {
            "shard_id": shard_id,
            "input_ref": p.input_ref,
            "input_bytes": p.input_bytes,
            "input_blake3": p.input_blake3,
            "params": json.loads(p.params_json),
            "expected_outputs": list(p.expected_outputs),
        }
    )


def _sorted_counts(items: Iterator[str] | Any) -> dict[str, int]:
    return dict(sorted(Counter(items).items()))


# --- driving a real LedgerService ---------------------------------------------


class FakeClock:
    """A server clock the test moves by hand, so stale is deterministic."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


@dataclass
class Harness:
    ledger: LedgerService
    clock: FakeClock
    model: Model = field(default_factory=Model)

    def append(self, events: list[Event], at: int) -> bool:
        """Appends to the ledger and the model; asserts they agree on acceptance."""
        self.clock.now = at
        try:
            self.ledger.append(events, timeout=10)
            accepted = True
        except LedgerError:
            accepted = False
        assert accepted == self.model.append(events, at), f"acceptance differs for {events}"
        return accepted

    def check(self, now: int) -> None:
        """Asserts incremental == fresh replay == model for every read at now."""
        events = list(self.ledger.iter_events("", RUN))
        assert len(events) == self.model.count
        fresh = replay_run(events)
        run = self.ledger.run("", RUN)
        # The rebuild's path (rows folded straight from the stored bytes) lands on the same records.
        from_rows = RunReplay()
        with rebuild.gc_paused():
            stored_rows = self.ledger.store.read().iter_events(run.run_pk)
            assert sum(1 for _ in rebuild.fold_rows(from_rows, stored_rows)) == len(events)
        assert {k: r.to_json() for k, r in from_rows.records.items()} == {
            k: r.to_json() for k, r in fresh.records.items()
        }
        # A compact replay holding one record as an object (the rest packed, parsed back
        # on the shard's next event) builds the same rows and counters as the dict one.
        compact = RunReplay(records=CompactRecords(hot=1))
        with rebuild.gc_paused():
            for _ in rebuild.fold_rows(compact, self.ledger.store.read().iter_events(run.run_pk)):
                pass
        compact_rows, compact_counters = rebuild.take_projections(compact)
        dict_rows, dict_counters = rebuild.take_projections(replay_run(events))
        assert list(compact_rows) == list(dict_rows)
        assert compact_counters == dict_counters
        for row in self.ledger.store.read().iter_shards(run.run_pk):
            assert row.record is not None
            stored = record_from_row(row.record, row.beat_us, row.beat_step)
            assert stored.to_json() == fresh.records[row.shard_id].to_json()
        incremental = self.ledger.summary("", RUN, now=now)
        for key in ("as_of_us", "event_count", "head_hash"):
            incremental.pop(key)
        replayed = run_summary(
            fresh.counters(),
            stale=fresh.stale_count(now),
            run_id=RUN,
            namespace="default",
            last_event_us=fresh.last_receive_us,
            now_us=now,
        )
        assert incremental == replayed == self.model.summary(now)
        views, _ = self.ledger.shards("", RUN, now=now)
        assert views == [shard_view(r, now) for r in fresh.ordered()]
        # Keys the model knows must match; the view may grow new keys.
        model_views = [s.view(now) for s in self.model.ordered()]
        assert [
            {k: v[k] for k in m} for v, m in zip(views, model_views, strict=True)
        ] == model_views
        for state in QUERY_STATES:
            ids = [v["shard_id"] for v in self.ledger.shards("", RUN, state=state, now=now)[0]]
            assert ids == self.model.query(state, now), state
        resume = [
            (i.shard_id, i.plan_index, i.plan_line, i.reason)
            for i in self.ledger.resume("", RUN, now=now)
        ]
        replayed_resume = [
            (r.shard_id, r.plan_index, r.plan_line, why)
            for r in fresh.ordered()
            if (why := proj.resume_reason(r, now)) is not None
        ]
        assert resume == replayed_resume == self.model.resume(now)


@contextlib.contextmanager
def harness() -> Iterator[Harness]:
    """Yields a harness on a real ledger service over a fresh SQLite file with a fake clock."""
    with tempfile.TemporaryDirectory(prefix="replay-") as tmp:
        store = SqliteStore(Path(tmp) / "ledger.db")
        # Durability is not under test here; skipping fsync keeps examples fast.
        store.execute_raw("PRAGMA synchronous=OFF")
        clock = FakeClock()
        ledger = LedgerService(store, clock=clock)
        try:
            yield Harness(ledger, clock)
        finally:
            ledger.close()
            store.close()


# --- random histories ---------------------------------------------------------

# Repeats weight the draw towards the events that move shards along.
KINDS: tuple[str, ...] = ("plan", "hb", "ckpt", "fail", "retry", "reuse", "stray", "invalid")
KINDS += ("start",) * 3 + ("commit",) * 4 + ("verify",) * 4 + ("close", "reopen")
OUTPUT_SETS = ((), ("a",), ("a", "b"))
OP = st.tuples(
    st.sampled_from(KINDS),
    st.integers(0, 3),
    st.integers(0, 2),
    st.integers(0, 2),
    st.integers(0, 20),
)
# (op, time advance, joins the previous batch when 0)
STEPS = st.lists(st.tuples(OP, st.integers(0, 30), st.integers(0, 3)), min_size=20, max_size=70)


@dataclass
class Builder:
    """Turns abstract ops into concrete events, most of them plausible given the model so far."""

    outputs: list[tuple[str, ...]]
    model: Model
    sent: list[Event] = field(default_factory=list)
    counter: int = 0

    def event(self, shard: str, attempt: str, payload: Payload, *, run: str = RUN) -> Event:
        self.counter += 1
        return Event(f"e{self.counter}", "", run, shard, attempt, 0, payload)

    def plan(self, i: int, variant: int) -> Event:
        # variant 2 conflicts with the plan; 3 is the same definition with another line and index.
        sid, index = SHARDS[i], PLAN_INDEX[i] + (10 if variant == 3 else 0)
        line = "" if i == 3 else canonical_json({"shard": sid, "n": index})
        bytes_ = 100 + (variant == 2)
        return self.event(
            sid, "", ShardPlanned(f"/in/{sid}", bytes_, "", '{"k":1}', self.outputs[i], line, index)
        )

    def attempt(self, sid: str, kind: str, j: int, d: int) -> str:
        # j == 2 picks an id the life cycle forbids (reused, or perhaps never started).
        shard = self.model.shards.get(sid)
        started = list(shard.attempts) if shard else []
        if kind == "start":
            return started[d % len(started)] if j == 2 and started else f"a{self.counter}"
        if j == 2 or not started:
            return f"a{d % 3}"
        return started[-1] if j == 0 else started[d % len(started)]

    def steer(self, kind: str, i: int, j: int, d: int) -> int:
        # Events mostly go to shards where they can land; j == 2 keeps the blind pick.
        if j == 2 or kind not in ("hb", "ckpt", "commit", "fail", "verify"):
            return i
        fit = [k for k, sid in enumerate(SHARDS) if self.fits(kind, self.model.shards.get(sid))]
        return i if not fit or i in fit else fit[d % len(fit)]

    def fits(self, kind: str, shard: MShard | None) -> bool:
        if shard is None:
            return False
        if kind == "verify":
            return bool(shard.commits)
        return any(not a.failed for a in shard.attempts.values())

    def output_name(self, sid: str, attempt: str, c: int) -> str:
        # c == 0: the next expected output this attempt still lacks, so shards complete.
        shard = self.model.shards.get(sid)
        if c == 0 and shard is not None and attempt in shard.attempts:
            done = shard.attempts[attempt].outputs()
            return next((n for n in shard.expected if n not in done), "a")
        return NAMES[c]

    def build(self, op: tuple[str, int, int, int, int]) -> Event | None:
        kind, i, j, c, d = op
        i = self.steer(kind, i, j, d)
        sid, attempt = SHARDS[i], self.attempt(SHARDS[i], kind, j, d)
        if kind in ("retry", "reuse"):
            if not self.sent:
                return None
            orig = self.sent[d % len(self.sent)]
            if kind == "retry":
                return orig
            return Event(orig.event_id, "", RUN, orig.shard_id, "a0", 0, Heartbeat(99, 0.5, {}))
        payload: Payload
        if kind == "plan":
            return self.plan(i, c)
        if kind == "close":
            # Run-level; d % 6 announces up to 5 shards, more than a run here ever plans.
            # j == 2: closed from a time that may still be ahead (submitted_until).
            until = T0 + 40 * d if j == 2 else 0
            return self.event("", "", SubmissionClosed(f"wave {c}", d % 6, until))
        if kind == "reopen":
            # Run-level; refused unless a close stands (as often as not, here).
            return self.event("", "", RunReopened(f"late wave {c}" if j else ""))
        if kind == "start":
            payload = AttemptStarted(
                f"node-{j}", 7, (10, 40)[d % 2], {"fp": str(c)} if c else {}, FINGERPRINTS[c]
            )
        elif kind in ("hb", "invalid", "stray"):
            polluted = ("loss",) if d % 5 == 4 else ()  # a NaN loss, named, not sent
            payload = Heartbeat(d, 2.0 if kind == "invalid" else 0.5, {"loss": 0.1}, polluted)
            if kind == "stray":
                return self.event(sid, attempt, payload, run="ghost")
        elif kind == "ckpt":
            payload = CheckpointSaved(d, f"/ck/{sid}", 1, DIGESTS[0])
        elif kind == "commit":
            name = self.output_name(sid, attempt, c)
            path = f"/o/{sid}/{name}" + (".v2" if d % 4 == 3 else "")
            payload = ArtifactCommitted(name, path, 10 + d % 3, DIGESTS[d % 3 if d > 8 else 0], "")
        elif kind == "fail":
            payload = AttemptFailed(TAGS[c], "boom")
        else:  # verify: mostly an accepted commit, sometimes something never committed
            shard = self.model.shards.get(sid)
            known = [c[:4] for c in shard.commits] if shard else []
            who, name, path, digest = (
                known[-1 - d % len(known)] if known else ("a0", "a", "/o/x", DIGESTS[0])
            )
            if d >= 18:
                digest, path = DIGESTS[(DIGESTS.index(digest) + 1) % 3], path + ".x"
            passed = j != 0
            reason = "" if passed else REASONS[(c + d) % len(REASONS)]
            result = ("failed", "passed")[passed]
            # New verifiers name the commit's attempt; old ones (d odd) named none.
            named = "" if d % 2 else who
            return self.event(sid, named, ArtifactVerified(name, path, digest, result, reason, ""))
        return self.event(sid, attempt, payload)

    def batches(
        self, steps: list[tuple[tuple[str, int, int, int, int], int, int]]
    ) -> Iterator[tuple[list[Event], int]]:
        batch: list[Event] = []
        dt = 0
        for op, advance, join in steps:
            # Yield before building, so the next event sees the model after this batch.
            if batch and not (join == 0 and len(batch) < 3):
                yield batch, dt
                batch = []
            event = self.build(op)
            if event is None:
                continue
            if not batch:
                dt = advance
            batch.append(event)
            self.sent.append(event)
        if batch:
            yield batch, dt


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    outputs=st.lists(st.sampled_from(OUTPUT_SETS), min_size=4, max_size=4),
    first=st.sets(st.integers(0, 3), min_size=2),
    steps=STEPS,
    later=st.sampled_from((1, 15, 1000)),
)
def test_incremental_projections_equal_fresh_replay_and_reference_model(
    outputs: list[tuple[str, ...]], first: set[int], steps: list[Any], later: int
) -> None:
    with harness() as h:
        builder = Builder(outputs, h.model)
        plans = [builder.plan(i, 0) for i in sorted(first)]
        builder.sent.extend(plans)
        assert h.append(plans, T0)
        now = T0
        for batch, dt in builder.batches(steps):
            now += dt
            h.append(batch, now)
        label("run:reopened" if h.model.reopened else "run:never reopened")
        for shard in h.model.shards.values():
            label(f"state:{shard.live(now)[0]}")
            for kind in shard.duplicates():
                label(f"duplicate:{kind}")
        h.check(now)
        h.check(now + later)


# --- golden histories -----------------------------------------------------------


def decode(d: dict[str, Any]) -> Event:
    """Returns the event a golden-file line describes (short keys, defaults filled in)."""
    kind, sid = d["kind"], d.get("shard", "")
    hexed: Callable[[str], str] = lambda c: c * 64 if len(c) == 1 else c  # noqa: E731
    payload: Payload
    if kind == "planned":
        line = canonical_json(d["line"]) if "line" in d else ""
        payload = ShardPlanned(
            f"/in/{sid}",
            d.get("bytes", 100),
            "",
            canonical_json(d.get("params", {})),
            tuple(d.get("outputs", ["a"])),
            line,
            d.get("index", 0),
        )
    elif kind == "started":
        payload = AttemptStarted(
            d.get("host", "node"), 1, d.get("timeout", 100), {}, hexed(d.get("fp", ""))
        )
    elif kind == "heartbeat":
        payload = Heartbeat(d.get("step", 1), 0.5, {}, tuple(d.get("nonfinite", ())))
    elif kind == "artifact_committed":
        payload = ArtifactCommitted(d["name"], d["path"], d.get("size", 10), hexed(d["digest"]), "")
    elif kind == "verified":
        payload = ArtifactVerified(
            d["name"], d["path"], hexed(d["digest"]), d["result"], d.get("reason", ""), ""
        )
    elif kind == "submission_closed":
        payload = SubmissionClosed(d.get("reason", ""), d.get("expected", 0), d.get("until", 0))
    elif kind == "run_reopened":
        payload = RunReopened(d.get("reason", ""))
    else:
        payload = AttemptFailed(d["tag"], d.get("message", ""))
    return Event(d["id"], "", d.get("run", RUN), sid, d.get("attempt", ""), 0, payload)


GOLDEN = sorted(DATA.glob("golden_*.jsonl"))


@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_golden_history_projects_as_recorded(path: Path) -> None:
    with harness() as h:
        for number, text in enumerate(path.read_text().splitlines(), start=1):
            step = json.loads(text)
            if "events" in step:
                accepted = h.append([decode(e) for e in step["events"]], step["at"])
                assert accepted == step.get("accepted", True), f"{path.name}:{number}"
                continue
            now = step["now"]
            h.check(now)
            summary = h.ledger.summary("", RUN, now=now)
            for key, value in step.get("summary", {}).items():
                assert summary[key] == value, f"{path.name}:{number} summary[{key}]"
            resume = [[i.shard_id, i.reason] for i in h.ledger.resume("", RUN, now=now)]
            assert resume == step["resume"], f"{path.name}:{number}"
            views = {v["shard_id"]: v for v in h.ledger.shards("", RUN, now=now)[0]}
            for sid, expected in step.get("shards", {}).items():
                for key, value in expected.items():
                    assert views[sid][key] == value, f"{path.name}:{number} {sid}.{key}"


def test_golden_files_exist() -> None:
    assert len(GOLDEN) >= 3
