"""The SQLite schema (numbered migrations) and every statement the store runs, by name."""

from __future__ import annotations

from typing import Final

from ledger_server import formats
from ledger_server.states import RESUME_STATES
from ledger_server.store.resume_sql import resume_reason_sql

# Each migration is a list of statements applied in one transaction together
# with its row in schema_migrations, so a crash leaves either all or none.
MIGRATIONS: Final[list[tuple[int, str, list[str]]]] = [
    (
        1,
        "events, runs, shard projections, counters",
        [
            """CREATE TABLE runs (
                run_pk INTEGER PRIMARY KEY,
                namespace TEXT NOT NULL,
                run_id TEXT NOT NULL,
                event_count INTEGER NOT NULL,
                head_hash BLOB NOT NULL,
                created_us INTEGER NOT NULL,
                updated_us INTEGER NOT NULL,
                UNIQUE (namespace, run_id))""",
            """CREATE TABLE events (
                seq INTEGER PRIMARY KEY,
                run_pk INTEGER NOT NULL REFERENCES runs (run_pk),
                run_seq INTEGER NOT NULL,
                event_id TEXT NOT NULL UNIQUE,
                row BLOB NOT NULL,
                hash BLOB NOT NULL)""",
            "CREATE UNIQUE INDEX events_by_run ON events (run_pk, seq)",
            """CREATE TRIGGER events_no_update BEFORE UPDATE ON events
               BEGIN SELECT RAISE(ABORT, 'events are append-only: UPDATE refused'); END""",
            """CREATE TRIGGER events_no_delete BEFORE DELETE ON events
               BEGIN SELECT RAISE(ABORT, 'events are append-only: DELETE refused'); END""",
            """CREATE TABLE shards (
                run_pk INTEGER NOT NULL,
                shard_id TEXT NOT NULL,
                plan_index INTEGER NOT NULL,
                state TEXT NOT NULL,
                detail TEXT NOT NULL,
                deadline_us INTEGER,
                plan_line TEXT NOT NULL,
                record BLOB NOT NULL,
                PRIMARY KEY (run_pk, shard_id)) WITHOUT ROWID""",
            "CREATE INDEX shards_by_state ON shards (run_pk, state, deadline_us)",
            "CREATE INDEX shards_by_plan ON shards (run_pk, plan_index, shard_id)",
            """CREATE TABLE run_counters (
                run_pk INTEGER NOT NULL,
                key TEXT NOT NULL,
                n INTEGER NOT NULL,
                PRIMARY KEY (run_pk, key)) WITHOUT ROWID""",
        ],
    ),
    (
        2,
        "access tokens (hashes only)",
        [
            """CREATE TABLE tokens (
                token_id TEXT PRIMARY KEY,
                namespace TEXT NOT NULL,
                role TEXT NOT NULL,
                run_prefix TEXT NOT NULL,
                secret_hash TEXT NOT NULL,
                description TEXT NOT NULL,
                created_us INTEGER NOT NULL,
                expires_us INTEGER,
                revoked_us INTEGER)""",
        ],
    ),
    (
        3,
        "shard heartbeats in a narrow table; a plan-order index that holds the state",
        [
            # One row per shard whose latest write was a heartbeat; a full save of the
            # shard's record deletes it. Narrow rows keep a busy fleet's commits small.
            """CREATE TABLE shard_beats (
                run_pk INTEGER NOT NULL,
                shard_id TEXT NOT NULL,
                deadline_us INTEGER,
                beat_us INTEGER NOT NULL,
                beat_step INTEGER NOT NULL,
                PRIMARY KEY (run_pk, shard_id)) WITHOUT ROWID""",
            # Plan order with the state in the index: a resume list or a state filter
            # skips the shards it does not want without reading their (wide) rows.
            "CREATE INDEX shards_by_plan_state ON shards (run_pk, plan_index, shard_id, state)",
            "DROP INDEX shards_by_plan",
        ],
    ),
    (
        4,
        "shard rows in a rowid table: records stay on their page",
        [
            # A WITHOUT ROWID table keeps at most ~1,000 bytes of a row on a 4 KiB page;
            # a shard's record is 1-2 KB, so every row spilled into its own overflow page
            # (4 KiB per shard, and 4x the write time). A rowid table keeps ~4 KB locally.
            """CREATE TABLE shards_v4 (
                run_pk INTEGER NOT NULL,
                shard_id TEXT NOT NULL,
                plan_index INTEGER NOT NULL,
                state TEXT NOT NULL,
                detail TEXT NOT NULL,
                deadline_us INTEGER,
                plan_line TEXT NOT NULL,
                record BLOB NOT NULL,
                UNIQUE (run_pk, shard_id))""",
            "INSERT INTO shards_v4 (run_pk, shard_id, plan_index, state, detail, deadline_us,"
            " plan_line, record) SELECT run_pk, shard_id, plan_index, state, detail, deadline_us,"
            " plan_line, record FROM shards ORDER BY run_pk, plan_index, shard_id",
            "DROP TABLE shards",
            "ALTER TABLE shards_v4 RENAME TO shards",
            # The shard id rides along (a WITHOUT ROWID index had it as the key): the
            # stale count joins the heartbeat rows on it without reading the wide rows.
            "CREATE INDEX shards_by_state ON shards (run_pk, state, deadline_us, shard_id)",
            "CREATE INDEX shards_by_plan_state ON shards (run_pk, plan_index, shard_id, state)",
        ],
    ),
    (
        5,
        "the plan-order index covers the resume list",
        [
            # The resume list reads these columns of every unconfirmed shard in plan order.
            # From the index alone that is a sequential scan; through the table it is one
            # row lookup per shard, scattered over ~1.5 KB rows (2-3x the time at 1M).
            "DROP INDEX shards_by_plan_state",
            "CREATE INDEX shards_by_plan_state ON shards"
            " (run_pk, plan_index, shard_id, state, detail, deadline_us, plan_line)",
        ],
    ),
    (
        6,
        "run tombstones: an archived run's events leave the hot store",
        [
            """CREATE TABLE run_archives (
                run_pk INTEGER PRIMARY KEY REFERENCES runs (run_pk),
                location TEXT NOT NULL,
                digest TEXT NOT NULL,
                event_count INTEGER NOT NULL,
                head_hash BLOB NOT NULL,
                first_seq INTEGER NOT NULL,
                last_seq INTEGER NOT NULL,
                size_bytes INTEGER NOT NULL,
                tree_head TEXT NOT NULL,
                summary TEXT NOT NULL,
                report TEXT NOT NULL,
                labels TEXT NOT NULL,
                archived_us INTEGER NOT NULL)""",
            # Events stay append-only, except the rows of a run whose tombstone stands:
            # the archive's transaction writes the tombstone first, then deletes them.
            "DROP TRIGGER events_no_delete",
            """CREATE TRIGGER events_no_delete BEFORE DELETE ON events
               WHEN NOT EXISTS (SELECT 1 FROM run_archives WHERE run_pk = OLD.run_pk)
               BEGIN SELECT RAISE(ABORT, 'events are append-only: DELETE refused'); END""",
            """CREATE TRIGGER run_archives_no_update BEFORE UPDATE ON run_archives
               BEGIN SELECT RAISE(ABORT, 'tombstones are immutable: UPDATE refused'); END""",
            # A tombstone goes only with its run's events back in place (restore).
            """CREATE TRIGGER run_archives_no_delete BEFORE DELETE ON run_archives
               WHEN (SELECT COUNT(*) FROM events WHERE run_pk = OLD.run_pk) != OLD.event_count
               BEGIN SELECT RAISE(ABORT,
                 'tombstones stay until their run''s events are restored: DELETE refused'); END""",
        ],
    ),
    (
        7,
        "open attempts in a narrow table: scrapes and reports sum them without a parse",
        [
            # One row per running shard (its open latest attempt), written with its shard
            # row and moved by its heartbeats. A report or a scrape adds the writer's sums
            # (run_counters) and finds what went stale by a range on the deadline; the
            # rows are filled by the record format 8 upgrade (a replay of each run).
            """CREATE TABLE shard_open (
                run_pk INTEGER NOT NULL,
                shard_id TEXT NOT NULL,
                deadline_us INTEGER,
                seen_us INTEGER NOT NULL,
                started_us INTEGER NOT NULL,
                gpus INTEGER NOT NULL,
                gpus_known INTEGER NOT NULL,
                saved_us INTEGER NOT NULL,
                first_pass INTEGER NOT NULL,
                labels TEXT NOT NULL,
                shard_labels TEXT NOT NULL,
                PRIMARY KEY (run_pk, shard_id)) WITHOUT ROWID""",
            "CREATE INDEX shard_open_by_deadline ON shard_open (run_pk, deadline_us)",
            "CREATE INDEX shard_open_by_seen ON shard_open (run_pk, seen_us)",
        ],
    ),
]
formats.check_schema("SQLite", MIGRATIONS, formats.SQLITE_SCHEMA)
SQL_TOKEN_COLUMNS: Final = "token_id, namespace, role, run_prefix, secret_hash, description, created_us, expires_us, revoked_us"

# A run row as RunRow reads it: its head, and whether a tombstone stands in for its events.
SQL_RUN_COLUMNS: Final = (
    "run_pk, namespace, run_id, event_count, head_hash, created_us, updated_us,"
    " EXISTS (SELECT 1 FROM run_archives AS a WHERE a.run_pk = runs.run_pk)"
)
SQL_GET_RUN: Final = f"SELECT {SQL_RUN_COLUMNS} FROM runs WHERE namespace = ? AND run_id = ?"
SQL_LIST_RUNS: Final = (
    f"SELECT {SQL_RUN_COLUMNS}"
    " FROM runs WHERE (? IS NULL OR namespace = ?) ORDER BY updated_us DESC, run_pk DESC LIMIT ?"
)
# Sequences are never reused: an archived run's were taken, and restore puts its rows back
# under them, so the next one is past every stored and every archived sequence.
SQL_MAX_SEQUENCE: Final = (
    "SELECT MAX(COALESCE((SELECT MAX(seq) FROM events), 0),"
    " COALESCE((SELECT MAX(last_seq) FROM run_archives), 0))"
)
SQL_TOMBSTONE_COLUMNS: Final = (
    "run_pk, location, digest, event_count, head_hash, first_seq, last_seq, size_bytes,"
    " tree_head, summary, report, labels, archived_us"
)
SQL_GET_TOMBSTONE: Final = f"SELECT {SQL_TOMBSTONE_COLUMNS} FROM run_archives WHERE run_pk = ?"
SQL_INSERT_TOMBSTONE: Final = (
    f"INSERT INTO run_archives ({SQL_TOMBSTONE_COLUMNS}) VALUES ({', '.join('?' * 13)})"
)
SQL_DELETE_TOMBSTONE: Final = "DELETE FROM run_archives WHERE run_pk = ?"
SQL_RUN_HEAD: Final = "SELECT event_count, head_hash FROM runs WHERE run_pk = ?"
# An archived run's rows, all of them at once: what restore clears before it writes the
# bundle's rows back (a purge a crash cut short may have left some).
SQL_ARCHIVE_DELETES: Final = (
    "DELETE FROM shard_open WHERE run_pk = ?",
    "DELETE FROM shard_beats WHERE run_pk = ?",
    "DELETE FROM shards WHERE run_pk = ?",
    "DELETE FROM events WHERE run_pk = ?",
)
# Once its tombstone stands, an archived run's rows are dead: purge deletes them a bounded
# number (?2) at a time, each its own short transaction, so appends wait for one chunk at
# most. Only under a tombstone (the events trigger checks it too): a hot run's rows never go.
_UNDER_TOMBSTONE: Final = "EXISTS (SELECT 1 FROM run_archives WHERE run_pk = ?1)"
SQL_PURGE_ARCHIVED: Final = (
    f"DELETE FROM shard_beats WHERE run_pk = ?1 AND {_UNDER_TOMBSTONE} AND shard_id IN"
    " (SELECT shard_id FROM shard_beats WHERE run_pk = ?1 LIMIT ?2)",
    f"DELETE FROM shards WHERE run_pk = ?1 AND {_UNDER_TOMBSTONE} AND shard_id IN"
    " (SELECT shard_id FROM shards WHERE run_pk = ?1 LIMIT ?2)",
    f"DELETE FROM events WHERE {_UNDER_TOMBSTONE} AND seq IN"
    " (SELECT seq FROM events WHERE run_pk = ?1 ORDER BY seq LIMIT ?2)",
)
# Archived runs whose purge is not finished (a crash cut it short): a restart finishes it.
SQL_ARCHIVED_WITH_ROWS: Final = (
    "SELECT a.run_pk FROM run_archives AS a"
    " WHERE EXISTS (SELECT 1 FROM events AS e WHERE e.run_pk = a.run_pk)"
    " OR EXISTS (SELECT 1 FROM shards AS s WHERE s.run_pk = a.run_pk)"
    " OR EXISTS (SELECT 1 FROM shard_beats AS b WHERE b.run_pk = a.run_pk)"
    " ORDER BY a.run_pk"
)
SQL_RESTORE_EVENTS: Final = (
    "INSERT INTO events (seq, run_pk, run_seq, event_id, row, hash) VALUES {values}"
)
SQL_UPDATE_RUN: Final = (
    "UPDATE runs SET event_count = ?, head_hash = ?, updated_us = ? WHERE run_pk = ?"
)
SQL_INSERT_RUN: Final = (
    "INSERT INTO runs (run_pk, namespace, run_id, event_count, head_hash, created_us, updated_us)"
    " VALUES (?, ?, ?, ?, ?, ?, ?)"
)
# Buffered writes go out as multi-row statements ({values} is repeated "(?, ...)" groups):
# Python's sqlite3 releases and retakes the GIL around every row of an executemany, and
# with the server's request threads busy each retake can wait a whole switch interval,
# so one statement per few hundred rows is many times faster under load.
SQL_INSERT_EVENTS: Final = (
    "INSERT INTO events (seq, run_pk, run_seq, event_id, row, hash) VALUES {values}"
)
SQL_EVENT_COLUMNS: Final = "seq, run_pk, run_seq, event_id, row, hash"
SQL_LIST_EVENTS: Final = (
    f"SELECT {SQL_EVENT_COLUMNS} FROM events WHERE run_pk = ? AND seq > ? ORDER BY seq LIMIT ?"
)
# An upsert updates the row in place, touching only the indexes whose columns changed;
# INSERT OR REPLACE would delete and re-insert the row in every index.
SQL_SAVE_SHARDS: Final = (
    "INSERT INTO shards"
    " (run_pk, shard_id, plan_index, state, detail, deadline_us, plan_line, record)"
    " VALUES {values}"
    " ON CONFLICT (run_pk, shard_id) DO UPDATE SET plan_index = excluded.plan_index,"
    " state = excluded.state, detail = excluded.detail, deadline_us = excluded.deadline_us,"
    " plan_line = excluded.plan_line, record = excluded.record"
)
SQL_SAVE_BEATS: Final = (
    "INSERT INTO shard_beats (run_pk, shard_id, deadline_us, beat_us, beat_step)"
    " VALUES {values} ON CONFLICT (run_pk, shard_id) DO UPDATE SET"
    " deadline_us = excluded.deadline_us, beat_us = excluded.beat_us,"
    " beat_step = excluded.beat_step"
)
SQL_CLEAR_BEATS: Final = "DELETE FROM shard_beats WHERE (run_pk, shard_id) IN (VALUES {values})"
# A shard's row as readers see it: the heartbeat row, when there is one, is the newer
# deadline and liveness (see projections.record_from_row).
SQL_SHARD_FROM: Final = (
    " FROM shards AS s LEFT JOIN shard_beats AS b"
    " ON b.run_pk = s.run_pk AND b.shard_id = s.shard_id"
)
SQL_DEADLINE: Final = "CASE WHEN b.run_pk IS NULL THEN s.deadline_us ELSE b.deadline_us END"
# The same deadline without the join, for the resume list (it needs no record), which
# asks only for a running shard's: its heartbeat row's when there is one.
SQL_RUNNING_DEADLINE: Final = (
    "COALESCE((SELECT b.deadline_us FROM shard_beats AS b"
    " WHERE b.run_pk = s.run_pk AND b.shard_id = s.shard_id), s.deadline_us)"
)
SQL_ITER_RESUME: Final = (
    f"SELECT s.shard_id, s.plan_index, s.plan_line, {resume_reason_sql(SQL_RUNNING_DEADLINE, '?1')}"
    f" FROM shards AS s WHERE s.run_pk = ?2 AND s.state IN ({', '.join('?' * len(RESUME_STATES))})"
    " ORDER BY s.plan_index, s.shard_id"
)
SQL_ADD_COUNTERS: Final = (
    "INSERT INTO run_counters (run_pk, key, n) VALUES {values}"
    " ON CONFLICT (run_pk, key) DO UPDATE SET n = n + excluded.n"
)
SQL_COUNTERS: Final = "SELECT key, n FROM run_counters WHERE run_pk = ? AND n != 0"
SQL_COUNTER: Final = "SELECT n FROM run_counters WHERE run_pk = ? AND key = ?"
# Every running shard has its open attempt row, with the deadline its heartbeats moved:
# the stale ones are a range of the deadline index, not a pass over the running shards.
SQL_COUNT_STALE: Final = "SELECT COUNT(*) FROM shard_open WHERE run_pk = ? AND deadline_us < ?"
SQL_OPEN_COLUMNS: Final = (
    "deadline_us, seen_us, started_us, gpus, gpus_known, saved_us, first_pass, labels, shard_labels"
)
SQL_SAVE_OPEN: Final = (
    f"INSERT INTO shard_open (run_pk, shard_id, {SQL_OPEN_COLUMNS}) VALUES {{values}}"
    " ON CONFLICT (run_pk, shard_id) DO UPDATE SET deadline_us = excluded.deadline_us,"
    " seen_us = excluded.seen_us, started_us = excluded.started_us, gpus = excluded.gpus,"
    " gpus_known = excluded.gpus_known, saved_us = excluded.saved_us,"
    " first_pass = excluded.first_pass, labels = excluded.labels,"
    " shard_labels = excluded.shard_labels"
)
SQL_CLEAR_OPEN: Final = "DELETE FROM shard_open WHERE (run_pk, shard_id) IN (VALUES {values})"
# A heartbeat moves only the deadline and the last-seen time of a row that exists.
SQL_TOUCH_OPEN: Final = (
    "UPDATE shard_open SET deadline_us = t.column3, seen_us = t.column4"
    " FROM (VALUES {values}) AS t"
    " WHERE shard_open.run_pk = t.column1 AND shard_open.shard_id = t.column2"
)
# The same sums as field.add_open over each stale attempt (span never below 0).
SQL_STALE_OPEN: Final = (
    "SELECT first_pass, labels, shard_labels, COUNT(*),"
    " SUM(gpus * MAX(0, seen_us - started_us)), SUM(1 - gpus_known),"
    " SUM(MAX(0, deadline_us - saved_us))"
    " FROM shard_open WHERE run_pk = ? AND deadline_us < ?"
    " GROUP BY first_pass, labels, shard_labels"
)
SQL_OLDEST_OPEN_SEEN: Final = "SELECT MIN(seen_us) FROM shard_open WHERE run_pk = ?"
SQL_OPEN_ROWS: Final = f"SELECT shard_id, {SQL_OPEN_COLUMNS} FROM shard_open WHERE run_pk = ?"
SQL_HAS_MIGRATIONS: Final = (
    "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_migrations'"
)
