"""Event stores: the narrow persistence interface and its backends."""

from __future__ import annotations

from ledger_server.store.base import (
    ConcurrentWriteError,
    ReadView,
    RunRow,
    Store,
    StoredEvent,
    WriteTx,
)
from ledger_server.store.urls import POSTGRES_SCHEMES, redact_url, sqlite_path

__all__ = [
    "ConcurrentWriteError",
    "ReadView",
    "RunRow",
    "Store",
    "StoredEvent",
    "WriteTx",
    "open_store",
    "redact_url",
    "sqlite_path",
]


def open_store(
    url: str, *, read_only: bool = False, commit_wait_bound_s: float | None = None
) -> Store:
    """Opens the store a URL names: a path, sqlite:///PATH or postgresql://USER@HOST/DB.

    read_only opens an existing ledger so that nothing can be written to it (a SQLite
    file read-only, PostgreSQL sessions with default_transaction_read_only) and never
    migrates it: a ledger of an older schema raises StoreError. commit_wait_bound_s bounds
    how long a PostgreSQL COMMIT may wait for its synchronous standby (None: the default;
    SQLite has no standby and ignores it).
    """
    if url.startswith(POSTGRES_SCHEMES):
        # Imported here: psycopg is an optional extra (`pip install shardledger[postgres]`).
        from ledger_server.store.postgres import DEFAULT_COMMIT_WAIT_BOUND_S, PostgresStore

        bound = DEFAULT_COMMIT_WAIT_BOUND_S if commit_wait_bound_s is None else commit_wait_bound_s
        return PostgresStore(url, read_only=read_only, commit_wait_bound_s=bound)
    from ledger_server.store.sqlite import SqliteStore

    path = sqlite_path(url)
    if path is None:
        raise ValueError(
            f"unsupported database URL scheme in {url!r}:"
            " use a path, sqlite:///PATH or postgresql://USER@HOST/DB"
        )
    return SqliteStore(path, read_only=read_only)
