"""Writes docs/contract.md's generated sections: every field of every event as its row holds it.

    python -m tools.gen.contract_table            # rewrite the generated sections
    python -m tools.gen.contract_table --check    # exit 1 when they differ or a field has no rule

The tables are built from the proto's descriptors (ShardEvent, the message of each case
of its `payload` oneof and the messages those hold) and ledger_server/events.py's rules:
a payload field's row key is its domain field (its own name, or as `_row_key` says), and
it is left out while unset when events.py lists it in `_LATER_FIELDS`. `problems()`
names every proto field without a rule, every domain field without a proto field, and
every field written while unset that is not in FIRST_VERSION, so a field cannot ship
without a rule (tests/contract/test_contract_table.py). The worked examples are the
`event_rows` vectors of tests/data/contract_vectors.json.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, Final, NamedTuple, cast

from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor

from ledger_server.codec import decode_event
from ledger_server.errors import InvalidEvent
from ledger_server.events import (
    _LATER_FIELDS,
    INPUT_SEEN_FIELDS,
    PAYLOAD_TYPES,
    ArtifactVerified,
    AttemptFailed,
)
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.vocabulary import SCHEDULER_FIELDS

ROOT: Final = Path(__file__).resolve().parents[2]
DOC: Final = ROOT / "docs" / "contract.md"
VECTORS: Final = ROOT / "tests" / "data" / "contract_vectors.json"
SECTIONS: Final = ("fields", "examples")

# The fields of the first contract version, by kind: every row has them, set or not.
# Frozen: every field added since is left out while unset (events.py's _LATER_FIELDS),
# so the rows of events that leave it unset keep the bytes they had before it existed.
FIRST_VERSION: Final[dict[str, tuple[str, ...]]] = {
    "planned": (
        "input_ref",
        "input_bytes",
        "input_blake3",
        "params_json",
        "expected_outputs",
        "plan_line",
        "plan_index",
    ),
    "started": ("host", "pid", "heartbeat_timeout_us", "fingerprint", "fingerprint_digest"),
    "heartbeat": ("step", "progress", "metrics"),
    "checkpoint": ("step", "path", "size_bytes", "blake3_hex"),
    "artifact_committed": ("name", "path", "size_bytes", "blake3_hex", "media_type"),
    "verified": ("name", "path", "blake3_hex", "result", "reason", "detail"),
    "failed": ("tag", "message"),
    "submission_closed": (),
    "run_reopened": (),
}
# AttemptStarted.input (InputSeen) is flattened into the started payload under these keys.
INPUT_KEYS: Final = {
    "input_ref": "input_ref",
    "size_bytes": "input_bytes",
    "mtime_ns": "input_mtime_ns",
    "inode": "input_inode",
    "device": "input_device",
    "version_id": "input_version_id",
    "etag": "input_etag",
    "blake3_hex": "input_blake3",
}
# ShardEvent's own fields: (where the row holds it, its JSON, when unset).
ENVELOPE: Final[dict[str, tuple[str, str, str]]] = {
    "event_id": ("`event.event_id`", "string", "refused"),
    "namespace": ("`event.namespace`", "string", '`"default"`'),
    "run_id": ("`event.run_id`", "string", "refused"),
    "shard_id": ("`event.shard_id`", "string", '`""`: run-level kinds only'),
    "attempt_id": ("`event.attempt_id`", "string", '`""`: planned, verified, run-level kinds'),
    "client_time": ("`event.client_time_us`", "µs since 1970 (see Timestamp)", "`0`"),
    "sequence": ("not in the row", "output only: the global position", "—"),
    "run_sequence": ("`run_sequence`", "number; a decimal string past 2^53 − 1", "—"),
    "receive_time": ("`receive_time_us`", "µs since 1970; a decimal string past 2^53 − 1", "—"),
    "row_hash": ("not in the row", "output only: blake3(previous row hash ‖ row)", "—"),
    "row_format": ("`v`", "`2`; a row of format 1 has no `v`", "`0`: format 1"),
}
# A few first-version fields are not written as their type's zero while unset.
UNSET: Final[dict[str, str]] = {
    "ShardPlanned.params_json": '`"{}"`',
    "AttemptStarted.heartbeat_timeout": "refused (more than 0, at most 7 days)",
}
# A few fields say more than their type does.
NOTES: Final[dict[str, str]] = {
    "ShardPlanned.params_json": "the RFC 8785 text of the object",
    "ShardPlanned.plan_line": "the RFC 8785 text of the object",
    "AttemptStarted.fingerprint_digest": "computed by the ledger from `fingerprint` when"
    " the map is not empty; kept as sent without one",
    "AttemptStarted.scheduler": "an object of its non-empty fields, by their proto names",
    "ArtifactCommitted.read_back": '`"size_etag"` or `"digest"`',
}
_TIME_TYPES: Final = ("google.protobuf.Timestamp", "google.protobuf.Duration")
_INTEGER = "number; a decimal string past 2^53 − 1"
_UNSET_AS: Final = {
    FieldDescriptor.TYPE_STRING: '`""`',
    FieldDescriptor.TYPE_BOOL: "`false`",
    FieldDescriptor.TYPE_DOUBLE: "`0`",
}


class FieldRule(NamedTuple):
    """One row of a kind's table: a proto field and how the row holds it."""

    proto: str  # the field's path in the payload message, e.g. input.size_bytes
    number: str
    key: str  # its key in the row's payload
    json: str
    unset: str  # what the row holds while it is unset
    note: str


def _row_key(field: FieldDescriptor) -> str:
    """Returns a payload field's row key: its name; a Timestamp or Duration NAME as NAME_us."""
    if field.full_name == "shardledger.v1.CheckpointSaved.write_duration":
        return "write_us"
    if field.message_type is not None and field.message_type.full_name in _TIME_TYPES:
        return f"{field.name}_us"
    return field.name


def _is_map(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def _json_of(field: FieldDescriptor) -> str:
    """Returns how a field's value is written in the row."""
    if field.message_type is not None and _is_map(field):
        value = field.message_type.fields_by_name["value"]
        return "object of " + (
            "numbers" if value.type == FieldDescriptor.TYPE_DOUBLE else "strings"
        )
    if field.is_repeated:
        return "array of strings, in the order sent"
    if field.message_type is not None:
        name = field.message_type.full_name
        if name == "google.protobuf.Timestamp":
            return "µs since 1970 (" + _INTEGER + ")"
        if name == "google.protobuf.Duration":
            return "µs (" + _INTEGER + ")"
        return "object of strings"
    if field.enum_type is not None:
        return f"string: a `{field.enum_type.name}` name (below)"
    if field.type in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64):
        return _INTEGER
    if field.type in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_UINT32):
        return "number"
    return {
        FieldDescriptor.TYPE_STRING: "string",
        FieldDescriptor.TYPE_BOOL: "`true` (only ever written set)",
        FieldDescriptor.TYPE_DOUBLE: "number (finite)",
    }[field.type]


def _unset_of(field: FieldDescriptor, *, always: bool) -> str:
    if not always:
        return "left out"
    if _is_map(field):
        return "`{}`"
    if field.is_repeated:
        return "`[]`"
    if field.enum_type is not None:
        return "refused (0 is `UNSPECIFIED`)"
    return _UNSET_AS.get(field.type, "`0`")


def kind_messages() -> dict[str, Descriptor]:
    """Returns each event kind (a case of ShardEvent's `payload` oneof) and its message."""
    oneof = pb.ShardEvent.DESCRIPTOR.oneofs_by_name["payload"]
    out: dict[str, Descriptor] = {}
    for field in oneof.fields:
        # Every case of the oneof is a message (upb's Descriptor is the same type at run time).
        out[field.name] = cast(Descriptor, field.message_type)
    return out


def kind_rules(kind: str, message: Descriptor) -> list[FieldRule]:
    """Returns the rules of one kind's fields, in proto field order (InputSeen's flattened)."""
    later = set(_LATER_FIELDS.get(PAYLOAD_TYPES[kind], ()))
    out = []
    for field in message.fields:
        note = NOTES.get(f"{message.name}.{field.name}", "")
        if (
            field.message_type is not None
            and field.message_type.full_name == "shardledger.v1.InputSeen"
        ):
            for sub in field.message_type.fields:
                key = INPUT_KEYS.get(sub.name, "")
                always = key not in later
                out.append(
                    FieldRule(
                        f"input.{sub.name}",
                        f"{field.number}.{sub.number}",
                        key,
                        _json_of(sub),
                        _unset_of(sub, always=always),
                        "",
                    )
                )
            continue
        key = _row_key(field)
        unset = _unset_of(field, always=key not in later)
        if unset != "left out":
            unset = UNSET.get(f"{message.name}.{field.name}", unset)
        out.append(FieldRule(field.name, str(field.number), key, _json_of(field), unset, note))
    return out


def enum_names(enum: EnumDescriptor) -> list[tuple[int, str, str]]:
    """Returns an enum's values with the names rows write: the prefix dropped, lowercased."""
    prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", enum.name).upper() + "_"
    return [
        (value.number, value.name, value.name.removeprefix(prefix).lower())
        for value in enum.values
        if value.number != 0
    ]


def _decoded_enum(kind: str, number: int) -> str:
    """Returns the name the server's codec gives an enum value (FailureTag, VerificationResult)."""
    msg = pb.ShardEvent(event_id="e", run_id="r", shard_id="s")
    if kind == "failed":
        msg.failed.tag = number  # type: ignore[assignment]
    else:
        msg.verified.result = number  # type: ignore[assignment]
    payload = decode_event(msg).payload
    if isinstance(payload, AttemptFailed):
        return payload.tag
    assert isinstance(payload, ArtifactVerified)
    return payload.result


def problems() -> list[str]:
    """Returns every field without a rule and every rule that disagrees with the code."""
    out = []
    envelope = {f.name for f in pb.ShardEvent.DESCRIPTOR.fields if f.containing_oneof is None}
    for name in sorted(envelope ^ set(ENVELOPE)):
        out.append(f"ShardEvent.{name}: a field of the proto without a rule, or a rule without one")
    messages = kind_messages()
    for kind in sorted(set(messages) ^ set(PAYLOAD_TYPES)):
        out.append(f"kind {kind}: in the proto's oneof or in events.py's PAYLOAD_TYPES, not both")
    for kind, message in messages.items():
        if kind not in PAYLOAD_TYPES:
            continue
        cls = PAYLOAD_TYPES[kind]
        rules = kind_rules(kind, message)
        keys = [r.key for r in rules]
        domain = [f.name for f in fields(cls)]
        for rule in rules:
            if rule.key not in domain:
                out.append(
                    f"{message.name}.{rule.proto}: no rule (no field {rule.key or '?'} of"
                    f" {cls.__name__} in ledger_server/events.py; add it there, to _LATER_FIELDS"
                    " and to ledger_server/codec.py)"
                )
        for name in domain:
            if name not in keys:
                out.append(
                    f"{cls.__name__}.{name}: no proto field of {message.name} is written as it"
                )
        always = tuple(r.key for r in rules if r.unset != "left out")
        if kind not in FIRST_VERSION:
            out.append(
                f"{kind}: a new kind needs its FIRST_VERSION entry (its fields always written)"
            )
        elif set(always) != set(FIRST_VERSION[kind]):
            out.append(
                f"{kind}: written while unset {sorted(always)}, but the first contract version"
                f" has {sorted(FIRST_VERSION[kind])}: a field added later belongs in _LATER_FIELDS"
            )
    names = {f"{m.name}.{f.name}" for m in messages.values() for f in m.fields}
    for name in sorted((set(NOTES) | set(UNSET)) - names):
        out.append(f"NOTES or UNSET names {name}, which is no field")
    scheduler = tuple(f.name for f in pb.SchedulerIdentity.DESCRIPTOR.fields)
    if scheduler != SCHEDULER_FIELDS:
        out.append(f"SchedulerIdentity has {scheduler}, shard_client.vocabulary {SCHEDULER_FIELDS}")
    seen = tuple(f.name for f in pb.InputSeen.DESCRIPTOR.fields)
    if seen != tuple(INPUT_KEYS) or tuple(INPUT_KEYS.values()) != INPUT_SEEN_FIELDS:
        out.append(f"InputSeen has {seen}: each needs its key in INPUT_KEYS and INPUT_SEEN_FIELDS")
    for kind, enum in (
        ("failed", pb.FailureTag.DESCRIPTOR),
        ("verified", pb.VerificationResult.DESCRIPTOR),
    ):
        for number, name, row_name in enum_names(enum):
            try:
                decoded = _decoded_enum(kind, number)
            except InvalidEvent as exc:  # a value the codec does not know
                decoded = f"refused ({exc})"
            if decoded != row_name:
                out.append(f"{name}: rows write {row_name!r} by the rule, the codec {decoded!r}")
    return out


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return lines


def render_fields() -> str:
    """Returns the generated field tables: the envelope, each kind's payload, the enums."""
    lines = [
        "#### `ShardEvent` and the row around it",
        "",
        *_table(
            ("field", "#", "in the row", "JSON", "while unset"),
            [
                (f"`{f.name}`", str(f.number), *ENVELOPE[f.name])
                for f in pb.ShardEvent.DESCRIPTOR.fields
                if f.containing_oneof is None and f.name in ENVELOPE
            ],
        ),
        "",
        "The case of the `payload` oneof that is set is the event's `kind` (the oneof field's"
        " name) and its message the `payload` object:",
        "",
    ]
    messages = kind_messages()
    for field in pb.ShardEvent.DESCRIPTOR.oneofs_by_name["payload"].fields:
        message = messages[field.name]
        lines += [
            f"#### `{field.name}` (`{message.name}`, oneof field {field.number})",
            "",
            *_table(
                ("proto field", "#", "row key", "JSON", "while unset", "note"),
                [
                    (f"`{r.proto}`", r.number, f"`{r.key}`", r.json, r.unset, r.note)
                    for r in kind_rules(field.name, message)
                ],
            ),
            "",
        ]
    for enum in (pb.FailureTag.DESCRIPTOR, pb.VerificationResult.DESCRIPTOR):
        lines += [
            f"#### `{enum.name}`",
            "",
            *_table(
                ("#", "proto name", "in the row"),
                [(str(n), f"`{name}`", f'`"{row}"`') for n, name, row in enum_names(enum)],
            ),
            "",
        ]
    return "\n".join(lines).rstrip("\n")


def render_examples(vectors: dict[str, Any]) -> str:
    """Returns one worked example per kind: the content of its unset and its set vector."""
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for vector in vectors["event_rows"]:
        by_kind.setdefault(vector["kind"], []).append(vector)
    lines = []
    for kind in kind_messages():
        lines += [f"`{kind}`:", "", "```"]
        for vector in by_kind.get(kind, [])[:2]:
            lines += [f"# {vector['name']}", vector["content_canonical"]]
        lines += ["```", ""]
    first = vectors["event_rows"][1]
    lines += [
        f"The whole way for one of them (`{first['name']}`), as `event_rows` holds every one:",
        "",
        "```",
        "# the event as sent (protobuf JSON)",
        json.dumps(first["event"], ensure_ascii=False, separators=(",", ":")),
        "# its row (run_sequence and receive_time_us given by the ledger)",
        first["row"],
        f"# prev_hash {first['prev_hash']}",
        f"# row_hash  {first['row_hash']}",
        "```",
    ]
    return "\n".join(lines).rstrip("\n")


def _markers(section: str) -> tuple[str, str]:
    return (
        f"<!-- generated by python -m tools.gen.contract_table ({section}): edit the generator -->",
        f"<!-- end of generated {section} -->",
    )


def render(text: str) -> str:
    """Returns the page with its generated sections rewritten."""
    vectors = json.loads(VECTORS.read_text(encoding="utf-8"))
    bodies = {"fields": render_fields(), "examples": render_examples(vectors)}
    for section in SECTIONS:
        begin, end = _markers(section)
        pattern = re.compile(re.escape(begin) + r"\n.*?" + re.escape(end), re.DOTALL)
        found = pattern.search(text)
        if found is None:
            raise ValueError(f"{DOC} lacks the markers of its generated {section}")
        text = f"{text[: found.start()]}{begin}\n{bodies[section]}\n{end}{text[found.end() :]}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page differs")
    args = parser.parse_args(argv)
    found = problems()
    for problem in found:
        print(problem, file=sys.stderr)
    current = DOC.read_text(encoding="utf-8")
    text = render(current)
    if args.check:
        if text != current:
            print(
                f"{DOC} differs from the proto and events.py: run python -m tools.gen.contract_table",
                file=sys.stderr,
            )
            return 1
        return 1 if found else 0
    DOC.write_text(text, encoding="utf-8")
    print(f"wrote {DOC}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
