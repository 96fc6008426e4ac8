# Over 450 lines on purpose: every limit a client can rely on beside the check that enforces it, and the heartbeat fast path that must agree with them.
"""Event validation: the limits a client can rely on and the checks that enforce them.

Pure: no grpc, protobuf or SQL. validate() hands back the canonical JSON it had
to compute anyway (to measure the event), so the writer never encodes an event
twice.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from typing import Final, NamedTuple

from ledger_server.beat_json import heartbeat_jcs
from ledger_server.errors import FingerprintDigestMismatch, InvalidEvent, LimitExceeded
from ledger_server.events import (
    DEFAULT_NAMESPACE,
    INPUT_SEEN_FIELDS,
    READ_BACKS,
    ROW_FORMAT,
    ROW_FORMAT_LEGACY,
    VERIFY_RESULTS,
    ArtifactCommitted,
    ArtifactVerified,
    AttemptFailed,
    AttemptStarted,
    CheckpointSaved,
    Event,
    Heartbeat,
    Payload,
    RunReopened,
    ShardPlanned,
    SubmissionClosed,
    content_jcs,
    payload_dict,
)
from ledger_server.ranks import RANK_PLACEHOLDER
from shard_client.canonical import canonical_json, fingerprint_digest, legacy_json
from shard_client.labels import label_problem
from shard_client.vocabulary import FAILURE_TAGS, SCHEDULER_FIELDS

# Limits a client can rely on (documented in docs/limits.md).
MAX_ID_CHARS: Final = 128
MAX_PATH_CHARS: Final = 4096
MAX_TEXT_CHARS: Final = 8192
MAX_EXPECTED_OUTPUTS: Final = 256
MAX_MAP_ENTRIES: Final = 256
MAX_PAYLOAD_BYTES: Final = 64 * 1024
MAX_HEARTBEAT_TIMEOUT_US: Final = 7 * 24 * 3600 * 1_000_000
MAX_WORLD_SIZE: Final = 65_536
# The GPUs one process may say it holds (AttemptStarted.gpu_count).
MAX_GPU_COUNT: Final = 4096
# The most shards a close may announce: the run summary carries the count as int32
# (RunLifecycle.expected_shards), so a larger one would make every summary unreadable.
MAX_EXPECTED_SHARDS: Final = 2**31 - 1

# The last microsecond a protobuf Timestamp may hold: 9999-12-31T23:59:59.999999Z.
MAX_TIMESTAMP_US: Final = 253_402_300_799_999_999
# A Timestamp's or Duration's nanos are a fraction of its second: more would be folded
# into the seconds as the event is decoded, and it would be kept other than it was sent.
MAX_NANOS: Final = 999_999_999
_ID_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+=/-]*")
_NAMESPACE_RE: Final = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
_HEX64_RE: Final = re.compile(r"[0-9a-f]{64}")


class ValidEvent(NamedTuple):
    """An event that passed validate(), in normal form, with its canonical content JSON.

    A tuple: the writer gets one per appended event. `canonical` is
    `event.content_json()`, computed once.
    """

    event: Event
    canonical: str


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


def check_nanos(field_name: str, nanos: int, *, duration: bool = False) -> None:
    """Raises InvalidEvent unless nanos is a Timestamp's (or a Duration's) fraction of a second."""
    low = -MAX_NANOS if duration else 0
    if not low <= nanos <= MAX_NANOS:
        raise InvalidEvent(field_name, f"nanos must be in [{low}, {MAX_NANOS}]")


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


def _check_coalesced(p: Heartbeat) -> None:
    """Checks what a coalesced heartbeat says about its interval."""
    if p.progress_calls < 1:
        raise InvalidEvent(
            "heartbeat.progress_calls", "must be >= 1 when first_step or metric extremes are set"
        )
    if not 0 <= p.first_step <= p.step:
        raise InvalidEvent("heartbeat.first_step", "must be in [0, step]")
    for field_name, extremes in (("metrics_min", p.metrics_min), ("metrics_max", p.metrics_max)):
        if len(extremes) > MAX_MAP_ENTRIES:
            raise InvalidEvent(f"heartbeat.{field_name}", f"more than {MAX_MAP_ENTRIES} entries")
        for metric, number in extremes.items():
            _check_text(f"heartbeat.{field_name}", metric, 256, required=True)
            if not math.isfinite(number):
                raise InvalidEvent(f"heartbeat.{field_name}", f"{metric!r} must be finite")
    for metric, low in p.metrics_min.items():
        high = p.metrics_max.get(metric)
        if high is not None and low > high:
            raise InvalidEvent("heartbeat.metrics_min", f"{metric!r} is above its maximum")


def _check_json_object(field_name: str, text: str, row_format: int = ROW_FORMAT) -> str:
    if not text:
        return "{}"
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InvalidEvent(field_name, f"is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidEvent(field_name, "must be a JSON object")
    try:
        # RFC 8785 refuses an integer past +-(2**53 - 1) (a JCS number is an IEEE double,
        # so another language would read another number): send it as a string.
        encode = legacy_json if row_format == ROW_FORMAT_LEGACY else canonical_json
        text = encode(value)
        # A JSON escape may name a lone surrogate ("\\ud800"): valid JSON, but no UTF-8
        # text can carry it, and the row must be stored as UTF-8.
        text.encode("utf-8")
    except RecursionError:
        raise InvalidEvent(field_name, "is nested too deeply") from None
    except ValueError as exc:  # UnicodeEncodeError is a ValueError
        raise InvalidEvent(field_name, f"is not canonicalizable: {exc}") from None
    return text


def normalize_plan(p: ShardPlanned, row_format: int = ROW_FORMAT) -> ShardPlanned:
    """Returns the plan with canonical JSON fields, or raises InvalidEvent."""
    _check_text("planned.input_ref", p.input_ref, MAX_PATH_CHARS, required=True)
    _check_size("planned.input_bytes", p.input_bytes)
    check_digest("planned.input_blake3", p.input_blake3, required=False)
    _check_size("planned.plan_index", p.plan_index)
    if len(p.expected_outputs) > MAX_EXPECTED_OUTPUTS:
        raise InvalidEvent("planned.expected_outputs", f"more than {MAX_EXPECTED_OUTPUTS} names")
    for name in p.expected_outputs:
        check_id("planned.expected_outputs", name.replace(RANK_PLACEHOLDER, "0"))
    if len(set(p.expected_outputs)) != len(p.expected_outputs):
        raise InvalidEvent("planned.expected_outputs", "names must be unique")
    _check_text("planned.plan_line", p.plan_line, MAX_PAYLOAD_BYTES)
    _check_labels("planned.labels", p.labels)
    _check_text("planned.input_version_id", p.input_version_id, 1024)
    _check_text("planned.input_etag", p.input_etag, 1024)
    _check_size("planned.input_mtime_ns", p.input_mtime_ns)
    return ShardPlanned(
        input_ref=p.input_ref,
        input_bytes=p.input_bytes,
        input_blake3=p.input_blake3,
        params_json=_check_json_object("planned.params_json", p.params_json, row_format),
        expected_outputs=tuple(p.expected_outputs),
        plan_line=(
            _check_json_object("planned.plan_line", p.plan_line, row_format) if p.plan_line else ""
        ),
        plan_index=p.plan_index,
        labels=p.labels,
        input_version_id=p.input_version_id,
        input_etag=p.input_etag,
        input_mtime_ns=p.input_mtime_ns,
        input_inode=p.input_inode,
        input_device=p.input_device,
        input_revision=p.input_revision,
    )


def check_label_key(key: str) -> None:
    """Raises InvalidEvent (field ``label``) unless ``key`` is a label key."""
    problem = label_problem({key: ""})
    if problem:
        raise InvalidEvent("label", problem)


def _check_labels(field_name: str, labels: dict[str, str]) -> None:
    problem = label_problem(labels)
    if problem:
        raise InvalidEvent(field_name, problem)


def _check_payload(event: Event, row_format: int) -> Payload:
    p = event.payload
    if isinstance(p, SubmissionClosed):
        # A run-level event: it is about no shard and no attempt.
        if event.shard_id or event.attempt_id:
            raise InvalidEvent("shard_id", "must be empty (with attempt_id) for submission_closed")
        _check_text("submission_closed.reason", p.reason, 1024)
        if not 0 <= p.expected_shards <= MAX_EXPECTED_SHARDS:
            raise InvalidEvent(
                "submission_closed.expected_shards", f"must be between 0 and {MAX_EXPECTED_SHARDS}"
            )
        if not 0 <= p.submitted_until_us <= MAX_TIMESTAMP_US:
            raise InvalidEvent(
                "submission_closed.submitted_until", "must be between 1970 and the year 10000"
            )
        return p
    if isinstance(p, RunReopened):
        # Run-level, as a close: whether the run is closed is the writer's to check.
        if event.shard_id or event.attempt_id:
            raise InvalidEvent("shard_id", "must be empty (with attempt_id) for run_reopened")
        _check_text("run_reopened.reason", p.reason, 1024)
        return p
    check_id("shard_id", event.shard_id)
    if isinstance(p, ShardPlanned):
        if event.attempt_id:
            raise InvalidEvent("attempt_id", "must be empty for a planned event")
        return normalize_plan(p, row_format)
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
        for key, value in p.scheduler.items():
            if key not in SCHEDULER_FIELDS:
                raise InvalidEvent("started.scheduler", f"unknown field {key!r}")
            _check_text(f"started.scheduler.{key}", value, 255)
        if p.scheduler and not p.scheduler.get("kind"):
            raise InvalidEvent("started.scheduler.kind", "must name the scheduler")
        _check_size("started.process_start_ticks", p.process_start_ticks)
        _check_labels("started.labels", p.labels)
        _check_ranks(p)
        _check_input_seen(p)
        if row_format != ROW_FORMAT_LEGACY:
            return _own_digest(p)
    elif isinstance(p, Heartbeat):
        _check_size("heartbeat.step", p.step)
        if not (math.isfinite(p.progress) and 0.0 <= p.progress <= 1.0):
            raise InvalidEvent("heartbeat.progress", "must be a number in [0, 1]")
        if len(p.metrics) > MAX_MAP_ENTRIES:
            raise InvalidEvent("heartbeat.metrics", f"more than {MAX_MAP_ENTRIES} entries")
        for metric, number in p.metrics.items():
            _check_text("heartbeat.metrics", metric, 256, required=True)
            if not math.isfinite(number):
                raise InvalidEvent(
                    "heartbeat.metrics",
                    f"{metric!r} must be finite (name it in nonfinite_metrics instead)",
                )
        if len(p.nonfinite_metrics) > MAX_MAP_ENTRIES:
            raise InvalidEvent("heartbeat.nonfinite_metrics", f"more than {MAX_MAP_ENTRIES}")
        for metric in p.nonfinite_metrics:
            _check_text("heartbeat.nonfinite_metrics", metric, 256, required=True)
        _check_rank("heartbeat.rank", p.rank)
        if p.progress_calls or p.first_step or p.metrics_min or p.metrics_max:
            _check_coalesced(p)
    elif isinstance(p, CheckpointSaved):
        _check_size("checkpoint.step", p.step)
        _check_text("checkpoint.path", p.path, MAX_PATH_CHARS, required=True)
        _check_size("checkpoint.size_bytes", p.size_bytes)
        check_digest("checkpoint.blake3_hex", p.blake3_hex)
        _check_size("checkpoint.write_duration", p.write_us)
        _check_rank("checkpoint.rank", p.rank)
        if not 0 <= p.world_size <= MAX_WORLD_SIZE:
            raise InvalidEvent("checkpoint.world_size", f"must be in [0, {MAX_WORLD_SIZE}]")
        if p.rank and p.rank >= p.world_size:
            raise InvalidEvent("checkpoint.rank", "must be < checkpoint.world_size")
    elif isinstance(p, ArtifactCommitted):
        check_id("artifact_committed.name", p.name)
        _check_text("artifact_committed.path", p.path, MAX_PATH_CHARS, required=True)
        _check_size("artifact_committed.size_bytes", p.size_bytes)
        check_digest("artifact_committed.blake3_hex", p.blake3_hex)
        _check_text("artifact_committed.media_type", p.media_type, 255)
        _check_rank("artifact_committed.rank", p.rank)
        _check_text("artifact_committed.version_id", p.version_id, 1024)
        _check_text("artifact_committed.etag", p.etag, 1024)
        if p.read_back not in READ_BACKS:
            raise InvalidEvent("artifact_committed.read_back", "must be empty, size_etag or digest")
    elif isinstance(p, ArtifactVerified):
        check_id("verified.name", p.name)
        _check_text("verified.path", p.path, MAX_PATH_CHARS, required=True)
        check_digest("verified.blake3_hex", p.blake3_hex)
        if p.result not in VERIFY_RESULTS:
            raise InvalidEvent("verified.result", "must be PASSED or FAILED")
        _check_text("verified.reason", p.reason, 255, required=p.result == "failed")
        _check_text("verified.detail", p.detail, MAX_TEXT_CHARS)
        _check_text("verified.version_id", p.version_id, 1024)
    elif isinstance(p, AttemptFailed):
        if p.tag not in FAILURE_TAGS:
            raise InvalidEvent("failed.tag", "must be one of " + ", ".join(FAILURE_TAGS))
        _check_text("failed.message", p.message, MAX_TEXT_CHARS)
        _check_text("failed.diagnostics_path", p.diagnostics_path, MAX_PATH_CHARS)
        check_digest(
            "failed.diagnostics_blake3_hex",
            p.diagnostics_blake3_hex,
            required=bool(p.diagnostics_path),
        )
        if p.diagnostics_blake3_hex and not p.diagnostics_path:
            raise InvalidEvent("failed.diagnostics_path", "must be set with its digest")
        _check_rank("failed.rank", p.rank)
    return p


def _check_rank(field_name: str, rank: int) -> None:
    # Whether the rank belongs to its attempt is the life cycle's question (projections).
    if not 0 <= rank < MAX_WORLD_SIZE:
        raise InvalidEvent(field_name, f"must be in [0, {MAX_WORLD_SIZE})")


def _check_input_seen(p: AttemptStarted) -> None:
    """Raises InvalidEvent unless the started event's input (if any) is one input's identity."""
    if not p.input_ref:
        if any(getattr(p, name) for name in INPUT_SEEN_FIELDS):
            raise InvalidEvent("started.input.input_ref", "must name the input it describes")
        return
    _check_text("started.input.input_ref", p.input_ref, MAX_PATH_CHARS)
    _check_size("started.input.size_bytes", p.input_bytes)
    _check_size("started.input.mtime_ns", p.input_mtime_ns)
    _check_text("started.input.version_id", p.input_version_id, 1024)
    _check_text("started.input.etag", p.input_etag, 1024)
    check_digest("started.input.blake3_hex", p.input_blake3, required=False)


def _check_ranks(p: AttemptStarted) -> None:
    """Raises InvalidEvent unless the started event's rank fields describe one rank of a launch."""
    if not 0 <= p.world_size <= MAX_WORLD_SIZE:
        raise InvalidEvent("started.world_size", f"must be in [0, {MAX_WORLD_SIZE}]")
    if not 0 <= p.rank < max(p.world_size, 1):
        raise InvalidEvent("started.rank", "must be in [0, started.world_size)")
    if not 0 <= p.local_rank < max(p.world_size, 1):
        raise InvalidEvent("started.local_rank", "must be in [0, started.world_size)")
    _check_text("started.launch_id", p.launch_id, 255)
    _check_size("started.restart_count", p.restart_count)
    if not 0 <= p.gpu_count <= MAX_GPU_COUNT:
        raise InvalidEvent("started.gpu_count", f"must be in [0, {MAX_GPU_COUNT}]")


def _own_digest(p: AttemptStarted) -> AttemptStarted:
    """Returns the started payload with the digest the server computes from its fingerprint.

    A fingerprint map's digest is the server's: absent, it is filled in; sent, it must be
    the map's (or the digest older SDKs computed, non-ASCII escaped, which a spool may still
    hold), else FINGERPRINT_DIGEST_MISMATCH. Without a map there is nothing to compute
    from, and a digest sent alone is kept as the client's group key.
    """
    if not p.fingerprint:
        return p
    digest = fingerprint_digest(p.fingerprint)
    if p.fingerprint_digest == digest:
        return p
    if p.fingerprint_digest and p.fingerprint_digest != fingerprint_digest(
        p.fingerprint, legacy=True
    ):
        raise FingerprintDigestMismatch(p.fingerprint_digest, digest)
    return replace(p, fingerprint_digest=digest)


def validate(event: Event, *, row_format: int = ROW_FORMAT) -> ValidEvent:
    """Returns the event with defaults applied and its canonical JSON, or raises InvalidEvent.

    `row_format` is the format the event is stored in: new events are validated for
    ROW_FORMAT; an imported row of format 1 by the rules its server applied (its JSON
    fields in Python's encoding, its fingerprint digest as the client sent it).
    """
    check_id("event_id", event.event_id)
    namespace = check_namespace(event.namespace)
    check_id("run_id", event.run_id)
    if event.client_time_us < 0:
        raise InvalidEvent("client_time", "must not be before 1970")
    if event.client_time_us > MAX_TIMESTAMP_US:
        # Beyond it a Timestamp cannot carry the value back: every read of the run would fail.
        raise InvalidEvent("client_time", "must be before the year 10000")
    payload = _check_payload(event, row_format)
    if payload is event.payload and row_format != ROW_FORMAT_LEGACY:
        # Most events are heartbeats, encoded as sent: their text is written directly, and
        # it is ASCII (heartbeat_jcs leaves any other to the generic path), one byte a char.
        beat = heartbeat_jcs(event, namespace)
        if beat is not None:
            if len(beat) > MAX_PAYLOAD_BYTES:
                raise LimitExceeded("event_bytes", len(beat), MAX_PAYLOAD_BYTES)
            if namespace != event.namespace:
                event = _in_namespace(event, namespace)
            return ValidEvent(event, beat)
    # Only a plan or a namespace is ever normalized; every other event is encoded as sent.
    content = event.content()
    if namespace != event.namespace:
        content["namespace"] = namespace
    if payload is not event.payload:
        content["payload"] = payload_dict(payload)
    try:
        text = legacy_json(content) if row_format == ROW_FORMAT_LEGACY else content_jcs(content)
    except UnicodeEncodeError as exc:  # a lone surrogate from a caller that is not protobuf
        raise InvalidEvent("payload", f"is not UTF-8 text: {exc.reason}") from None
    except (TypeError, ValueError) as exc:
        raise InvalidEvent("payload", f"is not representable: {exc}") from None
    try:
        size = len(text) if text.isascii() else len(text.encode())
    except UnicodeEncodeError as exc:  # a lone surrogate from a caller that is not protobuf
        raise InvalidEvent("payload", f"is not UTF-8 text: {exc.reason}") from None
    if size > MAX_PAYLOAD_BYTES:
        raise LimitExceeded("event_bytes", size, MAX_PAYLOAD_BYTES)
    if namespace == event.namespace and payload is event.payload:
        return ValidEvent(event, text)
    return ValidEvent(_in_namespace(event, namespace, payload), text)


def _in_namespace(event: Event, namespace: str, payload: Payload | None = None) -> Event:
    """Returns the event in its checked namespace (and normalized payload); faster than replace()."""
    return Event(
        event.event_id,
        namespace,
        event.run_id,
        event.shard_id,
        event.attempt_id,
        event.client_time_us,
        event.payload if payload is None else payload,
    )
