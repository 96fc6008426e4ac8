"""Health that follows the store: NOT_SERVING while appends cannot be written, SERVING again after one commits."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import structlog
from grpc_health.v1 import health_pb2

from ledger_server.framework import LedgerHealth
from ledger_server.store.base import StoreError

log = structlog.get_logger("shardledger.store")


class StoreHealth:
    """Flips the health of the named services with the outcome of each append's write."""

    def __init__(self, servicer: LedgerHealth, services: Sequence[str]) -> None:
        self._servicer = servicer
        self._services = tuple(services)
        self._lock = threading.Lock()
        self._failing: str | None = None  # the reason of the fault in force, if any

    @property
    def failing(self) -> str | None:
        """Returns the reason of the storage fault in force, or None while writes commit."""
        return self._failing

    def observe(self, error: StoreError | None) -> None:
        """Records one append's write: a store error, or None when it committed."""
        with self._lock:
            reason = error.reason if error is not None else None
            if reason == self._failing:
                return
            was, self._failing = self._failing, reason
        if error is not None:
            # One line per change of fault, not per refused append (there may be thousands).
            log.error(
                "store_write_failed",
                reason=error.reason,
                permanent=error.permanent,
                error=str(error),
            )
            status = health_pb2.HealthCheckResponse.NOT_SERVING
        else:
            log.warning("store_writable_again", after=was)
            status = health_pb2.HealthCheckResponse.SERVING
        # After enter_graceful_shutdown the servicer ignores set(): a stop stays NOT_SERVING.
        for name in self._services:
            self._servicer.set(name, status)
