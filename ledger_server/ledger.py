"""The application service: validated, group-committed appends and reads; no protobuf."""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

import structlog

from ledger_server import projections as proj
from ledger_server.chain import GENESIS_HASH, chain_hash, encode_row, event_from_row
from ledger_server.errors import (
    EventIdReused,
    EventRejected,
    InvalidEvent,
    LedgerError,
    LimitExceeded,
    RunNotFound,
)
from ledger_server.events import CheckpointSaved, Event, Heartbeat, RecordedEvent, ShardPlanned
from ledger_server.record import ShardRecord, record_from_row
from ledger_server.states import QUERY_STATES, stored_states
from ledger_server.store.base import ConcurrentWriteError, RunRow, Store, StoredEvent, WriteTx
from ledger_server.summary import (
    PASS_CLOSED_KEY,
    contributions,
    matches,
    run_summary,
    shard_view,
)
from ledger_server.validation import ValidEvent, check_id, check_namespace, validate

log = structlog.get_logger("shardledger.ledger")

MAX_EVENTS_PER_BATCH: Final = 10_000
# One group commit gathers at most this many events, so one slow transaction
# cannot starve the callers queued behind it for long.
MAX_GROUP_EVENTS: Final = 20_000
# A group that lost a race to another replica is retried this many times in all.
GROUP_ATTEMPTS: Final = 3

# Event kinds that never change a shard's contribution to the run counters (a heartbeat
# that names non-finite metrics does: it flags the shard).
_COUNTER_NEUTRAL: Final = (Heartbeat, CheckpointSaved)

# Shard records the single writer keeps between transactions (exclusive stores only), so
# a busy shard's heartbeat costs no parse of its stored record; about 2 KB each.
RECORD_CACHE_SIZE: Final = 50_000

APPENDED: Final = "appended"
DUPLICATE: Final = "duplicate"
ALREADY_PLANNED: Final = "already_planned"


def now_us() -> int:
    """Returns the server clock in microseconds since the epoch."""
    return time.time_ns() // 1000


class AppendResult(NamedTuple):
    """The acknowledgement of one event (a tuple: one per appended event)."""

    event_id: str
    sequence: int
    outcome: str


class ResumeItem(NamedTuple):
    """One shard that must run again (a tuple: a resume list has a million of them)."""

    shard_id: str
    plan_index: int
    plan_line: str
    reason: str


@dataclass(slots=True)
class _Head:
    """A run's chain head as a batch moves it."""

    run_pk: int
    count: int
    hash: bytes


@dataclass(slots=True)
class _BatchState:
    """What folding one batch reads and builds up."""

    stored: dict[str, StoredEvent]
    runs: dict[tuple[str, str], RunRow]
    records: dict[tuple[int, str], ShardRecord]
    # event_id -> (canonical content, result) of the events earlier in this batch.
    in_batch: dict[str, tuple[str, AppendResult]] = field(default_factory=dict)
    # Shards whose row changes, and those of them that need more than a heartbeat touch.
    dirty: set[tuple[int, str]] = field(default_factory=set)
    full: set[tuple[int, str]] = field(default_factory=set)
    # A shard's counter contributions before this batch changed it (only when they may).
    before: dict[tuple[int, str], Counter[str]] = field(default_factory=dict)
    # The chain heads of the runs this batch appended to.
    heads: dict[tuple[str, str], _Head] = field(default_factory=dict)
    # run_pk -> the global sequence that closed the run's first pass (0: still open).
    pass_closed: dict[int, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Job:
    events: list[ValidEvent]
    future: Future[list[AppendResult]]


def recorded(stored: StoredEvent) -> RecordedEvent:
    """Decodes a stored row into a RecordedEvent."""
    event, run_sequence, receive_time_us = event_from_row(stored.row)
    return RecordedEvent(event, stored.sequence, run_sequence, receive_time_us, stored.row_hash)


class Ledger:
    """Appends events with group commit and answers reads from the projections."""

    def __init__(
        self,
        store: Store,
        *,
        clock: Callable[[], int] = now_us,
        on_group: Callable[[int, int], None] | None = None,
    ) -> None:
        self.store = store
        self.clock = clock
        self._on_group = on_group
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._commit_cond = threading.Condition()
        self._last_sequence = store.read().max_sequence()
        self._records: dict[tuple[int, str], ShardRecord] | None = (
            {} if store.exclusive_writer else None
        )
        self._closed = False
        # run_pk -> the sequence that closed its first pass, for runs whose closing is
        # committed (and so final); _group_closed holds the group's until it commits.
        self._closed_passes: dict[int, int] = {}
        self._group_closed: dict[int, int] = {}
        self.stats: Counter[str] = Counter()
        self._writer = threading.Thread(target=self._writer_loop, name="ledger-writer", daemon=True)
        self._writer.start()

    # --- writes ---------------------------------------------------------------

    def append(
        self, events: Sequence[Event], *, timeout: float | None = None
    ) -> list[AppendResult]:
        """Validates and appends a batch atomically; returns after the commit is durable."""
        return self.submit(events).result(timeout=timeout)

    def submit(self, events: Sequence[Event]) -> Future[list[AppendResult]]:
        """Validates a batch and queues it for the next group commit."""
        if not events:
            raise InvalidEvent("events", "must contain at least one event")
        if len(events) > MAX_EVENTS_PER_BATCH:
            raise LimitExceeded("events_per_batch", len(events), MAX_EVENTS_PER_BATCH)
        checked: list[ValidEvent] = []
        for index, event in enumerate(events):
            try:
                checked.append(validate(event))
            except LedgerError as exc:
                raise EventRejected(index, exc) from None
        if self._closed:
            raise LedgerError("the ledger is shutting down", reason="SHUTTING_DOWN")
        future: Future[list[AppendResult]] = Future()
        self._queue.put(_Job(checked, future))
        return future

    def _writer_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            jobs, count = [job], len(job.events)
            while count < MAX_GROUP_EVENTS:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)
                    break
                jobs.append(more)
                count += len(more.events)
            self._commit_group(jobs)

    def _commit_group(self, jobs: list[_Job]) -> None:
        try:
            outcomes = self._write_group_retrying(jobs)
        except Exception as exc:  # the commit itself failed: nobody is acknowledged
            log.error("group_commit_failed", error=str(exc), jobs=len(jobs))
            if self._records is not None:
                self._records.clear()  # it may hold what was folded but never committed
            for job in jobs:
                job.future.set_exception(exc)
            return
        self.stats["groups"] += 1
        self.stats["events"] += sum(len(o) for o in outcomes if isinstance(o, list))
        if self._on_group is not None:
            self._on_group(len(jobs), sum(len(o) for o in outcomes if isinstance(o, list)))
        max_seq = max((r.sequence for o in outcomes if isinstance(o, list) for r in o), default=0)
        with self._commit_cond:
            self._last_sequence = max(self._last_sequence, max_seq)
            self._commit_cond.notify_all()
        for job, outcome in zip(jobs, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                job.future.set_exception(outcome)
            else:
                job.future.set_result(outcome)

    def _write_group_retrying(self, jobs: list[_Job]) -> list[list[AppendResult] | BaseException]:
        # The only writer of a store may skip looking up each event id before inserting it:
        # a resent id (rare: a client retry) then fails the unique index at commit, and the
        # group is redone with the lookups. Shared stores always look up first.
        careful = self._records is None
        for attempt in range(1, GROUP_ATTEMPTS):
            try:
                return self._write_group(jobs, careful=careful)
            except ConcurrentWriteError as exc:
                # Another replica won a race (the same event id, the same new run), or an id
                # was already stored. Nothing of this group was committed, and a fresh
                # transaction sees the stored rows, so the retry answers DUPLICATE or appends
                # after them instead of failing.
                log.info("group_commit_retried", error=str(exc), attempt=attempt)
                self.stats["groups_retried"] += 1
                if self._records is not None:
                    self._records.clear()  # it holds what the rolled-back group folded
                careful = True
        return self._write_group(jobs, careful=True)

    def _write_group(
        self, jobs: list[_Job], *, careful: bool
    ) -> list[list[AppendResult] | BaseException]:
        outcomes: list[list[AppendResult] | BaseException] = []
        receive_us = self.clock()
        self._group_closed = {}
        with self.store.write() as tx:
            # Lock (PostgreSQL: FOR UPDATE) every existing run of the group, in one global
            # order, before any job reads: two replicas whose groups share runs then queue
            # instead of deadlocking, and every later read (stored event ids, shard records)
            # sees those runs as of holding their locks. In SQLite these are plain reads.
            for key in sorted(
                {(v.event.namespace, v.event.run_id) for job in jobs for v in job.events}
            ):
                tx.get_run(*key)
            for job in jobs:
                try:
                    with tx.savepoint():
                        outcomes.append(self._apply(tx, job.events, receive_us, careful))
                    continue
                except LedgerError as exc:
                    if careful:
                        outcomes.append(exc)
                        continue
                # Refused without the id lookups: a resent event may be what broke the rules
                # (an attempt "started twice"), so the batch is judged again with them.
                try:
                    with tx.savepoint():
                        outcomes.append(self._apply(tx, job.events, receive_us, True))
                except LedgerError as exc:
                    outcomes.append(exc)
        self._closed_passes.update(self._group_closed)
        return outcomes

    def _apply(
        self, tx: WriteTx, events: list[ValidEvent], receive_us: int, careful: bool
    ) -> list[AppendResult]:
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
            state.in_batch.setdefault(event.event_id, (content, result))
            results.append(result)
        for shard_key in state.dirty:
            record = records[shard_key]
            run_pk, shard_id = shard_key
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
            tx.save_shard(run_pk=run_pk, shard_id=shard_id, **proj.row_columns(record))
            # Heartbeats and checkpoints never change a shard's summary counters, so a
            # shard touched only by them skips the recount (the hot path of a busy fleet).
            if shard_key in state.before:
                delta = contributions(record)
                delta.subtract(state.before[shard_key])
                tx.add_counters(run_pk, delta)
        for head in state.heads.values():
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
            earlier_content, earlier = state.in_batch[event.event_id]
            if earlier_content != content:
                raise EventIdReused(
                    f"event_id {event.event_id} is used twice in this batch with different content",
                    event_id=event.event_id,
                )
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
            if first.content_json() != content:
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
        shard_key = (head.run_pk, event.shard_id)
        record = records.get(shard_key)
        if not proj.check(record, event):
            assert record is not None  # only a plan identical to the stored one
            return AppendResult(event.event_id, record.planned_seq, ALREADY_PLANNED)
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
        head.count, head.hash = run_sequence, row_hash
        rec = RecordedEvent(event, sequence, run_sequence, receive_us, row_hash)
        if record is None:
            state.before[shard_key] = Counter()
            state.full.add(shard_key)
        else:
            payload = event.payload
            if not isinstance(payload, _COUNTER_NEUTRAL):
                state.before.setdefault(shard_key, contributions(record))
            if not (isinstance(payload, Heartbeat) and event.attempt_id == record.latest_attempt):
                state.full.add(shard_key)
        records[shard_key] = proj.fold(record, rec)
        state.dirty.add(shard_key)
        return AppendResult(event.event_id, sequence, APPENDED)

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

    # --- reads ----------------------------------------------------------------

    def run(self, namespace: str, run_id: str) -> RunRow:
        """Returns the run's head or raises RunNotFound."""
        namespace = check_namespace(namespace)
        check_id("run_id", run_id)
        row = self.store.read().get_run(namespace, run_id)
        if row is None:
            raise RunNotFound(
                f"run {run_id} in namespace {namespace} does not exist",
                namespace=namespace,
                run_id=run_id,
            )
        return row

    def list_runs(self, namespace: str | None, *, limit: int = 100) -> list[RunRow]:
        """Returns runs, most recently updated first."""
        if namespace is not None:
            namespace = check_namespace(namespace)
        return self.store.read().list_runs(namespace, limit)

    def list_events(
        self, namespace: str, run_id: str, *, after_sequence: int = 0, limit: int = 1000
    ) -> list[RecordedEvent]:
        """Returns a page of the run's events with sequence > after_sequence."""
        run = self.run(namespace, run_id)
        rows = self.store.read().list_events(run.run_pk, after_sequence=after_sequence, limit=limit)
        return [recorded(r) for r in rows]

    def iter_events(
        self, namespace: str, run_id: str, *, until_sequence: int | None = None
    ) -> Iterator[RecordedEvent]:
        """Yields every event of the run in order."""
        run = self.run(namespace, run_id)
        for stored in self.store.read().iter_events(run.run_pk, until_sequence=until_sequence):
            yield recorded(stored)

    @property
    def last_sequence(self) -> int:
        """Returns the highest committed sequence this process has seen."""
        return self._last_sequence

    def wait_for_commit(self, after_sequence: int, timeout: float) -> int:
        """Blocks until a commit beyond after_sequence or the timeout; returns the last sequence."""
        with self._commit_cond:
            self._commit_cond.wait_for(
                lambda: self._last_sequence > after_sequence or self._closed, timeout=timeout
            )
            return self._last_sequence

    def summary(self, namespace: str, run_id: str, *, now: int | None = None) -> dict[str, Any]:
        """Returns the run summary at now (server clock by default)."""
        run = self.run(namespace, run_id)
        at = self.clock() if now is None else now
        view = self.store.read()
        counters = Counter(view.counters(run.run_pk))
        out = run_summary(
            counters,
            stale=view.count_stale(run.run_pk, at),
            run_id=run.run_id,
            namespace=run.namespace,
        )
        out["as_of_us"] = at
        out["event_count"] = run.event_count
        out["head_hash"] = run.head_hash.hex()
        return out

    def shards(
        self,
        namespace: str,
        run_id: str,
        *,
        state: str = "",
        after: tuple[int, str] | None = None,
        limit: int = 1000,
        now: int | None = None,
    ) -> tuple[list[dict[str, Any]], tuple[int, str] | None]:
        """Returns a page of shard views (optionally one state) and the cursor for the next."""
        if state and state not in QUERY_STATES:
            raise InvalidEvent("state", "must be one of " + ", ".join(QUERY_STATES))
        run = self.run(namespace, run_id)
        at = self.clock() if now is None else now
        sql_states = stored_states(state)
        out: list[dict[str, Any]] = []
        cursor: tuple[int, str] | None = None
        for row in self.store.read().iter_shards(run.run_pk, states=sql_states, after_index=after):
            assert row.record is not None
            record = record_from_row(row.record, row.beat_us, row.beat_step)
            cursor = (row.plan_index, row.shard_id)
            if state and not matches(record, state, at):
                continue
            out.append(shard_view(record, at))
            if len(out) >= limit:
                return out, cursor
        return out, None

    def resume(
        self, namespace: str, run_id: str, *, now: int | None = None
    ) -> Iterator[ResumeItem]:
        """Returns an iterator over exactly the planned shards without a confirmed artifact."""
        return map(ResumeItem._make, self.resume_rows(namespace, run_id, now=now))

    def resume_rows(
        self, namespace: str, run_id: str, *, now: int | None = None
    ) -> Iterator[tuple[str, int, str, str]]:
        """resume() as plain (shard_id, plan_index, plan_line, reason) tuples, for streaming."""
        run = self.run(namespace, run_id)  # eagerly, so a bad run fails before streaming
        return self.store.read().iter_resume(run.run_pk, self.clock() if now is None else now)

    def close(self, timeout: float = 30.0) -> None:
        """Stops the writer after the queued batches commit."""
        self._closed = True
        self._queue.put(None)
        self._writer.join(timeout)
        with self._commit_cond:
            self._commit_cond.notify_all()
