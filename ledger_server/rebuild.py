"""Rebuilds a run's projections from its stored events alone.

`shardledger db rebuild` (check or repair a run's shard rows and counters in
place), `shardledger db copy` (the target's projections) and the rebuild
benchmark all replay through here. It folds the same way the server does
(projections.RunReplay); what it adds is speed at the size of a big night:

- rows are folded straight from the stored bytes (``RunReplay.feed_row``), so a
  heartbeat, most of a night's events, never becomes an event object;
- the cyclic garbage collector is paused while millions of records are built:
  they hold no cycles, and each full collection would walk all of them again.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ledger_server.chain import GENESIS_HASH, chain_hash
from ledger_server.compact import HOT_RECORDS, CompactRecords
from ledger_server.open_attempts import shard_row
from ledger_server.record import record_from_row
from ledger_server.replay import RunReplay
from ledger_server.store.base import OpenRow, RunRow, ShardRow, Store, StoredEvent

PROGRESS_EVERY = 1000
# Rows sent per flush while a rebuild writes, so its buffer stays bounded.
WRITE_CHUNK = 20_000


class RebuildRefused(Exception):
    """The run cannot be rebuilt as asked; nothing was written."""


@dataclass(slots=True)
class RunRebuild:
    """What replaying one run found, and whether its projections were rewritten."""

    namespace: str
    run_id: str
    events: int
    shards: int
    # Shard rows the replay disagrees with: different, missing from the store, or extra
    # (a running shard's open attempt row counts as one more).
    differing_shards: int
    counters_differ: bool
    written: bool
    seconds: float
    # Of which: reading, checking and folding the events; rewriting the projections.
    replay_seconds: float = 0.0
    write_seconds: float = 0.0

    @property
    def consistent(self) -> bool:
        """True when the stored projections already equalled the replay."""
        return not self.differing_shards and not self.counters_differ


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
    replay: RunReplay,
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


def take_projections(replay: RunReplay) -> tuple[Collection[ShardRow], dict[str, int]]:
    """Returns the rebuilt shard rows in plan order and the summary counters.

    It empties the replay: each record is dropped as soon as its row is built, so
    a run's records and its rows (each ~1 GB or more at a million shards as
    objects) are not both held at their full size. A replay over CompactRecords
    hands over the rows it spilled, in plan order, with their summed contributions.
    """
    records = replay.records
    if isinstance(records, CompactRecords):
        packed, total = records.take_rows()
        return packed, {k: n for k, n in replay.run_counters(total).items() if n}
    rebuilt_counters = {k: n for k, n in replay.counters().items() if n}
    order = sorted((r.plan_index, shard_id) for shard_id, r in records.items())
    rows = []
    for _, shard_id in order:
        record = records.pop(shard_id)
        rows.append(shard_row(shard_id, record))
    return rows, rebuilt_counters


def rebuild_run(
    store: Store,
    run: RunRow,
    *,
    write: bool,
    advance: Callable[[int], None] = lambda n: None,
    records_in_memory: int = HOT_RECORDS,
) -> RunRebuild:
    """Replays a run, compares its stored projections and, if asked and they differ, rewrites them.

    Every row's hash is checked against the chain before it is folded: projections are
    never rebuilt from rows the chain does not vouch for (RebuildRefused). The rewrite is
    one transaction that first checks the run has not moved since it was read; stop the
    server writing to the run first (its cache would not see the rewrite).
    """
    started = time.monotonic()
    # 0 keeps every record as an object (~4 KB per shard); otherwise the records past
    # that many are spilled into a temp database (CompactRecords).
    replay = (
        RunReplay(records=CompactRecords(records_in_memory)) if records_in_memory else RunReplay()
    )
    view = store.read()
    with gc_paused():
        count, head = _replay_checked(replay, view.iter_events(run.run_pk), run, advance)
        replayed_at = time.monotonic()
        rows, rebuilt_counters = take_projections(replay)
        differing = _differing(rows, view.iter_shards(run.run_pk))
        differing += _open_differing(rows, view.open_rows(run.run_pk))
        counters_differ = view.counters(run.run_pk) != rebuilt_counters
        written = False
        compared_at = time.monotonic()
        if write and (differing or counters_differ):
            _rewrite(store, run, (count, head), rows, rebuilt_counters)
            written = True
    finished = time.monotonic()
    return RunRebuild(
        namespace=run.namespace,
        run_id=run.run_id,
        events=count,
        shards=len(rows),
        differing_shards=differing,
        counters_differ=counters_differ,
        written=written,
        seconds=finished - started,
        replay_seconds=replayed_at - started,
        write_seconds=finished - compared_at,
    )


def _replay_checked(
    replay: RunReplay, rows: Iterable[StoredEvent], run: RunRow, advance: Callable[[int], None]
) -> tuple[int, bytes]:
    """Folds each row after it links to the run's hash chain; returns (count, head).

    Raises RebuildRefused at a break. One loop (not a generator per stage): a big
    night runs it ten million times.
    """
    head, count, pending = GENESIS_HASH, 0, 0
    feed = replay.feed_row
    for stored in rows:
        row, row_hash = stored.row, stored.row_hash
        if chain_hash(head, row) != row_hash:
            raise RebuildRefused(
                f"run {run.namespace}/{run.run_id}: the hash chain breaks at"
                f" sequence {stored.sequence}; `shardledger audit verify --db` tells what"
                " changed"
            )
        head, count = row_hash, count + 1
        feed(stored.sequence, row, row_hash)
        pending += 1
        if pending == PROGRESS_EVERY:
            advance(pending)
            pending = 0
    if pending:
        advance(pending)
    return count, head


def _differing(rebuilt: Iterable[ShardRow], stored: Iterable[ShardRow]) -> int:
    """Counts shard rows that differ, merging both lists in plan order."""
    differing = 0
    wanted = iter(rebuilt)
    ahead = next(wanted, None)
    for have in stored:
        # Rebuilt rows that sort before this stored one are missing from the store.
        while ahead is not None and (ahead.plan_index, ahead.shard_id) < (
            have.plan_index,
            have.shard_id,
        ):
            differing += 1
            ahead = next(wanted, None)
        if ahead is None or ahead.shard_id != have.shard_id:
            differing += 1  # a stored row the events do not explain
            continue
        if not _same(ahead, have):
            differing += 1
        ahead = next(wanted, None)
    while ahead is not None:
        differing += 1
        ahead = next(wanted, None)
    return differing


def _open_differing(rebuilt: Iterable[ShardRow], stored: dict[str, OpenRow]) -> int:
    """Counts open attempt rows that differ from the replay's: different, missing or extra."""
    extra = dict(stored)
    differing = 0
    for row in rebuilt:
        if row.open is not None and extra.pop(row.shard_id, None) != row.open:
            differing += 1
    return differing + len(extra)


def _same(rebuilt: ShardRow, have: ShardRow) -> bool:
    columns = ("plan_index", "state", "detail", "deadline_us", "plan_line")
    if any(getattr(rebuilt, c) != getattr(have, c) for c in columns):
        return False
    if have.record is None:
        return False
    if have.beat_us is None:
        return have.record == rebuilt.record  # canonical JSON: equal records, equal bytes
    merged = record_from_row(have.record, have.beat_us, have.beat_step)
    return merged.to_json().encode() == rebuilt.record


def _rewrite(
    store: Store,
    run: RunRow,
    replayed: tuple[int, bytes],
    rows: Iterable[ShardRow],
    rebuilt_counters: dict[str, int],
) -> None:
    with store.write() as tx:
        now = tx.get_run(run.namespace, run.run_id)
        if now is None or (now.event_count, now.head_hash) != replayed:
            raise RebuildRefused(
                f"run {run.namespace}/{run.run_id} changed while it was replayed: stop the"
                " server writing to it, then rebuild again"
            )
        tx.clear_projections(run.run_pk)
        for n, row in enumerate(rows, 1):
            assert row.record is not None  # a rebuilt row always carries its record
            tx.save_shard(run.run_pk, row)
            if n % WRITE_CHUNK == 0:
                tx.flush()
        tx.add_counters(run.run_pk, rebuilt_counters)
