"""The ledger owns the fingerprint digest: it computes it from the map, fills it, refuses another."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration

from shard_client import Ledger
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.canonical import fingerprint_digest
from shard_client.client import LedgerClient
from shard_client.environment import Fingerprint
from shard_client.errors import LedgerRejected
from tests.builders import event, planned

A100 = {"gpu.0.name": "NVIDIA A100-SXM4-80GB", "gpu.0.uuid": "GPU-1", "driver": "550.54"}
H100 = {"gpu.0.name": "NVIDIA H100 80GB HBM3", "gpu.0.uuid": "GPU-2", "driver": "550.54"}
NON_ASCII = {"host.label": "Zürich-α", "driver": "550.54"}


def _started(attempt: str, fields: dict[str, str], digest: str) -> pb.ShardEvent:
    return event(
        attempt_id=attempt,
        started=pb.AttemptStarted(
            host="node-1",
            pid=7,
            heartbeat_timeout=Duration(seconds=60),
            fingerprint=fields,
            fingerprint_digest=digest,
        ),
    )


def _count(db_path: Path) -> int:
    with sqlite3.connect(db_path) as conn:
        return int(conn.execute("SELECT count(*) FROM events").fetchone()[0])


def test_a_digest_that_is_not_the_maps_is_refused_and_nothing_is_written(
    client: LedgerClient, db_path: Path
) -> None:
    client.append([planned()])
    wrong = fingerprint_digest(A100)  # an H100 attempt sent with the A100's digest
    with pytest.raises(LedgerRejected) as refused:
        client.append([_started("att-1", H100, wrong)])
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.reason == "FINGERPRINT_DIGEST_MISMATCH"
    assert refused.value.metadata["field"] == "started.fingerprint_digest"
    assert refused.value.metadata["computed"] == fingerprint_digest(H100)
    assert refused.value.metadata["sent"] == wrong
    assert _count(db_path) == 1


def test_an_absent_digest_is_filled_in_and_groups_the_attempts(client: LedgerClient) -> None:
    client.append([planned(shard_id=f"s{i}", index=i) for i in range(3)])
    client.append(
        [
            event(shard_id="s0", attempt_id="a", started=_started("a", A100, "").started),
            # Another board of the same model: GPU identity is not part of the digest.
            event(
                shard_id="s1",
                attempt_id="b",
                started=_started("b", {**A100, "gpu.0.uuid": "GPU-9"}, "").started,
            ),
            event(shard_id="s2", attempt_id="c", started=_started("c", H100, "").started),
        ]
    )
    digests = [e.started.fingerprint_digest for e in client.list_events("run-1") if e.attempt_id]
    assert digests == [fingerprint_digest(A100)] * 2 + [fingerprint_digest(H100)]
    groups = {v.shard_id: v.view_json for v in client.shards("run-1")}
    assert fingerprint_digest(A100) in groups["s0"] and fingerprint_digest(H100) in groups["s2"]


def test_the_digest_older_sdks_computed_is_accepted_and_stored_as_the_contracts(
    client: LedgerClient,
) -> None:
    legacy = fingerprint_digest(NON_ASCII, legacy=True)
    assert legacy != fingerprint_digest(NON_ASCII)  # only non-ASCII maps differ
    client.append([planned(), _started("att-1", NON_ASCII, legacy)])
    stored = next(e for e in client.list_events("run-1") if e.attempt_id)
    assert stored.started.fingerprint_digest == fingerprint_digest(NON_ASCII)


def test_a_resent_start_with_and_without_its_digest_is_one_event(client: LedgerClient) -> None:
    first = client.append([planned(), _started("att-1", A100, "")])
    again = _started("att-1", A100, fingerprint_digest(A100))
    again.event_id = first[1].event_id
    assert [r.outcome for r in client.append([again])] == [pb.APPEND_OUTCOME_DUPLICATE]


def test_a_digest_without_a_map_is_kept_as_the_clients_group_key(client: LedgerClient) -> None:
    client.append([planned(), _started("att-1", {}, "e" * 64)])
    stored = next(e for e in client.list_events("run-1") if e.attempt_id)
    assert stored.started.fingerprint_digest == "e" * 64


def test_the_sdk_sends_the_digest_of_the_map_it_sends_even_cut_to_the_limits(
    client: LedgerClient, tmp_path: Path
) -> None:
    # A value past the ledger's 1024 characters is cut by the SDK; its digest is the cut map's.
    long = Fingerprint.from_fields({"error": "x" * 3000, "driver": "550.54"})
    client.append([planned()])
    with (
        Ledger(client.target) as ledger,
        ledger.shard("run-1", "shard-0", fingerprint=long, output_dir=tmp_path) as shard,
        shard.atomic_write(tmp_path / "out.bin", name="out") as f,
    ):
        f.write(b"done")
    started = next(e.started for e in client.list_events("run-1") if e.HasField("started"))
    assert len(started.fingerprint["error"]) == 1024
    assert started.fingerprint_digest == fingerprint_digest(dict(started.fingerprint))
