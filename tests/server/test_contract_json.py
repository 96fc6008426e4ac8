"""What the ledger stores of JSON and integers, as docs/contract.md specifies it."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import grpc
import pytest

from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from shard_client.errors import LedgerRejected
from tests.builders import event, planned, run_cli, started


def _rows(db_path: Path) -> list[bytes]:
    with sqlite3.connect(db_path) as conn:
        return [bytes(r[0]) for r in conn.execute("SELECT row FROM events ORDER BY seq")]


def test_params_are_stored_in_rfc8785_form(client: LedgerClient) -> None:
    plan = planned()
    plan.planned.params_json = '{"lr": 1.0, "eps": 1e-07, "big": 1e21, "name": "Äpfel"}'
    client.append([plan])
    stored = next(iter(client.list_events("run-1"))).planned.params_json
    assert stored == '{"big":1e+21,"eps":1e-7,"lr":1,"name":"Äpfel"}'


def test_an_integer_param_past_2_53_is_refused_with_the_field_and_nothing_is_written(
    client: LedgerClient, db_path: Path
) -> None:
    plan = planned()
    plan.planned.params_json = '{"seed": 9007199254740993}'
    with pytest.raises(LedgerRejected) as refused:
        client.append([plan])
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.reason == "INVALID_FIELD"
    assert refused.value.metadata["field"] == "planned.params_json"
    assert _rows(db_path) == []


def test_an_event_integer_past_2_53_is_a_string_in_the_row_and_reads_back(
    client: LedgerClient, db_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    late = started()
    late.client_time.FromMicroseconds(253_402_300_799_999_999)  # the last valid Timestamp
    commit = event(
        attempt_id="att-1",
        artifact_committed=pb.ArtifactCommitted(
            name="out", path="/out/x", size_bytes=2**60, blake3_hex="c" * 64
        ),
    )
    client.append([planned(), late, commit])
    rows = [json.loads(r) for r in _rows(db_path)]
    assert rows[1]["event"]["client_time_us"] == "253402300799999999"
    assert rows[2]["event"]["payload"]["size_bytes"] == str(2**60)
    events = list(client.list_events("run-1"))
    assert events[1].client_time.ToMicroseconds() == 253_402_300_799_999_999
    assert events[2].artifact_committed.size_bytes == 2**60
    code, out, _ = run_cli(capsys, "audit", "verify", "run-1", "--server", client.target)
    assert code == 0, out
    code, out, _ = run_cli(capsys, "audit", "verify", "run-1", "--db", str(db_path))
    assert code == 0, out
