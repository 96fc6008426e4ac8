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
    """Returns the URL with any password (user:PASSWORD@, ?password=, ?sslpassword=) as ***.

    The authority is split the way libpq splits it: the user information runs to the
    last "@" before the first "/", so a "#" or "?" inside a password is masked too.
    A URL with no password comes back exactly as given.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    slash = rest.find("/")
    at = (rest if slash < 0 else rest[:slash]).rfind("@")
    userinfo, after = (rest[:at], rest[at + 1 :]) if at >= 0 else ("", rest)
    if ":" in userinfo:
        userinfo = userinfo.split(":", 1)[0] + ":***"
    location, question, query = after.partition("?")
    if question:
        query = "&".join(
            f"{item.split('=', 1)[0]}=***"
            if "=" in item and item.split("=", 1)[0].lower().endswith("password")
            else item
            for item in query.split("&")
        )
    redacted = f"{scheme}://{userinfo}{'@' if at >= 0 else ''}{location}{question}{query}"
    return url if redacted == url else redacted
