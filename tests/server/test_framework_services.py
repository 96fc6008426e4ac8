"""Health and reflection (v1 and v1alpha) refuse undecodable bytes as the ledger does.

An independent campaign got INTERNAL "Exception deserializing request!" without
details from every framework method for two garbage bytes; each now answers
INVALID_ARGUMENT with ErrorInfo MALFORMED_REQUEST, and still serves valid requests.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import grpc
import pytest
from google.protobuf import descriptor_pb2
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from grpc_status import rpc_status

from ledger_server.config import ENGINES, ServerConfig
from ledger_server.framework import V1_FILE, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME
from ledger_server.rpc_status import ERROR_DOMAIN
from ledger_server.server import RunningServer, create_server

GARBAGE: Final = b"\xff\x0f"
NOT_A_MESSAGE: Final = b"\x0a\xff\xff\xff\xff\x0f"  # field 1's length runs past the end
REFLECTION: Final = {"v1": V1_SERVICE_NAME, "v1alpha": V1ALPHA_SERVICE_NAME}
# (path, kind): kind is how the method streams.
FRAMEWORK_METHODS: Final = {
    "health Check": ("/grpc.health.v1.Health/Check", "unary"),
    "health List": ("/grpc.health.v1.Health/List", "unary"),
    "health Watch": ("/grpc.health.v1.Health/Watch", "server_stream"),
    **{
        f"reflection {version}": (f"/{name}/ServerReflectionInfo", "bidi")
        for version, name in REFLECTION.items()
    },
}
RAW: Final[dict[str, Any]] = {"request_serializer": None, "response_deserializer": None}


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    """Each test here runs on every engine: health and reflection are served by each."""
    return str(request.param)


@pytest.fixture
def server(db_path: Path, engine: str) -> Iterator[RunningServer]:
    """Starts a real server of the engine on 127.0.0.1 with an ephemeral port."""
    running = create_server(
        ServerConfig(database=str(db_path), listen="127.0.0.1:0", engine=engine)
    )
    yield running
    running.stop(0.5)


@pytest.fixture
def channel(server: RunningServer) -> Iterator[grpc.Channel]:
    """Returns a plain channel to the fixture server."""
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch


def call_raw(channel: grpc.Channel, path: str, kind: str, payload: bytes) -> list[bytes]:
    """Sends payload as the request bytes of path and returns the raw responses."""
    if kind == "bidi":
        return list(channel.stream_stream(path, **RAW)(iter([payload]), timeout=10))
    if kind == "server_stream":
        return list(channel.unary_stream(path, **RAW)(payload, timeout=10))
    return [channel.unary_unary(path, **RAW)(payload, timeout=10)]


def reflect(
    channel: grpc.Channel, version: str, request: reflection_pb2.ServerReflectionRequest
) -> reflection_pb2.ServerReflectionResponse:
    """Sends one reflection request over the given version's service and returns its answer."""
    # v1's messages are v1alpha's field for field: the same classes encode both.
    info = channel.stream_stream(
        f"/{REFLECTION[version]}/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    (answer,) = list(info(iter([request]), timeout=10))
    return answer


@pytest.mark.parametrize("payload", [GARBAGE, NOT_A_MESSAGE], ids=["two-bytes", "overrun"])
@pytest.mark.parametrize("method", sorted(FRAMEWORK_METHODS))
def test_undecodable_bytes_get_invalid_argument_malformed_request(
    channel: grpc.Channel, method: str, payload: bytes
) -> None:
    path, kind = FRAMEWORK_METHODS[method]
    with pytest.raises(grpc.RpcError) as refused:
        call_raw(channel, path, kind, payload)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(refused.value)  # type: ignore[arg-type]
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert (info.reason, info.domain, dict(info.metadata)) == (
        "MALFORMED_REQUEST",
        ERROR_DOMAIN,
        {"field": "request"},
    )


def test_reflection_refuses_a_malformed_message_after_a_valid_one(channel: grpc.Channel) -> None:
    valid = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
    info = channel.stream_stream(f"/{V1_SERVICE_NAME}/ServerReflectionInfo", **RAW)
    answers = iter(info(iter([valid, GARBAGE]), timeout=10))
    first = reflection_pb2.ServerReflectionResponse.FromString(next(answers))
    with pytest.raises(grpc.RpcError) as refused:
        next(answers)
    assert first.HasField("list_services_response")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("service", ["", "shardledger.v1.LedgerService"])
def test_health_check_still_answers_serving(channel: grpc.Channel, service: str) -> None:
    reply = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=10
    )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_health_watch_still_streams_serving(channel: grpc.Channel) -> None:
    watch = health_pb2_grpc.HealthStub(channel).Watch(
        health_pb2.HealthCheckRequest(service="shardledger.v1.LedgerService"), timeout=10
    )
    first = next(watch)
    watch.cancel()
    assert first.status == health_pb2.HealthCheckResponse.SERVING


def test_open_health_watches_hold_no_handler_thread(tmp_path: Path, engine: str) -> None:
    # Watch answers through a callback; a wrapper that lost that would park a worker
    # per watcher, and a few load balancers would starve the ledger of threads.
    config = ServerConfig(
        database=str(tmp_path / "ledger.db"), listen="127.0.0.1:0", max_workers=2, engine=engine
    )
    running = create_server(config)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            watches = [stub.Watch(health_pb2.HealthCheckRequest(), timeout=10) for _ in range(4)]
            firsts = [next(w).status for w in watches]
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            for watch in watches:
                watch.cancel()
    finally:
        running.stop(0.5)
    assert firsts == [health_pb2.HealthCheckResponse.SERVING] * 4
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _stop_in_thread(running: RunningServer) -> threading.Thread:
    stopper = threading.Thread(target=running.stop, args=(0.5,), daemon=True)
    stopper.start()
    return stopper


def _cancel_all(watches: list[Any]) -> None:
    for watch in watches:
        watch.cancel()


def test_a_stop_while_watchers_cancel_ends(tmp_path: Path, engine: str) -> None:
    # grpcio's servicer sent NOT_SERVING while holding its lock; a cancelled watch's
    # close callback, run on grpcio's server thread, waited for that lock while the send
    # waited for the server thread, and a CI stop hung for good. Many rounds, because
    # the two must meet.
    for round_ in range(12):
        running = create_server(
            ServerConfig(
                database=str(tmp_path / f"ledger-{round_}.db"), listen="127.0.0.1:0", engine=engine
            )
        )
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            watches = [stub.Watch(health_pb2.HealthCheckRequest(), timeout=30) for _ in range(16)]
            for watch in watches:
                next(watch)
            cancel = threading.Thread(target=_cancel_all, args=(watches,), daemon=True)
            cancel.start()
            stopper = _stop_in_thread(running)
            stopper.join(60)
            cancel.join(10)
        assert not stopper.is_alive(), f"stop hung in round {round_}"


def test_watchers_hear_not_serving_then_their_stream_ends_on_stop(
    tmp_path: Path, engine: str
) -> None:
    running = create_server(
        ServerConfig(database=str(tmp_path / "ledger.db"), listen="127.0.0.1:0", engine=engine)
    )
    with grpc.insecure_channel(f"127.0.0.1:{running.port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        service = health_pb2.HealthCheckRequest(service="shardledger.v1.LedgerService")
        watches = [stub.Watch(service, timeout=30) for _ in range(3)]
        firsts = [next(w).status for w in watches]
        stopper = _stop_in_thread(running)
        # Each stream ends with status OK after NOT_SERVING, so a balancer moves on
        # instead of waiting out the drain.
        rests = [[reply.status for reply in watch] for watch in watches]
        stopper.join(30)
    assert firsts == [health_pb2.HealthCheckResponse.SERVING] * 3
    assert rests == [[health_pb2.HealthCheckResponse.NOT_SERVING]] * 3
    assert not stopper.is_alive()


def test_a_watch_of_an_unknown_service_hears_service_unknown(channel: grpc.Channel) -> None:
    watch = health_pb2_grpc.HealthStub(channel).Watch(
        health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10
    )
    first = next(watch)
    watch.cancel()
    assert first.status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


def test_health_check_of_an_unknown_service_is_not_found(channel: grpc.Channel) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10
        )
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_health_list_still_lists_the_ledger_serving(channel: grpc.Channel) -> None:
    reply = health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=10)
    assert reply.statuses["shardledger.v1.LedgerService"].status == (
        health_pb2.HealthCheckResponse.SERVING
    )


@pytest.mark.parametrize("version", sorted(REFLECTION))
def test_reflection_lists_the_ledger_and_both_reflection_versions(
    channel: grpc.Channel, version: str
) -> None:
    answer = reflect(channel, version, reflection_pb2.ServerReflectionRequest(list_services=""))
    names = {s.name for s in answer.list_services_response.service}
    assert {"shardledger.v1.LedgerService", V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME} <= names


@pytest.mark.parametrize("version", sorted(REFLECTION))
def test_reflection_describes_the_ledger_service(channel: grpc.Channel, version: str) -> None:
    request = reflection_pb2.ServerReflectionRequest(
        file_containing_symbol="shardledger.v1.LedgerService"
    )
    answer = reflect(channel, version, request)
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for raw in answer.file_descriptor_response.file_descriptor_proto
    ]
    services = {f"{f.package}.{s.name}" for f in files for s in f.service}
    assert "shardledger.v1.LedgerService" in services


def test_reflection_v1_describes_itself_in_the_v1_package(channel: grpc.Channel) -> None:
    request = reflection_pb2.ServerReflectionRequest(file_containing_symbol=V1_SERVICE_NAME)
    answer = reflect(channel, "v1", request)
    (raw,) = answer.file_descriptor_response.file_descriptor_proto
    described = descriptor_pb2.FileDescriptorProto.FromString(raw)
    method = described.service[0].method[0]
    assert (described.name, described.package, method.input_type) == (
        V1_FILE,
        "grpc.reflection.v1",
        ".grpc.reflection.v1.ServerReflectionRequest",
    )
