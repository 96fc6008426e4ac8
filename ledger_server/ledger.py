"""The application service: validated, group-committed appends and reads; no protobuf."""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Final

import structlog

from ledger_server import projections as proj
from ledger_server.errors import (
    EventIdReused,
    EventRejected,
    InvalidEvent,
    LedgerError,
    LimitExceeded,
    RunNotFound,
)
from ledger_server.events import (
    GENESIS_HASH,
    CheckpointSaved,
    Event,
    Heartbeat,
    RecordedEvent,
    ShardPlanned,
    chain_hash,
    check_id,
    check_namespace,
    event_from_row,
    row_bytes,
    validate,
)
from ledger_server.store.base import ConcurrentWriteError, RunRow, Store, StoredEvent, WriteTx

log = structlog.get_logger("shardledger.ledger")

MAX_EVENTS_PER_BATCH: Final = 10_000
# One group commit gathers at most this many events, so one slow transaction
# cannot starve the callers queued behind it for long.
MAX_GROUP_EVENTS: Final = 20_000
# A group that lost a race to another replica is retried this many times in all.
GROUP_ATTEMPTS: Final = 3

# Event kinds that never change a shard's contribution to the run counters.
_COUNTER_NEUTRAL: Final = (Heartbeat, CheckpointSaved)

APPENDED: Final = "appended"
DUPLICATE: Final = "duplicate"
ALREADY_PLANNED: Final = "already_planned"


def now_us() -> int:
    """Returns the server clock in microseconds since the epoch."""
    return time.time_ns() // 1000


@dataclass(frozen=True, slots=True)
class AppendResult:
    """The acknowledgement of one event."""

    event_id: str
    sequence: int
    outcome: str


@dataclass(frozen=True, slots=True)
class ResumeItem:
    """One shard that must run again."""

    shard_id: str
    plan_index: int
    plan_line: str
    reason: str


@dataclass(slots=True)
class _Job:
    events: list[Event]
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
        self._closed = False
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
        checked = []
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
        for attempt in range(1, GROUP_ATTEMPTS):
            try:
                return self._write_group(jobs)
            except ConcurrentWriteError as exc:
                # Another replica won a race (the same event id, the same new run). Nothing of
                # this group was committed, and a fresh transaction sees the winner's rows, so
                # the retry answers DUPLICATE or appends after them instead of failing.
                log.info("group_commit_retried", error=str(exc), attempt=attempt)
        return self._write_group(jobs)

    def _write_group(self, jobs: list[_Job]) -> list[list[AppendResult] | BaseException]:
        outcomes: list[list[AppendResult] | BaseException] = []
        receive_us = self.clock()
        with self.store.write() as tx:
            # Lock (PostgreSQL: FOR UPDATE) every existing run of the group, in one global
            # order, before any job reads: two replicas whose groups share runs then queue
            # instead of deadlocking, and every later read (stored event ids, shard records)
            # sees those runs as of holding their locks. In SQLite these are plain reads.
            for key in sorted({(e.namespace, e.run_id) for job in jobs for e in job.events}):
                tx.get_run(*key)
            for job in jobs:
                try:
                    with tx.savepoint():
                        outcomes.append(self._apply(tx, job.events, receive_us))
                except LedgerError as exc:
                    outcomes.append(exc)
        return outcomes

    def _apply(self, tx: WriteTx, events: list[Event], receive_us: int) -> list[AppendResult]:
        stored = tx.find_events([e.event_id for e in events])
        runs: dict[tuple[str, str], RunRow] = {}
        for key in dict.fromkeys((e.namespace, e.run_id) for e in events):
            run = tx.get_run(*key)
            if run is not None:
                runs[key] = run
        records: dict[tuple[int, str], proj.ShardRecord] = {}
        before: dict[tuple[int, str], Counter[str]] = {}
        for key, run in runs.items():
            wanted = [e.shard_id for e in events if (e.namespace, e.run_id) == key]
            for shard_id, blob in tx.load_shards(run.run_pk, wanted).items():
                records[(run.run_pk, shard_id)] = proj.ShardRecord.from_json(blob)
        in_batch: dict[str, tuple[str, AppendResult]] = {}
        results: list[AppendResult] = []
        dirty: set[tuple[int, str]] = set()
        for index, event in enumerate(events):
            try:
                result = self._apply_one(
                    tx, event, stored, in_batch, runs, records, dirty, before, receive_us
                )
            except LedgerError as exc:
                raise EventRejected(index, exc) from None
            in_batch.setdefault(event.event_id, (event.content_json(), result))
            results.append(result)
        for shard_key in dirty:
            record = records[shard_key]
            tx.save_shard(run_pk=shard_key[0], shard_id=shard_key[1], **proj.row_columns(record))
            # Heartbeats and checkpoints never change a shard's summary counters, so a
            # shard touched only by them skips the recount (the hot path of a busy fleet).
            if shard_key in before:
                delta = proj.contributions(record)
                delta.subtract(before[shard_key])
                tx.add_counters(shard_key[0], delta)
        for run in runs.values():
            tx.update_run(
                run.run_pk, event_count=run.event_count, head_hash=run.head_hash, now_us=receive_us
            )
        return results

    def _apply_one(
        self,
        tx: WriteTx,
        event: Event,
        stored: dict[str, StoredEvent],
        in_batch: dict[str, tuple[str, AppendResult]],
        runs: dict[tuple[str, str], RunRow],
        records: dict[tuple[int, str], proj.ShardRecord],
        dirty: set[tuple[int, str]],
        before: dict[tuple[int, str], Counter[str]],
        receive_us: int,
    ) -> AppendResult:
        content = event.content_json()
        if event.event_id in in_batch:
            earlier_content, earlier = in_batch[event.event_id]
            if earlier_content != content:
                raise EventIdReused(
                    f"event_id {event.event_id} is used twice in this batch with different content",
                    event_id=event.event_id,
                )
            return AppendResult(event.event_id, earlier.sequence, DUPLICATE)
        if event.event_id in stored:
            original = stored[event.event_id]
            if recorded(original).event.content_json() != content:
                raise EventIdReused(
                    f"event_id {event.event_id} was stored at sequence {original.sequence}"
                    " with different content",
                    event_id=event.event_id,
                    existing_sequence=original.sequence,
                )
            return AppendResult(event.event_id, original.sequence, DUPLICATE)
        run_key = (event.namespace, event.run_id)
        run = runs.get(run_key)
        is_plan = isinstance(event.payload, ShardPlanned)
        if run is None:
            if not is_plan:
                raise RunNotFound(
                    f"run {event.run_id} in namespace {event.namespace} does not exist:"
                    " plan its shards first",
                    namespace=event.namespace,
                    run_id=event.run_id,
                )
            run = tx.create_run(*run_key, now_us=receive_us, genesis=GENESIS_HASH)
        shard_key = (run.run_pk, event.shard_id)
        record = records.get(shard_key)
        if is_plan:
            if not proj.check_plan(record, event):
                assert record is not None
                return AppendResult(event.event_id, record.planned_seq, ALREADY_PLANNED)
        else:
            proj.check_lifecycle(record, event)
        run_sequence = run.event_count + 1
        row = row_bytes(event, run_sequence=run_sequence, receive_time_us=receive_us)
        row_hash = chain_hash(run.head_hash, row)
        sequence = tx.insert_event(
            run_pk=run.run_pk,
            run_sequence=run_sequence,
            event_id=event.event_id,
            row=row,
            row_hash=row_hash,
        )
        runs[run_key] = RunRow(
            run.run_pk,
            run.namespace,
            run.run_id,
            run_sequence,
            row_hash,
            run.created_us,
            receive_us,
        )
        rec = RecordedEvent(event, sequence, run_sequence, receive_us, row_hash)
        if record is None:
            records[shard_key] = proj.new_record(rec)
            before[shard_key] = Counter()
        else:
            if shard_key not in before and not isinstance(event.payload, _COUNTER_NEUTRAL):
                before[shard_key] = proj.contributions(record)
            proj.apply(record, rec)
        dirty.add(shard_key)
        return AppendResult(event.event_id, sequence, APPENDED)

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
        out = proj.summary(
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
        if state and state not in proj.QUERY_STATES:
            raise InvalidEvent("state", "must be one of " + ", ".join(proj.QUERY_STATES))
        run = self.run(namespace, run_id)
        at = self.clock() if now is None else now
        sql_states = _sql_states(state)
        out: list[dict[str, Any]] = []
        cursor: tuple[int, str] | None = None
        for row in self.store.read().iter_shards(run.run_pk, states=sql_states, after_index=after):
            assert row.record is not None
            record = proj.ShardRecord.from_json(row.record)
            cursor = (row.plan_index, row.shard_id)
            if state and not proj.matches(record, state, at):
                continue
            out.append(proj.shard_view(record, at))
            if len(out) >= limit:
                return out, cursor
        return out, None

    def resume(
        self, namespace: str, run_id: str, *, now: int | None = None
    ) -> Iterator[ResumeItem]:
        """Returns an iterator over exactly the planned shards without a confirmed artifact."""
        run = self.run(namespace, run_id)  # eagerly, so a bad run fails before streaming
        return self._resume(run, self.clock() if now is None else now)

    def _resume(self, run: RunRow, at: int) -> Iterator[ResumeItem]:
        states = [s for s in proj.BASE_STATES if s != "verified"]
        for row in self.store.read().iter_shards(run.run_pk, states=states, with_record=False):
            reason = _reason(row.state, row.detail, row.deadline_us, at)
            yield ResumeItem(row.shard_id, row.plan_index, row.plan_line, reason)

    def close(self, timeout: float = 30.0) -> None:
        """Stops the writer after the queued batches commit."""
        self._closed = True
        self._queue.put(None)
        self._writer.join(timeout)
        with self._commit_cond:
            self._commit_cond.notify_all()


def _reason(state: str, detail: str, deadline: int | None, now: int) -> str:
    if state == "running" and deadline is not None and deadline < now:
        return "stale"
    if state == "failed":
        return f"failed:{detail}"
    if state == "verify_failed":
        return f"verify-failed:{detail}"
    return proj.RESUME_REASONS[state]


def _sql_states(state: str) -> list[str] | None:
    if state in ("stale", "live"):
        return ["running"]
    if state == "missing":
        return ["planned"]
    if state == "unconfirmed":
        return [s for s in proj.BASE_STATES if s != "verified"]
    if state in proj.BASE_STATES:
        return [state]
    return None
