"""The ledger beside its peers, in one run: in-process appends vs eventsourcing and raw SQLite.

    python -m tools.bench peers [--seconds S]

All in this process, one thread, no network, the same heartbeat-shaped events:

* ``ledger``: `LedgerService.append` on SQLite (validation, hash chain,
  projections in the same transaction, synchronous=FULL), 100 events per
  append and one per append;
* ``eventsourcing``: the Python library's Application on its SQLite
  persistence module, one aggregate per shard, 100 events per ``save`` and
  one per ``save`` (its defaults otherwise); skipped with a note when the
  package is missing (it is in the ``bench`` extra, not in ``test``);
* ``raw_sqlite``: the same rows and indexes inserted with executemany,
  1,000 rows per transaction, synchronous=FULL: the floor of the storage.

Each figure is events/s over the same count of events; the ratios are the
ledger's to each peer.
"""

from __future__ import annotations

import importlib
import os
import sqlite3
import tempfile
import time
from typing import Any

from ledger_server.events import AttemptStarted, Event, Heartbeat, ShardPlanned
from ledger_server.service import LedgerService
from ledger_server.store.sqlite import SqliteStore

SHARDS = 100


def _peer() -> tuple[Any, Any] | str:
    """Returns (Application, the shard aggregate class), or why the peer is skipped."""
    try:  # the peer is optional: the bench extra installs it
        application = importlib.import_module("eventsourcing.application")
        domain = importlib.import_module("eventsourcing.domain")
    except ImportError as exc:
        return f"skipped: eventsourcing is not installed ({exc.name}); pip install -e '.[bench]'"

    class ShardAggregate(domain.Aggregate):  # type: ignore[misc,name-defined]
        """A shard as an eventsourcing aggregate: its heartbeats are its events."""

        def __init__(self, shard_id: str) -> None:
            self.shard_id, self.step = shard_id, 0

        @domain.event("Heartbeat")  # type: ignore[untyped-decorator]
        def beat(self, step: int, progress: float, loss: float) -> None:
            self.step = step

    return application.Application, ShardAggregate


def _rate(events: int, seconds: float) -> float:
    return round(events / seconds) if seconds > 0 else 0.0


def _ledger_rate(tmp: str, events: int, per_append: int) -> float:
    store = SqliteStore(f"{tmp}/ledger-{per_append}.db")
    service = LedgerService(store)
    run = f"peers-{per_append}"

    def ev(i: int, shard: str, attempt: str, payload: Any) -> Event:
        return Event(f"{run}-{i}", "", run, shard, attempt, 1, payload)

    shards = [f"s{i}" for i in range(SHARDS)]
    service.append(
        [
            ev(i, s, "", ShardPlanned(f"/in/{s}", 1, "", "{}", (), "", i))
            for i, s in enumerate(shards)
        ]
    )
    service.append(
        [
            ev(SHARDS + i, s, "a", AttemptStarted("h", 1, 60_000_000, {}, ""))
            for i, s in enumerate(shards)
        ]
    )
    batches = [
        [
            ev(
                2 * SHARDS + b * per_append + j,
                shards[(b * per_append + j) % SHARDS],
                "a",
                Heartbeat(b, 0.5, {"loss": 0.1}),
            )
            for j in range(per_append)
        ]
        for b in range(events // per_append)
    ]
    start = time.perf_counter()
    for batch in batches:
        service.append(batch)
    elapsed = time.perf_counter() - start
    service.close()
    store.close()
    return _rate(len(batches) * per_append, elapsed)


def _eventsourcing_rate(peer: tuple[Any, Any], tmp: str, events: int, per_save: int) -> float:
    application, aggregate = peer
    app = application(
        env={
            "PERSISTENCE_MODULE": "eventsourcing.sqlite",
            "SQLITE_DBNAME": f"{tmp}/es-{per_save}.db",
        }
    )
    shards = [aggregate(f"s{i}") for i in range(SHARDS)]
    app.save(*shards)
    start = time.perf_counter()
    for b in range(events // per_save):
        touched = []
        for j in range(per_save):
            shard = shards[(b * per_save + j) % SHARDS]
            shard.beat(step=b, progress=0.5, loss=0.1)
            touched.append(shard)
        app.save(*touched)
    elapsed = time.perf_counter() - start
    app.close()
    return _rate(events // per_save * per_save, elapsed)


def _raw_sqlite_rate(tmp: str, events: int, row_bytes: int = 300) -> float:
    conn = sqlite3.connect(f"{tmp}/raw.db", isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute(
        "CREATE TABLE events (seq INTEGER PRIMARY KEY, run_pk INTEGER NOT NULL,"
        " run_seq INTEGER NOT NULL, event_id TEXT NOT NULL UNIQUE, row BLOB NOT NULL,"
        " hash BLOB NOT NULL)"
    )
    conn.execute("CREATE UNIQUE INDEX events_by_run ON events (run_pk, seq)")
    body = os.urandom(row_bytes)
    start = time.perf_counter()
    for base in range(0, events, 1000):
        conn.execute("BEGIN")
        conn.executemany(
            "INSERT INTO events (run_pk, run_seq, event_id, row, hash) VALUES (?, ?, ?, ?, ?)",
            [(1, base + i, f"id-{base + i}", body, os.urandom(32)) for i in range(1000)],
        )
        conn.execute("COMMIT")
    elapsed = time.perf_counter() - start
    conn.close()
    return _rate(events // 1000 * 1000, elapsed)


def bench_peers(seconds: float = 5.0) -> dict[str, Any]:
    """In-process events/s of the ledger, eventsourcing and raw SQLite, batched and single."""
    # Sizes that take about `seconds` each on the 2-core machine of docs/performance.md.
    batched, single = max(1000, int(seconds * 4000)), max(100, int(seconds * 200))
    out: dict[str, Any] = {
        "workload": f"in process, one thread: {batched} heartbeats in appends of 100,"
        f" {single} one per append; {SHARDS} shards",
    }
    with tempfile.TemporaryDirectory() as tmp:
        out["ledger_batched_events_per_s"] = _ledger_rate(tmp, batched, 100)
        out["ledger_single_events_per_s"] = _ledger_rate(tmp, single, 1)
        peer = _peer()
        if isinstance(peer, str):
            out["eventsourcing"] = peer
        else:
            es_batched = _eventsourcing_rate(peer, tmp, batched, 100)
            es_single = _eventsourcing_rate(peer, tmp, single, 1)
            out["eventsourcing"] = {
                "batched_events_per_s": es_batched,
                "single_events_per_s": es_single,
                "ledger_ratio_batched": round(out["ledger_batched_events_per_s"] / es_batched, 2),
                "ledger_ratio_single": round(out["ledger_single_events_per_s"] / es_single, 2),
            }
        raw = _raw_sqlite_rate(tmp, max(batched, 10_000))
        out["raw_sqlite_rows_per_s"] = raw
        out["ledger_batched_ratio_to_raw_sqlite"] = round(
            out["ledger_batched_events_per_s"] / raw, 3
        )
    return out
