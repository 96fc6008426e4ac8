"""validate() names the field and the problem of each malformed event, without a server."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from ledger_server.errors import InvalidEvent, LimitExceeded
from ledger_server.events import (
    AttemptFailed,
    Event,
    Heartbeat,
    RunReopened,
    ShardPlanned,
    SubmissionClosed,
)
from ledger_server.validation import MAX_PAYLOAD_BYTES, validate

DIGEST = "cd" * 32
PLAN = ShardPlanned(
    input_ref="file:///data/0",
    input_bytes=1,
    input_blake3="",
    params_json="",
    expected_outputs=("model",),
    plan_line="",
    plan_index=0,
)
BEAT = Heartbeat(step=1, progress=0.5, metrics={})


def _event(payload: Any = BEAT, **fields: Any) -> Event:
    base = Event("ev-1", "", "run-1", "shard-1", "a1", 1, payload)
    return dataclasses.replace(base, **fields)


BAD: list[tuple[Event, str, str]] = [
    (_event(event_id=""), "event_id", "must not be empty"),
    (_event(event_id="x" * 129), "event_id", "longer than 128 characters"),
    (_event(event_id="-lead"), "event_id", "must start with a letter or digit"),
    (_event(namespace="Team"), "namespace", "must be 1-63 lowercase letters"),
    (_event(run_id="has space"), "run_id", "must start with a letter or digit"),
    (_event(shard_id=""), "shard_id", "must not be empty"),
    (_event(client_time_us=-1), "client_time", "must not be before 1970"),
    (_event(client_time_us=253_402_300_800_000_000), "client_time", "before the year 10000"),
    (_event(PLAN), "attempt_id", "must be empty for a planned event"),
    (_event(BEAT, attempt_id=""), "attempt_id", "must not be empty"),
    (_event(Heartbeat(1, 1.5, {})), "heartbeat.progress", "must be a number in [0, 1]"),
    (_event(Heartbeat(1, 0.5, {"loss": float("nan")})), "heartbeat.metrics", "must be finite"),
    (_event(Heartbeat(-1, 0.5, {})), "heartbeat.step", "must not be negative"),
    # The summary carries it as int32: 3e9 would make every GetRunSummary of the run fail.
    (
        _event(SubmissionClosed(expected_shards=3_000_000_000), shard_id="", attempt_id=""),
        "submission_closed.expected_shards",
        "must be between 0 and 2147483647",
    ),
    # A reopen is run-level, as a close, and its reason has a close's limit.
    (_event(RunReopened("late"), attempt_id=""), "shard_id", "must be empty (with attempt_id)"),
    (
        _event(RunReopened("x" * 1025), shard_id="", attempt_id=""),
        "run_reopened.reason",
        "longer than 1024 characters",
    ),
    (
        _event(Heartbeat(1, 0.5, {}, first_step=2, progress_calls=2)),
        "heartbeat.first_step",
        "must be in [0, step]",
    ),
    (
        _event(Heartbeat(1, 0.5, {}, metrics_min={"loss": 1.0})),
        "heartbeat.progress_calls",
        "must be >= 1 when first_step or metric extremes are set",
    ),
    (
        _event(
            Heartbeat(
                1, 0.5, {}, metrics_min={"loss": 2.0}, metrics_max={"loss": 1.0}, progress_calls=2
            )
        ),
        "heartbeat.metrics_min",
        "'loss' is above its maximum",
    ),
    (
        _event(Heartbeat(1, 0.5, {}, metrics_max={"loss": float("inf")}, progress_calls=2)),
        "heartbeat.metrics_max",
        "must be finite",
    ),
    (_event(AttemptFailed("cosmic-ray", "")), "failed.tag", "must be one of oom, timeout"),
    (
        _event(dataclasses.replace(PLAN, expected_outputs=("a", "a")), attempt_id=""),
        "planned.expected_outputs",
        "names must be unique",
    ),
    (
        _event(dataclasses.replace(PLAN, params_json="[1]"), attempt_id=""),
        "planned.params_json",
        "must be a JSON object",
    ),
    (
        _event(dataclasses.replace(PLAN, input_blake3="ABC"), attempt_id=""),
        "planned.input_blake3",
        "must be a blake3 digest",
    ),
]


@pytest.mark.parametrize(
    ("event", "field", "problem"), BAD, ids=[f"{b[1]}-{n}" for n, b in enumerate(BAD)]
)
def test_a_bad_field_is_refused_with_its_name_and_problem(
    event: Event, field: str, problem: str
) -> None:
    with pytest.raises(InvalidEvent) as caught:
        validate(event)
    assert caught.value.field == field
    assert problem in caught.value.message
    assert caught.value.reason == "INVALID_FIELD"


def test_an_event_over_the_size_limit_is_refused_as_a_limit() -> None:
    metrics = {f"{i:03d}" + "m" * 250: 1.0 for i in range(256)}  # each key within its limit
    with pytest.raises(LimitExceeded) as caught:
        validate(_event(Heartbeat(1, 0.5, metrics)))
    assert caught.value.metadata["limit"] == "event_bytes"
    assert caught.value.metadata["maximum"] == str(MAX_PAYLOAD_BYTES)


def test_a_valid_event_is_returned_unchanged_with_its_canonical_json() -> None:
    event = _event(namespace="team-a")
    valid = validate(event)
    assert valid.event is event
    assert valid.canonical == event.content_json()
    assert valid.canonical.startswith('{"attempt_id":"a1","client_time_us":1,')


def test_defaults_and_normal_forms_are_applied_in_a_new_event() -> None:
    event = _event(dataclasses.replace(PLAN, params_json='{ "b": 1, "a": 2 }'), attempt_id="")
    valid = validate(event)
    assert valid.event.namespace == "default"
    assert isinstance(valid.event.payload, ShardPlanned)
    assert valid.event.payload.params_json == '{"a":2,"b":1}'
    assert valid.canonical == valid.event.content_json()
    assert event.namespace == ""  # the submitted event is left as it was


def test_a_plain_heartbeat_keeps_its_canonical_json_and_a_coalesced_one_adds_its_interval() -> None:
    plain = validate(_event(BEAT)).canonical
    assert '"payload":{"metrics":{},"progress":0.5,"step":1}' in plain
    beat = Heartbeat(
        9,
        0.5,
        {"loss": 0.2},
        first_step=3,
        metrics_min={"loss": 0.1},
        metrics_max={"loss": 0.4},
        progress_calls=7,
    )
    coalesced = validate(_event(beat)).canonical
    assert (
        '"payload":{"first_step":3,"metrics":{"loss":0.2},"metrics_max":{"loss":0.4},'
        '"metrics_min":{"loss":0.1},"progress":0.5,"progress_calls":7,"step":9}'
    ) in coalesced
