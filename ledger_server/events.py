"""Domain events: frozen types, field validation and the canonical row bytes.

Pure: no grpc, protobuf or SQL here. The canonical bytes of a row are what the
hash chain and the Merkle tree commit to, so their encoding never changes
within a contract version.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Final, NamedTuple

import blake3

from ledger_server.errors import InvalidEvent, LimitExceeded

DEFAULT_NAMESPACE: Final = "default"
GENESIS_HASH: Final = bytes(32)
FAILURE_TAGS: Final = (
    "oom",
    "timeout",
    "killed",
    "preempted",
    "nccl",
    "data",
    "incomplete",
    "unknown",
)
VERIFY_RESULTS: Final = ("passed", "failed")

# Limits a client can rely on (documented in docs/limits.md).
MAX_ID_CHARS: Final = 128
MAX_PATH_CHARS: Final = 4096
MAX_TEXT_CHARS: Final = 8192
MAX_EXPECTED_OUTPUTS: Final = 256
MAX_MAP_ENTRIES: Final = 256
MAX_PAYLOAD_BYTES: Final = 64 * 1024
MAX_HEARTBEAT_TIMEOUT_US: Final = 7 * 24 * 3600 * 1_000_000

# The last microsecond a protobuf Timestamp may hold: 9999-12-31T23:59:59.999999Z.
MAX_TIMESTAMP_US: Final = 253_402_300_799_999_999
_ID_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+=/-]*")
_NAMESPACE_RE: Final = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
_HEX64_RE: Final = re.compile(r"[0-9a-f]{64}")


# Built once: json.dumps with options builds a new encoder per call, which costs more
# than encoding an event. check_circular=False: every value encoded here is a tree.
_CANONICAL: Final = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False, check_circular=False
)


def _fast_encoder() -> Callable[[Any], str] | None:
    """Returns CPython's C encoder with the canonical options, built once, if it is there.

    JSONEncoder.encode builds this object on every call; building it once halves the
    cost of encoding an event. It is used only if it encodes a probe exactly as the
    public encoder does.
    """
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return None
    try:
        c_encode = make(
            None,
            _CANONICAL.default,
            json.encoder.encode_basestring,
            None,
            ":",
            ",",
            True,
            False,
            False,
        )

        def encode(value: Any) -> str:
            return "".join(c_encode(value, 0))

        probe = {"b": [1, 2.5, None, True], "a": {"é": 'x\n"y'}, "c": -1e300}
        return encode if encode(probe) == _CANONICAL.encode(probe) else None
    except TypeError:  # a different C signature: the public encoder serves instead
        return None


_ENCODE: Final = _fast_encoder() or _CANONICAL.encode


def canonical_json(value: Any) -> str:
    """Returns the one JSON text of a value: sorted keys, no spaces, UTF-8 kept."""
    return _ENCODE(value)


@dataclass(frozen=True, slots=True)
class ShardPlanned:
    """The shard's definition was registered."""

    KIND: ClassVar[str] = "planned"
    input_ref: str
    input_bytes: int
    input_blake3: str
    params_json: str
    expected_outputs: tuple[str, ...]
    plan_line: str
    plan_index: int

    def definition(self) -> dict[str, Any]:
        """Returns what makes two plans of one shard the same plan."""
        return {
            "input_ref": self.input_ref,
            "input_bytes": self.input_bytes,
            "input_blake3": self.input_blake3,
            "params_json": self.params_json,
            "expected_outputs": list(self.expected_outputs),
        }


@dataclass(frozen=True, slots=True)
class AttemptStarted:
    """An attempt at the shard started."""

    KIND: ClassVar[str] = "started"
    host: str
    pid: int
    heartbeat_timeout_us: int
    fingerprint: dict[str, str]
    fingerprint_digest: str


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """An attempt is alive."""

    KIND: ClassVar[str] = "heartbeat"
    step: int
    progress: float
    metrics: dict[str, float]


@dataclass(frozen=True, slots=True)
class CheckpointSaved:
    """An attempt saved a checkpoint atomically."""

    KIND: ClassVar[str] = "checkpoint"
    step: int
    path: str
    size_bytes: int
    blake3_hex: str


@dataclass(frozen=True, slots=True)
class ArtifactCommitted:
    """An attempt committed an artifact atomically."""

    KIND: ClassVar[str] = "artifact_committed"
    name: str
    path: str
    size_bytes: int
    blake3_hex: str
    media_type: str


@dataclass(frozen=True, slots=True)
class ArtifactVerified:
    """A verifier re-read a committed artifact."""

    KIND: ClassVar[str] = "verified"
    name: str
    path: str
    blake3_hex: str
    result: str
    reason: str
    detail: str


@dataclass(frozen=True, slots=True)
class AttemptFailed:
    """An attempt failed."""

    KIND: ClassVar[str] = "failed"
    tag: str
    message: str


Payload = (
    ShardPlanned
    | AttemptStarted
    | Heartbeat
    | CheckpointSaved
    | ArtifactCommitted
    | ArtifactVerified
    | AttemptFailed
)
PAYLOAD_TYPES: Final[dict[str, type[Any]]] = {
    cls.KIND: cls
    for cls in (
        ShardPlanned,
        AttemptStarted,
        Heartbeat,
        CheckpointSaved,
        ArtifactCommitted,
        ArtifactVerified,
        AttemptFailed,
    )
}


_FIELD_NAMES: Final[dict[type[Any], tuple[str, ...]]] = {
    cls: tuple(f.name for f in fields(cls)) for cls in PAYLOAD_TYPES.values()
}


@dataclass(frozen=True, slots=True)
class Event:
    """An event as a client submits it."""

    event_id: str
    namespace: str
    run_id: str
    shard_id: str
    attempt_id: str
    client_time_us: int
    payload: Payload
    # The canonical JSON of content(), computed once by validate(); not part of identity.
    canonical: str = field(default="", compare=False, repr=False)

    @property
    def kind(self) -> str:
        """Returns the payload kind, e.g. "planned"."""
        return self.payload.KIND

    def content(self) -> dict[str, Any]:
        """Returns the client-supplied content as a JSON-ready dict."""
        return {
            "event_id": self.event_id,
            "namespace": self.namespace,
            "run_id": self.run_id,
            "shard_id": self.shard_id,
            "attempt_id": self.attempt_id,
            "client_time_us": self.client_time_us,
            "kind": self.kind,
            "payload": _payload_dict(self.payload),
        }

    def content_json(self) -> str:
        """Returns the canonical JSON of the client-supplied content."""
        return self.canonical or canonical_json(self.content())


class RecordedEvent(NamedTuple):
    """An event as stored: the client content plus the server-assigned fields.

    A tuple rather than a frozen dataclass: the writer builds one per appended event
    and a replay one per stored event, and a tuple is built in a third of the time.
    """

    event: Event
    sequence: int
    run_sequence: int
    receive_time_us: int
    row_hash: bytes

    def row_bytes(self) -> bytes:
        """Returns the canonical bytes the chain and the Merkle tree commit to."""
        return row_bytes(
            self.event, run_sequence=self.run_sequence, receive_time_us=self.receive_time_us
        )


def row_bytes(event: Event, *, run_sequence: int, receive_time_us: int) -> bytes:
    """Returns the canonical row bytes; the global sequence is left out so runs stay portable.

    The row is the canonical JSON of {"event": content, "receive_time_us": .., "run_sequence": ..};
    its keys sort in that order, so the event's own canonical JSON is spliced in unchanged
    instead of being encoded a second time.
    """
    return (
        f'{{"event":{event.content_json()},"receive_time_us":{int(receive_time_us)},'
        f'"run_sequence":{int(run_sequence)}}}'
    ).encode()


def chain_hash(prev_hash: bytes, row: bytes) -> bytes:
    """Returns blake3(prev_hash || row)."""
    return blake3.blake3(prev_hash + row).digest()


_RAW_DECODE: Final = json.JSONDecoder().raw_decode


def parse_row(row: bytes) -> Any:
    """Parses a stored row's canonical JSON into plain dicts and lists."""
    # json.loads(bytes) sniffs the encoding and strips whitespace with regexes on every call;
    # a row is UTF-8 with no whitespace around it, so the scanner is called directly. Any
    # text after the value is refused, as json.loads would.
    text = row.decode("utf-8")
    value, end = _RAW_DECODE(text)
    if end != len(text):
        raise ValueError(f"extra data after the row's JSON value at {end}")
    return value


def event_from_row(row: bytes) -> tuple[Event, int, int]:
    """Parses canonical row bytes back into (event, run_sequence, receive_time_us)."""
    return event_from_parsed(parse_row(row))


def event_from_parsed(outer: Any) -> tuple[Event, int, int]:
    """Builds (event, run_sequence, receive_time_us) from a row parse_row() returned."""
    data = outer["event"]
    kind = data["kind"]
    payload_data = dict(data["payload"])
    if kind == "planned":
        payload_data["expected_outputs"] = tuple(payload_data["expected_outputs"])
    payload = PAYLOAD_TYPES[kind](**payload_data)
    event = Event(
        event_id=data["event_id"],
        namespace=data["namespace"],
        run_id=data["run_id"],
        shard_id=data["shard_id"],
        attempt_id=data["attempt_id"],
        client_time_us=data["client_time_us"],
        payload=payload,
    )
    return event, outer["run_sequence"], outer["receive_time_us"]


def _payload_dict(payload: Payload) -> dict[str, Any]:
    # Fields are JSON-ready already (str, int, float, flat dicts, a tuple that encodes as a
    # list), so a shallow read is enough; dataclasses.asdict would deep-copy every value.
    return {name: getattr(payload, name) for name in _FIELD_NAMES[type(payload)]}


# --- validation -------------------------------------------------------------


def check_id(field_name: str, value: str, *, required: bool = True) -> None:
    """Raises InvalidEvent unless value is a well-formed identifier."""
    if not value:
        if required:
            raise InvalidEvent(field_name, "must not be empty")
        return
    if len(value) > MAX_ID_CHARS:
        raise InvalidEvent(field_name, f"longer than {MAX_ID_CHARS} characters")
    if not _ID_RE.fullmatch(value):
        raise InvalidEvent(
            field_name,
            "must start with a letter or digit and use only letters, digits and ._:@+=/-",
        )


def check_namespace(value: str) -> str:
    """Returns the namespace, defaulted, or raises InvalidEvent."""
    namespace = value or DEFAULT_NAMESPACE
    if not _NAMESPACE_RE.fullmatch(namespace):
        raise InvalidEvent("namespace", "must be 1-63 lowercase letters, digits or '-'")
    return namespace


def check_digest(field_name: str, value: str, *, required: bool = True) -> None:
    """Raises InvalidEvent unless value is 64 lowercase hex characters."""
    if not value and not required:
        return
    if not _HEX64_RE.fullmatch(value):
        raise InvalidEvent(field_name, "must be a blake3 digest: 64 lowercase hex characters")


def _check_text(field_name: str, value: str, limit: int, *, required: bool = False) -> None:
    if required and not value:
        raise InvalidEvent(field_name, "must not be empty")
    if len(value) > limit:
        raise InvalidEvent(field_name, f"longer than {limit} characters")
    if "\x00" in value:
        raise InvalidEvent(field_name, "must not contain NUL characters")


def _check_size(field_name: str, value: int) -> None:
    if value < 0:
        raise InvalidEvent(field_name, "must not be negative")


def _check_json_object(field_name: str, text: str) -> str:
    if not text:
        return "{}"
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InvalidEvent(field_name, f"is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidEvent(field_name, "must be a JSON object")
    try:
        text = canonical_json(value)
        # A JSON escape may name a lone surrogate ("\\ud800"): valid JSON, but no UTF-8
        # text can carry it, and the row must be stored as UTF-8.
        text.encode("utf-8")
    except ValueError as exc:  # UnicodeEncodeError is a ValueError
        raise InvalidEvent(field_name, f"is not canonicalizable: {exc}") from None
    return text


def normalize_plan(p: ShardPlanned) -> ShardPlanned:
    """Returns the plan with canonical JSON fields, or raises InvalidEvent."""
    _check_text("planned.input_ref", p.input_ref, MAX_PATH_CHARS, required=True)
    _check_size("planned.input_bytes", p.input_bytes)
    check_digest("planned.input_blake3", p.input_blake3, required=False)
    _check_size("planned.plan_index", p.plan_index)
    if len(p.expected_outputs) > MAX_EXPECTED_OUTPUTS:
        raise InvalidEvent("planned.expected_outputs", f"more than {MAX_EXPECTED_OUTPUTS} names")
    for name in p.expected_outputs:
        check_id("planned.expected_outputs", name)
    if len(set(p.expected_outputs)) != len(p.expected_outputs):
        raise InvalidEvent("planned.expected_outputs", "names must be unique")
    _check_text("planned.plan_line", p.plan_line, MAX_PAYLOAD_BYTES)
    return ShardPlanned(
        input_ref=p.input_ref,
        input_bytes=p.input_bytes,
        input_blake3=p.input_blake3,
        params_json=_check_json_object("planned.params_json", p.params_json),
        expected_outputs=tuple(p.expected_outputs),
        plan_line=_check_json_object("planned.plan_line", p.plan_line) if p.plan_line else "",
        plan_index=p.plan_index,
    )


def _check_payload(event: Event) -> Payload:
    p = event.payload
    if isinstance(p, ShardPlanned):
        if event.attempt_id:
            raise InvalidEvent("attempt_id", "must be empty for a planned event")
        return normalize_plan(p)
    if isinstance(p, ArtifactVerified):
        check_id("attempt_id", event.attempt_id, required=False)
    else:
        check_id("attempt_id", event.attempt_id)
    if isinstance(p, AttemptStarted):
        _check_text("started.host", p.host, 255)
        _check_size("started.pid", p.pid)
        if not 0 < p.heartbeat_timeout_us <= MAX_HEARTBEAT_TIMEOUT_US:
            raise InvalidEvent("started.heartbeat_timeout", "must be > 0 and at most 7 days")
        if len(p.fingerprint) > MAX_MAP_ENTRIES:
            raise InvalidEvent("started.fingerprint", f"more than {MAX_MAP_ENTRIES} entries")
        for key, value in p.fingerprint.items():
            _check_text("started.fingerprint", key, 256, required=True)
            _check_text("started.fingerprint", value, 1024)
        check_digest("started.fingerprint_digest", p.fingerprint_digest, required=False)
    elif isinstance(p, Heartbeat):
        _check_size("heartbeat.step", p.step)
        if not (math.isfinite(p.progress) and 0.0 <= p.progress <= 1.0):
            raise InvalidEvent("heartbeat.progress", "must be a number in [0, 1]")
        if len(p.metrics) > MAX_MAP_ENTRIES:
            raise InvalidEvent("heartbeat.metrics", f"more than {MAX_MAP_ENTRIES} entries")
        for metric, number in p.metrics.items():
            _check_text("heartbeat.metrics", metric, 256, required=True)
            if not math.isfinite(number):
                raise InvalidEvent("heartbeat.metrics", f"{metric!r} must be finite")
    elif isinstance(p, CheckpointSaved):
        _check_size("checkpoint.step", p.step)
        _check_text("checkpoint.path", p.path, MAX_PATH_CHARS, required=True)
        _check_size("checkpoint.size_bytes", p.size_bytes)
        check_digest("checkpoint.blake3_hex", p.blake3_hex)
    elif isinstance(p, ArtifactCommitted):
        check_id("artifact_committed.name", p.name)
        _check_text("artifact_committed.path", p.path, MAX_PATH_CHARS, required=True)
        _check_size("artifact_committed.size_bytes", p.size_bytes)
        check_digest("artifact_committed.blake3_hex", p.blake3_hex)
        _check_text("artifact_committed.media_type", p.media_type, 255)
    elif isinstance(p, ArtifactVerified):
        check_id("verified.name", p.name)
        _check_text("verified.path", p.path, MAX_PATH_CHARS, required=True)
        check_digest("verified.blake3_hex", p.blake3_hex)
        if p.result not in VERIFY_RESULTS:
            raise InvalidEvent("verified.result", "must be PASSED or FAILED")
        _check_text("verified.reason", p.reason, 255, required=p.result == "failed")
        _check_text("verified.detail", p.detail, MAX_TEXT_CHARS)
    elif isinstance(p, AttemptFailed):
        if p.tag not in FAILURE_TAGS:
            raise InvalidEvent("failed.tag", "must be one of " + ", ".join(FAILURE_TAGS))
        _check_text("failed.message", p.message, MAX_TEXT_CHARS)
    return p


def validate(event: Event) -> Event:
    """Returns the event with defaults and canonical JSON applied, or raises InvalidEvent."""
    check_id("event_id", event.event_id)
    namespace = check_namespace(event.namespace)
    check_id("run_id", event.run_id)
    check_id("shard_id", event.shard_id)
    if event.client_time_us < 0:
        raise InvalidEvent("client_time", "must not be before 1970")
    if event.client_time_us > MAX_TIMESTAMP_US:
        # Beyond it a Timestamp cannot carry the value back: every read of the run would fail.
        raise InvalidEvent("client_time", "must be before the year 10000")
    payload = _check_payload(event)
    # Only a plan or a namespace is ever normalized; every other event is encoded as sent.
    content = event.content()
    if namespace != event.namespace:
        content["namespace"] = namespace
    if payload is not event.payload:
        content["payload"] = _payload_dict(payload)
    try:
        text = canonical_json(content)
    except (TypeError, ValueError) as exc:
        raise InvalidEvent("payload", f"is not representable: {exc}") from None
    try:
        size = len(text) if text.isascii() else len(text.encode())
    except UnicodeEncodeError as exc:  # a lone surrogate from a caller that is not protobuf
        raise InvalidEvent("payload", f"is not UTF-8 text: {exc.reason}") from None
    if size > MAX_PAYLOAD_BYTES:
        raise LimitExceeded("event_bytes", size, MAX_PAYLOAD_BYTES)
    if namespace == event.namespace and payload is event.payload:
        # canonical is a cache of content_json (compare=False), so filling it in on the
        # event just decoded changes no value; it spares building the event a second time.
        object.__setattr__(event, "canonical", text)
        return event
    return Event(
        event.event_id,
        namespace,
        event.run_id,
        event.shard_id,
        event.attempt_id,
        event.client_time_us,
        payload,
        text,
    )
