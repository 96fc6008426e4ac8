"""The contract's StreamAppendEvents vectors, replayed on live ledgers of both engines.

tests/data/contract_vectors.json `stream_appends` (docs/contract.md, "Appends on a
stream") holds one exchange: the batches a client sends on one stream and the
answers it must get, in order. Each engine serves a fresh ledger here, and the
answers are compared field by field as a client in another language would.
"""

from __future__ import annotations

import json
import queue
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format
from google.rpc import error_details_pb2, status_pb2

from ledger_server.config import ServerConfig
from ledger_server.server import create_server
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.api.shardledger.v1 import ledger_pb2_grpc as pb_grpc

VECTORS = json.loads(
    (Path(__file__).resolve().parent.parent / "data" / "contract_vectors.json").read_text()
)["stream_appends"]


def _error_as_seen(error: pb.AppendError) -> dict[str, Any]:
    """Returns an AppendError as the vectors write it: code, ErrorInfo reason and metadata."""
    seen: dict[str, Any] = {"code": error.code}
    for detail in error.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            seen["reason"], seen["metadata"] = info.reason, dict(info.metadata)
    return seen


@pytest.mark.parametrize("engine", ["aio", "threads"])
def test_the_stream_exchange_answers_as_the_vectors_say(tmp_path: Path, engine: str) -> None:
    running = create_server(
        ServerConfig(database=str(tmp_path / "ledger.db"), listen="127.0.0.1:0", engine=engine)
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            outgoing: queue.SimpleQueue[pb.StreamAppendEventsRequest | None] = queue.SimpleQueue()
            stub = pb_grpc.LedgerServiceStub(channel)
            answers = stub.StreamAppendEvents(iter(outgoing.get, None), timeout=60)
            for step in VECTORS["exchange"]:
                outgoing.put(json_format.ParseDict(step["request"], pb.StreamAppendEventsRequest()))
                answer = next(answers)
                want = step["answer"]
                assert str(answer.batch_id) == want["batch_id"]
                if "error" in want:
                    assert answer.WhichOneof("outcome") == "error"
                    assert _error_as_seen(answer.error) == want["error"]
                else:
                    got = json_format.MessageToDict(
                        answer.appended, preserving_proto_field_name=True
                    )
                    assert got == want["appended"]
            outgoing.put(None)
            assert list(answers) == []  # the client's end ends the stream, OK
    finally:
        running.stop(0.5)


def test_an_append_error_is_google_rpc_status_on_the_wire() -> None:
    raw = bytes.fromhex(VECTORS["append_error_is_google_rpc_status"]["append_error_hex"])
    error = pb.AppendError.FromString(raw)
    status = status_pb2.Status.FromString(raw)
    assert (status.code, status.message) == (error.code, error.message)
    assert status.SerializeToString() == raw
