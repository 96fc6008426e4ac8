"""The SQLite buffered write transaction and read view: rows in, rows out, one error edge."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Final

from ledger_server.states import RESUME_STATES
from ledger_server.store import sqlite_sql as q
from ledger_server.store.base import (
    OpenRow,
    RunRow,
    ShardRow,
    StaleOpen,
    StoredEvent,
    StoredShard,
    StoreError,
    Tombstone,
)
from ledger_server.store.sqlite_errors import translate

_CHUNK: Final = 500


# Bound parameters per statement: SQLite's limit is 32766 since 3.32, 999 before.
_MAX_PARAMS: Final = 32766 if sqlite3.sqlite_version_info >= (3, 32, 0) else 999
_ROWS_PER_STATEMENT: Final = 500


def _write_rows(
    conn: sqlite3.Connection, template: str, rows: Sequence[tuple[object, ...]]
) -> None:
    """Runs template once per chunk of rows, its {values} filled with one group per row."""
    if not rows:
        return
    width = len(rows[0])
    group = "(" + ", ".join("?" * width) + ")"
    step = max(1, min(_ROWS_PER_STATEMENT, _MAX_PARAMS // width))
    for start in range(0, len(rows), step):
        chunk = rows[start : start + step]
        sql = template.format(values=", ".join([group] * len(chunk)))
        conn.execute(sql, [value for row in chunk for value in row])


def _run(row: tuple[object, ...]) -> RunRow:
    pk, namespace, run_id, count, head, created, updated, archived = row
    return RunRow(pk, namespace, run_id, count, head, created, updated, bool(archived))  # type: ignore[arg-type]


def tombstone_of(row: tuple[object, ...]) -> Tombstone:
    """Returns the tombstone in a run_archives row."""
    return Tombstone(*row)  # type: ignore[arg-type]


def _event(row: tuple[object, ...]) -> StoredEvent:
    body = row[4]
    if type(body) is bytes:
        return StoredEvent._make(row)
    # A row edited outside the server may come back as TEXT; the audit must still read it.
    data = body.encode() if isinstance(body, str) else bytes(body)  # type: ignore[call-overload]
    seq, run_pk, run_seq, event_id, _, row_hash = row
    return StoredEvent(seq, run_pk, run_seq, event_id, data, row_hash)  # type: ignore[arg-type]


@dataclass(slots=True)
class _Buffer:
    """Everything one transaction will write; copied at a savepoint, restored on rollback."""

    next_seq: int
    next_run_pk: int | None = None
    events: list[tuple[int, int, int, str, bytes, bytes]] = field(default_factory=list)
    event_index: dict[str, int] = field(default_factory=dict)
    new_runs: list[RunRow] = field(default_factory=list)
    runs: dict[tuple[str, str], RunRow] = field(default_factory=dict)
    dirty_runs: set[int] = field(default_factory=set)
    # key -> the shards row's parameters, for full saves.
    shards: dict[tuple[int, str], tuple[object, ...]] = field(default_factory=dict)
    # key -> (deadline_us, beat_us, beat_step) of the heartbeat row; cleared: rows to delete.
    beats: dict[tuple[int, str], tuple[int | None, int, int]] = field(default_factory=dict)
    cleared: set[tuple[int, str]] = field(default_factory=set)
    counters: dict[tuple[int, str], int] = field(default_factory=dict)
    # key -> the open attempt row to write; keys whose row goes; key -> (deadline, seen)
    # a heartbeat moved in a row written before this transaction.
    opens: dict[tuple[int, str], OpenRow] = field(default_factory=dict)
    closed: set[tuple[int, str]] = field(default_factory=set)
    open_beats: dict[tuple[int, str], tuple[int | None, int]] = field(default_factory=dict)

    def copy(self) -> _Buffer:
        # Shallow copies suffice: buffered values are immutable and the event list is only
        # ever appended to, so its length marks the savepoint.
        return _Buffer(
            self.next_seq,
            self.next_run_pk,
            self.events,
            dict(self.event_index),
            list(self.new_runs),
            dict(self.runs),
            set(self.dirty_runs),
            dict(self.shards),
            dict(self.beats),
            set(self.cleared),
            dict(self.counters),
            dict(self.opens),
            set(self.closed),
            dict(self.open_beats),
        )


class SqliteWriteTx:
    """The group's transaction: writes are buffered and sent at commit, one executemany each.

    SQLite has one writer (this process holds the write lock), so sequences and run keys
    are assigned here, and a savepoint is a copy of the buffer: a refused batch wrote
    nothing to the database, and rolling it back costs no SQL.
    """

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        top = conn.execute(q.SQL_MAX_SEQUENCE).fetchone()[0]
        self._buf = _Buffer(next_seq=int(top) + 1)
        # Runs whose projections this transaction cleared and no heartbeat row was written
        # for since: a shard row saved for one has no heartbeat row to delete (a rebuild's
        # rewrite saves a million rows this way).
        self._cleared_runs: set[int] = set()

    @contextmanager
    def savepoint(self) -> Iterator[None]:
        saved, mark = self._buf.copy(), len(self._buf.events)
        try:
            yield
        except BaseException:
            del saved.events[mark:]
            self._buf = saved
            raise

    def flush(self) -> None:
        """Sends every buffered write now (at commit, or to bound a long import's memory)."""
        buf = self._buf
        conn = self.conn
        if buf.new_runs:
            conn.executemany(
                q.SQL_INSERT_RUN,
                [
                    (r.run_pk, r.namespace, r.run_id, 0, r.head_hash, r.created_us, r.updated_us)
                    for r in buf.new_runs
                ],
            )
        _write_rows(conn, q.SQL_INSERT_EVENTS, buf.events)
        _write_rows(conn, q.SQL_SAVE_SHARDS, list(buf.shards.values()))
        _write_rows(conn, q.SQL_CLEAR_BEATS, list(buf.cleared))
        _write_rows(conn, q.SQL_SAVE_BEATS, [(*k, *v) for k, v in buf.beats.items()])
        _write_rows(conn, q.SQL_ADD_COUNTERS, [(*k, n) for k, n in buf.counters.items() if n])
        _write_rows(conn, q.SQL_CLEAR_OPEN, list(buf.closed))
        _write_rows(conn, q.SQL_SAVE_OPEN, [(*k, *v) for k, v in buf.opens.items()])
        _write_rows(conn, q.SQL_TOUCH_OPEN, [(*k, *v) for k, v in buf.open_beats.items()])
        heads = [r for r in buf.runs.values() if r.run_pk in buf.dirty_runs]
        conn.executemany(
            q.SQL_UPDATE_RUN, [(r.event_count, r.head_hash, r.updated_us, r.run_pk) for r in heads]
        )
        # Run heads stay known to this transaction; only what was sent is dropped.
        self._buf = _Buffer(next_seq=buf.next_seq, next_run_pk=buf.next_run_pk, runs=buf.runs)

    def get_run(self, namespace: str, run_id: str) -> RunRow | None:
        key = (namespace, run_id)
        run = self._buf.runs.get(key)
        if run is None:
            row = self.conn.execute(q.SQL_GET_RUN, key).fetchone()
            if row is None:
                return None
            run = self._buf.runs[key] = _run(row)
        return run

    def create_run(self, namespace: str, run_id: str, *, now_us: int, genesis: bytes) -> RunRow:
        buf = self._buf
        if buf.next_run_pk is None:
            top = self.conn.execute("SELECT COALESCE(MAX(run_pk), 0) FROM runs").fetchone()[0]
            buf.next_run_pk = int(top) + 1
        run = RunRow(buf.next_run_pk, namespace, run_id, 0, genesis, now_us, now_us)
        buf.next_run_pk += 1
        buf.new_runs.append(run)
        buf.runs[(namespace, run_id)] = run
        return run

    def find_events(self, event_ids: Sequence[str]) -> dict[str, StoredEvent]:
        found: dict[str, StoredEvent] = {}
        ids = []
        for event_id in dict.fromkeys(event_ids):
            index = self._buf.event_index.get(event_id)
            if index is None:
                ids.append(event_id)
            else:
                seq, run_pk, run_seq, _, body, row_hash = self._buf.events[index]
                found[event_id] = StoredEvent(seq, run_pk, run_seq, event_id, body, row_hash)
        for start in range(0, len(ids), _CHUNK):
            chunk = ids[start : start + _CHUNK]
            marks = ",".join("?" * len(chunk))
            sql = f"SELECT {q.SQL_EVENT_COLUMNS} FROM events WHERE event_id IN ({marks})"
            for row in self.conn.execute(sql, chunk):
                ev = _event(row)
                found[ev.event_id] = ev
        return found

    def load_shards(self, run_pk: int, shard_ids: Sequence[str]) -> dict[str, StoredShard]:
        out: dict[str, StoredShard] = {}
        ids = list(dict.fromkeys(shard_ids))
        for start in range(0, len(ids), _CHUNK):
            chunk = ids[start : start + _CHUNK]
            marks = ",".join("?" * len(chunk))
            sql = (
                f"SELECT s.shard_id, s.record, b.beat_us, b.beat_step{q.SQL_SHARD_FROM}"
                f" WHERE s.run_pk = ? AND s.shard_id IN ({marks})"
            )
            for shard_id, record, beat_us, beat_step in self.conn.execute(sql, [run_pk, *chunk]):
                out[shard_id] = StoredShard(record, beat_us, beat_step)
        # Buffered writes of this transaction win over the database.
        buf = self._buf
        for shard_id in ids:
            key = (run_pk, shard_id)
            saved, beat = buf.shards.get(key), buf.beats.get(key)
            if saved is not None:
                record = saved[7]
                assert isinstance(record, bytes)
                out[shard_id] = StoredShard(record, None, None)
            if beat is not None and shard_id in out:
                out[shard_id] = StoredShard(out[shard_id].record, beat[1], beat[2])
            elif key in buf.cleared and shard_id in out:
                out[shard_id] = StoredShard(out[shard_id].record, None, None)
        return out

    def insert_event(
        self, *, run_pk: int, run_sequence: int, event_id: str, row: bytes, row_hash: bytes
    ) -> int:
        buf = self._buf
        seq = buf.next_seq
        buf.next_seq += 1
        buf.event_index[event_id] = len(buf.events)
        buf.events.append((seq, run_pk, run_sequence, event_id, row, row_hash))
        return seq

    def save_shard(self, run_pk: int, shard: ShardRow) -> None:
        key = (run_pk, shard.shard_id)
        buf = self._buf
        buf.shards[key] = (
            run_pk,
            shard.shard_id,
            shard.plan_index,
            shard.state,
            shard.detail,
            shard.deadline_us,
            shard.plan_line,
            shard.record,
        )
        buf.beats.pop(key, None)
        if run_pk not in self._cleared_runs:
            buf.cleared.add(key)
        buf.open_beats.pop(key, None)
        if shard.open is not None:
            buf.opens[key] = shard.open
            buf.closed.discard(key)
        else:
            buf.opens.pop(key, None)
            if run_pk not in self._cleared_runs:
                buf.closed.add(key)

    def touch_shard(
        self, *, run_pk: int, shard_id: str, deadline_us: int | None, beat_us: int, beat_step: int
    ) -> None:
        key = (run_pk, shard_id)
        buf = self._buf
        buf.beats[key] = (deadline_us, beat_us, beat_step)
        buf.cleared.discard(key)
        self._cleared_runs.discard(run_pk)
        pending = buf.opens.get(key)
        if pending is not None:
            buf.opens[key] = pending._replace(deadline_us=deadline_us, seen_us=beat_us)
        elif key not in buf.closed:
            buf.open_beats[key] = (deadline_us, beat_us)

    def add_counters(self, run_pk: int, deltas: Mapping[str, int]) -> None:
        counters = self._buf.counters
        for key, n in deltas.items():
            if n:
                counters[(run_pk, key)] = counters.get((run_pk, key), 0) + n

    def counter(self, run_pk: int, key: str) -> int:
        try:
            row = self.conn.execute(q.SQL_COUNTER, (run_pk, key)).fetchone()
        except sqlite3.Error as exc:
            raise translate(exc) from exc
        # A clear_projections() flushes and deletes at once, so the table plus what is
        # buffered since is what this transaction holds.
        return (0 if row is None else int(row[0])) + self._buf.counters.get((run_pk, key), 0)

    def clear_projections(self, run_pk: int) -> None:
        try:
            self.flush()  # writes buffered before this call land first, and are cleared too
            for table in ("shards", "shard_beats", "shard_open", "run_counters"):
                self.conn.execute(f"DELETE FROM {table} WHERE run_pk = ?", (run_pk,))
            self._cleared_runs.add(run_pk)
        except sqlite3.Error as exc:
            raise translate(exc) from exc

    def update_run(self, run_pk: int, *, event_count: int, head_hash: bytes, now_us: int) -> None:
        buf = self._buf
        for key, run in buf.runs.items():
            if run.run_pk == run_pk:
                buf.runs[key] = replace(
                    run, event_count=event_count, head_hash=head_hash, updated_us=now_us
                )
                buf.dirty_runs.add(run_pk)
                return
        raise StoreError(f"run_pk {run_pk} was not read in this transaction")


class SqliteReadView:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def get_run(self, namespace: str, run_id: str) -> RunRow | None:
        row = self.conn.execute(q.SQL_GET_RUN, (namespace, run_id)).fetchone()
        return _run(row) if row else None

    def list_runs(self, namespace: str | None, limit: int) -> list[RunRow]:
        return [_run(r) for r in self.conn.execute(q.SQL_LIST_RUNS, (namespace, namespace, limit))]

    def list_events(self, run_pk: int, *, after_sequence: int, limit: int) -> list[StoredEvent]:
        return [
            _event(r) for r in self.conn.execute(q.SQL_LIST_EVENTS, (run_pk, after_sequence, limit))
        ]

    def iter_events(
        self, run_pk: int, *, until_sequence: int | None = None
    ) -> Iterator[StoredEvent]:
        after = 0
        limit = until_sequence if until_sequence is not None else 2**62
        while True:
            page = self.conn.execute(
                f"SELECT {q.SQL_EVENT_COLUMNS} FROM events"
                " WHERE run_pk = ? AND seq > ? AND seq <= ? ORDER BY seq LIMIT 5000",
                (run_pk, after, limit),
            ).fetchall()
            if not page:
                return
            for row in page:
                yield _event(row)
            after = int(page[-1][0])

    def counters(self, run_pk: int) -> dict[str, int]:
        return {k: n for k, n in self.conn.execute(q.SQL_COUNTERS, (run_pk,))}

    def stale_open(self, run_pk: int, now_us: int) -> list[StaleOpen]:
        return [
            StaleOpen(bool(fp), labels, shard_labels, *map(int, sums))
            for fp, labels, shard_labels, *sums in self.conn.execute(
                q.SQL_STALE_OPEN, (run_pk, now_us)
            )
        ]

    def oldest_open_seen(self, run_pk: int) -> int | None:
        (oldest,) = self.conn.execute(q.SQL_OLDEST_OPEN_SEEN, (run_pk,)).fetchone()
        return None if oldest is None else int(oldest)

    def open_rows(self, run_pk: int) -> dict[str, OpenRow]:
        return {
            shard_id: OpenRow(
                deadline, seen, started, gpus, bool(known), saved, bool(fp), labels, shard_labels
            )
            for shard_id, deadline, seen, started, gpus, known, saved, fp, labels, shard_labels in (
                self.conn.execute(q.SQL_OPEN_ROWS, (run_pk,))
            )
        }

    def count_stale(self, run_pk: int, now_us: int) -> int:
        return int(self.conn.execute(q.SQL_COUNT_STALE, (run_pk, now_us)).fetchone()[0])

    def iter_shards(
        self,
        run_pk: int,
        *,
        states: Sequence[str] | None = None,
        after_index: tuple[int, str] | None = None,
    ) -> Iterator[ShardRow]:
        idx, sid = after_index if after_index else (-1, "")
        where = "s.run_pk = ? AND (s.plan_index, s.shard_id) > (?, ?)"
        params: list[object] = [run_pk, idx, sid]
        if states is not None:
            where += f" AND s.state IN ({','.join('?' * len(states))})"
            params.extend(states)
        cursor = self.conn.execute(
            f"SELECT s.shard_id, s.plan_index, s.state, s.detail, {q.SQL_DEADLINE}, s.plan_line,"
            f" s.record, b.beat_us, b.beat_step{q.SQL_SHARD_FROM}"
            f" WHERE {where} ORDER BY s.plan_index, s.shard_id",
            params,
        )
        while True:
            rows = cursor.fetchmany(2000)
            if not rows:
                return
            for row in rows:
                yield ShardRow(*row)

    def iter_resume(self, run_pk: int, now_us: int) -> Iterator[tuple[str, int, str, str]]:
        cursor = self.conn.execute(q.SQL_ITER_RESUME, [now_us, run_pk, *RESUME_STATES])
        while rows := cursor.fetchmany(2000):
            yield from rows

    def max_sequence(self) -> int:
        return int(self.conn.execute(q.SQL_MAX_SEQUENCE).fetchone()[0])

    def get_tombstone(self, run_pk: int) -> Tombstone | None:
        row = self.conn.execute(q.SQL_GET_TOMBSTONE, (run_pk,)).fetchone()
        return tombstone_of(row) if row else None

    def archived_with_rows(self) -> list[int]:
        return [int(pk) for (pk,) in self.conn.execute(q.SQL_ARCHIVED_WITH_ROWS)]
