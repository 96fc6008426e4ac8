"""Rebuilds a run's projections from its stored events alone.

The replay behind `shardledger db copy` (the target's shard rows and counters)
and the rebuild benchmark. It folds the same way the server does
(projections.RunReplay); what it adds is speed at the size of a big night:

- rows are folded straight from the stored bytes (``RunReplay.feed_row``), so a
  heartbeat, most of a night's events, never becomes an event object;
- the cyclic garbage collector is paused while millions of records are built:
  they hold no cycles, and each full collection would walk all of them again.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from ledger_server import projections as proj
from ledger_server.store.base import ShardRow, StoredEvent

PROGRESS_EVERY = 1000


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pauses the cyclic garbage collector for the block (reference counting still frees)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def fold_rows(
    replay: proj.RunReplay,
    rows: Iterable[StoredEvent],
    advance: Callable[[int], None] = lambda n: None,
) -> Iterator[StoredEvent]:
    """Folds each row into ``replay`` and passes it on; ``advance`` gets progress counts."""
    pending = 0
    for stored in rows:
        replay.feed_row(stored.sequence, stored.row, stored.row_hash)
        pending += 1
        if pending == PROGRESS_EVERY:
            advance(pending)
            pending = 0
        yield stored
    if pending:
        advance(pending)


def shard_rows(replay: proj.RunReplay) -> Iterator[ShardRow]:
    """Yields the rebuilt projection rows in plan order."""
    for record in replay.ordered():
        yield ShardRow(shard_id=record.shard_id, **proj.row_columns(record))


def counters(replay: proj.RunReplay) -> dict[str, int]:
    """Returns the rebuilt summary counters, without the zeros a store does not keep."""
    return {k: n for k, n in replay.counters().items() if n}
