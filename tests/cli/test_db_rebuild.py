"""`shardledger db rebuild`: replay runs to check or repair their projections, on both backends.

A real server writes the history; the test then edits projection rows behind its
back (as a bug or a hand-edit would), and checks what `--check` reports, that it
changes nothing, that a rebuild restores exactly what the server answered before,
and that a run whose hash chain is broken is refused and left alone while the others are rebuilt.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ledger_server.config import ServerConfig
from ledger_server.server import create_server
from ledger_server.store import open_store
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from shardledger_cli.cli import (
    EXIT_LOCAL,
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_USAGE,
    CommandError,
    build_parser,
)
from tests import pg
from tests.builders import DIGEST_B, committed, event, planned, started

pg_cluster = pg.pg_cluster
pg_url = pg.pg_url


def _db(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    """Runs `shardledger db ...`; returns the exit code and the parsed JSON it printed."""
    capsys.readouterr()
    args = build_parser(("shardledger_cli.commands.db",)).parse_args(["db", *argv])
    code: int = args.func(args)
    out = capsys.readouterr().out
    return code, json.loads(out) if "--json" in argv else out


def _history(client: LedgerClient) -> None:
    for run in ("night-1", "night-2"):
        batch = [planned(run, f"s{i}", index=i) for i in range(6)]
        batch += [started(run, f"s{i}", "a1") for i in range(1, 6)]
        batch += [committed(run, f"s{i}", "a1") for i in (2, 3, 5)]
        batch += [
            event(run, "s4", "a1", failed=pb.AttemptFailed(tag=pb.FAILURE_TAG_OOM, message="")),
            started(run, "s5", "a2"),
            committed(run, "s5", "a2", digest=DIGEST_B),
        ]
        client.append(batch)
        # Heartbeats of a latest attempt land in the narrow heartbeat rows.
        for step in (1, 2, 3):
            client.append([event(run, "s1", "a1", heartbeat=pb.Heartbeat(step=step, progress=0.1))])


def _write_history(url: str) -> None:
    """Writes the two runs through a real server on the database."""
    running = create_server(ServerConfig(database=url, listen="127.0.0.1:0"))
    client = LedgerClient(f"127.0.0.1:{running.port}", timeout_s=10)
    try:
        _history(client)
    finally:
        client.close()
        running.stop(0.5)


def _answers(url: str) -> dict[str, Any]:
    """What a user reads from a server on this database: status and resume of each run."""
    running = create_server(ServerConfig(database=url, listen="127.0.0.1:0"))
    client = LedgerClient(f"127.0.0.1:{running.port}", timeout_s=10)
    try:
        out = {}
        for run in ("night-1", "night-2"):
            summary = json.loads(client.summary(run))
            for key in ("as_of_us", "event_count", "head_hash"):
                summary.pop(key)
            resume = [(e.shard_id, e.reason) for e in client.resume(run)]
            out[run] = (summary, resume)
        return out
    finally:
        client.close()
        running.stop(0.5)


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Returns a database of each backend holding two runs written through a real server."""
    if request.param == "sqlite":
        database = f"sqlite:///{tmp_path / 'ledger.db'}"
    else:
        database = str(request.getfixturevalue("pg_url"))
    _write_history(database)
    yield database


def _sql(url: str, sql: str, params: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
    store = open_store(url)
    try:
        rows: list[tuple[Any, ...]] = store.execute_raw(sql, params)  # type: ignore[attr-defined]
        return rows
    finally:
        store.close()


def _tamper(url: str) -> None:
    """Edits night-1's projections behind the server's back: one row, one counter, one extra."""
    mark = "?" if url.startswith("sqlite") else "%s"
    (pk,) = _sql(url, "SELECT run_pk FROM runs WHERE run_id = 'night-1'")[0]
    _sql(
        url,
        f"UPDATE shards SET state = 'verified', detail = '' WHERE run_pk = {mark}"
        f" AND shard_id = 's4'",
        (pk,),
    )
    _sql(url, f"DELETE FROM run_counters WHERE run_pk = {mark} AND key = 'state:failed'", (pk,))
    _sql(
        url,
        "INSERT INTO shards (run_pk, shard_id, plan_index, state, detail, deadline_us,"
        f" plan_line, record) VALUES ({mark}, 'ghost', 99, 'planned', '', NULL, '', {mark})",
        (pk, b"{}"),
    )


def test_check_passes_on_the_projections_a_server_wrote(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report = _db(capsys, "rebuild", "--database-url", url, "--check", "--json")
    assert code == EXIT_OK
    assert [(r["run_id"], r["events"], r["shards"]) for r in report["runs"]] == [
        ("night-1", 20, 6),
        ("night-2", 20, 6),
    ]
    assert all(r["differing_shards"] == 0 and not r["counters_differ"] for r in report["runs"])
    assert not any(r["rewritten"] for r in report["runs"])


def test_check_reports_edited_projections_changes_nothing_and_rebuild_repairs_them(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _answers(url)
    _tamper(url)
    tampered = _answers(url)
    assert tampered["night-1"] != before["night-1"]

    code, report = _db(capsys, "rebuild", "--database-url", url, "--check", "--json")
    assert code == EXIT_PROBLEMS
    night1, night2 = report["runs"]
    assert (night1["differing_shards"], night1["counters_differ"]) == (2, True)
    assert (night2["differing_shards"], night2["counters_differ"]) == (0, False)
    assert _answers(url) == tampered  # --check wrote nothing

    code, text = _db(capsys, "rebuild", "--database-url", url, "--run", "night-1")
    assert code == EXIT_OK
    assert "default/night-1: 20 events, 6 shards" in text
    assert "2 shard rows differ, counters differ -> rewritten" in text
    assert _answers(url) == before
    code, report = _db(capsys, "rebuild", "--database-url", url, "--check", "--json")
    assert code == EXIT_OK


@pytest.mark.parametrize("in_memory", ["1", "0"])
def test_a_rebuild_holding_few_or_all_records_in_memory_repairs_the_same(
    url: str, capsys: pytest.CaptureFixture[str], in_memory: str
) -> None:
    # 1: every shard record but the latest used waits packed and is parsed back on the
    # shard's next event; 0: all stay objects. Both must land on what the server wrote.
    before = _answers(url)
    _tamper(url)
    code, text = _db(capsys, "rebuild", "--database-url", url, "--records-in-memory", in_memory)
    assert code == EXIT_OK
    assert "2 shard rows differ, counters differ -> rewritten" in text
    assert _answers(url) == before
    code, report = _db(
        capsys,
        "rebuild",
        "--database-url",
        url,
        "--check",
        "--records-in-memory",
        in_memory,
        "--json",
    )
    assert code == EXIT_OK
    assert [r["shards"] for r in report["runs"]] == [6, 6]


def test_a_run_with_a_broken_chain_is_refused_and_left_alone_while_the_others_are_rebuilt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ledger.db"
    url = f"sqlite:///{path}"
    _write_history(url)
    _tamper(url)  # night-1's projections: rebuilt from its intact chain
    with sqlite3.connect(path) as conn:
        # A hand-edit of one of night-2's event rows: the append-only trigger has to go first.
        conn.execute("DROP TRIGGER events_no_update")
        conn.execute(
            "UPDATE events SET row = CAST(replace(CAST(row AS TEXT), '\"oom\"', '\"nan\"') AS BLOB)"
            " WHERE CAST(row AS TEXT) LIKE '%\"oom\"%' AND run_pk = 2"
        )
        (seq,) = conn.execute(
            "SELECT seq FROM events WHERE CAST(row AS TEXT) LIKE '%\"nan\"%'"
        ).fetchone()
    night_2 = "SELECT * FROM shards WHERE run_pk = 2 ORDER BY shard_id"
    night_2_before = _sql(url, night_2)

    code, report = _db(capsys, "rebuild", "--database-url", url, "--check", "--json")
    assert code == EXIT_LOCAL
    [refused] = report["refused"]
    assert refused["run_id"] == "night-2"
    assert f"hash chain breaks at sequence {seq}" in refused["reason"]

    code, text = _db(capsys, "rebuild", "--database-url", url)
    assert code == EXIT_LOCAL
    assert "default/night-1: 20 events, 6 shards" in text and "-> rewritten" in text
    assert "default/night-2: REFUSED, left as it was: run default/night-2" in text
    assert "nothing was written" not in text
    assert _sql(url, night_2) == night_2_before
    assert _sql(url, "SELECT count(*) FROM shards WHERE shard_id = 'ghost'") == [(0,)]


def test_an_unknown_run_or_a_bad_namespace_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    with pytest.raises(CommandError) as typo:
        _db(capsys, "rebuild", "--database-url", url)
    assert (typo.value.code, str(typo.value)) == (EXIT_LOCAL, f"no ledger at {url}")
    assert not (tmp_path / "ledger.db").exists()
    open_store(url).close()  # an empty ledger
    with pytest.raises(CommandError) as missing:
        _db(capsys, "rebuild", "--database-url", url, "--run", "nope")
    assert missing.value.code == EXIT_LOCAL
    assert "no run nope in namespace default" in str(missing.value)
    with pytest.raises(CommandError) as bad:
        _db(capsys, "rebuild", "--database-url", url, "--run", "x", "--namespace", "Bad_NS")
    assert bad.value.code == EXIT_USAGE
    code, text = _db(capsys, "rebuild", "--database-url", url)
    assert (code, text.strip()) == (EXIT_OK, "no runs")
