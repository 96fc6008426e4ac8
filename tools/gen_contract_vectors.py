"""Writes tests/data/contract_vectors.json: the contract's test vectors (docs/contract.md).

    python -m tools.gen_contract_vectors            # rewrite the file
    python -m tools.gen_contract_vectors --check    # exit 1 when the file differs

Every expected output is computed here by the Python implementation and, for RFC 8785,
checked against the `rfc8785` package on the way; tests/sdk/test_contract_vectors.py
and the Go client (examples/go) reproduce them. Changing an expected output changes
shard ids, digests or row hashes that ledgers already hold: add vectors, never edit one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import rfc8785

from ledger_server.chain import GENESIS_HASH, chain_hash, encode_row
from ledger_server.events import ROW_FORMAT, ROW_FORMAT_LEGACY, content_jcs
from shard_client.canonical import canonical_json, digest_fields, fingerprint_digest
from shard_client.ids import PlanEntry, plan_event_id, shard_id_for

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "contract_vectors.json"

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


def _jcs_checked(value: Any) -> str:
    text = canonical_json(value)
    assert text.encode() == rfc8785.dumps(value), (value, text)
    return text


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
