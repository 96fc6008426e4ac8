"""The background drain of orphaned spools: what dead processes left under a spool root.

A job that ended while the ledger was away leaves its last events in its spool
directory. Until they reach the ledger, `shardledger status` shows that shard
running or missing. So every SDK process, once its sender starts, looks under
its spool root from one daemon thread and sends the spools whose owner is gone
(the spool's flock tells: a live owner holds it, and a second drainer finds it
held too, so each spool has at most one drainer). It tries a bounded number of
times with capped exponential backoff while the ledger is unreachable, logs
what it did, and never raises into the job.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Final

from shard_client import backoff
from shard_client.client import LedgerClient
from shard_client.spooldir import DrainResult, drain_spool_dirs

__all__ = ["ORPHAN_DRAIN_ATTEMPTS", "OrphanDrainer"]

log = logging.getLogger("shard_client")

# Delays of 1, 2, 4, ... 60 s: the drain keeps trying for about five minutes of an
# outage, then leaves the spools to the next process or `shardledger spool drain`.
ORPHAN_DRAIN_ATTEMPTS: Final = 10
ORPHAN_FIRST_DELAY_S: Final = 1.0
ORPHAN_MAX_DELAY_S: Final = 60.0


class OrphanDrainer:
    """Drains the spools of dead processes under one root to this process's ledger, in a thread."""

    def __init__(
        self,
        *,
        root: str,
        client: LedgerClient,
        exclude: str,
        gate: threading.Lock | None = None,
        attempts: int = ORPHAN_DRAIN_ATTEMPTS,
        first_delay_s: float = ORPHAN_FIRST_DELAY_S,
        max_delay_s: float = ORPHAN_MAX_DELAY_S,
        drain: Callable[..., list[DrainResult]] = drain_spool_dirs,
    ) -> None:
        self.root, self.client, self.exclude = root, client, exclude
        self._gate = gate
        self._attempts = attempts
        self._first_delay_s, self._max_delay_s = first_delay_s, max_delay_s
        self._drain = drain
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.results: list[DrainResult] = []  # the last attempt's, for tests and debugging

    def start(self) -> OrphanDrainer:
        """Starts the daemon thread; returns self."""
        self._thread = threading.Thread(
            target=self._run, name="shard_client-orphan-drain", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Asks the thread to stop after the spool it is sending (it is not waited for)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> bool:
        """Waits for the thread to end; returns whether it did."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def _run(self) -> None:
        delay = self._first_delay_s
        for attempt in range(1, self._attempts + 1):
            if self._stop.is_set():
                return
            try:
                results = self._once()
            except Exception:  # a bug here must never reach the job; the spools stay for later
                log.exception("orphan_spool_drain_failed root=%s", self.root)
                return
            self.results = results
            waiting = [r for r in results if r.status == "unavailable"]
            if not waiting:
                return
            if attempt == self._attempts:
                log.warning(
                    "orphan_spools_left count=%d root=%s target=%s: the ledger did not answer"
                    " after %d attempts; the next SDK process on this host tries again,"
                    " or run: shardledger spool drain --dir %s",
                    len(waiting),
                    self.root,
                    self.client.target,
                    attempt,
                    self.root,
                )
                return
            if self._stop.wait(backoff.jittered(delay)):
                return
            delay = backoff.grown(delay, self._max_delay_s)

    def _once(self) -> list[DrainResult]:
        # The job's own client (its credentials and TLS), the sender's RPC gate (a fork
        # must not happen mid-call) and no retries inside a call: the loop above retries.
        results = self._drain(
            self.root,
            exclude=[self.exclude],
            only_target=self.client.target,
            client_factory=lambda _target: self.client,
            connect_timeout_s=None,
            gate=self._gate,
            retry=False,
        )
        for result in results:
            if result.status == "drained" and (result.sent or result.rejected):
                log.info(
                    "orphan_spool_drained directory=%s sent=%d rejected=%d",
                    result.directory,
                    result.sent,
                    result.rejected,
                )
            elif result.status in ("denied", "damaged"):
                log.warning(
                    "orphan_spool_not_drained directory=%s status=%s error=%s",
                    result.directory,
                    result.status,
                    result.error,
                )
        return results
