"""The embedded SQLite event store (WAL, synchronous=FULL, one writer)."""

from __future__ import annotations

import fcntl
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final

from ledger_server.states import RESUME_STATES, ShardState
from ledger_server.store.base import (
    DuplicateEventError,
    ImmutableRowError,
    RunRow,
    ShardRow,
    StoredEvent,
    StoredShard,
    StoreError,
    TokenRow,
    WriterBusy,
)
from ledger_server.store.resume_sql import resume_reason_sql

# Each migration is a list of statements applied in one transaction together
# with its row in schema_migrations, so a crash leaves either all or none.
MIGRATIONS: Final[list[tuple[int, str, list[str]]]] = [
    (
        1,
        "events, runs, shard projections, counters",
        [
            """CREATE TABLE runs (
                run_pk INTEGER PRIMARY KEY,
                namespace TEXT NOT NULL,
                run_id TEXT NOT NULL,
                event_count INTEGER NOT NULL,
                head_hash BLOB NOT NULL,
                created_us INTEGER NOT NULL,
                updated_us INTEGER NOT NULL,
                UNIQUE (namespace, run_id))""",
            """CREATE TABLE events (
                seq INTEGER PRIMARY KEY,
                run_pk INTEGER NOT NULL REFERENCES runs (run_pk),
                run_seq INTEGER NOT NULL,
                event_id TEXT NOT NULL UNIQUE,
                row BLOB NOT NULL,
                hash BLOB NOT NULL)""",
            "CREATE UNIQUE INDEX events_by_run ON events (run_pk, seq)",
            """CREATE TRIGGER events_no_update BEFORE UPDATE ON events
               BEGIN SELECT RAISE(ABORT, 'events are append-only: UPDATE refused'); END""",
            """CREATE TRIGGER events_no_delete BEFORE DELETE ON events
               BEGIN SELECT RAISE(ABORT, 'events are append-only: DELETE refused'); END""",
            """CREATE TABLE shards (
                run_pk INTEGER NOT NULL,
                shard_id TEXT NOT NULL,
                plan_index INTEGER NOT NULL,
                state TEXT NOT NULL,
                detail TEXT NOT NULL,
                deadline_us INTEGER,
                plan_line TEXT NOT NULL,
                record BLOB NOT NULL,
                PRIMARY KEY (run_pk, shard_id)) WITHOUT ROWID""",
            "CREATE INDEX shards_by_state ON shards (run_pk, state, deadline_us)",
            "CREATE INDEX shards_by_plan ON shards (run_pk, plan_index, shard_id)",
            """CREATE TABLE run_counters (
                run_pk INTEGER NOT NULL,
                key TEXT NOT NULL,
                n INTEGER NOT NULL,
                PRIMARY KEY (run_pk, key)) WITHOUT ROWID""",
        ],
    ),
    (
        2,
        "access tokens (hashes only)",
        [
            """CREATE TABLE tokens (
                token_id TEXT PRIMARY KEY,
                namespace TEXT NOT NULL,
                role TEXT NOT NULL,
                run_prefix TEXT NOT NULL,
                secret_hash TEXT NOT NULL,
                description TEXT NOT NULL,
                created_us INTEGER NOT NULL,
                expires_us INTEGER,
                revoked_us INTEGER)""",
        ],
    ),
    (
        3,
        "shard heartbeats in a narrow table; a plan-order index that holds the state",
        [
            # One row per shard whose latest write was a heartbeat; a full save of the
            # shard's record deletes it. Narrow rows keep a busy fleet's commits small.
            """CREATE TABLE shard_beats (
                run_pk INTEGER NOT NULL,
                shard_id TEXT NOT NULL,
                deadline_us INTEGER,
                beat_us INTEGER NOT NULL,
                beat_step INTEGER NOT NULL,
                PRIMARY KEY (run_pk, shard_id)) WITHOUT ROWID""",
            # Plan order with the state in the index: a resume list or a state filter
            # skips the shards it does not want without reading their (wide) rows.
            "CREATE INDEX shards_by_plan_state ON shards (run_pk, plan_index, shard_id, state)",
            "DROP INDEX shards_by_plan",
        ],
    ),
    (
        4,
        "shard rows in a rowid table: records stay on their page",
        [
            # A WITHOUT ROWID table keeps at most ~1,000 bytes of a row on a 4 KiB page;
            # a shard's record is 1-2 KB, so every row spilled into its own overflow page
            # (4 KiB per shard, and 4x the write time). A rowid table keeps ~4 KB locally.
            """CREATE TABLE shards_v4 (
                run_pk INTEGER NOT NULL,
                shard_id TEXT NOT NULL,
                plan_index INTEGER NOT NULL,
                state TEXT NOT NULL,
                detail TEXT NOT NULL,
                deadline_us INTEGER,
                plan_line TEXT NOT NULL,
                record BLOB NOT NULL,
                UNIQUE (run_pk, shard_id))""",
            "INSERT INTO shards_v4 (run_pk, shard_id, plan_index, state, detail, deadline_us,"
            " plan_line, record) SELECT run_pk, shard_id, plan_index, state, detail, deadline_us,"
            " plan_line, record FROM shards ORDER BY run_pk, plan_index, shard_id",
            "DROP TABLE shards",
            "ALTER TABLE shards_v4 RENAME TO shards",
            # The shard id rides along (a WITHOUT ROWID index had it as the key): the
            # stale count joins the heartbeat rows on it without reading the wide rows.
            "CREATE INDEX shards_by_state ON shards (run_pk, state, deadline_us, shard_id)",
            "CREATE INDEX shards_by_plan_state ON shards (run_pk, plan_index, shard_id, state)",
        ],
    ),
    (
        5,
        "the plan-order index covers the resume list",
        [
            # The resume list reads these columns of every unconfirmed shard in plan order.
            # From the index alone that is a sequential scan; through the table it is one
            # row lookup per shard, scattered over ~1.5 KB rows (2-3x the time at 1M).
            "DROP INDEX shards_by_plan_state",
            "CREATE INDEX shards_by_plan_state ON shards"
            " (run_pk, plan_index, shard_id, state, detail, deadline_us, plan_line)",
        ],
    ),
]
SQL_TOKEN_COLUMNS: Final = "token_id, namespace, role, run_prefix, secret_hash, description, created_us, expires_us, revoked_us"

SQL_GET_RUN: Final = (
    "SELECT run_pk, namespace, run_id, event_count, head_hash, created_us, updated_us"
    " FROM runs WHERE namespace = ? AND run_id = ?"
)
SQL_LIST_RUNS: Final = (
    "SELECT run_pk, namespace, run_id, event_count, head_hash, created_us, updated_us"
    " FROM runs WHERE (? IS NULL OR namespace = ?) ORDER BY updated_us DESC, run_pk DESC LIMIT ?"
)
SQL_UPDATE_RUN: Final = (
    "UPDATE runs SET event_count = ?, head_hash = ?, updated_us = ? WHERE run_pk = ?"
)
SQL_INSERT_RUN: Final = (
    "INSERT INTO runs (run_pk, namespace, run_id, event_count, head_hash, created_us, updated_us)"
    " VALUES (?, ?, ?, ?, ?, ?, ?)"
)
# Buffered writes go out as multi-row statements ({values} is repeated "(?, ...)" groups):
# Python's sqlite3 releases and retakes the GIL around every row of an executemany, and
# with the server's request threads busy each retake can wait a whole switch interval,
# so one statement per few hundred rows is many times faster under load.
SQL_INSERT_EVENTS: Final = (
    "INSERT INTO events (seq, run_pk, run_seq, event_id, row, hash) VALUES {values}"
)
SQL_EVENT_COLUMNS: Final = "seq, run_pk, run_seq, event_id, row, hash"
SQL_LIST_EVENTS: Final = (
    f"SELECT {SQL_EVENT_COLUMNS} FROM events WHERE run_pk = ? AND seq > ? ORDER BY seq LIMIT ?"
)
# An upsert updates the row in place, touching only the indexes whose columns changed;
# INSERT OR REPLACE would delete and re-insert the row in every index.
SQL_SAVE_SHARDS: Final = (
    "INSERT INTO shards"
    " (run_pk, shard_id, plan_index, state, detail, deadline_us, plan_line, record)"
    " VALUES {values}"
    " ON CONFLICT (run_pk, shard_id) DO UPDATE SET plan_index = excluded.plan_index,"
    " state = excluded.state, detail = excluded.detail, deadline_us = excluded.deadline_us,"
    " plan_line = excluded.plan_line, record = excluded.record"
)
SQL_SAVE_BEATS: Final = (
    "INSERT INTO shard_beats (run_pk, shard_id, deadline_us, beat_us, beat_step)"
    " VALUES {values} ON CONFLICT (run_pk, shard_id) DO UPDATE SET"
    " deadline_us = excluded.deadline_us, beat_us = excluded.beat_us,"
    " beat_step = excluded.beat_step"
)
SQL_CLEAR_BEATS: Final = "DELETE FROM shard_beats WHERE (run_pk, shard_id) IN (VALUES {values})"
# A shard's row as readers see it: the heartbeat row, when there is one, is the newer
# deadline and liveness (see projections.record_from_row).
SQL_SHARD_FROM: Final = (
    " FROM shards AS s LEFT JOIN shard_beats AS b"
    " ON b.run_pk = s.run_pk AND b.shard_id = s.shard_id"
)
SQL_DEADLINE: Final = "CASE WHEN b.run_pk IS NULL THEN s.deadline_us ELSE b.deadline_us END"
# The same deadline without the join, for the resume list (it needs no record), which
# asks only for a running shard's: its heartbeat row's when there is one.
SQL_RUNNING_DEADLINE: Final = (
    "COALESCE((SELECT b.deadline_us FROM shard_beats AS b"
    " WHERE b.run_pk = s.run_pk AND b.shard_id = s.shard_id), s.deadline_us)"
)
SQL_ITER_RESUME: Final = (
    f"SELECT s.shard_id, s.plan_index, s.plan_line, {resume_reason_sql(SQL_RUNNING_DEADLINE, '?1')}"
    f" FROM shards AS s WHERE s.run_pk = ?2 AND s.state IN ({', '.join('?' * len(RESUME_STATES))})"
    " ORDER BY s.plan_index, s.shard_id"
)
SQL_ADD_COUNTERS: Final = (
    "INSERT INTO run_counters (run_pk, key, n) VALUES {values}"
    " ON CONFLICT (run_pk, key) DO UPDATE SET n = n + excluded.n"
)
SQL_COUNTERS: Final = "SELECT key, n FROM run_counters WHERE run_pk = ? AND n != 0"
SQL_COUNTER: Final = "SELECT n FROM run_counters WHERE run_pk = ? AND key = ?"
SQL_COUNT_STALE: Final = (
    f"SELECT COUNT(*){SQL_SHARD_FROM} WHERE s.run_pk = ? AND s.state = '{ShardState.RUNNING}'"
    f" AND {SQL_DEADLINE} < ?"
)
SQL_HAS_MIGRATIONS: Final = (
    "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_migrations'"
)
_CHUNK: Final = 500


# Bound parameters per statement: SQLite's limit is 32766 since 3.32, 999 before.
_MAX_PARAMS: Final = 32766 if sqlite3.sqlite_version_info >= (3, 32, 0) else 999
_ROWS_PER_STATEMENT: Final = 500


def _write_rows(
    conn: sqlite3.Connection, template: str, rows: Sequence[tuple[object, ...]]
) -> None:
    """Runs template once per chunk of rows, its {values} filled with one group per row."""
    if not rows:
        return
    width = len(rows[0])
    group = "(" + ", ".join("?" * width) + ")"
    step = max(1, min(_ROWS_PER_STATEMENT, _MAX_PARAMS // width))
    for start in range(0, len(rows), step):
        chunk = rows[start : start + step]
        sql = template.format(values=", ".join([group] * len(chunk)))
        conn.execute(sql, [value for row in chunk for value in row])


def _run(row: tuple[object, ...]) -> RunRow:
    return RunRow(*row)  # type: ignore[arg-type]


def _event(row: tuple[object, ...]) -> StoredEvent:
    body = row[4]
    if type(body) is bytes:
        return StoredEvent._make(row)
    # A row edited outside the server may come back as TEXT; the audit must still read it.
    data = body.encode() if isinstance(body, str) else bytes(body)  # type: ignore[call-overload]
    seq, run_pk, run_seq, event_id, _, row_hash = row
    return StoredEvent(seq, run_pk, run_seq, event_id, data, row_hash)  # type: ignore[arg-type]


def _translate(exc: sqlite3.Error) -> StoreError:
    # Driver errors are translated at this one edge; callers see StoreError only.
    if "append-only" in str(exc):
        return ImmutableRowError(str(exc))
    if isinstance(exc, sqlite3.IntegrityError) and "events.event_id" in str(exc):
        return DuplicateEventError(str(exc))
    return StoreError(f"{type(exc).__name__}: {exc}")


def _require_file(path: str) -> None:
    """Raises StoreError unless path is an existing regular file."""
    if not os.path.exists(path):
        raise StoreError(f"no ledger at {path}: no such file")
    if os.path.isdir(path):
        raise StoreError(f"no ledger at {path}: a directory, not a ledger file")
    if not os.path.isfile(path):
        raise StoreError(f"no ledger at {path}: not a regular file")
    if os.path.getsize(path) == 0:
        raise StoreError(f"no ledger at {path}: an empty file")


def _require_ledger_schema(conn: sqlite3.Connection, path: str) -> None:
    """Raises StoreError (closing conn) unless the database holds this store's schema."""
    try:
        found = conn.execute(SQL_HAS_MIGRATIONS).fetchone()
    except sqlite3.DatabaseError as exc:  # "file is not a database"
        conn.close()
        raise StoreError(f"no ledger at {path}: {exc}") from exc
    if found is None:
        conn.close()
        raise StoreError(f"no ledger at {path}: a SQLite database without the ledger's tables")


class SqliteStore:
    """An event store in one SQLite file."""

    exclusive_writer = True

    def __init__(self, path: str | Path, *, must_exist: bool = False) -> None:
        """Opens (creating by default) the ledger at path.

        With must_exist, a missing file, a directory, a file that is not SQLite, or
        a SQLite database without this schema raises StoreError and nothing is
        created or changed: a mistyped path must not turn into a new, empty ledger.
        """
        self.path = str(path)
        self._must_exist = must_exist
        if must_exist:
            _require_file(self.path)
        elif self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        self._readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        self._writer = self._connect()
        self._write_lock = threading.Lock()
        self._claim: int | None = None
        self._migrate()

    def _connect(self) -> sqlite3.Connection:
        try:
            if self._must_exist:
                # mode=rw opens read-write but never creates the file (plain connect would).
                conn = sqlite3.connect(
                    Path(self.path).absolute().as_uri() + "?mode=rw",
                    uri=True,
                    isolation_level=None,
                    check_same_thread=False,
                    timeout=30,
                )
                # Checked before the WAL pragma, which would rewrite another program's database.
                _require_ledger_schema(conn, self.path)
            else:
                conn = sqlite3.connect(
                    self.path, isolation_level=None, check_same_thread=False, timeout=30
                )
            conn.execute("PRAGMA journal_mode=WAL")
            # FULL: a COMMIT returns only after the WAL is fsynced, so an
            # acknowledged append survives power loss, not just a process crash.
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA busy_timeout=30000")
        except sqlite3.Error as exc:
            raise _translate(exc) from exc
        return conn

    def _migrate(self) -> None:
        conn = self._writer
        conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations"
            " (version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_us INTEGER NOT NULL)"
        )
        done = {v for (v,) in conn.execute("SELECT version FROM schema_migrations")}
        for version, name, statements in MIGRATIONS:
            if version in done:
                continue
            conn.execute("BEGIN IMMEDIATE")
            try:
                for statement in statements:
                    conn.execute(statement)
                conn.execute(
                    "INSERT INTO schema_migrations VALUES (?, ?, ?)",
                    (version, name, int(time.time() * 1e6)),
                )
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                conn.execute("ROLLBACK")
                raise _translate(exc) from exc

    def schema_version(self) -> int:
        """Returns the highest applied migration."""
        row = self._writer.execute("SELECT MAX(version) FROM schema_migrations").fetchone()
        return int(row[0] or 0)

    def claim_writer(self) -> None:
        """Takes the file's writer lock (flock on `<file>-lock`), or raises WriterBusy.

        The writer keeps shard records in memory between transactions, which is only
        right while no other process writes the file: a second server on the same
        file would fold onto records the first one has since changed. SQLite's own
        locks serialize transactions but cannot tell that. The kernel drops the lock
        when the process ends, a kill -9 included.
        """
        with self._write_lock:
            self._claim_locked()

    def _claim_locked(self) -> None:
        if self._claim is not None or self.path == ":memory:":
            return
        lock_path = self.path + "-lock"
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StoreError(f"cannot open the writer lock {lock_path}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise WriterBusy(
                f"{self.path} is being written by another process"
                f"{f' (pid {holder})' if holder.isdigit() else ''}: a SQLite ledger has one"
                " writer at a time (one server; `db rebuild` and `import` with it stopped)"
            ) from None
        except OSError as exc:
            os.close(fd)
            raise StoreError(f"cannot lock {lock_path}: {exc}") from exc
        try:  # who holds it, for the message a second writer gets
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            os.close(fd)
            raise StoreError(f"cannot write the writer lock {lock_path}: {exc}") from exc
        self._claim = fd

    @contextmanager
    def write(self) -> Iterator[_SqliteWriteTx]:
        """Opens the write transaction; it commits durably when the context exits cleanly."""
        with self._write_lock:
            if self._claim is None:
                self._claim_locked()
            conn = self._writer
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise _translate(exc) from exc
            try:
                tx = _SqliteWriteTx(conn)
                yield tx
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            try:
                tx.flush()
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise _translate(exc) from exc

    def read(self) -> _SqliteReadView:
        """Returns the calling thread's read view."""
        view = getattr(self._local, "view", None)
        if view is None:
            conn = self._connect()
            with self._readers_lock:
                self._readers.append(conn)
            view = _SqliteReadView(conn)
            self._local.view = view
        return view

    def integrity_check(self) -> str:
        """Returns PRAGMA integrity_check's verdict."""
        rows = self._writer.execute("PRAGMA integrity_check").fetchall()
        return "\n".join(str(r[0]) for r in rows)

    def execute_raw(self, sql: str, params: Sequence[object] = ()) -> list[tuple[object, ...]]:
        """Runs raw SQL on the writer connection (tests and maintenance only)."""
        with self._write_lock:
            try:
                return self._writer.execute(sql, params).fetchall()
            except sqlite3.Error as exc:
                raise _translate(exc) from exc

    def create_token(self, token: TokenRow) -> None:
        """Stores a new token (its secret only as a hash)."""
        self.execute_raw(
            f"INSERT INTO tokens ({SQL_TOKEN_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                token.token_id,
                token.namespace,
                token.role,
                token.run_prefix,
                token.secret_hash,
                token.description,
                token.created_us,
                token.expires_us,
                token.revoked_us,
            ),
        )

    def get_token(self, token_id: str) -> TokenRow | None:
        """Returns the token with this id, or None."""
        row = (
            self.read()
            .conn.execute(f"SELECT {SQL_TOKEN_COLUMNS} FROM tokens WHERE token_id = ?", (token_id,))
            .fetchone()
        )
        return TokenRow(*row) if row else None

    def list_tokens(self) -> list[TokenRow]:
        """Returns every token, oldest first."""
        rows = (
            self.read()
            .conn.execute(f"SELECT {SQL_TOKEN_COLUMNS} FROM tokens ORDER BY created_us, token_id")
            .fetchall()
        )
        return [TokenRow(*r) for r in rows]

    def revoke_token(self, token_id: str, *, now_us: int) -> bool:
        """Marks a token revoked; returns False when there is no such live token."""
        with self._write_lock:
            cur = self._writer.execute(
                "UPDATE tokens SET revoked_us = ? WHERE token_id = ? AND revoked_us IS NULL",
                (now_us, token_id),
            )
            return cur.rowcount == 1

    def close(self) -> None:
        """Closes every connection."""
        with self._readers_lock:
            for conn in self._readers:
                conn.close()
            self._readers.clear()
        with self._write_lock:
            self._writer.close()
            if self._claim is not None:
                os.close(self._claim)  # releases the writer lock
                self._claim = None


@dataclass(slots=True)
class _Buffer:
    """Everything one transaction will write; copied at a savepoint, restored on rollback."""

    next_seq: int
    next_run_pk: int | None = None
    events: list[tuple[int, int, int, str, bytes, bytes]] = field(default_factory=list)
    event_index: dict[str, int] = field(default_factory=dict)
    new_runs: list[RunRow] = field(default_factory=list)
    runs: dict[tuple[str, str], RunRow] = field(default_factory=dict)
    dirty_runs: set[int] = field(default_factory=set)
    # key -> the shards row's parameters, for full saves.
    shards: dict[tuple[int, str], tuple[object, ...]] = field(default_factory=dict)
    # key -> (deadline_us, beat_us, beat_step) of the heartbeat row; cleared: rows to delete.
    beats: dict[tuple[int, str], tuple[int | None, int, int]] = field(default_factory=dict)
    cleared: set[tuple[int, str]] = field(default_factory=set)
    counters: dict[tuple[int, str], int] = field(default_factory=dict)

    def copy(self) -> _Buffer:
        # Shallow copies suffice: buffered values are immutable and the event list is only
        # ever appended to, so its length marks the savepoint.
        return _Buffer(
            self.next_seq,
            self.next_run_pk,
            self.events,
            dict(self.event_index),
            list(self.new_runs),
            dict(self.runs),
            set(self.dirty_runs),
            dict(self.shards),
            dict(self.beats),
            set(self.cleared),
            dict(self.counters),
        )


class _SqliteWriteTx:
    """The group's transaction: writes are buffered and sent at commit, one executemany each.

    SQLite has one writer (this process holds the write lock), so sequences and run keys
    are assigned here, and a savepoint is a copy of the buffer: a refused batch wrote
    nothing to the database, and rolling it back costs no SQL.
    """

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        top = conn.execute("SELECT COALESCE(MAX(seq), 0) FROM events").fetchone()[0]
        self._buf = _Buffer(next_seq=int(top) + 1)

    @contextmanager
    def savepoint(self) -> Iterator[None]:
        saved, mark = self._buf.copy(), len(self._buf.events)
        try:
            yield
        except BaseException:
            del saved.events[mark:]
            self._buf = saved
            raise

    def flush(self) -> None:
        """Sends every buffered write now (at commit, or to bound a long import's memory)."""
        buf = self._buf
        conn = self.conn
        if buf.new_runs:
            conn.executemany(
                SQL_INSERT_RUN,
                [
                    (r.run_pk, r.namespace, r.run_id, 0, r.head_hash, r.created_us, r.updated_us)
                    for r in buf.new_runs
                ],
            )
        _write_rows(conn, SQL_INSERT_EVENTS, buf.events)
        _write_rows(conn, SQL_SAVE_SHARDS, list(buf.shards.values()))
        _write_rows(conn, SQL_CLEAR_BEATS, list(buf.cleared))
        _write_rows(conn, SQL_SAVE_BEATS, [(*k, *v) for k, v in buf.beats.items()])
        _write_rows(conn, SQL_ADD_COUNTERS, [(*k, n) for k, n in buf.counters.items() if n])
        heads = [r for r in buf.runs.values() if r.run_pk in buf.dirty_runs]
        conn.executemany(
            SQL_UPDATE_RUN, [(r.event_count, r.head_hash, r.updated_us, r.run_pk) for r in heads]
        )
        # Run heads stay known to this transaction; only what was sent is dropped.
        self._buf = _Buffer(next_seq=buf.next_seq, next_run_pk=buf.next_run_pk, runs=buf.runs)

    def get_run(self, namespace: str, run_id: str) -> RunRow | None:
        key = (namespace, run_id)
        run = self._buf.runs.get(key)
        if run is None:
            row = self.conn.execute(SQL_GET_RUN, key).fetchone()
            if row is None:
                return None
            run = self._buf.runs[key] = _run(row)
        return run

    def create_run(self, namespace: str, run_id: str, *, now_us: int, genesis: bytes) -> RunRow:
        buf = self._buf
        if buf.next_run_pk is None:
            top = self.conn.execute("SELECT COALESCE(MAX(run_pk), 0) FROM runs").fetchone()[0]
            buf.next_run_pk = int(top) + 1
        run = RunRow(buf.next_run_pk, namespace, run_id, 0, genesis, now_us, now_us)
        buf.next_run_pk += 1
        buf.new_runs.append(run)
        buf.runs[(namespace, run_id)] = run
        return run

    def find_events(self, event_ids: Sequence[str]) -> dict[str, StoredEvent]:
        found: dict[str, StoredEvent] = {}
        ids = []
        for event_id in dict.fromkeys(event_ids):
            index = self._buf.event_index.get(event_id)
            if index is None:
                ids.append(event_id)
            else:
                seq, run_pk, run_seq, _, body, row_hash = self._buf.events[index]
                found[event_id] = StoredEvent(seq, run_pk, run_seq, event_id, body, row_hash)
        for start in range(0, len(ids), _CHUNK):
            chunk = ids[start : start + _CHUNK]
            marks = ",".join("?" * len(chunk))
            sql = f"SELECT {SQL_EVENT_COLUMNS} FROM events WHERE event_id IN ({marks})"
            for row in self.conn.execute(sql, chunk):
                ev = _event(row)
                found[ev.event_id] = ev
        return found

    def load_shards(self, run_pk: int, shard_ids: Sequence[str]) -> dict[str, StoredShard]:
        out: dict[str, StoredShard] = {}
        ids = list(dict.fromkeys(shard_ids))
        for start in range(0, len(ids), _CHUNK):
            chunk = ids[start : start + _CHUNK]
            marks = ",".join("?" * len(chunk))
            sql = (
                f"SELECT s.shard_id, s.record, b.beat_us, b.beat_step{SQL_SHARD_FROM}"
                f" WHERE s.run_pk = ? AND s.shard_id IN ({marks})"
            )
            for shard_id, record, beat_us, beat_step in self.conn.execute(sql, [run_pk, *chunk]):
                out[shard_id] = StoredShard(record, beat_us, beat_step)
        # Buffered writes of this transaction win over the database.
        buf = self._buf
        for shard_id in ids:
            key = (run_pk, shard_id)
            saved, beat = buf.shards.get(key), buf.beats.get(key)
            if saved is not None:
                record = saved[7]
                assert isinstance(record, bytes)
                out[shard_id] = StoredShard(record, None, None)
            if beat is not None and shard_id in out:
                out[shard_id] = StoredShard(out[shard_id].record, beat[1], beat[2])
            elif key in buf.cleared and shard_id in out:
                out[shard_id] = StoredShard(out[shard_id].record, None, None)
        return out

    def insert_event(
        self, *, run_pk: int, run_sequence: int, event_id: str, row: bytes, row_hash: bytes
    ) -> int:
        buf = self._buf
        seq = buf.next_seq
        buf.next_seq += 1
        buf.event_index[event_id] = len(buf.events)
        buf.events.append((seq, run_pk, run_sequence, event_id, row, row_hash))
        return seq

    def save_shard(
        self,
        *,
        run_pk: int,
        shard_id: str,
        plan_index: int,
        state: str,
        detail: str,
        deadline_us: int | None,
        plan_line: str,
        record: bytes,
    ) -> None:
        key = (run_pk, shard_id)
        buf = self._buf
        buf.shards[key] = (
            run_pk,
            shard_id,
            plan_index,
            state,
            detail,
            deadline_us,
            plan_line,
            record,
        )
        buf.beats.pop(key, None)
        buf.cleared.add(key)

    def touch_shard(
        self, *, run_pk: int, shard_id: str, deadline_us: int | None, beat_us: int, beat_step: int
    ) -> None:
        key = (run_pk, shard_id)
        buf = self._buf
        buf.beats[key] = (deadline_us, beat_us, beat_step)
        buf.cleared.discard(key)

    def add_counters(self, run_pk: int, deltas: Mapping[str, int]) -> None:
        counters = self._buf.counters
        for key, n in deltas.items():
            if n:
                counters[(run_pk, key)] = counters.get((run_pk, key), 0) + n

    def counter(self, run_pk: int, key: str) -> int:
        try:
            row = self.conn.execute(SQL_COUNTER, (run_pk, key)).fetchone()
        except sqlite3.Error as exc:
            raise _translate(exc) from exc
        # A clear_projections() flushes and deletes at once, so the table plus what is
        # buffered since is what this transaction holds.
        stored = 0 if row is None else int(row[0])
        return stored + self._buf.counters.get((run_pk, key), 0)

    def clear_projections(self, run_pk: int) -> None:
        try:
            self.flush()  # writes buffered before this call land first, and are cleared too
            for table in ("shards", "shard_beats", "run_counters"):
                self.conn.execute(f"DELETE FROM {table} WHERE run_pk = ?", (run_pk,))
        except sqlite3.Error as exc:
            raise _translate(exc) from exc

    def update_run(self, run_pk: int, *, event_count: int, head_hash: bytes, now_us: int) -> None:
        buf = self._buf
        for key, run in buf.runs.items():
            if run.run_pk == run_pk:
                buf.runs[key] = replace(
                    run, event_count=event_count, head_hash=head_hash, updated_us=now_us
                )
                buf.dirty_runs.add(run_pk)
                return
        raise StoreError(f"run_pk {run_pk} was not read in this transaction")


class _SqliteReadView:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def get_run(self, namespace: str, run_id: str) -> RunRow | None:
        row = self.conn.execute(SQL_GET_RUN, (namespace, run_id)).fetchone()
        return _run(row) if row else None

    def list_runs(self, namespace: str | None, limit: int) -> list[RunRow]:
        return [_run(r) for r in self.conn.execute(SQL_LIST_RUNS, (namespace, namespace, limit))]

    def list_events(self, run_pk: int, *, after_sequence: int, limit: int) -> list[StoredEvent]:
        return [
            _event(r) for r in self.conn.execute(SQL_LIST_EVENTS, (run_pk, after_sequence, limit))
        ]

    def iter_events(
        self, run_pk: int, *, until_sequence: int | None = None
    ) -> Iterator[StoredEvent]:
        after = 0
        limit = until_sequence if until_sequence is not None else 2**62
        while True:
            page = self.conn.execute(
                f"SELECT {SQL_EVENT_COLUMNS} FROM events"
                " WHERE run_pk = ? AND seq > ? AND seq <= ? ORDER BY seq LIMIT 5000",
                (run_pk, after, limit),
            ).fetchall()
            if not page:
                return
            for row in page:
                yield _event(row)
            after = int(page[-1][0])

    def counters(self, run_pk: int) -> dict[str, int]:
        return {k: n for k, n in self.conn.execute(SQL_COUNTERS, (run_pk,))}

    def count_stale(self, run_pk: int, now_us: int) -> int:
        return int(self.conn.execute(SQL_COUNT_STALE, (run_pk, now_us)).fetchone()[0])

    def iter_shards(
        self,
        run_pk: int,
        *,
        states: Sequence[str] | None = None,
        after_index: tuple[int, str] | None = None,
    ) -> Iterator[ShardRow]:
        idx, sid = after_index if after_index else (-1, "")
        where = "s.run_pk = ? AND (s.plan_index, s.shard_id) > (?, ?)"
        params: list[object] = [run_pk, idx, sid]
        if states is not None:
            where += f" AND s.state IN ({','.join('?' * len(states))})"
            params.extend(states)
        cursor = self.conn.execute(
            f"SELECT s.shard_id, s.plan_index, s.state, s.detail, {SQL_DEADLINE}, s.plan_line,"
            f" s.record, b.beat_us, b.beat_step{SQL_SHARD_FROM}"
            f" WHERE {where} ORDER BY s.plan_index, s.shard_id",
            params,
        )
        while True:
            rows = cursor.fetchmany(2000)
            if not rows:
                return
            for row in rows:
                yield ShardRow(*row)

    def iter_resume(self, run_pk: int, now_us: int) -> Iterator[tuple[str, int, str, str]]:
        cursor = self.conn.execute(SQL_ITER_RESUME, [now_us, run_pk, *RESUME_STATES])
        while rows := cursor.fetchmany(2000):
            yield from rows

    def max_sequence(self) -> int:
        return int(self.conn.execute("SELECT COALESCE(MAX(seq), 0) FROM events").fetchone()[0])
