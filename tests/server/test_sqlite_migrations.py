"""A SQLite ledger written by an older release opens under this one with the same answers.

The file is written at schema version 3 (shard rows in a WITHOUT ROWID table) by a
real server, then opened by the current code, which applies migration 4 (shard rows
in a rowid table, so a 1-2 KB record no longer spills into an overflow page) and
migration 5 (the plan-order index covers the resume list).
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from ledger_server.config import ServerConfig
from ledger_server.server import create_server
from ledger_server.store import sqlite_sql
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from tests.builders import committed, event, planned, started


def _write_and_read(path: Path, *, write: bool) -> dict[str, Any]:
    """Serves the file; optionally writes a night first; returns what a user reads."""
    running = create_server(ServerConfig(database=str(path), listen="127.0.0.1:0"))
    client = LedgerClient(f"127.0.0.1:{running.port}", timeout_s=10)
    try:
        if write:
            client.append([planned("night", f"s{i}", index=i) for i in range(5)])
            client.append([started("night", f"s{i}", "a1") for i in range(1, 5)])
            client.append([committed("night", "s2", "a1"), committed("night", "s3", "a1")])
            client.append(
                [event("night", "s4", "a1", heartbeat=pb.Heartbeat(step=7, progress=0.5))]
            )
        summary = json.loads(client.summary("night"))
        summary.pop("as_of_us")
        return {
            "summary": summary,
            "shards": [json.loads(s.view_json) for s in client.shards("night")],
            "resume": [(e.shard_id, e.reason) for e in client.resume("night")],
        }
    finally:
        client.close()
        running.stop(0.5)


def _shards_ddl(path: Path) -> str:
    with sqlite3.connect(path) as conn:
        (ddl,) = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'shards'").fetchone()
        return str(ddl)


def test_a_version_3_file_migrates_to_rowid_shard_rows_with_the_same_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ledger.db"
    with monkeypatch.context() as old_release:
        # Version 3, plus the tombstone table (6), which every run query of this release
        # reads, and the open attempts table (7), which its writer fills; they touch
        # neither shards table, so 4 and 5 migrate as they did.
        old_release.setattr(
            sqlite_sql, "MIGRATIONS", sqlite_sql.MIGRATIONS[:3] + sqlite_sql.MIGRATIONS[5:7]
        )
        before = _write_and_read(path, write=True)
    assert "WITHOUT ROWID" in _shards_ddl(path)

    after = _write_and_read(path, write=False)
    assert after == before
    assert "WITHOUT ROWID" not in _shards_ddl(path)
    with sqlite3.connect(path) as conn:
        versions = [v for (v,) in conn.execute("SELECT version FROM schema_migrations")]
        indexes = {n for (n,) in conn.execute("SELECT name FROM sqlite_master WHERE type='index'")}
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert sorted(versions) == [1, 2, 3, 4, 5, 6, 7]
    assert {"shards_by_state", "shards_by_plan_state"} <= indexes
    # The migrated table takes the writes that follow: a full save and a heartbeat row.
    running = create_server(ServerConfig(database=str(path), listen="127.0.0.1:0"))
    client = LedgerClient(f"127.0.0.1:{running.port}", timeout_s=10)
    try:
        client.append([committed("night", "s4", "a1")])
        client.append([event("night", "s1", "a1", heartbeat=pb.Heartbeat(step=3, progress=0.1))])
        views = {
            v["shard_id"]: v for v in (json.loads(s.view_json) for s in client.shards("night"))
        }
        assert views["s4"]["state"] == "unverified"
        assert views["s1"]["last_step"] == 3
    finally:
        client.close()
        running.stop(0.5)
