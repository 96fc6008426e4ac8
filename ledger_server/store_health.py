"""Health that follows the store: NOT_SERVING while a write cannot commit, SERVING once one can.

Two things tell: each append's write (StoreHealth.observe) and a background probe of
the store (StoreProbe: ``store.probe()`` every ``--store-probe-interval`` seconds, every
PROBE_RETRY_S while it fails, and at once after an append fails). So health goes
NOT_SERVING at the first failed write or probe, and SERVING again at the first probe
or commit that succeeds: it never waits for the next append, and it never reports
SERVING while nobody appends to a store that cannot be written.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Final

import structlog
from grpc_health.v1 import health_pb2

from ledger_server.framework import LedgerHealth
from ledger_server.store.base import PROBE_RETRY_S, Store, StoreError

__all__ = ["StoreHealth", "StoreProbe"]

log = structlog.get_logger("shardledger.store")
# The one fault the probe checks for itself (the store cannot be reached, or written at all);
# it cannot see a full disk or a failed fsync, which only a write meets, so only a commit
# clears those.
_PROBED: Final = "STORE_UNAVAILABLE"
# How long a stop waits for a probe in progress (a connect attempt) to end.
_STOP_WAIT_S: Final = 5.0


class StoreHealth:
    """Flips the health of the named services with the store's state, from appends and probes."""

    def __init__(
        self,
        servicer: LedgerHealth,
        services: Sequence[str],
        *,
        on_change: Callable[[bool, float], None] | None = None,
    ) -> None:
        self._servicer = servicer
        self._services = tuple(services)
        self._on_change = on_change  # (serving, unix time) at each transition
        self._lock = threading.Lock()
        self._fault: StoreError | None = None  # the fault in force, if any
        self._probed = False  # whether the probe found it (so the probe may clear it)
        self._since = time.monotonic()
        # Called at the first failed append of an outage: the probe should look now.
        self.wake: Callable[[], None] | None = None

    @property
    def failing(self) -> str | None:
        """Returns the reason of the storage fault in force, or None while writes commit."""
        fault = self._fault
        return fault.reason if fault is not None else None

    def observe(self, error: StoreError | None) -> None:
        """Records one append's write: a store error, or None when it committed."""
        # A commit proves the store writable, whatever the probe said last.
        if self._change(error, source="append") and error is not None and self.wake is not None:
            self.wake()

    def observe_probe(self, error: StoreError | None) -> None:
        """Records one probe of the store: the fault it found, or None when a write could commit."""
        with self._lock:
            fault, probed = self._fault, self._probed
        if error is None and fault is not None and fault.reason != _PROBED and not probed:
            return  # a full disk or a failed fsync an append met is not for the probe to clear
        self._change(error, source="probe")

    def _change(self, error: StoreError | None, *, source: str) -> bool:
        """Sets the fault in force; returns whether serving flipped."""
        reason = error.reason if error is not None else None
        now = time.monotonic()
        with self._lock:
            was = self._fault
            self._probed = source == "probe"
            if (was.reason if was is not None else None) == reason:
                if error is not None:
                    self._fault = error  # the same fault, its latest words
                return False
            self._fault = error
            flipped = (was is None) != (error is None)
            since_s = now - self._since
            if flipped:
                self._since = now
        # One line per change of fault, not per refused append (there may be thousands).
        if error is not None:
            log.error(
                "store_write_failed",
                reason=error.reason,
                permanent=error.permanent,
                source=source,
                error=str(error),
                serving_for_s=round(since_s, 3) if flipped else None,
            )
        else:
            log.warning(
                "store_writable_again",
                after=was.reason if was is not None else None,
                source=source,
                not_serving_for_s=round(since_s, 3),
            )
        if not flipped:
            return False
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if error is None
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        # After enter_graceful_shutdown the servicer ignores set(): a stop stays NOT_SERVING.
        for name in self._services:
            self._servicer.set(name, status)
        if self._on_change is not None:
            self._on_change(error is None, time.time())
        return True


class StoreProbe:
    """Probes the store on a thread of its own and reports each result to a StoreHealth."""

    def __init__(self, store: Store, health: StoreHealth, *, interval_s: float) -> None:
        self._store = store
        self._health = health
        self._interval_s = interval_s
        # While the store fails, probe often: this delay bounds how late a replica notices
        # that a new primary takes writes (docs/operations.md, "Failover").
        self._retry_s = min(PROBE_RETRY_S, interval_s)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-probe", daemon=True)
        self.on_probe: Callable[[StoreError | None], None] | None = None

    def start(self) -> None:
        """Starts probing: the first probe runs at once."""
        self._health.wake = self.wake
        self._store.on_fault(self.wake)
        self._thread.start()

    def wake(self) -> None:
        """Runs the next probe now instead of at the end of the interval."""
        self._wake.set()

    def stop(self) -> None:
        """Stops probing; waits a little for a probe in progress."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(_STOP_WAIT_S)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                error = self._store.probe()
            except Exception as exc:  # a probe that raises is a fault of the probe, not a crash
                error = StoreError(f"the store's probe failed: {type(exc).__name__}: {exc}")
            if self._stop.is_set():
                return
            if self.on_probe is not None:
                self.on_probe(error)
            self._health.observe_probe(error)
            self._wake.wait(self._interval_s if error is None else self._retry_s)
