"""Hypothesis strategies for valid events of every kind, as a client sends them (protobuf).

Every optional field is set or not; integers fall on both sides of 2**53 up to
2**64 - 1, text comes from every plane of unicode, clocks carry sub-microsecond
digits, params are JSON as clients write it (spaces, 1.0 for 1). Every event the
strategies make passes the server's validation (tests/contract/test_go_client.py
fails on one that does not).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp
from hypothesis import strategies as st

from ledger_server.validation import MAX_TIMESTAMP_US
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.canonical import fingerprint_digest
from shard_client.vocabulary import SCHEDULER_FIELDS

_EDGE_INTS = [0, 1, 2**53 - 1, 2**53, 2**53 + 1, 2**63 - 1]
_INT64 = st.sampled_from(_EDGE_INTS) | st.integers(0, 2**63 - 1)
_UINT64 = _INT64 | st.sampled_from([2**64 - 1]) | st.integers(0, 2**64 - 1)
_TEXT = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=12)
_NAME = _TEXT.filter(bool)
_ID = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:@+=/-]{0,15}", fullmatch=True)
_HEX = st.text("0123456789abcdef", min_size=64, max_size=64)
_FLOAT = st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from(
    [1e-7, 1e-6, 1e20, 1e21, 5e-324, -0.0, 2.0**53, 2.0**60, 0.1, 1.0]
)
_LABELS = st.dictionaries(
    st.from_regex(r"[a-z][a-z0-9_.-]{0,10}", fullmatch=True),
    st.text(st.characters(exclude_categories=["Cs"], min_codepoint=32), max_size=10),
    max_size=4,
)
_METRICS = st.dictionaries(_NAME, _FLOAT, max_size=4)
# JSON objects as clients write them: spaces, 1.0 for 1, escapes; safe integers only.
_JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53 - 1), 2**53 - 1)
    | _FLOAT
    | st.text(st.characters(exclude_categories=["Cs"]), max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=10,
)
_JSON_OBJECT = st.dictionaries(_TEXT, _JSON_VALUES, max_size=4).map(
    lambda v: json.dumps(v, ensure_ascii=False)
) | st.sampled_from(["", "{}", '{"lr": 1.0, "eps": 1e-07}', '{"\\ud83d\\ude00": [2.5, -0.0]}'])


@st.composite
def _timestamp(draw: st.DrawFn) -> Timestamp:
    us = draw(st.integers(0, MAX_TIMESTAMP_US) | st.sampled_from([0, 2**53 - 1, 2**53]))
    return Timestamp(
        seconds=us // 1_000_000, nanos=(us % 1_000_000) * 1000 + draw(st.integers(0, 999))
    )


@st.composite
def _duration(draw: st.DrawFn, *, low_us: int, high_us: int) -> Duration:
    us = draw(st.integers(low_us, high_us))
    return Duration(
        seconds=us // 1_000_000, nanos=(us % 1_000_000) * 1000 + draw(st.integers(0, 999))
    )


def _planned(draw: st.DrawFn) -> pb.ShardPlanned:
    return pb.ShardPlanned(
        input_ref=draw(_NAME),
        input_bytes=draw(_INT64),
        input_blake3=draw(st.just("") | _HEX),
        params_json=draw(_JSON_OBJECT),
        expected_outputs=draw(st.lists(_ID, max_size=3, unique=True)),
        plan_line=draw(st.just("") | _JSON_OBJECT.filter(bool)),
        plan_index=draw(_INT64),
        labels=draw(_LABELS),
        input_version_id=draw(_TEXT),
        input_etag=draw(_TEXT),
        input_mtime_ns=draw(_INT64),
        input_inode=draw(_UINT64),
        input_device=draw(_UINT64),
        input_revision=draw(st.booleans()),
    )


def _started(draw: st.DrawFn) -> pb.AttemptStarted:
    fingerprint = draw(
        st.dictionaries(_NAME | st.sampled_from(["gpu.0.uuid", "gpu.1.ecc.sbe"]), _TEXT, max_size=4)
    )
    digests = ["", fingerprint_digest(fingerprint), fingerprint_digest(fingerprint, legacy=True)]
    world = draw(st.integers(0, 16))
    started = pb.AttemptStarted(
        host=draw(_TEXT),
        pid=draw(_INT64),
        heartbeat_timeout=draw(_duration(low_us=1, high_us=7 * 24 * 3600 * 1_000_000)),
        fingerprint=fingerprint,
        fingerprint_digest=draw(st.sampled_from(digests) if fingerprint else st.just("") | _HEX),
        process_start_ticks=draw(_INT64),
        labels=draw(_LABELS),
        world_size=world,
        rank=draw(st.integers(0, max(world, 1) - 1)),
        local_rank=draw(st.integers(0, max(world, 1) - 1)),
        launch_id=draw(_TEXT),
        restart_count=draw(st.integers(0, 2**31 - 1)),
        gpu_count=draw(st.integers(0, 4096)),
    )
    if draw(st.booleans()):
        fields = draw(st.dictionaries(st.sampled_from(SCHEDULER_FIELDS[1:]), _TEXT))
        started.scheduler.CopyFrom(pb.SchedulerIdentity(kind=draw(_NAME), **fields))
    if draw(st.booleans()):
        started.input.CopyFrom(
            pb.InputSeen(
                input_ref=draw(_NAME),
                size_bytes=draw(_INT64),
                mtime_ns=draw(_INT64),
                inode=draw(_UINT64),
                device=draw(_UINT64),
                version_id=draw(_TEXT),
                etag=draw(_TEXT),
                blake3_hex=draw(st.just("") | _HEX),
            )
        )
    return started


def _heartbeat(draw: st.DrawFn) -> pb.Heartbeat:
    beat = pb.Heartbeat(
        step=draw(_INT64),
        progress=draw(st.floats(0, 1) | st.sampled_from([0.0, 1.0, 5e-324])),
        metrics=draw(_METRICS),
        nonfinite_metrics=draw(st.lists(_NAME, max_size=3)),
        rank=draw(st.integers(0, 65535)),
        rank_finished=draw(st.booleans()),
    )
    if draw(st.booleans()):  # coalesced: the interval's first step, extremes and calls
        beat.first_step = draw(st.integers(0, beat.step))
        beat.progress_calls = draw(st.integers(1, 2**63 - 1))
        for name, (low, high) in draw(
            st.dictionaries(_NAME, st.tuples(_FLOAT, _FLOAT), max_size=3)
        ).items():
            beat.metrics_min[name], beat.metrics_max[name] = min(low, high), max(low, high)
    return beat


def _checkpoint(draw: st.DrawFn) -> pb.CheckpointSaved:
    world = draw(st.integers(0, 8))
    ckpt = pb.CheckpointSaved(
        step=draw(_INT64),
        path=draw(_NAME),
        size_bytes=draw(_INT64),
        blake3_hex=draw(_HEX),
        rank=draw(st.integers(0, max(world, 1) - 1)) if world else 0,
        world_size=world,
    )
    if draw(st.booleans()):
        ckpt.write_duration.CopyFrom(draw(_duration(low_us=0, high_us=2**53 + 10)))
    return ckpt


def _committed(draw: st.DrawFn) -> pb.ArtifactCommitted:
    return pb.ArtifactCommitted(
        name=draw(_ID),
        path=draw(_NAME),
        size_bytes=draw(_INT64),
        blake3_hex=draw(_HEX),
        media_type=draw(_TEXT),
        rank=draw(st.integers(0, 65535)),
        version_id=draw(_TEXT),
        etag=draw(_TEXT),
        read_back=draw(st.sampled_from(["", "size_etag", "digest"])),
    )


def _verified(draw: st.DrawFn) -> pb.ArtifactVerified:
    failed = draw(st.booleans())
    return pb.ArtifactVerified(
        name=draw(_ID),
        path=draw(_NAME),
        blake3_hex=draw(_HEX),
        result=pb.VERIFICATION_RESULT_FAILED if failed else pb.VERIFICATION_RESULT_PASSED,
        reason=draw(_NAME if failed else _TEXT),
        detail=draw(_TEXT),
        version_id=draw(_TEXT),
    )


def _failed(draw: st.DrawFn) -> pb.AttemptFailed:
    diagnostics = draw(st.booleans())
    tags = [v.number for v in pb.FailureTag.DESCRIPTOR.values if v.number]
    return pb.AttemptFailed(
        tag=draw(st.sampled_from(tags)),  # type: ignore[arg-type]
        message=draw(_TEXT),
        diagnostics_path=draw(_NAME) if diagnostics else "",
        diagnostics_blake3_hex=draw(_HEX) if diagnostics else "",
        rank=draw(st.integers(0, 65535)),
    )


def _closed(draw: st.DrawFn) -> pb.RunSubmissionClosed:
    close = pb.RunSubmissionClosed(
        reason=draw(_TEXT), expected_shards=draw(st.integers(0, 2**31 - 1))
    )
    if draw(st.booleans()):
        close.submitted_until.CopyFrom(draw(_timestamp()))
    return close


_PAYLOADS: dict[str, Callable[[st.DrawFn], Any]] = {
    "planned": _planned,
    "started": _started,
    "heartbeat": _heartbeat,
    "checkpoint": _checkpoint,
    "artifact_committed": _committed,
    "verified": _verified,
    "failed": _failed,
    "submission_closed": _closed,
    "run_reopened": lambda draw: pb.RunReopened(reason=draw(_TEXT)),
}


@st.composite
def events(draw: st.DrawFn) -> pb.ShardEvent:
    """Returns a valid event of any kind, every optional field set or not."""
    kind = draw(st.sampled_from(sorted(_PAYLOADS)))
    run_level = kind in ("submission_closed", "run_reopened")
    msg = pb.ShardEvent(
        event_id=draw(_ID),
        namespace=draw(st.sampled_from(["", "default", "team-a"])),
        run_id=draw(_ID),
        shard_id="" if run_level else draw(_ID),
        attempt_id="" if run_level or kind == "planned" else draw(_ID),
    )
    if draw(st.booleans()):
        msg.client_time.CopyFrom(draw(_timestamp()))
    getattr(msg, kind).CopyFrom(_PAYLOADS[kind](draw))
    return msg
