"""The versions of what a ledger stores, in one module that loads nothing else.

`shardledger version` reads them without loading the store; the modules that define
each format take their number from here, and the schemas check theirs at import.
"""

from __future__ import annotations

from typing import Final

__all__ = ["POSTGRESQL_SCHEMA", "RECORD_FORMAT", "ROW_FORMAT", "SQLITE_SCHEMA", "check_schema"]

# The last migration of each store's schema (store/sqlite_sql.py, store/postgres_sql.py):
# a ledger file at a lower one is migrated by `shardledger db migrate` (or at serve).
SQLITE_SCHEMA: Final = 7
POSTGRESQL_SCHEMA: Final = 6
# The chained row's format ("v" in each event's stored JSON; events.py, chain.py).
ROW_FORMAT: Final = 2
# The shard projection records' format (record.py); older ones are rebuilt from events.
RECORD_FORMAT: Final = 8


def check_schema(store: str, migrations: list[tuple[int, str, list[str]]], declared: int) -> None:
    """Raises RuntimeError unless the migrations end at the version declared here."""
    last = migrations[-1][0]
    if last != declared:
        raise RuntimeError(
            f"the {store} schema's last migration is {last}, and ledger_server.formats says"
            f" {declared}: change them together"
        )
