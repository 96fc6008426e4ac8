import datetime

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
APPEND_OUTCOME_UNSPECIFIED: AppendOutcome
APPEND_OUTCOME_APPENDED: AppendOutcome
APPEND_OUTCOME_DUPLICATE: AppendOutcome
APPEND_OUTCOME_ALREADY_PLANNED: AppendOutcome

class ShardEvent(_message.Message):
    __slots__ = ("event_id", "namespace", "run_id", "shard_id", "attempt_id", "client_time", "planned", "started", "heartbeat", "checkpoint", "artifact_committed", "verified", "failed", "sequence", "run_sequence", "receive_time", "row_hash")
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
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    RUN_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_TIME_FIELD_NUMBER: _ClassVar[int]
    ROW_HASH_FIELD_NUMBER: _ClassVar[int]
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
    sequence: int
    run_sequence: int
    receive_time: _timestamp_pb2.Timestamp
    row_hash: bytes
    def __init__(self, event_id: _Optional[str] = ..., namespace: _Optional[str] = ..., run_id: _Optional[str] = ..., shard_id: _Optional[str] = ..., attempt_id: _Optional[str] = ..., client_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., planned: _Optional[_Union[ShardPlanned, _Mapping]] = ..., started: _Optional[_Union[AttemptStarted, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., checkpoint: _Optional[_Union[CheckpointSaved, _Mapping]] = ..., artifact_committed: _Optional[_Union[ArtifactCommitted, _Mapping]] = ..., verified: _Optional[_Union[ArtifactVerified, _Mapping]] = ..., failed: _Optional[_Union[AttemptFailed, _Mapping]] = ..., sequence: _Optional[int] = ..., run_sequence: _Optional[int] = ..., receive_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., row_hash: _Optional[bytes] = ...) -> None: ...

class ShardPlanned(_message.Message):
    __slots__ = ("input_ref", "input_bytes", "input_blake3", "params_json", "expected_outputs", "plan_line", "plan_index", "input_version_id", "input_etag")
    INPUT_REF_FIELD_NUMBER: _ClassVar[int]
    INPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    INPUT_BLAKE3_FIELD_NUMBER: _ClassVar[int]
    PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PLAN_LINE_FIELD_NUMBER: _ClassVar[int]
    PLAN_INDEX_FIELD_NUMBER: _ClassVar[int]
    INPUT_VERSION_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_ETAG_FIELD_NUMBER: _ClassVar[int]
    input_ref: str
    input_bytes: int
    input_blake3: str
    params_json: str
    expected_outputs: _containers.RepeatedScalarFieldContainer[str]
    plan_line: str
    plan_index: int
    input_version_id: str
    input_etag: str
    def __init__(self, input_ref: _Optional[str] = ..., input_bytes: _Optional[int] = ..., input_blake3: _Optional[str] = ..., params_json: _Optional[str] = ..., expected_outputs: _Optional[_Iterable[str]] = ..., plan_line: _Optional[str] = ..., plan_index: _Optional[int] = ..., input_version_id: _Optional[str] = ..., input_etag: _Optional[str] = ...) -> None: ...

class AttemptStarted(_message.Message):
    __slots__ = ("host", "pid", "heartbeat_timeout", "fingerprint", "fingerprint_digest", "scheduler", "process_start_ticks")
    class FingerprintEntry(_message.Message):
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
    host: str
    pid: int
    heartbeat_timeout: _duration_pb2.Duration
    fingerprint: _containers.ScalarMap[str, str]
    fingerprint_digest: str
    scheduler: SchedulerIdentity
    process_start_ticks: int
    def __init__(self, host: _Optional[str] = ..., pid: _Optional[int] = ..., heartbeat_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., fingerprint: _Optional[_Mapping[str, str]] = ..., fingerprint_digest: _Optional[str] = ..., scheduler: _Optional[_Union[SchedulerIdentity, _Mapping]] = ..., process_start_ticks: _Optional[int] = ...) -> None: ...

class SchedulerIdentity(_message.Message):
    __slots__ = ("kind", "job_id", "array_job_id", "array_task_id", "cluster", "node", "namespace")
    KIND_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ARRAY_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ARRAY_TASK_ID_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    job_id: str
    array_job_id: str
    array_task_id: str
    cluster: str
    node: str
    namespace: str
    def __init__(self, kind: _Optional[str] = ..., job_id: _Optional[str] = ..., array_job_id: _Optional[str] = ..., array_task_id: _Optional[str] = ..., cluster: _Optional[str] = ..., node: _Optional[str] = ..., namespace: _Optional[str] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("step", "progress", "metrics", "nonfinite_metrics")
    class MetricsEntry(_message.Message):
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
    step: int
    progress: float
    metrics: _containers.ScalarMap[str, float]
    nonfinite_metrics: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step: _Optional[int] = ..., progress: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ..., nonfinite_metrics: _Optional[_Iterable[str]] = ...) -> None: ...

class CheckpointSaved(_message.Message):
    __slots__ = ("step", "path", "size_bytes", "blake3_hex")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLAKE3_HEX_FIELD_NUMBER: _ClassVar[int]
    step: int
    path: str
    size_bytes: int
    blake3_hex: str
    def __init__(self, step: _Optional[int] = ..., path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., blake3_hex: _Optional[str] = ...) -> None: ...

class ArtifactCommitted(_message.Message):
    __slots__ = ("name", "path", "size_bytes", "blake3_hex", "media_type", "version_id", "etag", "read_back")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLAKE3_HEX_FIELD_NUMBER: _ClassVar[int]
    MEDIA_TYPE_FIELD_NUMBER: _ClassVar[int]
    VERSION_ID_FIELD_NUMBER: _ClassVar[int]
    ETAG_FIELD_NUMBER: _ClassVar[int]
    READ_BACK_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    size_bytes: int
    blake3_hex: str
    media_type: str
    version_id: str
    etag: str
    read_back: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., blake3_hex: _Optional[str] = ..., media_type: _Optional[str] = ..., version_id: _Optional[str] = ..., etag: _Optional[str] = ..., read_back: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("tag", "message", "diagnostics_path", "diagnostics_blake3_hex")
    TAG_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DIAGNOSTICS_PATH_FIELD_NUMBER: _ClassVar[int]
    DIAGNOSTICS_BLAKE3_HEX_FIELD_NUMBER: _ClassVar[int]
    tag: FailureTag
    message: str
    diagnostics_path: str
    diagnostics_blake3_hex: str
    def __init__(self, tag: _Optional[_Union[FailureTag, str]] = ..., message: _Optional[str] = ..., diagnostics_path: _Optional[str] = ..., diagnostics_blake3_hex: _Optional[str] = ...) -> None: ...

class AppendEventsRequest(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[ShardEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[ShardEvent, _Mapping]]] = ...) -> None: ...

class AppendResult(_message.Message):
    __slots__ = ("event_id", "sequence", "outcome")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    sequence: int
    outcome: AppendOutcome
    def __init__(self, event_id: _Optional[str] = ..., sequence: _Optional[int] = ..., outcome: _Optional[_Union[AppendOutcome, str]] = ...) -> None: ...

class AppendEventsResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[AppendResult]
    def __init__(self, results: _Optional[_Iterable[_Union[AppendResult, _Mapping]]] = ...) -> None: ...

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
    __slots__ = ("namespace", "run_id", "event_count", "head_hash", "create_time", "update_time")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_COUNT_FIELD_NUMBER: _ClassVar[int]
    HEAD_HASH_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    UPDATE_TIME_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    run_id: str
    event_count: int
    head_hash: bytes
    create_time: _timestamp_pb2.Timestamp
    update_time: _timestamp_pb2.Timestamp
    def __init__(self, namespace: _Optional[str] = ..., run_id: _Optional[str] = ..., event_count: _Optional[int] = ..., head_hash: _Optional[bytes] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., update_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

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
    __slots__ = ("summary_json", "as_of_time")
    SUMMARY_JSON_FIELD_NUMBER: _ClassVar[int]
    AS_OF_TIME_FIELD_NUMBER: _ClassVar[int]
    summary_json: str
    as_of_time: _timestamp_pb2.Timestamp
    def __init__(self, summary_json: _Optional[str] = ..., as_of_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

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
    __slots__ = ("shard_id", "state", "view_json")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    VIEW_JSON_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    state: str
    view_json: str
    def __init__(self, shard_id: _Optional[str] = ..., state: _Optional[str] = ..., view_json: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("tree_head_json",)
    TREE_HEAD_JSON_FIELD_NUMBER: _ClassVar[int]
    tree_head_json: str
    def __init__(self, tree_head_json: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("proof_bundle_json",)
    PROOF_BUNDLE_JSON_FIELD_NUMBER: _ClassVar[int]
    proof_bundle_json: str
    def __init__(self, proof_bundle_json: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("proof", "tree_head_json")
    PROOF_FIELD_NUMBER: _ClassVar[int]
    TREE_HEAD_JSON_FIELD_NUMBER: _ClassVar[int]
    proof: _containers.RepeatedScalarFieldContainer[bytes]
    tree_head_json: str
    def __init__(self, proof: _Optional[_Iterable[bytes]] = ..., tree_head_json: _Optional[str] = ...) -> None: ...

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
