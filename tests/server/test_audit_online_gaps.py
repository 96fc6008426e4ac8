"""Online `audit verify` must see the whole run: rows deleted, added or gone behind the server.

The tamper suite's attacker again (raw SQL on the SQLite file, triggers
dropped), here against what only the online path got wrong: an empty listing,
rows beyond the run head, a tail cut after the server cached the tree, and a
run that vanished with a database rolled back to before it existed.
"""

from __future__ import annotations

import shutil
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ledger_server.chain import chain_hash
from ledger_server.codec import decode_event
from ledger_server.config import ServerConfig
from ledger_server.merkle import MerkleTree
from ledger_server.server import RunningServer, create_server
from ledger_server.service import LedgerService
from ledger_server.store.sqlite import SqliteStore
from shard_client.client import LedgerClient
from shard_client.errors import LedgerRejected
from shardledger_cli import audit_checks
from shardledger_cli.audit_checks import rpc_public_key, signed_head_check
from shardledger_cli.audit_walk import ChainWalk, walk_server
from shardledger_cli.cli import EXIT_REJECTED, main
from tests.builders import planned, started
from tests.server.test_audit import tree_head
from tests.server.test_tamper import EVENTS, RUN, attack, build, checkpoint, cli, rows

DELETE_THE_RUN = (
    "DELETE FROM events WHERE run_pk = (SELECT run_pk FROM runs WHERE run_id = ?)",
    (RUN,),
)


pytestmark = pytest.mark.usefixtures("quiet_logs")


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "ledger.db"
    build(path)
    return path


@pytest.fixture
def serve() -> Iterator[list[RunningServer]]:
    """Yields a list that serve_db appends to; every server in it is stopped at the end."""
    started_servers: list[RunningServer] = []
    yield started_servers
    for running in started_servers:
        running.stop(0.1)


def serve_db(servers: list[RunningServer], db: Path) -> str:
    running = create_server(ServerConfig(database=str(db), listen="127.0.0.1:0"))
    servers.append(running)
    return f"127.0.0.1:{running.port}"


def failed(report: dict[str, object]) -> dict[str, str]:
    checks = report["checks"]
    assert isinstance(checks, list)
    return {c["check"]: c["detail"] for c in checks if not c["ok"]}


def append_a_forged_row(db: Path) -> None:
    """Appends a correctly chained row past the run head; the runs row is left alone."""
    with sqlite3.connect(db) as conn:
        (run_pk,) = conn.execute("SELECT run_pk FROM runs WHERE run_id = ?", (RUN,)).fetchone()
    seq, run_seq, event_id, body, row_hash = [r for r in rows(db) if b'"run_id":"run-1"' in r[3]][
        -1
    ]
    forged = body.replace(event_id.encode(), b"forged-1").replace(
        b'"run_sequence":%d' % run_seq, b'"run_sequence":%d' % (run_seq + 1)
    )
    attack(
        db,
        (
            "INSERT INTO events (seq, run_pk, run_seq, event_id, row, hash) VALUES (?, ?, ?, ?, ?, ?)",
            (seq + 1000, run_pk, run_seq + 1, "forged-1", forged, chain_hash(row_hash, forged)),
        ),
    )


# --- every row of the run deleted -------------------------------------------


def test_a_run_with_every_row_deleted_fails_online_verify(
    db: Path, serve: list[RunningServer], capsys: pytest.CaptureFixture[str]
) -> None:
    attack(db, DELETE_THE_RUN)
    code, report = cli(capsys, "audit", "verify", RUN, "--server", serve_db(serve, db))
    assert code == 1 and not report["ok"] and report["events"] == 0
    assert report["namespace"] == "default"
    assert "LEDGER_CORRUPT" in failed(report)["signed_head"]


def test_a_run_with_every_row_deleted_fails_online_verify_against_a_saved_head(
    db: Path, serve: list[RunningServer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    head = checkpoint(db, tmp_path, capsys)
    attack(db, DELETE_THE_RUN)
    target = serve_db(serve, db)
    code, report = cli(capsys, "audit", "verify", RUN, "--server", target, "--against", str(head))
    assert code == 1 and not report["ok"]
    assert f"0 events, fewer than the {EVENTS}" in failed(report)["checkpoint"]
    assert report["checks"][-1]["check"] == "checkpoint"


# --- rows the listing and the run head disagree on --------------------------


def test_the_server_refuses_to_sign_a_row_past_the_run_head_every_time(
    db: Path, serve: list[RunningServer], capsys: pytest.CaptureFixture[str]
) -> None:
    append_a_forged_row(db)
    target = serve_db(serve, db)
    for _ in range(2):  # the second answer comes from the tree the first one cached
        code, report = cli(capsys, "audit", "verify", RUN, "--server", target)
        assert code == 1 and not report["ok"]
        detail = failed(report)["signed_head"]
        assert "LEDGER_CORRUPT" in detail and "the stored rows and the run head disagree" in detail
        assert "went back" not in detail


def test_a_row_past_the_run_head_fails_verify_against_a_saved_head_without_a_refusal(
    db: Path, serve: list[RunningServer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    head = checkpoint(db, tmp_path, capsys)
    append_a_forged_row(db)
    target = serve_db(serve, db)
    code, report = cli(capsys, "audit", "verify", RUN, "--server", target, "--against", str(head))
    assert code == 1 and set(failed(report)) == {"signed_head", "consistency_proof"}


def test_tail_rows_deleted_after_the_server_cached_the_tree_fail_online_verify(
    db: Path, serve: list[RunningServer], capsys: pytest.CaptureFixture[str]
) -> None:
    target = serve_db(serve, db)
    assert cli(capsys, "audit", "verify", RUN, "--server", target)[0] == 0  # caches the tree
    attack(db, ("DELETE FROM events WHERE seq > ?", (EVENTS - 4,)))
    code, report = cli(capsys, "audit", "verify", RUN, "--server", target)
    assert code == 1 and not report["ok"]
    assert "the stored rows and the run head disagree" in failed(report)["signed_head"]


def test_the_server_refuses_a_cached_tree_whose_last_row_is_gone(
    db: Path, serve: list[RunningServer]
) -> None:
    client = LedgerClient(serve_db(serve, db))
    try:
        assert tree_head(client).tree_size == EVENTS
        attack(db, ("DELETE FROM events WHERE seq = (SELECT max(seq) FROM events)", ()))
        with pytest.raises(LedgerRejected) as info:
            tree_head(client)
    finally:
        client.close()
    assert info.value.reason == "LEDGER_CORRUPT"
    assert "the stored rows and the run head disagree" in str(info.value)


def test_online_verify_while_events_are_appended_raises_no_alarm(
    db: Path, serve: list[RunningServer], capsys: pytest.CaptureFixture[str]
) -> None:
    target = serve_db(serve, db)
    stop = threading.Event()
    errors: list[BaseException] = []

    def appender() -> None:
        client = LedgerClient(target)
        try:
            for i in range(10_000):
                if stop.is_set():
                    return
                client.append([started(shard_id=f"s{i % 8}", attempt_id=f"live{i}")])
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        finally:
            client.close()

    thread = threading.Thread(target=appender)
    thread.start()
    try:
        reports = [cli(capsys, "audit", "verify", RUN, "--server", target) for _ in range(5)]
    finally:
        stop.set()
        thread.join()
    assert not errors
    assert all(code == 0 and report["ok"] for code, report in reports), reports


def _walk_then_append(target: str, appended: int) -> tuple[LedgerClient, ChainWalk, str]:
    """Walks the run over gRPC, then appends events the walk has not seen."""
    client = LedgerClient(target)
    walk = walk_server(client, RUN, "")
    assert walk.count == EVENTS and not walk.problem
    for i in range(appended):
        client.append([started(shard_id=f"s{i}", attempt_id=f"late{i}")])
    return client, walk, rpc_public_key(client)


def test_a_run_that_grew_past_the_walk_passes_by_the_servers_proof(
    db: Path, serve: list[RunningServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    # No catch-up walk: the appender is always faster than the reader.
    monkeypatch.setattr(audit_checks, "_CATCH_UP_ROUNDS", 0)
    client, walk, pem = _walk_then_append(serve_db(serve, db), 3)
    try:
        name, ok, detail = signed_head_check(client, walk, pem)
    finally:
        client.close()
    assert (name, ok) == ("signed_head", True), detail
    assert f"size {EVENTS + 3} signed" in detail
    assert f"the {EVENTS} events walked are its first" in detail


def test_a_walk_that_is_not_a_prefix_of_the_grown_head_fails(
    db: Path, serve: list[RunningServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(audit_checks, "_CATCH_UP_ROUNDS", 0)
    client, walk, pem = _walk_then_append(serve_db(serve, db), 3)
    # What a listing that disagrees with the signed log would give: same size, other rows.
    walk.tree = MerkleTree()
    for i in range(EVENTS):
        walk.tree.append(b"not the stored row %d" % i)
    try:
        name, ok, detail = signed_head_check(client, walk, pem)
    finally:
        client.close()
    assert (name, ok) == ("signed_head", False)
    assert f"signed head is for {EVENTS + 3} events, the listing gave {EVENTS}" in detail


# --- a run that vanished with a rolled-back database ------------------------


@pytest.mark.parametrize("mode", ["db", "grpc"])
def test_a_run_that_vanished_fails_verify_against_its_saved_head(
    tmp_path: Path, serve: list[RunningServer], capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    db, old = tmp_path / "rolled.db", tmp_path / "old.db"
    store = SqliteStore(db)
    ledger = LedgerService(store)
    ledger.append([decode_event(planned(run_id="earlier", shard_id="x"))])
    ledger.close()
    store.close()
    shutil.copy(db, old)  # the backup predates run-1
    build(db)
    head = checkpoint(db, tmp_path, capsys)
    for suffix in ("", "-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    shutil.copy(old, db)

    if mode == "db":
        code, report = cli(capsys, "audit", "verify", "--db", str(db), "--against", str(head))
    else:
        target = serve_db(serve, db)
        code, report = cli(
            capsys, "audit", "verify", RUN, "--server", target, "--against", str(head)
        )
    assert code == 1 and not report["ok"] and report["run_id"] == RUN
    assert "truncated or restored" in failed(report)["checkpoint"]


def test_an_unknown_run_with_a_saved_head_of_another_run_is_still_refused(
    db: Path, serve: list[RunningServer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    head = checkpoint(db, tmp_path, capsys)
    target = serve_db(serve, db)
    argv = ["audit", "verify", "no-such-run", "--server", target, "--against", str(head)]
    assert main(argv) == EXIT_REJECTED
    assert "RUN_NOT_FOUND" in capsys.readouterr().err
