"""Storage faults by kind, on real SQLite files and a real server.

A full disk is a small tmpfs (where this test may mount one) answering UNAVAILABLE
STORE_FULL until space is freed; a read-only file system before start is refused with
the fix; a store that turns read-only mid-run or fails an fsync is injected at the
store's commit seam (a remount with the ledger open needs the kernel's error path),
and answers FAILED_PRECONDITION with health NOT_SERVING.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from ledger_server.audit import verify_store
from ledger_server.config import ServerConfig
from ledger_server.server import SERVICE_NAME, RunningServer, create_server
from ledger_server.startup import StartupError, open_database
from ledger_server.store.sqlite import SqliteStore
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.api.shardledger.v1 import ledger_pb2_grpc
from shard_client.client import LedgerClient
from shard_client.errors import StoreFault
from tests.builders import planned, without_root_bypass


def _serve(db: Path) -> RunningServer:
    return create_server(ServerConfig(database=str(db), listen="127.0.0.1:0"))


def _plans(count: int, pad: int = 0) -> list[pb.ShardEvent]:
    events = []
    for i in range(count):
        ev = planned(run_id="run-f", shard_id=f"s-{uuid.uuid4().hex[:12]}", index=i)
        if pad:
            ev.planned.params_json = json.dumps({"pad": "x" * pad})
        events.append(ev)
    return events


def _append(port: int, events: list[pb.ShardEvent]) -> tuple[grpc.StatusCode, str]:
    """Returns (code, ErrorInfo reason) of one AppendEvents call, (OK, "") when it committed."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ledger_pb2_grpc.LedgerServiceStub(channel)
        try:
            stub.AppendEvents(pb.AppendEventsRequest(events=events), timeout=30)
        except grpc.RpcError as exc:
            assert isinstance(exc, grpc.Call)
            status = rpc_status.from_call(exc)
            assert status is not None, exc.details()
            info = error_details_pb2.ErrorInfo()
            status.details[0].Unpack(info)
            return exc.code(), info.reason
    return grpc.StatusCode.OK, ""


def _health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5
        )
    return int(reply.status)


def _stored_ids(db: Path) -> set[str]:
    with sqlite3.connect(db) as conn:
        return {row[0] for row in conn.execute("SELECT event_id FROM events")}


def _sample(running: RunningServer, name: str, **labels: str) -> float | None:
    return running.metrics.registry.get_sample_value(name, labels)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs (needs root and mount); skipped where this test cannot mount one."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(directory: Path) -> Path:
    """Fills the file system of directory to the last byte; returns the filler file."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as fh:
        for size in (65536, 1):
            try:
                while fh.write(b"\0" * size):
                    pass
            except OSError:
                pass
    return filler


def test_a_full_disk_answers_unavailable_store_full_and_appends_resume_once_space_is_freed(
    small_fs: Path,
) -> None:
    db = small_fs / "ledger.db"
    running = _serve(db)
    try:
        acked = _plans(5)
        assert _append(running.port, acked) == (grpc.StatusCode.OK, "")
        filler = _fill(small_fs)
        code, reason = _append(running.port, _plans(200, pad=8000))
        assert (code, reason) == (grpc.StatusCode.UNAVAILABLE, "STORE_FULL")
        assert _health(running.port) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert _sample(running, "shardledger_store_writable") == 0
        assert _sample(running, "shardledger_store_write_errors_total", kind="STORE_FULL") == 1
        filler.unlink()
        again = _plans(200, pad=2000)
        assert _append(running.port, again) == (grpc.StatusCode.OK, "")
        assert _health(running.port) == health_pb2.HealthCheckResponse.SERVING
        assert _sample(running, "shardledger_store_writable") == 1
    finally:
        running.stop(0.5)
    assert {e.event_id for e in acked + again} <= _stored_ids(db)
    store = SqliteStore(db, must_exist=True)
    try:
        assert store.integrity_check() == "ok"
        assert all(report.ok for report in verify_store(store))
    finally:
        store.close()


def test_a_ledger_on_a_read_only_file_system_is_refused_at_start_with_the_fix(
    small_fs: Path,
) -> None:
    db = small_fs / "ledger.db"
    _serve(db).stop(0.5)
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    with pytest.raises(StartupError, match="read-only") as refused:
        open_database(str(db))
    assert "remount" in refused.value.message and "read-only file system" in refused.value.message
    # The command's exit code and its one line, as an operator sees them; on port 0, so a
    # ledger already serving the default 127.0.0.1:50551 cannot answer "Address already in use".
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardledger_cli",
            "serve",
            "--db",
            str(db),
            "--listen",
            "127.0.0.1:0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 5, done.stderr
    assert "read-only" in done.stderr and "give a ledger file" not in done.stderr


# The opener, in an interpreter of its own: exit 5 and the message when refused.
_OPENER = """
import sys
from ledger_server.startup import StartupError, open_database
try:
    open_database(sys.argv[1]).close()
except StartupError as exc:
    print(exc, end="")
    raise SystemExit(5)
print("opened", end="")
"""


def _open_unprivileged(db: Path) -> tuple[int, str]:
    """Opens the ledger in a new process that file modes bind; returns (code, message).

    Root may write a file whatever its mode, and CI runs as root: the child runs without
    the capabilities that allow it (tests.builders.without_root_bypass), as the server's
    own user would. A fresh interpreter (fork and exec), never a bare fork of this pytest
    process: its threads (xdist's, gRPC's) would leave their locks held in the child,
    which then crashed (SIGSEGV under a loaded CI).
    """
    done = subprocess.run(
        without_root_bypass([sys.executable, "-c", _OPENER, str(db)]),
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "PYTHONDONTWRITEBYTECODE": "1"},
        cwd="/",
    )
    return done.returncode, done.stdout or done.stderr[-2000:]


def test_a_read_only_ledger_file_or_directory_is_refused_at_start_with_the_fix(
    tmp_path: Path,
) -> None:
    home = tmp_path / "ledger"
    home.mkdir()
    try:
        db = home / "ledger.db"
        _serve(db).stop(0.5)
        db.chmod(0o444)
        code, message = _open_unprivileged(db)
        assert code == 5, message
        assert re.search(r"ledger file is read-only.*chmod u\+rw", message, re.S), message
        db.chmod(0o644)
        home.chmod(0o555)
        code, message = _open_unprivileged(db)
        assert code == 5, message
        assert re.search(r"directory .* is read-only.*-wal", message, re.S), message
    finally:
        home.chmod(0o755)


def _fail_commit(code: int, name: str) -> object:
    def commit(self: SqliteStore, conn: sqlite3.Connection) -> None:
        exc = sqlite3.OperationalError("injected")
        exc.sqlite_errorcode = code
        exc.sqlite_errorname = name
        raise exc

    return commit


def test_a_store_turned_read_only_mid_run_answers_failed_precondition_until_it_is_writable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "ledger.db"
    running = _serve(db)
    client = LedgerClient(f"127.0.0.1:{running.port}", timeout_s=10, retry_deadline_s=5)
    try:
        commit = SqliteStore._commit
        monkeypatch.setattr(SqliteStore, "_commit", _fail_commit(8, "SQLITE_READONLY"))
        refused = _plans(3)
        code, reason = _append(running.port, refused)
        assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "STORE_READ_ONLY")
        assert _health(running.port) == health_pb2.HealthCheckResponse.NOT_SERVING
        # The SDK neither retries that nor takes it as a verdict on the events.
        with pytest.raises(StoreFault, match="write access"):
            client.append(refused, retry=True)
        monkeypatch.setattr(SqliteStore, "_commit", commit)
        assert _append(running.port, refused) == (grpc.StatusCode.OK, "")
        assert _health(running.port) == health_pb2.HealthCheckResponse.SERVING
        assert _sample(running, "shardledger_store_write_errors_total", kind="STORE_READ_ONLY") == 2
    finally:
        client.close()
        running.stop(0.5)


def test_a_failed_fsync_is_not_acknowledged_and_no_write_is_until_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "ledger.db"
    running = _serve(db)
    try:
        commit = SqliteStore._commit
        monkeypatch.setattr(SqliteStore, "_commit", _fail_commit(10 | 4 << 8, "SQLITE_IOERR_FSYNC"))
        lost = _plans(3)
        code, reason = _append(running.port, lost)
        assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "STORE_SYNC_FAILED")
        monkeypatch.setattr(SqliteStore, "_commit", commit)
        # The disk seems fine again, but the page cache cannot be trusted: still refused.
        later = _plans(2)
        code, reason = _append(running.port, later)
        assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "STORE_SYNC_FAILED")
        assert _health(running.port) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        running.stop(0.5)
    assert not {e.event_id for e in lost + later} & _stored_ids(db)
    running = _serve(db)  # a restart recovers from what is on disk and writes again
    try:
        assert _append(running.port, lost + later) == (grpc.StatusCode.OK, "")
    finally:
        running.stop(0.5)


def test_vacuum_into_of_a_live_ledger_is_a_copy_that_serves_and_audits_clean(
    tmp_path: Path,
) -> None:
    db, copy = tmp_path / "ledger.db", tmp_path / "backup.db"
    running = _serve(db)
    try:
        events = _plans(50)
        assert _append(running.port, events) == (grpc.StatusCode.OK, "")
        with sqlite3.connect(db) as conn:  # while the server writes on
            conn.execute("VACUUM INTO ?", (str(copy),))
        assert _append(running.port, _plans(5)) == (grpc.StatusCode.OK, "")
    finally:
        running.stop(0.5)
    assert {e.event_id for e in events} == _stored_ids(copy)
    restored = _serve(copy)
    try:
        assert all(report.ok for report in verify_store(restored.ledger.store))
        assert _append(restored.port, _plans(1)) == (grpc.StatusCode.OK, "")
    finally:
        restored.stop(0.5)


def test_a_postgresql_url_that_cannot_connect_gets_a_postgresql_hint() -> None:
    pytest.importorskip("psycopg")
    with pytest.raises(StartupError) as refused:
        open_database("postgresql://ledger@127.0.0.1:9/ledger?connect_timeout=1&pool_timeout=1")
    assert "PostgreSQL" in refused.value.message
    assert "ledger file" not in refused.value.message
