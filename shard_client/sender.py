# Over 400 lines on purpose: the queue, the thread, the spill and the fork hooks share one lock and its invariants.
"""The batching sender: one daemon thread per process turns emits into batched appends.

``emit()`` only queues; the thread coalesces the events of every shard of the
process into appends of up to 500 events, waiting at most 50 ms for more. When
the ledger cannot be reached, the policy decides:

- ``"spool"`` (default): events go to a durable local :class:`Spool` and the
  job keeps running; the spool drains in order, before any newer event, once
  the ledger answers (order matters: an artifact before its ``started`` is refused);
- ``"block"``: the sender retries forever and ``emit`` waits once the queue is full;
- ``"raise"``: the acks fail with ``LedgerUnavailable``, and so does every
  later ``emit``: the job is meant to stop.

Draining is idempotent because every event carries its id. Once its thread
starts, a sender also drains, from another daemon thread, the spools that dead
processes left under its spool root (`shard_client.orphans`).

When no ledger answers at all (the connection refused, the name unresolvable: an
``unreachable`` `LedgerUnavailable`), the spool policy spools at once instead of
waiting ``unavailable_after_s``: the events are durable within milliseconds and
the job goes on.

Closing (``Ledger.close()``, or interpreter exit) tries the ledger once more and
waits up to ``exit_wait_s`` (default $SHARDLEDGER_EXIT_WAIT, else 10 s) for every
event to be acknowledged, spooled ones included, retrying a ledger that answers
slowly; it returns at once when every event is acknowledged or durably spooled
and the ledger is unreachable. Whatever stays in the spool is logged in one
``events_spooled`` line naming the count, the spool directory and the command
that drains it. An event the ledger
refuses is logged on ``logging.getLogger("shard_client")`` and appended to
``rejected.jsonl`` in the process's spool directory: nothing is lost silently.
Events still queued in memory die with a SIGKILLed process; ``Ack.wait`` tells
when one is safe.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import secrets
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Literal

import grpc

from shard_client import backoff
from shard_client.ack import Ack, resolve
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient, nothing_listens
from shard_client.delivery import MAX_BATCH_BYTES, MAX_BATCH_EVENTS, deliver
from shard_client.errors import LedgerClientError, LedgerRejected, LedgerUnavailable
from shard_client.orphans import OrphanDrainer
from shard_client.spool import Spool, SpoolLockedError
from shard_client.spooldir import (
    default_spool_root,
    drain_spool,
    open_process_spool,
    process_spool_dir,
    record_rejection,
    remove_finished_spool,
)

__all__ = [
    "DEFAULT_EXIT_WAIT_S",
    "ENV_EXIT_WAIT",
    "MAX_EVENT_BYTES",
    "Ack",
    "Policy",
    "Sender",
    "exit_wait_from_env",
    "new_event_id",
]

Policy = Literal["spool", "block", "raise"]
log = logging.getLogger("shard_client")
# An event this large can never be stored: the ledger takes at most 64 KiB of canonical
# JSON per event, and a protobuf event is never that much bigger than its JSON (the
# largest difference, a map entry's framing, is a few bytes per entry and at most 256
# entries are allowed). Sent, it would wait in the queue and the spool forever, holding
# up every event behind it; it is refused at emit instead.
MAX_EVENT_BYTES: Final = 1024 * 1024
ENV_EXIT_WAIT: Final = "SHARDLEDGER_EXIT_WAIT"
# Long enough for a ledger restart or a replica failover; short enough that a node
# whose ledger is down for good does not hold its GPUs long after each job.
DEFAULT_EXIT_WAIT_S: Final = 10.0


def exit_wait_from_env() -> float:
    """Returns $SHARDLEDGER_EXIT_WAIT in seconds, or the default; raises ValueError if malformed."""
    text = os.environ.get(ENV_EXIT_WAIT, "").strip()
    if not text:
        return DEFAULT_EXIT_WAIT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ValueError(f"${ENV_EXIT_WAIT} must be a number of seconds >= 0, not {text!r}")
    return value


_ids: tuple[int, str, itertools.count[int]] = (-1, "", itertools.count())


def new_event_id() -> str:
    """Returns a unique event id: a random per-process prefix and a counter (cheaper than uuid4)."""
    global _ids
    pid, prefix, counter = _ids
    if pid != os.getpid():
        _ids = pid, prefix, counter = os.getpid(), secrets.token_hex(10), itertools.count()
    return f"{prefix}-{next(counter):x}"


@dataclass(frozen=True, slots=True)
class _Item:
    event: pb.ShardEvent
    ack: Ack
    size: int


class Sender:
    """Queues events and delivers them from one daemon thread per process; fork-aware.

    A forked child starts afresh (its own queue, thread and spool directory) and
    drops the parent's queued events, which the parent sends. A fork waits for
    the append in flight, because a gRPC call active during fork() can leave the
    child's gRPC state wedged.

    ``jitter`` spreads each retry delay (``backoff.jittered``: between half and all
    of it), so that jobs refused together do not retry in step; a simulator or a test
    that must see this sender's own schedule passes its own. When the ledger's refusal
    says when to come back (RetryInfo: overloaded, or its store away), the sender waits
    that instead, capped at ``max_backoff_s`` and spread by ``advised_jitter``
    (``backoff.stretched``: between all of it and half again as much).
    """

    def __init__(
        self,
        client: LedgerClient,
        *,
        spool_root: str | None = None,
        policy: Policy = "spool",
        max_batch: int = MAX_BATCH_EVENTS,
        linger_s: float = 0.05,
        max_queue: int = 10_000,
        unavailable_after_s: float = 5.0,
        max_backoff_s: float = backoff.SENDER_MAX_DELAY_S,
        exit_wait_s: float | None = None,
        drain_orphans: bool = True,
        jitter: Callable[[float], float] = backoff.jittered,
        advised_jitter: Callable[[float], float] = backoff.stretched,
    ) -> None:
        if policy not in ("spool", "block", "raise"):
            raise ValueError(f"policy must be 'spool', 'block' or 'raise', not {policy!r}")
        if exit_wait_s is None:
            exit_wait_s = exit_wait_from_env()
        elif not 0 <= exit_wait_s < float("inf"):
            raise ValueError("exit_wait_s must be a number of seconds >= 0")
        self.client = client
        self.spool_root = os.path.abspath(spool_root or default_spool_root(client.target))
        self.policy: Policy = policy
        self.max_batch = max_batch
        self.linger_s = linger_s
        self.max_queue = max_queue
        self.unavailable_after_s = unavailable_after_s
        self.max_backoff_s = max_backoff_s
        self.exit_wait_s = exit_wait_s
        self.drain_orphans = drain_orphans
        self.jitter = jitter
        self.advised_jitter = advised_jitter
        self._reset()
        _SENDERS.add(self)

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # settled events; flush and acks wait here
        self._wakeup = threading.Condition(self._lock)  # only the sender thread waits here
        # Held around every RPC (a fork waits for it) and never around spool writes: an
        # emit that overflows to the spool must not wait for an append in flight.
        self._gate = threading.Lock()
        self._buffer: deque[_Item] = deque()
        self._inflight: list[_Item] = []
        self._inflight_spooled = False
        self._spool: Spool | None = None
        self.spool_dir = process_spool_dir(self.spool_root)
        self._spooled: dict[str, Ack] = {}
        # The spool holds records that go before anything queued. Set and cleared only
        # under the lock, as spills happen, so no spill can land unseen.
        self._dirty = False
        self._retry_at = 0.0
        self._backoff = backoff.FIRST_DELAY_S
        self._down: LedgerClientError | None = None
        # The latest call found no ledger at all (refused, unresolvable): close() need not wait.
        self._unreachable = False
        self._unsettled = 0
        self._urgent = self._closing = self._closed = False
        self._exit_deadline = float("inf")  # set by close(): retries stop there
        self._thread: threading.Thread | None = None
        self.orphans: OrphanDrainer | None = None

    def emit(self, event: pb.ShardEvent, *, ack: Ack | None = None) -> Ack:
        """Queues a copy of the event and returns its Ack; never waits for the network.

        ``ack``: one handed out before the event existed (a coalesced heartbeat's,
        made with the event's id), settled in place of a new one.
        The event is copied, so the caller may reuse the message. One over
        MAX_EVENT_BYTES is refused at once (its Ack says "rejected"; it is logged and
        written to rejected.jsonl): no ledger could store it.
        """
        if self._pid != os.getpid():
            self._reset()
        copy = pb.ShardEvent()
        copy.CopyFrom(event)
        item = _Item(copy, ack or Ack(event.event_id, self), copy.ByteSize())
        if item.size > MAX_EVENT_BYTES:
            return self._refuse_oversized(item)
        with self._cond:
            if self._closed:
                raise RuntimeError("the sender is closed")
            if self.policy == "raise" and self._down is not None:
                raise LedgerUnavailable(f"{self.client.target} is unreachable: {self._down}")
            while self.policy == "block" and len(self._buffer) >= self.max_queue:
                self._cond.wait(1.0)
            if self.policy == "raise" and len(self._buffer) >= self.max_queue:
                raise LedgerUnavailable("the sender's queue is full: the ledger is too slow")
            self._unsettled += 1
            self._buffer.append(item)
            if len(self._buffer) > self.max_queue:
                self._spill_locked()  # overflow goes to disk rather than blocking the job
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="shard_client-sender", daemon=True
                )
                self._thread.start()
                self._start_orphan_drain()
            self._wakeup.notify()
        return item.ack

    def _start_orphan_drain(self) -> None:
        """Starts draining the spools dead processes left under our root (once per process)."""
        if not self.drain_orphans or self.orphans is not None:
            return
        try:
            self.orphans = OrphanDrainer(
                root=self.spool_root, client=self.client, exclude=self.spool_dir, gate=self._gate
            ).start()
        except (
            RuntimeError
        ) as exc:  # no thread to be had (interpreter exit): a later process drains
            log.warning("orphan_spool_drain_not_started root=%s error=%s", self.spool_root, exc)

    def _refuse_oversized(self, item: _Item) -> Ack:
        refusal = LedgerRejected(
            f"event {item.ack.event_id} is {item.size} bytes; the SDK sends at most"
            f" {MAX_EVENT_BYTES} (the ledger stores at most 64 KiB of canonical JSON per event)",
            code=grpc.StatusCode.INVALID_ARGUMENT,
            reason="LIMIT_EXCEEDED",
            metadata={"limit": "event_bytes", "value": str(item.size)},
        )
        event = item.event
        # The refusal is on record (log, rejected.jsonl) with what identifies the event;
        # its megabytes are not copied into the file.
        header = pb.ShardEvent(
            event_id=event.event_id,
            namespace=event.namespace,
            run_id=event.run_id,
            shard_id=event.shard_id,
            attempt_id=event.attempt_id,
        )
        record_rejection(self.spool_dir, header, refusal)
        with self._cond:
            resolve(item.ack, refusal)
            self._cond.notify_all()
        return item.ack

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every emitted event is acknowledged, spooled or refused."""
        return self._wait(lambda: self._unsettled == 0, timeout)

    def drain(self, timeout: float | None = None) -> bool:
        """Waits until every event is settled and this process's spool is empty."""
        return self._wait(lambda: self._unsettled == 0 and not self._dirty, timeout, retry=True)

    def _wait(
        self, done: Callable[[], bool], timeout: float | None, *, retry: bool = False
    ) -> bool:
        if self._pid != os.getpid():
            self._reset()
        return self._await(done, timeout, retry=retry)

    def _await(
        self, done: Callable[[], bool], timeout: float | None, *, retry: bool = False
    ) -> bool:
        if self._pid != os.getpid():
            return done()  # an ack of the parent process: nothing here will settle it
        with self._cond:
            self._urgent = True  # someone waits: stop lingering for more events
            if retry:
                self._retry_at = 0.0
            self._wakeup.notify()
            return self._cond.wait_for(done, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Waits up to ``timeout`` (default ``exit_wait_s``) for every event to be acknowledged.

        What the ledger has not acknowledged by then stays in the spool (one
        ``events_spooled`` warning names the count and the directory) or, with
        the block and raise policies, is logged as lost. Then the thread stops
        and the spool is released.
        """
        wait_s = self.exit_wait_s if timeout is None else timeout
        with self._cond:
            if self._closed or self._pid != os.getpid():
                return
            self._closing = self._urgent = True
            self._retry_at = 0.0
            self._exit_deadline = time.monotonic() + wait_s
            self._wakeup.notify()
            thread = self._thread
        if self.orphans is not None:
            self.orphans.stop()  # no new attempts; a drain under way may use the exit wait
        if thread is not None:
            self._wait_or_leave(thread, wait_s)
        if self.orphans is not None:
            # A short job must not cut off the drain of the spools an earlier job left.
            self.orphans.join(max(self._exit_deadline - time.monotonic(), 0.0))
        with self._cond:
            self._closed = True
            if (self._buffer or self._inflight) and self.policy == "spool":
                self._spill_locked()
            lost, spool, unreachable = len(self._buffer), self._spool, self._unreachable
            if not self._inflight_spooled:
                # The thread is still inside its append (block policy, or a short timeout):
                # nothing vouches for that batch once the process exits.
                lost += sum(not item.ack.acknowledged for item in self._inflight)
        if lost:
            log.error("events_lost count=%d reason=ledger unreachable at exit", lost)
        thread_done = thread is None or not thread.is_alive()
        if thread_done and (self.orphans is None or self.orphans.join(0)):
            # Nothing of ours appends any more: the stream ends now, not at interpreter exit.
            self.client.end_stream()
        if spool is not None:
            with self._gate:
                left = spool.pending_count()
                spool.close()
            if left:
                why = (
                    "no ledger answers at %s (nothing waited for)"
                    if unreachable
                    else f"%s did not acknowledge them within the exit wait of {wait_s:g}s"
                    f" (${ENV_EXIT_WAIT})"
                )
                log.warning(
                    "events_spooled count=%d directory=%s: " + why + "; the next SDK process"
                    " on this host sends them, or run: shardledger spool drain --dir %s",
                    left,
                    self.spool_dir,
                    self.client.target,
                    self.spool_dir,
                )
            else:
                remove_finished_spool(self.spool_dir)

    def _wait_or_leave(self, thread: threading.Thread, wait_s: float) -> None:
        """Waits for the thread's end within wait_s, unless every event is durable and nothing listens.

        A failed call only suggests the ledger is gone (a channel still in its reconnect
        backoff fails at once after the ledger came back); a connect that is refused
        says so, and then waiting out the exit wait would only idle the job.
        """
        deadline = time.monotonic() + wait_s

        def left() -> float:
            return max(deadline - time.monotonic(), 0.0)

        with self._cond:
            self._cond.wait_for(
                lambda: not thread.is_alive() or self._durable_and_unreachable_locked(), left()
            )
            if not thread.is_alive() or not self._durable_and_unreachable_locked():
                return  # the thread ended, or the exit wait did
        # Every event is acknowledged or spooled, and the latest call found no ledger.
        if nothing_listens(self.client.target):
            with self._cond:
                # The thread stops at its next step; the spool keeps every event.
                self._exit_deadline = time.monotonic()
                self._retry_at = float("inf")
                self._wakeup.notify()
            return
        # It is back, or was never gone: the exit wait applies.
        with self._cond:
            self._cond.wait_for(lambda: not thread.is_alive(), left())

    def _durable_and_unreachable_locked(self) -> bool:
        """Returns whether every event is acknowledged or spooled and no ledger answers."""
        in_memory = bool(self._buffer) or (bool(self._inflight) and not self._inflight_spooled)
        return self._unreachable and self._unsettled == 0 and not in_memory

    # --- the thread -------------------------------------------------------------

    def _run(self) -> None:
        while True:
            work: list[_Item] | None = []
            try:
                with self._cond:
                    work = self._next_work_locked()
                if work is None:
                    with self._cond:
                        self._cond.notify_all()  # close() waits for this thread's end here
                    return
                if work:
                    self._send(work)
                else:
                    self._drain_step()
            except Exception:  # the thread must outlive any bug; the acks say what happened
                log.exception("sender_failed")
                with self._cond:
                    if self._closed:  # close() gave up waiting and released the spool
                        return
                    self._fail_locked(work or [], LedgerClientError("internal sender error"))
                    self._inflight = []
                    self._retry_at = time.monotonic() + self.max_backoff_s
                    self._wakeup.wait(self.max_backoff_s)  # a bug that repeats must not spin

    def _linger_locked(self) -> None:
        deadline = time.monotonic() + self.linger_s
        while len(self._buffer) < self.max_batch and not (self._urgent or self._closing):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._wakeup.wait(left)

    def _next_work_locked(self) -> list[_Item] | None:
        """Returns a batch to send, [] to drain the spool first, or None to stop."""
        while True:
            if self._dirty:
                if self._buffer:
                    self._linger_locked()
                    self._spill_locked()  # one order: the spool, then anything newer
                if time.monotonic() >= self._retry_at:
                    return []
                if self._closing and self._retry_at >= self._exit_deadline:
                    return None  # the exit wait is over: the rest stays for a later drain
                self._wakeup.wait(self._retry_at - time.monotonic())
            elif self._buffer:
                self._linger_locked()
                if self._dirty:
                    continue
                self._urgent = False
                batch, size = [self._buffer.popleft()], 0
                while self._buffer and len(batch) < self.max_batch:
                    size += batch[-1].size
                    if size + self._buffer[0].size > MAX_BATCH_BYTES:
                        break
                    batch.append(self._buffer.popleft())
                self._inflight, self._inflight_spooled = batch, False
                self._cond.notify_all()
                return batch
            elif self._closing:
                return None
            else:
                self._wakeup.wait()

    def _send(self, batch: list[_Item]) -> None:
        events = [item.event for item in batch]
        pos, unanswered_since = 0, 0.0
        while pos < len(batch):
            tried = time.monotonic()
            results, stop = deliver(self.client, events[pos:], gate=self._gate)
            self._settle(batch[pos : pos + len(results)], results)
            pos += len(results)
            if stop is None:
                break
            # Counted from when the failed call began: on a link that drops packets the
            # call itself takes the whole deadline, and that is time without an answer.
            unanswered_since = unanswered_since or tried
            with self._cond:
                self._unreachable = _nobody_listens(stop)
                if self._inflight_spooled:
                    break  # an overflow already put these in the spool
                elapsed = time.monotonic() - unanswered_since
                # No ledger answers at all: the spool keeps the events durably now.
                spool_now = self.policy == "spool" and self._unreachable
                if self.policy == "block" or (
                    elapsed < self.unavailable_after_s and not self._closing and not spool_now
                ):
                    # Blocking means waiting out even a close; the others stop at once.
                    self._wakeup.wait_for(
                        lambda: self._closing and self.policy != "block", self._retry_wait(stop)
                    )
                    self._backoff = backoff.grown(self._backoff, self.max_backoff_s)
                    continue
                if self.policy == "spool":
                    self._spill_locked(batch[pos:])
                    self._retry_at = time.monotonic() + self._retry_wait(stop)
                else:
                    self._down = stop
                    self._fail_locked(batch[pos:], stop)
                break
        with self._cond:
            self._inflight = []
            if pos == len(batch):
                self._down, self._backoff = None, backoff.FIRST_DELAY_S
                self._unreachable = False
            self._cond.notify_all()

    def _retry_wait(self, stop: LedgerClientError) -> float:
        """Returns how long to wait after a failed append: the ledger's delay, else our step."""
        return backoff.retry_wait(
            stop.retry_after_s,
            self._backoff,
            cap_s=self.max_backoff_s,
            jitter=self.jitter,
            advised_jitter=self.advised_jitter,
        )

    def _drain_step(self) -> None:
        spool = self._spool
        assert spool is not None
        _, _, stop = drain_spool(
            spool,
            self.client,
            directory=self.spool_dir,
            gate=self._gate,
            on_result=self._on_drained,
            max_batches=1,
        )
        with self._cond:
            # Spills happen under this lock too, so the count and the flag agree.
            empty = spool.pending_count() == 0
            self._unreachable = stop is not None and _nobody_listens(stop)
            if stop is None:
                self._backoff = backoff.FIRST_DELAY_S
            else:
                now = time.monotonic()
                self._retry_at = now + self._retry_wait(stop)
                if self._closing and self._retry_at >= self._exit_deadline:
                    # While closing, one last try just before the exit wait ends, if there
                    # is time for one; after it the rest stays for a later drain.
                    left = self._exit_deadline - now
                    self._retry_at = self._exit_deadline - 0.2 if left > 0.5 else float("inf")
                self._backoff = backoff.grown(self._backoff, self.max_backoff_s)
            self._dirty = not empty
            self._cond.notify_all()

    def _on_drained(self, event_id: str, result: pb.AppendResult | LedgerRejected) -> None:
        with self._cond:
            ack = self._spooled.pop(event_id, None)
            if ack is not None:
                resolve(ack, result)

    # --- settling: always under the lock, so that each ack counts once ------------

    def _settle(
        self, items: Sequence[_Item], results: Sequence[pb.AppendResult | LedgerRejected]
    ) -> None:
        for item, result in zip(items, results, strict=True):
            if isinstance(result, LedgerRejected):
                record_rejection(self.spool_dir, item.event, result)
        with self._cond:
            for item, result in zip(items, results, strict=True):
                self._unsettled -= resolve(item.ack, result)
                self._spooled.pop(item.ack.event_id, None)
            self._cond.notify_all()

    def _fail_locked(self, items: Sequence[_Item], error: LedgerClientError) -> None:
        self._unsettled -= sum(item.ack._settle("failed", 0, error) for item in items)
        self._cond.notify_all()

    def _spill_locked(self, items: Sequence[_Item] = ()) -> None:
        """Writes unsent events, oldest first, to the spool; the caller holds the lock."""
        chosen = list(items)
        # The batch in flight is older than the queue, so it goes first; if it
        # gets through as well, its spooled copy drains as a harmless duplicate.
        with_inflight = not chosen and bool(self._inflight) and not self._inflight_spooled
        if with_inflight:
            chosen = list(self._inflight)
        chosen += self._buffer
        if not chosen:
            return
        try:
            # The Spool serializes its own writers; the RPC gate is not taken here.
            if self._spool is None:
                self._spool = open_process_spool(self.spool_dir, target=self.client.target)
            self._spool.append([item.event.SerializeToString() for item in chosen])
        except (
            OSError,
            SpoolLockedError,
        ) as exc:  # the events stay in memory; a later spill retries
            log.error("spool_write_failed directory=%s error=%s", self.spool_dir, exc)
            self._buffer.extendleft(reversed(items))
            return
        self._inflight_spooled = self._inflight_spooled or with_inflight
        self._buffer.clear()
        for item in chosen:
            self._unsettled -= item.ack._settle("spooled")
            if not item.ack.acknowledged:
                self._spooled[item.ack.event_id] = item.ack
        self._dirty = True
        self._cond.notify_all()
        self._wakeup.notify()


def _nobody_listens(error: LedgerClientError) -> bool:
    """Returns whether a failed call found no ledger at all (refused, unresolvable)."""
    return isinstance(error, LedgerUnavailable) and error.unreachable


_SENDERS: weakref.WeakSet[Sender] = weakref.WeakSet()


_HELD: list[threading.Lock] = []


def _before_fork() -> None:
    for sender in list(_SENDERS):
        if sender._pid == os.getpid():
            sender._gate.acquire()
            _HELD.append(sender._gate)


def _after_fork_in_parent() -> None:
    while _HELD:
        _HELD.pop().release()


def _after_fork_in_child() -> None:
    _HELD.clear()
    for sender in list(_SENDERS):
        if sender._spool is not None:
            # Our copies of the parent's descriptors would hold its spool's lock for as
            # long as this child lives; closing them leaves the parent's lock in place.
            sender._spool.forget_inherited()
        sender._reset()  # the parent's queue, thread, locks and spool are not ours


def _close_all() -> None:
    for sender in list(_SENDERS):
        sender.close()


os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
)
atexit.register(_close_all)
