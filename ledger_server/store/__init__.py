"""Event stores: the narrow persistence interface and its backends."""

from __future__ import annotations

from ledger_server.store.base import ReadView, RunRow, Store, StoredEvent, WriteTx

__all__ = ["ReadView", "RunRow", "Store", "StoredEvent", "WriteTx", "open_store"]


def open_store(url: str) -> Store:
    """Opens the store a URL names: a path or sqlite:///path (PostgreSQL comes later)."""
    from ledger_server.store.sqlite import SqliteStore

    if url.startswith("sqlite:///"):
        return SqliteStore(url[len("sqlite:///") :])
    if "://" in url:
        raise ValueError(
            f"unsupported database URL scheme in {url!r}: use a path or sqlite:///PATH"
        )
    return SqliteStore(url)
