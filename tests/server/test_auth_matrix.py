"""Every RPC against every kind of caller: the status code, the ErrorInfo reason, no tenant leaks.

One real server (auth="tokens") on a loopback ephemeral port over a real SQLite
file holds two tenants: "alpha" (the tenant every request names) and "beta"
(the other tenant, whose rows must never be read or written by alpha's callers).
"""

from __future__ import annotations

import contextlib
import io
import json
import secrets
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from structlog.testing import capture_logs

from ledger_server.auth import new_token
from ledger_server.config import ServerConfig
from ledger_server.server import RunningServer, create_server
from ledger_server.store.sqlite import SqliteStore
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.api.shardledger.v1 import ledger_pb2_grpc as pb_grpc
from shard_client.client import channel_credentials
from shard_client.errors import status_code
from shardledger_cli.cli import main as cli_main
from tests.builders import committed, planned, started

NS = "alpha"
OTHER_NS = "beta"
RUN = "team-run"
MISSING_RUN = "team-run-that-does-not-exist"
# Every beta identifier carries this mark, so a leak shows up in any serialized response.
LEAK_MARK = "beta-secret"
OTHER_RUN = f"{LEAK_MARK}-run"

OK = grpc.StatusCode.OK
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
DENIED = grpc.StatusCode.PERMISSION_DENIED

RPCS = (
    "AppendEvents",
    "StreamAppendEvents",
    "ListEvents",
    "TailEvents",
    "ListRuns",
    "GetRunSummary",
    "ListShards",
    "StreamResumeList",
    "GetTreeHead",
    "GetInclusionProof",
    "GetConsistencyProof",
    "GetPublicKey",
    "GetRunReport",
    "CompareRuns",
)
# A stream's batch is refused what AppendEvents is (within the stream: the batch's answer).
APPENDS = ("AppendEvents", "StreamAppendEvents")
# The token failures the interceptor answers before any handler runs.
UNAUTHENTICATED_CALLERS = {
    "no_token": "TOKEN_MISSING",
    "malformed": "TOKEN_MALFORMED",
    "wrong_secret": "TOKEN_INVALID",
    "expired": "TOKEN_EXPIRED",
    "revoked": "TOKEN_REVOKED",
}
CALLERS = (
    *UNAUTHENTICATED_CALLERS,
    "other_tenant",
    "reader",
    "writer_other_prefix",
    "writer",
    "auditor",
    "admin",
)


@dataclass(frozen=True, slots=True)
class Expect:
    """The answer one caller gets from one RPC."""

    code: grpc.StatusCode
    reason: str = ""

    def __str__(self) -> str:
        return self.code.name + (f":{self.reason}" if self.reason else "")


def expected(caller: str, rpc: str) -> Expect:
    """Returns the answer the authorization rules (ledger_server/auth.py) promise."""
    if caller in UNAUTHENTICATED_CALLERS:
        return Expect(UNAUTHENTICATED, UNAUTHENTICATED_CALLERS[caller])
    if rpc == "GetPublicKey":
        return Expect(OK)  # the verification key is public; any valid token may fetch it
    if caller == "other_tenant":
        return Expect(DENIED, "NAMESPACE_FORBIDDEN")
    if rpc in APPENDS:
        if caller in ("reader", "auditor"):
            return Expect(DENIED, "ROLE_FORBIDDEN")
        if caller == "writer_other_prefix":
            return Expect(DENIED, "RUN_PREFIX_FORBIDDEN")
    # Reads, and the audit RPCs, are open to every role within its tenant.
    return Expect(OK)


@dataclass(slots=True)
class World:
    """The module's server, its database and a channel per caller."""

    running: RunningServer
    db: Path
    target: str
    stubs: dict[str, pb_grpc.LedgerServiceStub]
    tokens: dict[str, str | None]
    alpha_event_id: str
    channels: list[grpc.Channel]


def _cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli_main(list(argv))
    return code, out.getvalue()


def _token_id(token: str) -> str:
    return token.split("_", 2)[1]


def _secret(token: str) -> str:
    # The secret is URL-safe base64 and may itself contain "_": split only twice.
    return token.split("_", 2)[2]


def _store_token(store: SqliteStore, *, namespace: str, role: str, **kw: Any) -> str:
    now = time.time_ns() // 1000
    kw.setdefault("expires_us", None)
    token, row = new_token(namespace=namespace, role=role, now_us=now, **kw)
    store.create_token(row)
    return token


def _make_tokens(db: Path, store: SqliteStore) -> dict[str, str | None]:
    hour_us = 3600 * 1_000_000
    now = time.time_ns() // 1000
    # The reader comes from the CLI, as an operator would make it.
    code, out = _cli("token", "create", "--db", str(db), "--role", "reader", "--namespace", NS)
    assert code == 0
    reader = out.strip()
    expired, row = new_token(
        namespace=NS, role="reader", now_us=now - 2 * hour_us, expires_us=now - hour_us
    )
    store.create_token(row)
    revoked = _store_token(store, namespace=NS, role="writer")
    code, _ = _cli("token", "revoke", _token_id(revoked), "--db", str(db))
    assert code == 0
    reader_id = _token_id(reader)
    return {
        "no_token": None,
        "malformed": "slt_not-a-token",
        "wrong_secret": f"slt_{reader_id}_{secrets.token_urlsafe(32)}",
        "expired": expired,
        "revoked": revoked,
        "other_tenant": _store_token(store, namespace=OTHER_NS, role="writer"),
        "reader": reader,
        "writer_other_prefix": _store_token(
            store, namespace=NS, role="writer", run_prefix="other-"
        ),
        "writer": _store_token(store, namespace=NS, role="writer", run_prefix="team-"),
        "auditor": _store_token(store, namespace="ops", role="auditor"),
        "admin": _store_token(store, namespace="ops", role="admin"),
    }


def _in(namespace: str, msg: pb.ShardEvent) -> pb.ShardEvent:
    msg.namespace = namespace
    return msg


def _seed(stub: pb_grpc.LedgerServiceStub) -> str:
    alpha = [
        _in(NS, planned(RUN, "s0")),
        _in(NS, started(RUN, "s0")),
        _in(NS, committed(RUN, "s0")),
        _in(NS, planned(RUN, "s1", index=1)),
    ]
    beta = [
        _in(OTHER_NS, planned(OTHER_RUN, f"{LEAK_MARK}-shard")),
        _in(OTHER_NS, planned(OTHER_RUN, f"{LEAK_MARK}-shard-2", index=1)),
    ]
    for ev in beta:
        ev.event_id = f"{LEAK_MARK}-{uuid.uuid4().hex}"
        ev.planned.input_ref = f"/{LEAK_MARK}/input.bin"
    stub.AppendEvents(pb.AppendEventsRequest(events=alpha + beta))
    return alpha[0].event_id


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """Starts one token-checking server with two tenants and a channel per caller."""
    db = tmp_path_factory.mktemp("auth") / "ledger.db"
    running = create_server(ServerConfig(database=str(db), listen="127.0.0.1:0", auth="tokens"))
    target = f"127.0.0.1:{running.port}"
    store = SqliteStore(str(db))
    try:
        tokens = _make_tokens(db, store)
    finally:
        store.close()
    channels: list[grpc.Channel] = []
    stubs = {}
    for caller, token in tokens.items():
        creds = channel_credentials(token=token) if token else None
        channel = grpc.secure_channel(target, creds) if creds else grpc.insecure_channel(target)
        channels.append(channel)
        stubs[caller] = pb_grpc.LedgerServiceStub(channel)
    alpha_event_id = _seed(stubs["admin"])
    yield World(running, db, target, stubs, tokens, alpha_event_id, channels)
    for channel in channels:
        channel.close()
    running.stop(0.5)


def _request(world: World, rpc: str, *, run_id: str = RUN, namespace: str = NS) -> Message:
    if rpc in APPENDS:
        shard = f"s-{uuid.uuid4().hex[:12]}"
        events = [_in(namespace, planned(run_id, shard))]
        if rpc == "StreamAppendEvents":
            return pb.StreamAppendEventsRequest(batch_id=7, events=events)
        return pb.AppendEventsRequest(events=events)
    if rpc == "ListRuns":
        return pb.ListRunsRequest(namespace=namespace)
    if rpc == "GetPublicKey":
        return pb.GetPublicKeyRequest()
    if rpc == "GetInclusionProof":
        return pb.GetInclusionProofRequest(
            namespace=namespace, run_id=run_id, event_id=world.alpha_event_id
        )
    if rpc == "GetConsistencyProof":
        return pb.GetConsistencyProofRequest(namespace=namespace, run_id=run_id, old_size=1)
    if rpc == "CompareRuns":
        return pb.CompareRunsRequest(namespace=namespace, run_ids=[run_id], label="provider")
    cls: type[Message] = getattr(pb, f"{rpc}Request")
    return cls(namespace=namespace, run_id=run_id)


def _invoke(stub: pb_grpc.LedgerServiceStub, rpc: str, request: Message) -> list[Message]:
    """Calls an RPC and returns what it answered (a stream's first message for TailEvents)."""
    method: Callable[..., Any] = getattr(stub, rpc)
    if rpc == "TailEvents":
        call = method(request, timeout=10)
        try:
            return [next(call)]  # the tail never ends on its own
        finally:
            call.cancel()
    if rpc == "StreamResumeList":
        return list(method(request, timeout=10))
    if rpc == "StreamAppendEvents":
        return list(method(iter([request]), timeout=10))
    return [method(request, timeout=10)]


def _answer(stub: pb_grpc.LedgerServiceStub, rpc: str, request: Message) -> tuple[Expect, bytes]:
    """Returns the code and ErrorInfo reason an RPC answered, and its serialized responses."""
    try:
        responses = _invoke(stub, rpc, request)
    except grpc.RpcError as exc:
        return Expect(exc.code(), _reason(exc)), b""
    if rpc == "StreamAppendEvents":
        answer: Any
        (answer,) = responses
        assert answer.batch_id == 7
        if answer.HasField("error"):  # the batch refused, the stream ended OK
            return Expect(status_code(answer.error.code), _info_reason(answer.error.details)), b""
    return Expect(OK), b"".join(r.SerializeToString() for r in responses)


def _reason(exc: grpc.RpcError) -> str:
    status = rpc_status.from_call(exc)  # type: ignore[arg-type]
    return "" if status is None else _info_reason(status.details)


def _info_reason(details: Any) -> str:
    for detail in details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return str(info.reason)
    return ""


def _tenant_rows(db: Path) -> dict[str, tuple[int, ...]]:
    """Returns, per namespace: runs, events, the last sequence, shards and counter rows."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        rows = conn.execute(
            """SELECT r.namespace, COUNT(DISTINCT r.run_pk),
                      (SELECT COUNT(*) FROM events e JOIN runs x USING (run_pk)
                        WHERE x.namespace = r.namespace),
                      (SELECT COALESCE(MAX(seq), 0) FROM events e JOIN runs x USING (run_pk)
                        WHERE x.namespace = r.namespace),
                      (SELECT COUNT(*) FROM shards s JOIN runs x USING (run_pk)
                        WHERE x.namespace = r.namespace),
                      (SELECT COALESCE(SUM(n), 0) FROM run_counters c JOIN runs x USING (run_pk)
                        WHERE x.namespace = r.namespace)
               FROM runs r GROUP BY r.namespace"""
        ).fetchall()
    return {row[0]: tuple(row[1:]) for row in rows}


MATRIX = [
    pytest.param(caller, rpc, id=f"{rpc}|{caller}|{expected(caller, rpc)}")
    for rpc in RPCS
    for caller in CALLERS
]


@pytest.mark.parametrize(("caller", "rpc"), MATRIX)
def test_caller_gets_the_answer_its_token_allows_and_no_other_tenant_rows(
    world: World, caller: str, rpc: str
) -> None:
    want = expected(caller, rpc)
    before = _tenant_rows(world.db)

    got, body = _answer(world.stubs[caller], rpc, _request(world, rpc))

    after = _tenant_rows(world.db)
    assert got == want
    assert LEAK_MARK.encode() not in body
    assert after[OTHER_NS] == before[OTHER_NS]
    if rpc in APPENDS and want.code == OK:
        # Exactly the one planned event, in alpha, and nowhere else.
        assert after[NS][1] == before[NS][1] + 1
        assert after[NS][3] == before[NS][3] + 1
    else:
        assert after[NS] == before[NS]


def test_matrix_covers_every_rpc_of_the_service() -> None:
    service = pb.DESCRIPTOR.services_by_name["LedgerService"]
    assert {m.name for m in service.methods} == set(RPCS)


@pytest.mark.parametrize(
    "rpc", [r for r in RPCS if r not in ("ListRuns", "GetPublicKey", *APPENDS)]
)
def test_other_tenant_gets_the_same_refusal_whether_or_not_the_run_exists(
    world: World, rpc: str
) -> None:
    stub = world.stubs["other_tenant"]
    existing = _refusal_as_seen(stub, rpc, _request(world, rpc, run_id=RUN))
    missing = _refusal_as_seen(stub, rpc, _request(world, rpc, run_id=MISSING_RUN))
    assert existing == missing
    assert existing[0] == DENIED
    assert RUN not in existing[1]


def _refusal_as_seen(
    stub: pb_grpc.LedgerServiceStub, rpc: str, request: Message
) -> tuple[grpc.StatusCode, str, bytes]:
    """Returns everything a refused caller sees: code, message and the status details."""
    with pytest.raises(grpc.RpcError) as refused:
        _invoke(stub, rpc, request)
    metadata: Any = refused.value.trailing_metadata() or ()
    trailers: dict[str, Any] = dict(metadata)
    return refused.value.code(), refused.value.details() or "", trailers["grpc-status-details-bin"]


def test_other_tenant_append_into_a_missing_run_is_refused_before_lookup(world: World) -> None:
    before = _tenant_rows(world.db)
    got, _ = _answer(
        world.stubs["other_tenant"],
        "AppendEvents",
        _request(world, "AppendEvents", run_id=MISSING_RUN),
    )
    assert got == Expect(DENIED, "NAMESPACE_FORBIDDEN")
    assert _tenant_rows(world.db) == before


def test_tenant_token_without_a_namespace_means_its_own_tenant(world: World) -> None:
    alpha = world.stubs["reader"].ListRuns(pb.ListRunsRequest(), timeout=10)
    beta = world.stubs["other_tenant"].ListRuns(pb.ListRunsRequest(), timeout=10)
    assert {(r.namespace, r.run_id) for r in alpha.runs} == {(NS, RUN)}
    assert {(r.namespace, r.run_id) for r in beta.runs} == {(OTHER_NS, OTHER_RUN)}


def test_tenant_append_without_a_namespace_lands_in_its_own_tenant(world: World) -> None:
    before = _tenant_rows(world.db)
    ev = planned(RUN, f"s-{uuid.uuid4().hex[:12]}")
    world.stubs["writer"].AppendEvents(pb.AppendEventsRequest(events=[ev]), timeout=10)
    after = _tenant_rows(world.db)
    assert after[NS][1] == before[NS][1] + 1
    assert after[OTHER_NS] == before[OTHER_NS]


def test_batch_with_one_event_for_another_tenant_writes_nothing(world: World) -> None:
    before = _tenant_rows(world.db)
    mine = _in(NS, planned(RUN, f"s-{uuid.uuid4().hex[:12]}"))
    theirs = _in(OTHER_NS, planned(OTHER_RUN, f"s-{uuid.uuid4().hex[:12]}"))
    request = pb.AppendEventsRequest(events=[mine, theirs])
    got, _ = _answer(world.stubs["writer"], "AppendEvents", request)
    assert got == Expect(DENIED, "NAMESPACE_FORBIDDEN")
    assert _tenant_rows(world.db) == before


def test_an_event_id_another_tenant_used_is_refused_without_describing_its_row(
    world: World,
) -> None:
    before = _tenant_rows(world.db)
    taken = _in(OTHER_NS, planned(OTHER_RUN, f"s-{uuid.uuid4().hex[:12]}"))
    world.stubs["other_tenant"].AppendEvents(pb.AppendEventsRequest(events=[taken]), timeout=10)
    mine = _in(NS, planned("team-ids", f"s-{uuid.uuid4().hex[:12]}"))
    mine.event_id = taken.event_id
    with pytest.raises(grpc.RpcError) as caught:
        world.stubs["writer"].AppendEvents(pb.AppendEventsRequest(events=[mine]), timeout=10)
    assert (caught.value.code(), _reason(caught.value)) == (
        grpc.StatusCode.ALREADY_EXISTS,
        "EVENT_ID_REUSED",
    )
    status = rpc_status.from_call(caught.value)  # type: ignore[arg-type]
    assert status is not None and "sequence" not in status.message
    [info] = [d for d in status.details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)]
    error = error_details_pb2.ErrorInfo()
    info.Unpack(error)
    assert "existing_sequence" not in error.metadata
    assert _tenant_rows(world.db)[NS] == before[NS]


def test_auditor_reads_every_tenant(world: World) -> None:
    got, body = _answer(
        world.stubs["auditor"],
        "ListEvents",
        pb.ListEventsRequest(namespace=OTHER_NS, run_id=OTHER_RUN),
    )
    assert got == Expect(OK)
    assert LEAK_MARK.encode() in body


@pytest.mark.parametrize(("caller", "reason"), sorted(UNAUTHENTICATED_CALLERS.items()))
def test_unauthenticated_call_is_logged_and_counted_without_the_token(
    world: World, caller: str, reason: str
) -> None:
    counted = world.running.interceptor.rejections[reason]
    with capture_logs() as logs:
        got, _ = _answer(world.stubs[caller], "ListRuns", _request(world, "ListRuns"))
    assert got == Expect(UNAUTHENTICATED, reason)
    rejected = [e for e in logs if e["event"] == "request_rejected"]
    assert [(e["reason"], e["method"]) for e in rejected] == [
        (reason, "/shardledger.v1.LedgerService/ListRuns")
    ]
    assert world.running.interceptor.rejections[reason] == counted + 1
    token = world.tokens[caller]
    if token:
        hidden = [token, *token.split("_", 2)[2:]]  # the whole token, and its secret if any
        assert all(h not in repr(entry) for entry in logs for h in hidden)


def test_forbidden_call_is_logged_and_counted(world: World) -> None:
    counted = world.running.interceptor.rejections["ROLE_FORBIDDEN"]
    with capture_logs() as logs:
        got, _ = _answer(world.stubs["reader"], "AppendEvents", _request(world, "AppendEvents"))
    assert got == Expect(DENIED, "ROLE_FORBIDDEN")
    assert [e["reason"] for e in logs if e["event"] == "request_rejected"] == ["ROLE_FORBIDDEN"]
    assert world.running.interceptor.rejections["ROLE_FORBIDDEN"] == counted + 1
    secret = _secret(str(world.tokens["reader"]))
    assert all(secret not in repr(entry) for entry in logs)


def test_token_revoked_with_the_cli_is_refused_at_the_next_call(world: World) -> None:
    code, out = _cli(
        "token", "create", "--db", str(world.db), "--role", "reader", "--namespace", NS, "--json"
    )
    assert code == 0
    created = json.loads(out)
    credentials = channel_credentials(token=created["token"])
    assert credentials is not None
    with grpc.secure_channel(world.target, credentials) as ch:
        stub = pb_grpc.LedgerServiceStub(ch)
        assert _answer(stub, "ListRuns", _request(world, "ListRuns"))[0] == Expect(OK)
        code, _ = _cli("token", "revoke", created["token_id"], "--db", str(world.db))
        assert code == 0
        got, _ = _answer(stub, "ListRuns", _request(world, "ListRuns"))
    assert got == Expect(UNAUTHENTICATED, "TOKEN_REVOKED")


def test_token_list_shows_ids_but_never_secrets(world: World) -> None:
    code, out = _cli("token", "list", "--db", str(world.db), "--json")
    assert code == 0
    listed = {item["token_id"]: item["status"] for item in map(json.loads, out.splitlines())}
    for caller in ("reader", "writer", "admin", "expired", "revoked"):
        token = str(world.tokens[caller])
        assert _token_id(token) in listed
        assert _secret(token) not in out
    assert listed[_token_id(str(world.tokens["expired"]))] == "expired"
    assert listed[_token_id(str(world.tokens["revoked"]))] == "revoked"


def test_health_answers_without_a_token(world: World) -> None:
    with grpc.insecure_channel(world.target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
