"""A heartbeat's content text written directly is the generic RFC 8785 text, byte for byte.

`validate` takes heartbeats past the content dict and the generic encoder
(ledger_server.beat_json); the row bytes and the hash chain are computed over that
text, so any heartbeat whose text differs from `content_jcs(event.content())` would
store other bytes than the contract vectors say. Random heartbeats, edge numbers
included, check that, and that the cases the direct path cannot judge fall back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger_server.beat_json import heartbeat_jcs
from ledger_server.chain import chain_hash, encode_row, event_from_row
from ledger_server.errors import InvalidEvent
from ledger_server.events import Event, Heartbeat, content_jcs
from ledger_server.validation import validate
from shard_client.canonical import MAX_SAFE_INTEGER

VECTORS = Path(__file__).parents[1] / "data" / "contract_vectors.json"
# Numbers whose RFC 8785 text differs from Python's repr, or sits at an edge of it.
EDGE_FLOATS = (
    0.0,
    -0.0,
    1.0,
    -3.0,
    1e-4,
    9.999e-5,
    1e-7,
    5e-324,
    0.1,
    1e16,
    2.0**53,
    2.0**53 + 2,
    1e21,
    1e22,
    -1.7976931348623157e308,
    123456.789,
)
floats = st.one_of(st.sampled_from(EDGE_FLOATS), st.floats(allow_nan=False, allow_infinity=False))
ints = st.one_of(
    st.integers(0, 10),
    st.integers(0, 2**63 - 1),
    st.sampled_from((MAX_SAFE_INTEGER, MAX_SAFE_INTEGER + 1)),
)
names = st.one_of(
    st.sampled_from(("loss", "lr", "a", "B", "a.b", 'q"uote', "back\\slash", "tab\t", "é")),
    st.text(min_size=1, max_size=8),
)
metric_maps = st.dictionaries(names, floats, max_size=5)
ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:@+=/-]{0,12}", fullmatch=True)


@st.composite
def heartbeats(draw: st.DrawFn) -> Event:
    step = draw(ints)
    calls = draw(st.sampled_from((0, 0, 1, 7, MAX_SAFE_INTEGER + 5)))
    low = draw(metric_maps) if calls else {}
    high = {k: v + abs(v) + 1.0 for k, v in low.items()}
    payload = Heartbeat(
        step=step,
        progress=draw(st.sampled_from((0.0, 0.5, 1.0, 1e-5, 0.333))),
        metrics=draw(metric_maps),
        nonfinite_metrics=tuple(draw(st.lists(names, max_size=3))),
        rank=draw(st.sampled_from((0, 0, 1, 63))),
        rank_finished=draw(st.booleans()),
        first_step=draw(st.integers(0, step)) if calls else 0,
        metrics_min=low,
        metrics_max={k: v for k, v in high.items() if v != float("inf")},
        progress_calls=calls,
    )
    return Event(
        event_id=draw(ids),
        namespace=draw(st.sampled_from(("default", "team-a", ""))),
        run_id=draw(ids),
        shard_id=draw(ids),
        attempt_id=draw(ids),
        client_time_us=draw(st.sampled_from((0, 1_765_000_000_123_456, MAX_SAFE_INTEGER + 1))),
        payload=payload,
    )


@settings(max_examples=300, deadline=None)
@given(heartbeats())
def test_direct_heartbeat_text_is_the_generic_rfc8785_text(event: Event) -> None:
    try:
        checked = validate(event)
    except InvalidEvent:
        return  # a heartbeat validation refuses (e.g. extremes that cross) is stored nowhere
    assert checked.canonical == content_jcs(checked.event.content())
    direct = heartbeat_jcs(checked.event, checked.event.namespace)
    assert direct is None or direct == checked.canonical


def test_common_heartbeat_takes_the_direct_path() -> None:
    event = Event(
        "e-1",
        "default",
        "r",
        "s1",
        "a",
        1_765_000_000_000_000,
        Heartbeat(step=3, progress=0.5, metrics={"loss": 0.1, "lr": 3e-05}),
    )
    assert heartbeat_jcs(event, event.namespace) == content_jcs(event.content())
    assert heartbeat_jcs(event, event.namespace) is not None


@pytest.mark.parametrize(
    "payload",
    [
        Heartbeat(1, 1, {"loss": 0.5}),  # an int progress
        Heartbeat(1, 0.5, {"lr": 1}),  # an int metric value
        Heartbeat(True, 0.5, {}),  # a bool step
        Heartbeat(1, 0.5, {}, rank=1, rank_finished=1),  # type: ignore[arg-type]
    ],
)
def test_an_in_process_caller_s_other_types_take_the_generic_path(payload: Heartbeat) -> None:
    event = Event("e-1", "default", "r", "s1", "a", 0, payload)
    assert heartbeat_jcs(event, "default") is None
    assert validate(event).canonical == content_jcs(event.content())


@pytest.mark.parametrize("name", ["é", "\U0001f600", "\ud800"])
def test_a_non_ascii_metric_name_takes_the_generic_path(name: str) -> None:
    event = Event("e-1", "default", "r", "s1", "a", 0, Heartbeat(1, 0.5, {name: 1.5}))
    assert heartbeat_jcs(event, event.namespace) is None


def _vector_rows() -> list[dict[str, Any]]:
    data = json.loads(VECTORS.read_text(encoding="utf-8"))
    rows: list[dict[str, Any]] = [*data["rows"], *data["event_rows"]]
    return [r for r in rows if '"kind":"heartbeat"' in r["row"]]


@pytest.mark.parametrize("vector", _vector_rows(), ids=lambda v: v.get("name", "row"))
def test_contract_vector_heartbeats_validate_to_their_stored_row(vector: dict[str, Any]) -> None:
    event, run_sequence, receive_us = event_from_row(vector["row"].encode())
    checked = validate(event)
    assert checked.canonical == vector["content_canonical"]
    row = encode_row(checked.canonical, run_sequence=run_sequence, receive_time_us=receive_us)
    assert row.decode() == vector["row"]
    assert chain_hash(bytes.fromhex(vector["prev_hash"]), row).hex() == vector["row_hash"]
