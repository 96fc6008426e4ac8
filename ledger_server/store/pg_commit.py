"""A bound on how long a PostgreSQL COMMIT may wait, chiefly for its synchronous standby.

With ``synchronous_commit = on`` and a synchronous standby named, a COMMIT returns only
once the standby has flushed its WAL. If the standby is gone and nobody (Patroni, an
operator) changes ``synchronous_standby_names``, the COMMIT waits forever, holding its
row locks, and so do the calls queued behind it: without a bound a replica answers
nothing until every client's deadline passes, and its health says SERVING throughout.
``statement_timeout`` cannot bound that wait: PostgreSQL disarms it before it commits.

CommitWatch cancels a COMMIT that is still waiting after ``bound_s`` (the server's
``--pg-commit-wait-bound``). PostgreSQL then *returns success* with a WARNING ("canceling
wait for synchronous replication ... The transaction has already committed locally,
but might not have been replicated to the standby"): the transaction is durable on this
server only, and would vanish if a standby without it were promoted. So the write is
never acknowledged: its caller gets StoreCommitWaitExceeded (UNAVAILABLE with a
RetryInfo), and the client resends with the same event ids. That resend is safe either
way: where the rows survived it is answered DUPLICATE with their original sequences,
and where they were lost with the old primary it writes them once. Answering DUPLICATE
takes the run's row lock, itself a WAL record, so that answer too waits for the standby
(and meets the same bound): nothing is acknowledged before the standby holds it.
The same holds for a COMMIT whose wait anyone else cancels (``pg_cancel_backend``):
any WARNING at COMMIT makes its outcome unknown, and it is not acknowledged.

A cancel that arrives after its COMMIT finished could hit the session's next statement,
so a connection whose COMMIT was cancelled is closed, never reused.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Final

import psycopg
import structlog

from ledger_server.store.base import StoreCommitWaitExceeded
from ledger_server.store.postgres_tx import Conn

__all__ = ["CommitWait", "CommitWatch"]

log = structlog.get_logger("shardledger.store")

# How long one cancel request may take to reach the server (a partitioned host answers never).
_CANCEL_TIMEOUT_S: Final = 2.0


@dataclass(slots=True)
class CommitWait:
    """One COMMIT under watch: its connection, when it began, and what happened to it."""

    conn: Conn
    began: float
    deadline: float
    report: bool
    backend_pid: int
    cancelled: bool = False
    warnings: list[str] = field(default_factory=list)

    def note(self, diag: psycopg.errors.Diagnostic) -> None:
        """Keeps a WARNING the server sent during the COMMIT (a cancelled wait sends one)."""
        if diag.severity_nonlocalized == "WARNING":
            self.warnings.append(f"{diag.message_primary} {diag.message_detail or ''}".strip())

    @property
    def unknown(self) -> bool:
        """Returns whether the COMMIT may have committed locally only (never acknowledge it)."""
        return self.cancelled or bool(self.warnings)


class CommitWatch:
    """Cancels every COMMIT that waits longer than bound_s; bound_s 0 watches nothing."""

    def __init__(
        self,
        bound_s: float,
        *,
        retry_after_s: float,
        on_exceeded: Callable[[StoreCommitWaitExceeded], None],
    ) -> None:
        self.bound_s = bound_s
        self._retry_after_s = retry_after_s
        self._on_exceeded = on_exceeded
        self._cond = threading.Condition()
        self._waits: list[CommitWait] = []
        self._thread: threading.Thread | None = None
        self._closed = False

    @contextmanager
    def commit(self, conn: Conn, *, report: bool = True) -> Iterator[CommitWait]:
        """Watches the COMMIT sent inside the block; report: tell on_exceeded when it overruns."""
        now = time.monotonic()
        wait = CommitWait(conn, now, now + self.bound_s, report, conn.info.backend_pid)
        conn.add_notice_handler(wait.note)
        if self.bound_s > 0:
            with self._cond:
                self._waits.append(wait)
                if self._thread is None and not self._closed:
                    self._thread = threading.Thread(
                        target=self._run, name="pg-commit-watch", daemon=True
                    )
                    self._thread.start()
                self._cond.notify()
        try:
            yield wait
        finally:
            with self._cond:
                if wait in self._waits:
                    self._waits.remove(wait)
            conn.remove_notice_handler(wait.note)

    def exceeded(self, wait: CommitWait) -> StoreCommitWaitExceeded:
        """Returns the error a caller gets for a COMMIT whose outcome is unknown."""
        waited = time.monotonic() - wait.began
        said = "; ".join(wait.warnings) or "no answer yet"
        return StoreCommitWaitExceeded(
            f"PostgreSQL: the COMMIT waited {waited:.1f} s (--pg-commit-wait-bound"
            f" {self.bound_s:g} s), most likely for its synchronous standby, and was"
            f" cancelled (the server said: {said}); it may be committed on the primary only,"
            " so it is not acknowledged: resend the same events (their ids make that safe)",
            retry_after_s=self._retry_after_s,
        )

    def stalled(self) -> StoreCommitWaitExceeded | None:
        """Returns the fault while an append's COMMIT is past the bound and not yet returned."""
        with self._cond:
            overdue = [w for w in self._waits if w.cancelled and w.report]
        return self.exceeded(overdue[0]) if overdue else None

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                due = [w for w in self._waits if not w.cancelled and w.deadline <= now]
                for wait in due:
                    wait.cancelled = True
                pending = [w.deadline for w in self._waits if not w.cancelled]
                if not due:
                    self._cond.wait(min(pending) - now if pending else None)
                    continue
            for wait in due:
                try:
                    self._cancel(wait)
                except Exception:  # the watch must outlive one failed cancel
                    log.exception("store_commit_cancel_failed", backend_pid=wait.backend_pid)

    def _cancel(self, wait: CommitWait) -> None:
        waited = time.monotonic() - wait.began
        log.error(
            "store_commit_wait_exceeded",
            waited_s=round(waited, 3),
            bound_s=self.bound_s,
            backend_pid=wait.backend_pid,
            probe=not wait.report,
            # What PostgreSQL's pg_stat_activity shows for it: wait_event SyncRep while a
            # synchronous standby is missing, WALSync/WALWrite while the local disk stalls.
            waits_for="synchronous replication or the WAL flush",
        )
        if wait.report:
            self._on_exceeded(self.exceeded(wait))
        try:
            wait.conn.cancel_safe(timeout=_CANCEL_TIMEOUT_S)
        except (psycopg.Error, OSError) as exc:
            # The server is out of reach (a partition): TCP's keepalives would end the COMMIT
            # only after 11 s, past a client's deadline. Shutting the socket down makes the
            # blocked read fail now, and the COMMIT's caller is answered (a lost connection).
            log.warning("store_commit_cancel_failed", error=str(exc), action="socket_shutdown")
            self._shutdown(wait)

    def _shutdown(self, wait: CommitWait) -> None:
        """Shuts down the COMMIT's socket under its owner's blocked read (never closes its fd)."""
        with self._cond:
            # The owner closes the connection only after its COMMIT left the watch: while
            # the wait is here, the descriptor is still this connection's, not a reused one.
            if wait not in self._waits:
                return
            try:
                fd = os.dup(wait.conn.pgconn.socket)
            except (psycopg.Error, OSError):
                return  # closed by the server meanwhile: the COMMIT is answered already
        try:
            dup = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)
            raise
        # ENOTCONN: the connection ended meanwhile, which is the aim.
        with dup, contextlib.suppress(OSError):
            dup.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Stops the watch thread (COMMITs under way are no longer watched)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
