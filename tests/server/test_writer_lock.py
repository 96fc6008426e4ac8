"""One writer per SQLite ledger: a second server, or a rebuild under a live server, is refused.

The server keeps shard records in memory between transactions. A second process
writing the same file would make those records stale without either process
noticing (SQLite serializes the transactions, not the caches), and the first
server's resume list would stop being exact. The store therefore takes a writer
lock that the kernel drops when the process ends, a SIGKILL included.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ledger_server.config import ServerConfig
from ledger_server.server import RunningServer, create_server
from ledger_server.store.base import WriterBusy
from ledger_server.store.sqlite import SqliteStore
from shard_client.client import LedgerClient
from shardledger_cli.cli import EXIT_LOCAL, EXIT_OK, EXIT_PROBLEMS, CommandError, build_parser
from tests.builders import committed, planned, started


def _serve_cli(db: Path, port_file: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "shardledger_cli", "serve", "--db", str(db)),
            *("--listen", "127.0.0.1:0", "--port-file", str(port_file), "--log-level", "warning"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_port(proc: subprocess.Popen[str], port_file: Path) -> int:
    deadline = time.monotonic() + 30
    while not port_file.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    return int(port_file.read_text())


def _event_count(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return int(conn.execute("SELECT COUNT(*) FROM events").fetchone()[0])


def _shards(port: int) -> dict[str, str]:
    client = LedgerClient(f"127.0.0.1:{port}", timeout_s=10)
    try:
        views = (json.loads(v.view_json) for v in client.shards("night"))
        return {v["shard_id"]: v["state"] for v in views}
    finally:
        client.close()


def test_a_second_server_on_the_file_refuses_to_start_and_the_first_keeps_serving(
    tmp_path: Path,
) -> None:
    db = tmp_path / "ledger.db"
    first = create_server(ServerConfig(database=str(db), listen="127.0.0.1:0"))
    client = LedgerClient(f"127.0.0.1:{first.port}", timeout_s=10)
    try:
        client.append([planned("night", "s1", index=0), started("night", "s1", "a1")])
        before = _event_count(db)

        second = _serve_cli(db, tmp_path / "port2")
        _, err = second.communicate(timeout=60)
        assert second.returncode != 0
        assert f"is being written by another process (pid {os.getpid()})" in err
        assert "one writer at a time" in err
        assert not (tmp_path / "port2").exists()
        assert _event_count(db) == before  # the refused server wrote nothing

        client.append([committed("night", "s1", "a1")])
        assert _shards(first.port) == {"s1": "unverified"}
    finally:
        client.close()
        first.stop(0.5)


def test_the_lock_goes_with_the_server_even_on_sigkill(tmp_path: Path) -> None:
    db, port_file = tmp_path / "ledger.db", tmp_path / "port"
    proc = _serve_cli(db, port_file)
    port = _wait_port(proc, port_file)
    client = LedgerClient(f"127.0.0.1:{port}", timeout_s=10)
    client.append([planned("night", "s1", index=0), started("night", "s1", "a1")])
    client.close()
    with pytest.raises(WriterBusy), SqliteStore(db).write():
        pass
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)

    running: RunningServer = create_server(ServerConfig(database=str(db), listen="127.0.0.1:0"))
    try:
        assert _shards(running.port) == {"s1": "running"}  # acknowledged before the kill
    finally:
        running.stop(0.5)


def _db(*argv: str) -> int:
    """Runs `shardledger db ...` in process; a refusal raises CommandError."""
    args = build_parser(("shardledger_cli.commands.db",)).parse_args(["db", *argv])
    code: int = args.func(args)
    return code


def _state(db: Path, shard_id: str) -> str:
    with sqlite3.connect(db) as conn:
        row = conn.execute("SELECT state FROM shards WHERE shard_id = ?", (shard_id,)).fetchone()
        return str(row[0])


def test_db_rebuild_is_refused_while_a_server_writes_the_file_and_check_still_works(
    tmp_path: Path,
) -> None:
    db = tmp_path / "ledger.db"
    url = f"sqlite:///{db}"
    running = create_server(ServerConfig(database=str(db), listen="127.0.0.1:0"))
    try:
        client = LedgerClient(f"127.0.0.1:{running.port}", timeout_s=10)
        client.append([planned("night", f"s{i}", index=i) for i in range(3)])
        client.close()
        with sqlite3.connect(db) as conn:  # a projection row edited behind the server's back
            conn.execute("UPDATE shards SET state = 'verified' WHERE shard_id = 's1'")

        # Checking only reads: it works beside the server and reports the edit.
        assert _db("rebuild", "--database-url", url, "--check") == EXIT_PROBLEMS
        with pytest.raises(CommandError) as refused:
            _db("rebuild", "--database-url", url)
        assert refused.value.code == EXIT_LOCAL
        message = str(refused.value)
        assert f"is being written by another process (pid {os.getpid()})" in message
        assert "nothing was written" in message
        assert _state(db, "s1") == "verified"  # still the edited row
    finally:
        running.stop(0.5)
    # With the server stopped, the same rebuild repairs the row.
    assert _db("rebuild", "--database-url", url) == EXIT_OK
    assert _state(db, "s1") == "planned"
