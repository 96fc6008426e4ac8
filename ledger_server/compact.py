"""Shard records of a big replay in bounded memory: a hot set of objects, the rest spilled.

`db rebuild` and `db copy` replay a run's every event into one record per shard.
As objects a record takes ~4 KB, so a million-shard night needed 3.6 GB (issue
#22). `CompactRecords` keeps at most `hot` records as objects and
spills every other shard into a private temporary SQLite database (SQLite's own
temp file, removed when the connection closes), in one of two forms:

- a shard only planned so far keeps its parsed plan row (table ``plans``, in
  ``marshal`` form, which loads several times faster than the row's JSON parses),
  folded on its first other event: a night plans every shard before most of them
  start, and starts them in plan order, so the plans are read back a window of
  consecutive ids at a time (the window grows while most of what it read is used
  and shrinks when shards start in some other order);
- an older record waits as its finished projection row (table ``rows``,
  ``row_columns``) with its summary contributions, which are added to the running
  counters when it spills and taken back if a later event reloads it (through
  ``ShardRecord.from_json``, the stored form the server's own cache reads).

Both tables are keyed by one id per shard, given in the order the shards are first
seen. A night is planned in plan order, so the ids are too, and the rebuilt rows
come back in plan order by reading ``rows`` in id order, with no sort; a replay
that met a shard out of plan order sorts them instead (`SpilledRows`).

A night's events cluster by shard in time (a wave of attempts runs, commits and is
verified), so a hot set larger than the shards in flight at once means a shard is
spilled about once and never parsed again; ``reloaded`` counts those that were.
Keep `hot` well above the shards that run at once: a hot set smaller than that
spills and reloads live records over and over (correct, but slow).
"""

from __future__ import annotations

import marshal
import sqlite3
from array import array
from collections import Counter, deque
from collections.abc import Collection, Iterator
from typing import Any, Final

from ledger_server.chain import event_from_parsed
from ledger_server.events import RecordedEvent
from ledger_server.open_attempts import open_row, stored_contributions
from ledger_server.projections import fold, row_columns
from ledger_server.record import ShardRecord
from ledger_server.states import ShardState
from ledger_server.store.base import ShardRow

# Records a compact replay keeps as objects (~4 KB each).
HOT_RECORDS: Final = 50_000
# The temp database's page cache: what SQLite may hold in memory before it writes
# its temp file (negative: KiB).
_CACHE_KIB: Final = 32 * 1024
_PAGE_BYTES: Final = 16_384
# Plans and spilled rows buffered before one executemany writes them.
_BATCH: Final = 1_000
# Plans read back at once on a miss: the window starts here and moves between 1 and _MAX_WINDOW.
_FIRST_WINDOW: Final = 16
_MAX_WINDOW: Final = 1_024
# Never-started shards folded per page at the end (a night of mostly unstarted
# shards holds a million of them).
_PLAN_PAGE: Final = 10_000
_SCHEMA: Final = (
    """
    CREATE TABLE plans (
        id INTEGER PRIMARY KEY,     -- the shard's id (CompactRecords._ids)
        sequence INTEGER NOT NULL,  -- the plan's global sequence
        body BLOB NOT NULL,         -- marshal of the parsed plan row
        hash BLOB NOT NULL          -- its chain hash
    )
    """,
    """
    CREATE TABLE rows (
        id INTEGER PRIMARY KEY,     -- the shard's id: plan order when the plans came in order
        shard_id TEXT NOT NULL,
        plan_index INTEGER NOT NULL,
        state TEXT NOT NULL,        -- the projection row's columns (row_columns)
        detail TEXT NOT NULL,
        deadline_us INTEGER,
        plan_line TEXT NOT NULL,
        record BLOB NOT NULL        -- the record's stored JSON: a reload parses it
    )
    """,
)


_Plan = tuple[int, bytes, bytes]  # sequence, marshal of the parsed row, chain hash


def _fold_plan(sequence: int, body: bytes, row_hash: bytes) -> ShardRecord:
    """Folds a spilled plan into the shard's first record, as the replay would have."""
    event, run_sequence, receive_us = event_from_parsed(marshal.loads(body))
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
        # Before the first table: 16 KiB pages hold a dozen spilled rows (~1.3 KB) each,
        # where 4 KiB ones held three; inserts cost less than half as much (tools/bench/replay).
        self._db.execute(f"PRAGMA page_size = {_PAGE_BYTES}")
        self._db.execute(f"PRAGMA cache_size = -{_CACHE_KIB}")
        self._db.execute("PRAGMA journal_mode = OFF")
        self._db.execute("PRAGMA synchronous = OFF")
        for table in _SCHEMA:
            self._db.execute(table)
        self._db.execute("BEGIN")
        # Each known shard's id, negative while its only spilled form is its plan row
        # (rows are large: looked up by integer key, not by text).
        self._ids: dict[str, int] = {}
        self._plans: list[tuple[int, int, bytes, bytes]] = []  # not written yet
        self._rows: list[tuple[Any, ...]] = []  # not written yet
        # Plans read back ahead of their shards' first events, and how many of the
        # current window were used.
        self._window = _FIRST_WINDOW
        self._ahead: dict[int, _Plan] = {}
        self._used = 0
        # Whether the ids were given in plan order, and the last plan-order key given one.
        self._in_plan_order = True
        self._last_key: tuple[int, str] = (-1, "")
        self.reloaded = 0

    def _new_id(self, shard_id: str, plan_index: int) -> int:
        key = (plan_index, shard_id)
        if key < self._last_key:
            self._in_plan_order = False
        self._last_key = key
        return len(self._ids) + 1

    def add_plan(
        self, shard_id: str, plan_index: int, sequence: int, parsed: Any, row_hash: bytes
    ) -> None:
        """Keeps a shard's parsed plan row to fold on first use; a later plan of a known shard is ignored."""
        if dict.__contains__(self, shard_id) or shard_id in self._ids:
            return
        row_id = self._new_id(shard_id, plan_index)
        self._ids[shard_id] = -row_id
        self._plans.append((row_id, sequence, marshal.dumps(parsed), row_hash))
        if len(self._plans) >= _BATCH:
            self._write_plans()

    def _write_plans(self) -> None:
        self._db.executemany("INSERT INTO plans VALUES (?, ?, ?, ?)", self._plans)
        self._plans.clear()

    def _write_rows(self) -> None:
        self._db.executemany(
            "INSERT OR REPLACE INTO rows VALUES (?, ?, ?, ?, ?, ?, ?, ?)", self._rows
        )
        self._rows.clear()

    def _plan_record(self, row_id: int) -> ShardRecord:
        plan = self._ahead.pop(row_id, None)
        if plan is None:
            if self._plans:
                self._write_plans()
            # A new window: wider when most of the last one was used, narrower otherwise.
            read = self._used + len(self._ahead)
            if read:
                wide = 2 * self._used >= read
                self._window = (
                    min(2 * self._window, _MAX_WINDOW) if wide else max(1, self._window // 2)
                )
            self._ahead = {
                i: (sequence, body, row_hash)
                for i, sequence, body, row_hash in self._db.execute(
                    "SELECT id, sequence, body, hash FROM plans WHERE id >= ? AND id < ?",
                    (row_id, row_id + self._window),
                )
            }
            self._used = 0
            plan = self._ahead.pop(row_id)
        self._used += 1
        return _fold_plan(*plan)

    def __missing__(self, shard_id: str) -> ShardRecord:
        row_id = self._ids[shard_id]  # KeyError for a shard never planned
        if row_id < 0:
            record = self._plan_record(-row_id)
        else:
            # Its row stays in the table, stale, until the record spills again (or the
            # end spills every hot record): its contributions are taken back meanwhile.
            if self._rows:
                self._write_rows()
            (stored,) = self._db.execute(
                "SELECT record FROM rows WHERE id = ?", (row_id,)
            ).fetchone()
            record = ShardRecord.from_json(stored)
            # What it added when it spilled: a function of the record, which the JSON keeps.
            self._spilled_total.subtract(stored_contributions(record))
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
        spilled = [row_id for sid, row_id in self._ids.items() if sid not in hot]
        if self._rows:
            self._write_rows()
        for row_id in spilled:
            if row_id < 0:
                yield self._plan_record(-row_id)
            else:
                (stored,) = self._db.execute(
                    "SELECT record FROM rows WHERE id = ?", (row_id,)
                ).fetchone()
                yield ShardRecord.from_json(stored)

    def _put(self, shard_id: str, record: ShardRecord) -> None:
        dict.__setitem__(self, shard_id, record)
        self._order.append(shard_id)
        if len(self._order) > self._limit:
            oldest = self._order.popleft()
            self._spill(oldest, dict.pop(self, oldest))

    def _spill(self, shard_id: str, record: ShardRecord) -> None:
        columns = row_columns(record)
        self._spilled_total.update(stored_contributions(record))
        row_id = self._ids.get(shard_id)
        if row_id is None:
            row_id = self._new_id(shard_id, record.plan_index)
        self._ids[shard_id] = row_id = abs(row_id)
        self._rows.append(
            (
                row_id,
                shard_id,
                record.plan_index,
                columns["state"],
                columns["detail"],
                columns["deadline_us"],
                columns["plan_line"],
                columns["record"],
            )
        )
        if len(self._rows) >= _BATCH:
            self._write_rows()

    def take_rows(self) -> tuple[SpilledRows, Counter[str]]:
        """Spills every record as its finished row; returns the rows in plan order and their sum.

        The records are gone afterwards: what is left is the rows' temp database.
        """
        while self._order:
            oldest = self._order.popleft()
            self._spill(oldest, dict.pop(self, oldest))
        # Shards never started are folded from their plan rows a page at a time.
        unstarted = array("q", sorted(-row_id for row_id in self._ids.values() if row_id < 0))
        if self._plans:
            self._write_plans()
        for start in range(0, len(unstarted), _PLAN_PAGE):
            page = unstarted[start : start + _PLAN_PAGE]
            wanted = set(page)
            # One range read (stale plans of started shards skipped), done before the
            # page's rows are written.
            folded = [
                _fold_plan(sequence, body, row_hash)
                for row_id, sequence, body, row_hash in self._db.execute(
                    "SELECT id, sequence, body, hash FROM plans WHERE id BETWEEN ? AND ?",
                    (page[0], page[-1]),
                )
                if row_id in wanted
            ]
            for record in folded:
                self._spill(record.shard_id, record)
        if self._rows:
            self._write_rows()
        self._ids.clear()  # from here on the table is the rows, read in plan order
        self._db.execute("COMMIT")
        total = +self._spilled_total  # drops the zero entries left by reloads
        return SpilledRows(self._db, in_id_order=self._in_plan_order), total


class SpilledRows(Collection[ShardRow]):
    """Rebuilt shard rows in plan order, read from the replay's temp database as iterated."""

    def __init__(self, db: sqlite3.Connection, *, in_id_order: bool) -> None:
        self._db = db
        # Rows given their ids in plan order are read in id order (the table's own
        # order: no sort); otherwise SQLite sorts them.
        self._order = "id" if in_id_order else "plan_index, shard_id"
        (self._count,) = db.execute("SELECT count(*) FROM rows").fetchone()

    def __len__(self) -> int:
        return int(self._count)

    def __iter__(self) -> Iterator[ShardRow]:
        rows = self._db.execute(
            "SELECT shard_id, plan_index, state, detail, deadline_us, plan_line, record"
            f" FROM rows ORDER BY {self._order}"
        )
        for shard_id, plan_index, state, detail, deadline_us, plan_line, record in rows:
            # A running shard's open attempt row is rebuilt from its record (few run at once).
            running = state == ShardState.RUNNING
            yield ShardRow(
                shard_id=shard_id,
                plan_index=plan_index,
                state=state,
                detail=detail,
                deadline_us=deadline_us,
                plan_line=plan_line,
                record=record,
                open=open_row(ShardRecord.from_json(record)) if running else None,
            )

    def __contains__(self, row: object) -> bool:
        return any(row == have for have in self)
