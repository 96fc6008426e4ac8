import datetime

from google.protobuf import any_pb2 as _any_pb2
from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerificationResult(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERIFICATION_RESULT_UNSPECIFIED: _ClassVar[VerificationResult]
    VERIFICATION_RESULT_PASSED: _ClassVar[VerificationResult]
    VERIFICATION_RESULT_FAILED: _ClassVar[VerificationResult]

class FailureTag(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_TAG_UNSPECIFIED: _ClassVar[FailureTag]
    FAILURE_TAG_OOM: _ClassVar[FailureTag]
    FAILURE_TAG_TIMEOUT: _ClassVar[FailureTag]
    FAILURE_TAG_KILLED: _ClassVar[FailureTag]
    FAILURE_TAG_PREEMPTED: _ClassVar[FailureTag]
    FAILURE_TAG_NCCL: _ClassVar[FailureTag]
    FAILURE_TAG_DATA: _ClassVar[FailureTag]
    FAILURE_TAG_INCOMPLETE: _ClassVar[FailureTag]
    FAILURE_TAG_UNKNOWN: _ClassVar[FailureTag]
    FAILURE_TAG_INPUT_CHANGED: _ClassVar[FailureTag]

class AppendOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    APPEND_OUTCOME_UNSPECIFIED: _ClassVar[AppendOutcome]
    APPEND_OUTCOME_APPENDED: _ClassVar[AppendOutcome]
    APPEND_OUTCOME_DUPLICATE: _ClassVar[AppendOutcome]
    APPEND_OUTCOME_ALREADY_PLANNED: _ClassVar[AppendOutcome]
VERIFICATION_RESULT_UNSPECIFIED: VerificationResult
VERIFICATION_RESULT_PASSED: VerificationResult
VERIFICATION_RESULT_FAILED: VerificationResult
FAILURE_TAG_UNSPECIFIED: FailureTag
FAILURE_TAG_OOM: FailureTag
FAILURE_TAG_TIMEOUT: FailureTag
FAILURE_TAG_KILLED: FailureTag
FAILURE_TAG_PREEMPTED: FailureTag
FAILURE_TAG_NCCL: FailureTag
FAILURE_TAG_DATA: FailureTag
FAILURE_TAG_INCOMPLETE: FailureTag
FAILURE_TAG_UNKNOWN: FailureTag
FAILURE_TAG_INPUT_CHANGED: FailureTag
APPEND_OUTCOME_UNSPECIFIED: AppendOutcome
APPEND_OUTCOME_APPENDED: AppendOutcome
APPEND_OUTCOME_DUPLICATE: AppendOutcome
APPEND_OUTCOME_ALREADY_PLANNED: AppendOutcome

class ShardEvent(_message.Message):
    __slots__ = ("event_id", "namespace", "run_id", "shard_id", "attempt_id", "client_time", "planned", "started", "heartbeat", "checkpoint", "artifact_committed", "verified", "failed", "submission_closed", "run_reopened", "sequence", "run_sequence", "receive_time", "row_hash", "row_format")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_TIME_FIELD_NUMBER: _ClassVar[int]
    PLANNED_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    SUBMISSION_CLOSED_FIELD_NUMBER: _ClassVar[int]
    RUN_REOPENED_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    RUN_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_TIME_FIELD_NUMBER: _ClassVar[int]
    ROW_HASH_FIELD_NUMBER: _ClassVar[int]
    ROW_FORMAT_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    namespace: str
    run_id: str
    shard_id: str
    attempt_id: str
    client_time: _timestamp_pb2.Timestamp
    planned: ShardPlanned
    started: AttemptStarted
    heartbeat: Heartbeat
    checkpoint: CheckpointSaved
    artifact_committed: ArtifactCommitted
    verified: ArtifactVerified
    failed: AttemptFailed
    submission_closed: RunSubmissionClosed
    run_reopened: RunReopened
    sequence: int
    run_sequence: int
    receive_time: _timestamp_pb2.Timestamp
    row_hash: bytes
    row_format: int
    def __init__(self, event_id: _Optional[str] = ..., namespace: _Optional[str] = ..., run_id: _Optional[str] = ..., shard_id: _Optional[str] = ..., attempt_id: _Optional[str] = ..., client_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., planned: _Optional[_Union[ShardPlanned, _Mapping]] = ..., started: _Optional[_Union[AttemptStarted, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., checkpoint: _Optional[_Union[CheckpointSaved, _Mapping]] = ..., artifact_committed: _Optional[_Union[ArtifactCommitted, _Mapping]] = ..., verified: _Optional[_Union[ArtifactVerified, _Mapping]] = ..., failed: _Optional[_Union[AttemptFailed, _Mapping]] = ..., submission_closed: _Optional[_Union[RunSubmissionClosed, _Mapping]] = ..., run_reopened: _Optional[_Union[RunReopened, _Mapping]] = ..., sequence: _Optional[int] = ..., run_sequence: _Optional[int] = ..., receive_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., row_hash: _Optional[bytes] = ..., row_format: _Optional[int] = ...) -> None: ...

class ShardPlanned(_message.Message):
    __slots__ = ("input_ref", "input_bytes", "input_blake3", "params_json", "expected_outputs", "plan_line", "plan_index", "labels", "input_version_id", "input_etag", "input_mtime_ns", "input_inode", "input_device", "input_revision")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    INPUT_REF_FIELD_NUMBER: _ClassVar[int]
    INPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    INPUT_BLAKE3_FIELD_NUMBER: _ClassVar[int]
    PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PLAN_LINE_FIELD_NUMBER: _ClassVar[int]
    PLAN_INDEX_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    INPUT_VERSION_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_ETAG_FIELD_NUMBER: _ClassVar[int]
    INPUT_MTIME_NS_FIELD_NUMBER: _ClassVar[int]
    INPUT_INODE_FIELD_NUMBER: _ClassVar[int]
    INPUT_DEVICE_FIELD_NUMBER: _ClassVar[int]
    INPUT_REVISION_FIELD_NUMBER: _ClassVar[int]
    input_ref: str
    input_bytes: int
    input_blake3: str
    params_json: str
    expected_outputs: _containers.RepeatedScalarFieldContainer[str]
    plan_line: str
    plan_index: int
    labels: _containers.ScalarMap[str, str]
    input_version_id: str
    input_etag: str
    input_mtime_ns: int
    input_inode: int
    input_device: int
    input_revision: bool
    def __init__(self, input_ref: _Optional[str] = ..., input_bytes: _Optional[int] = ..., input_blake3: _Optional[str] = ..., params_json: _Optional[str] = ..., expected_outputs: _Optional[_Iterable[str]] = ..., plan_line: _Optional[str] = ..., plan_index: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ..., input_version_id: _Optional[str] = ..., input_etag: _Optional[str] = ..., input_mtime_ns: _Optional[int] = ..., input_inode: _Optional[int] = ..., input_device: _Optional[int] = ..., input_revision: _Optional[bool] = ...) -> None: ...

class InputSeen(_message.Message):
    __slots__ = ("input_ref", "size_bytes", "mtime_ns", "inode", "device", "version_id", "etag", "blake3_hex")
    INPUT_REF_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MTIME_NS_FIELD_NUMBER: _ClassVar[int]
    INODE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VERSION_ID_FIELD_NUMBER: _ClassVar[int]
    ETAG_FIELD_NUMBER: _ClassVar[int]
    BLAKE3_HEX_FIELD_NUMBER: _ClassVar[int]
    input_ref: str
    size_bytes: int
    mtime_ns: int
    inode: int
    device: int
    version_id: str
    etag: str
    blake3_hex: str
    def __init__(self, input_ref: _Optional[str] = ..., size_bytes: _Optional[int] = ..., mtime_ns: _Optional[int] = ..., inode: _Optional[int] = ..., device: _Optional[int] = ..., version_id: _Optional[str] = ..., etag: _Optional[str] = ..., blake3_hex: _Optional[str] = ...) -> None: ...

class AttemptStarted(_message.Message):
    __slots__ = ("host", "pid", "heartbeat_timeout", "fingerprint", "fingerprint_digest", "scheduler", "process_start_ticks", "labels", "rank", "world_size", "local_rank", "launch_id", "restart_count", "gpu_count", "input")
    class FingerprintEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    PROCESS_START_TICKS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_ID_FIELD_NUMBER: _ClassVar[int]
    RESTART_COUNT_FIELD_NUMBER: _ClassVar[int]
    GPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    host: str
    pid: int
    heartbeat_timeout: _duration_pb2.Duration
    fingerprint: _containers.ScalarMap[str, str]
    fingerprint_digest: str
    scheduler: SchedulerIdentity
    process_start_ticks: int
    labels: _containers.ScalarMap[str, str]
    rank: int
    world_size: int
    local_rank: int
    launch_id: str
    restart_count: int
    gpu_count: int
    input: InputSeen
    def __init__(self, host: _Optional[str] = ..., pid: _Optional[int] = ..., heartbeat_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., fingerprint: _Optional[_Mapping[str, str]] = ..., fingerprint_digest: _Optional[str] = ..., scheduler: _Optional[_Union[SchedulerIdentity, _Mapping]] = ..., process_start_ticks: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., local_rank: _Optional[int] = ..., launch_id: _Optional[str] = ..., restart_count: _Optional[int] = ..., gpu_count: _Optional[int] = ..., input: _Optional[_Union[InputSeen, _Mapping]] = ...) -> None: ...

class SchedulerIdentity(_message.Message):
    __slots__ = ("kind", "job_id", "array_job_id", "array_task_id", "cluster", "node", "namespace", "task_id", "task_attempt", "actor_id")
    KIND_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ARRAY_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ARRAY_TASK_ID_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    ACTOR_ID_FIELD_NUMBER: _ClassVar[int]
    kind: str
    job_id: str
    array_job_id: str
    array_task_id: str
    cluster: str
    node: str
    namespace: str
    task_id: str
    task_attempt: str
    actor_id: str
    def __init__(self, kind: _Optional[str] = ..., job_id: _Optional[str] = ..., array_job_id: _Optional[str] = ..., array_task_id: _Optional[str] = ..., cluster: _Optional[str] = ..., node: _Optional[str] = ..., namespace: _Optional[str] = ..., task_id: _Optional[str] = ..., task_attempt: _Optional[str] = ..., actor_id: _Optional[str] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("step", "progress", "metrics", "nonfinite_metrics", "rank", "rank_finished", "first_step", "metrics_min", "metrics_max", "progress_calls")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class MetricsMinEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class MetricsMaxEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_METRICS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RANK_FINISHED_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    METRICS_MIN_FIELD_NUMBER: _ClassVar[int]
    METRICS_MAX_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_CALLS_FIELD_NUMBER: _ClassVar[int]
    step: int
    progress: float
    metrics: _containers.ScalarMap[str, float]
    nonfinite_metrics: _containers.RepeatedScalarFieldContainer[str]
    rank: int
    rank_finished: bool
    first_step: int
    metrics_min: _containers.ScalarMap[str, float]
    metrics_max: _containers.ScalarMap[str, float]
    progress_calls: int
    def __init__(self, step: _Optional[int] = ..., progress: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ..., nonfinite_metrics: _Optional[_Iterable[str]] = ..., rank: _Optional[int] = ..., rank_finished: _Optional[bool] = ..., first_step: _Optional[int] = ..., metrics_min: _Optional[_Mapping[str, float]] = ..., metrics_max: _Optional[_Mapping[str, float]] = ..., progress_calls: _Optional[int] = ...) -> None: ...

class CheckpointSaved(_message.Message):
    __slots__ = ("step", "path", "size_bytes", "blake3_hex", "write_duration", "rank", "world_size")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLAKE3_HEX_FIELD_NUMBER: _ClassVar[int]
    WRITE_DURATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    step: int
    path: str
    size_bytes: int
    blake3_hex: str
    write_duration: _duration_pb2.Duration
    rank: int
    world_size: int
    def __init__(self, step: _Optional[int] = ..., path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., blake3_hex: _Optional[str] = ..., write_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ...) -> None: ...

class ArtifactCommitted(_message.Message):
    __slots__ = ("name", "path", "size_bytes", "blake3_hex", "media_type", "rank", "version_id", "etag", "read_back")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLAKE3_HEX_FIELD_NUMBER: _ClassVar[int]
    MEDIA_TYPE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    VERSION_ID_FIELD_NUMBER: _ClassVar[int]
    ETAG_FIELD_NUMBER: _ClassVar[int]
    READ_BACK_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    size_bytes: int
    blake3_hex: str
    media_type: str
    rank: int
    version_id: str
    etag: str
    read_back: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., blake3_hex: _Optional[str] = ..., media_type: _Optional[str] = ..., rank: _Optional[int] = ..., version_id: _Optional[str] = ..., etag: _Optional[str] = ..., read_back: _Optional[str] = ...) -> None: ...

class ArtifactVerified(_message.Message):
    __slots__ = ("name", "path", "blake3_hex", "result", "reason", "detail", "version_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    BLAKE3_HEX_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    VERSION_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    blake3_hex: str
    result: VerificationResult
    reason: str
    detail: str
    version_id: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., blake3_hex: _Optional[str] = ..., result: _Optional[_Union[VerificationResult, str]] = ..., reason: _Optional[str] = ..., detail: _Optional[str] = ..., version_id: _Optional[str] = ...) -> None: ...

class AttemptFailed(_message.Message):
    __slots__ = ("tag", "message", "diagnostics_path", "diagnostics_blake3_hex", "rank")
    TAG_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DIAGNOSTICS_PATH_FIELD_NUMBER: _ClassVar[int]
    DIAGNOSTICS_BLAKE3_HEX_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    tag: FailureTag
    message: str
    diagnostics_path: str
    diagnostics_blake3_hex: str
    rank: int
    def __init__(self, tag: _Optional[_Union[FailureTag, str]] = ..., message: _Optional[str] = ..., diagnostics_path: _Optional[str] = ..., diagnostics_blake3_hex: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class RunSubmissionClosed(_message.Message):
    __slots__ = ("reason", "expected_shards", "submitted_until")
    REASON_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SHARDS_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_UNTIL_FIELD_NUMBER: _ClassVar[int]
    reason: str
    expected_shards: int
    submitted_until: _timestamp_pb2.Timestamp
    def __init__(self, reason: _Optional[str] = ..., expected_shards: _Optional[int] = ..., submitted_until: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class RunReopened(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class AppendEventsRequest(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[ShardEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[ShardEvent, _Mapping]]] = ...) -> None: ...

class AppendResult(_message.Message):
    __slots__ = ("event_id", "sequence", "outcome", "input_changed")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    INPUT_CHANGED_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    sequence: int
    outcome: AppendOutcome
    input_changed: str
    def __init__(self, event_id: _Optional[str] = ..., sequence: _Optional[int] = ..., outcome: _Optional[_Union[AppendOutcome, str]] = ..., input_changed: _Optional[str] = ...) -> None: ...

class AppendEventsResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[AppendResult]
    def __init__(self, results: _Optional[_Iterable[_Union[AppendResult, _Mapping]]] = ...) -> None: ...

class StreamAppendEventsRequest(_message.Message):
    __slots__ = ("batch_id", "events")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    events: _containers.RepeatedCompositeFieldContainer[ShardEvent]
    def __init__(self, batch_id: _Optional[int] = ..., events: _Optional[_Iterable[_Union[ShardEvent, _Mapping]]] = ...) -> None: ...

class AppendError(_message.Message):
    __slots__ = ("code", "message", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    details: _containers.RepeatedCompositeFieldContainer[_any_pb2.Any]
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., details: _Optional[_Iterable[_Union[_any_pb2.Any, _Mapping]]] = ...) -> None: ...

class StreamAppendEventsResponse(_message.Message):
    __slots__ = ("batch_id", "appended", "error")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    APPENDED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    appended: AppendEventsResponse
    error: AppendError
    def __init__(self, batch_id: _Optional[int] = ..., appended: _Optional[_Union[AppendEventsResponse, _Mapping]] = ..., error: _Optional[_Union[AppendError, _Mapping]] = ...) -> None: ...

class ListEventsRequest(_message.Message):
    __slots__ = ("namespace", "run_id", "after_sequence", "page_size", "page_token")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    run_id: str
    after_sequence: int
    page_size: int
    page_token: str
    def __init__(self, namespace: _Optional[str] = ..., run_id: _Optional[str] = ..., after_sequence: _Optional[int] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListEventsResponse(_message.Message):
    __slots__ = ("events", "next_page_token")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[ShardEvent]
    next_page_token: str
    def __init__(self, events: _Optional[_Iterable[_Union[ShardEvent, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class TailEventsRequest(_message.Message):
    __slots__ = ("namespace", "run_id", "after_sequence")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    run_id: str
    after_sequence: int
    def __init__(self, namespace: _Optional[str] = ..., run_id: _Optional[str] = ..., after_sequence: _Optional[int] = ...) -> None: ...

class TailEventsResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: ShardEvent
    def __init__(self, event: _Optional[_Union[ShardEvent, _Mapping]] = ...) -> None: ...

class ListRunsRequest(_message.Message):
    __slots__ = ("namespace", "page_size")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    page_size: int
    def __init__(self, namespace: _Optional[str] = ..., page_size: _Optional[int] = ...) -> None: ...

class RunInfo(_message.Message):
    __slots__ = ("namespace", "run_id", "event_count", "head_hash", "create_time", "update_time", "archived", "archive_location")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_COUNT_FIELD_NUMBER: _ClassVar[int]
    HEAD_HASH_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    UPDATE_TIME_FIELD_NUMBER: _ClassVar[int]
    ARCHIVED_FIELD_NUMBER: _ClassVar[int]
    ARCHIVE_LOCATION_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    run_id: str
    event_count: int
    head_hash: bytes
    create_time: _timestamp_pb2.Timestamp
    update_time: _timestamp_pb2.Timestamp
    archived: bool
    archive_location: str
    def __init__(self, namespace: _Optional[str] = ..., run_id: _Optional[str] = ..., event_count: _Optional[int] = ..., head_hash: _Optional[bytes] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., update_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., archived: _Optional[bool] = ..., archive_location: _Optional[str] = ...) -> None: ...

class ListRunsResponse(_message.Message):
    __slots__ = ("runs",)
    RUNS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[RunInfo]
    def __init__(self, runs: _Optional[_Iterable[_Union[RunInfo, _Mapping]]] = ...) -> None: ...

class GetRunSummaryRequest(_message.Message):
    __slots__ = ("namespace", "run_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    run_id: str
    def __init__(self, namespace: _Optional[str] = ..., run_id: _Optional[str] = ...) -> None: ...

class GetRunSummaryResponse(_message.Message):
    __slots__ = ("summary_json", "as_of_time", "summary")
    SUMMARY_JSON_FIELD_NUMBER: _ClassVar[int]
    AS_OF_TIME_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    summary_json: str
    as_of_time: _timestamp_pb2.Timestamp
    summary: RunSummary
    def __init__(self, summary_json: _Optional[str] = ..., as_of_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., summary: _Optional[_Union[RunSummary, _Mapping]] = ...) -> None: ...

class RunSummary(_message.Message):
    __slots__ = ("namespace", "run_id", "submitted", "verified", "failed", "missing", "unverified", "running", "stale", "verify_failed", "completion_rate", "silent_errors", "silent_error_rate", "failure_tags", "attempt_failure_tags", "verify_failures", "duplicates", "duplicate_shards", "repairs", "fingerprint_groups", "attempts", "unconfirmed", "numeric", "late_attempts", "recomputed", "recomputed_rate", "first_pass", "as_of_us", "event_count", "head_hash", "lifecycle", "by_state")
    class FailureTagsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class AttemptFailureTagsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class VerifyFailuresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class DuplicatesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class FingerprintGroupsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    UNVERIFIED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FAILED_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_RATE_FIELD_NUMBER: _ClassVar[int]
    SILENT_ERRORS_FIELD_NUMBER: _ClassVar[int]
    SILENT_ERROR_RATE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_TAGS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FAILURE_TAGS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FAILURES_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_SHARDS_FIELD_NUMBER: _ClassVar[int]
    REPAIRS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_GROUPS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    UNCONFIRMED_FIELD_NUMBER: _ClassVar[int]
    NUMERIC_FIELD_NUMBER: _ClassVar[int]
    LATE_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_RATE_FIELD_NUMBER: _ClassVar[int]
    FIRST_PASS_FIELD_NUMBER: _ClassVar[int]
    AS_OF_US_FIELD_NUMBER: _ClassVar[int]
    EVENT_COUNT_FIELD_NUMBER: _ClassVar[int]
    HEAD_HASH_FIELD_NUMBER: _ClassVar[int]
    LIFECYCLE_FIELD_NUMBER: _ClassVar[int]
    BY_STATE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    run_id: str
    submitted: int
    verified: int
    failed: int
    missing: int
    unverified: int
    running: int
    stale: int
    verify_failed: int
    completion_rate: float
    silent_errors: int
    silent_error_rate: float
    failure_tags: _containers.ScalarMap[str, int]
    attempt_failure_tags: _containers.ScalarMap[str, int]
    verify_failures: _containers.ScalarMap[str, int]
    duplicates: _containers.ScalarMap[str, int]
    duplicate_shards: int
    repairs: int
    fingerprint_groups: _containers.ScalarMap[str, int]
    attempts: int
    unconfirmed: int
    numeric: int
    late_attempts: int
    recomputed: int
    recomputed_rate: float
    first_pass: FirstPassSummary
    as_of_us: int
    event_count: int
    head_hash: str
    lifecycle: RunLifecycle
    by_state: RunShardStates
    def __init__(self, namespace: _Optional[str] = ..., run_id: _Optional[str] = ..., submitted: _Optional[int] = ..., verified: _Optional[int] = ..., failed: _Optional[int] = ..., missing: _Optional[int] = ..., unverified: _Optional[int] = ..., running: _Optional[int] = ..., stale: _Optional[int] = ..., verify_failed: _Optional[int] = ..., completion_rate: _Optional[float] = ..., silent_errors: _Optional[int] = ..., silent_error_rate: _Optional[float] = ..., failure_tags: _Optional[_Mapping[str, int]] = ..., attempt_failure_tags: _Optional[_Mapping[str, int]] = ..., verify_failures: _Optional[_Mapping[str, int]] = ..., duplicates: _Optional[_Mapping[str, int]] = ..., duplicate_shards: _Optional[int] = ..., repairs: _Optional[int] = ..., fingerprint_groups: _Optional[_Mapping[str, int]] = ..., attempts: _Optional[int] = ..., unconfirmed: _Optional[int] = ..., numeric: _Optional[int] = ..., late_attempts: _Optional[int] = ..., recomputed: _Optional[int] = ..., recomputed_rate: _Optional[float] = ..., first_pass: _Optional[_Union[FirstPassSummary, _Mapping]] = ..., as_of_us: _Optional[int] = ..., event_count: _Optional[int] = ..., head_hash: _Optional[str] = ..., lifecycle: _Optional[_Union[RunLifecycle, _Mapping]] = ..., by_state: _Optional[_Union[RunShardStates, _Mapping]] = ...) -> None: ...

class RunShardStates(_message.Message):
    __slots__ = ("verified", "failed", "verify_failed", "missing", "running", "stale", "unverified")
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FAILED_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    UNVERIFIED_FIELD_NUMBER: _ClassVar[int]
    verified: int
    failed: int
    verify_failed: int
    missing: int
    running: int
    stale: int
    unverified: int
    def __init__(self, verified: _Optional[int] = ..., failed: _Optional[int] = ..., verify_failed: _Optional[int] = ..., missing: _Optional[int] = ..., running: _Optional[int] = ..., stale: _Optional[int] = ..., unverified: _Optional[int] = ...) -> None: ...

class RunLifecycle(_message.Message):
    __slots__ = ("state", "submission_closed", "submission_closed_at", "submission_closed_at_us", "submission_closed_at_sequence", "submission_closes_at", "expected_shards", "settled", "settled_at", "settled_at_us", "waiting_on", "reopened_at_sequence", "reopened_at", "reopened_at_us")
    STATE_FIELD_NUMBER: _ClassVar[int]
    SUBMISSION_CLOSED_FIELD_NUMBER: _ClassVar[int]
    SUBMISSION_CLOSED_AT_FIELD_NUMBER: _ClassVar[int]
    SUBMISSION_CLOSED_AT_US_FIELD_NUMBER: _ClassVar[int]
    SUBMISSION_CLOSED_AT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SUBMISSION_CLOSES_AT_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SHARDS_FIELD_NUMBER: _ClassVar[int]
    SETTLED_FIELD_NUMBER: _ClassVar[int]
    SETTLED_AT_FIELD_NUMBER: _ClassVar[int]
    SETTLED_AT_US_FIELD_NUMBER: _ClassVar[int]
    WAITING_ON_FIELD_NUMBER: _ClassVar[int]
    REOPENED_AT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    REOPENED_AT_FIELD_NUMBER: _ClassVar[int]
    REOPENED_AT_US_FIELD_NUMBER: _ClassVar[int]
    state: str
    submission_closed: bool
    submission_closed_at: str
    submission_closed_at_us: int
    submission_closed_at_sequence: int
    submission_closes_at: str
    expected_shards: int
    settled: bool
    settled_at: str
    settled_at_us: int
    waiting_on: RunWaitingOn
    reopened_at_sequence: int
    reopened_at: str
    reopened_at_us: int
    def __init__(self, state: _Optional[str] = ..., submission_closed: _Optional[bool] = ..., submission_closed_at: _Optional[str] = ..., submission_closed_at_us: _Optional[int] = ..., submission_closed_at_sequence: _Optional[int] = ..., submission_closes_at: _Optional[str] = ..., expected_shards: _Optional[int] = ..., settled: _Optional[bool] = ..., settled_at: _Optional[str] = ..., settled_at_us: _Optional[int] = ..., waiting_on: _Optional[_Union[RunWaitingOn, _Mapping]] = ..., reopened_at_sequence: _Optional[int] = ..., reopened_at: _Optional[str] = ..., reopened_at_us: _Optional[int] = ...) -> None: ...

class RunWaitingOn(_message.Message):
    __slots__ = ("running", "stale", "unverified", "unplanned")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    UNVERIFIED_FIELD_NUMBER: _ClassVar[int]
    UNPLANNED_FIELD_NUMBER: _ClassVar[int]
    running: int
    stale: int
    unverified: int
    unplanned: int
    def __init__(self, running: _Optional[int] = ..., stale: _Optional[int] = ..., unverified: _Optional[int] = ..., unplanned: _Optional[int] = ...) -> None: ...

class FirstPassSummary(_message.Message):
    __slots__ = ("closed", "closed_at_sequence", "verified", "completion_rate", "silent_errors", "silent_error_rate", "first_attempt_verified", "reconciliation_rate", "missing", "numeric", "verify_failures")
    class VerifyFailuresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    CLOSED_AT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_RATE_FIELD_NUMBER: _ClassVar[int]
    SILENT_ERRORS_FIELD_NUMBER: _ClassVar[int]
    SILENT_ERROR_RATE_FIELD_NUMBER: _ClassVar[int]
    FIRST_ATTEMPT_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    RECONCILIATION_RATE_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    NUMERIC_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FAILURES_FIELD_NUMBER: _ClassVar[int]
    closed: bool
    closed_at_sequence: int
    verified: int
    completion_rate: float
    silent_errors: int
    silent_error_rate: float
    first_attempt_verified: int
    reconciliation_rate: float
    missing: int
    numeric: int
    verify_failures: _containers.ScalarMap[str, int]
    def __init__(self, closed: _Optional[bool] = ..., closed_at_sequence: _Optional[int] = ..., verified: _Optional[int] = ..., completion_rate: _Optional[float] = ..., silent_errors: _Optional[int] = ..., silent_error_rate: _Optional[float] = ..., first_attempt_verified: _Optional[int] = ..., reconciliation_rate: _Optional[float] = ..., missing: _Optional[int] = ..., numeric: _Optional[int] = ..., verify_failures: _Optional[_Mapping[str, int]] = ...) -> None: ...

class ListShardsRequest(_message.Message):
    __slots__ = ("namespace", "run_id", "state", "page_size", "page_token")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    run_id: str
    state: str
    page_size: int
    page_token: str
    def __init__(self, namespace: _Optional[str] = ..., run_id: _Optional[str] = ..., state: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ShardView(_message.Message):
    __slots__ = ("shard_id", "state", "view_json", "view")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    VIEW_JSON_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    state: str
    view_json: str
    view: ShardDetails
    def __init__(self, shard_id: _Optional[str] = ..., state: _Optional[str] = ..., view_json: _Optional[str] = ..., view: _Optional[_Union[ShardDetails, _Mapping]] = ...) -> None: ...

class ShardDetails(_message.Message):
    __slots__ = ("shard_id", "plan_index", "state", "detail", "attempts", "latest_attempt", "host", "pid", "scheduler", "process_start_ticks", "deadline_us", "last_seen_us", "last_step", "fingerprint", "artifacts", "duplicates", "repaired", "failures", "numeric", "first_pass", "world_size", "launch_id", "restart_count", "ranks_alive", "ranks", "input", "plan", "attempt_history")
    class SchedulerEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class ArtifactsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: ArtifactView
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[ArtifactView, _Mapping]] = ...) -> None: ...
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_INDEX_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    LATEST_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    PROCESS_START_TICKS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_US_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_US_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    REPAIRED_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    NUMERIC_FIELD_NUMBER: _ClassVar[int]
    FIRST_PASS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_ID_FIELD_NUMBER: _ClassVar[int]
    RESTART_COUNT_FIELD_NUMBER: _ClassVar[int]
    RANKS_ALIVE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_HISTORY_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    plan_index: int
    state: str
    detail: str
    attempts: int
    latest_attempt: str
    host: str
    pid: int
    scheduler: _containers.ScalarMap[str, str]
    process_start_ticks: int
    deadline_us: int
    last_seen_us: int
    last_step: int
    fingerprint: str
    artifacts: _containers.MessageMap[str, ArtifactView]
    duplicates: _containers.RepeatedScalarFieldContainer[str]
    repaired: bool
    failures: _containers.RepeatedScalarFieldContainer[str]
    numeric: NumericWarning
    first_pass: str
    world_size: int
    launch_id: str
    restart_count: int
    ranks_alive: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankView]
    input: str
    plan: ShardPlanView
    attempt_history: _containers.RepeatedCompositeFieldContainer[AttemptView]
    def __init__(self, shard_id: _Optional[str] = ..., plan_index: _Optional[int] = ..., state: _Optional[str] = ..., detail: _Optional[str] = ..., attempts: _Optional[int] = ..., latest_attempt: _Optional[str] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., scheduler: _Optional[_Mapping[str, str]] = ..., process_start_ticks: _Optional[int] = ..., deadline_us: _Optional[int] = ..., last_seen_us: _Optional[int] = ..., last_step: _Optional[int] = ..., fingerprint: _Optional[str] = ..., artifacts: _Optional[_Mapping[str, ArtifactView]] = ..., duplicates: _Optional[_Iterable[str]] = ..., repaired: _Optional[bool] = ..., failures: _Optional[_Iterable[str]] = ..., numeric: _Optional[_Union[NumericWarning, _Mapping]] = ..., first_pass: _Optional[str] = ..., world_size: _Optional[int] = ..., launch_id: _Optional[str] = ..., restart_count: _Optional[int] = ..., ranks_alive: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankView, _Mapping]]] = ..., input: _Optional[str] = ..., plan: _Optional[_Union[ShardPlanView, _Mapping]] = ..., attempt_history: _Optional[_Iterable[_Union[AttemptView, _Mapping]]] = ...) -> None: ...

class AttemptView(_message.Message):
    __slots__ = ("attempt_id", "outcome", "detail", "host", "pid", "scheduler", "started_us", "ended_us", "last_seen_us", "fingerprint", "clock_skew_us", "late", "client_started_us", "client_ended_us", "span_clock", "delivery_gap_us")
    class SchedulerEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    STARTED_US_FIELD_NUMBER: _ClassVar[int]
    ENDED_US_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_US_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CLOCK_SKEW_US_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_STARTED_US_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ENDED_US_FIELD_NUMBER: _ClassVar[int]
    SPAN_CLOCK_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_GAP_US_FIELD_NUMBER: _ClassVar[int]
    attempt_id: str
    outcome: str
    detail: str
    host: str
    pid: int
    scheduler: _containers.ScalarMap[str, str]
    started_us: int
    ended_us: int
    last_seen_us: int
    fingerprint: str
    clock_skew_us: int
    late: bool
    client_started_us: int
    client_ended_us: int
    span_clock: str
    delivery_gap_us: int
    def __init__(self, attempt_id: _Optional[str] = ..., outcome: _Optional[str] = ..., detail: _Optional[str] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., scheduler: _Optional[_Mapping[str, str]] = ..., started_us: _Optional[int] = ..., ended_us: _Optional[int] = ..., last_seen_us: _Optional[int] = ..., fingerprint: _Optional[str] = ..., clock_skew_us: _Optional[int] = ..., late: _Optional[bool] = ..., client_started_us: _Optional[int] = ..., client_ended_us: _Optional[int] = ..., span_clock: _Optional[str] = ..., delivery_gap_us: _Optional[int] = ...) -> None: ...

class ShardPlanView(_message.Message):
    __slots__ = ("input_ref", "input_bytes", "input_blake3", "params_json", "expected_outputs", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    INPUT_REF_FIELD_NUMBER: _ClassVar[int]
    INPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    INPUT_BLAKE3_FIELD_NUMBER: _ClassVar[int]
    PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    input_ref: str
    input_bytes: int
    input_blake3: str
    params_json: str
    expected_outputs: _containers.RepeatedScalarFieldContainer[str]
    labels: _containers.ScalarMap[str, str]
    def __init__(self, input_ref: _Optional[str] = ..., input_bytes: _Optional[int] = ..., input_blake3: _Optional[str] = ..., params_json: _Optional[str] = ..., expected_outputs: _Optional[_Iterable[str]] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RankView(_message.Message):
    __slots__ = ("rank", "state", "alive", "local_rank", "host", "pid", "process_start_ticks", "scheduler", "last_seen_us", "last_step", "failed_tag")
    class SchedulerEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RANK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_START_TICKS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_US_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    FAILED_TAG_FIELD_NUMBER: _ClassVar[int]
    rank: int
    state: str
    alive: bool
    local_rank: int
    host: str
    pid: int
    process_start_ticks: int
    scheduler: _containers.ScalarMap[str, str]
    last_seen_us: int
    last_step: int
    failed_tag: str
    def __init__(self, rank: _Optional[int] = ..., state: _Optional[str] = ..., alive: _Optional[bool] = ..., local_rank: _Optional[int] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., process_start_ticks: _Optional[int] = ..., scheduler: _Optional[_Mapping[str, str]] = ..., last_seen_us: _Optional[int] = ..., last_step: _Optional[int] = ..., failed_tag: _Optional[str] = ...) -> None: ...

class ArtifactView(_message.Message):
    __slots__ = ("path", "size_bytes", "blake3")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLAKE3_FIELD_NUMBER: _ClassVar[int]
    path: str
    size_bytes: int
    blake3: str
    def __init__(self, path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., blake3: _Optional[str] = ...) -> None: ...

class NumericWarning(_message.Message):
    __slots__ = ("step", "metrics")
    STEP_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    step: int
    metrics: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step: _Optional[int] = ..., metrics: _Optional[_Iterable[str]] = ...) -> None: ...

class ListShardsResponse(_message.Message):
    __slots__ = ("shards", "next_page_token")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[ShardView]
    next_page_token: str
    def __init__(self, shards: _Optional[_Iterable[_Union[ShardView, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class StreamResumeListRequest(_message.Message):
    __slots__ = ("namespace", "run_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    run_id: str
    def __init__(self, namespace: _Optional[str] = ..., run_id: _Optional[str] = ...) -> None: ...

class ResumeEntry(_message.Message):
    __slots__ = ("shard_id", "plan_line", "reason", "plan_index")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_LINE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PLAN_INDEX_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    plan_line: str
    reason: str
    plan_index: int
    def __init__(self, shard_id: _Optional[str] = ..., plan_line: _Optional[str] = ..., reason: _Optional[str] = ..., plan_index: _Optional[int] = ...) -> None: ...

class StreamResumeListResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[ResumeEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[ResumeEntry, _Mapping]]] = ...) -> None: ...

class GetTreeHeadRequest(_message.Message):
    __slots__ = ("namespace", "run_id", "tree_size")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_SIZE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    run_id: str
    tree_size: int
    def __init__(self, namespace: _Optional[str] = ..., run_id: _Optional[str] = ..., tree_size: _Optional[int] = ...) -> None: ...

class GetTreeHeadResponse(_message.Message):
    __slots__ = ("tree_head_json", "tree_head")
    TREE_HEAD_JSON_FIELD_NUMBER: _ClassVar[int]
    TREE_HEAD_FIELD_NUMBER: _ClassVar[int]
    tree_head_json: str
    tree_head: TreeHead
    def __init__(self, tree_head_json: _Optional[str] = ..., tree_head: _Optional[_Union[TreeHead, _Mapping]] = ...) -> None: ...

class TreeHead(_message.Message):
    __slots__ = ("namespace", "run_id", "tree_size", "root_hex", "timestamp_ms", "key_id", "signature_hex")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROOT_HEX_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_HEX_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    run_id: str
    tree_size: int
    root_hex: str
    timestamp_ms: int
    key_id: str
    signature_hex: str
    def __init__(self, namespace: _Optional[str] = ..., run_id: _Optional[str] = ..., tree_size: _Optional[int] = ..., root_hex: _Optional[str] = ..., timestamp_ms: _Optional[int] = ..., key_id: _Optional[str] = ..., signature_hex: _Optional[str] = ...) -> None: ...

class InclusionProofBundle(_message.Message):
    __slots__ = ("head", "leaf_index", "leaf_hex", "proof_hex")
    HEAD_FIELD_NUMBER: _ClassVar[int]
    LEAF_INDEX_FIELD_NUMBER: _ClassVar[int]
    LEAF_HEX_FIELD_NUMBER: _ClassVar[int]
    PROOF_HEX_FIELD_NUMBER: _ClassVar[int]
    head: TreeHead
    leaf_index: int
    leaf_hex: str
    proof_hex: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, head: _Optional[_Union[TreeHead, _Mapping]] = ..., leaf_index: _Optional[int] = ..., leaf_hex: _Optional[str] = ..., proof_hex: _Optional[_Iterable[str]] = ...) -> None: ...

class GetInclusionProofRequest(_message.Message):
    __slots__ = ("namespace", "run_id", "event_id", "tree_size")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_SIZE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    run_id: str
    event_id: str
    tree_size: int
    def __init__(self, namespace: _Optional[str] = ..., run_id: _Optional[str] = ..., event_id: _Optional[str] = ..., tree_size: _Optional[int] = ...) -> None: ...

class GetInclusionProofResponse(_message.Message):
    __slots__ = ("proof_bundle_json", "bundle")
    PROOF_BUNDLE_JSON_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    proof_bundle_json: str
    bundle: InclusionProofBundle
    def __init__(self, proof_bundle_json: _Optional[str] = ..., bundle: _Optional[_Union[InclusionProofBundle, _Mapping]] = ...) -> None: ...

class GetConsistencyProofRequest(_message.Message):
    __slots__ = ("namespace", "run_id", "old_size", "new_size")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    OLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NEW_SIZE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    run_id: str
    old_size: int
    new_size: int
    def __init__(self, namespace: _Optional[str] = ..., run_id: _Optional[str] = ..., old_size: _Optional[int] = ..., new_size: _Optional[int] = ...) -> None: ...

class GetConsistencyProofResponse(_message.Message):
    __slots__ = ("proof", "tree_head_json", "tree_head")
    PROOF_FIELD_NUMBER: _ClassVar[int]
    TREE_HEAD_JSON_FIELD_NUMBER: _ClassVar[int]
    TREE_HEAD_FIELD_NUMBER: _ClassVar[int]
    proof: _containers.RepeatedScalarFieldContainer[bytes]
    tree_head_json: str
    tree_head: TreeHead
    def __init__(self, proof: _Optional[_Iterable[bytes]] = ..., tree_head_json: _Optional[str] = ..., tree_head: _Optional[_Union[TreeHead, _Mapping]] = ...) -> None: ...

class GetPublicKeyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetPublicKeyResponse(_message.Message):
    __slots__ = ("public_key_pem", "key_id")
    PUBLIC_KEY_PEM_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    public_key_pem: str
    key_id: str
    def __init__(self, public_key_pem: _Optional[str] = ..., key_id: _Optional[str] = ...) -> None: ...

class GetRunReportRequest(_message.Message):
    __slots__ = ("namespace", "run_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    run_id: str
    def __init__(self, namespace: _Optional[str] = ..., run_id: _Optional[str] = ...) -> None: ...

class GetRunReportResponse(_message.Message):
    __slots__ = ("report", "as_of_time")
    REPORT_FIELD_NUMBER: _ClassVar[int]
    AS_OF_TIME_FIELD_NUMBER: _ClassVar[int]
    report: RunReport
    as_of_time: _timestamp_pb2.Timestamp
    def __init__(self, report: _Optional[_Union[RunReport, _Mapping]] = ..., as_of_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class RunReport(_message.Message):
    __slots__ = ("namespace", "run_id", "labels", "costs", "checkpoint_advice", "first_pass_silent_forms", "first_pass_loud_failures")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class FirstPassSilentFormsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class FirstPassLoudFailuresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    COSTS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ADVICE_FIELD_NUMBER: _ClassVar[int]
    FIRST_PASS_SILENT_FORMS_FIELD_NUMBER: _ClassVar[int]
    FIRST_PASS_LOUD_FAILURES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    run_id: str
    labels: _containers.ScalarMap[str, str]
    costs: RunCosts
    checkpoint_advice: CheckpointAdvice
    first_pass_silent_forms: _containers.ScalarMap[str, int]
    first_pass_loud_failures: _containers.ScalarMap[str, int]
    def __init__(self, namespace: _Optional[str] = ..., run_id: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., costs: _Optional[_Union[RunCosts, _Mapping]] = ..., checkpoint_advice: _Optional[_Union[CheckpointAdvice, _Mapping]] = ..., first_pass_silent_forms: _Optional[_Mapping[str, int]] = ..., first_pass_loud_failures: _Optional[_Mapping[str, int]] = ...) -> None: ...

class RunCosts(_message.Message):
    __slots__ = ("gpu_s", "counted_gpu_s", "running_gpu_s", "lost_gpu_s", "not_counted_gpu_s", "not_counted_share", "attempts", "hangs", "hang_lost_s", "gpus_unknown_attempts", "clock", "recomputed_gpu_s")
    class LostGpuSEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class AttemptsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ClockEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    GPU_S_FIELD_NUMBER: _ClassVar[int]
    COUNTED_GPU_S_FIELD_NUMBER: _ClassVar[int]
    RUNNING_GPU_S_FIELD_NUMBER: _ClassVar[int]
    LOST_GPU_S_FIELD_NUMBER: _ClassVar[int]
    NOT_COUNTED_GPU_S_FIELD_NUMBER: _ClassVar[int]
    NOT_COUNTED_SHARE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    HANGS_FIELD_NUMBER: _ClassVar[int]
    HANG_LOST_S_FIELD_NUMBER: _ClassVar[int]
    GPUS_UNKNOWN_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_GPU_S_FIELD_NUMBER: _ClassVar[int]
    gpu_s: float
    counted_gpu_s: float
    running_gpu_s: float
    lost_gpu_s: _containers.ScalarMap[str, float]
    not_counted_gpu_s: float
    not_counted_share: float
    attempts: _containers.ScalarMap[str, int]
    hangs: int
    hang_lost_s: float
    gpus_unknown_attempts: int
    clock: _containers.ScalarMap[str, int]
    recomputed_gpu_s: float
    def __init__(self, gpu_s: _Optional[float] = ..., counted_gpu_s: _Optional[float] = ..., running_gpu_s: _Optional[float] = ..., lost_gpu_s: _Optional[_Mapping[str, float]] = ..., not_counted_gpu_s: _Optional[float] = ..., not_counted_share: _Optional[float] = ..., attempts: _Optional[_Mapping[str, int]] = ..., hangs: _Optional[int] = ..., hang_lost_s: _Optional[float] = ..., gpus_unknown_attempts: _Optional[int] = ..., clock: _Optional[_Mapping[str, int]] = ..., recomputed_gpu_s: _Optional[float] = ...) -> None: ...

class CheckpointAdvice(_message.Message):
    __slots__ = ("shard_duration_s", "checkpoint_write_s", "reclaim_probability", "attempts", "interval_s", "interval_steps", "expected_waste_s", "reason")
    SHARD_DURATION_S_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_WRITE_S_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_WASTE_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    shard_duration_s: float
    checkpoint_write_s: float
    reclaim_probability: float
    attempts: int
    interval_s: float
    interval_steps: int
    expected_waste_s: float
    reason: str
    def __init__(self, shard_duration_s: _Optional[float] = ..., checkpoint_write_s: _Optional[float] = ..., reclaim_probability: _Optional[float] = ..., attempts: _Optional[int] = ..., interval_s: _Optional[float] = ..., interval_steps: _Optional[int] = ..., expected_waste_s: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class CompareRunsRequest(_message.Message):
    __slots__ = ("namespace", "run_ids", "label")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    RUN_IDS_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    run_ids: _containers.RepeatedScalarFieldContainer[str]
    label: str
    def __init__(self, namespace: _Optional[str] = ..., run_ids: _Optional[_Iterable[str]] = ..., label: _Optional[str] = ...) -> None: ...

class CompareRunsResponse(_message.Message):
    __slots__ = ("groups", "as_of_time")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    AS_OF_TIME_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[LabelGroup]
    as_of_time: _timestamp_pb2.Timestamp
    def __init__(self, groups: _Optional[_Iterable[_Union[LabelGroup, _Mapping]]] = ..., as_of_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class LabelGroup(_message.Message):
    __slots__ = ("label", "value", "runs", "shards", "first_pass_verified", "first_pass_completion_rate", "first_attempt_verified", "first_pass_reconciliation_rate", "missing", "missing_rate", "silent_errors", "silent_error_rate", "silent_by_form", "silent_empty", "silent_empty_share", "truncations", "loud_failures", "reclaims", "hangs", "fingerprints", "fingerprint_drift", "gpu_s", "gpu_s_by_bucket", "lost_gpu_s")
    class SilentByFormEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class LoudFailuresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class GpuSByBucketEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LABEL_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_PASS_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    FIRST_PASS_COMPLETION_RATE_FIELD_NUMBER: _ClassVar[int]
    FIRST_ATTEMPT_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    FIRST_PASS_RECONCILIATION_RATE_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    MISSING_RATE_FIELD_NUMBER: _ClassVar[int]
    SILENT_ERRORS_FIELD_NUMBER: _ClassVar[int]
    SILENT_ERROR_RATE_FIELD_NUMBER: _ClassVar[int]
    SILENT_BY_FORM_FIELD_NUMBER: _ClassVar[int]
    SILENT_EMPTY_FIELD_NUMBER: _ClassVar[int]
    SILENT_EMPTY_SHARE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATIONS_FIELD_NUMBER: _ClassVar[int]
    LOUD_FAILURES_FIELD_NUMBER: _ClassVar[int]
    RECLAIMS_FIELD_NUMBER: _ClassVar[int]
    HANGS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINTS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_DRIFT_FIELD_NUMBER: _ClassVar[int]
    GPU_S_FIELD_NUMBER: _ClassVar[int]
    GPU_S_BY_BUCKET_FIELD_NUMBER: _ClassVar[int]
    LOST_GPU_S_FIELD_NUMBER: _ClassVar[int]
    label: str
    value: str
    runs: _containers.RepeatedScalarFieldContainer[str]
    shards: int
    first_pass_verified: int
    first_pass_completion_rate: float
    first_attempt_verified: int
    first_pass_reconciliation_rate: float
    missing: int
    missing_rate: float
    silent_errors: int
    silent_error_rate: float
    silent_by_form: _containers.ScalarMap[str, int]
    silent_empty: int
    silent_empty_share: float
    truncations: int
    loud_failures: _containers.ScalarMap[str, int]
    reclaims: int
    hangs: int
    fingerprints: int
    fingerprint_drift: int
    gpu_s: float
    gpu_s_by_bucket: _containers.ScalarMap[str, float]
    lost_gpu_s: float
    def __init__(self, label: _Optional[str] = ..., value: _Optional[str] = ..., runs: _Optional[_Iterable[str]] = ..., shards: _Optional[int] = ..., first_pass_verified: _Optional[int] = ..., first_pass_completion_rate: _Optional[float] = ..., first_attempt_verified: _Optional[int] = ..., first_pass_reconciliation_rate: _Optional[float] = ..., missing: _Optional[int] = ..., missing_rate: _Optional[float] = ..., silent_errors: _Optional[int] = ..., silent_error_rate: _Optional[float] = ..., silent_by_form: _Optional[_Mapping[str, int]] = ..., silent_empty: _Optional[int] = ..., silent_empty_share: _Optional[float] = ..., truncations: _Optional[int] = ..., loud_failures: _Optional[_Mapping[str, int]] = ..., reclaims: _Optional[int] = ..., hangs: _Optional[int] = ..., fingerprints: _Optional[int] = ..., fingerprint_drift: _Optional[int] = ..., gpu_s: _Optional[float] = ..., gpu_s_by_bucket: _Optional[_Mapping[str, float]] = ..., lost_gpu_s: _Optional[float] = ...) -> None: ...
