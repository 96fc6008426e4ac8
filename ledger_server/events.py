"""Domain events: the frozen event types a client submits and the server records.

Pure: no grpc, protobuf or SQL here. Validation lives in validation.py, the
canonical row bytes and the hash chain in chain.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Final, NamedTuple

from shard_client.canonical import canonical_json

DEFAULT_NAMESPACE: Final = "default"
VERIFY_RESULTS: Final = ("passed", "failed")
# What an object-storage commit read back before it was recorded ("" for a local file).
READ_BACKS: Final = ("", "size_etag", "digest")


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
    # Object-storage inputs only: evidence of which object was planned, not part of the
    # definition (a re-plan after the store re-reported an ETag is the same plan).
    input_version_id: str = ""
    input_etag: str = ""

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
    # Scheduler identity (kind, job_id, array_job_id, array_task_id, cluster, node,
    # namespace; only the set ones) and the process start time in clock ticks since boot.
    scheduler: dict[str, str] = field(default_factory=dict)
    process_start_ticks: int = 0


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """An attempt is alive."""

    KIND: ClassVar[str] = "heartbeat"
    step: int
    progress: float
    metrics: dict[str, float]
    # Metrics that were NaN or infinite at this step, by name (left out of metrics).
    nonfinite_metrics: tuple[str, ...] = ()


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
    # Object-storage artifacts only (path is a URL): what the store said of the upload.
    version_id: str = ""
    etag: str = ""
    read_back: str = ""


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
    version_id: str = ""


@dataclass(frozen=True, slots=True)
class AttemptFailed:
    """An attempt failed."""

    KIND: ClassVar[str] = "failed"
    tag: str
    message: str
    diagnostics_path: str = ""
    diagnostics_blake3_hex: str = ""


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


# Fields added after the first contract version: left out of the canonical JSON when
# unset (empty or zero), so older rows and events keep their bytes.
_LATER_FIELDS: Final[dict[type[Any], tuple[str, ...]]] = {
    AttemptStarted: ("scheduler", "process_start_ticks"),
    Heartbeat: ("nonfinite_metrics",),
    AttemptFailed: ("diagnostics_path", "diagnostics_blake3_hex"),
    ShardPlanned: ("input_version_id", "input_etag"),
    ArtifactCommitted: ("version_id", "etag", "read_back"),
    ArtifactVerified: ("version_id",),
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
            "payload": payload_dict(self.payload),
        }

    def content_json(self) -> str:
        """Returns the canonical JSON of the client-supplied content."""
        return canonical_json(self.content())


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


def payload_dict(payload: Payload) -> dict[str, Any]:
    """Returns the payload's fields as a JSON-ready dict (fields added later only when set)."""
    # Fields are JSON-ready already (str, int, float, flat dicts, a tuple that encodes as a
    # list), so a shallow read is enough; dataclasses.asdict would deep-copy every value.
    out = {name: getattr(payload, name) for name in _FIELD_NAMES[type(payload)]}
    for name in _LATER_FIELDS.get(type(payload), ()):
        if not out[name]:
            # A row written before the field existed encodes without it; so does every
            # event that leaves it unset, and their canonical bytes stay what they were.
            del out[name]
    return out
