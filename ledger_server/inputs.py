"""Input identity: what a plan recorded of a shard's input, and whether a job saw the same.

Pure: no grpc, protobuf or SQL. The plan records the input's size and blake3 (its
definition) and, as evidence, the cheap identity a job can read again without
reading the bytes: a local file's mtime, inode and device, an object's version id
and ETag. A started event that names its input carries the same identity as the
job found it (and a blake3 when the job re-hashed). The rules (docs/concepts.md,
"Input identity"):

- another input reference, or another size, is another input;
- a blake3 the job computed decides alone: the same bytes are the same input,
  however the file was touched or copied since;
- without one, any piece of cheap identity both sides know and that differs is a
  change (a job that wants a touched-but-identical file accepted re-hashes: the SDK
  does so whenever its cheap identity differs from the plan it was handed).
"""

from __future__ import annotations

import json
from typing import Any

from ledger_server.events import AttemptStarted, ShardPlanned
from shard_client.inputs import IDENTITY_FIELDS, difference

__all__ = ["IDENTITY_FIELDS", "input_change", "planned_identity", "revision_change"]


def planned_identity(p: ShardPlanned) -> dict[str, Any]:
    """Returns the plan's evidence of its input: the known (non-empty) identity fields."""
    values = (p.input_mtime_ns, p.input_inode, p.input_device, p.input_version_id, p.input_etag)
    return {name: value for name, value in zip(IDENTITY_FIELDS, values, strict=True) if value}


def input_change(definition_json: str, identity: dict[str, Any], seen: AttemptStarted) -> str:
    """Returns what differs between the plan's input and what a started event saw ("" if none).

    ``definition_json`` and ``identity`` are the shard record's (the plan as it stands,
    revisions included). A started event that names no input is never a change.
    """
    if not seen.input_ref:
        return ""
    plan = json.loads(definition_json)
    planned = {
        "ref": plan["input_ref"],
        "bytes": int(plan["input_bytes"]),  # a decimal string past 2**53
        "blake3": plan["input_blake3"],
        # A size of 0 with no identity is a plan that did not know the size (a manifest
        # line with input_blake3 only), not an empty file.
        "known_size": bool(identity),
        **identity,
    }
    values = (
        seen.input_mtime_ns,
        seen.input_inode,
        seen.input_device,
        seen.input_version_id,
        seen.input_etag,
    )
    observed = {
        "ref": seen.input_ref,
        "bytes": seen.input_bytes,
        "blake3": seen.input_blake3,
        **dict(zip(IDENTITY_FIELDS, values, strict=True)),
    }
    return difference(planned, observed)


def revision_change(definition_json: str, p: ShardPlanned) -> bool:
    """Returns whether a revision of the plan's input changes its content (size or digest).

    A revision that only refreshes the cheap identity (a file copied or touched, its
    bytes the same) keeps the attempts' evidence: their outputs were computed on it.
    """
    plan = json.loads(definition_json)
    return int(plan["input_bytes"]) != p.input_bytes or plan["input_blake3"] != p.input_blake3
