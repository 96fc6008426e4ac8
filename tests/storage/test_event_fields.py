"""The object-storage fields of the events: validated, and absent from canonical JSON when unset."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ledger_server.codec import decode_event
from ledger_server.errors import InvalidEvent
from ledger_server.validation import validate
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from tests.builders import DIGEST_A, event


def commit(**fields: Any) -> pb.ShardEvent:
    """Returns an artifact_committed event with the given extra fields."""
    return event(
        attempt_id="att-1",
        artifact_committed=pb.ArtifactCommitted(
            name="out", path="s3://b/k", size_bytes=3, blake3_hex=DIGEST_A, **fields
        ),
    )


def test_a_local_commit_encodes_exactly_as_before_the_storage_fields_existed() -> None:
    content = json.loads(validate(decode_event(commit())).canonical)
    assert sorted(content["payload"]) == ["blake3_hex", "media_type", "name", "path", "size_bytes"]


def test_an_object_commit_carries_its_version_etag_and_read_back() -> None:
    content = json.loads(
        validate(decode_event(commit(version_id="v1", etag="e1", read_back="digest"))).canonical
    )
    assert (content["payload"]["version_id"], content["payload"]["read_back"]) == ("v1", "digest")


def test_an_unknown_read_back_is_refused_naming_the_field() -> None:
    with pytest.raises(InvalidEvent) as refused:
        validate(decode_event(commit(read_back="eyeballed")))
    assert refused.value.field == "artifact_committed.read_back"
