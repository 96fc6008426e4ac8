"""The embedded SQLite event store (WAL, synchronous=FULL, one writer)."""

from __future__ import annotations

import fcntl
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from ledger_server.store import sqlite_archive
from ledger_server.store import sqlite_sql as q
from ledger_server.store.base import (
    ShardRow,
    StoredEvent,
    StoreError,
    StoreReadOnly,
    StoreSyncFailed,
    TokenRow,
    Tombstone,
    WriterBusy,
)
from ledger_server.store.sqlite_errors import translate
from ledger_server.store.sqlite_tx import SqliteReadView, SqliteWriteTx


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
        found = conn.execute(q.SQL_HAS_MIGRATIONS).fetchone()
    except sqlite3.DatabaseError as exc:  # "file is not a database"
        conn.close()
        raise StoreError(f"no ledger at {path}: {exc}") from exc
    if found is None:
        conn.close()
        raise StoreError(f"no ledger at {path}: a SQLite database without the ledger's tables")


def _read_only_uri(path: str) -> str:
    """Returns the URI that opens an existing ledger file for reading only, writing nothing.

    mode=ro alone is not enough: on a WAL database (every ledger) SQLite creates, and
    leaves, empty -wal and -shm files beside it, and in a directory it may not write it
    refuses to open at all. immutable=1 takes no lock and creates nothing, but it ignores
    a -wal file, so it is used only when the main file is the whole ledger and no
    connection has it open: no -wal with content, no -shm (a server holds one while it
    runs), no rollback -journal. Otherwise mode=ro reads through SQLite's shared memory,
    a consistent snapshot even beside a live server; the ledger file itself is never
    written, but SQLite may create the missing one of -wal and -shm.
    """
    uri = Path(path).absolute().as_uri() + "?mode=ro"
    wal = path + "-wal"
    if os.path.exists(wal) and os.path.getsize(wal) > 0:
        return uri
    if any(os.path.exists(path + suffix) for suffix in ("-shm", "-journal")):
        return uri
    return uri + "&immutable=1"


class SqliteStore:
    """An event store in one SQLite file."""

    exclusive_writer = True

    def __init__(
        self, path: str | Path, *, must_exist: bool = False, read_only: bool = False
    ) -> None:
        """Opens (creating by default) the ledger at path.

        With must_exist, a missing file, a directory, a file that is not SQLite, or
        a SQLite database without this schema raises StoreError and nothing is
        created or changed: a mistyped path must not turn into a new, empty ledger.
        read_only implies must_exist and opens the file so that nothing can be written
        (_read_only_uri): no migration, no writer lock, and a schema older than this
        release's is refused rather than migrated.
        """
        self.path = str(path)
        self.read_only = read_only
        self._must_exist = must_exist or read_only
        self._uri = ""
        if self._must_exist:
            _require_file(self.path)
            if read_only:
                self._uri = _read_only_uri(self.path)
        elif self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        self._readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        self._writer = self._connect()
        self._write_lock = threading.Lock()
        self._claim: int | None = None
        # Set by a failed fsync: every later write raises it (see _commit).
        self._sync_failed: StoreSyncFailed | None = None
        if read_only:
            self._require_current_schema()
        else:
            self._migrate()

    def _connect(self) -> sqlite3.Connection:
        try:
            if self._uri:
                conn = self._connect_read_only()
                _require_ledger_schema(conn, self.path)
                # A second lock beside mode=ro: this connection refuses any write statement.
                conn.execute("PRAGMA query_only=ON")
                conn.execute("PRAGMA busy_timeout=30000")
                return conn
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
            raise translate(exc, self.path) from exc
        return conn

    def _connect_read_only(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self._uri, uri=True, isolation_level=None, check_same_thread=False, timeout=30
        )
        try:
            conn.execute("PRAGMA schema_version").fetchone()  # the first read opens the WAL
        except sqlite3.OperationalError as exc:
            if not os.path.exists(self.path + "-wal"):
                return conn  # _require_ledger_schema names what the file is
            conn.close()
            # The one ledger SQLite cannot read read-only: commits in a -wal file, no -shm
            # beside it, and a directory where it may not create one.
            raise StoreReadOnly(
                f"cannot read {self.path} read-only: SQLite: {exc}; its -wal file holds"
                " commits that SQLite reads through a -shm file it cannot create in"
                f" {os.path.dirname(os.path.abspath(self.path))}: copy the ledger file with"
                " its -wal file into a directory you may write, and read the copy"
            ) from exc
        except sqlite3.DatabaseError:
            pass  # not a database: _require_ledger_schema says so
        return conn

    def _migrate(self) -> None:
        conn = self._writer
        conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations"
            " (version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_us INTEGER NOT NULL)"
        )
        done = {v for (v,) in conn.execute("SELECT version FROM schema_migrations")}
        for version, name, statements in q.MIGRATIONS:
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
                raise translate(exc, self.path) from exc

    def _require_current_schema(self) -> None:
        """Raises StoreError unless every migration of this release is applied (read-only opens)."""
        try:
            done = {v for (v,) in self._writer.execute("SELECT version FROM schema_migrations")}
        except sqlite3.Error as exc:
            self._writer.close()
            raise translate(exc, self.path) from exc
        missing = [version for version, _, _ in q.MIGRATIONS if version not in done]
        if missing:
            self._writer.close()
            raise StoreError(
                f"{self.path} has schema version {max(done, default=0)}, older than this"
                f" release's {q.MIGRATIONS[-1][0]}, and a ledger read with --db is never"
                f" migrated: run `shardledger db migrate --db COPY` on a copy and read the copy"
            )

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
        if self.read_only:
            raise StoreReadOnly(f"{self.path} is open read-only: nothing is written to it")
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
    def write(self) -> Iterator[SqliteWriteTx]:
        """Opens the write transaction; it commits durably when the context exits cleanly."""
        with self._write_lock:
            if self._sync_failed is not None:
                raise self._sync_failed
            if self._claim is None or self.read_only:
                self._claim_locked()
            conn = self._writer
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise translate(exc, self.path) from exc
            try:
                tx = SqliteWriteTx(conn)
                yield tx
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            try:
                tx.flush()
                self._commit(conn)
            except sqlite3.Error as exc:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                error = translate(exc, self.path)
                if isinstance(error, StoreSyncFailed):
                    # fsyncgate: after a failed fsync the kernel may have dropped the pages
                    # and cleared the error, so a later fsync would "succeed" over a hole and
                    # later commits could vanish in WAL recovery. Like PostgreSQL (which now
                    # PANICs), stop: no write is acknowledged again until a restart recovers
                    # from what is really on disk.
                    self._sync_failed = error
                raise error from exc

    def _commit(self, conn: sqlite3.Connection) -> None:
        """Commits the open transaction (WAL frames written and fsynced: synchronous=FULL)."""
        # One seam for the commit, where a test injects a failed fsync or a full disk.
        conn.execute("COMMIT")

    def archive_run(self, tombstone: Tombstone, *, before_commit: Callable[[], None]) -> None:
        """Writes the run's tombstone in one short transaction (sqlite_archive)."""
        with self.write() as tx:
            sqlite_archive.archive(tx, tombstone, before_commit)

    def purge_archived(self, run_pk: int, *, limit: int) -> int:
        """Deletes up to limit dead rows of an archived run, in one transaction; returns how many."""
        with self.write() as tx:
            return sqlite_archive.purge(tx, run_pk, limit)

    def restore_run(
        self,
        tombstone: Tombstone,
        events: Iterable[StoredEvent],
        projections: Callable[[], tuple[Collection[ShardRow], dict[str, int]]],
    ) -> None:
        """Puts an archived run's rows back and drops its tombstone in one transaction."""
        with self.write() as tx:
            sqlite_archive.restore(tx, tombstone, events, projections)

    def read(self) -> SqliteReadView:
        """Returns the calling thread's read view."""
        view = getattr(self._local, "view", None)
        if view is None:
            conn = self._connect()
            with self._readers_lock:
                self._readers.append(conn)
            view = SqliteReadView(conn)
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
                raise translate(exc, self.path) from exc

    def create_token(self, token: TokenRow) -> None:
        """Stores a new token (its secret only as a hash)."""
        self.execute_raw(
            f"INSERT INTO tokens ({q.SQL_TOKEN_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
            .conn.execute(
                f"SELECT {q.SQL_TOKEN_COLUMNS} FROM tokens WHERE token_id = ?", (token_id,)
            )
            .fetchone()
        )
        return TokenRow(*row) if row else None

    def list_tokens(self) -> list[TokenRow]:
        """Returns every token, oldest first."""
        rows = (
            self.read()
            .conn.execute(f"SELECT {q.SQL_TOKEN_COLUMNS} FROM tokens ORDER BY created_us, token_id")
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

    def probe(self) -> StoreError | None:
        """Checks cheaply that a write could commit: no failed fsync, the file writable.

        The file and its directory (where the -wal and -shm files live) must be writable by
        this process on a file system mounted read-write. A full disk shows only in a write,
        and is reported by the append that meets it.
        """
        if self._sync_failed is not None:
            return self._sync_failed
        if self.path == ":memory:" or self.read_only:
            return None  # read-only: no write is ever made, so none can fail
        directory = os.path.dirname(os.path.abspath(self.path))
        try:
            read_only_mount = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
        except OSError as exc:
            return StoreError(f"cannot reach {directory}: {exc.strerror}")
        unwritable = [p for p in (self.path, directory) if not os.access(p, os.W_OK)]
        if read_only_mount or unwritable:
            where = "its file system is mounted read-only" if read_only_mount else "no write access"
            return StoreReadOnly(
                f"{self.path}: {where} ({', '.join(unwritable) or directory}); the server needs"
                " write access to the file, its -wal and -shm files and their directory"
            )
        return None

    def on_fault(self, wake: Callable[[], None]) -> None:
        """Nothing to watch: every fault of a file shows in the write that meets it."""

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
