"""The PostgreSQL event store: one database shared by several stateless server replicas.

Concurrency model (what makes replicas safe):

* Appends to one run are serialized by a row lock on the run's head
  (``SELECT ... FOR UPDATE`` on ``runs``), held until COMMIT; the Ledger takes
  the locks of all of a group's runs first, in sorted order, then reads. A new
  run is inserted with ``ON CONFLICT DO NOTHING``; losing that race raises
  ConcurrentWriteError and the Ledger retries the group, which then finds and
  locks the winner's row. So does any sign, later in the group, of rows for a
  run that was missing (and so unlocked) when the group began: the group's
  reads would otherwise come from two moments. Appends to different runs touch
  different rows and never wait for each other.
* A tailer never skips an event that commits late. A PostgreSQL sequence hands
  out numbers at INSERT time, not at COMMIT, so across *all* runs a lower
  ``seq`` can become visible after a higher one. Every event read is per run,
  though, and within a run that cannot happen: a writer draws a run's sequence
  numbers only while holding that run's row lock (a job's numbers are reserved
  in one round trip after its locks are taken, and leftovers are dropped at the
  next lock), and the lock is released only
  after the commit is visible to every new snapshot, so the next writer of the
  run draws strictly higher numbers and commits strictly later. We chose this
  over a global commit-order position because the latter needs a lock held
  across every COMMIT (its WAL flush), which would serialize all replicas; the
  run lock costs nothing extra. As a second line of defence, ``list_events``
  (the tail and page reader) checks ``run_seq``, which the hash chain numbers
  densely per run, and returns only the gap-free prefix of what it read.
* ``event_id`` is unique in the database. A duplicate inserted by another
  replica at the same moment surfaces as a unique violation, translated to
  ConcurrentWriteError; the retried group sees the committed row and answers
  DUPLICATE with the original sequence.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any, Final
from urllib.parse import unquote

import psycopg

from ledger_server.store import postgres_archive
from ledger_server.store import postgres_sql as q
from ledger_server.store.base import (
    PROBE_RETRY_S,
    RunRow,
    ShardRow,
    StoredEvent,
    StoreError,
    TokenRow,
    Tombstone,
)
from ledger_server.store.pg_pool import PgPool
from ledger_server.store.postgres_tx import Conn, PgReadView, PgWriteTx, edge
from ledger_server.store.urls import redact_url, split_libpq

__all__ = ["DEFAULT_COMMIT_WAIT_BOUND_S", "PostgresStore", "split_url"]

# Query parameters the store reads itself (libpq would refuse them). pool_timeout: how long
# a call waits for a free connection; write_timeout: the statement_timeout of each statement
# of an append's transaction but its COMMIT (see PostgresStore.write).
POOL_OPTIONS: Final = {
    "pool_min_size": 1,
    "pool_max_size": 16,
    "pool_timeout": 5.0,
    "write_timeout": 4.0,
}
# How long a COMMIT may wait (for its synchronous standby) before it is cancelled and not
# acknowledged: under the SDK's 10 s call deadline, so a caller is answered UNAVAILABLE
# rather than DEADLINE_EXCEEDED; far above a healthy COMMIT (milliseconds).
DEFAULT_COMMIT_WAIT_BOUND_S: Final = 5.0
# libpq's connect_timeout applies to each host of a multi-host URL in turn, so with the old
# primary's host silently gone a connection takes up to this long per host it tries first.
CONNECT_TIMEOUT_S: Final = 2
# libpq settings the store adds when the URL has none of its own. A server whose host
# vanishes without a reset (a dead machine, a partition) leaves a session waiting on a
# socket that never answers: statement_timeout is the server's and cannot end it, so the
# kernel must. Unacknowledged data ends it after tcp_user_timeout (ms), an idle wait (a
# query sent, no answer) after keepalives_idle + interval x count seconds.
LIBPQ_DEFAULTS: Final = {
    "connect_timeout": str(CONNECT_TIMEOUT_S),
    "tcp_user_timeout": "5000",
    "keepalives_idle": "5",
    "keepalives_interval": "2",
    "keepalives_count": "3",
}


def split_url(url: str) -> tuple[str, dict[str, float]]:
    """Returns the libpq URL without the store's own pool_* parameters, and those parameters.

    The other parameters are kept byte for byte (re-encoding turned the space of
    options=-c%20x=y into a "+" libpq does not decode), and the query is found the
    way libpq finds it: after the user information, so a "#" or "?" in a password
    stays part of it.
    """
    parts = split_libpq(url)
    options: dict[str, float] = dict(POOL_OPTIONS)
    kept: list[str] = []
    for item in filter(None, (parts.query or "").split("&")):
        key, _, value = item.partition("=")
        if key in POOL_OPTIONS:
            options[key] = float(unquote(value))
        else:
            kept.append(item)
    given = {item.partition("=")[0] for item in kept}
    kept += [f"{key}={value}" for key, value in LIBPQ_DEFAULTS.items() if key not in given]
    return parts._replace(query="&".join(kept)).join(), options


def _configure(conn: Conn, *, idle_ms: int) -> None:
    # on: a COMMIT returns only after its WAL is flushed, so an acknowledged append survives a
    # database crash. The idle timeout frees the run locks of a replica gone silent
    # mid-group (hung, or cut off from the database: the server keeps a session whose
    # client vanished without a reset for hours), so the other replicas' appends to those
    # runs wait no longer than a statement may: a replica's group never idles between its
    # statements longer than one of them may run (write_timeout), only folds in between.
    conn.execute("SET synchronous_commit = on")
    conn.execute(f"SET idle_in_transaction_session_timeout = {idle_ms}")
    # That timer runs only once the server has answered a whole request; a replica cut
    # off mid-request (a pipeline without its Sync, half a message) leaves the session
    # reading, its locks held, until TCP says the client is gone. The server's own
    # keepalives, as the client's (LIBPQ_DEFAULTS), say it within 5 + 2 x 3 = 11 s, not
    # the hours of the kernel's default. (Ignored on a Unix socket.)
    for name in ("keepalives_idle", "keepalives_interval", "keepalives_count"):
        conn.execute(f"SET tcp_{name} = {int(LIBPQ_DEFAULTS[name])}")
    conn.execute("SET application_name = 'shardledger'")


def _configure_read_only(conn: Conn, *, idle_ms: int) -> None:
    # Every transaction of the session is READ ONLY: PostgreSQL itself refuses any write
    # (SQLSTATE 25006), whatever statement reaches it.
    _configure(conn, idle_ms=idle_ms)
    conn.execute("SET default_transaction_read_only = on")


class PostgresStore:
    """An event store in one PostgreSQL database, safe for several server processes."""

    # Other replicas write the same rows, so nothing may be kept between transactions.
    exclusive_writer = False

    def __init__(
        self,
        url: str,
        *,
        read_only: bool = False,
        commit_wait_bound_s: float = DEFAULT_COMMIT_WAIT_BOUND_S,
    ) -> None:
        """Opens the database (migrating it), or with read_only in read-only sessions.

        read_only never migrates: a database without the ledger's tables, or of an
        older schema, raises StoreError. A COMMIT still waiting after commit_wait_bound_s
        (0: no bound) is cancelled and not acknowledged (pg_commit.py).
        """
        self.url = url
        self.read_only = read_only
        conninfo, options = split_url(url)
        self._write_timeout_ms = int(options["write_timeout"] * 1000)
        self._pool = PgPool(
            conninfo,
            min_size=int(options["pool_min_size"]),
            max_size=int(options["pool_max_size"]),
            timeout=options["pool_timeout"],
            configure=partial(
                _configure_read_only if read_only else _configure, idle_ms=self._write_timeout_ms
            ),
            probe_timeout_ms=int(CONNECT_TIMEOUT_S * 1000),
            retry_after_s=PROBE_RETRY_S,
            commit_wait_bound_s=commit_wait_bound_s,
        )
        self._pool.open()
        try:
            if read_only:
                self._require_current_schema()
            else:
                self._migrate()
        except BaseException:
            self._pool.close()
            raise
        self._view = PgReadView(self._pool)

    def _migrate(self) -> None:
        with edge(), self._pool.connection() as conn:
            # The usual case, and the only one a least-privilege server role can pass: the
            # schema is current, so no DDL (and no CREATE privilege) is needed.
            if conn.execute(q.SQL_TABLE_EXISTS).fetchone() == (True,):
                done = {row[0] for row in conn.execute(q.SQL_APPLIED)}
                if done >= {version for version, _, _ in q.MIGRATIONS}:
                    return
            for version, name, statements in q.MIGRATIONS:
                with conn.transaction():
                    # Replicas starting together queue here; the loser sees the record and skips.
                    conn.execute(q.SQL_MIGRATION_LOCK, q.MIGRATION_LOCK)
                    conn.execute(q.SQL_CREATE_MIGRATIONS)
                    done = {row[0] for row in conn.execute(q.SQL_APPLIED)}
                    if version in done:
                        continue
                    for statement in statements:
                        conn.execute(statement)
                    conn.execute(q.SQL_RECORD_MIGRATION, (version, name, int(time.time() * 1e6)))

    def _require_current_schema(self) -> None:
        with edge(), self._pool.connection() as conn:
            if conn.execute(q.SQL_TABLE_EXISTS).fetchone() != (True,):
                raise StoreError(
                    f"no ledger in {redact_url(self.url)}: a database without the ledger's tables"
                )
            done = {row[0] for row in conn.execute(q.SQL_APPLIED)}
        if not done >= {version for version, _, _ in q.MIGRATIONS}:
            raise StoreError(
                f"{redact_url(self.url)} has schema version {max(done, default=0)}, older than"
                f" this release's {q.MIGRATIONS[-1][0]}, and a ledger read with --db is never"
                " migrated: run `shardledger db migrate --db URL` first"
            )

    def applied_migrations(self) -> list[tuple[int, str, int]]:
        """Returns (version, name, applied_us) of every applied migration."""
        with edge(), self._pool.connection() as conn:
            return [(int(v), str(n), int(t)) for v, n, t in conn.execute(q.SQL_APPLIED)]

    def schema_version(self) -> int:
        """Returns the highest applied migration."""
        return max((v for v, _, _ in self.applied_migrations()), default=0)

    def claim_writer(self) -> None:
        """Replicas share the database: there is no single writer to claim."""

    @contextmanager
    def write(self) -> Iterator[PgWriteTx]:
        """Opens the write transaction; it commits durably when the context exits cleanly."""
        with edge():
            pool, conn = self._pool.checkout()
        try:
            with edge(), conn.pipeline():
                conn.execute("BEGIN")
                # Bounds every statement below (a lock wait, a server that stopped answering)
                # under the callers' deadlines.
                conn.execute(f"SET LOCAL statement_timeout = {self._write_timeout_ms}")
            tx = PgWriteTx(conn)
            try:
                yield tx
                with edge():
                    tx.flush()
                    # statement_timeout cannot bound the COMMIT's wait for the synchronous
                    # standby (PostgreSQL disarms it first); the watch does, and a COMMIT it
                    # cancelled, or that anyone else cancelled, is never acknowledged.
                    with self._pool.watch.commit(conn) as wait:
                        conn.execute("COMMIT")
                if wait.unknown:
                    conn.close()  # a late cancel must not reach this session's next statement
                    raise self._pool.watch.exceeded(wait)
            except BaseException:
                if (
                    not conn.closed
                    and conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE
                ):
                    # If the connection is gone, the server has rolled back on its own.
                    with contextlib.suppress(psycopg.Error):
                        conn.execute("ROLLBACK")
                raise
        finally:
            self._pool.checkin(pool, conn)

    def read(self) -> PgReadView:
        """Returns the read view (thread-safe: each query borrows a pooled connection)."""
        return self._view

    def integrity_check(self) -> str:
        """Returns "ok", or what is wrong with the schema and its immutability triggers."""
        problems = []
        if self.schema_version() != q.MIGRATIONS[-1][0]:
            problems.append(f"schema version {self.schema_version()} is not current")
        with edge(), self._pool.connection() as conn:
            triggers = {str(name): str(state) for name, state in conn.execute(q.SQL_TRIGGERS)}
        for name in q.EXPECTED_TRIGGERS:
            if triggers.get(name) in (None, "D"):
                problems.append(f"trigger {name} is missing or disabled")
        return "\n".join(problems) or "ok"

    def execute_raw(self, sql: str, params: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        """Runs raw SQL in its own transaction (tests and maintenance only)."""
        with edge(), self._pool.connection() as conn, conn.transaction():
            cur = conn.execute(sql, params)
            return list(cur.fetchall()) if cur.description else []

    def create_token(self, token: TokenRow) -> None:
        """Stores a new token (its secret only as a hash)."""
        self.execute_raw(
            q.SQL_CREATE_TOKEN,
            (
                *(token.token_id, token.namespace, token.role, token.run_prefix),
                *(token.secret_hash, token.description, token.created_us),
                *(token.expires_us, token.revoked_us),
            ),
        )

    def get_token(self, token_id: str) -> TokenRow | None:
        """Returns the token with this id, or None."""
        rows = self._view.rows(q.SQL_GET_TOKEN, (token_id,))
        return TokenRow(*rows[0]) if rows else None

    def list_tokens(self) -> list[TokenRow]:
        """Returns every token, oldest first."""
        return [TokenRow(*r) for r in self._view.rows(q.SQL_LIST_TOKENS, ())]

    def revoke_token(self, token_id: str, *, now_us: int) -> bool:
        """Marks a token revoked; returns False when there is no such live token."""
        with edge(), self._pool.connection() as conn:
            return conn.execute(q.SQL_REVOKE_TOKEN, (now_us, token_id)).rowcount == 1

    def import_run(
        self,
        run: RunRow,
        events: Iterable[StoredEvent],
        projections: Callable[[], tuple[Collection[ShardRow], dict[str, int]]],
    ) -> None:
        """Writes one run verbatim (keys, rows, hashes) and its projections in one transaction.

        ``projections`` is called after ``events`` is exhausted, so a caller can fold the
        stream while it is copied instead of holding the run in memory.
        """
        with edge(), self._pool.connection() as conn, conn.transaction():
            conn.execute(
                q.SQL_IMPORT_RUN,
                (
                    *(run.run_pk, run.namespace, run.run_id, run.event_count, run.head_hash),
                    *(run.created_us, run.updated_us),
                ),
            )
            with conn.cursor().copy(q.SQL_COPY_EVENTS) as copy:
                for ev in events:
                    copy.write_row(
                        (ev.sequence, ev.run_pk, ev.run_sequence, ev.event_id, ev.row, ev.row_hash)
                    )
            shards, counters = projections()
            opens = []
            with conn.cursor().copy(q.SQL_COPY_SHARDS) as copy:
                for s in shards:
                    copy.write_row(
                        (
                            *(run.run_pk, s.shard_id, s.plan_index, s.state, s.detail),
                            *(s.deadline_us, s.plan_line, s.record),
                        )
                    )
                    if s.open is not None:
                        opens.append((run.run_pk, s.shard_id, *s.open))
            with conn.cursor().copy(q.SQL_COPY_OPEN) as copy:
                for row in opens:
                    copy.write_row(row)
            with conn.cursor().copy(q.SQL_COPY_COUNTERS) as copy:
                for key, n in sorted(counters.items()):
                    copy.write_row((run.run_pk, key, n))

    def archive_run(self, tombstone: Tombstone, *, before_commit: Callable[[], None]) -> None:
        """Writes the run's tombstone in one short transaction (postgres_archive)."""
        with self.write() as tx:
            postgres_archive.archive(tx, tombstone, before_commit)

    def purge_archived(self, run_pk: int, *, limit: int) -> int:
        """Deletes up to limit dead rows of an archived run, in one transaction; returns how many."""
        with self.write() as tx:
            return postgres_archive.purge(tx, run_pk, limit)

    def restore_run(
        self,
        tombstone: Tombstone,
        events: Iterable[StoredEvent],
        projections: Callable[[], tuple[Collection[ShardRow], dict[str, int]]],
    ) -> None:
        """Puts an archived run's rows back and drops its tombstone in one transaction."""
        with self.write() as tx:
            postgres_archive.restore(tx, tombstone, events, projections)

    def sync_sequences(self) -> None:
        """Moves the id sequences past the highest imported keys."""
        with edge(), self._pool.connection() as conn, conn.transaction():
            for statement in q.SQL_SYNC_SEQUENCES:
                conn.execute(statement)

    def probe(self) -> StoreError | None:
        """Checks on the probe's own connection that a write could commit now (see pg_pool)."""
        if self.read_only:
            return None  # no write is ever made; a read meets an outage itself
        return self._pool.probe()

    def on_fault(self, wake: Callable[[], None]) -> None:
        """Calls wake (the server's probe) whenever a call meets a dead connection."""
        self._pool.on_fault = wake

    def close(self) -> None:
        """Closes every connection."""
        self._pool.close()
