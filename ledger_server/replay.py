"""A run's projections rebuilt from its events alone: what audit replay, rebuild and the tests use.

The writer keeps the same projections incrementally; both fold through
`projections.fold`, and both close the run's first pass at its first verdict.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, MutableMapping
from dataclasses import dataclass, field

from ledger_server.chain import event_from_parsed, parse_row
from ledger_server.compact import CompactRecords
from ledger_server.events import (
    ArtifactVerified,
    Heartbeat,
    RecordedEvent,
    RunReopened,
    ShardPlanned,
    SubmissionClosed,
)
from ledger_server.open_attempts import stored_contributions
from ledger_server.projections import fold, fold_beat, live_state
from ledger_server.ranks import is_ranked
from ledger_server.record import ShardRecord
from ledger_server.states import QueryState
from ledger_server.summary import (
    PASS_CLOSED_KEY,
    closing_delta,
    reopening_delta,
)
from shard_client.vocabulary import VERIFIER_REASONS


def closes_first_pass(rec: RecordedEvent) -> bool:
    """Returns whether the event, as the run's first of its kind, ends the run's first pass.

    The first pass is the night as it was launched: it ends when the run's first
    verdict about an artifact is recorded. Attempts started after it are reruns.
    """
    p = rec.event.payload
    return isinstance(p, ArtifactVerified) and p.reason not in VERIFIER_REASONS


# A heartbeat naming any of these takes the generic fold (non-finite metrics flag the
# shard; a rank's beat moves its own liveness).
_PLAIN_BEAT_KEYS: frozenset[str] = frozenset({"nonfinite_metrics", "rank", "rank_finished"})


@dataclass(slots=True)
class RunReplay:
    """Projections of one run rebuilt from its events alone."""

    records: MutableMapping[str, ShardRecord] = field(default_factory=dict)
    # Global sequence of the verdict that closed the first pass (0 while it is open).
    pass_closed: int = 0
    # The counters the run's submission_closed and run_reopened events set (empty while
    # none came).
    closing: Counter[str] = field(default_factory=Counter)
    # When the latest event folded was received: the run summary's last_event_us.
    last_receive_us: int = 0

    def feed(self, rec: RecordedEvent) -> None:
        """Folds one stored event (already accepted by the server)."""
        shard_id = rec.event.shard_id
        self.last_receive_us = rec.receive_time_us
        if isinstance(rec.event.payload, SubmissionClosed):
            # A run-level event: no shard record, only the run's close counters.
            self.closing.update(
                closing_delta(self.closing, rec.event.payload, rec.sequence, rec.receive_time_us)
            )
            return
        if isinstance(rec.event.payload, RunReopened):
            # Run-level too: it undoes the close that stood (the server checked there was one).
            self.closing.update(reopening_delta(self.closing, rec.sequence, rec.receive_time_us))
            return
        if isinstance(rec.event.payload, ShardPlanned):
            # A stored plan is the shard's first, a revision of its input, or (older
            # ledgers) one identical to the first: fold() tells them apart.
            # Not records.get(): CompactRecords brings a spilled record back only on [].
            known = self.records[shard_id] if shard_id in self.records else None  # noqa: SIM401
            self.records[shard_id] = fold(known, rec)
            return
        fold(self.records[shard_id], rec, first_pass=not self.pass_closed)
        if not self.pass_closed and closes_first_pass(rec):
            self.pass_closed = rec.sequence

    def feed_row(self, sequence: int, row: bytes, row_hash: bytes) -> None:
        """Folds one stored row; what feed(recorded(...)) does, without building a heartbeat.

        Heartbeats are most of a night's events and only move two numbers, so
        their rows are folded from the parsed JSON; every other kind (and a
        heartbeat that names non-finite metrics) is decoded into its event and
        folded by feed().
        """
        outer = parse_row(row)
        data = outer["event"]
        payload = data["payload"]
        if (
            data["kind"] == ShardPlanned.KIND
            and isinstance(self.records, CompactRecords)
            and not payload.get("input_revision")  # a revision folds into the record now
        ):
            # Kept as the parsed row until the shard's next event (a night plans every shard first).
            receive_us = outer["receive_time_us"]
            self.last_receive_us = int(receive_us) if type(receive_us) is str else receive_us
            index = payload["plan_index"]
            self.records.add_plan(
                data["shard_id"],
                int(index) if type(index) is str else index,
                sequence,
                outer,
                row_hash,
            )
            return
        if data["kind"] == Heartbeat.KIND and _PLAIN_BEAT_KEYS.isdisjoint(payload):
            record = self.records[data["shard_id"]]
            attempt = record.attempts.get(data["attempt_id"])
            # A rank of a multi-rank attempt keeps its own liveness: the generic fold.
            if attempt is not None and not is_ranked(attempt):
                receive_us, step = outer["receive_time_us"], payload["step"]
                # Row format 2 holds integers past 2**53 as decimal strings.
                receive_us = int(receive_us) if type(receive_us) is str else receive_us
                self.last_receive_us = receive_us
                fold_beat(
                    record, data["attempt_id"], receive_us, int(step) if type(step) is str else step
                )
                return
        event, run_sequence, receive_us = event_from_parsed(outer)
        self.feed(RecordedEvent(event, sequence, run_sequence, receive_us, row_hash))

    def counters(self) -> Counter[str]:
        """Returns the summed summary counters."""
        total: Counter[str] = Counter()
        for record in self.records.values():
            total.update(stored_contributions(record))
        return self.run_counters(total)

    def run_counters(self, total: Counter[str]) -> Counter[str]:
        """Adds the run's own counters (first pass, submission close) to the shards' sum."""
        if self.pass_closed:
            total[PASS_CLOSED_KEY] = self.pass_closed
        total.update(self.closing)
        return total

    def stale_count(self, now_us: int) -> int:
        """Returns how many shards are stale at now_us."""
        return sum(1 for r in self.records.values() if live_state(r, now_us)[0] == QueryState.STALE)

    def ordered(self) -> Iterator[ShardRecord]:
        """Yields the records in plan order."""
        yield from sorted(self.records.values(), key=lambda r: (r.plan_index, r.shard_id))


def replay_run(events: Iterable[RecordedEvent]) -> RunReplay:
    """Rebuilds a run's projections from its events."""
    out = RunReplay()
    for rec in events:
        out.feed(rec)
    return out
