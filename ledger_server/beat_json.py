"""The canonical content JSON of a heartbeat, written field by field.

Most of a night's events are heartbeats, and their content's RFC 8785 text is what
validation computes for each. The generic path builds the content dict, walks it for
floats JCS writes otherwise than Python, and runs the C encoder with sorted keys; a
heartbeat's shape is fixed, so its text can be written directly in its keys' sorted
order. It must be byte for byte what `content_jcs(event.content())` gives (stored rows
and their hash chain depend on it): tests/server/test_beat_json.py checks that on
random heartbeats, and a heartbeat this module would have to guess about (a non-ASCII
metric name, a field it does not know) gets None, and the generic path.

Pure: no grpc, protobuf or SQL.
"""

from __future__ import annotations

import json
from typing import Final

from ledger_server.events import _FIELD_NAMES, _LATER_FIELDS, Event, Heartbeat
from shard_client.canonical import MAX_SAFE_INTEGER, jcs_number

__all__ = ["heartbeat_jcs"]

# What a JSON string is, as the C encoder writes it with ensure_ascii=False.
_QUOTE: Final = json.encoder.encode_basestring
# The fields this module writes, in the dataclass's order, and those left out when unset.
_KNOWN_FIELDS: Final = (
    "step",
    "progress",
    "metrics",
    "nonfinite_metrics",
    "rank",
    "rank_finished",
    "first_step",
    "metrics_min",
    "metrics_max",
    "progress_calls",
)
_KNOWN_LATER: Final = (
    "nonfinite_metrics",
    "rank",
    "rank_finished",
    "first_step",
    "metrics_min",
    "metrics_max",
    "progress_calls",
)
# A field added to Heartbeat turns this path off (every heartbeat takes the generic one)
# until it is taught the field: a guessed encoding would change stored bytes.
_ENABLED: Final = (
    _FIELD_NAMES[Heartbeat] == _KNOWN_FIELDS and _LATER_FIELDS[Heartbeat] == _KNOWN_LATER
)


def _int(value: int) -> str:
    # Past 2**53 a JCS number cannot hold it: a decimal string, as content_jcs writes it.
    return str(value) if -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER else f'"{value}"'


def _metrics(values: dict[str, float]) -> str | None:
    """Returns a metric map's JCS text, or None for a name whose order JCS may see otherwise."""
    if not values:
        return "{}"
    parts = []
    for name in sorted(values):
        value = values[name]
        # ASCII names sort alike by code point and by UTF-16 unit; others go the generic
        # way, as does a value that is not a float (an in-process caller's int, say).
        if not name.isascii() or type(value) is not float:
            return None
        parts.append(f"{_QUOTE(name)}:{jcs_number(value)}")
    return "{" + ",".join(parts) + "}"


def _later_payload(p: Heartbeat, metrics: str) -> str | None:
    """Returns a heartbeat payload's members with its set later fields, keys sorted."""
    # The payload's keys in sorted order; the later fields only when set.
    fields = []
    if p.first_step:
        fields.append(f'"first_step":{_int(p.first_step)}')
    fields.append(f'"metrics":{metrics}')
    for key, extremes in (("metrics_max", p.metrics_max), ("metrics_min", p.metrics_min)):
        if extremes:
            text = _metrics(extremes)
            if text is None:
                return None
            fields.append(f'"{key}":{text}')
    if p.nonfinite_metrics:
        if not all(name.isascii() for name in p.nonfinite_metrics):
            return None
        names = ",".join([_QUOTE(name) for name in p.nonfinite_metrics])
        fields.append(f'"nonfinite_metrics":[{names}]')
    fields.append(f'"progress":{jcs_number(p.progress)}')
    if p.progress_calls:
        fields.append(f'"progress_calls":{_int(p.progress_calls)}')
    if p.rank:
        fields.append(f'"rank":{_int(p.rank)}')
    if p.rank_finished:
        fields.append('"rank_finished":true')
    fields.append(f'"step":{_int(p.step)}')
    return ",".join(fields)


def heartbeat_jcs(event: Event, namespace: str) -> str | None:
    """Returns the RFC 8785 text of a heartbeat's content in a namespace, or None to use content_jcs.

    The event is one validation accepted and `namespace` its checked namespace (the
    event's own, or the default for an empty one): its ids are identifiers (check_id,
    check_namespace) that JSON writes without escapes, and its floats are finite.
    """
    p = event.payload
    if type(p) is not Heartbeat or not _ENABLED:
        return None
    # Protobuf gives these their schema types; an in-process caller may not (a bool is an
    # int to Python but true to JSON, an int progress has no float text): generic path.
    if (
        type(p.progress) is not float
        or type(p.step) is not int
        or type(event.client_time_us) is not int
        or type(p.rank_finished) is not bool
        or type(p.first_step) is not int
        or type(p.progress_calls) is not int
        or type(p.rank) is not int
    ):
        return None
    metrics = _metrics(p.metrics)
    if metrics is None:
        return None
    if (
        p.first_step
        or p.metrics_max
        or p.metrics_min
        or p.nonfinite_metrics
        or p.progress_calls
        or p.rank
        or p.rank_finished
    ):
        payload = _later_payload(p, metrics)
        if payload is None:
            return None
    else:  # A plain heartbeat (no later field set): three keys.
        payload = f'"metrics":{metrics},"progress":{jcs_number(p.progress)},"step":{_int(p.step)}'
    return (
        f'{{"attempt_id":"{event.attempt_id}","client_time_us":{_int(event.client_time_us)},'
        f'"event_id":"{event.event_id}","kind":"heartbeat","namespace":"{namespace}",'
        f'"payload":{{{payload}}},"run_id":"{event.run_id}",'
        f'"shard_id":"{event.shard_id}"}}'
    )
