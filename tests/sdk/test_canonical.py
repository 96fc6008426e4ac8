"""RFC 8785 as the contract states it: the fast path is JCS, and the test vectors reproduce.

The vectors (tests/data/contract_vectors.json, docs/contract.md) are what any other
language's client must compute too; examples/go checks the same file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import blake3
import pytest
import rfc8785
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ledger_server.chain import (
    GENESIS_HASH,
    chain_hash,
    decode_row,
    encode_parsed_row,
    encode_row,
    parse_row,
    row_bytes,
)
from ledger_server.events import ROW_FORMAT, ROW_FORMAT_LEGACY, content_jcs
from shard_client.canonical import (
    MAX_SAFE_INTEGER,
    canonical_json,
    digest_fields,
    fingerprint_digest,
    legacy_json,
)
from shard_client.ids import PlanEntry, plan_event_id, shard_id_for
from tools.gen.contract_vectors import render

VECTORS_PATH = Path(__file__).parents[1] / "data" / "contract_vectors.json"
VECTORS: dict[str, Any] = json.loads(VECTORS_PATH.read_text(encoding="utf-8"))

# JSON values as any decoder could hand them over: every float, integers on both sides of
# 2**53, text with every plane (surrogates excluded: they are not Unicode scalar values).
_TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=8)
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**60), 2**60)
    | st.integers(-MAX_SAFE_INTEGER, MAX_SAFE_INTEGER)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([1e-7, 1e-5, 1e16, 1e21, -0.0, 5e-324, 2.0**53, 1.5e300, 0.1])
    | _TEXT
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=24,
)


@settings(max_examples=800, deadline=None)
@given(_VALUES)
def test_the_fast_path_is_rfc8785(value: Any) -> None:
    try:
        expected = rfc8785.dumps(value)
    except rfc8785.CanonicalizationError:
        with pytest.raises(ValueError):
            canonical_json(value)
        return
    assert canonical_json(value).encode() == expected


@settings(max_examples=800, deadline=None)
@given(_VALUES, st.integers(1, 2**53), st.integers(0, 2**53))
# RFC 8785 writes 2.0**64 as "18446744073709552000": json reads an int, orjson a float.
@example(2.0**64, 1, 0)
@example([-(2.0**63) * 4, {"x": 1e20}], 1, 0)
def test_a_stored_row_parses_to_what_the_json_module_reads(
    value: Any, run_sequence: int, receive_us: int
) -> None:
    """parse_row reads format-2 rows with orjson: the values must be the json module's, exactly."""
    try:
        content = canonical_json({"payload": value})
    except ValueError:
        return  # not storable (an integer past 2**53 outside the typed fields)
    for row_format in (ROW_FORMAT, ROW_FORMAT_LEGACY):
        row = encode_row(
            content, run_sequence=run_sequence, receive_time_us=receive_us, row_format=row_format
        )
        parsed, expected = parse_row(row), json.loads(row)
        assert parsed == expected
        # == says 1 == 1.0 and 0.0 == -0.0: the types and signs must match too.
        assert repr(parsed) == repr(expected)


def test_a_row_orjson_refuses_is_parsed_or_refused_by_the_json_module() -> None:
    # A float past the double range: json reads infinity, as before the fast path.
    assert parse_row(b'{"event":1e400,"v":2}') == {"event": float("inf"), "v": 2}
    with pytest.raises(ValueError, match="Expecting"):
        parse_row(b'{"event":,"v":2}')
    with pytest.raises(ValueError, match="extra data"):
        parse_row(b'{"a":1} {"event":1,"v":2}')


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_TEXT, st.floats(allow_nan=False, allow_infinity=False), max_size=6))
def test_a_heartbeats_metrics_map_encodes_as_rfc8785(metrics: dict[str, float]) -> None:
    assert canonical_json({"metrics": metrics, "progress": 1.0}).encode() == rfc8785.dumps(
        {"metrics": metrics, "progress": 1.0}
    )


def test_nan_and_infinity_are_refused() -> None:
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError):
            canonical_json({"x": bad})


def test_the_vector_file_is_what_the_implementation_computes() -> None:
    assert VECTORS_PATH.read_text(encoding="utf-8") == render()


@pytest.mark.parametrize("case", VECTORS["jcs"], ids=lambda c: c["name"])
def test_jcs_vectors(case: dict[str, str]) -> None:
    assert canonical_json(json.loads(case["input"])) == case["output"]
    assert rfc8785.dumps(json.loads(case["input"])).decode() == case["output"]


def test_known_rfc8785_numbers_by_hand() -> None:
    # ECMAScript's Number.prototype.toString, as RFC 8785 section 3.2.2.3 requires.
    assert canonical_json([1.0, 1e-7, 1e21, 1e20, -0.0, 0.000001]) == (
        "[1,1e-7,1e+21,100000000000000000000,0,0.000001]"
    )
    assert canonical_json({"\ufb01": 1, "\U0001f600": 2}) == '{"\U0001f600":2,"\ufb01":1}'
    assert legacy_json([1.0, 1e-7]) == "[1.0,1e-07]"  # row format 1 keeps Python's repr


@pytest.mark.parametrize("case", VECTORS["jcs_refused"], ids=lambda c: c["name"])
def test_refused_vectors(case: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        canonical_json(json.loads(case["input"]))


@pytest.mark.parametrize("case", VECTORS["shard_ids"], ids=lambda c: c["shard_id"])
def test_shard_id_vectors(case: dict[str, str]) -> None:
    params = json.loads(case["params"])
    assert canonical_json(params) == case["canonical_params"]
    assert case["material"] == f"{case['input_blake3']}\n{case['canonical_params']}"
    digest = blake3.blake3(case["material"].encode()).hexdigest()
    assert case["shard_id"] == "s-" + digest[:32]
    assert shard_id_for(input_blake3=case["input_blake3"], params=params) == case["shard_id"]


def test_a_float_param_written_either_way_is_one_shard() -> None:
    digest = "d" * 64
    one = shard_id_for(input_blake3=digest, params=json.loads('{"lr": 1.0, "eps": 1e-07}'))
    other = shard_id_for(input_blake3=digest, params=json.loads('{"eps": 1e-7, "lr": 1}'))
    assert one == other


@pytest.mark.parametrize("case", VECTORS["plan_events"], ids=lambda c: c["event_id"])
def test_plan_event_vectors(case: dict[str, Any]) -> None:
    entry = PlanEntry(
        shard_id=case["shard_id"],
        input_ref=case["input_ref"],
        input_bytes=case["input_bytes"],
        input_blake3=case["input_blake3"],
        params=json.loads(case["params"]),
        expected_outputs=tuple(case["expected_outputs"]),
        plan_line=case["plan_line"],
        plan_index=case["plan_index"],
    )
    assert plan_event_id(case["run_id"], entry, namespace=case["namespace"]) == case["event_id"]
    digest = blake3.blake3(case["material"].encode()).hexdigest()
    assert case["event_id"] == "plan-" + digest[:32]


@pytest.mark.parametrize("case", VECTORS["fingerprint_digests"], ids=lambda c: c["digest"][:8])
def test_fingerprint_digest_vectors(case: dict[str, Any]) -> None:
    fields = case["fingerprint"]
    assert fingerprint_digest(fields) == case["digest"]
    assert fingerprint_digest(fields, legacy=True) == case["legacy_digest"]
    if fields:
        assert canonical_json(digest_fields(fields)) == case["covered"]
        assert blake3.blake3(case["covered"].encode()).hexdigest() == case["digest"]
    else:
        assert case["digest"] == ""  # no fingerprint, no group


def test_row_vectors_chain_and_decode() -> None:
    prev = GENESIS_HASH
    for case in VECTORS["rows"]:
        assert bytes.fromhex(case["prev_hash"]) == prev
        text = content_jcs(case["content"])
        assert text == case["content_canonical"]
        row = encode_row(
            text, run_sequence=case["run_sequence"], receive_time_us=case["receive_time_us"]
        )
        assert row.decode() == case["row"]
        prev = chain_hash(prev, row)
        assert prev.hex() == case["row_hash"]
        decoded = decode_row(row)
        assert decoded.row_format == ROW_FORMAT
        # Integers past 2**53 travel as strings and come back as the ints they were.
        assert json.loads(legacy_json(decoded.event.content())) == case["content"]
        again = row_bytes(
            decoded.event,
            run_sequence=decoded.run_sequence,
            receive_time_us=decoded.receive_time_us,
        )
        assert again == row
        assert encode_parsed_row(json.loads(row)) == row


def test_a_legacy_row_is_verified_by_its_own_encoding() -> None:
    case = VECTORS["legacy_rows"][0]
    row = case["row"].encode()
    assert chain_hash(bytes.fromhex(case["prev_hash"]), row).hex() == case["row_hash"]
    assert encode_parsed_row(json.loads(row)) == row  # 1.0 stays 1.0
    assert "v" not in json.loads(row)


def test_a_row_of_an_unknown_format_is_not_a_row() -> None:
    row = VECTORS["rows"][0]["row"].replace('"v":2', '"v":3').encode()
    with pytest.raises(ValueError, match="unknown row format 3"):
        decode_row(row)


def test_the_legacy_row_format_keeps_pythons_encoding() -> None:
    row = encode_row(
        legacy_json({"x": 1.0}), run_sequence=1, receive_time_us=2, row_format=ROW_FORMAT_LEGACY
    )
    assert row == b'{"event":{"x":1.0},"receive_time_us":2,"run_sequence":1}'
