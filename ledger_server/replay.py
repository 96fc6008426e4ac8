"""A run's projections rebuilt from its events alone: what audit replay, rebuild and the tests use.

The writer keeps the same projections incrementally; both fold through
`projections.fold`, and both close the run's first pass at its first verdict.
"""

from __future__ import annotations

import marshal
import zlib
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Final

from ledger_server.chain import event_from_parsed, parse_row
from ledger_server.events import (
    ArtifactVerified,
    Heartbeat,
    RecordedEvent,
    ShardPlanned,
    SubmissionClosed,
)
from ledger_server.projections import fold, fold_beat, live_state, row_columns
from ledger_server.ranks import is_ranked
from ledger_server.record import ShardRecord
from ledger_server.states import QueryState
from ledger_server.store.base import ShardRow
from ledger_server.summary import PASS_CLOSED_KEY, closing_delta, contributions
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


# A packed row: (plan_index, zlib(marshal((state, detail, deadline_us, plan_line, record))),
# the shard's summary contributions as sorted (key, n) pairs).
PackedRow = tuple[int, bytes, tuple[tuple[str, int], ...]]
# Records a compact replay keeps as objects; the rest wait packed (issue #22: a
# million-shard night's records took ~4 KB each, 3.6 GB, as objects).
HOT_RECORDS: Final = 50_000


def pack_row(record: ShardRecord) -> tuple[bytes, tuple[tuple[str, int], ...]]:
    """Returns a record's projection row, packed, and its summary contributions."""
    columns = row_columns(record)
    packed = zlib.compress(
        marshal.dumps(
            (
                columns["state"],
                columns["detail"],
                columns["deadline_us"],
                columns["plan_line"],
                columns["record"],
            )
        ),
        1,
    )
    return packed, tuple(sorted(contributions(record).items()))


def unpack_row(shard_id: str, plan_index: int, packed: bytes) -> ShardRow:
    """Returns the ShardRow pack_row packed."""
    state, detail, deadline_us, plan_line, record = marshal.loads(zlib.decompress(packed))
    return ShardRow(
        shard_id=shard_id,
        plan_index=plan_index,
        state=state,
        detail=detail,
        deadline_us=deadline_us,
        plan_line=plan_line,
        record=record,
    )


# A plan not folded yet: (plan_index, sequence, the stored row, its hash).
_Plan = tuple[int, int, bytes, bytes]


def _fold_plan(plan: _Plan) -> ShardRecord:
    """Folds a stored plan row into the shard's first record, as feed() would have."""
    _, sequence, row, row_hash = plan
    event, run_sequence, receive_us = event_from_parsed(parse_row(row))
    return fold(None, RecordedEvent(event, sequence, run_sequence, receive_us, row_hash))


class CompactRecords(MutableMapping[str, ShardRecord]):
    """A replay's shard records: the `hot` most recently used as objects, the rest packed.

    Three tiers, so a million-shard night fits in a bounded memory (issue #22: as
    objects its records took ~4 KB each, 3.6 GB):

    - a shard only planned so far keeps its stored plan row (~0.4 KB), folded on its
      first other event: a night plans every shard before most of them start;
    - the `hot` most recently used records are objects;
    - an older one waits as its finished projection row (zlib over marshal, ~0.5 KB)
      with its summary contributions: a shard no later event touches is never parsed
      again, and one that is comes back through `ShardRecord.from_json`, the stored
      form the server's own cache reads.

    A night's events cluster by shard in time (a wave of attempts runs, commits and is
    verified), so a hot set larger than the shards in flight at once keeps that to
    about one packing per shard; ``unpacked`` counts the records parsed back.
    """

    def __init__(self, hot: int = HOT_RECORDS) -> None:
        if hot < 1:
            raise ValueError("hot must be at least 1")
        self._limit = hot
        self._hot: OrderedDict[str, ShardRecord] = OrderedDict()
        self._cold: dict[str, PackedRow] = {}
        self._plans: dict[str, _Plan] = {}
        self._interned: dict[tuple[tuple[str, int], ...], tuple[tuple[str, int], ...]] = {}
        self.unpacked = 0

    def add_plan(self, shard_id: str, plan_index: int, sequence: int, row: bytes, h: bytes) -> None:
        """Keeps a shard's plan row to fold on first use; a later plan of a known shard is ignored."""
        if shard_id not in self:
            self._plans[shard_id] = (plan_index, sequence, row, h)

    def __getitem__(self, shard_id: str) -> ShardRecord:
        hot = self._hot
        record = hot.get(shard_id)
        if record is not None:
            hot.move_to_end(shard_id)
            return record
        plan = self._plans.pop(shard_id, None)
        if plan is not None:
            record = _fold_plan(plan)
        else:
            _, packed, _ = self._cold.pop(shard_id)  # KeyError for a shard never planned
            record = ShardRecord.from_json(unpack_row(shard_id, 0, packed).record or b"")
            self.unpacked += 1
        self._put(shard_id, record)
        return record

    def __setitem__(self, shard_id: str, record: ShardRecord) -> None:
        self._cold.pop(shard_id, None)
        self._plans.pop(shard_id, None)
        self._put(shard_id, record)

    def __delitem__(self, shard_id: str) -> None:
        if self._hot.pop(shard_id, None) is None and self._plans.pop(shard_id, None) is None:
            del self._cold[shard_id]

    def __contains__(self, shard_id: object) -> bool:
        return shard_id in self._hot or shard_id in self._cold or shard_id in self._plans

    def __len__(self) -> int:
        return len(self._hot) + len(self._cold) + len(self._plans)

    def __iter__(self) -> Iterator[str]:
        yield from list(self._hot)
        yield from list(self._cold)
        yield from list(self._plans)

    def values(self) -> Iterator[ShardRecord]:  # type: ignore[override]
        """Yields every record without reordering the hot set (the others built anew)."""
        yield from list(self._hot.values())
        for shard_id, (_, packed, _) in list(self._cold.items()):
            yield ShardRecord.from_json(unpack_row(shard_id, 0, packed).record or b"")
        for plan in list(self._plans.values()):
            yield _fold_plan(plan)

    def _put(self, shard_id: str, record: ShardRecord) -> None:
        hot = self._hot
        hot[shard_id] = record
        hot.move_to_end(shard_id)
        if len(hot) > self._limit:
            old_id, old = hot.popitem(last=False)
            self._cold[old_id] = self._pack(old)

    def _pack(self, record: ShardRecord) -> PackedRow:
        packed, contributed = pack_row(record)
        return (record.plan_index, packed, self._interned.setdefault(contributed, contributed))

    def take_rows(self) -> tuple[list[tuple[str, PackedRow]], Counter[str]]:
        """Empties the records into packed rows in plan order, and sums their contributions."""
        order = sorted(
            [(r.plan_index, shard_id) for shard_id, r in self._hot.items()]
            + [(entry[0], shard_id) for shard_id, entry in self._cold.items()]
            + [(plan[0], shard_id) for shard_id, plan in self._plans.items()]
        )
        total: Counter[str] = Counter()
        rows: list[tuple[str, PackedRow]] = []
        for _, shard_id in order:
            entry = self._cold.pop(shard_id, None)
            if entry is None:
                plan = self._plans.pop(shard_id, None)
                record = self._hot.pop(shard_id) if plan is None else _fold_plan(plan)
                entry = self._pack(record)
            for key, n in entry[2]:
                total[key] += n
            rows.append((shard_id, entry))
        return rows, total


@dataclass(slots=True)
class RunReplay:
    """Projections of one run rebuilt from its events alone."""

    records: MutableMapping[str, ShardRecord] = field(default_factory=dict)
    # Global sequence of the verdict that closed the first pass (0 while it is open).
    pass_closed: int = 0
    # The counters the run's submission_closed events set (empty while none came).
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
        if isinstance(rec.event.payload, ShardPlanned):
            # A stored plan is the shard's first, or one identical to it.
            if shard_id not in self.records:
                self.records[shard_id] = fold(None, rec)
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
        if data["kind"] == ShardPlanned.KIND and isinstance(self.records, CompactRecords):
            # Kept as the row until the shard's next event (a night plans every shard first).
            receive_us = outer["receive_time_us"]
            self.last_receive_us = int(receive_us) if type(receive_us) is str else receive_us
            index = payload["plan_index"]
            self.records.add_plan(
                data["shard_id"],
                int(index) if type(index) is str else index,
                sequence,
                row,
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
            total.update(contributions(record))
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
