"""Property-based fuzzing of one live server: no crash, no UNKNOWN/INTERNAL, no rows from refusals.

One real server (auth="tokens", an admin token, loopback ephemeral port, real
SQLite file) takes the whole campaign: raw random and mutated bytes on the
wire to every method, structurally valid messages with boundary values in
every field, batches mixing valid and invalid events, and random
authorization headers. Every call is checked the same way (see `Campaign.call`):

* the answer is never UNKNOWN or INTERNAL (an unhandled exception or a
  framework failure on our side);
* a refused call leaves the database exactly as it was (rows, last sequence);
* an accepted append adds exactly the rows it reports as APPENDED.

Each test owns a request quota (QUOTAS), and the quotas sum to over 10,000
requests; the examples per test are tuned to reach them in about a minute on
a two-core CI machine.
`python -m tools.campaign` scales the quotas and runs past them for a set time
(tests/campaign.py).
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import sqlite3
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger_server.auth import new_token
from ledger_server.config import ServerConfig
from ledger_server.server import RunningServer, create_server
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.api.shardledger.v1 import ledger_pb2_grpc as pb_grpc
from shard_client.client import channel_credentials
from shard_client.errors import status_code
from tests import campaign as knobs
from tests.builders import DIGEST_A, DIGEST_B, committed, planned, started

SERVICE: Final = pb.DESCRIPTOR.services_by_name["LedgerService"]
METHODS: Final = {m.name: m for m in SERVICE.methods}
FORBIDDEN_CODES: Final = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
SEED_RUN: Final = "seed-run"
LIVE_SHARD: Final = "live"
LIVE_ATTEMPT: Final = "att-live"
INT64: Final = (-(2**63), 2**63 - 1)
INT32: Final = (-(2**31), 2**31 - 1)
# Requests each test must send; together they are the campaign's floor.
QUOTAS: Final = {
    "raw_bytes": 4400,
    "append_batches": 2400,
    "reads": 2600,
    "auth_headers": 800,
}
# The nightly campaign (tools/campaign/nightly.py) scales the quotas and adds wall time past them,
# shared among the raw-bytes tests (one per method) and the three other quota tests.
WANT: Final = {name: max(1, round(n * knobs.fuzz_scale())) for name, n in QUOTAS.items()}
SHARE_S: Final = knobs.fuzz_seconds() / (len(METHODS) + 3)
FAST: Final = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}


# --- the campaign: one server, one checked way to call it ------------------------------


@dataclass(slots=True)
class Campaign:
    """The live server, a plaintext and an admin channel, and what the calls answered."""

    running: RunningServer
    db: sqlite3.Connection
    admin: grpc.Channel
    plain: grpc.Channel
    requests: int = 0
    codes: Counter[str] = field(default_factory=Counter)

    def rows(self) -> tuple[int, ...]:
        """Returns events, last sequence, runs and shards: any write moves one of them."""
        row = self.db.execute(
            "SELECT (SELECT COUNT(*) FROM events), (SELECT COALESCE(MAX(seq), 0) FROM events),"
            " (SELECT COUNT(*) FROM runs), (SELECT COUNT(*) FROM shards)"
        ).fetchone()
        return tuple(row)

    def call(
        self,
        method: str,
        request: bytes | Message,
        *,
        channel: grpc.Channel | None = None,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> tuple[grpc.StatusCode, list[bytes]]:
        """Sends one request and checks the answer and the database; returns both."""
        payload = request if isinstance(request, bytes) else request.SerializeToString()
        path = f"/{SERVICE.full_name}/{method}"
        channel = channel or self.admin
        before = self.rows()
        code, responses = _send(channel, path, payload, METHODS[method], metadata)
        after = self.rows()
        self.requests += 1
        reply: Any = None
        if code == grpc.StatusCode.OK and method == "AppendEvents":
            reply = pb.AppendEventsResponse.FromString(responses[0])
        elif code == grpc.StatusCode.OK and method == "StreamAppendEvents" and responses:
            answer = pb.StreamAppendEventsResponse.FromString(responses[0])
            if answer.HasField("error"):  # the batch's own status, the stream's was OK
                code = status_code(answer.error.code)
            else:
                reply = answer.appended
        self.codes[code.name] += 1
        assert code not in FORBIDDEN_CODES, f"{method} answered {code.name}"
        if reply is None:
            assert after == before, f"{method} answered {code.name} but the rows changed"
        else:
            appended = sum(r.outcome == pb.APPEND_OUTCOME_APPENDED for r in reply.results)
            assert after[0] - before[0] == appended
        return code, responses


def _send(
    channel: grpc.Channel,
    path: str,
    payload: bytes,
    method: Any,
    metadata: tuple[tuple[str, str], ...],
) -> tuple[grpc.StatusCode, list[bytes]]:
    try:
        if method.client_streaming:  # StreamAppendEvents: one batch, then the stream's end
            bidi = channel.stream_stream(path, request_serializer=None, response_deserializer=None)
            return grpc.StatusCode.OK, list(bidi(iter([payload]), timeout=10, metadata=metadata))
        if not method.server_streaming:
            unary = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
            return grpc.StatusCode.OK, [unary(payload, timeout=10, metadata=metadata)]
        stream = channel.unary_stream(path, request_serializer=None, response_deserializer=None)
        # A tail of an existing run never ends: a short deadline, and the first message is enough.
        call: Any = stream(
            payload, timeout=0.5 if path.endswith("/TailEvents") else 10, metadata=metadata
        )
        try:
            first = next(call, None)
        finally:
            call.cancel()
        return grpc.StatusCode.OK, [] if first is None else [first]
    except grpc.RpcError as exc:
        code: grpc.StatusCode = exc.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and path.endswith("/TailEvents"):
            return grpc.StatusCode.OK, []  # a tail waiting for new events: the expected answer
        return code, []


@pytest.fixture(scope="module")
def campaign(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Campaign]:
    """Starts the one server of the module, seeds a run, and yields the checked caller."""
    path: Path = tmp_path_factory.mktemp("fuzz") / "ledger.db"
    running = create_server(ServerConfig(database=str(path), listen="127.0.0.1:0", auth="tokens"))
    token, row = new_token(
        namespace="ops", role="admin", now_us=time.time_ns() // 1000, expires_us=None
    )
    running.ledger.store.create_token(row)
    target = f"127.0.0.1:{running.port}"
    credentials = channel_credentials(token=token)
    assert credentials is not None
    admin = grpc.secure_channel(target, credentials)
    plain = grpc.insecure_channel(target)
    # Autocommit: every SELECT reads the latest commit.
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    state = Campaign(running, db, admin, plain)
    seed = [
        planned(SEED_RUN, "s0"),
        started(SEED_RUN, "s0"),
        committed(SEED_RUN, "s0"),
        planned(SEED_RUN, LIVE_SHARD, index=1),
        started(SEED_RUN, LIVE_SHARD, LIVE_ATTEMPT, timeout_s=7 * 24 * 3600),
    ]
    code, _ = state.call("AppendEvents", pb.AppendEventsRequest(events=seed))
    assert code == grpc.StatusCode.OK
    yield state
    forbidden = sum(state.codes[c.name] for c in FORBIDDEN_CODES)
    knobs.report(
        "fuzz", {"requests": state.requests, "codes": dict(state.codes), "forbidden": forbidden}
    )
    _assert_still_serving(state)
    admin.close()
    plain.close()
    db.close()
    running.stop(0.5)


def _assert_still_serving(state: Campaign) -> None:
    reply = health_pb2_grpc.HealthStub(state.plain).Check(
        health_pb2.HealthCheckRequest(), timeout=10
    )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    # A run of its own: the campaign may have closed the seeded run, which then takes no
    # new shard (RUN_CLOSED).
    fresh = planned(f"alive-{uuid.uuid4().hex}", "s0")
    code, _ = state.call("AppendEvents", pb.AppendEventsRequest(events=[fresh]))
    assert code == grpc.StatusCode.OK


def _run_to_quota(state: Campaign, name: str, before: int, run: Any) -> None:
    # Hypothesis may stop short of max_examples (duplicates, exhausted strategies);
    # another pass with fresh random data tops the campaign up to its floor.
    started_at = time.monotonic()
    run()
    while state.requests - before < WANT[name] or time.monotonic() - started_at < SHARE_S:
        run()


@contextlib.contextmanager
def _quota(state: Campaign, name: str) -> Iterator[None]:
    before = state.requests
    yield
    sent = state.requests - before
    assert sent >= WANT[name], f"{name}: {sent} requests, quota {WANT[name]}"
    _assert_still_serving(state)


# --- value strategies: the boundaries of every field -----------------------------------

ID_CHARS: Final = "abcXYZ0189._:@+=/-"
valid_ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:@+=/-]{0,30}", fullmatch=True)
odd_text = st.sampled_from(
    [
        "",
        "a",
        "\x00",
        "a\x00b",
        "\u0085",  # next line
        "\u2028",  # line separator
        "\u200b",  # zero-width space
        "\ufeff",  # byte order mark
        "\U0010ffff",  # the last code point
        "\U0001f600",
        "e\u0301",  # combining accent
        "\x7f\x1b[31m",
        "../../etc/passwd",
        " ",
        "-",
    ]
)
boundary_text = st.one_of(
    odd_text,
    st.sampled_from([n * "a" for n in (127, 128, 129, 255, 256, 1024, 1025, 4096, 4097)]),
    st.sampled_from(["é" * 128, "é" * 129, "\U0001f600" * 64, "a" * 8192, "a" * 8193]),
    st.text(max_size=24),
    st.text(alphabet=ID_CHARS, min_size=1, max_size=140),
)
int64s = st.one_of(
    st.sampled_from([0, 1, -1, 2**31 - 1, -(2**31), 2**32, INT64[0], INT64[1]]),
    st.integers(*INT64),
)
int32s = st.one_of(st.sampled_from([0, 1, -1, 5000, 5001, *INT32]), st.integers(*INT32))
floats = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 0.0, 1.0, 1.0000001, 5e-324, -1.0]),
    st.floats(),
)
enum_numbers = st.one_of(st.integers(-3, 12), st.integers(*INT32))


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode()


page_tokens = st.one_of(
    st.just(""),
    st.text(max_size=30),
    st.binary(max_size=30).map(_b64),
    st.sampled_from(
        [
            _b64(b"1e400"),
            _b64(b"-1e400"),
            _b64(b"NaN"),
            _b64(str(2**64).encode()),
            _b64(str(-(2**70)).encode()),
            _b64(b"[" * 50_000 + b"]" * 50_000),
            _b64(b'{"a":' * 20_000 + b"1" + b"}" * 20_000),
            _b64(b'[1e400,"x"]'),
            _b64(json.dumps([2**64, "x"]).encode()),
            _b64(b'[-1,"s0"]'),
            _b64(b'["1","2","3"]'),
            _b64(b'{"a":1,"b":2}'),
            _b64(b"\xff\xfe\x00"),
            _b64("\u00e9".encode("utf-16")),
            "====",
            "%%%",
        ]
    ),
    st.recursive(
        st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
        max_leaves=6,
    ).map(lambda v: _b64(json.dumps(v).encode())),
)


def timestamps() -> st.SearchStrategy[Timestamp]:
    """Returns timestamps including negative, huge and denormal ones."""
    return st.builds(Timestamp, seconds=int64s, nanos=int32s)


def durations() -> st.SearchStrategy[Duration]:
    """Returns durations around the 7-day heartbeat limit and far outside it."""
    week = 7 * 24 * 3600
    seconds = st.one_of(st.sampled_from([0, 1, -1, week, week + 1]), st.integers(*INT64))
    return st.builds(Duration, seconds=seconds, nanos=int32s)


# --- structured events: a valid base, then mutations that are known to break or keep it ---

KINDS: Final = [f.name for f in pb.ShardEvent.DESCRIPTOR.oneofs_by_name["payload"].fields]
# A mutation changes one field and returns (the field, whether that makes the event invalid:
# True, False, or None when unknown), or None when the field is not in the event's kind.
Mutation = Callable[[pb.ShardEvent, st.DataObject], tuple[str, bool | None] | None]


def _target(ev: pb.ShardEvent, path: str) -> tuple[Any, str] | None:
    parts = path.split(".")
    if parts[0] in KINDS and ev.WhichOneof("payload") != parts[0]:
        return None
    target: Any = ev
    for part in parts[:-1]:
        target = getattr(target, part)
    return target, parts[-1]


def _put(ev: pb.ShardEvent, path: str, value: Any) -> bool:
    found = _target(ev, path)
    if found is None:
        return False
    target, attr = found
    if isinstance(value, Message):
        getattr(target, attr).CopyFrom(value)
    elif isinstance(value, dict):
        getattr(target, attr).clear()
        getattr(target, attr).update(value)
    elif isinstance(value, list):
        del getattr(target, attr)[:]
        getattr(target, attr).extend(value)
    else:
        setattr(target, attr, value)
    return True


def _set(path: str, value: Any, bad: bool | None) -> Mutation:
    """Returns a mutation setting a dotted field to a value."""

    def apply(ev: pb.ShardEvent, _data: st.DataObject) -> tuple[str, bool | None] | None:
        return (path, bad) if _put(ev, path, value) else None

    return apply


def _drawn(path: str, values: st.SearchStrategy[Any]) -> Mutation:
    """Returns a mutation setting a field to a drawn value whose validity is not known."""

    def apply(ev: pb.ShardEvent, data: st.DataObject) -> tuple[str, bool | None] | None:
        return (path, None) if _put(ev, path, data.draw(values)) else None

    return apply


def _map(path: str, entries: int, value: Any, bad: bool) -> Mutation:
    """Returns a mutation filling a map field with entries."""

    def apply(ev: pb.ShardEvent, _data: st.DataObject) -> tuple[str, bool | None] | None:
        found = _target(ev, path)
        if found is None:
            return None
        target = getattr(found[0], found[1])
        target.clear()
        for i in range(entries):
            target[f"k{i}"] = value
        return path, bad

    return apply


def _no_payload(ev: pb.ShardEvent, _data: st.DataObject) -> tuple[str, bool | None] | None:
    kind = ev.WhichOneof("payload")
    if kind:
        ev.ClearField(kind)
    return "payload", True


W = 7 * 24 * 3600
MUTATIONS: list[Mutation] = [
    # identifiers: empty, 128 (fits), 129, bad first character, bad characters, NUL
    _set("event_id", "", True),
    _set("event_id", "a" * 129, True),
    _set("event_id", "-leading-dash", True),
    _set("event_id", "with space", True),
    _set("event_id", "nul\x00inside", True),
    _set("event_id", "é", True),
    _set("run_id", "r" * 129, True),
    _set("run_id", ".", True),
    _set("shard_id", "", True),
    _set("shard_id", "s" * 129, True),
    _set("shard_id", "\U0010ffff", True),
    _set("namespace", "UPPER", True),
    _set("namespace", "n" * 64, True),
    _set("namespace", "-lead", True),
    _set("namespace", "n" * 63, False),
    _set("client_time", Timestamp(seconds=-1), True),
    _set("client_time", Timestamp(seconds=253_402_300_799, nanos=999_999_999), False),
    _set("client_time", Timestamp(seconds=253_402_300_800), True),  # the year 10000
    _set("client_time", Timestamp(seconds=INT64[1]), True),  # reads of the run failed UNKNOWN
    # planned
    _set("planned.input_ref", "", True),
    _set("planned.input_ref", "/" + "p" * 4095, False),
    _set("planned.input_ref", "/" + "p" * 4096, True),
    _set("planned.input_ref", "/a\x00b", True),
    _set("planned.input_bytes", -1, True),
    _set("planned.input_bytes", INT64[1], False),
    _set("planned.input_blake3", "A" * 64, True),
    _set("planned.input_blake3", "a" * 63, True),
    _set("planned.params_json", "[]", True),
    _set("planned.params_json", "{", True),
    _set("planned.params_json", '{"a":NaN}', True),
    _set("planned.params_json", '{"a":1e400}', True),
    _set("planned.params_json", '{"x":"' + "y" * 70_000 + '"}', True),  # over 64 KiB
    _set("planned.params_json", "[" * 100_000 + "]" * 100_000, True),
    _set("planned.plan_line", "not json", True),
    _set("planned.params_json", '{"a":"\\ud800"}', True),  # a lone surrogate: no UTF-8 form
    _set("planned.plan_line", '{"a":"\\udc00"}', True),
    _set("planned.params_json", '{"a":"\\ud83d\\ude00"}', False),  # a pair is one character
    _set("planned.plan_line", '{"line":"\\u0000"}', False),
    _set("planned.plan_index", -1, True),
    _drawn("planned.plan_index", int64s),
    # started
    _set("started.host", "h" * 255, False),
    _set("started.host", "h" * 256, True),
    _set("started.pid", -1, True),
    _set("started.heartbeat_timeout", Duration(), True),
    _set("started.heartbeat_timeout", Duration(seconds=W, nanos=1000), True),
    _map("started.fingerprint", 256, "v", False),
    _map("started.fingerprint", 257, "v", True),
    _map("started.fingerprint", 1, "v" * 1025, True),
    _map("started.fingerprint", 1, "nul\x00", True),
    _set("started.fingerprint_digest", "z" * 64, True),
    # heartbeat
    _set("heartbeat.step", -1, True),
    _set("heartbeat.progress", math.nan, True),
    _set("heartbeat.progress", math.inf, True),
    _set("heartbeat.progress", 1.0000001, True),
    _set("heartbeat.progress", 1.0, False),
    _map("heartbeat.metrics", 257, 1.0, True),
    _map("heartbeat.metrics", 1, math.nan, True),
    _map("heartbeat.metrics", 1, -math.inf, True),
    _map("heartbeat.metrics", 256, 1e308, False),
    _drawn("heartbeat.step", int64s),
    # checkpoint and artifacts
    _set("checkpoint.path", "", True),
    _set("checkpoint.path", "c" * 4097, True),
    _set("checkpoint.size_bytes", -1, True),
    _set("checkpoint.blake3_hex", "", True),
    _set("artifact_committed.name", "", True),
    _set("artifact_committed.name", "n" * 129, True),
    _set("artifact_committed.path", "/" + "x" * 4096, True),
    _set("artifact_committed.media_type", "m" * 256, True),
    _set("verified.result", 0, True),
    _set("verified.detail", "d" * 8193, True),
    _set("failed.tag", 0, True),
    _set("failed.tag", 999, True),
    _set("failed.tag", -1, True),
    _set("failed.message", "m" * 8193, True),
    # run-level events
    _set("submission_closed.reason", "r" * 1025, True),
    _set("run_reopened.reason", "r" * 1024, False),
    _set("run_reopened.reason", "r" * 1025, True),
    _set("run_reopened.reason", "nul\x00", True),
    _no_payload,
]


def _values(fd: Any) -> st.SearchStrategy[Any]:
    """Returns boundary values for one field of any type the contract uses."""
    if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
        key, value = (_values(f) for f in fd.message_type.fields)
        return st.one_of(
            st.dictionaries(key, value, max_size=4),
            st.dictionaries(key, value, min_size=250, max_size=260),
        )
    if fd.is_repeated:
        element = _scalar_values(fd)
        return st.one_of(
            st.lists(element, max_size=4), st.lists(element, min_size=255, max_size=258)
        )
    return _scalar_values(fd)


def _scalar_values(fd: Any) -> st.SearchStrategy[Any]:
    if fd.message_type is not None:
        if fd.message_type.name == "Timestamp":
            return timestamps()
        if fd.message_type.name == "Duration":
            return durations()
        # Any other message (SchedulerIdentity, InputSeen): each field at its boundaries.
        classes = {"SchedulerIdentity": pb.SchedulerIdentity, "InputSeen": pb.InputSeen}
        cls = classes.get(fd.message_type.name)
        assert cls is not None, f"no fuzz values for message {fd.message_type.name}"
        inner = {f.name: _scalar_values(f) for f in fd.message_type.fields}
        return st.builds(lambda values: cls(**values), st.fixed_dictionaries({}, optional=inner))
    return {
        FieldDescriptor.TYPE_STRING: boundary_text,
        FieldDescriptor.TYPE_INT64: int64s,
        FieldDescriptor.TYPE_INT32: int32s,
        FieldDescriptor.TYPE_UINT32: st.sampled_from([0, 1, 2, 3, 2**32 - 1]),
        FieldDescriptor.TYPE_UINT64: st.sampled_from([0, 1, 2**53 - 1, 2**53 + 1, 2**64 - 1]),
        FieldDescriptor.TYPE_DOUBLE: floats,
        FieldDescriptor.TYPE_ENUM: enum_numbers,
        FieldDescriptor.TYPE_BYTES: st.binary(max_size=64),
        FieldDescriptor.TYPE_BOOL: st.booleans(),
    }[fd.type]


def _every_field() -> list[tuple[str, Any]]:
    """Returns the dotted path and descriptor of every field of ShardEvent and its payloads."""
    paths: list[tuple[str, Any]] = []
    envelope: list[Any] = list(pb.ShardEvent.DESCRIPTOR.fields)
    for fd in envelope:
        if fd.name in KINDS:
            paths += [(f"{fd.name}.{inner.name}", inner) for inner in fd.message_type.fields]
        else:
            paths.append((fd.name, fd))
    return paths


# Each field once more with values drawn at its boundaries (validity unknown: no verdict).
MUTATIONS += [_drawn(path, _values(fd)) for path, fd in _every_field()]


def _base_event(kind: str, data: st.DataObject) -> pb.ShardEvent:
    """Returns a field-valid event of a kind; only planned ones on new shards always append."""
    shard = data.draw(st.sampled_from([uuid.uuid4().hex, LIVE_SHARD, "s0"]))
    ev = pb.ShardEvent(
        event_id=uuid.uuid4().hex, run_id=SEED_RUN, shard_id=shard, attempt_id=LIVE_ATTEMPT
    )
    if kind == "planned":
        ev.attempt_id = ""
        ev.shard_id = uuid.uuid4().hex
        ev.planned.CopyFrom(
            pb.ShardPlanned(
                input_ref="/in/x", input_bytes=1, input_blake3=DIGEST_A, expected_outputs=["out"]
            )
        )
    elif kind == "started":
        ev.attempt_id = uuid.uuid4().hex
        ev.started.CopyFrom(
            pb.AttemptStarted(host="n", pid=1, heartbeat_timeout=Duration(seconds=60))
        )
    elif kind == "heartbeat":
        ev.heartbeat.CopyFrom(pb.Heartbeat(step=1, progress=0.5, metrics={"loss": 0.1}))
    elif kind == "checkpoint":
        ev.checkpoint.CopyFrom(
            pb.CheckpointSaved(step=1, path="/ck", size_bytes=1, blake3_hex=DIGEST_B)
        )
    elif kind == "artifact_committed":
        ev.artifact_committed.CopyFrom(
            pb.ArtifactCommitted(name="out", path="/o", size_bytes=1, blake3_hex=DIGEST_A)
        )
    elif kind == "verified":
        ev.verified.CopyFrom(
            pb.ArtifactVerified(
                name="out", path="/o", blake3_hex=DIGEST_A, result=pb.VERIFICATION_RESULT_PASSED
            )
        )
    elif kind == "submission_closed":
        # A run-level event: no shard, no attempt.
        ev.shard_id = ev.attempt_id = ""
        ev.submission_closed.CopyFrom(pb.RunSubmissionClosed(reason="x", expected_shards=1))
    elif kind == "run_reopened":
        # Run-level too; refused (RUN_NOT_CLOSED) unless a close of the run stands.
        ev.shard_id = ev.attempt_id = ""
        ev.run_reopened.CopyFrom(pb.RunReopened(reason="x"))
    else:
        ev.failed.CopyFrom(pb.AttemptFailed(tag=pb.FAILURE_TAG_OOM, message="x"))
    return ev


@st.composite
def shard_events(draw: st.DrawFn) -> tuple[pb.ShardEvent, bool]:
    """Returns an event and whether a mutation known to make it invalid was applied."""
    data = draw(st.data())
    ev = _base_event(draw(st.sampled_from(KINDS)), data)
    verdicts: dict[str, bool | None] = {}
    for mutation in draw(st.lists(st.sampled_from(MUTATIONS), max_size=3)):
        changed = mutation(ev, data)
        if changed is not None:
            verdicts[changed[0]] = changed[1]  # a later change of the same field wins
    if ev.WhichOneof("payload") in ("submission_closed", "run_reopened"):
        # A run-level event is the one kind whose shard id must be empty: any id is invalid.
        verdicts.pop("attempt_id", None)
        verdicts["shard_id"] = bool(ev.shard_id or ev.attempt_id) or None
    return ev, any(v is True for v in verdicts.values())


# --- raw bytes: random, and valid requests with a few bytes changed ----------------------


def _valid_request(method: str) -> bytes:
    fields: dict[str, Any] = {"run_id": SEED_RUN}
    if method == "AppendEvents":
        return pb.AppendEventsRequest(events=[planned(SEED_RUN, "raw")]).SerializeToString()
    if method == "StreamAppendEvents":
        events = [planned(SEED_RUN, "raw-stream")]
        return pb.StreamAppendEventsRequest(batch_id=1, events=events).SerializeToString()
    if method in ("ListRuns", "GetPublicKey"):
        fields = {}
    if method == "GetInclusionProof":
        fields["event_id"] = "e" * 32
    if method == "TailEvents":
        fields["run_id"] = "no-such-run"  # a live tail would only wait for new events
    if method == "CompareRuns":
        fields = {"run_ids": [SEED_RUN], "label": "provider"}
    cls: type[Message] = getattr(pb, f"{method}Request")
    return cls(**fields).SerializeToString()


@st.composite
def mutated(draw: st.DrawFn, valid: bytes) -> bytes:
    """Returns the valid bytes with a slice replaced by random bytes."""
    if not valid:
        return draw(st.binary(min_size=1, max_size=32))
    start = draw(st.integers(0, len(valid)))
    end = draw(st.integers(start, min(len(valid), start + 8)))
    return valid[:start] + draw(st.binary(max_size=8)) + valid[end:]


def wire_bytes(method: str) -> st.SearchStrategy[list[bytes]]:
    """Returns lists of payloads: random bytes, structured-looking bytes, and mutations."""
    valid = _valid_request(method)
    one = st.one_of(
        st.binary(max_size=64),
        st.binary(min_size=256, max_size=2048),
        mutated(valid),
        # A string field (tag 1 or 2, wire type 2) whose bytes are not UTF-8.
        st.binary(min_size=1, max_size=16).map(lambda b: b"\x12" + bytes([len(b)]) + b),
        st.just(b"\x0a\xff\xff\xff\xff\x0f"),  # a length far past the end
        st.just(b"\x08" + b"\xff" * 11),  # a varint too long
    )
    return st.lists(one, min_size=1, max_size=6)


# --- the tests ---------------------------------------------------------------------------


def test_campaign_quotas_add_up_to_ten_thousand_requests() -> None:
    assert sum(QUOTAS.values()) >= 10_000


@pytest.mark.parametrize("method", sorted(METHODS))
def test_random_bytes_to_every_method_get_a_clean_refusal_or_answer(
    campaign: Campaign, method: str
) -> None:
    quota = max(1, WANT["raw_bytes"] // len(METHODS))
    before = campaign.requests
    started_at = time.monotonic()

    @settings(max_examples=quota // 3 + 20, **FAST)  # type: ignore[arg-type]
    @given(wire_bytes(method))
    def run(payloads: list[bytes]) -> None:
        for payload in payloads:
            campaign.call(method, payload)

    run()
    while time.monotonic() - started_at < SHARE_S:
        run()
    # Top up to the quota deterministically if the lists came out short.
    payload = bytes(range(256))
    while campaign.requests - before < quota:
        campaign.call(method, payload[: campaign.requests % 256])
    assert campaign.requests - before >= quota
    _assert_still_serving(campaign)


def test_append_batches_mixing_valid_and_invalid_events(campaign: Campaign) -> None:
    before = campaign.requests
    with _quota(campaign, "append_batches"):
        # Three requests per example: the batch, then its first two events alone.
        @settings(max_examples=WANT["append_batches"] // 3 + 50, **FAST)  # type: ignore[arg-type]
        @given(st.lists(shard_events(), min_size=2, max_size=5))
        def run(batch: list[tuple[pb.ShardEvent, bool]]) -> None:
            events = [ev for ev, _ in batch]
            code, _ = campaign.call("AppendEvents", pb.AppendEventsRequest(events=events))
            if any(bad for _, bad in batch):
                assert code == grpc.StatusCode.INVALID_ARGUMENT
            for ev, bad in batch[:2]:
                code, _ = campaign.call("AppendEvents", pb.AppendEventsRequest(events=[ev]))
                if bad:
                    assert code == grpc.StatusCode.INVALID_ARGUMENT

        _run_to_quota(campaign, "append_batches", before, run)


@st.composite
def read_fields(draw: st.DrawFn) -> dict[str, Any]:
    """Returns the fields read requests share, at their boundaries."""
    run_id = draw(st.one_of(st.just(SEED_RUN), valid_ids, boundary_text))
    return {
        "namespace": draw(st.one_of(st.just(""), st.just("default"), boundary_text)),
        "run_id": run_id,
        "int64": draw(int64s),
        "int64b": draw(int64s),
        "int32": draw(int32s),
        "token": draw(page_tokens),
        "text": draw(st.one_of(boundary_text, st.sampled_from(["planned", "stale", "missing"]))),
        "event_id": draw(st.one_of(valid_ids, boundary_text)),
    }


def _read_requests(f: dict[str, Any]) -> list[tuple[str, Message]]:
    ns, run = f["namespace"], f["run_id"]
    # The seeded run's tail is asked from its start, so its first event comes at once.
    tail_after = min(f["int64"], 1) if run == SEED_RUN else f["int64"]
    return [
        (
            "ListEvents",
            pb.ListEventsRequest(
                namespace=ns,
                run_id=run,
                after_sequence=f["int64"],
                page_size=f["int32"],
                page_token=f["token"],
            ),
        ),
        ("TailEvents", pb.TailEventsRequest(namespace=ns, run_id=run, after_sequence=tail_after)),
        ("ListRuns", pb.ListRunsRequest(namespace=ns, page_size=f["int32"])),
        ("GetRunSummary", pb.GetRunSummaryRequest(namespace=ns, run_id=run)),
        (
            "ListShards",
            pb.ListShardsRequest(
                namespace=ns,
                run_id=run,
                state=f["text"],
                page_size=f["int32"],
                page_token=f["token"],
            ),
        ),
        ("StreamResumeList", pb.StreamResumeListRequest(namespace=ns, run_id=run)),
        ("GetTreeHead", pb.GetTreeHeadRequest(namespace=ns, run_id=run, tree_size=f["int64"])),
        (
            "GetInclusionProof",
            pb.GetInclusionProofRequest(
                namespace=ns, run_id=run, event_id=f["event_id"], tree_size=f["int64b"]
            ),
        ),
        (
            "GetConsistencyProof",
            pb.GetConsistencyProofRequest(
                namespace=ns, run_id=run, old_size=f["int64"], new_size=f["int64b"]
            ),
        ),
        ("GetPublicKey", pb.GetPublicKeyRequest()),
    ]


def test_read_requests_with_boundary_values(campaign: Campaign) -> None:
    before = campaign.requests
    with _quota(campaign, "reads"):

        @settings(max_examples=WANT["reads"] // 10 + 10, **FAST)  # type: ignore[arg-type]
        @given(read_fields())
        def run(fields: dict[str, Any]) -> None:
            for method, request in _read_requests(fields):
                campaign.call(method, request)

        _run_to_quota(campaign, "reads", before, run)


header_values = st.one_of(
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=80),
    st.builds(
        lambda tid, secret: f"Bearer slt_{tid}_{secret}",
        st.text(alphabet="0123456789abcdef", min_size=16, max_size=16),
        st.text(
            alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-",
            min_size=43,
            max_size=43,
        ),
    ),
    st.sampled_from(["", "Bearer", "Bearer ", "bearer slt_", "Basic dXNlcjpwYXNz", "Bearer  x"]),
)


def test_random_authorization_headers_are_refused_and_write_nothing(campaign: Campaign) -> None:
    before = campaign.requests
    with _quota(campaign, "auth_headers"):

        @settings(max_examples=WANT["auth_headers"] // 2 + 10, **FAST)  # type: ignore[arg-type]
        @given(header_values)
        def run(value: str) -> None:
            md = (("authorization", value),)
            for method, request in (
                ("ListRuns", pb.ListRunsRequest()),
                ("AppendEvents", pb.AppendEventsRequest(events=[planned(SEED_RUN, "h")])),
            ):
                code, _ = campaign.call(method, request, channel=campaign.plain, metadata=md)
                assert code == grpc.StatusCode.UNAUTHENTICATED

        _run_to_quota(campaign, "auth_headers", before, run)


def test_campaign_never_answered_unknown_or_internal(campaign: Campaign) -> None:
    # Every call already asserted this; the tally shows what the campaign exercised.
    assert campaign.requests > 0
    assert not set(campaign.codes) & {c.name for c in FORBIDDEN_CODES}
    print(f"fuzz campaign: {campaign.requests} requests, codes {dict(campaign.codes)}")


# --- what the campaign found, pinned as examples ---------------------------------------------

FORGED_TOKENS: Final = {
    "huge_int": _b64(str(2**64).encode()),
    "infinity": _b64(b"1e400"),
    "deep_nesting": _b64(b"[" * 50_000 + b"]" * 50_000),
    "pair_with_infinity": _b64(b'[1e400,"x"]'),
    "pair_with_huge_int": _b64(json.dumps([2**64, "x"]).encode()),
    # The shard id of a ListShards token goes to the store: PostgreSQL text cannot hold NUL.
    "pair_with_nul": _b64(json.dumps([1, "a\u0000b"]).encode()),
    "pair_with_lone_surrogate": _b64(b'[1,"\\ud800"]'),
    "pair_with_a_number_for_id": _b64(b"[1,2]"),
}


@pytest.mark.parametrize("method", ["ListEvents", "ListShards"])
@pytest.mark.parametrize("token", sorted(FORGED_TOKENS))
def test_forged_page_token_is_invalid_argument_naming_the_field(
    campaign: Campaign, method: str, token: str
) -> None:
    cls: type[Message] = getattr(pb, f"{method}Request")
    request = cls(run_id=SEED_RUN, page_token=FORGED_TOKENS[token])
    with pytest.raises(grpc.RpcError) as refused:
        getattr(pb_grpc.LedgerServiceStub(campaign.admin), method)(request, timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (refused.value.details() or "").startswith("page_token:")


NOT_A_MESSAGE: Final = b"\x0a\xff\xff\xff\xff\x0f"  # field 1's length runs past the end


@pytest.mark.parametrize("method", sorted(METHODS))
def test_bytes_that_are_not_a_message_get_malformed_request(
    campaign: Campaign, method: str
) -> None:
    path = f"/{SERVICE.full_name}/{method}"
    raw: dict[str, Any] = {"request_serializer": None, "response_deserializer": None}
    with pytest.raises(grpc.RpcError) as refused:
        if METHODS[method].client_streaming:
            list(campaign.admin.stream_stream(path, **raw)(iter([NOT_A_MESSAGE]), timeout=10))
        elif METHODS[method].server_streaming:
            list(campaign.admin.unary_stream(path, **raw)(NOT_A_MESSAGE, timeout=10))
        else:
            campaign.admin.unary_unary(path, **raw)(NOT_A_MESSAGE, timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(refused.value)  # type: ignore[arg-type]
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert (info.reason, info.metadata["field"]) == ("MALFORMED_REQUEST", "request")


def test_bytes_that_are_not_a_message_without_a_token_are_unauthenticated(
    campaign: Campaign,
) -> None:
    # Authentication comes first: an anonymous caller learns nothing about the parser.
    code, _ = campaign.call("ListRuns", NOT_A_MESSAGE, channel=campaign.plain)
    assert code == grpc.StatusCode.UNAUTHENTICATED


# --- the nightly atheris harness, briefly, in CI ------------------------------------------


def test_atheris_harness_target_survives_mutated_seeds(tmp_path: Path) -> None:
    from tools.campaign.fuzz_atheris import make_target, seed_inputs

    target = make_target(str(tmp_path))
    seeds = seed_inputs()
    for seed in seeds:
        target(seed)

    @settings(max_examples=300, **FAST)  # type: ignore[arg-type]
    @given(st.sampled_from(seeds).flatmap(mutated) | st.binary(max_size=128))
    def run(data: bytes) -> None:
        target(data)  # raises on anything but a LedgerError or unparsable bytes

    run()


def test_atheris_harness_without_atheris_says_how_to_install_and_exits_2() -> None:
    # Runs the module as `python -m tools.campaign.fuzz_atheris` would, with atheris made unimportable.
    code = (
        "import runpy, sys; sys.modules['atheris'] = None; "
        "runpy.run_module('tools.campaign.fuzz_atheris', run_name='__main__')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "-atheris_runs=1"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 2
    assert "pip install atheris" in done.stderr
