"""A shard attempt's heartbeats: progress() coalesced per interval, a thread for quiet times.

``shard.progress()`` may be called every step; the ledger gets at most one
heartbeat per ``heartbeat_interval`` from it (see shard_client.progress), plus
one at once for the attempt's first call and for a metric that turns
non-finite for the first time. Everything else the shard emits (a checkpoint,
a commit, a failure) first flushes the pending heartbeat, so the ledger's
order is the job's order and no progress is held back behind an outcome.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from shard_client.ack import Ack
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.errors import LedgerClientError
from shard_client.metrics import MAX_METRICS, Coerced
from shard_client.progress import ProgressWindow
from shard_client.signals import SigtermGrace
from shard_client.watchdog import ProgressClock, Watchdog

__all__ = ["Heartbeats"]

log = logging.getLogger("shard_client")


class Heartbeats:
    """Sends a heartbeat whenever the job was quiet for an interval, from one daemon thread.

    With ``progress_timeout_s`` the beats stop once no progress (a ``progress()``,
    checkpoint or commit) came for that long, so a job hung with its process alive
    goes stale on the ledger; they resume with progress. The same thread ends the
    SIGTERM grace period and runs the hang ``watchdog``'s check, because the main
    thread may be the one that hangs; once the watchdog tripped, no beat is sent.
    """

    def __init__(
        self,
        *,
        interval_s: float,
        progress_timeout_s: float | None,
        sigterm: SigtermGrace,
        wake: threading.Event,
        send: Callable[[pb.Heartbeat, Ack | None], Ack],
        reserve: Callable[[], Ack],
        active: Callable[[], bool],
        shard_id: str,
        attempt_id: str,
        clock: ProgressClock,
        watchdog: Watchdog | None = None,
        ended_elsewhere: Callable[[], bool] | None = None,
        coalesce: bool = True,
    ) -> None:
        self.step, self.progress = 0, 0.0
        self._reserve = reserve
        self._coalesce = coalesce
        # progress() runs in the job's threads, the beat in this one: the window, its Ack
        # and the send order are guarded together, so the ledger sees windows in order.
        self._lock = threading.Lock()
        self._window: ProgressWindow | None = None
        self._window_ack: Ack | None = None
        self._calls = 0
        self._nonfinite_seen: set[str] = set()
        self._dropped_logged = False
        self._interval_s = interval_s
        self._progress_timeout_s = progress_timeout_s
        self._sigterm = sigterm
        self._wake = wake
        self._send = send
        self._active = active
        self._shard_id, self._attempt_id = shard_id, attempt_id
        self._last_beat = 0.0
        self._clock = clock
        self._watchdog = watchdog
        # A rank of a multi-rank attempt: asked about once a second whether another rank
        # ended the attempt (and then stopping this one); true from then on.
        self._ended_elsewhere = ended_elsewhere
        self._quiet_logged = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Starts the thread; the first beat is due an interval from now."""
        self._last_beat = time.monotonic()
        self._thread = threading.Thread(
            target=self._run, name=f"shard_client-heartbeat-{self._shard_id}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Wakes the thread (which sees the attempt inactive and returns) and joins it briefly."""
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def add(self, values: Coerced) -> Ack:
        """Adds one progress() call to the pending heartbeat; sends it when it is due.

        Due: the attempt's first call, a metric non-finite for the first time, an
        interval since the last beat, or coalescing off. The Ack returned is the
        heartbeat's that carries the call (settled once that heartbeat is).
        """
        self._clock.stepped()
        with self._lock:
            self.step, self.progress = values.step, values.progress
            if self._window is None or self._window_ack is None:
                self._window, self._window_ack = ProgressWindow(), self._reserve()
            self._window.add(values)
            ack = self._window_ack
            self._calls += 1
            fresh = set(values.nonfinite) - self._nonfinite_seen
            if fresh and len(self._nonfinite_seen) < MAX_METRICS:
                self._nonfinite_seen |= fresh  # numeric pollution is news: it goes at once
            else:
                fresh = set()
            now = time.monotonic()
            due = now >= self._last_beat + self._interval_s
            if not self._coalesce or due or fresh or self._calls == 1:
                self._flush_locked(now)
        return ack

    def flush(self) -> None:
        """Sends the pending heartbeat, if any: before any other event of the attempt."""
        with self._lock:
            self._flush_locked(time.monotonic())

    def _flush_locked(self, now: float) -> None:
        window, ack = self._window, self._window_ack
        if window is None or ack is None:
            return
        self._window = self._window_ack = None
        self._last_beat = now
        if window.dropped and not self._dropped_logged:
            self._dropped_logged = True
            log.warning(
                "progress_metrics_dropped shard=%s attempt=%s names=%d: over one heartbeat's limits",
                self._shard_id,
                self._attempt_id,
                window.dropped,
            )
        try:
            self._send(window.heartbeat(), ack)
        except LedgerClientError as error:
            ack._settle("failed", 0, error)  # whoever waits on the calls' Ack learns why
            raise

    def made_progress(self, step: int | None = None) -> None:
        """Notes progress other than a heartbeat (a commit or checkpoint), at least ``step``."""
        if step is not None:
            self.step = max(self.step, step)
        self._clock.progressed()

    def _run(self) -> None:
        while True:
            due = min(self._last_beat + self._interval_s, self._sigterm.deadline())
            if self._ended_elsewhere is not None:
                due = min(due, time.monotonic() + 1.0)
            if self._watchdog is not None:
                # A progress() call can move the deadline earlier (the first step time
                # arms it) without waking this thread, so it looks again every second.
                due = min(due, self._watchdog.deadline(), time.monotonic() + 1.0)
            if self._wake.wait(max(due - time.monotonic(), 0.0)):
                self._wake.clear()
            if not self._active():
                return
            now = time.monotonic()
            if now >= self._sigterm.deadline():
                self._sigterm.expire()
            if self._ended_elsewhere is not None and self._ended_elsewhere():
                self._last_beat = now  # the attempt ended: a beat would be refused
                continue
            if self._watchdog is not None and self._watchdog.check(now):
                # The attempt is recorded failed(timeout): a beat now would be refused.
                self._last_beat = now
                continue
            if now >= self._last_beat + self._interval_s:
                with self._lock, contextlib.suppress(LedgerClientError, RuntimeError):
                    if self._window is not None:
                        self._flush_locked(now)  # the interval's progress() calls
                        continue
                    self._last_beat = now
                    if self._stalled(now):
                        continue  # no beat: the ledger marks the shard stale after its timeout
                    self._send(pb.Heartbeat(step=self.step, progress=self.progress), None)

    def _stalled(self, now: float) -> bool:
        """Whether progress_timeout passed without progress (logged once per stall)."""
        limit, since = self._progress_timeout_s, self._clock.quiet_since()
        if limit is None or since is None or now - since <= limit:
            self._quiet_logged = False
            return False
        if not self._quiet_logged:
            self._quiet_logged = True
            log.warning(
                "no_progress shard=%s attempt=%s seconds=%.0f: heartbeats stop until it resumes",
                self._shard_id,
                self._attempt_id,
                now - since,
            )
        return True
