"""The PostgreSQL write transaction, read view and driver-error edge (see postgres.py)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Final, Protocol

import psycopg
from psycopg import errors as pg_errors
from psycopg.rows import TupleRow

from ledger_server.states import RESUME_STATES
from ledger_server.store import postgres_sql as q
from ledger_server.store.base import (
    PROBE_RETRY_S,
    ConcurrentWriteError,
    ImmutableRowError,
    OpenRow,
    RunRow,
    ShardRow,
    StaleOpen,
    StoreCorrupt,
    StoredEvent,
    StoredShard,
    StoreError,
    StoreFull,
    StoreIOError,
    StoreReadOnly,
    Tombstone,
)

Conn = psycopg.Connection[TupleRow]

_PAGE: Final = 2000
_RETRYABLE: Final = (
    pg_errors.UniqueViolation,
    pg_errors.DeadlockDetected,
    pg_errors.SerializationFailure,
)


def translate(exc: psycopg.Error) -> StoreError:
    """Returns the StoreError for a driver error."""
    # Driver errors are translated at this one edge; callers see StoreError only.
    message = exc.diag.message_primary or str(exc).strip()
    if exc.sqlstate == q.IMMUTABLE_SQLSTATE:
        return ImmutableRowError(message)
    if isinstance(exc, _RETRYABLE):
        return ConcurrentWriteError(f"{type(exc).__name__}: {message}")
    kind = _KINDS.get(exc.sqlstate or "")
    if kind is not None:
        cls, advice = kind
        return cls(f"PostgreSQL: {message} ({exc.sqlstate}); {advice}")
    error = StoreError(f"{type(exc).__name__}: {message}")
    if isinstance(exc, psycopg.OperationalError):
        # A lost connection, a failed connect, a pool timeout: the probe retries this often.
        error.retry_after_s = PROBE_RETRY_S
    return error


# SQLSTATEs that name a storage fault, with what the operator does about it.
_KINDS: Final[dict[str, tuple[type[StoreError], str]]] = {
    "53100": (StoreFull, "free space on the database server's disk; writes resume by themselves"),
    "25006": (
        StoreReadOnly,
        "the database is a read-only standby (or default_transaction_read_only is on):"
        " point --database-url at the primary",
    ),
    "58030": (StoreIOError, "check the database server's disk and its log"),
    "XX001": (StoreCorrupt, "restore the database from a backup (docs/operations.md)"),
    "XX002": (StoreCorrupt, "REINDEX the damaged index, or restore from a backup"),
}


@contextmanager
def edge() -> Iterator[None]:
    """Translates driver errors raised inside the block."""
    try:
        yield
    except psycopg.Error as exc:  # PoolTimeout and PoolClosed are OperationalErrors too
        raise translate(exc) from exc


def _run(row: Sequence[Any]) -> RunRow:
    pk, namespace, run_id, count, head, created, updated, archived = row
    return RunRow(pk, namespace, run_id, count, head, created, updated, bool(archived))


def tombstone_of(row: Sequence[Any]) -> Tombstone:
    """Returns the tombstone in a run_archives row."""
    values = list(row)
    values[4] = bytes(values[4])
    return Tombstone(*values)


def _event(row: Sequence[Any]) -> StoredEvent:
    return StoredEvent(*row)


class PgWriteTx:
    """The group-commit transaction: reads go out at once, writes are buffered and pipelined."""

    def __init__(self, conn: Conn) -> None:
        self.conn = conn
        self._savepoints = 0
        self._events: list[tuple[Any, ...]] = []
        self._shards: dict[tuple[int, str], tuple[Any, ...]] = {}
        # Heartbeat rows to write, key -> (deadline, us, step), and those to delete.
        self._beats: dict[tuple[int, str], tuple[Any, ...]] = {}
        self._cleared: set[tuple[int, str]] = set()
        # Open attempt rows to write, those to delete, and (deadline, seen) a heartbeat moved.
        self._opens: dict[tuple[int, str], OpenRow] = {}
        self._closed: set[tuple[int, str]] = set()
        self._open_beats: dict[tuple[int, str], tuple[Any, ...]] = {}
        # Counter deltas are sums, so the deltas of many shards fold into one upsert per key.
        self._counters: dict[tuple[int, str], int] = {}
        self._heads: dict[int, tuple[Any, ...]] = {}
        self._reserved: list[int] = []
        self._hint = 1
        # Runs this transaction saw missing (so holds no lock on), and runs it created itself.
        self._absent: set[tuple[str, str]] = set()
        self._created: set[tuple[str, str]] = set()

    def flush(self) -> None:
        """Sends the buffered writes in one pipeline: one round trip, one statement per table."""
        if not (
            self._events
            or self._shards
            or self._beats
            or self._counters
            or self._heads
            or self._closed
            or self._open_beats
        ):
            return
        counters = [(pk, key, n) for (pk, key), n in self._counters.items() if n]
        bulk = [
            (q.SQL_INSERT_EVENTS, self._events),
            (q.SQL_SAVE_SHARDS, list(self._shards.values())),
            (q.SQL_CLEAR_BEATS, list(self._cleared)),
            (q.SQL_SAVE_BEATS, [(*k, *t) for k, t in self._beats.items()]),
            (q.SQL_ADD_COUNTERS, counters),
            (q.SQL_CLEAR_OPEN, list(self._closed)),
            (q.SQL_SAVE_OPEN, [(*k, *o) for k, o in self._opens.items()]),
            (q.SQL_TOUCH_OPEN, [(*k, *t) for k, t in self._open_beats.items()]),
        ]
        heads = list(self._heads.values())
        self.discard()
        # prepare=False: when one statement of a pipeline fails (a unique violation from a
        # racing replica), the server skips the rest, but psycopg would still count a skipped
        # PREPARE as done and later name a statement that does not exist.
        with self.conn.pipeline(), self.conn.cursor() as cur:
            for sql, rows in bulk:
                if rows:
                    columns = [list(column) for column in zip(*rows, strict=True)]
                    cur.execute(sql, columns, prepare=False)
            for head in heads:
                cur.execute(q.SQL_UPDATE_RUN, head, prepare=False)

    def discard(self) -> None:
        """Drops the buffered writes (their savepoint is being rolled back)."""
        self._events, self._shards, self._counters, self._heads = [], {}, {}, {}
        self._beats, self._cleared = {}, set()
        self._opens, self._closed, self._open_beats = {}, set(), {}

    def _query(self, sql: str, params: Any) -> list[TupleRow]:
        with edge():
            self.flush()
            return self.conn.execute(sql, params).fetchall()

    def _raced(self, key: tuple[str, str]) -> ConcurrentWriteError:
        # The Ledger locks every existing run of the group before reading anything else, so
        # its reads agree with one another. A run that was missing then has no lock: if another
        # writer's rows for it show up later, this group's reads are from two moments.
        return ConcurrentWriteError(
            f"run {key[1]} in namespace {key[0]} was created by another writer meanwhile"
        )

    @contextmanager
    def savepoint(self) -> Iterator[None]:
        self._savepoints += 1
        name = f"sp{self._savepoints}"
        created = set(self._created)
        with edge():
            self.flush()
            self.conn.execute(f"SAVEPOINT {name}")
        try:
            yield
            with edge():
                self.flush()
        except BaseException:
            self.discard()
            self._reserved.clear()
            self._created = created  # runs created in here are rolled back with it
            with edge():
                self.conn.execute(f"ROLLBACK TO SAVEPOINT {name}")
                self.conn.execute(f"RELEASE SAVEPOINT {name}")
            raise
        self._reserved.clear()
        with edge():
            self.conn.execute(f"RELEASE SAVEPOINT {name}")

    def get_run(self, namespace: str, run_id: str) -> RunRow | None:
        # Numbers reserved before this lock must not number this run's rows (see module doc).
        self._reserved.clear()
        key = (namespace, run_id)
        rows = self._query(q.SQL_LOCK_RUN, key)
        if not rows:
            self._absent.add(key)
            return None
        if key in self._absent and key not in self._created:
            raise self._raced(key)
        return _run(rows[0])

    def create_run(self, namespace: str, run_id: str, *, now_us: int, genesis: bytes) -> RunRow:
        self._reserved.clear()
        rows = self._query(q.SQL_CREATE_RUN, (namespace, run_id, genesis, now_us, now_us))
        if not rows:
            raise self._raced((namespace, run_id))
        self._created.add((namespace, run_id))
        return RunRow(int(rows[0][0]), namespace, run_id, 0, genesis, now_us, now_us)

    def find_events(self, event_ids: Sequence[str]) -> dict[str, StoredEvent]:
        ids = list(dict.fromkeys(event_ids))
        # An upper bound on the inserts that follow, so one round trip reserves their numbers.
        self._hint = max(len(ids), 1)
        found = {}
        for row in self._query(q.SQL_FIND_EVENTS, (ids,)):
            key = (row[6], row[7])
            if key in self._absent and key not in self._created:
                raise self._raced(key)
            found[row[3]] = _event(row[:6])
        return found

    def load_shards(self, run_pk: int, shard_ids: Sequence[str]) -> dict[str, StoredShard]:
        ids = list(dict.fromkeys(shard_ids))
        rows = self._query(q.SQL_LOAD_SHARDS, (run_pk, ids))
        return {sid: StoredShard(rec, us, step) for sid, rec, us, step in rows}

    def insert_event(
        self, *, run_pk: int, run_sequence: int, event_id: str, row: bytes, row_hash: bytes
    ) -> int:
        if not self._reserved:
            rows = self._query(q.SQL_RESERVE_SEQUENCES, (self._hint,))
            self._reserved = [int(r[0]) for r in reversed(rows)]
        seq = self._reserved.pop()
        self._hint = max(self._hint - 1, 1)
        self._events.append((seq, run_pk, run_sequence, event_id, row, row_hash))
        return seq

    def save_shard(self, run_pk: int, shard: ShardRow) -> None:
        key = (run_pk, shard.shard_id)
        self._shards[key] = (
            *(run_pk, shard.shard_id, shard.plan_index, shard.state, shard.detail),
            *(shard.deadline_us, shard.plan_line, shard.record),
        )
        self._beats.pop(key, None)
        self._cleared.add(key)
        self._open_beats.pop(key, None)
        if shard.open is not None:
            self._opens[key] = shard.open
            self._closed.discard(key)
        else:
            self._opens.pop(key, None)
            self._closed.add(key)

    def touch_shard(
        self, *, run_pk: int, shard_id: str, deadline_us: int | None, beat_us: int, beat_step: int
    ) -> None:
        key = (run_pk, shard_id)
        self._beats[key] = (deadline_us, beat_us, beat_step)
        self._cleared.discard(key)
        pending = self._opens.get(key)
        if pending is not None:
            self._opens[key] = pending._replace(deadline_us=deadline_us, seen_us=beat_us)
        elif key not in self._closed:
            self._open_beats[key] = (deadline_us, beat_us)

    def add_counters(self, run_pk: int, deltas: Mapping[str, int]) -> None:
        for key, n in deltas.items():
            if n:
                self._counters[(run_pk, key)] = self._counters.get((run_pk, key), 0) + n

    def counter(self, run_pk: int, key: str) -> int:
        with edge():
            row = self.conn.execute(q.SQL_COUNTER, (run_pk, key)).fetchone()
        # clear_projections() flushes and deletes at once: the table plus the buffer is
        # what this transaction holds.
        return (0 if row is None else int(row[0])) + self._counters.get((run_pk, key), 0)

    def clear_projections(self, run_pk: int) -> None:
        with edge():
            self.flush()  # writes buffered before this call land first, and are cleared too
            for table in ("shards", "shard_beats", "shard_open", "run_counters"):
                self.conn.execute(f"DELETE FROM {table} WHERE run_pk = %s", (run_pk,))

    def update_run(self, run_pk: int, *, event_count: int, head_hash: bytes, now_us: int) -> None:
        self._heads[run_pk] = (event_count, head_hash, now_us, run_pk)


class Connections(Protocol):
    """Where reads borrow connections (pg_pool.PgPool)."""

    def connection(self) -> AbstractContextManager[Conn]:
        """Lends a checked connection for the block."""


class PgReadView:
    """Reads; each call borrows a pooled connection, streams hold one in a snapshot."""

    def __init__(self, pool: Connections) -> None:
        self._pool = pool

    def rows(self, sql: str, params: Any) -> list[TupleRow]:
        """Runs one read statement on a pooled connection and returns its rows."""
        with edge(), self._pool.connection() as conn:
            return conn.execute(sql, params).fetchall()

    def _stream(self, sql: str, params: Any) -> Iterator[TupleRow]:
        # One REPEATABLE READ snapshot for the whole stream (like one SQLite read statement),
        # through a server-side cursor; the connection goes back when the generator closes.
        with edge(), self._pool.connection() as conn, conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            # A slow consumer (a resume list streamed to a busy client) may idle between
            # pages; the idle timeout is for writers holding run locks, not for readers.
            conn.execute("SET LOCAL idle_in_transaction_session_timeout = 0")
            with conn.cursor(name="shardledger_stream") as cur:
                cur.itersize = _PAGE
                cur.execute(sql, params)
                yield from cur

    def get_run(self, namespace: str, run_id: str) -> RunRow | None:
        rows = self.rows(q.SQL_GET_RUN, (namespace, run_id))
        return _run(rows[0]) if rows else None

    def list_runs(self, namespace: str | None, limit: int) -> list[RunRow]:
        return [_run(r) for r in self.rows(q.SQL_LIST_RUNS, (namespace, namespace, limit))]

    def list_events(self, run_pk: int, *, after_sequence: int, limit: int) -> list[StoredEvent]:
        rows = self.rows(
            q.SQL_LIST_EVENTS, {"run": run_pk, "after": after_sequence, "limit": limit}
        )
        out: list[StoredEvent] = []
        for row in rows:
            expected = int(row[0]) + 1 + len(out)
            if row[3] != expected:
                break  # a gap: whatever fills it has not committed yet; never skip past it
            out.append(_event(row[1:]))
        return out

    def iter_events(
        self, run_pk: int, *, until_sequence: int | None = None
    ) -> Iterator[StoredEvent]:
        until = until_sequence if until_sequence is not None else 2**62
        for row in self._stream(q.SQL_ITER_EVENTS, (run_pk, until)):
            yield _event(row)

    def counters(self, run_pk: int) -> dict[str, int]:
        return {str(k): int(n) for k, n in self.rows(q.SQL_COUNTERS, (run_pk,))}

    def stale_open(self, run_pk: int, now_us: int) -> list[StaleOpen]:
        return [
            StaleOpen(bool(fp), str(labels), str(shard_labels), *(int(n) for n in sums))
            for fp, labels, shard_labels, *sums in self.rows(q.SQL_STALE_OPEN, (run_pk, now_us))
        ]

    def oldest_open_seen(self, run_pk: int) -> int | None:
        oldest = self.rows(q.SQL_OLDEST_OPEN_SEEN, (run_pk,))[0][0]
        return None if oldest is None else int(oldest)

    def open_rows(self, run_pk: int) -> dict[str, OpenRow]:
        return {str(r[0]): OpenRow(*r[1:]) for r in self.rows(q.SQL_OPEN_ROWS, (run_pk,))}

    def count_stale(self, run_pk: int, now_us: int) -> int:
        return int(self.rows(q.SQL_COUNT_STALE, (run_pk, now_us))[0][0])

    def iter_shards(
        self,
        run_pk: int,
        *,
        states: Sequence[str] | None = None,
        after_index: tuple[int, str] | None = None,
    ) -> Iterator[ShardRow]:
        idx, sid = after_index if after_index else (-1, "")
        params: dict[str, object] = {"run": run_pk, "index": idx, "shard": sid}
        sql = q.SQL_ITER_SHARDS
        if states is not None:
            sql, params["states"] = sql.replace(" ORDER BY", q.IN_STATES), list(states)
        for row in self._stream(sql, params):
            yield ShardRow(*row)

    def iter_resume(self, run_pk: int, now_us: int) -> Iterator[tuple[str, int, str, str]]:
        params = {"run": run_pk, "now": now_us, "states": list(RESUME_STATES)}
        for row in self._stream(q.SQL_ITER_RESUME, params):
            yield (str(row[0]), int(row[1]), str(row[2]), str(row[3]))

    def max_sequence(self) -> int:
        return int(self.rows(q.SQL_MAX_SEQUENCE, ())[0][0])

    def get_tombstone(self, run_pk: int) -> Tombstone | None:
        rows = self.rows(q.SQL_GET_TOMBSTONE, (run_pk,))
        return tombstone_of(rows[0]) if rows else None

    def archived_with_rows(self) -> list[int]:
        return [int(pk) for (pk,) in self.rows(q.SQL_ARCHIVED_WITH_ROWS, ())]
