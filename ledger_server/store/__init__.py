"""Event stores: the narrow persistence interface and its backends."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from ledger_server.store.base import (
    ConcurrentWriteError,
    ReadView,
    RunRow,
    Store,
    StoredEvent,
    WriteTx,
)

__all__ = [
    "ConcurrentWriteError",
    "ReadView",
    "RunRow",
    "Store",
    "StoredEvent",
    "WriteTx",
    "open_store",
    "redact_url",
]

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def open_store(url: str) -> Store:
    """Opens the store a URL names: a path, sqlite:///PATH or postgresql://USER@HOST/DB."""
    if url.startswith(POSTGRES_SCHEMES):
        # Imported here: psycopg is an optional extra (`pip install shardledger[postgres]`).
        from ledger_server.store.postgres import PostgresStore

        return PostgresStore(url)
    from ledger_server.store.sqlite import SqliteStore

    if url.startswith("sqlite:///"):
        return SqliteStore(url[len("sqlite:///") :])
    if "://" in url:
        raise ValueError(
            f"unsupported database URL scheme in {url!r}:"
            " use a path, sqlite:///PATH or postgresql://USER@HOST/DB"
        )
    return SqliteStore(url)


def redact_url(url: str) -> str:
    """Returns the URL with any password (user:PASSWORD@ or ?password=) replaced by ***."""
    parts = urlsplit(url)
    if parts.password is not None:
        host = parts.netloc.rsplit("@", 1)[1]
        parts = parts._replace(netloc=f"{parts.username or ''}:***@{host}")
    if "password=" in parts.query:
        query = "&".join(
            "password=***" if item.startswith("password=") else item
            for item in parts.query.split("&")
        )
        parts = parts._replace(query=query)
    return urlunsplit(parts)
