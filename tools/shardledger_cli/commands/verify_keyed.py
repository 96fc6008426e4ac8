"""Keyed result sets in `verify`: outputs a plan declares keyed must hold exactly its input ids.

A plan declares them in its params (docs/metrics.md, "Keyed result sets"):

    {"keyed_outputs": {"out": "id"}, "input_ids": ["a", "b", ...]}
    {"keyed_outputs": {"out": "id"}, "input_ids_file": "ids/shard-7.tsv"}

``keyed_outputs`` maps an output name to its id field (the JSONL key, npz array or
parquet column); the ids are listed inline or in a file read like a result file
(relative paths under --root). The check runs after the file's own checks pass.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from shard_client.checks import CheckResult, resolve_within_root
from shard_client.checks_keyed import ID_SET_UNREADABLE, check_id_set, read_ids

__all__ = ["KeyedOutput", "check_keyed", "keyed_outputs"]


@dataclass(frozen=True, slots=True)
class KeyedOutput:
    """One output declared keyed: its id field and where the shard's input ids are."""

    id_field: str
    input_ids: tuple[str, ...] | None
    input_ids_file: str


def keyed_outputs(params_json: str) -> dict[str, KeyedOutput]:
    """Returns name -> declaration from a plan's params ({} when it declares none)."""
    try:
        params = json.loads(params_json or "{}")
    except ValueError:
        return {}
    declared = params.get("keyed_outputs") if isinstance(params, dict) else None
    if not isinstance(declared, dict):
        return {}
    ids = params.get("input_ids")
    inline = tuple(str(i) for i in ids) if isinstance(ids, list) else None
    source = str(params.get("input_ids_file") or "")
    return {
        str(name): KeyedOutput(str(field or "id"), inline, source)
        for name, field in declared.items()
    }


def check_keyed(keyed: KeyedOutput, *, root: str, path: str) -> CheckResult:
    """Returns the id-set check of one committed file against the shard's input ids."""
    expected: Any = keyed.input_ids
    if expected is None:
        if not keyed.input_ids_file:
            return CheckResult(
                False, ID_SET_UNREADABLE, "keyed_outputs without input_ids or input_ids_file"
            )
        source = keyed.input_ids_file
        try:
            where = source if os.path.isabs(source) else str(resolve_within_root(root, source))
            expected = [i for i in read_ids(where, id_field=keyed.id_field) if i is not None]
        except (OSError, ValueError) as exc:
            return CheckResult(False, ID_SET_UNREADABLE, f"cannot read input ids {source}: {exc}")
    return check_id_set(resolve_within_root(root, path), expected, id_field=keyed.id_field)
