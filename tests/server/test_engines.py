"""What differs between the engines (ServerConfig.engine) stays invisible to a client.

The asyncio engine awaits each append's commit on its event loop; a client that gives
up (deadline, cancel) cancels that wait. The commit must go on, the writer must keep
committing, and the room admission held for the append must come back: before the
commit's future was shielded from that cancellation, the writer thread met a cancelled
future, died, and the ledger acknowledged nothing more (a netns fault test found it).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from ledger_server.config import ENGINES, ServerConfig
from ledger_server.server import RunningServer, create_server
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.api.shardledger.v1 import ledger_pb2_grpc as pb_grpc
from shard_client.client import LedgerClient
from tests.builders import planned, started
from tests.server.test_admission import WriterGate

RUN = "run-engines"


@pytest.fixture(params=ENGINES)
def running(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    config = ServerConfig(
        database=str(tmp_path / "ledger.db"), listen="127.0.0.1:0", engine=request.param
    )
    server = create_server(config)
    yield server
    server.stop(0.5)


def _wait(what: str, done: object, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.02)


def test_an_append_whose_client_gave_up_still_commits_and_the_ledger_goes_on(
    running: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = f"127.0.0.1:{running.port}"
    client = LedgerClient(target, timeout_s=10)
    client.append([planned(RUN, "s0", 0), planned(RUN, "s1", 1)])
    gate = WriterGate(running, monkeypatch)
    admission = running.ledger.admission
    assert admission is not None
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.LedgerServiceStub(channel)
        request = pb.AppendEventsRequest(events=[started(RUN, "s0", "a1")])
        with pytest.raises(grpc.RpcError) as gave_up:
            stub.AppendEvents(request, timeout=0.5)  # the gate holds its commit past this
    assert gave_up.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert gate.entered.is_set()
    gate.opened.set()
    # In doubt for the client, committed by the ledger: the writer finished the group.
    _wait(
        "the abandoned append's commit",
        lambda: any(e.WhichOneof("payload") == "started" for e in client.list_events(RUN)),
    )
    # The writer is alive: the next append is acknowledged.
    (ack,) = client.append([started(RUN, "s1", "a1")])
    assert ack.sequence > 0
    # And the room the abandoned append held is free again.
    _wait("admission to hold nothing", lambda: (admission.events, admission.calls) == (0, 0))
    client.close()
    kinds = [e.WhichOneof("payload") for e in LedgerClient(target).list_events(RUN)]
    assert kinds == ["planned", "planned", "started", "started"]
