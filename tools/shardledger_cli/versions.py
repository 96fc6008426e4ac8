"""What is installed: shardledger's version, its contract, and what it runs on."""

from __future__ import annotations

import importlib.metadata
import platform
from typing import Any, Final

CONTRACT: Final = "shardledger.v1"


def versions() -> dict[str, Any]:
    """Returns the installed versions the CLI, the SDK and the ledger run on."""

    def of(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "shardledger": of("shardledger") or "unknown (not installed as a package)",
        "contract": CONTRACT,
        "python": platform.python_version(),
        "grpcio": of("grpcio"),
        "protobuf": of("protobuf"),
        "torch": of("torch"),
        "store": store_formats(),
    }


def store_formats() -> dict[str, Any] | None:
    """Returns the ledger formats this release writes, or None without the server extra.

    sqlite_schema and postgresql_schema are the last migration of each store (a ledger at
    a lower one is migrated by `shardledger db migrate`), row_format the chained event
    row's, record_format the shard records'.
    """
    try:
        from ledger_server import formats
    except ImportError:
        return None
    return {
        "sqlite_schema": formats.SQLITE_SCHEMA,
        "postgresql_schema": formats.POSTGRESQL_SCHEMA,
        "row_format": formats.ROW_FORMAT,
        "record_format": formats.RECORD_FORMAT,
    }


def version_line() -> str:
    """Returns the one line `--version` prints."""
    v = versions()
    store = v["store"]
    schema = (
        f"store schema {store['sqlite_schema']} (SQLite), {store['postgresql_schema']} (PostgreSQL)"
        if store is not None
        else "no server extra"
    )
    return (
        f"shardledger {v['shardledger']} (contract {v['contract']}, {schema}, Python {v['python']})"
    )
