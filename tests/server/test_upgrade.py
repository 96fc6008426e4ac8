"""A ledger written by release 0.1.0 keeps verifying after the upgrade, and its night reads right.

`tests/data/ledger-0.1.0.db` was written by release 0.1.0 (tools/gen/old_ledger.py):
its shard records are of format 1, which kept verdicts per (path, digest) for the
whole shard. The events are untouched by the upgrade; the records are rebuilt from
them, when a server starts or by `shardledger db migrate`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ledger_server.config import ServerConfig
from ledger_server.server import create_server
from ledger_server.store.sqlite import SqliteStore
from ledger_server.upgrade import stale_runs
from shard_client import LedgerClient
from tests.builders import run_cli

OLD = Path(__file__).parents[1] / "data" / "ledger-0.1.0.db"
RUN = "night-0.1.0"


@pytest.fixture
def old_db(tmp_path: Path) -> Path:
    copy = tmp_path / "ledger.db"
    shutil.copyfile(OLD, copy)
    return copy


def test_the_old_ledger_is_of_the_old_record_format(old_db: Path) -> None:
    store = SqliteStore(str(old_db))
    try:
        assert [r.run_id for r in stale_runs(store)] == [RUN]
    finally:
        store.close()


def test_a_server_start_rebuilds_old_records_and_the_night_reads_by_the_new_rules(
    old_db: Path, capsys: pytest.CaptureFixture[str], quiet_logs: None
) -> None:
    code, out, _ = run_cli(capsys, "audit", "verify", RUN, "--db", str(old_db))
    assert code == 0, out  # the chain of the old rows holds before
    running = create_server(ServerConfig(database=str(old_db), listen="127.0.0.1:0"))
    try:
        target = f"127.0.0.1:{running.port}"
        summary = json.loads(LedgerClient(target).summary(RUN))
        states = {v.shard_id: v.state for v in LedgerClient(target).shards(RUN)}
    finally:
        running.stop(0)
    # s1's rerun wrote the bytes whose first commit failed: the rerun is unverified, not
    # failed by the old verdict; s4's outside_root verdict (a wrong --root) counts for nothing.
    assert states == {
        "s0": "verified",
        "s1": "unverified",
        "s2": "failed",
        "s3": "missing",
        "s4": "unverified",
    }
    assert summary["repairs"] == 1
    assert summary["first_pass"]["closed"]
    assert summary["first_pass"]["silent_errors"] == 2  # s1's digest mismatch, s2's swallowed error
    code, out, _ = run_cli(capsys, "audit", "verify", RUN, "--db", str(old_db))
    assert code == 0, out  # the events were not touched
    code, out, _ = run_cli(
        capsys, "db", "rebuild", "--check", "--database-url", f"sqlite:///{old_db}"
    )
    assert code == 0, out
    assert "consistent" in out


def test_db_migrate_upgrades_old_records_without_a_server(
    old_db: Path, capsys: pytest.CaptureFixture[str], quiet_logs: None
) -> None:
    url = f"sqlite:///{old_db}"
    code, out, _ = run_cli(capsys, "db", "rebuild", "--check", "--database-url", url)
    assert code == 1 and "differ" in out  # format-1 records are not what a replay builds now
    code, out, _ = run_cli(capsys, "db", "migrate", "--database-url", url, "--json")
    assert code == 0
    assert json.loads(out)["runs_upgraded"] == [f"default/{RUN}"]
    code, out, _ = run_cli(capsys, "db", "rebuild", "--check", "--database-url", url)
    assert code == 0 and "consistent" in out
    code, out, _ = run_cli(capsys, "db", "migrate", "--database-url", url, "--json")
    assert json.loads(out)["runs_upgraded"] == []  # nothing left to upgrade


def test_a_run_the_upgrade_must_refuse_is_left_as_it_was_and_the_server_still_starts(
    old_db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import sqlite3

    import structlog.testing

    # Someone edited a stored row: its chain no longer holds, so no replay may vouch for it.
    conn = sqlite3.connect(old_db)
    try:
        conn.execute("DROP TRIGGER IF EXISTS events_no_update")
        conn.execute("UPDATE events SET hash = zeroblob(32) WHERE seq = 3")
        conn.commit()
    finally:
        conn.close()
    with structlog.testing.capture_logs() as logs:
        running = create_server(ServerConfig(database=str(old_db), listen="127.0.0.1:0"))
        running.stop(0)
    refused = [e for e in logs if e["event"] == "projections_upgrade_refused"]
    assert [e["run_id"] for e in refused] == [RUN]
    store = SqliteStore(str(old_db))
    try:
        assert [r.run_id for r in stale_runs(store)] == [RUN]  # nothing was rewritten
    finally:
        store.close()
