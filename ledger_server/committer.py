"""The group committer: one writer thread commits the queued batches together, one transaction."""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Final

import structlog

from ledger_server.batch import AppendResult, BatchFolder
from ledger_server.errors import LedgerError
from ledger_server.store.base import ConcurrentWriteError, Store, StoreUnreachable
from ledger_server.validation import ValidEvent

log = structlog.get_logger("shardledger.ledger")

# One group commit gathers at most this many events, so one slow transaction
# cannot starve the callers queued behind it for long.
MAX_GROUP_EVENTS: Final = 20_000
# A group that lost a race to another replica is retried this many times in all.
GROUP_ATTEMPTS: Final = 3


@dataclass(slots=True)
class _Job:
    events: list[ValidEvent]
    future: Future[list[AppendResult]]


class GroupCommitter:
    """Gathers queued batches into group commits on one writer thread."""

    def __init__(
        self,
        store: Store,
        *,
        clock: Callable[[], int],
        on_group: Callable[[int, int], None] | None = None,
        on_commit: Callable[[int, float], None] | None = None,
        stats: Counter[str],
    ) -> None:
        self.store = store
        self.clock = clock
        self.stats = stats
        self._on_group = on_group
        # (events, seconds) of each committed group: the rate admission measures.
        self._on_commit = on_commit
        self._folder = BatchFolder(cache_records=store.exclusive_writer)
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._commit_cond = threading.Condition()
        self._last_sequence = store.read().max_sequence()
        self.closed = False
        self._writer = threading.Thread(target=self._writer_loop, name="ledger-writer", daemon=True)
        self._writer.start()

    def submit(self, events: list[ValidEvent]) -> Future[list[AppendResult]]:
        """Queues a validated batch for the next group commit."""
        if self.closed:
            raise LedgerError("the ledger is shutting down", reason="SHUTTING_DOWN")
        future: Future[list[AppendResult]] = Future()
        # Running from here: a waiter that gives up (a cancelled asyncio call) cannot
        # cancel it, so the writer always sets its outcome, and never meets a cancelled one.
        future.set_running_or_notify_cancel()
        self._queue.put(_Job(events, future))
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
        began = time.perf_counter()
        try:
            outcomes = self._write_group_retrying(jobs)
        except Exception as exc:  # the commit itself failed: nobody is acknowledged
            if not isinstance(exc, StoreUnreachable):  # refused at once: store_health logs it
                log.error("group_commit_failed", error=str(exc), jobs=len(jobs))
            self._folder.forget()  # it may hold what was folded but never committed
            for job in jobs:
                job.future.set_exception(exc)
            return
        committed = sum(len(o) for o in outcomes if isinstance(o, list))
        self.stats["groups"] += 1
        self.stats["events"] += committed
        if self._on_commit is not None:
            # Every event of the group took the writer's time, refused batches' too.
            self._on_commit(sum(len(job.events) for job in jobs), time.perf_counter() - began)
        if self._on_group is not None:
            self._on_group(len(jobs), committed)
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
        careful = not self._folder.caches_records
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
                self._folder.forget()  # it holds what the rolled-back group folded
                careful = True
        return self._write_group(jobs, careful=True)

    def _write_group(
        self, jobs: list[_Job], *, careful: bool
    ) -> list[list[AppendResult] | BaseException]:
        outcomes: list[list[AppendResult] | BaseException] = []
        receive_us = self.clock()
        self._folder.begin_group()
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
                        outcomes.append(self._folder.apply(tx, job.events, receive_us, careful))
                    continue
                except LedgerError as exc:
                    if careful:
                        outcomes.append(exc)
                        continue
                # Refused without the id lookups: a resent event may be what broke the rules
                # (an attempt "started twice"), so the batch is judged again with them.
                try:
                    with tx.savepoint():
                        outcomes.append(self._folder.apply(tx, job.events, receive_us, True))
                except LedgerError as exc:
                    outcomes.append(exc)
        self._folder.group_committed()
        return outcomes

    @property
    def last_sequence(self) -> int:
        """Returns the highest committed sequence this process has seen."""
        return self._last_sequence

    def wait_for_commit(self, after_sequence: int, timeout: float) -> int:
        """Blocks until a commit beyond after_sequence or the timeout; returns the last sequence."""
        with self._commit_cond:
            self._commit_cond.wait_for(
                lambda: self._last_sequence > after_sequence or self.closed, timeout=timeout
            )
            return self._last_sequence

    def close(self, timeout: float = 30.0) -> None:
        """Stops the writer after the queued batches commit."""
        self.closed = True
        self._queue.put(None)
        self._writer.join(timeout)
        with self._commit_cond:
            self._commit_cond.notify_all()
