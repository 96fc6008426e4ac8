"""The tamper suite: an attacker with the SQLite file edits the log; `audit verify` must notice.

The attacker drops the append-only triggers with raw SQL, as anyone with write
access to the file can. Damage inside the log is found by the chain alone;
damage that keeps the chain whole (a truncated tail with the run head rewound,
an old copy restored, history rewritten and re-hashed) needs a head saved
earlier with `audit checkpoint`, and is found by `--against`.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ledger_server.chain import GENESIS_HASH, chain_hash
from ledger_server.codec import decode_event
from ledger_server.config import ServerConfig
from ledger_server.events import AttemptStarted, Event, Heartbeat, ShardPlanned
from ledger_server.server import create_server
from ledger_server.service import LedgerService
from ledger_server.store.sqlite import SqliteStore
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from shardledger_cli.cli import main
from tests.builders import committed, event, planned, started

RUN = "run-1"
EVENTS = 30


pytestmark = pytest.mark.usefixtures("quiet_logs")


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    """Runs the CLI with --json and returns (exit code, the one run's report)."""
    capsys.readouterr()
    code = main([*argv, "--json"])
    out = json.loads(capsys.readouterr().out)
    return code, out["runs"][0]


def build(db: Path) -> None:
    """Writes a 30-event run of every kind (and another run) through the ledger service."""
    store = SqliteStore(db)
    ledger = LedgerService(store)
    passed = pb.VERIFICATION_RESULT_PASSED
    batches = [
        [planned(shard_id=f"s{i}", index=i) for i in range(8)],
        [started(shard_id=f"s{i}", attempt_id=f"a{i}") for i in range(8)],
        [planned(run_id="other", shard_id="o1")],
        [
            event(RUN, f"s{i}", f"a{i}", heartbeat=pb.Heartbeat(step=i, progress=0.5))
            for i in range(4)
        ],
        [committed(shard_id=f"s{i}", attempt_id=f"a{i}") for i in range(4)],
        [
            event(
                RUN,
                f"s{i}",
                verified=pb.ArtifactVerified(
                    name="out", path="/out/x", blake3_hex="a" * 64, result=passed
                ),
            )
            for i in range(4)
        ],
        [event(RUN, "s7", "a7", failed=pb.AttemptFailed(tag=pb.FAILURE_TAG_NCCL, message="x"))],
        [started(shard_id="s7", attempt_id="b7")],
    ]
    try:
        for batch in batches:
            ledger.append([decode_event(e) for e in batch])
        assert ledger.run("default", RUN).event_count == EVENTS
    finally:
        ledger.close()
        store.close()


def rows(db: Path) -> list[tuple[int, int, str, bytes, bytes]]:
    with sqlite3.connect(db) as conn:
        return [
            (r[0], r[1], r[2], bytes(r[3]), bytes(r[4]))
            for r in conn.execute(
                "SELECT seq, run_seq, event_id, row, hash FROM events ORDER BY seq"
            )
        ]


def attack(db: Path, *statements: tuple[str, tuple[Any, ...]]) -> None:
    """Runs raw SQL on the file with the append-only triggers dropped."""
    conn = sqlite3.connect(db)
    try:
        conn.execute("DROP TRIGGER IF EXISTS events_no_update")
        conn.execute("DROP TRIGGER IF EXISTS events_no_delete")
        for sql, params in statements:
            conn.execute(sql, params)
        conn.commit()
    finally:
        conn.close()


def run_seq_of(db: Path, seq: int) -> tuple[int, str, bytes, bytes]:
    (row,) = [(r[1], r[2], r[3], r[4]) for r in rows(db) if r[0] == seq]
    return row


# --- damage found by the chain alone ----------------------------------------


def edit_a_byte(db: Path) -> int:
    seq = 23  # an artifact_committed row
    body = run_seq_of(db, seq)[2]
    index = body.index(b"/out/x") + 5
    edited = body[:index] + b"y" + body[index + 1 :]
    attack(db, ("UPDATE events SET row = ? WHERE seq = ?", (edited, seq)))
    return seq


def delete_a_row(db: Path) -> int:
    attack(db, ("DELETE FROM events WHERE seq = ?", (12,)))
    return 13


def reorder_two_rows(db: Path) -> int:
    a, b = run_seq_of(db, 12), run_seq_of(db, 13)
    sql = "UPDATE events SET run_seq = ?, event_id = ?, row = ?, hash = ? WHERE seq = ?"
    # event_id is UNIQUE, so row 12 steps aside before the two swap places.
    attack(
        db,
        ("UPDATE events SET event_id = 'tmp' WHERE seq = 12", ()),
        (sql, (*a, 13)),
        (sql, (*b, 12)),
    )
    return 12


def insert_a_forged_row(db: Path) -> int:
    # Rows from 12 on move up, and a forged row 12 chained from row 11 takes their place.
    prev_hash = run_seq_of(db, 11)[3]
    with sqlite3.connect(db) as conn:
        (run_pk,) = conn.execute("SELECT run_pk FROM runs WHERE run_id = ?", (RUN,)).fetchone()
    original = run_seq_of(db, 12)[2]
    forged = original.replace(b'"event_id":"', b'"event_id":"forged-', 1)
    attack(
        db,
        ("UPDATE events SET seq = seq + 1000 WHERE seq >= 12", ()),
        (
            "INSERT INTO events (seq, run_pk, run_seq, event_id, row, hash) VALUES (12, ?, 12, ?, ?, ?)",
            (
                run_pk,
                json.loads(forged)["event"]["event_id"],
                forged,
                chain_hash(prev_hash, forged),
            ),
        ),
    )
    return 1012


def truncate_the_tail_naively(db: Path) -> int | None:
    attack(db, ("DELETE FROM events WHERE seq > ?", (EVENTS - 4,)))
    return None  # the rows chain; the run head is what disagrees


@pytest.mark.parametrize(
    "damage",
    [edit_a_byte, delete_a_row, reorder_two_rows, insert_a_forged_row, truncate_the_tail_naively],
)
@pytest.mark.parametrize("mode", ["db", "grpc"])
def test_damage_inside_the_log_is_found_and_the_first_bad_row_named(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    damage: Callable[[Path], int | None],
    mode: str,
) -> None:
    db = tmp_path / "ledger.db"
    build(db)
    first_bad = damage(db)
    if mode == "db":
        code, report = cli(capsys, "audit", "verify", "--db", str(db), RUN)
        assert report["first_bad_sequence"] == first_bad
    else:
        running = create_server(ServerConfig(database=str(db), listen="127.0.0.1:0"))
        try:
            code, report = cli(
                capsys, "audit", "verify", RUN, "--server", f"127.0.0.1:{running.port}"
            )
        finally:
            running.stop(0.1)
        if first_bad is not None:
            assert report["first_bad_sequence"] == first_bad
    assert code == 1 and not report["ok"]
    assert any(not c["ok"] for c in report["checks"])


# --- damage that keeps the chain whole: found against a saved head ----------


def checkpoint(db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], **append: Any) -> Path:
    """Saves a signed head through a real server (appending more events first, if asked)."""
    head = tmp_path / "head.json"
    running = create_server(ServerConfig(database=str(db), listen="127.0.0.1:0"))
    target = f"127.0.0.1:{running.port}"
    try:
        if append:
            client = LedgerClient(target)
            client.append(
                [started(shard_id=f"s{i}", attempt_id=f"c{i}") for i in range(append["n"])]
            )
            client.close()
        assert main(["audit", "checkpoint", RUN, "--server", target, "-o", str(head)]) == 0
    finally:
        running.stop(0.1)
    capsys.readouterr()
    return head


def rewind_head(db: Path, keep: int) -> None:
    """Deletes rows after run_seq keep and rewinds the run head to match (a careful attacker)."""
    (head_hash,) = [r[4] for r in rows(db) if r[1] == keep and b'"run_id":"run-1"' in r[3]]
    attack(
        db,
        (
            "DELETE FROM events WHERE run_seq > ? AND run_pk = (SELECT run_pk FROM runs WHERE run_id = ?)",
            (keep, RUN),
        ),
        ("UPDATE runs SET event_count = ?, head_hash = ? WHERE run_id = ?", (keep, head_hash, RUN)),
    )


def test_a_truncated_tail_with_the_head_rewound_is_found_only_against_a_saved_head(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "ledger.db"
    build(db)
    head = checkpoint(db, tmp_path, capsys)
    rewind_head(db, EVENTS - 5)
    assert (
        cli(capsys, "audit", "verify", "--db", str(db), RUN)[0] == 0
    )  # the chain alone cannot tell
    code, report = cli(capsys, "audit", "verify", "--db", str(db), "--against", str(head))
    assert code == 1 and "truncated or restored" in report["checks"][-1]["detail"]


def test_an_old_copy_restored_over_the_database_is_found_against_a_saved_head(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db, copy = tmp_path / "ledger.db", tmp_path / "old.db"
    build(db)
    with sqlite3.connect(db) as src, sqlite3.connect(copy) as dst:
        src.backup(dst)
    head = checkpoint(db, tmp_path, capsys, n=6)  # the log grew to 36 after the copy
    for suffix in ("", "-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    shutil.copy(copy, db)

    assert cli(capsys, "audit", "verify", "--db", str(db), RUN)[0] == 0
    code, report = cli(capsys, "audit", "verify", "--db", str(db), "--against", str(head))
    assert code == 1 and "30 events, fewer than the 36" in report["checks"][-1]["detail"]
    running = create_server(ServerConfig(database=str(db), listen="127.0.0.1:0"))
    try:
        target = f"127.0.0.1:{running.port}"
        code, report = cli(
            capsys, "audit", "verify", RUN, "--server", target, "--against", str(head)
        )
    finally:
        running.stop(0.1)
    assert code == 1 and not report["ok"]


def test_history_rewritten_and_rehashed_is_found_against_a_saved_head(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "ledger.db"
    build(db)
    head = checkpoint(db, tmp_path, capsys)
    # The attacker edits row 23 and recomputes every later hash and the run head.
    prev = GENESIS_HASH
    statements: list[tuple[str, tuple[Any, ...]]] = []
    for seq, _run_seq, _event_id, body, _hash in rows(db):
        if b'"run_id":"run-1"' not in body:
            continue
        if seq == 23:
            body = body.replace(b"/out/x", b"/out/y")
        prev = chain_hash(prev, body)
        statements.append(("UPDATE events SET row = ?, hash = ? WHERE seq = ?", (body, prev, seq)))
    statements.append(("UPDATE runs SET head_hash = ? WHERE run_id = ?", (prev, RUN)))
    attack(db, *statements)

    assert cli(capsys, "audit", "verify", "--db", str(db), RUN)[0] == 0
    code, report = cli(capsys, "audit", "verify", "--db", str(db), "--against", str(head))
    assert code == 1 and "history was rewritten" in report["checks"][-1]["detail"]
    running = create_server(ServerConfig(database=str(db), listen="127.0.0.1:0"))
    try:
        target = f"127.0.0.1:{running.port}"
        code, report = cli(
            capsys, "audit", "verify", RUN, "--server", target, "--against", str(head)
        )
    finally:
        running.stop(0.1)
    assert code == 1 and "history was rewritten" in report["checks"][-1]["detail"]


# --- no false alarms ---------------------------------------------------------


@pytest.mark.slow
def test_a_clean_log_of_100k_events_raises_no_alarm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "big.db"
    store = SqliteStore(db)
    ledger = LedgerService(store)
    shards = 100

    def ev(event_id: str, shard: int, attempt: str, payload: Any) -> Event:
        return Event(event_id, "default", "big", f"s{shard}", attempt, 0, payload)

    # Every shard planned and started, then heartbeats: the bulk of a real night's log.
    ledger.append(
        [
            ev(f"p{i}", i, "", ShardPlanned(f"/in/{i}", 1, "", "{}", ("out",), "", i))
            for i in range(shards)
        ]
        + [ev(f"s{i}", i, "a", AttemptStarted("h", 1, 60_000_000, {}, "")) for i in range(shards)]
    )
    n = 2 * shards
    while n < 100_000:
        batch = min(5000, 100_000 - n)
        ledger.append(
            [ev(f"h{k}", k % shards, "a", Heartbeat(k, 0.5, {})) for k in range(n, n + batch)]
        )
        n += batch
    ledger.close()
    store.close()

    # How long it takes is a benchmark's question, never a timing assert here (tests/README.md).
    code, report = cli(capsys, "audit", "verify", "--db", str(db), "big")
    assert code == 0 and report["ok"] and report["events"] == 100_000
