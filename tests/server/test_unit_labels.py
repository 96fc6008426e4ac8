"""Labels (plan and attempt) and the checkpoint write time: on the wire, in stored rows, refused when bad."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ledger_server import codec
from ledger_server.chain import event_from_row, row_bytes
from ledger_server.errors import InvalidEvent
from ledger_server.events import Event, Payload
from ledger_server.validation import validate
from shard_client.labels import labels_from_env, merged_labels, parse_label
from tests.server.test_unit_codec import PAYLOADS

LABELS = {"image": "trainer@sha256:ab12", "pool": "spot", "provider": "D", "region": "us-2"}


def _event(kind: str, payload: Payload) -> Event:
    return Event(
        "ev-1", "team-a", "run-1", "shard-0", "" if kind == "planned" else "a1", 0, payload
    )


@pytest.mark.parametrize(
    ("kind", "changes"),
    [
        ("planned", {"labels": LABELS}),
        ("started", {"labels": LABELS}),
        ("checkpoint", {"write_us": 12_345_678}),
    ],
)
def test_the_new_fields_round_trip_through_protobuf_and_the_stored_row(
    kind: str, changes: dict[str, object]
) -> None:
    event = _event(kind, dataclasses.replace(PAYLOADS[kind], **changes))  # type: ignore[arg-type]

    decoded = codec.decode_event(codec.encode_event(event))
    row = row_bytes(validate(decoded).event, run_sequence=1, receive_time_us=5)

    assert decoded == event
    assert event_from_row(row)[0] == event
    payload = json.loads(row)["event"]["payload"]
    assert {k: payload[k] for k in changes} == changes


@pytest.mark.parametrize("kind", ["planned", "started", "checkpoint"])
def test_unset_new_fields_leave_the_canonical_bytes_as_they_were(kind: str) -> None:
    payload = json.loads(_event(kind, PAYLOADS[kind]).content_json())["payload"]

    assert "labels" not in payload and "write_us" not in payload


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        ({"Provider": "A"}, "must match"),
        ({"provider": "x" * 257}, "longer than 256"),
        ({f"k{i}": "v" for i in range(33)}, "more than 32 labels"),
        ({"pool": "spot\n"}, "control character"),
    ],
)
def test_bad_labels_are_refused_naming_the_field(labels: dict[str, str], message: str) -> None:
    event = _event("started", dataclasses.replace(PAYLOADS["started"], labels=labels))  # type: ignore[arg-type]

    with pytest.raises(InvalidEvent, match=message) as caught:
        validate(event)
    assert "started.labels" in str(caught.value)


def test_env_flags_and_sdk_layers_merge_later_over_earlier() -> None:
    env = labels_from_env(
        {"SHARDLEDGER_LABEL_POOL": "spot", "SHARDLEDGER_LABEL_REGION": "eu", "HOME": "/"}
    )

    assert env == {"pool": "spot", "region": "eu"}
    assert merged_labels(env, {"pool": "on-demand"}, None) == {"pool": "on-demand", "region": "eu"}
    assert parse_label("image=a=b") == ("image", "a=b")
    with pytest.raises(ValueError, match="not key=value"):
        parse_label("provider")
    with pytest.raises(ValueError, match=r"\$SHARDLEDGER_LABEL_\*"):
        labels_from_env({"SHARDLEDGER_LABEL_BAD KEY": "x"})
