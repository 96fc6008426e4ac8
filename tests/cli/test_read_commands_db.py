"""Read commands on a ledger file (--db): the same answers as through a server, nothing written.

A real night (tests/nights.py: every outcome, a SIGKILLed job, verify) is played on a
real server over a SQLite file; a consistent copy of that file is then read with
`COMMAND --db COPY` while the server keeps serving the original, and each command's
JSON must equal what `COMMAND --server` prints, byte for byte once the fields that
legitimately differ are masked. The copy, and its directory, must not change.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import structlog

from ledger_server.config import ServerConfig
from ledger_server.server import RunningServer, create_server
from ledger_server.store import open_store
from ledger_server.store.base import StoreReadOnly
from ledger_server.store.sqlite import SqliteStore
from shard_client.client import LedgerClient
from tests import pg
from tests.builders import committed, planned, run_cli, started
from tests.nights import play_night

RUN = "night-01"
RUN_2 = "night-02"
OUTCOMES = ["ok", "ok", "empty", "truncated", "preempted", "hang", "missing"]
OLD = Path(__file__).parents[1] / "data" / "ledger-0.1.0.db"

pytestmark = pytest.mark.usefixtures("spool_in_tmp")
pg_cluster = pg.pg_cluster
pg_url = pg.pg_url


@dataclass(frozen=True, slots=True)
class Night:
    """The live server's address, the copy of its ledger file and the night's outputs."""

    target: str
    live: Path
    copy: Path
    root: Path


@pytest.fixture(scope="module")
def ledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, Path]]:
    """A real server on a free port over a SQLite file, kept for the whole module."""
    base = tmp_path_factory.mktemp("read-db")
    (base / "live").mkdir()
    server = create_server(
        ServerConfig(database=str(base / "live" / "ledger.db"), listen="127.0.0.1:0")
    )
    yield server, base
    server.stop(0.5)


_played: dict[str, Night] = {}


@pytest.fixture
def night(ledger: tuple[RunningServer, Path], capsys: pytest.CaptureFixture[str]) -> Night:
    """Two nights played once for the module (by the first test asking), and the file's copy."""
    if RUN not in _played:
        server, base = ledger
        target = f"127.0.0.1:{server.port}"
        root = base / "out"
        with structlog.testing.capture_logs():
            play_night(capsys, target, root, RUN, OUTCOMES, labels={"provider": "D"})
            play_night(capsys, target, root, RUN_2, ["ok", "empty"], labels={"provider": "E"})
        live = base / "live" / "ledger.db"
        copy = base / "copy" / "ledger.db"
        copy.parent.mkdir()
        backup(live, copy)
        # export signs the run's head with the ledger's key: a post-mortem copies it too.
        shutil.copyfile(f"{live}.signing-key.pem", f"{copy}.signing-key.pem")
        _played[RUN] = Night(target=target, live=live, copy=copy, root=root)
    return _played[RUN]


def backup(source: Path, target: Path) -> None:
    """Copies a ledger file consistently (the online backup API), as an operator would."""
    with sqlite3.connect(source) as src, sqlite3.connect(target) as dst:
        src.backup(dst)
    src.close()
    dst.close()


def snapshot(path: Path) -> tuple[list[str], str]:
    """Returns the directory's names and the file's sha256."""
    names = sorted(p.name for p in path.parent.iterdir())
    return names, hashlib.sha256(path.read_bytes()).hexdigest()


def masked(value: Any, keys: frozenset[str]) -> Any:
    """Returns value with every key in keys, at any depth, replaced by "<masked>"."""
    if isinstance(value, dict):
        return {k: "<masked>" if k in keys else masked(v, keys) for k, v in value.items()}
    if isinstance(value, list):
        return [masked(v, keys) for v in value]
    return value


def json_values(out: str) -> list[Any]:
    """Returns the JSON values a command printed: one object, or one per line (JSON Lines)."""
    text = out.strip()
    if not text:
        return []
    try:
        return [json.loads(text)]
    except json.JSONDecodeError:
        return [json.loads(line) for line in text.splitlines()]


# What each command computes "now" differs between two runs of it, and nothing else may:
# as_of_us and as_of are the moment of the answer (status, report, the analysis database's
# runs row); the signed tree head of an export carries its signing time, so its signature
# differs too.
AS_OF = frozenset({"as_of_us", "as_of"})
SIGNED_AT = AS_OF | {"timestamp_ms", "signature_hex"}

# (argv with {root}/{out} to fill in, the keys to mask). Every read command with --db.
COMMANDS: dict[str, tuple[list[str], frozenset[str]]] = {
    "status": (["status", RUN, "--json"], AS_OF),
    "status --costs": (["status", RUN, "--costs", "--json"], AS_OF),
    "shards": (["shards", RUN, "--json"], AS_OF),
    "shards --state": (["shards", RUN, "--state", "unconfirmed", "--format", "json"], AS_OF),
    "resume": (["resume", RUN, "--json", "--reasons"], AS_OF),
    "events": (["events", RUN, "--json"], AS_OF),
    "events --shard": (["events", RUN, "--shard", "s4", "--json"], AS_OF),
    "runs": (["runs", "--json"], AS_OF),
    "report": (["report", RUN, "--json"], AS_OF),
    "report --by": (["report", "--by", "provider", RUN, RUN_2, "--json"], AS_OF),
    "report --by --last": (["report", "--by", "provider", "--json"], AS_OF),
    "trend": (["trend", "--json"], AS_OF),
    "export": (["export", RUN], SIGNED_AT),
    # The analysis database's own path differs (one per side); its tables are compared below.
    "export --sqlite": (["export", RUN, "--sqlite", "{out}", "--json"], frozenset({"database"})),
    "verify --dry-run": (
        ["verify", RUN, "--root", "{root}", "--dry-run", "--recheck", "--json"],
        AS_OF,
    ),
    "compare": (
        ["compare", RUN, RUN_2, "--root", "{root}", "--ref-root", "{root}", "--json"],
        AS_OF,
    ),
    "accept": (["accept", "--runs", f"{RUN},{RUN_2}", "--json"], AS_OF),
    "sample --dry-run": (
        ["sample", RUN, "--as", "night-01-ref", "--min", "2", "--dry-run", "--json"],
        AS_OF,
    ),
    "notify --dry-run": (["notify", RUN, "--dry-run", "--json"], AS_OF),
    # Lists the stale attempts (the SIGKILLed job's) as of now; --db acts on none.
    "watch": (["watch", RUN, "--diag-dir", "{out}", "--json"], AS_OF),
}


def in_order(values: list[Any]) -> list[Any]:
    """Returns values with verify's failures and unchecked lists sorted.

    verify lists them as its reads finish, which differs from one run to the next
    (even with one reader: finished reads come back as a set); the lists must hold the
    same entries, not in the same order.
    """
    return [
        value | {k: sorted(value[k], key=canonical) for k in ("failures", "unchecked")}
        if isinstance(value, dict) and "dry_run" in value
        else value
        for value in values
    ]


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def fill(argv: list[str], night: Night, out: Path) -> list[str]:
    return [a.format(root=night.root, out=out) for a in argv]


@pytest.mark.parametrize("name", COMMANDS)
def test_a_read_command_answers_from_the_file_exactly_as_through_the_server(
    night: Night, capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str
) -> None:
    argv, mask = COMMANDS[name]
    before = snapshot(night.copy)
    with structlog.testing.capture_logs():
        code_s, out_s, err_s = run_cli(
            capsys, *fill(argv, night, tmp_path / "server.db"), "--server", night.target
        )
        code_f, out_f, err_f = run_cli(
            capsys, *fill(argv, night, tmp_path / "file.db"), "--db", str(night.copy)
        )
    assert code_s in (0, 1), err_s
    assert (code_f, err_f) == (code_s, err_s.replace("server.db", "file.db"))
    from_server, from_file = json_values(out_s), json_values(out_f)
    assert from_server, f"{name} printed nothing"
    assert in_order(masked(from_file, mask)) == in_order(masked(from_server, mask))
    if name == "export --sqlite":
        assert tables(tmp_path / "file.db") == tables(tmp_path / "server.db")
    assert snapshot(night.copy) == before


def tables(path: Path) -> dict[str, list[dict[str, Any]]]:
    """Returns every table of an analysis database, its rows sorted, as_of_us masked."""
    found: dict[str, list[dict[str, Any]]] = {}
    with sqlite3.connect(path) as conn:
        names = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for name in names:
            cursor = conn.execute(f'SELECT * FROM "{name}"')
            columns = [d[0] for d in cursor.description]
            rows = [masked(dict(zip(columns, row, strict=True)), AS_OF) for row in cursor]
            found[name] = sorted(rows, key=lambda r: json.dumps(r, sort_keys=True, default=str))
    conn.close()
    return found


def test_the_file_a_server_has_open_reads_the_same_and_keeps_its_bytes(
    night: Night, capsys: pytest.CaptureFixture[str]
) -> None:
    # The live file: its commits may still be in the -wal, read through SQLite's shared
    # memory (-shm, an index SQLite itself rewrites); the file and its -wal are untouched.
    wal = Path(f"{night.live}-wal")
    before = [p.read_bytes() for p in (night.live, wal)]
    with structlog.testing.capture_logs():
        _, out_s, _ = run_cli(capsys, "status", RUN, "--json", "--server", night.target)
        code, out_f, err = run_cli(capsys, "status", RUN, "--json", "--db", str(night.live))
    assert code == 1, err
    assert masked(json.loads(out_f), AS_OF) == masked(json.loads(out_s), AS_OF)
    assert [p.read_bytes() for p in (night.live, wal)] == before


# Each read command as it is typed with --db (the file's path follows).
WITH_DB = [
    ["status", RUN],
    ["shards", RUN],
    ["resume", RUN],
    ["events", RUN],
    ["runs"],
    ["report", RUN],
    ["trend"],
    ["export", RUN],
    ["verify", RUN, "--dry-run"],
    ["compare", RUN, RUN_2],
    ["accept", "--runs", RUN],
    ["sample", RUN, "--as", "ref", "--dry-run"],
    ["notify", RUN, "--dry-run"],
    ["watch", RUN],
]


@pytest.mark.parametrize("argv", WITH_DB, ids=lambda a: a[0])
def test_db_with_server_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    missing = tmp_path / "ledger.db"
    code, _, err = run_cli(capsys, *argv, "--db", str(missing), "--server", "127.0.0.1:1")
    assert code == 2, err
    assert "--db and --server are mutually exclusive" in err
    assert not missing.exists()


@pytest.mark.parametrize("argv", WITH_DB, ids=lambda a: a[0])
def test_a_missing_file_is_refused_with_exit_5_naming_it_and_not_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    missing = tmp_path / "no-such" / "ledger.db"
    missing.parent.mkdir()
    code, out, err = run_cli(capsys, *argv, "--db", str(missing))
    assert code == 5, out + err
    assert f"no ledger at {missing}: no such file" in err
    assert list(missing.parent.iterdir()) == []


def test_verify_on_a_file_without_dry_run_is_refused_as_it_would_record(
    night: Night, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(
        capsys, "verify", RUN, "--root", str(night.root), "--db", str(night.copy)
    )
    assert code == 2
    assert "add --dry-run" in err and "--db opens the ledger read-only" in err


def test_verify_dry_run_through_a_server_records_nothing(
    night: Night, capsys: pytest.CaptureFixture[str]
) -> None:
    def event_count() -> int:
        client = LedgerClient(night.target)
        try:
            return int(json.loads(client.summary(RUN))["event_count"])
        finally:
            client.close()

    before = event_count()
    argv = ["verify", RUN, "--root", str(night.root), "--recheck", "--dry-run", "--json"]
    with structlog.testing.capture_logs():
        code, out, err = run_cli(capsys, *argv, "--server", night.target)
    report = json.loads(out)
    assert code == 1, err  # the night's empty and truncated outputs fail
    assert report["dry_run"] and report["appended"] == 0
    assert report["not_recorded"] == report["checked"] > 0
    assert event_count() == before


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["sample", RUN, "--as", "night-01-ref"], "add --dry-run"),
        (["watch", RUN, "--kill-stale"], "--kill-stale records failed(timeout)"),
        (["watch", RUN, "--record-remote"], "--record-remote records failed(timeout)"),
        (["watch", RUN, "--interval", "5"], "--interval waits"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else "",
)
def test_a_command_that_would_write_or_wait_is_refused_on_a_file_and_changes_nothing(
    night: Night, capsys: pytest.CaptureFixture[str], argv: list[str], flag: str
) -> None:
    before = snapshot(night.copy)
    code, out, err = run_cli(capsys, *argv, "--db", str(night.copy))
    assert (code, out) == (2, ""), err
    assert flag in err and "--server" in err
    assert snapshot(night.copy) == before


def test_events_follow_on_a_file_is_refused(
    night: Night, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(capsys, "events", RUN, "--follow", "--db", str(night.copy))
    assert code == 2
    assert "--follow" in err and "--server" in err


def test_export_of_a_file_without_its_signing_key_says_where_the_key_belongs(
    night: Night, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bare = tmp_path / "ledger.db"
    backup(night.copy, bare)
    code, out, err = run_cli(capsys, "export", RUN, "--db", str(bare))
    assert code == 5, err
    assert out == ""
    assert f"no signing key at {bare}.signing-key.pem" in err


def test_a_ledger_whose_records_need_a_rebuild_is_refused_and_left_as_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = tmp_path / "ledger.db"
    shutil.copyfile(OLD, old)  # release 0.1.0's shard records: a server start rewrites them
    SqliteStore(old).close()  # the schema of this release (records are left as they were)
    before = snapshot(old)
    code, _, err = run_cli(capsys, "status", "night-0.1.0", "--db", str(old))
    assert code == 5, err
    assert "older format" in err and "shardledger db rebuild --db COPY" in err
    assert snapshot(old) == before


def test_a_ledger_of_an_older_schema_is_refused_not_migrated(
    night: Night, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = tmp_path / "ledger.db"
    backup(night.copy, old)
    with sqlite3.connect(old) as conn:  # as if the last migration had not run yet
        conn.execute("DELETE FROM schema_migrations WHERE version = ?", (max_version(conn),))
    conn.close()
    before = snapshot(old)
    code, _, err = run_cli(capsys, "runs", "--db", str(old))
    assert code == 5, err
    assert "older than this release's" in err and "shardledger db migrate" in err
    assert snapshot(old) == before


def max_version(conn: sqlite3.Connection) -> int:
    return int(conn.execute("SELECT MAX(version) FROM schema_migrations").fetchone()[0])


def test_a_postgresql_ledger_is_read_in_read_only_sessions(
    pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with structlog.testing.capture_logs():
        server = create_server(ServerConfig(database=pg_url, listen="127.0.0.1:0"))
        try:
            target = f"127.0.0.1:{server.port}"
            client = LedgerClient(target)
            client.append([planned(), started(), committed()])
            client.close()
            for argv in (["status", "run-1", "--json"], ["shards", "run-1", "--json"]):
                _, out_s, _ = run_cli(capsys, *argv, "--server", target)
                code, out_f, err = run_cli(capsys, *argv, "--db", pg_url)
                assert code in (0, 1), err
                assert masked(json_values(out_f), AS_OF) == masked(json_values(out_s), AS_OF)
        finally:
            server.stop(0.5)
    # What --db opens: a session in which PostgreSQL itself refuses a write (25006).
    store = open_store(pg_url, read_only=True)
    try:
        with pytest.raises(StoreReadOnly), store.write() as tx:
            tx.create_run("default", "run-ro", now_us=1, genesis=bytes(32))
    finally:
        store.close()
