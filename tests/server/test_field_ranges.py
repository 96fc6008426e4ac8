"""Every numeric field of every event and request fits every place the server copies it to.

Generated from the proto descriptors: each numeric field of each event payload (and of
the ShardEvent itself, Timestamps and Durations included) and of each read request is
sent at the edges of its own type and just past the narrower ones (int32, the 2**53 a
JSON double holds exactly). Each value is either refused at the door, INVALID_ARGUMENT
naming the field, or taken; a taken one must come back unchanged from ListEvents, and
every read that copies it somewhere (the shard views, the summary, the report, the
resume list, the comparison) must still answer. A field whose range is wider than a
field, view or column it is copied to fails here: the read that cannot be built says so.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import Message
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from structlog.testing import capture_logs

from ledger_server import codec
from ledger_server.config import ServerConfig
from ledger_server.server import RunningServer, create_server
from ledger_server.servicer import built
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.api.shardledger.v1 import ledger_pb2_grpc as pb_grpc
from tests.builders import DIGEST_A, committed, event, planned, started

F = FieldDescriptor
_INT64_EDGES = [2**31, 2**53 + 1, 2**63 - 1, -(2**31) - 1, -(2**63)]
# The values a field of each type is sent with: its own edges and just past the narrower types.
EDGES: dict[int, list[Any]] = {
    F.TYPE_INT32: [2**31 - 1, -(2**31)],
    F.TYPE_SINT32: [2**31 - 1, -(2**31)],
    F.TYPE_SFIXED32: [2**31 - 1, -(2**31)],
    F.TYPE_UINT32: [2**31, 2**32 - 1],
    F.TYPE_FIXED32: [2**31, 2**32 - 1],
    F.TYPE_INT64: _INT64_EDGES,
    F.TYPE_SINT64: _INT64_EDGES,
    F.TYPE_SFIXED64: _INT64_EDGES,
    F.TYPE_UINT64: [2**53 + 1, 2**63, 2**64 - 1],
    F.TYPE_FIXED64: [2**53 + 1, 2**63, 2**64 - 1],
    F.TYPE_DOUBLE: [1e308, -1e308],
    F.TYPE_FLOAT: [3e38, -3e38],
}
WELL_KNOWN = {"google.protobuf.Timestamp", "google.protobuf.Duration"}
Path_ = tuple[str, ...]


# Descriptors typed Any: upb's and the pure-Python ones are different classes to mypy.
def numeric_paths(descriptor: Any, prefix: Path_ = ()) -> Iterator[tuple[Path_, int]]:
    """Yields the path and type of every singular numeric field, nested messages included."""
    for field in descriptor.fields:
        path = (*prefix, field.name)
        if field.is_repeated:
            continue  # maps and lists of numbers: none in requests or events carries a count
        if field.type == F.TYPE_MESSAGE:
            yield from numeric_paths(field.message_type, path)
        elif field.type in EDGES:
            yield path, field.type


def _field_at(message: Message, path: Path_) -> tuple[Message, str]:
    for name in path[:-1]:
        message = getattr(message, name)
    return message, path[-1]


def _set(message: Message, path: Path_, value: Any) -> None:
    holder, name = _field_at(message, path)
    setattr(holder, name, value)


def _get(message: Message, path: Path_) -> Any:
    holder, name = _field_at(message, path)
    return getattr(holder, name)


# The events an event of each kind needs before it, and the event itself, for one run.
def _planned(run: str) -> pb.ShardEvent:
    plan = planned(run)
    plan.planned.labels["team"] = "a"  # CompareRuns groups by it
    return plan


def _heartbeat(run: str) -> pb.ShardEvent:
    # A coalesced one (progress_calls set), so that first_step may be set too.
    beat = pb.Heartbeat(step=1, progress=0.5, progress_calls=1)
    return event(run, "shard-0", "att-1", heartbeat=beat)


def _checkpoint(run: str) -> pb.ShardEvent:
    saved = pb.CheckpointSaved(
        step=1, path="/ck/1", size_bytes=5, blake3_hex=DIGEST_A, write_duration=Duration(seconds=1)
    )
    return event(run, "shard-0", "att-1", checkpoint=saved)


def _failed(run: str) -> pb.ShardEvent:
    failed = pb.AttemptFailed(tag=pb.FAILURE_TAG_KILLED, message="killed")
    return event(run, "shard-0", "att-1", failed=failed)


def _closed(run: str) -> pb.ShardEvent:
    return event(run, "", "", submission_closed=pb.RunSubmissionClosed(expected_shards=1))


def _started(run: str) -> pb.ShardEvent:
    start = started(run)
    start.started.input.input_ref = "/data/shard-0.bin"  # what the plan names: InputSeen is kept
    start.started.input.size_bytes = 10
    return start


def _later_checkpoint(run: str) -> pb.ShardEvent:
    later = _checkpoint(run)
    later.checkpoint.step, later.checkpoint.path = 2, "/ck/2"
    return later


def _verified(run: str) -> pb.ShardEvent:
    verdict = pb.ArtifactVerified(
        name="out", path="/out/x", blake3_hex=DIGEST_A, result=pb.VERIFICATION_RESULT_PASSED
    )
    return event(run, "shard-0", "", verified=verdict)


def _reclaimed(run: str) -> list[pb.ShardEvent]:
    """Returns another shard's attempt, preempted: the run's reclaim probability is then > 0."""
    failed = pb.AttemptFailed(tag=pb.FAILURE_TAG_PREEMPTED, message="preempted")
    return [
        planned(run, "shard-9", index=9),
        started(run, "shard-9", "att-9"),
        event(run, "shard-9", "att-9", failed=failed),
    ]


def _second(make: Callable[..., pb.ShardEvent]) -> Build:
    return lambda run: make(run, attempt_id="att-2")


Build = Callable[[str], pb.ShardEvent]
# Per kind: the events before it, the event itself, and the events after it that carry
# the shard to its end, so the views that fold its values (costs, checkpoint advice, first
# pass, the lifecycle) are built from it too. A later event the value makes illegal is
# refused, and the reads go on with what was taken.
SCENES: dict[str, tuple[list[Build], Build, list[Build]]] = {
    "planned": ([], _planned, [started, _heartbeat, _checkpoint, committed, _verified]),
    "started": ([_planned], _started, [_heartbeat, _checkpoint, _later_checkpoint, committed]),
    # Steps, write times and a reclaim: the checkpoint advice (interval_steps) is computed.
    "heartbeat": ([_planned, started, _checkpoint], _heartbeat, [committed, _verified]),
    "checkpoint": ([_planned, started, _heartbeat], _checkpoint, [_later_checkpoint, committed]),
    "artifact_committed": ([_planned, started], committed, [_verified]),
    "failed": ([_planned, started], _failed, [_second(started), _second(committed), _verified]),
    "submission_closed": ([_planned], _closed, [started, committed, _verified]),
}
_PAYLOADS = {f.name for f in pb.ShardEvent.DESCRIPTOR.oneofs_by_name["payload"].fields}


# Steps are int64 on the wire and where they are copied (ShardDetails.last_step,
# RankView.last_step); the checkpoint advice's interval_steps (int32) saturates at
# 2**31 - 1 (shard_client/advice.py). No field is known to disagree.
KNOWN: dict[Path_, str] = {}


def _event_cases() -> Iterator[Any]:
    for path, kind in numeric_paths(pb.ShardEvent.DESCRIPTOR):
        scene = path[0] if path[0] in _PAYLOADS else "heartbeat"
        if scene not in SCENES:
            raise AssertionError(f"no scene for the numeric field {'.'.join(path)}: add one")
        for value in EDGES[kind]:
            known = KNOWN.get(path) if value > 2**31 - 1 else None
            marks = [pytest.mark.xfail(reason=known, strict=False)] if known else []
            yield pytest.param(scene, path, value, id=f"{'.'.join(path)}={value:g}", marks=marks)


def test_every_payload_with_a_numeric_field_has_a_scene() -> None:
    with_numbers = {p[0] for p, _ in numeric_paths(pb.ShardEvent.DESCRIPTOR) if p[0] in _PAYLOADS}
    assert with_numbers <= set(SCENES)
    assert with_numbers  # the walk sees the payloads at all


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[pb_grpc.LedgerServiceStub]:
    db = Path(tmp_path_factory.mktemp("ranges")) / "ledger.db"
    running: RunningServer = create_server(ServerConfig(database=str(db), listen="127.0.0.1:0"))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            yield pb_grpc.LedgerServiceStub(channel)
    finally:
        running.stop(0.5)


def _named_field(exc: grpc.RpcError) -> str:
    """Returns the field an error names (its ErrorInfo's field metadata), or ''."""
    status = rpc_status.from_call(exc)  # type: ignore[arg-type]
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return str(info.metadata.get("field", ""))
    return ""


def _names(reported: str, path: Path_, message: Any) -> bool:
    """Returns whether the reported field is the path's field (a Timestamp's: the Timestamp)."""
    last = reported.rsplit(".", 1)[-1]
    holder = message
    for name in path[:-1]:
        holder = holder.fields_by_name[name].message_type
    wanted = {path[-1]}
    if holder.full_name in WELL_KNOWN and len(path) > 1:
        wanted = {path[-2]}
    return last in wanted


def _reads(stub: pb_grpc.LedgerServiceStub, run: str) -> dict[str, Callable[[], Any]]:
    return {
        "ListEvents": lambda: stub.ListEvents(pb.ListEventsRequest(run_id=run), timeout=30),
        "ListShards": lambda: stub.ListShards(pb.ListShardsRequest(run_id=run), timeout=30),
        "GetRunSummary": lambda: stub.GetRunSummary(
            pb.GetRunSummaryRequest(run_id=run), timeout=30
        ),
        "GetRunReport": lambda: stub.GetRunReport(pb.GetRunReportRequest(run_id=run), timeout=30),
        "CompareRuns": lambda: stub.CompareRuns(
            pb.CompareRunsRequest(run_ids=[run], label="team"), timeout=30
        ),
        "StreamResumeList": lambda: list(
            stub.StreamResumeList(pb.StreamResumeListRequest(run_id=run), timeout=30)
        ),
        "ListRuns": lambda: stub.ListRuns(pb.ListRunsRequest(), timeout=30),
    }


@pytest.mark.parametrize(("scene", "path", "value"), list(_event_cases()))
def test_a_numeric_event_field_is_refused_at_the_door_or_fits_every_read(
    stub: pb_grpc.LedgerServiceStub, scene: str, path: Path_, value: Any
) -> None:
    run = f"ranges-{uuid.uuid4().hex[:12]}"
    before, build, after = SCENES[scene]
    history = [*_reclaimed(run), *(make(run) for make in before)]
    if history:
        stub.AppendEvents(pb.AppendEventsRequest(events=history), timeout=30)
    sent = build(run)
    _set(sent, path, value)
    field = ".".join(path)
    try:
        stub.AppendEvents(pb.AppendEventsRequest(events=[sent]), timeout=30)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, exc.code(), exc.details())
        reported = _named_field(exc)
        assert _names(reported, path, pb.ShardEvent.DESCRIPTOR), (field, reported, exc.details())
        return
    for make in after:
        with contextlib.suppress(grpc.RpcError):
            stub.AppendEvents(pb.AppendEventsRequest(events=[make(run)]), timeout=30)
    failures = {}
    answers = {}
    for name, read in _reads(stub, run).items():
        try:
            answers[name] = read()
        except grpc.RpcError as exc:
            failures[name] = (exc.code(), exc.details())
    assert not failures, f"{field}={value} was taken, but reads fail: {failures}"
    if path[0] in ("sequence", "run_sequence", "receive_time", "row_format"):
        return  # the server's own fields: what a client sends there is not kept
    (back,) = [e for e in answers["ListEvents"].events if e.event_id == sent.event_id]
    assert _get(back, path) == value, f"{field} was taken as {value} but reads back otherwise"


def _request_cases() -> Iterator[Any]:
    service = pb.DESCRIPTOR.services_by_name["LedgerService"]
    for method in service.methods:
        if method.client_streaming or method.input_type.name == "AppendEventsRequest":
            continue
        for path, kind in numeric_paths(method.input_type):
            for value in EDGES[kind]:
                yield pytest.param(
                    method.name, path, value, id=f"{method.name}.{'.'.join(path)}={value:g}"
                )


# A read may refuse a value or find nothing there; it may never fail to say which.
ANSWERS = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
}


@pytest.mark.parametrize(("method", "path", "value"), list(_request_cases()))
def test_a_numeric_request_field_is_refused_by_name_or_answered(
    stub: pb_grpc.LedgerServiceStub, method: str, path: Path_, value: Any
) -> None:
    run = f"ranges-{uuid.uuid4().hex[:12]}"
    stub.AppendEvents(pb.AppendEventsRequest(events=[_planned(run)]), timeout=30)
    descriptor = pb.DESCRIPTOR.services_by_name["LedgerService"].methods_by_name[method]
    request_class = getattr(pb, descriptor.input_type.name)
    request = request_class()
    for name in ("run_id",):
        if name in descriptor.input_type.fields_by_name:
            setattr(request, name, run)
    if "run_ids" in descriptor.input_type.fields_by_name:
        request.run_ids.append(run)
        request.label = "team"
    _set(request, path, value)
    call = getattr(stub, method)
    code = grpc.StatusCode.OK
    try:
        if descriptor.server_streaming:
            # A tail waits for events that never come: its first answer, or its deadline, is enough.
            stream = call(request, timeout=2 if method == "TailEvents" else 30)
            for _ in stream:
                if method == "TailEvents":
                    break
        else:
            call(request, timeout=30)
    except grpc.RpcError as exc:
        code = exc.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and method == "TailEvents":
            return
        assert code in ANSWERS, (method, path, value, code, exc.details())
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            reported = _named_field(exc)
            assert reported, (method, path, exc.details())
    assert code in ANSWERS


class _Context:
    """Stands in for a ServicerContext: keeps the status the call was ended with."""

    status: grpc.Status | None = None

    def abort_with_status(self, status: grpc.Status) -> None:
        self.status = status
        raise RuntimeError("aborted")


def test_a_response_that_cannot_be_built_ends_internal_naming_the_field_and_is_logged() -> None:
    context = _Context()
    summary = {"submitted": 1, "lifecycle": {"expected_shards": 3_000_000_000}}
    with capture_logs() as logs, pytest.raises(RuntimeError, match="aborted"):
        built(context, "RunSummary", codec.run_summary_pb, summary)  # type: ignore[arg-type]
    assert context.status is not None
    assert context.status.code == grpc.StatusCode.INTERNAL
    assert context.status.details.startswith("RunSummary.lifecycle.expected_shards: ")
    (line,) = [entry for entry in logs if entry["event"] == "response_field_out_of_range"]
    assert line["field"] == "RunSummary.lifecycle.expected_shards"
