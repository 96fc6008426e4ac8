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
    "sqlite_path",
]

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def open_store(url: str) -> Store:
    """Opens the store a URL names: a path, sqlite:///PATH or postgresql://USER@HOST/DB."""
    if url.startswith(POSTGRES_SCHEMES):
        # Imported here: psycopg is an optional extra (`pip install shardledger[postgres]`).
        from ledger_server.store.postgres import PostgresStore

        return PostgresStore(url)
    from ledger_server.store.sqlite import SqliteStore

    path = sqlite_path(url)
    if path is None:
        raise ValueError(
            f"unsupported database URL scheme in {url!r}:"
            " use a path, sqlite:///PATH or postgresql://USER@HOST/DB"
        )
    return SqliteStore(path)


def sqlite_path(url: str) -> str | None:
    """Returns the file a SQLite spec names (a path or sqlite:///PATH); None for other URLs."""
    path = url[len("sqlite:///") :] if url.startswith("sqlite:///") else url
    return None if "://" in path else path


def redact_url(url: str) -> str:
    """Returns the URL with any password (user:PASSWORD@ or ?password=) replaced by ***.

    A URL with no password comes back as given: a round trip through urlsplit would
    drop the empty authority of sqlite:///PATH.
    """
    parts = urlsplit(url)
    if parts.password is None and "password=" not in parts.query:
        return url
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
