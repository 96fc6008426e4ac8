"""`shardledger export RUN --sqlite`: nights played through the SDK, queried as docs/analysis.md does."""

from __future__ import annotations

import json
import re
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlite_utils
import structlog

from shardledger_cli.cli import EXIT_LOCAL, EXIT_OK, EXIT_REJECTED, EXIT_USAGE
from tests.builders import run_cli
from tests.nights import play_night

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("spool_in_tmp")


@pytest.fixture(autouse=True)
def quiet_server_logs() -> Iterator[None]:
    """Keeps the in-process server's log lines out of the CLI's captured stdout."""
    with structlog.testing.capture_logs():
        yield


def doc_queries() -> dict[str, str]:
    """Returns docs/analysis.md's example queries by their heading."""
    text = (REPO / "docs" / "analysis.md").read_text()
    found = re.findall(r"### (.+?)\n.*?```sql\n(.+?)```", text, flags=re.S)
    return {title.strip(): sql for title, sql in found}


@pytest.fixture
def nights(capsys: pytest.CaptureFixture[str], target: str, tmp_path: Path) -> Path:
    """Two providers' nights exported into one analysis database; returns its path."""
    root = tmp_path / "out"
    db = tmp_path / "nights.db"
    a = {"provider": "A", "pool": "on-demand", "region": "eu-1", "image": "img@sha256:1"}
    d = {"provider": "D", "pool": "spot", "region": "us-2", "image": "img@sha256:1"}
    play_night(capsys, target, root, "night-a", ["ok", "ok", "ok", "missing"], labels=a)
    play_night(capsys, target, root, "night-d", ["ok", "empty", "truncated", "preempted"], labels=d)
    for run in ("night-a", "night-d"):
        code, _, err = run_cli(capsys, "export", run, "--sqlite", str(db), "--server", target)
        assert code == EXIT_OK, err
    return db


def test_export_sqlite_writes_tidy_tables_of_what_the_sdk_recorded(
    nights: Path, capsys: pytest.CaptureFixture[str], target: str
) -> None:
    db = sqlite_utils.Database(nights)

    assert {"runs", "shards", "attempts", "artifacts", "checkpoints", "verdicts", "events"} <= set(
        db.table_names()
    )
    runs = {r["run_id"]: r for r in db.query("select * from runs")}
    assert (runs["night-a"]["provider"], runs["night-a"]["submitted"]) == ("A", 4)
    assert runs["night-a"]["missing"] == 1 and runs["night-d"]["silent_errors"] == 2
    states = dict(
        db.execute("select shard_id, state from shards where run_id='night-d'").fetchall()
    )
    assert states == {
        "s0": "verified",
        "s1": "verify_failed",
        "s2": "verify_failed",
        "s3": "verified",
    }
    [(tags,)] = db.execute(
        "select group_concat(failed_tag) from attempts where run_id='night-d' and failed_tag is not null"
    ).fetchall()
    assert tags == "preempted"
    reasons = [
        r[0]
        for r in db.execute("select reason from verdicts where result='failed' order by shard_id")
    ]
    assert reasons == ["empty", "size_mismatch"]
    [(write_s,)] = db.execute(
        "select min(write_s) from checkpoints where run_id='night-a'"
    ).fetchall()
    assert write_s > 0  # the SDK measured each checkpoint's write
    kinds = {r[0] for r in db.execute("select distinct kind from events")}
    assert {
        "planned",
        "started",
        "heartbeat",
        "checkpoint",
        "artifact_committed",
        "verified",
    } <= kinds


def test_exporting_a_run_again_replaces_its_rows_and_keeps_the_others(
    nights: Path, capsys: pytest.CaptureFixture[str], target: str
) -> None:
    before = sqlite_utils.Database(nights).execute("select count(*) from events").fetchone()[0]

    code, out, _ = run_cli(
        capsys, "export", "night-a", "--sqlite", str(nights), "--server", target, "--json"
    )

    assert code == EXIT_OK
    answer = json.loads(out)
    assert answer["run_id"] == "night-a" and answer["rows"]["shards"] == 4
    after = sqlite_utils.Database(nights).execute("select count(*) from events").fetchone()[0]
    assert after == before


def test_the_three_documented_queries_answer_the_field_reports_questions(nights: Path) -> None:
    queries = doc_queries()
    assert len(queries) >= 3, queries
    conn = sqlite3.connect(nights)
    conn.row_factory = sqlite3.Row

    missing = [dict(r) for r in conn.execute(queries["Missing shards by batch"])]
    silent = {r["provider"]: dict(r) for r in conn.execute(queries["Silent errors by provider"])}
    drift = [dict(r) for r in conn.execute(queries["Drift by fingerprint"])]

    assert {(r["run_id"], r["batch"], r["missing"]) for r in missing} >= {("night-a", 0, 1)}
    assert silent["A"]["silent"] == 0 and silent["D"]["silent"] == 2
    assert silent["D"]["shards"] == 4 and silent["D"]["silent_rate"] == 0.5
    # One environment. The outputs that passed: s0-s2 of night-a, s0 and the rerun s3 of
    # night-d. s1 gave a result on night-a and an empty file on night-d, and s2 was
    # truncated there: failed verification is a silent error, not drift (the query once
    # counted it as drifted 1, with 7 outputs).
    [group] = drift
    assert (group["outputs"], group["inputs"], group["drifted"]) == (5, 4, 0)


def test_a_file_that_is_not_an_analysis_database_is_refused_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str, db_path: Path
) -> None:
    play_night(capsys, target, tmp_path / "out", "night-x", ["ok"])
    before = db_path.read_bytes()

    code, _, err = run_cli(
        capsys, "export", "night-x", "--sqlite", str(db_path), "--server", target
    )

    assert code == EXIT_LOCAL
    assert "not a shardledger analysis database" in err
    assert db_path.read_bytes() == before


def test_unknown_run_and_both_targets_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str
) -> None:
    out = tmp_path / "a.db"
    code, _, err = run_cli(capsys, "export", "nope", "--sqlite", str(out), "--server", target)
    assert code == EXIT_REJECTED and "RUN_NOT_FOUND" in err
    assert not out.exists()
    code, _, err = run_cli(capsys, "export", "nope", "--sqlite", str(out), "-o", "x.jsonl")
    assert code == EXIT_USAGE and "not allowed with" in err


def test_a_repair_keeps_the_first_pass_silent_errors_and_durations_end_at_the_commit(
    nights: Path, capsys: pytest.CaptureFixture[str], target: str, tmp_path: Path
) -> None:
    """The issue's night: silent errors by provider read {0} after repair, and duration_s grew
    with every later verify. The first pass is history; an attempt ends at its own end."""
    db = sqlite_utils.Database(nights)
    before = dict(
        db.execute("select attempt_id, duration_s from attempts where run_id='night-d'").fetchall()
    )
    # Rerun the two shards that failed verification, verify again, then verify once more
    # after an idle wait: none of it may move an attempt's span.
    play_night(capsys, target, tmp_path / "out", "night-d", ["ok", "ok"], shard_ids=["s1", "s2"])
    time.sleep(1.0)
    code, _, err = run_cli(
        capsys, "verify", "night-d", "--root", str(tmp_path / "out"), "--server", target
    )
    assert code in (0, 1), err
    code, _, err = run_cli(capsys, "export", "night-d", "--sqlite", str(nights), "--server", target)
    assert code == EXIT_OK, err

    silent = {r["provider"]: r for r in db.query(doc_queries()["Silent errors by provider"])}
    assert (silent["D"]["silent"], silent["D"]["shards"]) == (2, 4)  # the first pass's two
    now = dict(db.execute("select shard_id, silent from shards where run_id='night-d'").fetchall())
    assert now == {"s0": 0, "s1": 0, "s2": 0, "s3": 0}  # repaired: no silent error now
    after = dict(
        db.execute("select attempt_id, duration_s from attempts where run_id='night-d'").fetchall()
    )
    assert len(after) == len(before) + 2
    assert {a: after[a] for a in before} == before  # verdicts and an idle second never extend
    assert max(after.values()) < 1.0  # the jobs take milliseconds; the idle wait was 1 s
