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


def open_store(url: str, *, read_only: bool = False) -> Store:
    """Opens the store a URL names: a path, sqlite:///PATH or postgresql://USER@HOST/DB.

    read_only opens an existing ledger so that nothing can be written to it (a SQLite
    file read-only, PostgreSQL sessions with default_transaction_read_only) and never
    migrates it: a ledger of an older schema raises StoreError.
    """
    if url.startswith(POSTGRES_SCHEMES):
        # Imported here: psycopg is an optional extra (`pip install shardledger[postgres]`).
        from ledger_server.store.postgres import PostgresStore

        return PostgresStore(url, read_only=read_only)
    from ledger_server.store.sqlite import SqliteStore

    path = sqlite_path(url)
    if path is None:
        raise ValueError(
            f"unsupported database URL scheme in {url!r}:"
            " use a path, sqlite:///PATH or postgresql://USER@HOST/DB"
        )
    return SqliteStore(path, read_only=read_only)
