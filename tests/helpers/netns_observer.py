"""The test's hands inside a network namespace: ``python tests/helpers/netns_observer.py``.

Reads one JSON request per line on stdin ({"op": ..., ...}) and answers one JSON line
on stdout ({"result": ...} or {"error": "Type: message"}). Every call is one try with
a short deadline (no retries): the test decides what to wait for.

ops: plan (target, run, shards), summary (target, run), shards (target, run),
events (target, run), health (target), probe_append (target, run, shard, deadline_s,
retry_s), sql (dsn, query): rows of a read-only query, hold_run_lock (dsn, run): a
replica's group cut off mid-request.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import uuid
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shard_client.client import LedgerClient
from tests.builders import planned

_clients: dict[str, LedgerClient] = {}


def client(target: str) -> LedgerClient:
    """Returns a client of target that tries once, with a 5 s deadline."""
    if target not in _clients:
        _clients[target] = LedgerClient(target, timeout_s=5, retry_deadline_s=0)
    return _clients[target]


def plan(target: str, run: str, shards: list[str]) -> int:
    """Plans the shards (expected output: "out"); returns how many were appended."""
    events = [planned(run, shard, index) for index, shard in enumerate(shards)]
    return len(LedgerClient(target, retry_deadline_s=30).append(events))


def events(target: str, run: str) -> list[dict[str, Any]]:
    """Returns the run's events as the ledger stores them: ids, sequences, kinds, clocks."""
    out = []
    for e in client(target).list_events(run):
        out.append(
            {
                "event_id": e.event_id,
                "sequence": e.sequence,
                "kind": e.WhichOneof("payload"),
                "shard_id": e.shard_id,
                "attempt_id": e.attempt_id,
                "receive_us": e.receive_time.seconds * 1_000_000 + e.receive_time.nanos // 1000,
                "client_us": e.client_time.seconds * 1_000_000 + e.client_time.nanos // 1000,
                "blake3": e.artifact_committed.blake3_hex
                if e.WhichOneof("payload") == "artifact_committed"
                else "",
            }
        )
    return out


def health(target: str) -> str:
    """Returns the replica's health status name, or the gRPC code that answered instead."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            answer = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
        except grpc.RpcError as exc:
            return str(exc.code().name)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))


def probe_append(
    target: str, run: str, shard: str, deadline_s: float, retry_s: float = 0
) -> dict[str, Any]:
    """Appends one planned event with a fresh id; returns whether it was acknowledged, and when.

    One call with deadline_s, or calls with that deadline retried for retry_s.
    """
    probe = planned(run, shard)
    probe.event_id = uuid.uuid4().hex
    started = time.monotonic()
    try:
        LedgerClient(target, timeout_s=deadline_s, retry_deadline_s=retry_s).append([probe])
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"ok": True, "seconds": time.monotonic() - started, "event_id": probe.event_id}


_held: list[contextlib.ExitStack] = []


def hold_run_lock(dsn: str, run: str) -> str:
    """Locks the run as a replica's group does, then sends a statement of a pipeline and no Sync.

    What a replica cut off mid-group leaves on the database: a session holding the run's
    lock that has not finished its request, so the server waits to read the rest (its
    idle_in_transaction_session_timeout is not running). Held until the process ends.
    """
    from ledger_server.store.postgres import PostgresStore

    stack = contextlib.ExitStack()
    store = PostgresStore(dsn)
    stack.callback(store.close)
    tx = stack.enter_context(store.write())
    tx.conn.execute("SELECT 1 FROM runs WHERE run_id = %s FOR UPDATE", (run,))
    stack.enter_context(tx.conn.pipeline())
    tx.conn.execute("SELECT 1")
    _held.append(stack)
    return "held"


def sql(dsn: str, query: str) -> list[list[Any]]:
    """Returns the rows of a read-only query (a standby's view of the ledger)."""
    import psycopg

    with psycopg.connect(dsn, connect_timeout=3, autocommit=True) as conn:
        return [list(row) for row in conn.execute(query).fetchall()]


def answer(request: dict[str, Any]) -> Any:
    """Runs one request."""
    op = request.pop("op")
    if op == "plan":
        return plan(**request)
    if op == "summary":
        return json.loads(client(request["target"]).summary(request["run"]))
    if op == "shards":
        return [json.loads(v.view_json) for v in client(request["target"]).shards(request["run"])]
    if op == "events":
        return events(**request)
    if op == "health":
        return health(**request)
    if op == "probe_append":
        return probe_append(**request)
    if op == "sql":
        return sql(**request)
    if op == "hold_run_lock":
        return hold_run_lock(**request)
    raise ValueError(f"unknown op {op!r}")


def main() -> int:
    """Answers requests until stdin closes."""
    for line in sys.stdin:
        try:
            reply: dict[str, Any] = {"result": answer(json.loads(line))}
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
