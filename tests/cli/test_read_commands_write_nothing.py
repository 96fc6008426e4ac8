"""Commands that only read a ledger file never write one: an empty or foreign file is refused.

`audit verify --db F` and `db rebuild --check --db F` once wrote a full schema into a
0-byte file (0 -> 65,536 bytes) and exited 0. Each case checksums the file (and
lists its directory) before and after the command.
"""

from __future__ import annotations

import hashlib
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
