"""The one translation between protobuf messages and domain events."""

from __future__ import annotations

from typing import Any, Final

from google.protobuf import json_format
from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from ledger_server.errors import InvalidEvent
from ledger_server.events import (
    ArtifactCommitted,
    ArtifactVerified,
    AttemptFailed,
    AttemptStarted,
    CheckpointSaved,
    Event,
    Heartbeat,
    Payload,
    RecordedEvent,
    RunReopened,
    ShardPlanned,
    SubmissionClosed,
)
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.vocabulary import SCHEDULER_FIELDS, FailureTag

_TAGS: Final[dict[pb.FailureTag, FailureTag]] = {
    pb.FAILURE_TAG_OOM: FailureTag.OOM,
    pb.FAILURE_TAG_TIMEOUT: FailureTag.TIMEOUT,
    pb.FAILURE_TAG_KILLED: FailureTag.KILLED,
    pb.FAILURE_TAG_PREEMPTED: FailureTag.PREEMPTED,
    pb.FAILURE_TAG_NCCL: FailureTag.NCCL,
    pb.FAILURE_TAG_DATA: FailureTag.DATA,
    pb.FAILURE_TAG_INCOMPLETE: FailureTag.INCOMPLETE,
    pb.FAILURE_TAG_UNKNOWN: FailureTag.UNKNOWN,
    pb.FAILURE_TAG_INPUT_CHANGED: FailureTag.INPUT_CHANGED,
}
_TAG_VALUES: Final[dict[str, pb.FailureTag]] = {v.value: k for k, v in _TAGS.items()}
_RESULTS: Final = {pb.VERIFICATION_RESULT_PASSED: "passed", pb.VERIFICATION_RESULT_FAILED: "failed"}
_RESULT_VALUES: Final = {v: k for k, v in _RESULTS.items()}
OUTCOMES: Final = {
    "appended": pb.APPEND_OUTCOME_APPENDED,
    "duplicate": pb.APPEND_OUTCOME_DUPLICATE,
    "already_planned": pb.APPEND_OUTCOME_ALREADY_PLANNED,
}


def timestamp_us(ts: Timestamp) -> int:
    """Returns a Timestamp as microseconds since the epoch."""
    return ts.seconds * 1_000_000 + ts.nanos // 1000


def us_timestamp(us: int) -> Timestamp:
    """Returns microseconds since the epoch as a Timestamp."""
    return Timestamp(seconds=us // 1_000_000, nanos=(us % 1_000_000) * 1000)


def _us_duration(us: int) -> Duration:
    return Duration(seconds=us // 1_000_000, nanos=(us % 1_000_000) * 1000)


def _duration_us(d: Duration) -> int:
    return d.seconds * 1_000_000 + d.nanos // 1000


# Most of a night's events are plain heartbeats: passing every field skips the frozen
# dataclass's two default_factory calls (a third of its build time). Payloads are never
# mutated, so one empty dict serves them all.
_NO_EXTREMES: Final[dict[str, float]] = {}


def _strings(values: Any) -> tuple[str, ...]:
    """Returns a repeated string field as a tuple.

    tuple() of the container iterates it through the Sequence ABC in Python (1.4 µs for
    an empty one, on every heartbeat); a slice is a list built in C.
    """
    return tuple(values[:]) if values else ()


def _coalesced(h: pb.Heartbeat) -> Heartbeat:
    """Returns a coalesced heartbeat: the latest values and what its interval held."""
    metrics, low, high = h.metrics, h.metrics_min, h.metrics_max
    return Heartbeat(
        step=h.step,
        progress=h.progress,
        metrics={k: metrics[k] for k in metrics},
        nonfinite_metrics=_strings(h.nonfinite_metrics),
        rank=h.rank,
        rank_finished=h.rank_finished,
        first_step=h.first_step,
        metrics_min={k: low[k] for k in low},
        metrics_max={k: high[k] for k in high},
        progress_calls=h.progress_calls,
    )


_NO_INPUT: Final = pb.InputSeen()


def _input_seen(p: AttemptStarted) -> pb.InputSeen:
    return pb.InputSeen(
        input_ref=p.input_ref,
        size_bytes=p.input_bytes,
        mtime_ns=p.input_mtime_ns,
        inode=p.input_inode,
        device=p.input_device,
        version_id=p.input_version_id,
        etag=p.input_etag,
        blake3_hex=p.input_blake3,
    )


def _decode_payload(msg: pb.ShardEvent) -> Payload:
    case = msg.WhichOneof("payload")
    if case == "planned":
        p = msg.planned
        return ShardPlanned(
            input_ref=p.input_ref,
            input_bytes=p.input_bytes,
            input_blake3=p.input_blake3,
            params_json=p.params_json,
            expected_outputs=_strings(p.expected_outputs),
            plan_line=p.plan_line,
            plan_index=p.plan_index,
            labels=dict(sorted(p.labels.items())),
            input_version_id=p.input_version_id,
            input_etag=p.input_etag,
            input_mtime_ns=p.input_mtime_ns,
            input_inode=p.input_inode,
            input_device=p.input_device,
            input_revision=p.input_revision,
        )
    if case == "started":
        s = msg.started
        seen = s.input if s.HasField("input") else _NO_INPUT
        return AttemptStarted(
            host=s.host,
            pid=s.pid,
            heartbeat_timeout_us=_duration_us(s.heartbeat_timeout),
            fingerprint=dict(sorted(s.fingerprint.items())),
            fingerprint_digest=s.fingerprint_digest,
            scheduler=_scheduler_dict(s.scheduler) if s.HasField("scheduler") else {},
            process_start_ticks=s.process_start_ticks,
            labels=dict(sorted(s.labels.items())),
            rank=s.rank,
            world_size=s.world_size,
            local_rank=s.local_rank,
            launch_id=s.launch_id,
            restart_count=s.restart_count,
            gpu_count=s.gpu_count,
            input_ref=seen.input_ref,
            input_bytes=seen.size_bytes,
            input_mtime_ns=seen.mtime_ns,
            input_inode=seen.inode,
            input_device=seen.device,
            input_version_id=seen.version_id,
            input_etag=seen.etag,
            input_blake3=seen.blake3_hex,
        )
    if case == "heartbeat":
        h = msg.heartbeat
        # dict(map) goes through the Mapping ABC's Python-level keys view; iterating the map
        # and indexing it stays in C (half the time). An empty map costs nothing.
        if h.progress_calls or h.first_step or h.metrics_min or h.metrics_max:
            return _coalesced(h)  # validation refuses extremes without progress_calls
        metrics = h.metrics
        return Heartbeat(
            step=h.step,
            progress=h.progress,
            metrics={k: metrics[k] for k in metrics},
            nonfinite_metrics=_strings(h.nonfinite_metrics),
            rank=h.rank,
            rank_finished=h.rank_finished,
            metrics_min=_NO_EXTREMES,
            metrics_max=_NO_EXTREMES,
        )
    if case == "checkpoint":
        c = msg.checkpoint
        return CheckpointSaved(
            step=c.step,
            path=c.path,
            size_bytes=c.size_bytes,
            blake3_hex=c.blake3_hex,
            write_us=_duration_us(c.write_duration),
            rank=c.rank,
            world_size=c.world_size,
        )
    if case == "artifact_committed":
        a = msg.artifact_committed
        return ArtifactCommitted(
            name=a.name,
            path=a.path,
            size_bytes=a.size_bytes,
            blake3_hex=a.blake3_hex,
            media_type=a.media_type,
            rank=a.rank,
            version_id=a.version_id,
            etag=a.etag,
            read_back=a.read_back,
        )
    if case == "verified":
        v = msg.verified
        if v.result not in _RESULTS:
            raise InvalidEvent("verified.result", "must be PASSED or FAILED")
        return ArtifactVerified(
            name=v.name,
            path=v.path,
            blake3_hex=v.blake3_hex,
            result=_RESULTS[v.result],
            reason=v.reason,
            detail=v.detail,
            version_id=v.version_id,
        )
    if case == "failed":
        f = msg.failed
        if f.tag not in _TAGS:
            raise InvalidEvent("failed.tag", "must be a known FailureTag other than UNSPECIFIED")
        # The plain value: a driver would bind an Enum member by its name.
        return AttemptFailed(
            tag=_TAGS[f.tag].value,
            message=f.message,
            diagnostics_path=f.diagnostics_path,
            diagnostics_blake3_hex=f.diagnostics_blake3_hex,
            rank=f.rank,
        )
    if case == "submission_closed":
        close = msg.submission_closed
        until = timestamp_us(close.submitted_until) if close.HasField("submitted_until") else 0
        return SubmissionClosed(
            reason=close.reason, expected_shards=close.expected_shards, submitted_until_us=until
        )
    if case == "run_reopened":
        return RunReopened(reason=msg.run_reopened.reason)
    raise InvalidEvent("payload", "exactly one payload kind must be set")


def _scheduler_dict(s: pb.SchedulerIdentity) -> dict[str, str]:
    """Returns the scheduler identity's set fields (empty strings left out)."""
    return {name: getattr(s, name) for name in SCHEDULER_FIELDS if getattr(s, name)}


def decode_event(msg: pb.ShardEvent) -> Event:
    """Returns the domain event a client sent (server-assigned fields are ignored)."""
    return Event(
        event_id=msg.event_id,
        namespace=msg.namespace,
        run_id=msg.run_id,
        shard_id=msg.shard_id,
        attempt_id=msg.attempt_id,
        client_time_us=timestamp_us(msg.client_time) if msg.HasField("client_time") else 0,
        payload=_decode_payload(msg),
    )


def encode_event(event: Event, msg: pb.ShardEvent | None = None) -> pb.ShardEvent:
    """Returns the protobuf form of a domain event (client fields only)."""
    out = msg if msg is not None else pb.ShardEvent()
    out.event_id = event.event_id
    out.namespace = event.namespace
    out.run_id = event.run_id
    out.shard_id = event.shard_id
    out.attempt_id = event.attempt_id
    if event.client_time_us:
        out.client_time.CopyFrom(us_timestamp(event.client_time_us))
    p = event.payload
    if isinstance(p, ShardPlanned):
        out.planned.CopyFrom(
            pb.ShardPlanned(
                input_ref=p.input_ref,
                input_bytes=p.input_bytes,
                input_blake3=p.input_blake3,
                params_json=p.params_json,
                expected_outputs=list(p.expected_outputs),
                plan_line=p.plan_line,
                plan_index=p.plan_index,
                labels=p.labels,
                input_version_id=p.input_version_id,
                input_etag=p.input_etag,
                input_mtime_ns=p.input_mtime_ns,
                input_inode=p.input_inode,
                input_device=p.input_device,
                input_revision=p.input_revision,
            )
        )
    elif isinstance(p, AttemptStarted):
        timeout = Duration(
            seconds=p.heartbeat_timeout_us // 1_000_000,
            nanos=(p.heartbeat_timeout_us % 1_000_000) * 1000,
        )
        out.started.CopyFrom(
            pb.AttemptStarted(
                host=p.host,
                pid=p.pid,
                heartbeat_timeout=timeout,
                fingerprint=p.fingerprint,
                fingerprint_digest=p.fingerprint_digest,
                scheduler=pb.SchedulerIdentity(**p.scheduler) if p.scheduler else None,
                process_start_ticks=p.process_start_ticks,
                labels=p.labels,
                rank=p.rank,
                world_size=p.world_size,
                local_rank=p.local_rank,
                launch_id=p.launch_id,
                restart_count=p.restart_count,
                gpu_count=p.gpu_count,
                input=_input_seen(p) if p.input_ref else None,
            )
        )
    elif isinstance(p, Heartbeat):
        out.heartbeat.CopyFrom(
            pb.Heartbeat(
                step=p.step,
                progress=p.progress,
                metrics=p.metrics,
                nonfinite_metrics=p.nonfinite_metrics,
                rank=p.rank,
                rank_finished=p.rank_finished,
                first_step=p.first_step,
                metrics_min=p.metrics_min,
                metrics_max=p.metrics_max,
                progress_calls=p.progress_calls,
            )
        )
    elif isinstance(p, CheckpointSaved):
        out.checkpoint.CopyFrom(
            pb.CheckpointSaved(
                step=p.step,
                path=p.path,
                size_bytes=p.size_bytes,
                blake3_hex=p.blake3_hex,
                write_duration=_us_duration(p.write_us) if p.write_us else None,
                rank=p.rank,
                world_size=p.world_size,
            )
        )
    elif isinstance(p, ArtifactCommitted):
        out.artifact_committed.CopyFrom(
            pb.ArtifactCommitted(
                name=p.name,
                path=p.path,
                size_bytes=p.size_bytes,
                blake3_hex=p.blake3_hex,
                media_type=p.media_type,
                rank=p.rank,
                version_id=p.version_id,
                etag=p.etag,
                read_back=p.read_back,
            )
        )
    elif isinstance(p, ArtifactVerified):
        out.verified.CopyFrom(
            pb.ArtifactVerified(
                name=p.name,
                path=p.path,
                blake3_hex=p.blake3_hex,
                result=_RESULT_VALUES[p.result],
                reason=p.reason,
                detail=p.detail,
                version_id=p.version_id,
            )
        )
    elif isinstance(p, AttemptFailed):
        out.failed.CopyFrom(
            pb.AttemptFailed(
                tag=_TAG_VALUES[p.tag],
                message=p.message,
                diagnostics_path=p.diagnostics_path,
                diagnostics_blake3_hex=p.diagnostics_blake3_hex,
                rank=p.rank,
            )
        )
    elif isinstance(p, SubmissionClosed):
        out.submission_closed.CopyFrom(
            pb.RunSubmissionClosed(
                reason=p.reason,
                expected_shards=p.expected_shards,
                submitted_until=us_timestamp(p.submitted_until_us)
                if p.submitted_until_us
                else None,
            )
        )
    elif isinstance(p, RunReopened):
        out.run_reopened.CopyFrom(pb.RunReopened(reason=p.reason))
    return out


def encode_recorded(rec: RecordedEvent) -> pb.ShardEvent:
    """Returns the protobuf form of a stored event, server fields included."""
    msg = encode_event(rec.event)
    msg.sequence = rec.sequence
    msg.run_sequence = rec.run_sequence
    msg.receive_time.CopyFrom(us_timestamp(rec.receive_time_us))
    msg.row_hash = rec.row_hash
    msg.row_format = rec.row_format
    return msg


def run_summary_pb(summary: dict[str, Any]) -> pb.RunSummary:
    """Returns the typed run summary: every key of the summary that RunSummary has a field for.

    A key without a field yet (one another change added to summary.run_summary) is left
    out rather than refused, so the JSON and the message can grow in either order.
    """
    return json_format.ParseDict(summary, pb.RunSummary(), ignore_unknown_fields=True)


def shard_details_pb(view: dict[str, Any]) -> pb.ShardDetails:
    """Returns the typed shard view (a key without a field yet is left out, as for summaries)."""
    return json_format.ParseDict(view, pb.ShardDetails(), ignore_unknown_fields=True)


def _no_nulls(value: Any) -> Any:
    """Returns the JSON value without null members (an unset optional field)."""
    if isinstance(value, dict):
        return {k: _no_nulls(v) for k, v in value.items() if v is not None}
    return value


def run_report_pb(report: dict[str, Any]) -> pb.RunReport:
    """Returns the typed run report (field.run_report's keys; as_of_us is the response's)."""
    return json_format.ParseDict(_no_nulls(report), pb.RunReport(), ignore_unknown_fields=True)


def label_group_pb(group: dict[str, Any]) -> pb.LabelGroup:
    """Returns one typed group of CompareRuns (field.compare's keys)."""
    return json_format.ParseDict(_no_nulls(group), pb.LabelGroup(), ignore_unknown_fields=True)
