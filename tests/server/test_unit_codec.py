"""The protobuf codec round-trips every event kind, and the chain rows parse back, without a server."""

from __future__ import annotations

import dataclasses

import pytest

from ledger_server import codec
from ledger_server.chain import GENESIS_HASH, ChainWalker, chain_hash, event_from_row, row_bytes
from ledger_server.events import (
    PAYLOAD_TYPES,
    ArtifactCommitted,
    ArtifactVerified,
    AttemptFailed,
    AttemptStarted,
    CheckpointSaved,
    Event,
    Heartbeat,
    Payload,
    RecordedEvent,
    RunReopened,
    ShardPlanned,
    SubmissionClosed,
)
from ledger_server.validation import validate
from shard_client.canonical import fingerprint_digest
from shard_client.vocabulary import FailureTag

DIGEST = "ab" * 32
PAYLOADS: dict[str, Payload] = {
    "planned": ShardPlanned(
        input_ref="s3://bucket/shard-0",
        input_bytes=1024,
        input_blake3=DIGEST,
        params_json='{"lr":0.1}',
        expected_outputs=("model", "metrics"),
        plan_line="",
        plan_index=3,
    ),
    "started": AttemptStarted(
        host="gpu-7",
        pid=4242,
        heartbeat_timeout_us=30_000_000,
        fingerprint={"cuda": "12.4", "torch": "2.13.0"},
        fingerprint_digest=fingerprint_digest({"cuda": "12.4", "torch": "2.13.0"}),
    ),
    "heartbeat": Heartbeat(step=17, progress=0.25, metrics={"loss": 1.5}),
    "checkpoint": CheckpointSaved(step=17, path="/ckpt/17.pt", size_bytes=99, blake3_hex=DIGEST),
    "artifact_committed": ArtifactCommitted(
        name="model", path="/out/model.bin", size_bytes=7, blake3_hex=DIGEST, media_type="x/y"
    ),
    "verified": ArtifactVerified(
        name="model",
        path="/out/model.bin",
        blake3_hex=DIGEST,
        result="failed",
        reason="digest_mismatch",
        detail="re-read gave other bytes",
    ),
    "failed": AttemptFailed(tag=FailureTag.NCCL.value, message="ring broke"),
    "submission_closed": SubmissionClosed(reason="last wave planned", expected_shards=12),
    "run_reopened": RunReopened(reason="a late wave"),
}
RUN_LEVEL = ("submission_closed", "run_reopened")


def _event(kind: str) -> Event:
    payload = PAYLOADS[kind]
    return Event(
        event_id=f"ev-{kind}",
        namespace="team-a",
        run_id="run-1",
        shard_id="" if kind in RUN_LEVEL else "shard-0",
        attempt_id="" if kind in ("planned", "verified", *RUN_LEVEL) else "a1",
        client_time_us=1_700_000_000_123_456,
        payload=payload,
    )


def test_the_table_covers_every_event_kind() -> None:
    assert set(PAYLOADS) == set(PAYLOAD_TYPES)


@pytest.mark.parametrize("kind", sorted(PAYLOAD_TYPES))
def test_every_kind_round_trips_through_protobuf(kind: str) -> None:
    event = _event(kind)
    message = codec.encode_event(event)
    assert message.WhichOneof("payload") == kind
    decoded = codec.decode_event(type(message).FromString(message.SerializeToString()))
    assert decoded == event
    assert decoded.content_json() == event.content_json()


@pytest.mark.parametrize("kind", sorted(PAYLOAD_TYPES))
def test_every_kind_round_trips_through_its_stored_row(kind: str) -> None:
    valid = validate(_event(kind))
    assert valid.canonical == valid.event.content_json()
    row = row_bytes(valid.event, run_sequence=5, receive_time_us=1_700_000_000_200_000)
    assert event_from_row(row) == (valid.event, 5, 1_700_000_000_200_000)


def test_a_recorded_event_carries_its_server_fields_on_the_wire() -> None:
    rec = RecordedEvent(_event("heartbeat"), 41, 7, 1_700_000_000_999_999, b"\x01" * 32)
    message = codec.encode_recorded(rec)
    assert (message.sequence, message.run_sequence) == (41, 7)
    assert codec.timestamp_us(message.receive_time) == 1_700_000_000_999_999


def test_the_failure_tag_decodes_as_its_plain_string() -> None:
    decoded = codec.decode_event(codec.encode_event(_event("failed")))
    assert isinstance(decoded.payload, AttemptFailed)
    assert type(decoded.payload.tag) is str
    assert decoded.payload.tag == "nccl"


def test_the_chain_walker_accepts_a_chain_and_names_its_break() -> None:
    rows = [b'{"a":1}', b'{"a":2}']
    hashes = [chain_hash(GENESIS_HASH, rows[0])]
    hashes.append(chain_hash(hashes[0], rows[1]))
    walker = ChainWalker()
    for sequence, (row, row_hash) in enumerate(zip(rows, hashes, strict=True), 1):
        assert walker.in_order(sequence)
        assert walker.links(row, row_hash)
        walker.advance(row_hash)
    assert (walker.count, walker.head, walker.expected) == (2, hashes[1], 3)
    assert not walker.in_order(2)
    assert not walker.links(b'{"a":3}', hashes[1])


def test_a_coalesced_heartbeat_round_trips_through_protobuf_and_its_row() -> None:
    beat = Heartbeat(
        step=40,
        progress=0.5,
        metrics={"loss": 0.25},
        nonfinite_metrics=("grad_norm",),
        first_step=0,
        metrics_min={"loss": 0.25},
        metrics_max={"loss": 2.0},
        progress_calls=41,
    )
    event = dataclasses.replace(_event("heartbeat"), payload=beat)
    message = codec.encode_event(event)
    assert (message.heartbeat.progress_calls, message.heartbeat.metrics_max["loss"]) == (41, 2.0)
    assert codec.decode_event(type(message).FromString(message.SerializeToString())) == event
    valid = validate(event)
    row = row_bytes(valid.event, run_sequence=2, receive_time_us=1_700_000_000_200_000)
    assert event_from_row(row)[0] == event


@pytest.mark.parametrize(("reason", "payload"), [("", "{}"), ("late", '{"reason":"late"}')])
def test_a_reopen_without_reason_has_an_empty_payload_like_a_close(
    reason: str, payload: str
) -> None:
    event = dataclasses.replace(_event("run_reopened"), payload=RunReopened(reason=reason))
    assert f'"kind":"run_reopened","namespace":"team-a","payload":{payload},' in (
        event.content_json()
    )
