"""The in-job hang watchdog: a job alive but making no progress is diagnosed, recorded and stopped.

Why the default threshold is ``10 × the median step time + hang_grace (5 min)``:
the field reports (§3.4) size a hang as "单步耗时的 10 倍加上固定宽限" — ten
times the time one step takes plus a fixed grace of five minutes. Ten steps'
worth absorbs the ordinary jitter of a training loop (a slow batch, a GC
pause, a data-loader refill), the grace absorbs what no step time predicts (a
first CUDA compile, an eval pass, a slow filesystem), and the median of the
recent intervals between ``progress()`` calls follows a job that slows down
without letting one long step raise the bar. A job that never calls
``progress()`` has no step time, so it keeps the heartbeat-only behaviour
unless it sets ``hang_timeout`` explicitly.

The clock pauses while a checkpoint is saved or a file is written or committed
through the shard (a multi-gigabyte save is not a hang) and restarts when that
ends; a checkpoint or commit counts as progress.

When it trips, from its own thread (the main thread may be the one that hangs):
a diagnostics bundle is written atomically (`shard_client.diagnostics`), the
attempt is recorded ``failed(timeout)`` with the bundle's path and BLAKE3 — and
acknowledged or durably spooled — then the process gets SIGTERM (the SDK's
``sigterm_grace`` handling lets the job checkpoint and stop) and, ``kill_grace``
seconds later if it still lives, SIGKILL. Each step is logged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final

from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.diagnostics import BundleContext, write_bundle
from shard_client.errors import LedgerClientError
from shard_client.signals import discard_empty_stack

__all__ = [
    "DEFAULT_HANG_GRACE_S",
    "DEFAULT_KILL_GRACE_S",
    "STEP_FACTOR",
    "HangPolicy",
    "ProgressClock",
    "Watchdog",
    "terminate_self",
]

log = logging.getLogger("shard_client")

STEP_FACTOR: Final = 10
DEFAULT_HANG_GRACE_S: Final = 300.0
DEFAULT_KILL_GRACE_S: Final = 30.0
# Enough recent steps for a stable median, few enough to follow a job that slows down.
_WINDOW: Final = 32


class ProgressClock:
    """When the job last made progress, how long its steps take, and whether a save is under way."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._lock = threading.Lock()
        self.last = now()  # progress(), a checkpoint or a commit
        self._last_step: float | None = None
        self._intervals: deque[float] = deque(maxlen=_WINDOW)
        self._busy = 0

    def stepped(self) -> None:
        """Notes a progress() call: progress, and one more step interval observed."""
        with self._lock:
            now = self._now()
            if self._last_step is not None:
                self._intervals.append(now - self._last_step)
            self._last_step = self.last = now

    def progressed(self) -> None:
        """Notes progress that is not a step (a checkpoint or a commit)."""
        with self._lock:
            self.last = self._now()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Stops the clock while a save or commit runs; its end counts as progress."""
        with self._lock:
            self._busy += 1
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1
                self.last = self._now()
                if self._last_step is not None:
                    # The save's time is not a step's: the next interval starts after it.
                    self._last_step = self.last

    def median_step(self) -> float | None:
        """Returns the median of the recent intervals between progress() calls, if any."""
        with self._lock:
            intervals = list(self._intervals)
        if not intervals:
            return None
        import statistics  # with fractions and decimal: loaded once a job reports steps

        return statistics.median(intervals)

    def quiet_since(self) -> float | None:
        """Returns when progress last happened, or None while a save or commit runs."""
        with self._lock:
            return None if self._busy else self.last


@dataclass(frozen=True, slots=True)
class HangPolicy:
    """How long a quiet job may stay quiet, and how it is stopped."""

    hang_timeout: float | None  # explicit: trips with or without progress() calls
    hang_grace: float = DEFAULT_HANG_GRACE_S
    kill_grace: float = DEFAULT_KILL_GRACE_S
    log_file: str | None = None

    def threshold(self, median_step: float | None) -> tuple[float, str] | None:
        """Returns the quiet time that counts as a hang and how it was reached; None: unwatched."""
        if self.hang_timeout is not None:
            return self.hang_timeout, f"hang_timeout {self.hang_timeout:g}s"
        if median_step is None:
            return None
        limit = STEP_FACTOR * median_step + self.hang_grace
        basis = f"{STEP_FACTOR} x median step {median_step:.3g}s + hang_grace {self.hang_grace:g}s"
        return limit, basis


class Watchdog:
    """Decides when the quiet job is hung and then diagnoses, records and stops it (once)."""

    def __init__(
        self,
        *,
        policy: HangPolicy,
        clock: ProgressClock,
        context: BundleContext,
        claim: Callable[[], bool],
        record_failed: Callable[[pb.AttemptFailed], object],
        kill: Callable[[int, int], None] = os.kill,
    ) -> None:
        self.policy = policy
        self.clock = clock
        self.tripped = False
        self._context = context
        self._claim = claim
        self._record_failed = record_failed
        self._kill = kill
        self._thread: threading.Thread | None = None

    def deadline(self) -> float:
        """Returns when (monotonic) the job counts as hung if nothing happens; inf if never."""
        since = self.clock.quiet_since()
        limit = self.policy.threshold(self.clock.median_step())
        if self.tripped or since is None or limit is None:
            return float("inf")
        return since + limit[0]

    def check(self, now: float) -> bool:
        """Trips when the deadline passed (and the shard is still ours to end); returns tripped."""
        if self.tripped or now < self.deadline():
            return self.tripped
        since, limit = self.clock.quiet_since(), self.policy.threshold(self.clock.median_step())
        if since is None or limit is None or not self._claim():
            return False  # a save began, or the block is ending by itself
        self.tripped = True
        quiet, (threshold, basis) = now - since, limit
        log.error(
            "hang_detected shard=%s attempt=%s quiet_s=%.1f threshold_s=%.1f basis=%r",
            self._context.shard_id,
            self._context.attempt_id,
            quiet,
            threshold,
            basis,
        )
        self._thread = threading.Thread(
            target=self._stop,
            args=(quiet, threshold, basis),
            name=f"shard_client-watchdog-{self._context.shard_id}",
            daemon=True,
        )
        self._thread.start()
        return True

    def stop_after_peer(self, message: str) -> None:
        """Stops the process because another rank ended the attempt: diagnostics, TERM, KILL.

        The attempt already has its ending on the ledger, so nothing is recorded.
        """
        if self.tripped:
            return
        self.tripped = True
        self._thread = threading.Thread(
            target=self._stop_peer,
            args=(message,),
            name=f"shard_client-watchdog-{self._context.shard_id}",
            daemon=True,
        )
        self._thread.start()

    def _stop_peer(self, message: str) -> None:
        ctx = self._context
        try:
            info = write_bundle(ctx, message=message, log_file=self.policy.log_file)
            log.warning("peer_stop_diagnostics_written shard=%s path=%s", ctx.shard_id, info.path)
        except Exception as exc:  # diagnostics are evidence; stopping matters more
            log.error("peer_stop_diagnostics_failed shard=%s error=%r", ctx.shard_id, exc)
        terminate_self(
            ctx.shard_id, self.policy.kill_grace, kill=self._kill, stack_label=ctx.attempt_id
        )

    def _stop(self, quiet: float, threshold: float, basis: str) -> None:
        ctx, policy = self._context, self.policy
        message = (
            f"hung: no progress() call, checkpoint or commit for {quiet:.1f}s"
            f" (threshold {threshold:.1f}s = {basis}); stopped by the SDK watchdog"
            f" with SIGTERM, SIGKILL after {policy.kill_grace:g}s"
        )
        path, digest = "", ""
        try:
            info = write_bundle(ctx, message=message, log_file=policy.log_file)
            path, digest = info.path, info.blake3_hex
            log.warning("hang_diagnostics_written shard=%s path=%s", ctx.shard_id, path)
        except Exception as exc:  # diagnostics are evidence; stopping the hang matters more
            log.error("hang_diagnostics_failed shard=%s error=%r", ctx.shard_id, exc)
        failed = pb.AttemptFailed(
            tag="FAILURE_TAG_TIMEOUT",
            message=message,
            diagnostics_path=path,
            diagnostics_blake3_hex=digest,
        )
        try:
            self._record_failed(failed)
            log.warning("hang_failure_recorded shard=%s tag=timeout", ctx.shard_id)
        except LedgerClientError as exc:  # still stopped: the ledger sees it stale instead
            log.error("hang_failure_not_recorded shard=%s error=%s", ctx.shard_id, exc)
        terminate_self(ctx.shard_id, policy.kill_grace, kill=self._kill, stack_label=ctx.attempt_id)

    def join(self, timeout: float) -> None:
        """Waits for the stopping thread (tests with a fake kill)."""
        if self._thread is not None:
            self._thread.join(timeout)


def terminate_self(
    label: str,
    kill_grace: float,
    *,
    kill: Callable[[int, int], None] = os.kill,
    stack_label: str = "",
) -> None:
    """Sends this process SIGTERM and, ``kill_grace`` seconds later if it still lives, SIGKILL.

    Before the SIGKILL the attempt's empty stack file (``stack_label``) is removed: the
    kill leaves no cleanup to run.
    """
    pid = os.getpid()
    log.warning("hang_sigterm_sent shard=%s pid=%d", label, pid)
    kill(pid, signal.SIGTERM)
    time.sleep(kill_grace)
    log.error(
        "hang_sigkill_sent shard=%s pid=%d: still alive %gs after SIGTERM", label, pid, kill_grace
    )
    for handler in logging.getLogger().handlers + log.handlers:
        with contextlib.suppress(Exception):  # the last line must reach the log before KILL
            handler.flush()
    if stack_label:
        discard_empty_stack(stack_label)
    kill(pid, signal.SIGKILL)
