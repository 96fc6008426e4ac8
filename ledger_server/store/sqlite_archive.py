"""An archived run's transactions on SQLite: tombstone in; dead rows out a chunk at a time;
rows back, tombstone out."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Collection, Iterable
from dataclasses import astuple
from itertools import islice
from typing import Final

from ledger_server.store import sqlite_sql as q
from ledger_server.store.base import (
    ArchiveConflict,
    ShardRow,
    StoredEvent,
    Tombstone,
    require_archived_head,
)
from ledger_server.store.sqlite_errors import translate
from ledger_server.store.sqlite_tx import SqliteWriteTx, _write_rows, tombstone_of

# Rows sent per statement batch while a restore writes, so its buffers stay bounded.
_CHUNK: Final = 5000


def check_head(tx: SqliteWriteTx, tombstone: Tombstone) -> Tombstone | None:
    """Raises ArchiveConflict unless the run's head is the tombstone's; returns the standing one."""
    head = tx.conn.execute(q.SQL_RUN_HEAD, (tombstone.run_pk,)).fetchone()
    require_archived_head(head, tombstone)
    row = tx.conn.execute(q.SQL_GET_TOMBSTONE, (tombstone.run_pk,)).fetchone()
    return tombstone_of(row) if row else None


def archive(tx: SqliteWriteTx, tombstone: Tombstone, before_commit: Callable[[], None]) -> None:
    """Writes the tombstone: once it commits the run is archived and its rows are dead.

    The rows are left to purge(): deleting a night's ~90,000 of them here took ~1.8 s
    of this one transaction, with every append waiting for the writer.
    """
    try:
        if check_head(tx, tombstone) is not None:
            raise ArchiveConflict("the run is archived already")
        tx.conn.execute(q.SQL_INSERT_TOMBSTONE, astuple(tombstone))
    except sqlite3.Error as exc:
        raise translate(exc) from exc
    before_commit()


def purge(tx: SqliteWriteTx, run_pk: int, limit: int) -> int:
    """Deletes up to limit of an archived run's dead rows (heartbeat, shard, then event rows).

    Returns how many went: 0 once none is left (or the run has no tombstone).
    """
    left = limit
    try:
        for sql in q.SQL_PURGE_ARCHIVED:
            if left > 0:
                left -= tx.conn.execute(sql, (run_pk, left)).rowcount
    except sqlite3.Error as exc:
        raise translate(exc) from exc
    return limit - left


def restore(
    tx: SqliteWriteTx,
    tombstone: Tombstone,
    events: Iterable[StoredEvent],
    projections: Callable[[], tuple[Collection[ShardRow], dict[str, int]]],
) -> None:
    """Puts the rows back under their sequences, rebuilds the projections, drops the tombstone."""
    try:
        if check_head(tx, tombstone) != tombstone:
            raise ArchiveConflict("the run's tombstone is not the one its archive was read for")
        # Dead rows a cut-short purge left (the same bytes): the bundle's rows replace them.
        for sql in q.SQL_ARCHIVE_DELETES:
            tx.conn.execute(sql, (tombstone.run_pk,))
        rows = iter(events)
        while chunk := list(islice(rows, _CHUNK)):
            _write_rows(tx.conn, q.SQL_RESTORE_EVENTS, [tuple(e) for e in chunk])
        tx.clear_projections(tombstone.run_pk)
        shards, counters = projections()
        for n, shard in enumerate(shards, 1):
            tx.save_shard(tombstone.run_pk, shard)
            if n % _CHUNK == 0:
                tx.flush()
        tx.add_counters(tombstone.run_pk, counters)
        tx.flush()
        tx.conn.execute(q.SQL_DELETE_TOMBSTONE, (tombstone.run_pk,))
    except sqlite3.Error as exc:
        raise translate(exc) from exc
