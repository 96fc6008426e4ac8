"""docs/contract.md's field tables are the proto's fields under events.py's rules, and the code's.

A proto field without a rule fails here, so a field cannot ship without one; each
rule is checked against what the server's codec and events.py write, field by field;
and the event-row vectors (every kind, every field unset and set) reproduce through
the server's own path, there and back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format
from google.protobuf.message import Message

from ledger_server.chain import (
    GENESIS_HASH,
    chain_hash,
    decode_row,
    encode_parsed_row,
    encode_row,
    parse_row,
    row_bytes,
)
from ledger_server.codec import decode_event, encode_event
from ledger_server.errors import InvalidEvent
from ledger_server.events import Event, Heartbeat, payload_dict
from ledger_server.validation import validate
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from tools.gen import contract_table as gen_contract_table
from tools.gen.contract_vectors import EVENT_CASES

VECTORS: dict[str, Any] = json.loads(
    (Path(__file__).parents[1] / "data" / "contract_vectors.json").read_text(encoding="utf-8")
)
_EVENT_ROWS: list[dict[str, Any]] = VECTORS["event_rows"]
# The row hashes of the vectors that predate event_rows: ledgers hold rows like them.
_PINNED_ROW_HASHES = {
    "rows": [
        "eed51ed7c836af99dc1e226ab7e3a97e7bc5845bf0c1362b122d5ecc6f0934fb",
        "6bd90429439ee10ec9cfb9b8b2719be7b4697470d9a4da40fcbdb705e613b5d0",
        "d2d290ecbaf80ec2d7e4c7450ad6fb3ec304ef12dcfacddac1e0a92973faf0ad",
        "b52e63371174f174986d2170d3255f685f213ec8fad034ce1764cd7ccab0c5fb",
        "d411d01c532d4dd7e8cd2469f1e0edc4b6848045fc395a8c56001ca02fcd0003",
    ],
    "legacy_rows": ["a9441aae3d4f1a48f8410ecfef29677d0cd17667832603b1b2467e39f4434d48"],
}


def test_every_proto_field_has_a_rule_and_every_rule_a_field() -> None:
    assert gen_contract_table.problems() == []


def test_the_page_is_the_generated_one() -> None:
    text = gen_contract_table.DOC.read_text(encoding="utf-8")
    assert gen_contract_table.render(text) == text, "run: python -m tools.gen.contract_table"


def _set_case(kind: str) -> pb.ShardEvent:
    """Returns the vector of `kind` with every field set, as the proto message sent."""
    name = next(
        n
        for n, case in EVENT_CASES
        if n == f"{kind}: every field set"
        or (kind == "heartbeat" and n == "heartbeat: coalesced, every field set")
    )
    return json_format.ParseDict(dict(EVENT_CASES)[name], pb.ShardEvent())


def _cleared(msg: pb.ShardEvent, kind: str, proto: str) -> pb.ShardEvent:
    out = pb.ShardEvent()
    out.CopyFrom(msg)
    target: Message = getattr(out, kind)
    *path, name = proto.split(".")
    for part in path:
        target = getattr(target, part)
    target.ClearField(name)
    return out


@pytest.mark.parametrize("kind", list(gen_contract_table.kind_messages()))
def test_each_rule_is_what_the_codec_writes_while_the_field_is_unset(kind: str) -> None:
    full = _set_case(kind)
    rules = gen_contract_table.kind_rules(kind, gen_contract_table.kind_messages()[kind])
    written = payload_dict(decode_event(full).payload)
    # The vector sets every field: a new field needs a vector that sets it.
    assert sorted(written) == sorted(r.key for r in rules)
    for rule in rules:
        cleared = _cleared(full, kind, rule.proto)
        if rule.unset.startswith("refused"):
            with pytest.raises(InvalidEvent):
                validate(decode_event(cleared))
            continue
        keys = payload_dict(decode_event(cleared).payload)
        assert (rule.key in keys) == (rule.unset != "left out"), rule


def test_every_kind_has_an_unset_and_a_set_vector() -> None:
    names = {v["name"] for v in _EVENT_ROWS}
    for kind in gen_contract_table.kind_messages():
        assert any(n.startswith(f"{kind}: every") and "unset" in n for n in names), kind
        assert any(n.startswith(f"{kind}: ") and "every field set" in n for n in names), kind


@pytest.mark.parametrize("vector", _EVENT_ROWS, ids=lambda v: v["name"])
def test_event_row_vectors_reproduce_there_and_back(vector: dict[str, Any]) -> None:
    sent = json_format.ParseDict(vector["event"], pb.ShardEvent())
    valid = validate(decode_event(sent))
    assert valid.canonical == vector["content_canonical"]
    assert valid.event.kind == vector["kind"]
    row = encode_row(
        valid.canonical,
        run_sequence=vector["run_sequence"],
        receive_time_us=vector["receive_time_us"],
    )
    assert row.decode() == vector["row"]
    assert chain_hash(bytes.fromhex(vector["prev_hash"]), row).hex() == vector["row_hash"]
    stored = json_format.ParseDict(vector["stored"], pb.ShardEvent())
    # Read back: the stored row is the stored event, and re-derives to its own bytes.
    decoded = decode_row(row)
    assert (decoded.run_sequence, decoded.receive_time_us) == (
        vector["run_sequence"],
        vector["receive_time_us"],
    )
    assert encode_event(decoded.event) == stored
    again = row_bytes(
        decoded.event,
        run_sequence=decoded.run_sequence,
        receive_time_us=decoded.receive_time_us,
    )
    assert again == row


def test_the_event_rows_chain_from_genesis() -> None:
    prev = GENESIS_HASH.hex()
    for vector in _EVENT_ROWS:
        assert vector["prev_hash"] == prev, vector["name"]
        prev = vector["row_hash"]


def test_the_earlier_row_vectors_keep_their_bytes() -> None:
    for section, hashes in _PINNED_ROW_HASHES.items():
        assert [v["row_hash"] for v in VECTORS[section]] == hashes, section


# --- rows the implementation once disagreed with itself on -----------------------
# An integral double past 2**53 is written without an exponent and parses as an int:
# decoding and re-encoding give it back as the double it was. Only "v":2 is format 2.


def _coalesced_beat(
    *, metrics: dict[str, float] | None = None, metrics_max: dict[str, float] | None = None
) -> Event:
    beat = Heartbeat(
        step=2,
        progress=0.5,
        metrics=metrics or {"m": 1.0},
        first_step=1,
        metrics_max=metrics_max or {},
        progress_calls=2,
    )
    return Event("e", "default", "r", "s", "a", 0, beat)


def test_a_row_whose_metric_extreme_is_an_integral_double_past_2_53_rederives() -> None:
    row = row_bytes(_coalesced_beat(metrics_max={"m": 2.0**60}), run_sequence=1, receive_time_us=1)
    decoded = decode_row(row)
    assert row_bytes(decoded.event, run_sequence=1, receive_time_us=1) == row


def test_a_parsed_row_with_an_integral_double_past_2_53_reencodes() -> None:
    row = row_bytes(_coalesced_beat(metrics={"m": 1e20}), run_sequence=1, receive_time_us=1)
    assert encode_parsed_row(parse_row(row)) == row


def test_a_row_with_v_0_is_not_a_row() -> None:
    row = VECTORS["rows"][0]["row"].replace('"v":2', '"v":0').encode()
    with pytest.raises(ValueError, match="unknown row format"):
        decode_row(row)
