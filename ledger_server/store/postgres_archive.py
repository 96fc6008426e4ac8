"""An archived run's transactions on PostgreSQL: tombstone in; dead rows out a chunk at a
time; rows back, tombstone out."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import astuple
from typing import Final

from ledger_server.store import postgres_sql as q
from ledger_server.store.base import (
    ArchiveConflict,
    ShardRow,
    StoredEvent,
    Tombstone,
    require_archived_head,
)
from ledger_server.store.postgres_tx import PgWriteTx, edge, tombstone_of

_CHUNK: Final = 5000


def check_head(tx: PgWriteTx, tombstone: Tombstone) -> Tombstone | None:
    """Locks the run's head; raises ArchiveConflict unless it is the tombstone's.

    Returns the tombstone that stands, if any. The row lock makes every replica's
    append to the run wait for this transaction, and then see the tombstone.
    """
    with edge():
        head = tx.conn.execute(q.SQL_LOCK_RUN_HEAD, (tombstone.run_pk,)).fetchone()
        require_archived_head(head, tombstone)
        row = tx.conn.execute(q.SQL_GET_TOMBSTONE, (tombstone.run_pk,)).fetchone()
    return tombstone_of(row) if row else None


def archive(tx: PgWriteTx, tombstone: Tombstone, before_commit: Callable[[], None]) -> None:
    """Writes the tombstone: once it commits the run is archived and its rows are dead (purge)."""
    if check_head(tx, tombstone) is not None:
        raise ArchiveConflict("the run is archived already")
    with edge():
        tx.conn.execute(q.SQL_INSERT_TOMBSTONE, astuple(tombstone))
    before_commit()


def purge(tx: PgWriteTx, run_pk: int, limit: int) -> int:
    """Deletes up to limit of an archived run's dead rows (heartbeat, shard, then event rows).

    Returns how many went: 0 once none is left (or the run has no tombstone).
    """
    left = limit
    with edge():
        # The run head's lock orders a purge after a restore of the same run (which then
        # leaves no tombstone for the deletes to find).
        tx.conn.execute(q.SQL_LOCK_RUN_HEAD, (run_pk,))
        for sql in q.SQL_PURGE_ARCHIVED:
            if left > 0:
                left -= tx.conn.execute(sql, {"run": run_pk, "limit": left}).rowcount
    return limit - left


def restore(
    tx: PgWriteTx,
    tombstone: Tombstone,
    events: Iterable[StoredEvent],
    projections: Callable[[], tuple[Collection[ShardRow], dict[str, int]]],
) -> None:
    """Puts the rows back under their sequences, rebuilds the projections, drops the tombstone."""
    if check_head(tx, tombstone) != tombstone:
        raise ArchiveConflict("the run's tombstone is not the one its archive was read for")
    with edge():
        # Dead rows a cut-short purge left (the same bytes): the bundle's rows replace them.
        for sql in q.SQL_ARCHIVE_DELETES:
            tx.conn.execute(sql, (tombstone.run_pk,))
        with tx.conn.cursor().copy(q.SQL_COPY_EVENTS) as copy:
            for ev in events:
                copy.write_row(tuple(ev))
        tx.clear_projections(tombstone.run_pk)
        shards, counters = projections()
        for n, shard in enumerate(shards, 1):
            tx.save_shard(tombstone.run_pk, shard)
            if n % _CHUNK == 0:
                tx.flush()
        tx.add_counters(tombstone.run_pk, counters)
        tx.flush()
        tx.conn.execute(q.SQL_DELETE_TOMBSTONE, (tombstone.run_pk,))
