"""Shard records of a big replay in bounded memory: a hot set of objects, the rest spilled.

`db rebuild` and `db copy` replay a run's every event into one record per shard.
As objects a record takes ~4 KB, so a million-shard night needed 3.6 GB (issue
#22). `CompactRecords` keeps at most `hot` records as objects and
spills every other shard into a private temporary SQLite database (SQLite's own
temp file, removed when the connection closes), in one of two forms:

- a shard only planned so far keeps its stored plan row, folded on its first other
  event: a night plans every shard before most of them start;
- an older record waits as its finished projection row (``row_columns``) with its
  summary contributions, which are added to the running counters when it spills
  and taken back if a later event reloads it (through ``ShardRecord.from_json``,
  the stored form the server's own cache reads).

A night's events cluster by shard in time (a wave of attempts runs, commits and is
verified), so a hot set larger than the shards in flight at once means a shard is
spilled about once and never parsed again; ``reloaded`` counts those that were.
Keep `hot` well above the shards that run at once: a hot set smaller than that
spills and reloads live records over and over (correct, but slow).
The rebuilt rows come back in plan order from the temp database (`SpilledRows`).
"""

from __future__ import annotations

import marshal
import sqlite3
from collections import Counter, deque
from collections.abc import Collection, Iterator
from typing import Final

from ledger_server.chain import event_from_parsed, parse_row
from ledger_server.events import RecordedEvent
from ledger_server.projections import fold, row_columns
from ledger_server.record import ShardRecord
from ledger_server.store.base import ShardRow
from ledger_server.summary import contributions

# Records a compact replay keeps as objects (~4 KB each).
HOT_RECORDS: Final = 50_000
# The temp database's page cache: what SQLite may hold in memory before it writes
# its temp file (negative: KiB).
_CACHE_KIB: Final = 32 * 1024
_PLAN, _ROW = 0, 1
# Plan rows folded per page at the end (a night of mostly unstarted shards holds a
# million of them).
_PLAN_PAGE: Final = 10_000
_SCHEMA: Final = """
CREATE TABLE spilled (
    id INTEGER PRIMARY KEY,     -- CompactRecords._ids maps each shard to it
    shard_id TEXT NOT NULL,
    plan_index INTEGER NOT NULL,
    kind INTEGER NOT NULL,      -- 0: a plan row not folded yet, 1: a finished projection row
    sequence INTEGER NOT NULL,  -- the plan's global sequence (kind 0)
    body BLOB NOT NULL,         -- kind 0: the stored plan row; 1: marshal of the row's columns
    extra BLOB NOT NULL         -- kind 0: the plan row's hash; 1: marshal of the contributions
)
"""


def _fold_plan(sequence: int, row: bytes, row_hash: bytes) -> ShardRecord:
    """Folds a stored plan row into the shard's first record, as the replay would have."""
    event, run_sequence, receive_us = event_from_parsed(parse_row(row))
    return fold(None, RecordedEvent(event, sequence, run_sequence, receive_us, row_hash))


class CompactRecords(dict[str, ShardRecord]):
    """A replay's shard records: at most `hot` as objects (this dict), the rest spilled.

    A dict, so the replay's lookup of a hot record (nearly every event) costs what a
    dict's does; a miss (`__missing__`) brings a spilled shard back. The hot set is
    first in, first out: the record spilled is the one that came in longest ago,
    which in a night's waves is one whose attempt ended long ago; a long-running
    shard spilled while still live is brought back by its next event.
    Membership, length, iteration and ``values()`` cover the spilled shards too.
    """

    def __init__(self, hot: int = HOT_RECORDS) -> None:
        super().__init__()
        if hot < 1:
            raise ValueError("hot must be at least 1")
        self._limit = hot
        self._order: deque[str] = deque()  # the hot shards, oldest first
        # The contributions of every spilled finished row (the hot ones are summed at the end).
        self._spilled_total: Counter[str] = Counter()
        self._db = sqlite3.connect("", isolation_level=None, check_same_thread=False)
        self._db.execute(f"PRAGMA cache_size = -{_CACHE_KIB}")
        self._db.execute("PRAGMA journal_mode = OFF")
        self._db.execute("PRAGMA synchronous = OFF")
        self._db.execute(_SCHEMA)
        self._db.execute("BEGIN")
        # Each spilled shard's row id (rows are large: looked up by integer key, not by text).
        self._ids: dict[str, int] = {}
        self.reloaded = 0

    def add_plan(
        self, shard_id: str, plan_index: int, sequence: int, row: bytes, row_hash: bytes
    ) -> None:
        """Keeps a shard's plan row to fold on first use; a later plan of a known shard is ignored."""
        if dict.__contains__(self, shard_id) or shard_id in self._ids:
            return
        self._ids[shard_id] = row_id = len(self._ids) + 1
        self._db.execute(
            "INSERT INTO spilled VALUES (?, ?, ?, ?, ?, ?, ?)",
            (row_id, shard_id, plan_index, _PLAN, sequence, row, row_hash),
        )

    def __missing__(self, shard_id: str) -> ShardRecord:
        row_id = self._ids[shard_id]  # KeyError for a shard never planned
        kind, sequence, body, extra = self._db.execute(
            "SELECT kind, sequence, body, extra FROM spilled WHERE id = ?", (row_id,)
        ).fetchone()
        if kind == _PLAN:
            record = _fold_plan(sequence, body, extra)
        else:
            # Its row stays in the table, stale, until the record spills again (or the
            # end spills every hot record): its contributions are taken back meanwhile.
            record = ShardRecord.from_json(marshal.loads(body)[4])
            self._spilled_total.subtract(dict(marshal.loads(extra)))
            self.reloaded += 1
        self._put(shard_id, record)
        return record

    def __setitem__(self, shard_id: str, record: ShardRecord) -> None:
        if dict.__contains__(self, shard_id):
            dict.__setitem__(self, shard_id, record)
            return
        if shard_id in self._ids:
            self[shard_id]  # the spilled copy's contributions are taken back first
            dict.__setitem__(self, shard_id, record)
            return
        self._put(shard_id, record)

    def __delitem__(self, shard_id: str) -> None:
        raise TypeError("a replay never forgets a shard")

    def __contains__(self, shard_id: object) -> bool:
        return dict.__contains__(self, shard_id) or shard_id in self._ids

    def __len__(self) -> int:
        return len(self._ids) + sum(1 for sid in dict.__iter__(self) if sid not in self._ids)

    def __iter__(self) -> Iterator[str]:
        hot = list(dict.__iter__(self))
        yield from hot
        yield from [sid for sid in self._ids if not dict.__contains__(self, sid)]

    def values(self) -> Iterator[ShardRecord]:  # type: ignore[override]
        """Yields every record (the spilled ones built anew, not brought back)."""
        hot = dict(self)
        yield from hot.values()
        rows = self._db.execute("SELECT shard_id, kind, sequence, body, extra FROM spilled")
        for shard_id, kind, sequence, body, extra in rows:  # read lazily: nothing writes here
            if shard_id in hot:
                continue
            if kind == _PLAN:
                yield _fold_plan(sequence, body, extra)
            else:
                yield ShardRecord.from_json(marshal.loads(body)[4])

    def _put(self, shard_id: str, record: ShardRecord) -> None:
        dict.__setitem__(self, shard_id, record)
        self._order.append(shard_id)
        if len(self._order) > self._limit:
            oldest = self._order.popleft()
            self._spill(oldest, dict.pop(self, oldest))

    def _spill(self, shard_id: str, record: ShardRecord) -> None:
        columns = row_columns(record)
        contributed = contributions(record)
        self._spilled_total.update(contributed)
        body = marshal.dumps(
            (
                columns["state"],
                columns["detail"],
                columns["deadline_us"],
                columns["plan_line"],
                columns["record"],
            )
        )
        row_id = self._ids.get(shard_id)
        if row_id is None:
            self._ids[shard_id] = row_id = len(self._ids) + 1
        self._db.execute(
            "INSERT OR REPLACE INTO spilled VALUES (?, ?, ?, ?, 0, ?, ?)",
            (
                row_id,
                shard_id,
                record.plan_index,
                _ROW,
                body,
                marshal.dumps(tuple(contributed.items())),
            ),
        )

    def take_rows(self) -> tuple[SpilledRows, Counter[str]]:
        """Spills every record as its finished row; returns the rows in plan order and their sum.

        The records are gone afterwards: what is left is the rows' temp database.
        """
        while self._order:
            oldest = self._order.popleft()
            self._spill(oldest, dict.pop(self, oldest))
        # Shards never started are folded from their plan rows a page at a time (each
        # spill rewrites its row, so the pages are read ahead of the writes).
        after = 0
        while plans := self._db.execute(
            "SELECT id, shard_id, sequence, body, extra FROM spilled"
            " WHERE kind = ? AND id > ? ORDER BY id LIMIT ?",
            (_PLAN, after, _PLAN_PAGE),
        ).fetchall():
            for row_id, shard_id, sequence, body, extra in plans:
                self._spill(shard_id, _fold_plan(sequence, body, extra))
                after = row_id
        self._ids.clear()  # from here on the table is the rows, read in plan order
        self._db.execute("COMMIT")
        total = +self._spilled_total  # drops the zero entries left by reloads
        return SpilledRows(self._db), total


class SpilledRows(Collection[ShardRow]):
    """Rebuilt shard rows in plan order, read from the replay's temp database as iterated."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db
        (self._count,) = db.execute("SELECT count(*) FROM spilled").fetchone()

    def __len__(self) -> int:
        return int(self._count)

    def __iter__(self) -> Iterator[ShardRow]:
        rows = self._db.execute(
            "SELECT shard_id, plan_index, body FROM spilled ORDER BY plan_index, shard_id"
        )
        for shard_id, plan_index, body in rows:
            state, detail, deadline_us, plan_line, record = marshal.loads(body)
            yield ShardRow(
                shard_id=shard_id,
                plan_index=plan_index,
                state=state,
                detail=detail,
                deadline_us=deadline_us,
                plan_line=plan_line,
                record=record,
            )

    def __contains__(self, row: object) -> bool:
        return any(row == have for have in self)
