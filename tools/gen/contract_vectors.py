# Over 400 lines on purpose: two thirds are the vectors' inputs, kept beside the code that computes what each must give.
"""Writes tests/data/contract_vectors.json: the contract's test vectors (docs/contract.md).

    python -m tools.gen.contract_vectors            # rewrite the file
    python -m tools.gen.contract_vectors --check    # exit 1 when the file differs

Every expected output is computed here by the Python implementation and, for RFC 8785,
checked against the `rfc8785` package on the way; tests/sdk/test_canonical.py,
tests/contract/test_contract_table.py and the Go client (examples/go) reproduce them.
`event_rows` runs each event of EVENT_CASES through the server's own path (the proto
decoded by ledger_server/codec.py, normalized by validation.py, its row by chain.py).
Changing an expected output changes shard ids, digests or row hashes that ledgers
already hold: add vectors, never edit one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import rfc8785
from google.protobuf import json_format

from ledger_server.chain import GENESIS_HASH, chain_hash, decode_row, encode_row, row_bytes
from ledger_server.codec import decode_event, encode_event
from ledger_server.events import ROW_FORMAT, ROW_FORMAT_LEGACY, content_jcs
from ledger_server.validation import validate
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.canonical import canonical_json, digest_fields, fingerprint_digest
from shard_client.ids import PlanEntry, plan_event_id, shard_id_for

OUT = Path(__file__).resolve().parents[2] / "tests" / "data" / "contract_vectors.json"

# (name, JSON text as another language would receive it)
JCS_CASES = [
    ("integral floats lose .0", '{"lr": 1.0, "scale": 2.0, "neg": -3.0}'),
    ("negative zero", "[-0.0, -0, 0.0]"),
    ("small floats", "[1e-7, 1e-06, 0.000001, 0.00001, 0.0001, 1.5e-10]"),
    ("large floats", "[1e16, 1e20, 1e21, 1e22, 1.5e300, 123456789012345680000.0]"),
    ("shortest round trip", "[0.1, 0.2, 0.30000000000000004, 2.5, 1.7976931348623157e308]"),
    ("subnormal", "[5e-324, 2.2250738585072014e-308]"),
    ("safe integers", "[9007199254740991, -9007199254740991, 0, -1, 42]"),
    ("literals", '{"t": true, "f": false, "n": null, "e": "", "a": [], "o": {}}'),
    ("unicode kept as UTF-8", '{"name": "Äpfel", "euro": "€", "apple": "🍎", "cjk": "数据"}'),
    (
        "escapes",
        '{"s": "quote \\" backslash \\\\ nl \\n tab \\t cr \\r bs \\b ff \\f us \\u001f'
        ' del \\u007f ls \\u2028 slash /"}',
    ),
    ("keys sort by UTF-16 code units", '{"z": 1, "\\ufb01": 2, "\\ud83d\\ude00": 3, "a": 4}'),
    ("keys sort ASCII", '{"b": 1, "a": 2, "A": 3, "aa": 4, "": 5, "_": 6}'),
    (
        "nesting",
        '{"outer": {"list": [1, 2.5, {"deep": [true, null, "x"]}], "b": {"a": {}}}, "a": [[[]]]}',
    ),
    ("astral in strings", '["\\ud834\\udd1e", "𝄞", "a😀b"]'),
]
# JSON the contract refuses: (name, text, why)
JCS_REFUSED = [
    ("integer past 2**53", '{"seed": 9007199254740992}', "integer beyond +-(2**53 - 1)"),
    ("negative integer past 2**53", "[-9007199254740992]", "integer beyond +-(2**53 - 1)"),
    ("big integer literal", "[100000000000000000000]", "integer beyond +-(2**53 - 1)"),
    ("float overflow", "[1e400]", "not a finite IEEE double"),
    ("lone surrogate", '["\\ud800"]', "not Unicode text"),
]
SHARD_ID_CASES = [
    ("a" * 64, "{}"),
    ("a" * 64, '{"lr": 0.001, "epochs": 3}'),
    ("b" * 64, '{"lr": 1.0, "eps": 1e-7, "name": "Äpfel 🍎", "nested": {"z": [1, 2.5]}}'),
    ("c" * 64, '{"\\ufb01": 1, "\\ud83d\\ude00": 2}'),
]
FINGERPRINTS: list[dict[str, str]] = [
    {},
    {"schema": "2", "gpu.0.name": "NVIDIA H100 80GB HBM3", "gpu.count": "1"},
    {"schema": "2", "gpu.0.uuid": "GPU-1234", "gpu.0.ecc.sbe": "3", "gpu.0.name": "A100"},
    {"schema": "2", "host.label": "Zürich-α", "\U0001f600": "x", "\ufb01": "y"},
]
ROW_CONTENTS: list[dict[str, Any]] = [
    {
        "attempt_id": "a0",
        "client_time_us": 1764000000123456,
        "event_id": "beat-1",
        "kind": "heartbeat",
        "namespace": "default",
        "payload": {"metrics": {"loss": 1e-07, "lr": 1.0}, "progress": 1.0, "step": 2},
        "run_id": "night-01",
        "shard_id": "s-0",
    },
    {
        "attempt_id": "",
        "client_time_us": 0,
        "event_id": "plan-1",
        "kind": "planned",
        "namespace": "default",
        "payload": {
            "expected_outputs": ["weights"],
            "input_blake3": "f" * 64,
            "input_bytes": 12,
            "input_ref": "/in/ünï 🍎",
            "params_json": '{"lr":1,"name":"Äpfel"}',
            "plan_index": 0,
            "plan_line": "",
        },
        "run_id": "night-01",
        "shard_id": "s-1",
    },
    {
        "attempt_id": "a1",
        "client_time_us": 253402300799999999,
        "event_id": "commit-1",
        "kind": "artifact_committed",
        "namespace": "default",
        "payload": {
            "blake3_hex": "a" * 64,
            "media_type": "",
            "name": "weights",
            "path": "/out/w.bin",
            "size_bytes": 9007199254740993,
        },
        "run_id": "night-01",
        "shard_id": "s-1",
    },
    # The run-level kinds: no shard, no attempt; payload fields left out while unset.
    {
        "attempt_id": "",
        "client_time_us": 0,
        "event_id": "close-1",
        "kind": "submission_closed",
        "namespace": "default",
        "payload": {"expected_shards": 1000, "reason": "last wave"},
        "run_id": "night-01",
        "shard_id": "",
    },
    {
        "attempt_id": "",
        "client_time_us": 0,
        "event_id": "reopen-1",
        "kind": "run_reopened",
        "namespace": "default",
        "payload": {"reason": "a late wave"},
        "run_id": "night-01",
        "shard_id": "",
    },
]

# Events as a client sends them (the protobuf JSON mapping of ShardEvent, proto field
# names), one of every kind with every optional field unset and one with every field
# set, and the edges: integers at 2**53 - 1, 2**53, 2**53 + 1, 2**63 - 1 and 2**64 - 1,
# unicode and escapes, empty maps, sub-microsecond clocks. `event_rows` holds each as
# the ledger normalizes, encodes and chains it; append new cases at the end.
_NIGHT = "night-02"
_SAFE, _UNSAFE, _UNSAFE_ODD = 2**53 - 1, 2**53, 2**53 + 1
_INT64_MAX, _UINT64_MAX = 2**63 - 1, 2**64 - 1
_HEX = ("0123456789abcdef" * 4, "fedcba9876543210" * 4)
_LEGACY_FINGERPRINT = {"schema": "2", "host.label": "Zürich-α", "gpu.0.uuid": "GPU-7"}


def _shard(name: str, **fields: Any) -> dict[str, Any]:
    return {"event_id": name, "run_id": _NIGHT, "shard_id": "s-0", **fields}


def _attempt(name: str, **fields: Any) -> dict[str, Any]:
    return _shard(name, attempt_id="a0", **fields)


def _run(name: str, **fields: Any) -> dict[str, Any]:
    return {"event_id": name, "run_id": _NIGHT, **fields}


_TAGS = ("TIMEOUT", "KILLED", "PREEMPTED", "NCCL", "DATA", "INCOMPLETE", "UNKNOWN")
EVENT_CASES: list[tuple[str, dict[str, Any]]] = [
    ("planned: every later field unset", _shard("plan-unset", planned={"input_ref": "/in/0"})),
    (
        "planned: every field set",
        _shard(
            "plan-set",
            namespace="team-a",
            client_time="2026-12-04T05:00:00.123456789Z",
            planned={
                "input_ref": "/in/ünï 🍎/1.bin",
                "input_bytes": _INT64_MAX,
                "input_blake3": _HEX[0],
                "params_json": '{"lr": 1.0, "eps": 1e-7, "seed": "18446744073709551615",'
                ' "name": "Äpfel 🍎", "\\ufb01": 1, "\\ud83d\\ude00": 2, "n": null}',
                "expected_outputs": ["weights", "metrics"],
                "plan_line": '{"shard_id": "s-0", "input": "/in/1", "params": {"lr": 1.0}}',
                "plan_index": _SAFE,
                "labels": {"pool": "spot", "region": "eu-zürich", "image": ""},
                "input_version_id": "3HL4kqtJlcpXroDTDmJ+rmSpXd3dIbrHY",
                "input_etag": '"9b2cf535f27731c974343645a3985328"',
                "input_mtime_ns": 1764000000123456789,
                "input_inode": _UINT64_MAX,
                "input_device": _UNSAFE,
                "input_revision": True,
            },
        ),
    ),
    (
        "started: every later field unset",
        _attempt("start-unset", started={"heartbeat_timeout": "60s"}),
    ),
    (
        "started: every field set",
        _attempt(
            "start-set",
            client_time="9999-12-31T23:59:59.999999999Z",
            started={
                "host": "gpu-node-07.zürich",
                "pid": _UNSAFE,
                "heartbeat_timeout": "3600.000001500s",
                "fingerprint": {
                    "schema": "2",
                    "gpu.0.name": "NVIDIA H100 80GB HBM3",
                    "gpu.0.uuid": "GPU-1234",
                    "gpu.0.ecc.sbe": "3",
                    "😀": "x",
                    "ﬁ": "",
                },
                "scheduler": {
                    "kind": "slurm",
                    "job_id": "4242",
                    "array_job_id": "4240",
                    "array_task_id": "2",
                    "cluster": "night",
                    "node": "gpu-node-07",
                    "namespace": "batch",
                },
                "process_start_ticks": _INT64_MAX,
                "labels": {"pool": "spot", "image": ""},
                "rank": 3,
                "world_size": 8,
                "local_rank": 3,
                "launch_id": "launch-1",
                "restart_count": 2,
                "gpu_count": 4096,
                "input": {
                    "input_ref": "/in/ünï 🍎/1.bin",
                    "size_bytes": _UNSAFE_ODD,
                    "mtime_ns": 1764000000123456789,
                    "inode": _UINT64_MAX,
                    "device": _SAFE,
                    "version_id": "3HL4kqtJlcpXroDTDmJ+rmSpXd3dIbrHY",
                    "etag": '"9b2cf535f27731c974343645a3985328"',
                    "blake3_hex": _HEX[0],
                },
            },
        ),
    ),
    (
        "started: a legacy fingerprint digest is replaced by the RFC 8785 one",
        _attempt(
            "start-legacy-digest",
            started={
                "heartbeat_timeout": "60s",
                "fingerprint": _LEGACY_FINGERPRINT,
                "fingerprint_digest": fingerprint_digest(_LEGACY_FINGERPRINT, legacy=True),
            },
        ),
    ),
    (
        "started: a digest sent without a fingerprint is kept",
        _attempt(
            "start-digest-only",
            started={"heartbeat_timeout": "0.000001s", "fingerprint_digest": _HEX[1]},
        ),
    ),
    (
        "started: a scheduler and an input with only some fields set",
        _attempt(
            "start-some",
            started={
                "heartbeat_timeout": "60s",
                "scheduler": {"kind": "kubernetes", "job_id": "pod-7", "namespace": "ml"},
                "input": {"input_ref": "s3://bucket/in/7", "size_bytes": 7, "etag": '"e"'},
            },
        ),
    ),
    ("heartbeat: every later field unset", _attempt("beat-unset", heartbeat={})),
    (
        "heartbeat: coalesced, every field set",
        _attempt(
            "beat-set",
            heartbeat={
                "step": _UNSAFE_ODD,
                "progress": 0.30000000000000004,
                "metrics": {
                    "loss": 1e-7,
                    "tokens/s": 1e21,
                    "count": 1e20,
                    "ﬁ": 5e-324,
                    "😀": -0.0,
                },
                "nonfinite_metrics": ["grad_norm", "loss/ü", "grad_norm"],
                "rank": 7,
                "rank_finished": True,
                "first_step": _UNSAFE,
                "metrics_min": {"loss": 1e-8, "😀": -1.5},
                "metrics_max": {"loss": 2.5, "😀": 0.1},
                "progress_calls": _INT64_MAX,
            },
        ),
    ),
    (
        "heartbeat: a rank's last beat",
        _attempt(
            "beat-rank",
            heartbeat={
                "step": 10,
                "progress": 1.0,
                "metrics": {"loss": 0.25},
                "rank": 1,
                "rank_finished": True,
            },
        ),
    ),
    (
        "checkpoint: every later field unset",
        _attempt("ckpt-unset", checkpoint={"path": "/ckpt/0", "blake3_hex": _HEX[0]}),
    ),
    (
        "checkpoint: every field set",
        _attempt(
            "ckpt-set",
            checkpoint={
                "step": _INT64_MAX,
                "path": "/ckpt/ünï/20.rank1",
                "size_bytes": _UNSAFE,
                "blake3_hex": _HEX[1],
                "write_duration": "12.345678901s",
                "rank": 1,
                "world_size": 4,
            },
        ),
    ),
    (
        "checkpoint: a write shorter than a microsecond is not measured",
        _attempt(
            "ckpt-fast",
            checkpoint={"path": "/ckpt/1", "blake3_hex": _HEX[0], "write_duration": "0.000000999s"},
        ),
    ),
    (
        "artifact_committed: every later field unset",
        _attempt(
            "commit-unset",
            artifact_committed={"name": "weights", "path": "/out/w", "blake3_hex": _HEX[0]},
        ),
    ),
    (
        "artifact_committed: every field set",
        _attempt(
            "commit-set",
            artifact_committed={
                "name": "weights",
                "path": "s3://bucket/out/ünï 🍎.bin",
                "size_bytes": _UNSAFE_ODD,
                "blake3_hex": _HEX[1],
                "media_type": "application/json",
                "rank": 2,
                "version_id": "v-7",
                "etag": '"e-7"',
                "read_back": "size_etag",
            },
        ),
    ),
    (
        "verified: every later field unset",
        _shard(
            "verify-unset",
            verified={
                "name": "weights",
                "path": "/out/w",
                "blake3_hex": _HEX[0],
                "result": "VERIFICATION_RESULT_PASSED",
            },
        ),
    ),
    (
        "verified: every field set",
        _attempt(
            "verify-set",
            verified={
                "name": "weights",
                "path": "s3://bucket/out/ünï 🍎.bin",
                "blake3_hex": _HEX[1],
                "result": "VERIFICATION_RESULT_FAILED",
                "reason": "digest",
                "detail": "expected fedc…\n got 0123…",
                "version_id": "v-7",
            },
        ),
    ),
    (
        "failed: every later field unset",
        _attempt("fail-unset", failed={"tag": "FAILURE_TAG_OOM"}),
    ),
    (
        "failed: every field set",
        _attempt(
            "fail-set",
            failed={
                "tag": "FAILURE_TAG_INPUT_CHANGED",
                "message": 'quote " backslash \\ nl \n tab \t us \u001f del \u007f ls \u2028 🍎',
                "diagnostics_path": "/diag/a0.tar",
                "diagnostics_blake3_hex": _HEX[1],
                "rank": 5,
            },
        ),
    ),
    *(
        (
            f"failed: tag {tag.lower()}",
            _attempt(f"fail-{tag.lower()}", failed={"tag": f"FAILURE_TAG_{tag}"}),
        )
        for tag in _TAGS
    ),
    ("submission_closed: every field unset", _run("close-unset", submission_closed={})),
    (
        "submission_closed: every field set",
        _run(
            "close-set",
            namespace="team-a",
            submission_closed={
                "reason": "last wave 🍎",
                "expected_shards": 2**31 - 1,
                "submitted_until": "2026-12-04T05:00:00.999999999Z",
            },
        ),
    ),
    ("run_reopened: every field unset", _run("reopen-unset", run_reopened={})),
    ("run_reopened: every field set", _run("reopen-set", run_reopened={"reason": "a late wave"})),
    (
        "client_time: less than a microsecond after 1970 is 0, as unset",
        _attempt("beat-epoch", client_time="1970-01-01T00:00:00.000000999Z", heartbeat={"step": 1}),
    ),
]
# Rows whose own integers pass 2**53: (case name, run_sequence, receive_time_us).
ROW_FRAMING_CASES = [("planned: every later field unset", _UNSAFE_ODD, 253402300799999999)]


def _jcs_checked(value: Any) -> str:
    text = canonical_json(value)
    assert text.encode() == rfc8785.dumps(value), (value, text)
    return text


def _event_row(
    name: str, case: dict[str, Any], *, run_sequence: int, receive_time_us: int, prev: bytes
) -> dict[str, Any]:
    """Returns one event-row vector: the event as sent, as stored, its content and row."""
    sent = json_format.ParseDict(case, pb.ShardEvent())
    valid = validate(decode_event(sent))
    row = encode_row(valid.canonical, run_sequence=run_sequence, receive_time_us=receive_time_us)
    assert row == row_bytes(
        valid.event, run_sequence=run_sequence, receive_time_us=receive_time_us
    ), name

    def as_json(msg: pb.ShardEvent) -> dict[str, Any]:
        # Sorted: MessageToDict writes a map in the order of its hash table, which varies.
        text = json.dumps(json_format.MessageToDict(msg, preserving_proto_field_name=True))
        ordered: dict[str, Any] = json.loads(text, object_hook=lambda o: dict(sorted(o.items())))
        return ordered

    return {
        "name": name,
        "kind": valid.event.kind,
        "event": as_json(sent),
        # What ListEvents returns of it (server-assigned fields aside): the event its row
        # decodes to, in normal form (and -0.0 as 0: the row cannot hold the sign).
        "stored": as_json(encode_event(decode_row(row).event)),
        "content_canonical": valid.canonical,
        "run_sequence": run_sequence,
        "receive_time_us": receive_time_us,
        "prev_hash": prev.hex(),
        "row": row.decode(),
        "row_hash": chain_hash(prev, row).hex(),
    }


def _event_rows() -> list[dict[str, Any]]:
    """Returns the event-row vectors: the cases chained as one run, then the framing edges."""
    out = []
    prev = GENESIS_HASH
    for sequence, (name, case) in enumerate(EVENT_CASES, start=1):
        vector = _event_row(
            name,
            case,
            run_sequence=sequence,
            receive_time_us=1764000000600000 + sequence,
            prev=prev,
        )
        out.append(vector)
        prev = bytes.fromhex(vector["row_hash"])
    cases = dict(EVENT_CASES)
    for name, sequence, receive_us in ROW_FRAMING_CASES:
        out.append(
            _event_row(
                f"{name}, its row's integers past 2**53",
                cases[name],
                run_sequence=sequence,
                receive_time_us=receive_us,
                prev=prev,
            )
        )
    assert len({v["name"] for v in out}) == len(out), "event-row names must be unique"
    return out


def _stream_event(event_id: str, shard: str, **fields: Any) -> dict[str, Any]:
    event = {"event_id": event_id, "run_id": "stream-night", "shard_id": shard, **fields}
    json_format.ParseDict(event, pb.ShardEvent())  # it parses as the proto says
    return event


def _stream_appends() -> dict[str, Any]:
    """One StreamAppendEvents exchange on a fresh ledger: the batches sent, the answers due.

    Answers name their batch_id and come in request order; a refused batch is answered
    with an AppendError (google.rpc.Status's fields: code, message, details) and the
    stream goes on. The message text is prose: a client compares code, reason, metadata.
    """
    plan = {
        "input_ref": "/in/a.bin",
        "input_bytes": "10",
        "input_blake3": "ab" * 32,
        "expected_outputs": ["out"],
    }
    first = _stream_event("stream-plan-a", "shard-a", planned=plan)
    second = _stream_event("stream-plan-b", "shard-b", planned={**plan, "plan_index": 1})
    started = _stream_event(
        "stream-start-a",
        "shard-a",
        attempt_id="att-1",
        started={"host": "h", "pid": 7, "heartbeat_timeout": "60s"},
    )
    no_payload = _stream_event("stream-empty", "shard-a", attempt_id="att-1")
    appended, duplicate = "APPEND_OUTCOME_APPENDED", "APPEND_OUTCOME_DUPLICATE"

    def results(*pairs: tuple[str, int, str]) -> dict[str, Any]:
        return {
            "appended": {
                "results": [
                    {"event_id": eid, "sequence": str(seq), "outcome": outcome}
                    for eid, seq, outcome in pairs
                ]
            }
        }

    exchange = [
        (
            {"batch_id": "1", "events": [first, second]},
            results(("stream-plan-a", 1, appended), ("stream-plan-b", 2, appended)),
        ),
        ({"batch_id": "2", "events": [first]}, results(("stream-plan-a", 1, duplicate))),
        (
            {"batch_id": "3", "events": [started, no_payload]},
            {
                "error": {
                    "code": 3,
                    "reason": "INVALID_FIELD",
                    "metadata": {"field": "payload", "event_index": "1"},
                }
            },
        ),
        (
            {"batch_id": "18446744073709551615", "events": [started]},
            results(("stream-start-a", 3, appended)),
        ),
    ]
    for request, _ in exchange:  # every request parses as the proto says
        json_format.ParseDict(request, pb.StreamAppendEventsRequest())
    status = pb.AppendError(
        code=3, message="event 1: payload: exactly one payload kind must be set"
    )
    return {
        "note": "send each request on one stream to a fresh ledger; each answer, in order,"
        " carries the request's batch_id and this outcome (error: code, ErrorInfo reason"
        " and metadata; the message is prose)",
        "exchange": [
            {"request": request, "answer": {"batch_id": request["batch_id"], **answer}}
            for request, answer in exchange
        ],
        "append_error_is_google_rpc_status": {
            "append_error_hex": status.SerializeToString().hex(),
            "note": "the same bytes decode as google.rpc.Status (fields 1 code, 2 message,"
            " 3 details)",
        },
    }


def build() -> dict[str, Any]:
    """Returns the vectors document."""
    jcs = [
        {"name": name, "input": text, "output": _jcs_checked(json.loads(text))}
        for name, text in JCS_CASES
    ]
    refused = []
    for name, text, why in JCS_REFUSED:
        try:
            canonical_json(json.loads(text))
        except ValueError:
            refused.append({"name": name, "input": text, "why": why})
        else:
            raise AssertionError(f"{name} was not refused")
    shard_ids = []
    for digest, params_text in SHARD_ID_CASES:
        params = json.loads(params_text)
        canonical = _jcs_checked(params)
        shard_ids.append(
            {
                "input_blake3": digest,
                "params": params_text,
                "canonical_params": canonical,
                "material": f"{digest}\n{canonical}",
                "shard_id": shard_id_for(input_blake3=digest, params=params),
            }
        )
    plans = []
    for index, (digest, params_text) in enumerate(SHARD_ID_CASES[:3]):
        params = json.loads(params_text)
        shard = shard_id_for(input_blake3=digest, params=params)
        line = _jcs_checked({"input": f"/in/{index}", "params": params, "shard_id": shard})
        entry = PlanEntry(
            shard_id=shard,
            input_ref=f"/in/{index}",
            input_bytes=100 + index,
            input_blake3=digest,
            params=params,
            expected_outputs=("weights", "metrics"),
            plan_line=line,
            plan_index=index,
        )
        material = {
            "namespace": "",
            "run_id": "night-01",
            "shard_id": shard,
            "definition": entry.definition(),
            "plan_line": line,
            "plan_index": index,
        }
        plans.append(
            {
                "run_id": "night-01",
                "namespace": "",
                "shard_id": shard,
                "input_ref": entry.input_ref,
                "input_bytes": entry.input_bytes,
                "input_blake3": digest,
                "params": params_text,
                "expected_outputs": list(entry.expected_outputs),
                "plan_line": line,
                "plan_index": index,
                "material": _jcs_checked(material),
                "event_id": plan_event_id("night-01", entry),
            }
        )
    fingerprints = [
        {
            "fingerprint": fields,
            "covered": _jcs_checked(digest_fields(fields)) if fields else "",
            "digest": fingerprint_digest(fields),
            "legacy_digest": fingerprint_digest(fields, legacy=True),
        }
        for fields in FINGERPRINTS
    ]
    rows = []
    prev = GENESIS_HASH
    for sequence, content in enumerate(ROW_CONTENTS, start=1):
        receive_us = 1764000000500000 + sequence
        text = content_jcs(content)
        row = encode_row(text, run_sequence=sequence, receive_time_us=receive_us)
        row_hash = chain_hash(prev, row)
        rows.append(
            {
                "content": content,
                "content_canonical": text,
                "run_sequence": sequence,
                "receive_time_us": receive_us,
                "prev_hash": prev.hex(),
                "row": row.decode(),
                "row_hash": row_hash.hex(),
            }
        )
        prev = row_hash
    legacy_row = encode_row(
        '{"kind":"heartbeat","progress":1.0}',
        run_sequence=1,
        receive_time_us=5,
        row_format=ROW_FORMAT_LEGACY,
    )
    return {
        "contract": "shardledger.v1",
        "row_format": ROW_FORMAT,
        "jcs": jcs,
        "jcs_refused": refused,
        "shard_ids": shard_ids,
        "plan_events": plans,
        "fingerprint_digests": fingerprints,
        "rows": rows,
        "legacy_rows": [
            {
                "note": "row format 1: verified byte for byte, never re-encoded",
                "row": legacy_row.decode(),
                "prev_hash": GENESIS_HASH.hex(),
                "row_hash": chain_hash(GENESIS_HASH, legacy_row).hex(),
            }
        ],
        "event_rows": _event_rows(),
        "stream_appends": _stream_appends(),
    }


def render() -> str:
    """Returns the file's text: indented JSON, non-ASCII kept, a trailing newline."""
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the file differs")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT} differs from what the implementation computes", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
