"""The canonical row bytes, their hash chain and the one walker that re-checks it.

The canonical bytes of a row are what the hash chain and the Merkle tree commit
to, so their encoding never changes within a contract version. Pure: no grpc,
protobuf or SQL.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final

import blake3

from ledger_server.events import PAYLOAD_TYPES, Event, RecordedEvent
from ledger_server.store.base import StoredEvent

GENESIS_HASH: Final = bytes(32)


def row_bytes(event: Event, *, run_sequence: int, receive_time_us: int) -> bytes:
    """Returns the canonical row bytes of an event; the global sequence is left out."""
    return encode_row(
        event.content_json(), run_sequence=run_sequence, receive_time_us=receive_time_us
    )


def encode_row(content_json: str, *, run_sequence: int, receive_time_us: int) -> bytes:
    """Returns the canonical row bytes around an event's canonical content JSON.

    The row is the canonical JSON of {"event": content, "receive_time_us": .., "run_sequence": ..};
    its keys sort in that order, so the event's own canonical JSON is spliced in unchanged
    instead of being encoded a second time. The global sequence is left out so runs stay
    portable.
    """
    return (
        f'{{"event":{content_json},"receive_time_us":{int(receive_time_us)},'
        f'"run_sequence":{int(run_sequence)}}}'
    ).encode()


def chain_hash(prev_hash: bytes, row: bytes) -> bytes:
    """Returns blake3(prev_hash || row)."""
    return blake3.blake3(prev_hash + row).digest()


_RAW_DECODE: Final = json.JSONDecoder().raw_decode


def parse_row(row: bytes) -> Any:
    """Parses a stored row's canonical JSON into plain dicts and lists."""
    # json.loads(bytes) sniffs the encoding and strips whitespace with regexes on every call;
    # a row is UTF-8 with no whitespace around it, so the scanner is called directly. Any
    # text after the value is refused, as json.loads would.
    text = row.decode("utf-8")
    value, end = _RAW_DECODE(text)
    if end != len(text):
        raise ValueError(f"extra data after the row's JSON value at {end}")
    return value


def event_from_row(row: bytes) -> tuple[Event, int, int]:
    """Parses canonical row bytes back into (event, run_sequence, receive_time_us)."""
    return event_from_parsed(parse_row(row))


def event_from_parsed(outer: Any) -> tuple[Event, int, int]:
    """Builds (event, run_sequence, receive_time_us) from a row parse_row() returned."""
    data = outer["event"]
    kind = data["kind"]
    payload_data = dict(data["payload"])
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
        client_time_us=data["client_time_us"],
        payload=payload,
    )
    return event, outer["run_sequence"], outer["receive_time_us"]


def recorded(stored: StoredEvent) -> RecordedEvent:
    """Decodes a stored row into a RecordedEvent."""
    event, run_sequence, receive_time_us = event_from_row(stored.row)
    return RecordedEvent(event, stored.sequence, run_sequence, receive_time_us, stored.row_hash)


@dataclass(slots=True)
class ChainWalker:
    """Recomputes one run's hash chain row by row: what every chain check walks with.

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
