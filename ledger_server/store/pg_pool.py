"""The PostgreSQL connection source: a pool that fails fast while no writable primary answers.

psycopg_pool alone lets the pool's state at the moment of a crash decide when a
replica writes again (read in psycopg_pool 3.3's pool.py and base.py):

* a connection that fails its check at checkout is discarded, and the caller sleeps
  with exponential backoff (1 s, 2 s, 4 s, ...) before it looks at the next one;
* each discarded connection is replaced by a background attempt that backs off the
  same way (attempts at 0, 1, 3, 7, 15 s, ...) for up to ``reconnect_timeout`` (5
  minutes), and only one attempt may grow the pool at a time;
* a caller waiting for a connection waits its whole timeout, whatever happens meanwhile.

A failover campaign saw no append acknowledged for 12 s after a promotion, and calls
that waited in the pool until their deadline. Here instead:

* a probe (``store_health.StoreProbe``: every interval, and at once when a call meets a
  dead connection)
  checks on its own connection that a session can write; libpq resolves the multi-host
  URL and ``target_session_attrs`` afresh on every attempt, so it finds the new primary;
* while the probe fails the pool is closed (its waiters fail at once) and every call is
  refused with StoreUnreachable before touching the network;
* when the probe succeeds again a fresh pool replaces the closed one, so no backoff or
  attempt left over from the outage decides when writes resume;
* a checkout checks the connection itself and moves to the next at once, never sleeping.

The probe writes: a transactional WAL record (``pg_logical_emit_message``, no table and
no row to bloat) committed with the session's ``synchronous_commit = on``, so it passes
only where an append's COMMIT would: the session is not read-only, the WAL can be written
and flushed, and the synchronous standby confirms it within ``--pg-commit-wait-bound``
(pg_commit.py). ``pg_is_in_recovery()`` alone says SERVING on a primary whose standby is
gone, while every COMMIT on it waits forever. A COMMIT of an append that overruns the
bound closes the pool at once, as a failed probe does.

Without a probe (the CLI's direct database commands) nothing is ever refused early.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Final

import psycopg
from psycopg_pool import ConnectionPool, PoolClosed

from ledger_server.store.base import (
    StoreCommitWaitExceeded,
    StoreError,
    StoreReadOnly,
    StoreUnreachable,
)
from ledger_server.store.pg_commit import CommitWatch
from ledger_server.store.postgres_tx import Conn, edge, translate

__all__ = ["PgPool"]

# One round trip that says whether this session could write: not a standby in recovery,
# and not read-only by default_transaction_read_only (what target_session_attrs checks).
SQL_PROBE: Final = "SELECT pg_is_in_recovery(), current_setting('transaction_read_only')"
# The probe's write: one WAL record in a transaction (so its COMMIT waits for the synchronous
# standby as an append's does), readable by any role, leaving no row behind. Logical
# decoding consumers, if any, see it with this prefix.
SQL_PROBE_WRITE: Final = "SELECT pg_logical_emit_message(true, 'shardledger-probe', '')"
# How long a closed pool's threads may take to stop before the close stops waiting for them.
_CLOSE_WAIT_S: Final = 0.1


class PgPool:
    """A psycopg pool that a probe closes while the database is unreachable and renews after."""

    def __init__(
        self,
        conninfo: str,
        *,
        min_size: int,
        max_size: int,
        timeout: float,
        configure: Callable[[Conn], None],
        probe_timeout_ms: int,
        retry_after_s: float,
        commit_wait_bound_s: float,
    ) -> None:
        self._conninfo = conninfo
        self._sizes = (min_size, max_size)
        self._timeout = timeout
        self._configure = configure
        self._probe_timeout_ms = probe_timeout_ms
        self._retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._probe_lock = threading.Lock()
        self._pool: ConnectionPool[Conn] | None = None
        self._down: StoreError | None = None  # the probe's last failure while it lasts
        self._probe_conn: Conn | None = None
        self._closed = False
        # Wakes the server's probe when a call meets a dead connection (None: nobody probes).
        self.on_fault: Callable[[], None] | None = None
        self.watch = CommitWatch(
            commit_wait_bound_s, retry_after_s=retry_after_s, on_exceeded=self._exceeded
        )

    def _new_pool(self) -> ConnectionPool[Conn]:
        return ConnectionPool(
            self._conninfo,
            min_size=self._sizes[0],
            max_size=self._sizes[1],
            timeout=self._timeout,
            kwargs={"autocommit": True},
            configure=self._configure,
            # No check here: checkout() checks, without psycopg_pool's backoff sleeps.
            name="shardledger",
            open=False,
        )

    def open(self) -> None:
        """Opens the first pool and waits for its first connection (StoreError if none)."""
        pool = self._new_pool()
        try:
            with edge():
                pool.open(wait=True, timeout=self._timeout)
        except BaseException:
            pool.close()
            raise
        self._pool = pool

    def _live(self) -> ConnectionPool[Conn]:
        with self._lock:
            if self._closed:
                raise StoreError("the store is closed")
            if self._down is not None or self._pool is None:
                raise StoreUnreachable(
                    f"no writable PostgreSQL primary: {self._down}",
                    retry_after_s=self._retry_after_s,
                )
            return self._pool

    def checkout(self) -> tuple[ConnectionPool[Conn], Conn]:
        """Returns a checked connection and its pool; StoreError when none is to be had."""
        deadline = time.monotonic() + self._timeout
        while True:
            pool = self._live()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreError(f"no PostgreSQL connection within pool_timeout {self._timeout} s")
            try:
                conn = pool.getconn(timeout=remaining)
            except PoolClosed:
                continue  # closed or replaced by the probe meanwhile: _live() says which
            except psycopg.Error as exc:
                self._fault()
                raise translate(exc) from exc
            try:
                ConnectionPool.check_connection(conn)
            except psycopg.Error:
                # Dead with its server (a crash, a failover): the pool discards it and starts
                # a replacement, and the next idle one is tried at once.
                pool.putconn(conn)
                self._fault()
                continue
            return pool, conn

    def checkin(self, pool: ConnectionPool[Conn], conn: Conn) -> None:
        """Gives a connection back to the pool it came from (a broken one is discarded)."""
        if conn.broken:
            self._fault()
        pool.putconn(conn)

    def _fault(self) -> None:
        if self.on_fault is not None:
            self.on_fault()

    def _exceeded(self, error: StoreCommitWaitExceeded) -> None:
        # An append's COMMIT overran the bound: the calls behind it are refused at once
        # from now on (not after the cancelled COMMIT returns), and the probe looks now.
        # Without a probe nothing would bring the pool back: each call meets the bound.
        if self.on_fault is None:
            return
        self._go_down(error)
        self._fault()

    @contextmanager
    def connection(self) -> Iterator[Conn]:
        """Lends a checked connection for the block, as ConnectionPool.connection() does."""
        pool, conn = self.checkout()
        try:
            with conn:
                yield conn
        finally:
            self.checkin(pool, conn)

    def probe(self) -> StoreError | None:
        """Checks that a session can write now; closes or renews the pool to match."""
        with self._probe_lock:
            stalled = self.watch.stalled()
            if stalled is not None:
                # The cancel has not reached the server yet (it may be out of reach).
                self._go_down(stalled)
                return stalled
            error = self._check()
            if isinstance(error, StoreUnreachable):
                self._go_down(error)
            elif error is None:
                error = self._go_up()
            return error

    def _check(self) -> StoreError | None:
        for stale in (self._probe_conn is not None, False):
            try:
                if self._probe_conn is None:
                    conn = psycopg.connect(self._conninfo, autocommit=True)
                    self._probe_conn = conn
                    conn.execute(f"SET statement_timeout = {int(self._probe_timeout_ms)}")
                    conn.execute("SET application_name = 'shardledger-probe'")
                    # As an append's session (postgres._configure), whatever the server's default.
                    conn.execute("SET synchronous_commit = on")
                row = self._probe_conn.execute(SQL_PROBE).fetchone()
                if row is not None and not row[0] and row[1] == "off":
                    return self._write(self._probe_conn)
            except psycopg.Error as exc:
                self._close_probe()
                if stale:
                    continue  # the probe's own connection died: one fresh attempt decides
                message = exc.diag.message_primary or str(exc).strip()
                return StoreUnreachable(f"PostgreSQL: {message}", retry_after_s=self._retry_after_s)
            return StoreReadOnly(
                "PostgreSQL: the session the URL reached cannot write (a standby in recovery,"
                " or default_transaction_read_only); add target_session_attrs=read-write"
                " and list the primary's hosts"
            )
        raise AssertionError("unreachable")

    def _write(self, conn: Conn) -> StoreError | None:
        """Commits the probe's write; the fault when its COMMIT overran the bound."""
        conn.execute("BEGIN")
        conn.execute(SQL_PROBE_WRITE)
        with self.watch.commit(conn, report=False) as wait:
            conn.execute("COMMIT")
        if not wait.unknown:
            return None
        self._close_probe()  # a late cancel must not reach the next probe
        return self.watch.exceeded(wait)

    def _go_down(self, error: StoreError) -> None:
        with self._lock:
            self._down = error
            pool, self._pool = self._pool, None
        if pool is not None:
            self._close_later(pool)

    def _go_up(self) -> StoreError | None:
        with self._lock:
            if self._closed or (self._down is None and self._pool is not None):
                return None
        pool = self._new_pool()
        try:
            with edge():
                pool.open(wait=True, timeout=self._timeout)
        except StoreError as exc:
            pool.close()
            error = StoreUnreachable(str(exc), retry_after_s=self._retry_after_s)
            self._go_down(error)
            return error
        with self._lock:
            if self._closed:
                old: ConnectionPool[Conn] | None = pool
            else:
                old, self._pool, self._down = self._pool, pool, None
        if old is not None:
            self._close_later(old)
        return None

    def _close_later(self, pool: ConnectionPool[Conn]) -> None:
        # close() fails the pool's waiting callers only after its threads stop, and a thread
        # may be inside a connect attempt: close on the side, so the probe never waits.
        threading.Thread(
            target=pool.close, kwargs={"timeout": _CLOSE_WAIT_S}, name="pg-pool-close", daemon=True
        ).start()

    def _close_probe(self) -> None:
        conn, self._probe_conn = self._probe_conn, None
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Closes the pool and the probe's connection."""
        self.watch.close()
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
        with self._probe_lock:
            self._close_probe()
