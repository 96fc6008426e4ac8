"""The application service: validated appends through the group committer, and reads; no protobuf."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from itertools import islice
from typing import Any, Final, NamedTuple

from ledger_server import field as figures
from ledger_server.admission import Admission
from ledger_server.archive_read import (
    archived_resume,
    archived_rows,
    archived_shard_rows,
    tombstone_of,
)
from ledger_server.batch import AppendResult
from ledger_server.chain import recorded
from ledger_server.committer import GroupCommitter
from ledger_server.errors import (
    EventRejected,
    InvalidEvent,
    LedgerError,
    LimitExceeded,
    RunNotFound,
)
from ledger_server.events import Event, RecordedEvent
from ledger_server.open_attempts import field_counters, open_figures
from ledger_server.record import latest_attempt_from_row, record_from_row
from ledger_server.states import (
    QUERY_STATES,
    ShardState,
    canonical_query,
    stored_states,
)
from ledger_server.store.base import ReadView, RunRow, ShardRow, Store, StoredEvent, Tombstone
from ledger_server.summary import iso_time, matches, run_summary, shard_view
from ledger_server.validation import (
    ValidEvent,
    check_id,
    check_label_key,
    check_namespace,
    validate,
)

MAX_EVENTS_PER_BATCH: Final = 10_000
# Archived bundles being paged through at once (ArchiveCursors); the oldest is dropped.
MAX_OPEN_ARCHIVE_READS: Final = 16


def now_us() -> int:
    """Returns the server clock in microseconds since the epoch."""
    return time.time_ns() // 1000


class ResumeItem(NamedTuple):
    """One shard that must run again (a tuple: a resume list has a million of them)."""

    shard_id: str
    plan_index: int
    plan_line: str
    reason: str


class ArchiveCursors:
    """Open reads of archived bundles, so that paging through one reads it once.

    A page of an archived run's events continues the read the previous page left
    (keyed by the run, its bundle and the last sequence sent) instead of reading the
    bundle again from its start. The read checks as it streams: the page that reaches
    the bundle's end checks it whole, so a listing to the end has checked every byte.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple[int, str, int], Iterator[StoredEvent]] = {}

    def page(self, tombstone: Tombstone, after: int, limit: int) -> list[StoredEvent]:
        """Returns up to limit archived rows with sequence > after."""
        with self._lock:
            rows = self._open.pop((tombstone.run_pk, tombstone.digest, after), None)
        if rows is None:
            rows = (r for r in archived_rows(tombstone) if r.sequence > after)
        page = list(islice(rows, limit))
        if len(page) == limit:
            with self._lock:
                self._open[(tombstone.run_pk, tombstone.digest, page[-1].sequence)] = rows
                while len(self._open) > MAX_OPEN_ARCHIVE_READS:
                    del self._open[next(iter(self._open))]
        return page


class LedgerService:
    """Appends events with group commit and answers reads from the projections."""

    def __init__(
        self,
        store: Store,
        *,
        clock: Callable[[], int] = now_us,
        on_group: Callable[[int, int], None] | None = None,
        admission: Admission | None = None,
    ) -> None:
        self.store = store
        self.clock = clock
        self.stats: Counter[str] = Counter()
        # Only the RPC edge is admitted (servicer): in-process writers (import, tools) wait.
        self.admission = admission
        self._archive_cursors = ArchiveCursors()
        self._committer = GroupCommitter(
            store,
            clock=clock,
            on_group=on_group,
            on_commit=admission.observe_commit if admission is not None else None,
            stats=self.stats,
        )

    # --- writes ---------------------------------------------------------------

    def append(
        self, events: Sequence[Event], *, timeout: float | None = None
    ) -> list[AppendResult]:
        """Validates and appends a batch atomically; returns after the commit is durable."""
        return self.submit(events).result(timeout=timeout)

    def admitted(self, events: int) -> contextlib.AbstractContextManager[None]:
        """Holds room in the committer's queue for a batch of ``events``; raises Overloaded if none."""
        if self.admission is None:
            return contextlib.nullcontext()
        return self.admission.admitted(events)

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
        return self._committer.submit(checked)

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

    def archive_location(self, run: RunRow) -> str:
        """Returns where an archived run's bundle lives ("" for a hot run)."""
        if not run.archived:
            return ""
        tombstone = self.store.read().get_tombstone(run.run_pk)
        return tombstone.location if tombstone is not None else ""

    def list_events(
        self, namespace: str, run_id: str, *, after_sequence: int = 0, limit: int = 1000
    ) -> list[RecordedEvent]:
        """Returns a page of the run's events with sequence > after_sequence."""
        run = self.run(namespace, run_id)
        if run.archived:
            tombstone = tombstone_of(self.store.read(), run)
            rows = self._archive_cursors.page(tombstone, after_sequence, limit)
        else:
            rows = self.store.read().list_events(
                run.run_pk, after_sequence=after_sequence, limit=limit
            )
        return [recorded(r) for r in rows]

    def iter_events(
        self, namespace: str, run_id: str, *, until_sequence: int | None = None
    ) -> Iterator[RecordedEvent]:
        """Yields every event of the run in order."""
        run = self.run(namespace, run_id)
        view = self.store.read()
        if run.archived:
            for stored in archived_rows(tombstone_of(view, run)):
                if until_sequence is not None and stored.sequence > until_sequence:
                    return
                yield recorded(stored)
            return
        for stored in view.iter_events(run.run_pk, until_sequence=until_sequence):
            yield recorded(stored)

    def summary(self, namespace: str, run_id: str, *, now: int | None = None) -> dict[str, Any]:
        """Returns the run summary at now (server clock by default)."""
        run = self.run(namespace, run_id)
        return summary_at(self.store.read(), run, self.clock() if now is None else now)

    def report(self, namespace: str, run_id: str, *, now: int | None = None) -> dict[str, Any]:
        """Returns the run's field figures at now: costs, checkpoint advice, first pass.

        From the run's summed counters and its running shards alone (never every
        event): docs/metrics.md defines each figure. An archived run's counters stay
        hot, and its labels are its tombstone's: it is answered without its archive.
        """
        run = self.run(namespace, run_id)
        return report_at(self.store.read(), run, self.clock() if now is None else now)

    def compare(
        self, namespace: str, run_ids: Sequence[str], label: str, *, now: int | None = None
    ) -> list[dict[str, Any]]:
        """Returns the platform table over the runs by one label's values, at now."""
        check_label_key(label)
        at = self.clock() if now is None else now
        runs = [self.run(namespace, run_id) for run_id in run_ids]  # every name checked first
        view = self.store.read()
        return figures.compare(
            ((run.run_id, counters_at(view, run, at), ()) for run in runs), label
        )

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
        out: list[dict[str, Any]] = []
        for cursor, view in self.iter_shards(namespace, run_id, state=state, after=after, now=now):
            out.append(view)
            if len(out) >= limit:
                return out, cursor
        return out, None

    def iter_shards(
        self,
        namespace: str,
        run_id: str,
        *,
        state: str = "",
        after: tuple[int, str] | None = None,
        now: int | None = None,
    ) -> Iterator[tuple[tuple[int, str], dict[str, Any]]]:
        """Yields (cursor, view) of the run's shards (optionally one state) in plan order."""
        # Checked eagerly, so a bad state or run fails before the caller reads anything.
        try:
            state = canonical_query(state)  # old names ("planned") are accepted for one release
        except ValueError:
            raise InvalidEvent("state", "must be one of " + ", ".join(QUERY_STATES)) from None
        run = self.run(namespace, run_id)
        at = self.clock() if now is None else now
        if run.archived:
            rows = self._archived_shards(run, stored_states(state), after)
        else:
            rows = self.store.read().iter_shards(
                run.run_pk, states=stored_states(state), after_index=after
            )
        return self._views(rows, state, at)

    def _archived_shards(
        self, run: RunRow, states: list[str] | None, after: tuple[int, str] | None
    ) -> Iterator[ShardRow]:
        """Yields an archived run's shard rows, replayed from its bundle (checked whole first)."""
        for row in archived_shard_rows(tombstone_of(self.store.read(), run)):
            if states is not None and row.state not in states:
                continue
            if after is not None and (row.plan_index, row.shard_id) <= after:
                continue
            yield row

    @staticmethod
    def _views(
        rows: Iterator[ShardRow], state: str, at: int
    ) -> Iterator[tuple[tuple[int, str], dict[str, Any]]]:
        for row in rows:
            assert row.record is not None
            record = record_from_row(row.record, row.beat_us, row.beat_step)
            if state and not matches(record, state, at):
                continue
            yield (row.plan_index, row.shard_id), shard_view(record, at)

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
        at = self.clock() if now is None else now
        if run.archived:
            return archived_resume(tombstone_of(self.store.read(), run), at)
        return self.store.read().iter_resume(run.run_pk, at)

    @property
    def last_sequence(self) -> int:
        """Returns the highest committed sequence this process has seen."""
        return self._committer.last_sequence

    def wait_for_commit(self, after_sequence: int, timeout: float) -> int:
        """Blocks until a commit beyond after_sequence or the timeout; returns the last sequence."""
        return self._committer.wait_for_commit(after_sequence, timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Stops the writer after the queued batches commit."""
        self._committer.close(timeout)


def summary_at(view: ReadView, run: RunRow, at: int) -> dict[str, Any]:
    """Returns the run summary at ``at`` from its counters and stale shards (an archived run has none)."""
    counters = Counter(view.counters(run.run_pk))
    out = run_summary(
        counters,
        stale=view.count_stale(run.run_pk, at),
        run_id=run.run_id,
        namespace=run.namespace,
        last_event_us=run.updated_us,
        now_us=at,
    )
    out["as_of_us"] = at
    out["event_count"] = run.event_count
    out["head_hash"] = run.head_hash.hex()
    tombstone = view.get_tombstone(run.run_pk) if run.archived else None
    if tombstone is not None:
        # Where the events went and what vouches for them; the figures stay those above.
        out["archive"] = {
            "location": tombstone.location,
            "manifest_blake3": tombstone.digest,
            "size_bytes": tombstone.size_bytes,
            "archived_at": iso_time(tombstone.archived_us),
            "tree_head": json.loads(tombstone.tree_head),
        }
    return out


def run_labels(view: ReadView, run: RunRow) -> dict[str, str]:
    """Returns the run's labels: its first shard's, or (archived) its tombstone's."""
    if run.archived:
        tombstone = view.get_tombstone(run.run_pk)
        return {} if tombstone is None else dict(json.loads(tombstone.labels))
    for row in view.iter_shards(run.run_pk):
        assert row.record is not None
        return record_from_row(row.record, None, None).labels
    return {}


def report_at(view: ReadView, run: RunRow, at: int) -> dict[str, Any]:
    """Returns the run's field figures at ``at`` (LedgerService.report)."""
    counters = counters_at(view, run, at, by_label=False)
    out = figures.run_report(counters, (), labels=run_labels(view, run))
    return {"namespace": run.namespace, "run_id": run.run_id, **out, "as_of_us": at}


def counters_at(view: ReadView, run: RunRow, at: int, *, by_label: bool = True) -> Counter[str]:
    """Returns the run's field counters with its open attempts added as they stand at ``at``.

    The writer's sums of the open attempts and the stale ones a range of the deadline
    index finds (ledger_server.open_attempts): no running shard's record is read, so a
    report or a scrape costs the same at 100 running shards as at 100,000.
    """
    counters = view.counters(run.run_pk)
    out = field_counters(counters)
    out.update(open_figures(counters, view.stale_open(run.run_pk, at), by_label=by_label))
    return out


def open_parts(view: ReadView, run: RunRow, at: int) -> list[figures.OpenPart]:
    """Returns the open parts of the run's running shards, each parsed from its row.

    What counters_at replaced (a parse of every running shard per request); the tests
    and the report benchmark keep it as the reference the sums must equal.
    """
    parts = []
    for row in view.iter_shards(run.run_pk, states=[ShardState.RUNNING.value]):
        assert row.record is not None
        # A running shard's latest attempt is open: it alone is built, not the record.
        attempt, labels, shard_labels = latest_attempt_from_row(row.record, row.beat_us)
        if attempt is not None:
            parts.append(
                figures.open_part_of(
                    attempt, labels, row.deadline_us, at, shard_labels=shard_labels
                )
            )
    return parts
