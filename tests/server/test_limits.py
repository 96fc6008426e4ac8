"""Documented limits (docs/limits.md): each at its boundary, with the code and the name it answers."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from ledger_server import codec
from ledger_server.config import MAX_MESSAGE_BYTES, ServerConfig
from ledger_server.errors import InvalidEvent
from ledger_server.events import AttemptFailed, Event
from ledger_server.server import RunningServer, create_server
from ledger_server.service import MAX_EVENTS_PER_BATCH
from ledger_server.servicer import MAX_PAGE_SIZE
from ledger_server.validation import MAX_PAYLOAD_BYTES, validate
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.api.shardledger.v1 import ledger_pb2_grpc as pb_grpc
from tests.builders import DIGEST_A, DIGEST_B, event, planned, started

UNLIMITED = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


@pytest.fixture
def stub(server: RunningServer) -> Iterator[pb_grpc.LedgerServiceStub]:
    """Returns a stub whose channel sends and receives messages of any size."""
    with grpc.insecure_channel(f"127.0.0.1:{server.port}", options=UNLIMITED) as channel:
        yield pb_grpc.LedgerServiceStub(channel)


def _refusal(call: Callable[[], object]) -> tuple[grpc.StatusCode, str, dict[str, str], str]:
    """Returns the code, ErrorInfo reason, metadata and message of a refused call."""
    with pytest.raises(grpc.RpcError) as refused:
        call()
    exc = refused.value
    status = rpc_status.from_call(exc)  # type: ignore[arg-type]
    reason, metadata = "", {}
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason, metadata = info.reason, dict(info.metadata)
    return exc.code(), reason, metadata, exc.details() or ""


def _events(db: Path) -> int:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return int(conn.execute("SELECT COUNT(*) FROM events").fetchone()[0])


def _append(stub: pb_grpc.LedgerServiceStub, *events: pb.ShardEvent) -> pb.AppendEventsResponse:
    response: pb.AppendEventsResponse = stub.AppendEvents(
        pb.AppendEventsRequest(events=list(events)), timeout=60
    )
    return response


# --- message size ---------------------------------------------------------------------


def test_message_over_the_maximum_size_is_refused_with_resource_exhausted(
    stub: pb_grpc.LedgerServiceStub, db_path: Path
) -> None:
    big = planned()
    big.planned.plan_line = "x" * MAX_MESSAGE_BYTES  # the message is a little over 16 MiB
    code, _, _, message = _refusal(lambda: _append(stub, big))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(MAX_MESSAGE_BYTES) in message
    assert _events(db_path) == 0


def test_metadata_within_8_kib_is_accepted_and_over_16_kib_is_refused_as_documented(
    stub: pb_grpc.LedgerServiceStub, db_path: Path
) -> None:
    # docs/limits.md: gRPC's own limits on request metadata, below any handler.
    small = [("x-pad", "a" * 7000)]
    assert stub.AppendEvents(pb.AppendEventsRequest(events=[planned()]), metadata=small)
    with pytest.raises(grpc.RpcError) as refused:
        stub.AppendEvents(
            pb.AppendEventsRequest(events=[planned("run-1", "shard-9", 9)]),
            metadata=[("x-pad", "a" * 17_000)],
            timeout=10,
        )
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "metadata" in (refused.value.details() or "")
    assert _events(db_path) == 1  # the refused call wrote nothing


def test_message_size_limit_follows_the_server_setting(tmp_path: Path) -> None:
    running = create_server(
        ServerConfig(
            database=str(tmp_path / "l.db"), listen="127.0.0.1:0", max_message_bytes=64 * 1024
        )
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}", options=UNLIMITED) as channel:
            stub = pb_grpc.LedgerServiceStub(channel)
            big = planned()
            big.planned.params_json = '{"x":"' + "y" * 70_000 + '"}'
            code, *_ = _refusal(lambda: _append(stub, big))
    finally:
        running.stop(0.5)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED


# --- events per batch and bytes per event ----------------------------------------------------


def _plans(count: int, run_id: str = "run-1") -> list[pb.ShardEvent]:
    return [planned(run_id, f"shard-{i}", index=i) for i in range(count)]


def test_batch_over_ten_thousand_events_is_refused_naming_the_limit(
    stub: pb_grpc.LedgerServiceStub, db_path: Path
) -> None:
    code, reason, metadata, _ = _refusal(lambda: _append(stub, *_plans(MAX_EVENTS_PER_BATCH + 1)))
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "LIMIT_EXCEEDED")
    assert metadata == {"limit": "events_per_batch", "value": "10001", "maximum": "10000"}
    assert _events(db_path) == 0


def test_batch_of_exactly_ten_thousand_events_is_stored_and_read_back_in_capped_pages(
    stub: pb_grpc.LedgerServiceStub, db_path: Path
) -> None:
    assert MAX_EVENTS_PER_BATCH == 10_000
    response = _append(stub, *_plans(MAX_EVENTS_PER_BATCH))
    assert len(response.results) == MAX_EVENTS_PER_BATCH
    assert _events(db_path) == MAX_EVENTS_PER_BATCH
    page = stub.ListEvents(pb.ListEventsRequest(run_id="run-1", page_size=2**31 - 1), timeout=60)
    assert len(page.events) == MAX_PAGE_SIZE
    assert page.next_page_token


def _event_bytes(msg: pb.ShardEvent) -> int:
    return len(validate(codec.decode_event(msg)).canonical.encode())


def _planned_of_size(size: int) -> pb.ShardEvent:
    """Returns a planned event whose canonical JSON is exactly size bytes."""
    ev = planned()
    ev.planned.params_json = '{"x":""}'
    pad = size - _event_bytes(ev)
    ev.planned.params_json = '{"x":"' + "y" * pad + '"}'  # canonical already: adds pad bytes
    return ev


def test_event_of_exactly_64_kib_is_stored(stub: pb_grpc.LedgerServiceStub) -> None:
    ev = _planned_of_size(MAX_PAYLOAD_BYTES)
    assert _event_bytes(ev) == MAX_PAYLOAD_BYTES
    response = _append(stub, ev)
    assert response.results[0].outcome == pb.APPEND_OUTCOME_APPENDED


def test_text_no_utf8_can_carry_is_refused_from_python_callers_too() -> None:
    # Protobuf strings are UTF-8 by construction; a Python caller's str may hold a lone
    # surrogate, which no stored row could encode.
    lone = Event("e-1", "default", "run-1", "s1", "a1", 0, AttemptFailed("oom", "x\ud800"))
    with pytest.raises(InvalidEvent) as refused:
        validate(lone)
    assert refused.value.field == "payload"
    assert "not UTF-8 text" in str(refused.value)


def test_event_over_64_kib_is_refused_naming_the_limit(
    stub: pb_grpc.LedgerServiceStub, db_path: Path
) -> None:
    code, reason, metadata, _ = _refusal(
        lambda: _append(stub, planned("run-1", "first"), _planned_of_size(MAX_PAYLOAD_BYTES + 1))
    )
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "LIMIT_EXCEEDED")
    assert metadata == {
        "limit": "event_bytes",
        "value": str(MAX_PAYLOAD_BYTES + 1),
        "maximum": "65536",
        "event_index": "1",
    }
    assert _events(db_path) == 0  # the valid first event of the batch was not written either


# --- field lengths ----------------------------------------------------------------------


def _attempt(run_id: str, **payload: Any) -> list[pb.ShardEvent]:
    """Returns planned + started on a fresh run, then one event of the attempt."""
    return [planned(run_id), started(run_id), event(run_id, attempt_id="att-1", **payload)]


def _with(msg: pb.ShardEvent, **fields: str) -> pb.ShardEvent:
    for name, value in fields.items():
        setattr(msg, name, value)
    return msg


# (field named in the error, maximum, build(value) -> batch whose last event carries the value)
FIELD_LIMITS: list[tuple[str, int, Callable[[str], list[pb.ShardEvent]]]] = [
    ("event_id", 128, lambda v: [_with(planned(), event_id=v)]),
    ("run_id", 128, lambda v: [planned(run_id=v)]),
    ("shard_id", 128, lambda v: [planned(shard_id=v)]),
    ("attempt_id", 128, lambda v: [planned(), started(attempt_id=v)]),
    ("planned.input_ref", 4096, lambda v: [_input_ref(v)]),
    (
        "checkpoint.path",
        4096,
        lambda v: _attempt(
            "run-1",
            checkpoint=pb.CheckpointSaved(step=1, path=v, size_bytes=1, blake3_hex=DIGEST_B),
        ),
    ),
    (
        "artifact_committed.path",
        4096,
        lambda v: _attempt(
            "run-1",
            artifact_committed=pb.ArtifactCommitted(
                name="out", path=v, size_bytes=1, blake3_hex=DIGEST_A
            ),
        ),
    ),
    (
        "artifact_committed.version_id",
        1024,
        lambda v: _attempt(
            "run-1",
            artifact_committed=pb.ArtifactCommitted(
                name="out", path="s3://b/k", size_bytes=1, blake3_hex=DIGEST_A, version_id=v
            ),
        ),
    ),
    (
        "artifact_committed.etag",
        1024,
        lambda v: _attempt(
            "run-1",
            artifact_committed=pb.ArtifactCommitted(
                name="out", path="s3://b/k", size_bytes=1, blake3_hex=DIGEST_A, etag=v
            ),
        ),
    ),
    ("planned.input_version_id", 1024, lambda v: [_with_planned(input_version_id=v)]),
    (
        "failed.message",
        8192,
        lambda v: _attempt("run-1", failed=pb.AttemptFailed(tag=pb.FAILURE_TAG_OOM, message=v)),
    ),
    (
        "started.host",
        255,
        lambda v: [
            planned(),
            event(
                attempt_id="att-1",
                started=pb.AttemptStarted(host=v, pid=1, heartbeat_timeout=Duration(seconds=60)),
            ),
        ],
    ),
]


def _with_planned(**fields: str) -> pb.ShardEvent:
    ev = planned()
    for name, value in fields.items():
        setattr(ev.planned, name, value)
    return ev


def _input_ref(value: str) -> pb.ShardEvent:
    ev = planned()
    ev.planned.input_ref = value
    return ev


def _value(field: str, length: int) -> str:
    # Paths start with "/", ids with a letter; the rest is filler of the allowed alphabet.
    return ("/" if "path" in field or "input_ref" in field else "a") + "b" * (length - 1)


@pytest.mark.parametrize(
    ("field", "maximum", "build"), FIELD_LIMITS, ids=[f for f, _, _ in FIELD_LIMITS]
)
def test_field_at_its_maximum_length_is_stored(
    stub: pb_grpc.LedgerServiceStub,
    field: str,
    maximum: int,
    build: Callable[[str], list[pb.ShardEvent]],
) -> None:
    response = _append(stub, *build(_value(field, maximum)))
    assert all(r.outcome == pb.APPEND_OUTCOME_APPENDED for r in response.results)


@pytest.mark.parametrize(
    ("field", "maximum", "build"), FIELD_LIMITS, ids=[f for f, _, _ in FIELD_LIMITS]
)
def test_field_one_over_its_maximum_is_refused_naming_field_and_limit(
    stub: pb_grpc.LedgerServiceStub,
    db_path: Path,
    field: str,
    maximum: int,
    build: Callable[[str], list[pb.ShardEvent]],
) -> None:
    batch = build(_value(field, maximum + 1))
    code, reason, metadata, message = _refusal(lambda: _append(stub, *batch))
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD")
    assert metadata["field"] == field
    assert metadata["event_index"] == str(len(batch) - 1)
    assert f"longer than {maximum} characters" in message
    assert _events(db_path) == 0


@pytest.mark.parametrize(("length", "ok"), [(63, True), (64, False)])
def test_namespace_is_at_most_63_characters(
    stub: pb_grpc.LedgerServiceStub, length: int, ok: bool
) -> None:
    ev = planned()
    ev.namespace = "n" * length
    if ok:
        assert _append(stub, ev).results[0].outcome == pb.APPEND_OUTCOME_APPENDED
        return
    code, reason, metadata, _ = _refusal(lambda: _append(stub, ev))
    assert (code, reason, metadata["field"]) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_FIELD",
        "namespace",
    )


def test_more_than_256_fingerprint_entries_are_refused(stub: pb_grpc.LedgerServiceStub) -> None:
    ev = started()
    ev.started.fingerprint.update({f"k{i}": "v" for i in range(257)})
    code, reason, metadata, _ = _refusal(lambda: _append(stub, planned(), ev))
    assert (code, reason, metadata["field"]) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_FIELD",
        "started.fingerprint",
    )


def test_negative_page_size_is_refused_naming_the_field(stub: pb_grpc.LedgerServiceStub) -> None:
    code, reason, metadata, _ = _refusal(
        lambda: stub.ListEvents(pb.ListEventsRequest(run_id="run-1", page_size=-1), timeout=10)
    )
    assert (code, reason, metadata["field"]) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_FIELD",
        "page_size",
    )


# --- concurrent RPCs --------------------------------------------------------------------


def test_rpcs_beyond_the_concurrency_limit_get_resource_exhausted(tmp_path: Path) -> None:
    running = create_server(
        ServerConfig(database=str(tmp_path / "l.db"), listen="127.0.0.1:0", max_concurrent_rpcs=2)
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{running.port}")
    stub = pb_grpc.LedgerServiceStub(channel)
    tails = []
    try:
        _append(stub, planned())
        # Two tails hold both slots: each has delivered its first event, so each is in flight.
        for _ in range(2):
            tail = stub.TailEvents(pb.TailEventsRequest(run_id="run-1"), timeout=60)
            next(tail)
            tails.append(tail)
        code, *_ = _refusal(lambda: stub.ListRuns(pb.ListRunsRequest(), timeout=10))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        code, *_ = _refusal(
            lambda: next(stub.TailEvents(pb.TailEventsRequest(run_id="run-1"), timeout=10))
        )
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        for tail in tails:
            tail.cancel()
        assert _eventually_ok(lambda: stub.ListRuns(pb.ListRunsRequest(), timeout=10))
    finally:
        for tail in tails:
            tail.cancel()
        channel.close()
        running.stop(0.5)


def _eventually_ok(call: Callable[[], object], attempts: int = 300) -> bool:
    """Returns whether the call succeeds once the server has released the cancelled calls."""
    # A cancelled tail frees its slot when its handler returns (it polls once a second).
    done = threading.Event()
    for _ in range(attempts):
        try:
            call()
            return True
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
        done.wait(0.1)
    return False
