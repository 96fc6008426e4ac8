"""Commands that only read a ledger file never write one: an empty or foreign file is refused.

`audit verify --db F` and `db rebuild --check --db F` once wrote a full schema into a
0-byte file (0 -> 65,536 bytes) and exited 0. Each case checksums the file (and
lists its directory) before and after the command. The read commands that take --db
(status, shards, resume, events, runs, report, trend, export, verify --dry-run) open
the file read-only and refuse the same files with the same words.
"""

from __future__ import annotations

import hashlib
import shutil
import sqlite3
from pathlib import Path

import pytest

from shard_client.client import LedgerClient
from tests.builders import committed, planned, run_cli, started

READS = [
    pytest.param(("audit", "verify", "--db"), id="audit-verify"),
    pytest.param(("db", "rebuild", "--check", "--db"), id="db-rebuild-check"),
    pytest.param(("audit", "replay", "run-1", "--until", "5", "--db"), id="audit-replay"),
]
# The read commands with --db (tools/shardledger_cli/local_ledger.py); the file's path follows.
READ_COMMANDS = [
    pytest.param(("status", "run-1", "--db"), id="status"),
    pytest.param(("shards", "run-1", "--db"), id="shards"),
    pytest.param(("resume", "run-1", "--db"), id="resume"),
    pytest.param(("events", "run-1", "--db"), id="events"),
    pytest.param(("runs", "--db"), id="runs"),
    pytest.param(("report", "run-1", "--db"), id="report"),
    pytest.param(("report", "--by", "provider", "--db"), id="report-by"),
    pytest.param(("trend", "--db"), id="trend"),
    pytest.param(("export", "run-1", "--db"), id="export"),
    pytest.param(("verify", "run-1", "--dry-run", "--db"), id="verify-dry-run"),
]
READS += READ_COMMANDS


def snapshot(path: Path) -> tuple[list[str], str]:
    """Returns the directory's names and the file's sha256."""
    return sorted(p.name for p in path.parent.iterdir()), hashlib.sha256(
        path.read_bytes()
    ).hexdigest()


@pytest.mark.parametrize("argv", READS)
def test_an_empty_file_is_refused_with_exit_5_and_left_empty(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...]
) -> None:
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    before = snapshot(empty)
    code, out, err = run_cli(capsys, *argv, str(empty))
    assert code == 5, out + err
    assert "empty" in err and str(empty) in err
    assert snapshot(empty) == before and empty.stat().st_size == 0


@pytest.mark.parametrize("argv", READS)
def test_a_foreign_sqlite_database_is_refused_and_left_as_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...]
) -> None:
    other = tmp_path / "inventory.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE parts (id INTEGER PRIMARY KEY, name TEXT)")
        conn.execute("INSERT INTO parts (name) VALUES ('bolt')")
    conn.close()
    before = snapshot(other)
    code, out, err = run_cli(capsys, *argv, str(other))
    assert code == 5, out + err
    assert "without the ledger's tables" in err
    assert snapshot(other) == before


def test_reading_a_real_ledger_changes_none_of_its_bytes(
    client: LedgerClient, db_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client.append([planned(), started(), committed()])
    copy = tmp_path / "copy" / "ledger.db"
    copy.parent.mkdir()
    with sqlite3.connect(db_path) as source, sqlite3.connect(copy) as target:
        source.backup(target)  # a consistent copy, checkpointed, that no server holds open
    source.close()
    target.close()
    before = snapshot(copy)
    for argv in (("audit", "verify", "--db"), ("db", "rebuild", "--check", "--db")):
        code, out, err = run_cli(capsys, *argv, str(copy))
        assert code == 0, out + err
    assert snapshot(copy)[1] == before[1]


@pytest.mark.parametrize("argv", READ_COMMANDS)
def test_a_read_command_on_a_real_ledger_leaves_the_file_and_its_directory_as_they_were(
    client: LedgerClient,
    db_path: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: tuple[str, ...],
) -> None:
    client.append([planned(), started(), committed()])
    copy = tmp_path / "copy" / "ledger.db"
    copy.parent.mkdir()
    with sqlite3.connect(db_path) as source, sqlite3.connect(copy) as target:
        source.backup(target)
    source.close()
    target.close()
    # export signs the run's head with the ledger's key, which lives beside the file.
    shutil.copyfile(f"{db_path}.signing-key.pem", f"{copy}.signing-key.pem")
    before = snapshot(copy)
    code, out, err = run_cli(capsys, *argv, str(copy))
    # verify exits 5 here, having read nothing: the run's one artifact lies outside any --root.
    assert code in ((0, 1, 5) if argv[0] == "verify" else (0, 1)), out + err
    assert "no ledger" not in err
    # Not even SQLite's -wal and -shm files appear beside it (and no writer -lock).
    assert snapshot(copy) == before
