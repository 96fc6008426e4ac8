"""`shardledger db`: migrations on both backends, and moving a SQLite ledger to PostgreSQL."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ledger_server.chain import recorded
from ledger_server.config import ServerConfig
from ledger_server.record import record_from_row
from ledger_server.replay import replay_run
from ledger_server.server import create_server
from ledger_server.store import open_store, redact_url
from ledger_server.store.base import StoredEvent, TokenRow
from ledger_server.store.postgres import PostgresStore
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from shardledger_cli.cli import EXIT_OK, CommandError, build_parser, main
from tests import pg
from tests.builders import DIGEST_B, committed, event, planned, started

# The PostgreSQL fixtures, found by pytest under these names.
pg_cluster = pg.pg_cluster
pg_url = pg.pg_url


def _db(*argv: str) -> int:
    args = build_parser(("shardledger_cli.commands.db",)).parse_args(["db", *argv])
    code: int = args.func(args)
    return code


def _history(client: LedgerClient, runs: int) -> None:
    for r in range(runs):
        run = f"night-{r}"
        batch = [planned(run, f"s{i}", index=i) for i in range(6)]
        batch += [started(run, f"s{i}", "a1") for i in range(1, 6)]
        batch += [committed(run, f"s{i}", "a1") for i in (2, 3, 5)]
        batch += [
            event(run, "s4", "a1", failed=pb.AttemptFailed(tag=pb.FAILURE_TAG_OOM, message="")),
            started(run, "s5", "a2"),
            committed(run, "s5", "a2", digest=DIGEST_B),
            event(run, "s1", "a1", heartbeat=pb.Heartbeat(step=2, progress=0.1)),
        ]
        if r % 2:
            for e in batch:
                e.namespace = "team-b"
        client.append(batch)


@pytest.fixture
def sqlite_ledger(tmp_path: Path) -> Path:
    """Returns a SQLite ledger written through a real server: runs, namespaces, a token."""
    path = tmp_path / "ledger.db"
    running = create_server(
        ServerConfig(database=str(path), listen="127.0.0.1:0", signing_key=str(tmp_path / "k"))
    )
    try:
        _history(LedgerClient(f"127.0.0.1:{running.port}"), runs=5)
    finally:
        running.stop(0.5)
    store = open_store(str(path))
    try:
        store.create_token(TokenRow("tok1", "default", "writer", "", "h" * 64, "ci", 1, None, None))
    finally:
        store.close()
    return path


def _rows(query: Any, sql: str) -> list[tuple[Any, ...]]:
    return [tuple(bytes(v) if isinstance(v, memoryview) else v for v in row) for row in query(sql)]


def _sqlite(path: Path) -> Any:
    def query(sql: str) -> list[tuple[Any, ...]]:
        with sqlite3.connect(path) as conn:
            return conn.execute(sql).fetchall()

    return query


def _pg(url: str) -> Any:
    def query(sql: str) -> list[tuple[Any, ...]]:
        store = PostgresStore(url)
        try:
            return store.execute_raw(sql)
        finally:
            store.close()

    return query


TABLES = {
    "runs": "SELECT * FROM runs ORDER BY run_pk",
    "events": 'SELECT seq, run_pk, run_seq, event_id, "row", hash FROM events ORDER BY seq',
    # As readers see a shard: a heartbeat row, when there is one, has the newer liveness.
    "shards": "SELECT s.run_pk, s.shard_id, s.plan_index, s.state, s.detail,"
    " CASE WHEN b.run_pk IS NULL THEN s.deadline_us ELSE b.deadline_us END, s.plan_line,"
    " s.record, b.beat_us, b.beat_step FROM shards AS s LEFT JOIN shard_beats AS b"
    " ON b.run_pk = s.run_pk AND b.shard_id = s.shard_id ORDER BY s.run_pk, s.shard_id",
    "counters": "SELECT run_pk, key, n FROM run_counters WHERE n != 0 ORDER BY run_pk, key",
    "open attempts": "SELECT run_pk, shard_id, deadline_us, seen_us, started_us, gpus,"
    " CAST(gpus_known AS INTEGER), saved_us, CAST(first_pass AS INTEGER), labels, shard_labels"
    " FROM shard_open ORDER BY run_pk, shard_id",
    "tokens": "SELECT * FROM tokens ORDER BY token_id",
}


def _normalized(table: str, rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    if table != "shards":
        return rows
    # Records are JSON: compare their meaning, not the bytes of one encoder, with the
    # heartbeat row folded in (a copy rebuilds records whole, so it has none).
    return [(*r[:7], json.loads(record_from_row(bytes(r[7]), r[8], r[9]).to_json())) for r in rows]


def test_migrate_applies_and_prints_versions_on_both_backends(
    tmp_path: Path, pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # SQLite has one more: its shard rows moved to a rowid table (PostgreSQL needs no such
    # move). Both then cover the resume list with the plan-order index, and end with the
    # tombstones of archived runs and the open attempts' table.
    for url, last in ((f"sqlite:///{tmp_path / 'new.db'}", 7), (pg_url, 6)):
        assert _db("migrate", "--database-url", url) == EXIT_OK
        out = capsys.readouterr().out
        assert f"schema version {last}" in out
        assert "1  events, runs" in out and "2  access tokens" in out
        assert "3  shard heartbeats" in out
        assert ("4  shard rows in a rowid table" in out) == (last == 7)
        assert f"{last - 2}  the plan-order index covers the resume list" in out
        assert f"{last - 1}  run tombstones: an archived run's events leave the hot store" in out
        assert f"{last}  open attempts in a narrow table" in out
        assert _db("migrate", "--database-url", url, "--json") == EXIT_OK
        versions = json.loads(capsys.readouterr().out)["migrations"]
        assert [m["version"] for m in versions] == list(range(1, last + 1))


def test_copy_moves_every_row_verbatim_and_rebuilds_equal_projections(
    sqlite_ledger: Path, pg_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _db("copy", "--from", f"sqlite:///{sqlite_ledger}", "--to", pg_url) == EXIT_OK
    out = capsys.readouterr().out
    assert "copied 5 runs (90 events" in out and "5 chains in the target: 0 broken" in out
    for table, sql in TABLES.items():
        source = _normalized(table, _rows(_sqlite(sqlite_ledger), sql))
        target = _normalized(table, _rows(_pg(pg_url), sql))
        assert target == source, table
    assert _rows(_sqlite(sqlite_ledger), TABLES["open attempts"]), "the night has shards running"
    # The target serves on: new sequences continue above the copied ones, chains stay whole.
    running = create_server(
        ServerConfig(database=pg_url, listen="127.0.0.1:0", signing_key=str(tmp_path / "k"))
    )
    try:
        client = LedgerClient(f"127.0.0.1:{running.port}")
        again = client.append([started("night-0", "s0", "a1")])
        assert again[0].outcome == pb.APPEND_OUTCOME_APPENDED and again[0].sequence > 90
        resume = [e.shard_id for e in client.resume("night-0")]
        assert resume == ["s0", "s1", "s2", "s3", "s4", "s5"]
    finally:
        running.stop(0.5)


def test_copy_refuses_a_non_empty_target_and_resumes_an_interrupted_one(
    sqlite_ledger: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = PostgresStore.import_run
    calls = 0

    def failing(self: PostgresStore, run: Any, events: Iterable[StoredEvent], fold: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:

            def half(rows: Iterable[StoredEvent]) -> Iterator[StoredEvent]:
                for n, row in enumerate(rows):
                    if n == 7:
                        raise ConnectionError("the network went away mid-run")
                    yield row

            events = half(events)
        original(self, run, events, fold)

    monkeypatch.setattr(PostgresStore, "import_run", failing)
    source = f"sqlite:///{sqlite_ledger}"
    with pytest.raises(ConnectionError):
        _db("copy", "--from", source, "--to", pg_url)
    assert _pg(pg_url)("SELECT COUNT(*) FROM runs") == [(2,)]  # the third run rolled back whole
    with pytest.raises(CommandError, match="already holds 2 runs"):
        _db("copy", "--from", source, "--to", pg_url)
    assert _db("copy", "--from", source, "--to", pg_url, "--resume", "--json") == EXIT_OK
    for table, sql in TABLES.items():
        assert _normalized(table, _rows(_pg(pg_url), sql)) == _normalized(
            table, _rows(_sqlite(sqlite_ledger), sql)
        ), table


def test_copy_refuses_a_target_whose_run_differs(sqlite_ledger: Path, pg_url: str) -> None:
    source = f"sqlite:///{sqlite_ledger}"
    assert _db("copy", "--from", source, "--to", pg_url) == EXIT_OK
    _pg(pg_url)("UPDATE runs SET event_count = event_count + 1 WHERE run_id = 'night-1'")
    with pytest.raises(CommandError, match="night-1 differs"):
        _db("copy", "--from", source, "--to", pg_url, "--resume")


def test_copied_projections_equal_a_replay_of_the_copied_events(
    sqlite_ledger: Path, pg_url: str
) -> None:
    assert _db("copy", "--from", f"sqlite:///{sqlite_ledger}", "--to", pg_url) == EXIT_OK
    store = PostgresStore(pg_url)
    try:
        view = store.read()
        for run in view.list_runs(None, 100):
            replay = replay_run(recorded(e) for e in view.iter_events(run.run_pk))
            assert view.counters(run.run_pk) == {k: n for k, n in replay.counters().items() if n}
    finally:
        store.close()


def test_grants_prints_a_least_privilege_role(capsys: pytest.CaptureFixture[str]) -> None:
    assert _db("grants", "--role", "ledger_app") == EXIT_OK
    out = capsys.readouterr().out
    assert 'REVOKE UPDATE, DELETE, TRUNCATE ON events FROM "ledger_app";' in out
    assert 'GRANT SELECT, INSERT ON events TO "ledger_app";' in out


def test_database_urls_are_redacted_for_logs() -> None:
    assert redact_url("postgresql://app:s3cret@db:5432/l?sslmode=require&password=x") == (
        "postgresql://app:***@db:5432/l?sslmode=require&password=***"
    )
    assert redact_url("postgresql://app@db/l") == "postgresql://app@db/l"
    assert redact_url("/var/lib/ledger.db") == "/var/lib/ledger.db"
    assert redact_url("sqlite:///var/lib/ledger.db") == "sqlite:///var/lib/ledger.db"
    # libpq reads the user information up to the last "@" before the first "/".
    assert redact_url("postgresql://owner:S3cret#pw@127.0.0.1/ledger") == (
        "postgresql://owner:***@127.0.0.1/ledger"
    )
    assert redact_url("postgresql://u:pa?ss@h/db") == "postgresql://u:***@h/db"
    assert redact_url("postgresql://h?password=x") == "postgresql://h?password=***"
    assert redact_url("postgresql://u@h/db?sslpassword=k&sslmode=verify-full") == (
        "postgresql://u@h/db?sslpassword=***&sslmode=verify-full"
    )


def test_libpq_url_options_reach_the_postgresql_session_unchanged(pg_url: str) -> None:
    # A space must travel as %20: "+" is not a space to libpq.
    url = f"{pg_url}{'&' if '?' in pg_url else '?'}options=-c%20statement_timeout%3D12345"
    store = open_store(url + "&pool_max_size=2")
    try:
        assert store.execute_raw("SHOW statement_timeout") == [("12345ms",)]  # type: ignore[attr-defined]
    finally:
        store.close()


@pytest.mark.parametrize(
    "argv",
    [
        ("token", "list", "--db"),
        ("audit", "verify", "--db"),
        ("db", "migrate", "--database-url"),
    ],
)
def test_a_database_password_never_reaches_an_error_message(
    argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    url = "postgresql://owner:S3cret#pw@127.0.0.1:1/ledger?connect_timeout=1&pool_timeout=2"
    code: int | str | None
    try:
        code = main([*argv, url])
    except SystemExit as exc:  # argparse-level refusals exit through SystemExit
        code = exc.code
    captured = capsys.readouterr()
    assert code != 0
    assert "S3cret" not in captured.out + captured.err
    assert "owner:***@127.0.0.1:1" in captured.err
