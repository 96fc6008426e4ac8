"""The heartbeat thread of a shard attempt: beats while the job is quiet, ends the SIGTERM grace."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.errors import LedgerClientError
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
        send: Callable[[pb.Heartbeat], object],
        active: Callable[[], bool],
        shard_id: str,
        attempt_id: str,
        clock: ProgressClock,
        watchdog: Watchdog | None = None,
        ended_elsewhere: Callable[[], bool] | None = None,
    ) -> None:
        self.step, self.progress = 0, 0.0
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

    def beat_sent(self, step: int, progress: float) -> None:
        """Notes a heartbeat the job sent itself: progress, and no beat due for an interval."""
        self.step, self.progress = step, progress
        self._clock.stepped()
        self._last_beat = time.monotonic()

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
                self._last_beat = now
                if self._stalled(now):
                    continue  # no beat: the ledger marks the shard stale after its timeout
                beat = pb.Heartbeat(step=self.step, progress=self.progress)
                with contextlib.suppress(LedgerClientError, RuntimeError):
                    self._send(beat)

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
