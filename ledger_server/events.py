"""Domain events: the frozen event types a client submits and the server records.

Pure: no grpc, protobuf or SQL here. Validation lives in validation.py, the
canonical row bytes and the hash chain in chain.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Final, NamedTuple

from ledger_server import formats
from shard_client.canonical import MAX_SAFE_INTEGER, canonical_json, legacy_json

DEFAULT_NAMESPACE: Final = "default"
VERIFY_RESULTS: Final = ("passed", "failed")
# What an object-storage commit read back before it was recorded ("" for a local file).
READ_BACKS: Final = ("", "size_etag", "digest")

# The row formats (docs/contract.md): 1 is Python's json (rows written before RFC 8785 was
# adopted, which keep their bytes), 2 is RFC 8785 with a "v":2 key in the row. New rows
# are written in ROW_FORMAT.
ROW_FORMAT_LEGACY: Final = 1
ROW_FORMAT: Final = formats.ROW_FORMAT
ROW_FORMATS: Final = (ROW_FORMAT_LEGACY, ROW_FORMAT)


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
    # The run's labels (provider, pool, region, image, ...): where its shards were meant
    # to run. Not part of the definition: they describe the run, not what a shard computes.
    labels: dict[str, str] = field(default_factory=dict)
    # Object-storage inputs only: evidence of which object was planned, not part of the
    # definition (a re-plan after the store re-reported an ETag is the same plan).
    input_version_id: str = ""
    input_etag: str = ""
    # Local inputs only: the file's identity when planned (st_mtime_ns, st_ino, st_dev),
    # evidence as above: a job that finds another identity re-hashes before it judges.
    input_mtime_ns: int = 0
    input_inode: int = 0
    input_device: int = 0
    # The event revises the input of a shard already planned (`plan --refresh-inputs`).
    input_revision: bool = False

    def definition(self) -> dict[str, Any]:
        """Returns what makes two plans of one shard the same plan."""
        return {
            "input_ref": self.input_ref,
            # Past 2**53 a JCS number cannot hold it: a decimal string, as rows hold it.
            "input_bytes": safe_int(self.input_bytes),
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
    # Where the attempt ran (provider, pool, region, image, ...), for `report --by`.
    labels: dict[str, str] = field(default_factory=dict)
    # A multi-rank attempt (world_size > 1): each rank of one launch starts it once.
    rank: int = 0
    world_size: int = 0
    local_rank: int = 0
    launch_id: str = ""
    restart_count: int = 0
    # GPUs this process held (0: unknown; the field figures count one).
    gpu_count: int = 0
    # What the job saw of its input at start (the proto's InputSeen, flattened; unset
    # when the job named no input): the ledger compares it with the plan (inputs.py).
    input_ref: str = ""
    input_bytes: int = 0
    input_mtime_ns: int = 0
    input_inode: int = 0
    input_device: int = 0
    input_version_id: str = ""
    input_etag: str = ""
    input_blake3: str = ""


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """An attempt is alive."""

    KIND: ClassVar[str] = "heartbeat"
    step: int
    progress: float
    metrics: dict[str, float]
    # Metrics that were NaN or infinite at this step, by name (left out of metrics).
    nonfinite_metrics: tuple[str, ...] = ()
    rank: int = 0
    # The rank left its block cleanly; its silence from now on is no hang.
    rank_finished: bool = False
    # A heartbeat the SDK coalesced from several progress() calls also says what the
    # interval held: its first step, each metric's extremes, and how many calls.
    first_step: int = 0
    metrics_min: dict[str, float] = field(default_factory=dict)
    metrics_max: dict[str, float] = field(default_factory=dict)
    progress_calls: int = 0


@dataclass(frozen=True, slots=True)
class CheckpointSaved:
    """An attempt saved a checkpoint atomically."""

    KIND: ClassVar[str] = "checkpoint"
    step: int
    path: str
    size_bytes: int
    blake3_hex: str
    # How long the atomic write took, in microseconds (0: not measured).
    write_us: int = 0
    # A sharded checkpoint: this file is the part of `rank`, one of `world_size` parts.
    rank: int = 0
    world_size: int = 0


@dataclass(frozen=True, slots=True)
class ArtifactCommitted:
    """An attempt committed an artifact atomically."""

    KIND: ClassVar[str] = "artifact_committed"
    name: str
    path: str
    size_bytes: int
    blake3_hex: str
    media_type: str
    rank: int = 0
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
    rank: int = 0


@dataclass(frozen=True, slots=True)
class SubmissionClosed:
    """The planner declared the run's submission complete (a run-level event: no shard)."""

    KIND: ClassVar[str] = "submission_closed"
    reason: str = ""
    # How many shards the planner submitted; 0 when it did not say.
    expected_shards: int = 0
    # Closed from this server time on (microseconds); 0: when the event is received.
    submitted_until_us: int = 0


@dataclass(frozen=True, slots=True)
class RunReopened:
    """The planner undid the run's submission close to add shards (a run-level event: no shard)."""

    KIND: ClassVar[str] = "run_reopened"
    reason: str = ""


Payload = (
    ShardPlanned
    | AttemptStarted
    | Heartbeat
    | CheckpointSaved
    | ArtifactCommitted
    | ArtifactVerified
    | AttemptFailed
    | SubmissionClosed
    | RunReopened
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
        SubmissionClosed,
        RunReopened,
    )
}


# The started event's view of its input (the proto's AttemptStarted.input, flattened).
INPUT_SEEN_FIELDS: Final = (
    "input_ref",
    "input_bytes",
    "input_mtime_ns",
    "input_inode",
    "input_device",
    "input_version_id",
    "input_etag",
    "input_blake3",
)

# Fields added after the first contract version: left out of the canonical JSON when
# unset (empty or zero), so older rows and events keep their bytes.
_LATER_FIELDS: Final[dict[type[Any], tuple[str, ...]]] = {
    ShardPlanned: (
        "labels",
        "input_version_id",
        "input_etag",
        "input_mtime_ns",
        "input_inode",
        "input_device",
        "input_revision",
    ),
    AttemptStarted: (
        "scheduler",
        "process_start_ticks",
        "labels",
        "rank",
        "world_size",
        "local_rank",
        "launch_id",
        "restart_count",
        "gpu_count",
        *INPUT_SEEN_FIELDS,
    ),
    Heartbeat: (
        "nonfinite_metrics",
        "rank",
        "rank_finished",
        "first_step",
        "metrics_min",
        "metrics_max",
        "progress_calls",
    ),
    CheckpointSaved: ("write_us", "rank", "world_size"),
    ArtifactCommitted: ("rank", "version_id", "etag", "read_back"),
    ArtifactVerified: ("version_id",),
    AttemptFailed: ("diagnostics_path", "diagnostics_blake3_hex", "rank"),
    SubmissionClosed: ("reason", "expected_shards", "submitted_until_us"),
    # As a close's: an empty reason leaves the payload empty ({}).
    RunReopened: ("reason",),
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

    def content_json(self, row_format: int = ROW_FORMAT) -> str:
        """Returns the canonical JSON of the client-supplied content in a row format."""
        if row_format == ROW_FORMAT_LEGACY:
            return legacy_json(self.content())
        return content_jcs(self.content())


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
    # The format of the stored row (ROW_FORMATS): which encoding its bytes re-derive with.
    row_format: int = ROW_FORMAT


def safe_int(value: int) -> int | str:
    """Returns an integer as row format 2 holds it: a decimal string beyond +-(2**53 - 1)."""
    return value if -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER else str(value)


def content_jcs(content: dict[str, Any]) -> str:
    """Returns the RFC 8785 text of an event's content (row format 2).

    Integers beyond +-(2**53 - 1) (a JCS number is an IEEE double) are written as
    decimal strings, as the protobuf JSON mapping writes int64; they can only sit
    at the content's top level or in its payload, whose schema says they are ints.
    """
    try:
        return canonical_json(content)
    except ValueError:
        fixed = _big_ints_as_strings(content)
        if fixed is content:
            raise  # NaN, infinity or a lone surrogate: not an integer's doing
        return canonical_json(fixed)


def _big_ints_as_strings(content: dict[str, Any]) -> dict[str, Any]:
    def fix(level: dict[str, Any]) -> dict[str, Any]:
        changed = {
            k: str(v)
            for k, v in level.items()
            if type(v) is int and not -MAX_SAFE_INTEGER <= v <= MAX_SAFE_INTEGER
        }
        return {**level, **changed} if changed else level

    top = fix(content)
    payload = content.get("payload")
    if isinstance(payload, dict):
        fixed = fix(payload)
        if fixed is not payload:
            top = {**top, "payload": fixed}
    return top


def int_fields(cls: type[Any]) -> tuple[str, ...]:
    """Returns the names of a payload type's integer fields."""
    return tuple(f.name for f in fields(cls) if f.type in ("int", int))


def float_fields(cls: type[Any]) -> tuple[str, ...]:
    """Returns the names of a payload type's float fields."""
    return tuple(f.name for f in fields(cls) if f.type in ("float", float))


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
