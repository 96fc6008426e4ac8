"""The SDK's appends on one StreamAppendEvents stream: answers per batch, fallback, endings.

Real servers on loopback ports: the ledger (both engines), and an older ledger's
shape — a gRPC server that serves AppendEvents alone over the same servicer and
store — for the fallback to unary.
"""

from __future__ import annotations

import os
import sys
import threading
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from structlog.testing import capture_logs

from ledger_server.config import ServerConfig
from ledger_server.server import RunningServer, create_server
from ledger_server.servicer import LedgerServicer
from shard_client import LedgerClient
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.api.shardledger.v1 import ledger_pb2_grpc as pb_grpc
from shard_client.errors import InvalidArgument, LedgerUnavailable
from tests.builders import event, planned, started

RUN = "run-stream"
STREAM = "/shardledger.v1.LedgerService/StreamAppendEvents"
UNARY = "/shardledger.v1.LedgerService/AppendEvents"


@pytest.fixture(params=["aio", "threads"])
def ledger_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RunningServer]:
    config = ServerConfig(
        database=str(tmp_path / "ledger.db"), listen="127.0.0.1:0", engine=request.param
    )
    running = create_server(config)
    yield running
    running.stop(0.5)


def _methods(logs: list[Any]) -> list[object]:
    return [line["method"] for line in logs if line.get("event") == "request_handled"]


def test_appends_go_on_one_stream_each_batch_answered_and_a_refusal_keeps_it_open(
    ledger_server: RunningServer,
) -> None:
    client = LedgerClient(f"127.0.0.1:{ledger_server.port}")
    with capture_logs() as logs:
        plans = [planned(RUN, f"s{i}", i) for i in range(3)]
        first = client.append(plans)
        stream = client._append_stream()
        again = client.append(plans[:1])  # the same event: acknowledged, stored once
        with pytest.raises(InvalidArgument) as refused:
            client.append([plans[1], event(RUN, "s1")])  # the second has no payload
        after = client.append([started(RUN, "s0")])
        same_stream = client._append_stream() is stream
    client.close()

    assert [r.outcome for r in first] == [pb.APPEND_OUTCOME_APPENDED] * 3
    assert [r.sequence for r in first] == [1, 2, 3]
    assert again[0].outcome == pb.APPEND_OUTCOME_DUPLICATE and again[0].sequence == 1
    # The refusal is AppendEvents' own: reason, field and the refused event's index.
    assert refused.value.reason == "INVALID_FIELD"
    assert refused.value.metadata == {"field": "payload", "event_index": "1"}
    assert after[0].outcome == pb.APPEND_OUTCOME_APPENDED and after[0].sequence == 4
    assert same_stream  # a refused batch does not end the stream
    # Four batches, each logged as one request of the stream's method; nothing went unary.
    assert _methods(logs).count(STREAM) >= 4 and UNARY not in _methods(logs)
    listed = LedgerClient(f"127.0.0.1:{ledger_server.port}", stream_appends=False)
    assert [e.sequence for e in listed.list_events(RUN)] == [1, 2, 3, 4]
    listed.close()


@pytest.fixture
def older_ledger(server: RunningServer) -> Iterator[str]:
    """A ledger without the stream: AppendEvents alone, over the fixture server's ledger."""
    servicer = LedgerServicer(server.ledger)
    handler = grpc.method_handlers_generic_handler(
        "shardledger.v1.LedgerService",
        {
            "AppendEvents": grpc.unary_unary_rpc_method_handler(
                servicer.AppendEvents,
                request_deserializer=pb.AppendEventsRequest.FromString,
                response_serializer=pb.AppendEventsResponse.SerializeToString,
            )
        },
    )
    older = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    older.add_generic_rpc_handlers((handler,))
    port = older.add_insecure_port("127.0.0.1:0")
    older.start()
    yield f"127.0.0.1:{port}"
    older.stop(0.5)


def test_a_ledger_without_the_stream_gets_the_same_batches_unary(
    older_ledger: str, server: RunningServer
) -> None:
    client = LedgerClient(older_ledger)
    results = client.append([planned(RUN, "s0"), planned(RUN, "s1", 1)])
    more = client.append([started(RUN, "s0")])
    unary_until = client._unary_until
    client.close()

    assert [r.outcome for r in results + more] == [pb.APPEND_OUTCOME_APPENDED] * 3
    assert unary_until > 0  # UNIMPLEMENTED seen once: the next batches went unary at once
    reader = LedgerClient(f"127.0.0.1:{server.port}")
    assert [e.sequence for e in reader.list_events(RUN)] == [1, 2, 3]
    reader.close()


def test_a_stopping_ledger_ends_its_idle_streams_and_the_next_append_opens_a_new_one(
    tmp_path: Path,
) -> None:
    config = ServerConfig(database=str(tmp_path / "ledger.db"), listen="127.0.0.1:0")
    first = create_server(config)
    client = LedgerClient(f"127.0.0.1:{first.port}", retry_deadline_s=0)
    client.append([planned(RUN, "s0")])
    stream = client._append_stream()
    stopper = threading.Thread(target=first.stop, args=(600.0,))
    stopper.start()
    # A stream waits for no grace: the stop ends it, then finishes (no 600 s wait).
    stopper.join(120)
    assert not stopper.is_alive()
    assert stream.ended
    with pytest.raises(LedgerUnavailable):
        client.append([started(RUN, "s0")], retry=False)

    second = create_server(ServerConfig(database=str(tmp_path / "ledger.db"), listen="127.0.0.1:0"))
    try:
        client = LedgerClient(f"127.0.0.1:{second.port}")
        assert client.append([started(RUN, "s0")])[0].sequence == 2
        assert client._append_stream() is not stream
        client.close()
    finally:
        second.stop(0.5)


def test_a_forked_child_appends_on_its_own_stream_and_the_parent_goes_on(
    server: RunningServer,
) -> None:
    client = LedgerClient(f"127.0.0.1:{server.port}")
    client.append([planned(RUN, "parent"), planned(RUN, "child", 1)])
    parent_stream = client._append_stream()
    pid = os.fork()
    if pid == 0:  # the child: its own channel and stream, then out without atexit hooks
        code = 1
        try:
            done = client.append([started(RUN, "child")])
            code = 0 if done[0].outcome == pb.APPEND_OUTCOME_APPENDED else 2
        except BaseException as exc:  # reported through the exit code
            print(f"child failed: {exc!r}", file=sys.stderr)
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    # The fork ended the parent's stream first: no gRPC call was active across it.
    assert parent_stream.ended
    assert client.append([started(RUN, "parent")])[0].outcome == pb.APPEND_OUTCOME_APPENDED
    client.close()
    assert os.waitstatus_to_exitcode(status) == 0
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        listed = pb_grpc.LedgerServiceStub(channel).ListEvents(
            pb.ListEventsRequest(run_id=RUN), timeout=30
        )
    assert sorted(e.shard_id for e in listed.events if e.HasField("started")) == [
        "child",
        "parent",
    ]


def test_a_client_that_pipelines_gets_answers_in_order_by_batch_id(
    ledger_server: RunningServer,
) -> None:
    batches = [
        pb.StreamAppendEventsRequest(batch_id=100 + i, events=[planned(RUN, f"p{i}", i)])
        for i in range(50)
    ]
    batches.insert(10, pb.StreamAppendEventsRequest(batch_id=7, events=[event(RUN, "bad")]))
    with grpc.insecure_channel(f"127.0.0.1:{ledger_server.port}") as channel:
        stub = pb_grpc.LedgerServiceStub(channel)
        answers = list(stub.StreamAppendEvents(iter(batches), timeout=60))
    assert [a.batch_id for a in answers] == [b.batch_id for b in batches]
    kinds = [a.WhichOneof("outcome") for a in answers]
    assert (
        kinds.count("error") == 1
        and answers[10].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    )
    sequences = [a.appended.results[0].sequence for a in answers if a.HasField("appended")]
    assert sequences == list(range(1, 51))  # committed in the order sent


@pytest.mark.parametrize("engine", ["aio", "threads"])
def test_past_the_most_streams_a_new_one_is_refused_and_the_sdk_sends_unary(
    tmp_path: Path, engine: str
) -> None:
    config = ServerConfig(
        database=str(tmp_path / "ledger.db"),
        listen="127.0.0.1:0",
        engine=engine,
        max_append_streams=1,
    )
    running = create_server(config)
    try:
        target = f"127.0.0.1:{running.port}"
        holder, latecomer = LedgerClient(target), LedgerClient(target)
        holder.append([planned(RUN, "s0")])  # holds the one stream
        with capture_logs() as logs:
            late = latecomer.append([planned(RUN, "s1", 1)])
        holder_again = holder.append([started(RUN, "s0")])
        assert late[0].outcome == pb.APPEND_OUTCOME_APPENDED
        assert latecomer._unary_until > 0
        assert holder_again[0].sequence == 3
        refused = [
            line
            for line in logs
            if line.get("event") == "request_handled" and line["method"] == STREAM
        ]
        assert [line["code"] for line in refused] == ["RESOURCE_EXHAUSTED"]
        assert UNARY in _methods(logs)
        holder.close()
        latecomer.close()
    finally:
        running.stop(0.5)


def test_metrics_count_the_open_streams_against_the_limit(tmp_path: Path) -> None:
    config = ServerConfig(
        database=str(tmp_path / "ledger.db"),
        listen="127.0.0.1:0",
        metrics_listen="127.0.0.1:0",
        max_append_streams=7,
    )
    running = create_server(config)
    try:

        def scrape() -> dict[str, float]:
            url = f"http://127.0.0.1:{running.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=30) as page:
                text = page.read().decode()
            return {
                line.split()[0]: float(line.split()[1])
                for line in text.splitlines()
                if line.startswith("shardledger_append_streams")
            }

        client = LedgerClient(f"127.0.0.1:{running.port}")
        client.append([planned(RUN, "s0")])
        while_open = scrape()
        client.close()
        assert while_open == {
            "shardledger_append_streams": 1.0,
            "shardledger_append_streams_limit": 7.0,
        }
    finally:
        running.stop(0.5)
