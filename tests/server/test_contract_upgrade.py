"""Row format 1 ledgers keep verifying after RFC 8785 was adopted; new rows are of format 2.

`tests/data/ledger-v1-rows.db` was written by main before the change
(tools/gen/v1_rows_ledger.py): its rows hold floats (1.0, 1e-07), non-ASCII and astral
text in Python's encoding, which RFC 8785 writes differently. Its rows are never
rewritten: they are verified with the encoding that wrote them, and the run goes on
with rows of format 2 in the same chain.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf.duration_pb2 import Duration

from ledger_server.config import ServerConfig
from ledger_server.server import RunningServer, create_server
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.canonical import fingerprint_digest
from shard_client.client import LedgerClient
from tests.builders import DIGEST_A, event, run_cli

OLD = Path(__file__).parents[1] / "data" / "ledger-v1-rows.db"
RUN = "night-v1-rows"
# What the night read as before the upgrade (main at 4cbfae0).
MINUTE = Duration(seconds=60)
STATES = {"s0": "verified", "s1": "failed", "s2": "unverified", "s3": "missing"}


@pytest.fixture
def old_db(tmp_path: Path) -> Path:
    copy = tmp_path / "ledger.db"
    shutil.copyfile(OLD, copy)
    return copy


@pytest.fixture
def upgraded(old_db: Path, quiet_logs: None) -> Iterator[RunningServer]:
    running = create_server(ServerConfig(database=str(old_db), listen="127.0.0.1:0"))
    try:
        yield running
    finally:
        running.stop(0)


def _rows(db: Path) -> list[bytes]:
    with sqlite3.connect(db) as conn:
        return [bytes(r[0]) for r in conn.execute("SELECT row FROM events ORDER BY seq")]


def _verify_and_rebuild(capsys: pytest.CaptureFixture[str], db: Path) -> None:
    code, out, _ = run_cli(capsys, "audit", "verify", RUN, "--db", str(db))
    assert code == 0, out
    code, out, _ = run_cli(capsys, "db", "rebuild", "--check", "--database-url", f"sqlite:///{db}")
    assert code == 0, out
    assert "consistent" in out


def test_the_old_rows_are_of_row_format_1_and_verify_before(
    old_db: Path, capsys: pytest.CaptureFixture[str], quiet_logs: None
) -> None:
    rows = _rows(old_db)
    assert rows and all(b'"v":' not in r[-12:] for r in rows)
    assert b'\\"lr\\":1.0' in rows[0] and b'"loss":1e-07' in rows[5]
    # Its chain verifies as it is; its shard records are of an older record version
    # (multi-rank state came later), which the upgrade at server start rebuilds, so
    # `db rebuild --check` is asked only after it (the next test).
    code, out, _ = run_cli(capsys, "audit", "verify", RUN, "--db", str(old_db))
    assert code == 0, out


def test_after_the_upgrade_old_rows_verify_unchanged_and_the_run_goes_on_in_format_2(
    old_db: Path, upgraded: RunningServer, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _rows(old_db)
    client = LedgerClient(f"127.0.0.1:{upgraded.port}")
    assert {v.shard_id: v.state for v in client.shards(RUN)} == STATES
    fields = {"gpu.0.name": "NVIDIA H100 80GB HBM3", "host.label": "Zürich-α", "schema": "2"}
    results = client.append(
        [
            event(
                RUN,
                "s3",
                "a0",
                event_id="start-s3",
                started=pb.AttemptStarted(
                    host="n", pid=1, heartbeat_timeout=MINUTE, fingerprint=fields
                ),
            ),
            event(
                RUN,
                "s3",
                "a0",
                event_id="beat-s3",
                heartbeat=pb.Heartbeat(step=1, progress=1.0, metrics={"loss": 1e-07}),
            ),
        ]
    )
    assert [r.outcome for r in results] == [pb.APPEND_OUTCOME_APPENDED] * 2
    after = _rows(old_db)
    assert after[: len(before)] == before  # history is never rewritten
    new = [json.loads(r) for r in after[len(before) :]]
    assert [r["v"] for r in new] == [2, 2]
    assert new[1]["event"]["payload"] == {"metrics": {"loss": 1e-7}, "progress": 1, "step": 1}
    assert after[-1].endswith(
        b'"progress":1,"step":1},"run_id":"night-v1-rows","shard_id":"s3"},'
        + f'"receive_time_us":{new[1]["receive_time_us"]},'.encode()
        + b'"run_sequence":16,"v":2}'
    )
    # The server filled the digest in from the map, by the contract's rule.
    listed = list(client.list_events(RUN))
    assert listed[-2].started.fingerprint_digest == fingerprint_digest(fields)
    assert [e.row_format for e in listed] == [1] * len(before) + [2, 2]
    # A client re-deriving rows from what the server sends verifies both formats.
    code, out, _ = run_cli(capsys, "audit", "verify", RUN, "--server", client.target)
    assert code == 0, out
    _verify_and_rebuild(capsys, old_db)


def test_replanning_an_old_shard_with_float_params_is_the_same_plan(
    upgraded: RunningServer,
) -> None:
    client = LedgerClient(f"127.0.0.1:{upgraded.port}")
    stored = next(e for e in client.list_events(RUN) if e.shard_id == "s0").planned
    again = pb.ShardPlanned()
    again.CopyFrom(stored)
    # Another language writes the same params as RFC 8785 does: 1 for 1.0, 1e-7 for 1e-07.
    again.params_json = json.dumps(json.loads(stored.params_json)).replace("1.0", "1")
    results = client.append([event(RUN, "s0", event_id="replan-s0", planned=again)])
    assert [r.outcome for r in results] == [pb.APPEND_OUTCOME_ALREADY_PLANNED]


def test_a_mixed_run_exports_and_imports_with_both_formats_intact(
    old_db: Path, upgraded: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client = LedgerClient(f"127.0.0.1:{upgraded.port}")
    client.append(
        [
            event(
                RUN,
                "s3",
                "a0",
                event_id="start-s3",
                started=pb.AttemptStarted(
                    host="n", pid=1, heartbeat_timeout=MINUTE, fingerprint={"k": "ü"}
                ),
            ),
            event(
                RUN,
                "s3",
                "a0",
                artifact_committed=pb.ArtifactCommitted(
                    name="weights", path="/out/s3/w", size_bytes=3, blake3_hex=DIGEST_A
                ),
            ),
        ]
    )
    exported = tmp_path / "night.jsonl"
    code, _, err = run_cli(capsys, "export", RUN, "--server", client.target, "-o", str(exported))
    assert code == 0, err
    fresh = tmp_path / "fresh.db"
    code, out, err = run_cli(capsys, "import", str(exported), "--db", str(fresh))
    assert code == 0, out + err
    assert _rows(fresh) == _rows(old_db)
    _verify_and_rebuild(capsys, fresh)
