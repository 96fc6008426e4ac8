# Over 400 lines on purpose: one class, BatchFolder, whose steps share one transaction's state and the writer's record cache.
"""The batch fold: idempotency, life-cycle checks and counters of one batch, in one transaction.

The single writer of an exclusive store keeps the shard records it folded
between transactions (the record cache), so a busy shard's heartbeat costs no
parse of its stored record.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Final, NamedTuple

from ledger_server import field as figures
from ledger_server import projections as proj
from ledger_server import ranks
from ledger_server.chain import GENESIS_HASH, chain_hash, encode_row, recorded
from ledger_server.errors import (
    EventIdReused,
    EventRejected,
    LedgerError,
    RunArchived,
    RunNotFound,
)
from ledger_server.events import (
    ArtifactCommitted,
    ArtifactVerified,
    AttemptFailed,
    AttemptStarted,
    CheckpointSaved,
    Event,
    Heartbeat,
    RecordedEvent,
    RunReopened,
    ShardPlanned,
    SubmissionClosed,
)
from ledger_server.open_attempts import OpenBefore, open_row
from ledger_server.record import ShardRecord, record_from_row
from ledger_server.replay import closes_first_pass
from ledger_server.store.base import RunRow, ShardRow, StoredEvent, WriteTx
from ledger_server.summary import (
    CLOSING_KEYS,
    PASS_CLOSED_KEY,
    SUBMISSION_CLOSED_KEY,
    check_new_shard,
    check_reopen,
    closing_delta,
    contributions,
    reopening_delta,
)
from ledger_server.validation import ValidEvent

# Event kinds that never change a shard's contribution to the run counters.
# (A heartbeat that names non-finite metrics does change it: it flags the shard.)
_COUNTER_NEUTRAL: Final = (Heartbeat, CheckpointSaved)
# Event kinds whose fold depends on whether the run's first pass is still open, or close it.
_PASS_KINDS: Final = (AttemptStarted, ArtifactCommitted, AttemptFailed, ArtifactVerified)

# Shard records the single writer keeps between transactions (exclusive stores only), so
# a busy shard's heartbeat costs no parse of its stored record; about 2 KB each.
RECORD_CACHE_SIZE: Final = 50_000

APPENDED: Final = "appended"
DUPLICATE: Final = "duplicate"
ALREADY_PLANNED: Final = "already_planned"


def _plain_latest_beat(record: ShardRecord, event: Event) -> bool:
    """Returns whether the event is a heartbeat that only moves the beat columns.

    A heartbeat of the latest attempt moves its last_seen_us and last_step alone, so
    the writer touches two columns. A rank of a multi-rank attempt keeps its own
    liveness inside the record, so its heartbeats rewrite the record.
    """
    if not isinstance(event.payload, Heartbeat) or event.attempt_id != record.latest_attempt:
        return False
    latest = record.attempts.get(event.attempt_id)
    return latest is None or not ranks.is_ranked(latest)


class AppendResult(NamedTuple):
    """The acknowledgement of one event (a tuple: one per appended event)."""

    event_id: str
    sequence: int
    outcome: str
    # A started event whose input differs from the plan: what differs (inputs.py).
    input_changed: str = ""


@dataclass(slots=True)
class _Head:
    """A run's chain head as a batch moves it."""

    run_pk: int
    count: int
    hash: bytes
    # Whether the batch stored an event of the run: a batch of identical re-plans
    # (ALREADY_PLANNED) and retries moves neither the head nor the run's updated time,
    # which is the receive time of its latest event (the lifecycle's settled_at).
    moved: bool = False


@dataclass(slots=True)
class _BatchState:
    """What folding one batch reads and builds up."""

    stored: dict[str, StoredEvent]
    runs: dict[tuple[str, str], RunRow]
    records: dict[tuple[int, str], ShardRecord]
    # event_id -> (canonical content, result) of the events earlier in this batch.
    in_batch: dict[str, tuple[Event, str, AppendResult]] = field(default_factory=dict)
    # Shards whose row changes, and those of them that need more than a heartbeat touch.
    dirty: set[tuple[int, str]] = field(default_factory=set)
    full: set[tuple[int, str]] = field(default_factory=set)
    # A shard's counter contributions before this batch changed it (only when they may).
    before: dict[tuple[int, str], Counter[str]] = field(default_factory=dict)
    # The chain heads of the runs this batch appended to.
    heads: dict[tuple[str, str], _Head] = field(default_factory=dict)
    # run_pk -> the global sequence that closed the run's first pass (0: still open).
    pass_closed: dict[int, int] = field(default_factory=dict)
    # run_pk -> the run's close counters as this batch moved them (read once per run).
    closing: dict[int, Counter[str]] = field(default_factory=dict)
    # run_pk -> the run's shards before this batch (read once, only while a close stands)
    # and the shards this batch planned: its shard counters move only once it is folded.
    stored_shards: dict[int, int] = field(default_factory=dict)
    new_shards: Counter[int] = field(default_factory=Counter)
    # A shard's open attempt row before this batch changed it (open_attempts: the run's
    # open.* counters move by the difference, heartbeats included).
    open_before: dict[tuple[int, str], OpenBefore] = field(default_factory=dict)


def same_meaning(first: Event, first_content: str, event: Event, content: str) -> bool:
    """Returns whether a resent event says what the first one said.

    An event's identity is its content without client_time: the client clock is
    informative only, so a retry that rebuilt the event with a new timestamp is
    the same event (DUPLICATE, the original sequence), not a reused id.
    """
    if content == first_content:
        return True
    if event.client_time_us == first.client_time_us:
        return False
    return replace(event, client_time_us=first.client_time_us).content_json() == first_content


class BatchFolder:
    """Folds validated batches into a write transaction; keeps the single writer's records."""

    def __init__(self, *, cache_records: bool) -> None:
        self._records: dict[tuple[int, str], ShardRecord] | None = {} if cache_records else None
        # run_pk -> the sequence that closed its first pass, for runs whose closing is
        # committed (and so final); _group_closed holds the open group's until it commits.
        self._closed_passes: dict[int, int] = {}
        self._group_closed: dict[int, int] = {}

    def begin_group(self) -> None:
        """Starts a group transaction: what it closes is kept only once it commits."""
        self._group_closed = {}

    def group_committed(self) -> None:
        """Keeps the first passes the committed group closed (a closed pass stays closed)."""
        self._closed_passes.update(self._group_closed)
        self._group_closed = {}

    @property
    def caches_records(self) -> bool:
        """Returns whether shard records are kept between transactions (exclusive stores)."""
        return self._records is not None

    def forget(self) -> None:
        """Drops every cached record: they may hold what was folded but never committed."""
        if self._records is not None:
            self._records.clear()

    def apply(
        self, tx: WriteTx, events: list[ValidEvent], receive_us: int, careful: bool
    ) -> list[AppendResult]:
        """Folds one batch into tx (rolled back by the caller on error); returns its results."""
        # A resent plan would answer ALREADY_PLANNED instead of DUPLICATE without a lookup.
        if careful or any(isinstance(v.event.payload, ShardPlanned) for v in events):
            stored = tx.find_events([v.event.event_id for v in events])
        else:
            stored = {}
        runs: dict[tuple[str, str], RunRow] = {}
        wanted: dict[tuple[str, str], dict[str, None]] = {}
        for e, _ in events:
            wanted.setdefault((e.namespace, e.run_id), {})[e.shard_id] = None
        for key in wanted:
            run = tx.get_run(*key)
            if run is not None and run.archived:
                raise RunArchived(
                    f"run {key[1]} in namespace {key[0]} is archived: it takes no events"
                    " unless `shardledger restore` brings it back",
                    namespace=key[0],
                    run_id=key[1],
                )
            if run is not None:
                runs[key] = run
        records = self._load_records(tx, runs, wanted)
        try:
            results = self._fold_batch(tx, events, stored, runs, records, receive_us)
        except BaseException:
            # The batch is rolled back, but the cached records it folded into are not.
            if self._records is not None:
                for shard_key in records:
                    self._records.pop(shard_key, None)
            raise
        if self._records is not None:
            self._remember(records)
        return results

    def _load_records(
        self,
        tx: WriteTx,
        runs: dict[tuple[str, str], RunRow],
        wanted: dict[tuple[str, str], dict[str, None]],
    ) -> dict[tuple[int, str], ShardRecord]:
        records: dict[tuple[int, str], ShardRecord] = {}
        cache = self._records
        for key, run in runs.items():
            missing = []
            for shard_id in wanted[key]:
                record = cache.get((run.run_pk, shard_id)) if cache is not None else None
                if record is None:
                    missing.append(shard_id)
                else:
                    records[(run.run_pk, shard_id)] = record
            if missing:
                for shard_id, row in tx.load_shards(run.run_pk, missing).items():
                    records[(run.run_pk, shard_id)] = record_from_row(
                        row.record, row.beat_us, row.beat_step
                    )
        return records

    def _remember(self, records: dict[tuple[int, str], ShardRecord]) -> None:
        cache = self._records
        assert cache is not None
        for shard_key, record in records.items():
            cache.pop(shard_key, None)  # re-inserted last: the dict's order is recency
            cache[shard_key] = record
        while len(cache) > RECORD_CACHE_SIZE:
            del cache[next(iter(cache))]

    def _fold_batch(
        self,
        tx: WriteTx,
        events: list[ValidEvent],
        stored: dict[str, StoredEvent],
        runs: dict[tuple[str, str], RunRow],
        records: dict[tuple[int, str], ShardRecord],
        receive_us: int,
    ) -> list[AppendResult]:
        state = _BatchState(stored, runs, records)
        results: list[AppendResult] = []
        for index, (event, content) in enumerate(events):
            try:
                result = self._apply_one(tx, event, content, state, receive_us)
            except LedgerError as exc:
                raise EventRejected(index, exc) from None
            state.in_batch.setdefault(event.event_id, (event, content, result))
            results.append(result)
        for shard_key in state.dirty:
            record = records[shard_key]
            run_pk, shard_id = shard_key
            opened = open_row(record)
            tx.add_counters(run_pk, state.open_before[shard_key].delta(opened))
            if shard_key not in state.full:
                # Only heartbeats of the latest attempt: two numbers and the deadline move.
                latest = record.attempts[record.latest_attempt]
                tx.touch_shard(
                    run_pk=run_pk,
                    shard_id=shard_id,
                    deadline_us=proj.deadline_us(record),
                    beat_us=latest.last_seen_us,
                    beat_step=latest.last_step,
                )
                continue
            tx.save_shard(
                run_pk, ShardRow(shard_id=shard_id, **proj.row_columns(record), open=opened)
            )
            # Heartbeats and checkpoints never change a shard's summary counters, so a
            # shard touched only by them skips the recount (the hot path of a busy fleet).
            if shard_key in state.before:
                delta = contributions(record)
                delta.subtract(state.before[shard_key])
                tx.add_counters(run_pk, delta)
        for head in state.heads.values():
            if not head.moved:
                continue
            tx.update_run(
                head.run_pk, event_count=head.count, head_hash=head.hash, now_us=receive_us
            )
        # The batch stands (a refused one raised before here); its closings are final
        # once the group commits.
        self._group_closed.update((pk, seq) for pk, seq in state.pass_closed.items() if seq)
        return results

    def _apply_one(
        self, tx: WriteTx, event: Event, content: str, state: _BatchState, receive_us: int
    ) -> AppendResult:
        if event.event_id in state.in_batch:
            earlier_event, earlier_content, earlier = state.in_batch[event.event_id]
            if not same_meaning(earlier_event, earlier_content, event, content):
                raise EventIdReused(
                    f"event_id {event.event_id} is used twice in this batch with different content",
                    event_id=event.event_id,
                )
            if earlier.outcome == ALREADY_PLANNED:
                return earlier  # nothing was stored under this id: the plan already was
            return AppendResult(event.event_id, earlier.sequence, DUPLICATE)
        if event.event_id in state.stored:
            original = state.stored[event.event_id]
            first = recorded(original).event
            if first.namespace != event.namespace:
                # Ids are unique across the ledger, but another tenant's row is not ours to
                # describe: no sequence, no content, only that the id is taken.
                raise EventIdReused(
                    f"event_id {event.event_id} is already used: choose another",
                    event_id=event.event_id,
                )
            if not same_meaning(first, first.content_json(), event, content):
                raise EventIdReused(
                    f"event_id {event.event_id} was stored at sequence {original.sequence}"
                    " with different content",
                    event_id=event.event_id,
                    existing_sequence=original.sequence,
                )
            return AppendResult(event.event_id, original.sequence, DUPLICATE)
        records = state.records
        run_key = (event.namespace, event.run_id)
        head = state.heads.get(run_key)
        is_plan = isinstance(event.payload, ShardPlanned)
        if head is None:
            run = state.runs.get(run_key)
            if run is None:
                if not is_plan:
                    raise RunNotFound(
                        f"run {event.run_id} in namespace {event.namespace} does not exist:"
                        " plan its shards first",
                        namespace=event.namespace,
                        run_id=event.run_id,
                    )
                run = tx.create_run(*run_key, now_us=receive_us, genesis=GENESIS_HASH)
            head = state.heads[run_key] = _Head(run.run_pk, run.event_count, run.head_hash)
        if isinstance(event.payload, (SubmissionClosed, RunReopened)):
            return self._close_submission(tx, event, content, head, state, receive_us)
        shard_key = (head.run_pk, event.shard_id)
        record = records.get(shard_key)
        before = state.open_before.get(shard_key)
        if before is None:
            before = state.open_before[shard_key] = OpenBefore(record)
        if proj.fold_live_beat(record, event, receive_us):
            # A live attempt's plain heartbeat: checked and folded in one narrow step, and
            # its row is the two numbers and the deadline (the shard stays out of `full`).
            sequence = self._insert(tx, head, event, content, receive_us)
            state.dirty.add(shard_key)
            return AppendResult(event.event_id, sequence, APPENDED)
        if not proj.check(record, event):
            assert record is not None  # only a plan identical to the stored one
            return AppendResult(event.event_id, record.planned_seq, ALREADY_PLANNED)
        if record is None and is_plan:
            self._check_new_shard(tx, state, head.run_pk, event, receive_us)
        sequence = self._insert(tx, head, event, content, receive_us)
        rec = RecordedEvent(event, sequence, head.count, receive_us, head.hash)
        payload = event.payload
        if record is None:
            state.before[shard_key] = Counter()
            state.full.add(shard_key)
        else:
            flagged = isinstance(payload, Heartbeat) and bool(payload.nonfinite_metrics)
            flagged = flagged or ranks.changes_state(payload)  # a rank finished: may end it
            # A heartbeat or checkpoint drained late from a spool turns its attempt late.
            flagged = flagged or proj.marks_late(record, event, receive_us)
            # A heartbeat or checkpoint of an attempt that ended (or was superseded) moves
            # its span or its checkpoint times in the field figures; only an open attempt's
            # wait for its end (ledger_server.field).
            flagged = flagged or (
                isinstance(payload, _COUNTER_NEUTRAL)
                and event.attempt_id in record.attempts
                and not figures.is_open(record, record.attempts[event.attempt_id])
            )
            if flagged or not isinstance(payload, _COUNTER_NEUTRAL):
                state.before.setdefault(shard_key, contributions(record))
            if flagged or not _plain_latest_beat(record, event):
                state.full.add(shard_key)
        # Only these kinds read or close the first pass; heartbeats, most of a night's
        # events, and checkpoints skip the lookup.
        passes = isinstance(payload, _PASS_KINDS)
        closed = self._pass_closed(tx, state, head.run_pk) if passes else 0
        before.before_change(record)
        folded = records[shard_key] = proj.fold(record, rec, first_pass=not closed)
        if not closed and closes_first_pass(rec):
            state.pass_closed[head.run_pk] = sequence
            tx.add_counters(head.run_pk, {PASS_CLOSED_KEY: sequence})
        state.dirty.add(shard_key)
        if isinstance(payload, AttemptStarted) and payload.input_ref:
            # The job asked whether it reads the planned input: the answer is in its ack.
            changed = folded.attempts[event.attempt_id].input_changed
            return AppendResult(event.event_id, sequence, APPENDED, changed)
        return AppendResult(event.event_id, sequence, APPENDED)

    def _close_submission(
        self,
        tx: WriteTx,
        event: Event,
        content: str,
        head: _Head,
        state: _BatchState,
        receive_us: int,
    ) -> AppendResult:
        """Appends a run-level close or reopen and moves the run's close counters.

        A close moves them by closing_delta; a reopen, refused (RUN_NOT_CLOSED) unless
        a close stands, undoes it by reopening_delta.
        """
        current = self._closing(tx, state, head.run_pk)
        if isinstance(event.payload, RunReopened):
            check_reopen(current, event)
            sequence = self._insert(tx, head, event, content, receive_us)
            delta = reopening_delta(current, sequence, receive_us)
        else:
            assert isinstance(event.payload, SubmissionClosed)
            sequence = self._insert(tx, head, event, content, receive_us)
            # Every close stays in the chain (who said what, when); only an earlier one
            # moves it.
            delta = closing_delta(current, event.payload, sequence, receive_us)
        if delta:
            tx.add_counters(head.run_pk, delta)
            current.update(delta)
        return AppendResult(event.event_id, sequence, APPENDED)

    def _check_new_shard(
        self, tx: WriteTx, state: _BatchState, run_pk: int, event: Event, receive_us: int
    ) -> None:
        """Refuses a shard the run lacks once its close took effect (RUN_CLOSED); counts it."""
        current = self._closing(tx, state, run_pk)
        if current[SUBMISSION_CLOSED_KEY]:
            stored = state.stored_shards.get(run_pk)
            if stored is None:
                stored = state.stored_shards[run_pk] = tx.counter(run_pk, "submitted")
            submitted = stored + state.new_shards[run_pk]
            check_new_shard(current, event, receive_us, submitted=submitted)
        state.new_shards[run_pk] += 1

    @staticmethod
    def _closing(tx: WriteTx, state: _BatchState, run_pk: int) -> Counter[str]:
        """Returns the run's close counters as this batch moved them (read once per batch)."""
        current = state.closing.get(run_pk)
        if current is None:
            current = state.closing[run_pk] = Counter(
                {key: tx.counter(run_pk, key) for key in CLOSING_KEYS}
            )
        return current

    @staticmethod
    def _insert(tx: WriteTx, head: _Head, event: Event, content: str, receive_us: int) -> int:
        """Chains the event's row onto the run's head and buffers it; returns its sequence."""
        run_sequence = head.count + 1
        row = encode_row(content, run_sequence=run_sequence, receive_time_us=receive_us)
        row_hash = chain_hash(head.hash, row)
        sequence = tx.insert_event(
            run_pk=head.run_pk,
            run_sequence=run_sequence,
            event_id=event.event_id,
            row=row,
            row_hash=row_hash,
        )
        head.count, head.hash, head.moved = run_sequence, row_hash, True
        return sequence

    def _pass_closed(self, tx: WriteTx, state: _BatchState, run_pk: int) -> int:
        """Returns the sequence that closed the run's first pass, or 0 while it is open."""
        closed = state.pass_closed.get(run_pk)
        if closed is None:
            # Once closed a pass stays closed, so that answer is kept across groups; an
            # open one is read again in each group's transaction (another replica may
            # have closed it), which costs one indexed read per run and group.
            closed = self._closed_passes.get(run_pk) or tx.counter(run_pk, PASS_CLOSED_KEY)
            state.pass_closed[run_pk] = closed
        return closed
