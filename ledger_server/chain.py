"""The canonical row bytes, their hash chain and the one walker that re-checks it.

The canonical bytes of a row are what the hash chain and the Merkle tree commit
to, so their encoding never changes within a contract version. Pure: no grpc,
protobuf or SQL.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

import blake3
import orjson

from ledger_server.events import (
    PAYLOAD_TYPES,
    ROW_FORMAT,
    ROW_FORMAT_LEGACY,
    Event,
    Heartbeat,
    RecordedEvent,
    float_fields,
    int_fields,
)
from ledger_server.store.base import StoredEvent
from shard_client.canonical import MAX_SAFE_INTEGER, canonical_json, legacy_json

GENESIS_HASH: Final = bytes(32)


class DecodedRow(NamedTuple):
    """A stored row parsed back: its event, its place in the run, and its row format."""

    event: Event
    run_sequence: int
    receive_time_us: int
    row_format: int


def row_bytes(
    event: Event, *, run_sequence: int, receive_time_us: int, row_format: int = ROW_FORMAT
) -> bytes:
    """Returns the canonical row bytes of an event; the global sequence is left out."""
    return encode_row(
        event.content_json(row_format),
        run_sequence=run_sequence,
        receive_time_us=receive_time_us,
        row_format=row_format,
    )


def _number(value: int) -> str:
    """Returns an integer's JSON text in row format 2: a decimal string past +-(2**53 - 1)."""
    # Called twice for every appended row: inline what safe_int decides.
    if type(value) is not int:
        value = int(value)
    return str(value) if -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER else f'"{value}"'


def encode_row(
    content_json: str, *, run_sequence: int, receive_time_us: int, row_format: int = ROW_FORMAT
) -> bytes:
    """Returns the canonical row bytes around an event's canonical content JSON.

    The row is the canonical JSON of {"event": content, "receive_time_us": ..,
    "run_sequence": .., "v": 2} (row format 2, RFC 8785) or of the same object without
    "v" (row format 1, Python's json); its keys sort in that order under both, so the
    event's own canonical JSON is spliced in unchanged instead of being encoded a second
    time. The global sequence is left out so runs stay portable.
    """
    if row_format == ROW_FORMAT_LEGACY:
        return (
            f'{{"event":{content_json},"receive_time_us":{int(receive_time_us)},'
            f'"run_sequence":{int(run_sequence)}}}'
        ).encode()
    return (
        f'{{"event":{content_json},"receive_time_us":{_number(receive_time_us)},'
        f'"run_sequence":{_number(run_sequence)},"v":{ROW_FORMAT}}}'
    ).encode()


def chain_hash(prev_hash: bytes, row: bytes) -> bytes:
    """Returns blake3(prev_hash || row)."""
    return blake3.blake3(prev_hash + row).digest()


_RAW_DECODE: Final = json.JSONDecoder().raw_decode
# How every row of format 2 ends (its keys sort "event", "receive_time_us", "run_sequence", "v").
_FORMAT_2_TAIL: Final = b',"v":2}'
# Every digit as "0", anything else as a space: a row whose text has a run of 19 digits
# may hold an integer literal beyond 64 bits, which orjson reads as a float.
_DIGITS_AS_ZERO: Final = bytes(48 if 48 <= i <= 57 else 32 for i in range(256))
_LONG_DIGIT_RUN: Final = b"0" * 19


def parse_row(row: bytes) -> Any:
    """Parses a stored row's canonical JSON into plain dicts and lists.

    A row of format 2 is parsed by orjson, ~2.5 times faster than the json module (a
    rebuild parses every row of a night): its numbers are exact there, because the
    format writes every integer past 2**53 as a decimal string and orjson parses
    integers exactly to 64 bits and floats to the nearest double, as json does. One
    exception: RFC 8785 writes an integral float below 1e21 without an exponent
    (2.0**64 is "18446744073709552000"), which json reads as an int and orjson, past 64
    bits, as a float; a row with a run of 19 digits anywhere goes to json (a cheap
    byte scan, about a quarter of orjson's parse). Any row orjson refuses (and every
    row of format 1, whose integers are not bounded) goes to the json module, which
    parses or refuses it as it always did.
    """
    if (
        row[:1] == b"{"
        and row.endswith(_FORMAT_2_TAIL)
        and _LONG_DIGIT_RUN not in row.translate(_DIGITS_AS_ZERO)
    ):
        try:
            return orjson.loads(row)
        except orjson.JSONDecodeError:
            pass  # the json scanner below says what is wrong, in its words
    # json.loads(bytes) sniffs the encoding and strips whitespace with regexes on every call;
    # a row is UTF-8 with no whitespace around it, so the scanner is called directly. Any
    # text after the value is refused, as json.loads would.
    text = row.decode("utf-8")
    value, end = _RAW_DECODE(text)
    if end != len(text):
        raise ValueError(f"extra data after the row's JSON value at {end}")
    return value


def row_format_of(outer: Any) -> int:
    """Returns the format of a parsed row: 1 without a "v" key, else its (known) value."""
    if "v" not in outer:
        return ROW_FORMAT_LEGACY
    version = outer["v"]
    # Format 1 has no "v"; every row with one is format 2 (docs/contract.md): 0, 1, a
    # negative or a later number is not a row this reader can vouch for.
    if type(version) is not int or version != ROW_FORMAT:
        raise ValueError(f"unknown row format {version!r}")
    return version


def encode_parsed_row(outer: Any) -> bytes:
    """Returns the row bytes of a parsed row, re-encoded by its own format's rules.

    Both encodings give back the bytes they were parsed from: Python's json round-trips
    Python's floats and ints exactly, and RFC 8785 output is RFC 8785 of its own parse.
    """
    if row_format_of(outer) == ROW_FORMAT_LEGACY:
        return legacy_json(outer).encode()
    return canonical_json(_integral_doubles(outer)).encode()


def _integral_doubles(value: Any) -> Any:
    """Returns a parsed format-2 value with each bare integer past 2**53 a float again.

    Format 2 writes every integer past 2**53 as a decimal string, so a bare number
    that large was a double written without an exponent (RFC 8785 writes 1e20 as
    100000000000000000000), which the parser read as an int. Its digits are the
    double's shortest form, so float() gives back that very double.
    """
    kind = type(value)
    if kind is int:
        return float(value) if not -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER else value
    if kind is dict:
        return {k: _integral_doubles(v) for k, v in value.items()}
    if kind is list:
        return [_integral_doubles(v) for v in value]
    return value


def event_from_row(row: bytes) -> tuple[Event, int, int]:
    """Parses canonical row bytes back into (event, run_sequence, receive_time_us)."""
    decoded = decode_parsed(parse_row(row))
    return decoded.event, decoded.run_sequence, decoded.receive_time_us


def decode_row(row: bytes) -> DecodedRow:
    """Parses canonical row bytes back into their event, place and row format."""
    return decode_parsed(parse_row(row))


def event_from_parsed(outer: Any) -> tuple[Event, int, int]:
    """Builds (event, run_sequence, receive_time_us) from a row parse_row() returned."""
    decoded = decode_parsed(outer)
    return decoded.event, decoded.run_sequence, decoded.receive_time_us


_INT_FIELDS: Final = {kind: int_fields(cls) for kind, cls in PAYLOAD_TYPES.items()}
_FLOAT_FIELDS: Final = {kind: float_fields(cls) for kind, cls in PAYLOAD_TYPES.items()}
_FLOAT_MAPS: Final = ("metrics", "metrics_min", "metrics_max")  # Heartbeat's dict[str, float]


def _as_int(value: Any) -> int:
    # Row format 2 writes integers past 2**53 as decimal strings; a row whose string is
    # not one fails here or, when re-derived, as not canonical.
    return int(value) if type(value) is str else value


def _typed(kind: str, payload_data: dict[str, Any]) -> None:
    """Gives row-format-2 numbers back their schema types (in place)."""
    for name in _INT_FIELDS[kind]:
        if type(payload_data.get(name)) is str:
            payload_data[name] = int(payload_data[name])
    for name in _FLOAT_FIELDS[kind]:
        if type(payload_data.get(name)) is int:  # RFC 8785 writes 1.0 as 1
            payload_data[name] = float(payload_data[name])
    if kind == Heartbeat.KIND:
        # Metric values are doubles; RFC 8785 writes an integral one as an integer.
        for name in _FLOAT_MAPS:
            if name in payload_data:
                payload_data[name] = {k: float(v) for k, v in payload_data[name].items()}


def decode_parsed(outer: Any) -> DecodedRow:
    """Builds a DecodedRow from a row parse_row() returned."""
    row_format = row_format_of(outer)
    data = outer["event"]
    kind = data["kind"]
    payload_data = dict(data["payload"])
    client_time_us = data["client_time_us"]
    run_sequence, receive_time_us = outer["run_sequence"], outer["receive_time_us"]
    if row_format != ROW_FORMAT_LEGACY:
        _typed(kind, payload_data)
        client_time_us = _as_int(client_time_us)
        run_sequence, receive_time_us = _as_int(run_sequence), _as_int(receive_time_us)
    if kind == "planned":
        payload_data["expected_outputs"] = tuple(payload_data["expected_outputs"])
    elif kind == "heartbeat" and "nonfinite_metrics" in payload_data:
        payload_data["nonfinite_metrics"] = tuple(payload_data["nonfinite_metrics"])
    payload = PAYLOAD_TYPES[kind](**payload_data)
    event = Event(
        event_id=data["event_id"],
        namespace=data["namespace"],
        run_id=data["run_id"],
        shard_id=data["shard_id"],
        attempt_id=data["attempt_id"],
        client_time_us=client_time_us,
        payload=payload,
    )
    return DecodedRow(event, run_sequence, receive_time_us, row_format)


def recorded(stored: StoredEvent) -> RecordedEvent:
    """Decodes a stored row into a RecordedEvent."""
    event, run_sequence, receive_time_us, row_format = decode_row(stored.row)
    return RecordedEvent(
        event, stored.sequence, run_sequence, receive_time_us, stored.row_hash, row_format
    )


@dataclass(slots=True)
class ChainWalker:
    """Recomputes one run's hash chain row by row: what every chain check walks with.

    (The rebuild's replay inlines `links` and `advance`: it calls them ten million
    times in a big night.)

    Each caller names a break in its own words, so the walker answers questions
    (is the row next? does it link?) and moves only when told the row is good.
    """

    head: bytes = GENESIS_HASH
    count: int = 0

    @property
    def expected(self) -> int:
        """Returns the run_sequence the next row must have."""
        return self.count + 1

    def in_order(self, run_sequence: int) -> bool:
        """Returns whether a row at run_sequence is the next one."""
        return run_sequence == self.count + 1

    def links(self, row: bytes, row_hash: bytes) -> bool:
        """Returns whether row_hash is blake3(head || row)."""
        return chain_hash(self.head, row) == row_hash

    def advance(self, row_hash: bytes) -> None:
        """Moves past a row that was checked: row_hash is the new head."""
        self.head = row_hash
        self.count += 1
