"""`shardledger export RUN --sqlite OUT.db`: a tidy analysis database for sqlite-utils / Datasette.

Tables (docs/analysis.md lists every column): runs, shards, attempts, artifacts,
checkpoints, verdicts, events, and analysis_meta. Each export replaces that run's
rows in one transaction, so exporting several runs into one file builds a
database to compare nights and platforms; a file that is not an analysis
database (a ledger, say) is refused untouched.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
from typing import Any, Final

from shard_client.labels import WELL_KNOWN_LABELS
from shardledger_cli.cli import EXIT_OK, CommandError, client_from
from shardledger_cli.output import print_json
from shardledger_cli.run_data import RunData, load_run, shard_rows

__all__ = ["ANALYSIS_FORMAT", "TABLES", "run_export_sqlite", "write_analysis_db"]

ANALYSIS_FORMAT: Final = "shardledger-analysis-v1"
# Primary keys; every table but runs also carries run_id, so one file holds many runs.
TABLES: Final[dict[str, tuple[str, ...]]] = {
    "runs": ("run_id",),
    "shards": ("run_id", "shard_id"),
    "attempts": ("run_id", "attempt_id"),
    "artifacts": ("sequence",),
    "checkpoints": ("sequence",),
    "verdicts": ("sequence",),
    "events": ("sequence",),
}
INDEXES: Final = (
    ("shards", ("run_id", "state")),
    ("attempts", ("run_id", "shard_id")),
    ("artifacts", ("run_id", "shard_id")),
    ("verdicts", ("run_id", "shard_id")),
    ("events", ("run_id", "run_sequence")),
)


def run_row(data: RunData) -> dict[str, Any]:
    """Returns the run's one row: its labels, the summary's figures and the first pass's."""
    s, t = data.summary, data.tables
    row: dict[str, Any] = {
        "run_id": data.run_id,
        "namespace": s["namespace"],
        "labels": json.dumps(t.labels, sort_keys=True),
    }
    row |= {key: t.labels.get(key, "") for key in WELL_KNOWN_LABELS}
    row |= {"first_event_us": t.first_us or None, "last_event_us": t.last_us or None}
    row |= {k: v for k, v in s.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    fp = s.get("first_pass") or {}
    row |= {f"first_pass_{k}": v for k, v in fp.items() if isinstance(v, int | float)}
    for key in ("failure_tags", "verify_failures", "fingerprint_groups", "duplicates"):
        row[key] = json.dumps(s.get(key) or {}, sort_keys=True)
    return row


def _check_target(db: sqlite3.Connection, path: str) -> None:
    """Refuses a file that holds tables but is not an analysis database."""
    try:
        names = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not names:
            return
        fmt = (
            db.execute("SELECT value FROM analysis_meta WHERE key = 'format'").fetchone()
            if "analysis_meta" in names
            else None
        )
    except sqlite3.DatabaseError as exc:
        raise CommandError(f"{path} is not a SQLite database ({exc}); nothing written") from None
    if fmt is None or fmt[0] != ANALYSIS_FORMAT:
        raise CommandError(
            f"{path} holds tables but is not a shardledger analysis database"
            " (no analysis_meta); refusing to write into it (pick a new file)"
        )


def write_analysis_db(path: str, data: RunData) -> dict[str, int]:
    """Writes (replaces) one run's rows in the analysis database; returns rows per table."""
    import sqlite_utils

    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise CommandError(f"cannot write {path}: no directory {parent}")
    try:
        conn = sqlite3.connect(path)
    except sqlite3.Error as exc:
        raise CommandError(f"cannot open {path}: {exc}") from None
    try:
        _check_target(conn, path)
        db = sqlite_utils.Database(conn)
        rows = {
            "runs": [run_row(data)],
            "shards": shard_rows(data),
            "attempts": data.tables.attempt_rows(),
            "artifacts": data.tables.artifacts,
            "checkpoints": data.tables.checkpoints,
            "verdicts": data.tables.verdicts,
            "events": data.tables.events,
        }
        # One transaction: a run's rows are replaced whole or not at all.
        with conn:
            db.table("analysis_meta").insert_all(
                [{"key": "format", "value": ANALYSIS_FORMAT}], pk="key", replace=True
            )
            for table, pk in TABLES.items():
                if db.table(table).exists():
                    db.table(table).delete_where("run_id = ?", [data.run_id])
                if rows[table]:
                    db.table(table).insert_all(rows[table], pk=pk, alter=True, replace=True)
            for table, columns in INDEXES:
                if db.table(table).exists():
                    db.table(table).create_index(columns, if_not_exists=True)
    except sqlite3.Error as exc:
        raise CommandError(f"cannot write {path}: {exc}; nothing of this run written") from None
    finally:
        conn.close()
    return {table: len(r) for table, r in rows.items()}


def run_export_sqlite(args: argparse.Namespace) -> int:
    """Fetches the run and writes its rows into the analysis database --sqlite names."""
    data = load_run(client_from(args), args.run, namespace=args.namespace, keep_events=True)
    counts = write_analysis_db(args.sqlite, data)
    if args.json:
        print_json({"run_id": data.run_id, "database": args.sqlite, "rows": counts})
    else:
        shown = ", ".join(f"{n} {t}" for t, n in counts.items())
        print(f"wrote run {data.run_id} into {args.sqlite}: {shown}")
    print(
        "  try: sqlite-utils query " + args.sqlite + ' "select state, count(*) from shards'
        ' group by state"',
        file=sys.stderr,
    )
    return EXIT_OK
