"""The rules of planning a run again: what a re-plan may add, how it differs, how it is numbered.

A re-plan with the same params set is idempotent and a grown listing adds its new
inputs; shards with params none of the run's shards has would grow the run silently,
so `shardledger plan` refuses them without --add. The ledger keeps each shard's first
plan index, so a re-plan numbers the shards the run has as stored and the new ones
after the highest stored index, in listing order: two shards never share an index
(a Slurm array of the resume list would lose one).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.canonical import canonical_json
from shard_client.ids import PlanEntry

__all__ = [
    "OtherParams",
    "Renumbering",
    "StoredPlan",
    "other_params",
    "params_key",
    "plan_differences",
    "renumbered",
]


@dataclass(frozen=True, slots=True)
class StoredPlan:
    """A shard the run already has: its plan index and, from a ledger that says, its plan."""

    plan_index: int
    plan: pb.ShardPlanView | None


@dataclass(frozen=True, slots=True)
class OtherParams:
    """New shards whose params none of the run's shards has (RFC 8785 texts, sorted)."""

    stored: int
    have: list[str]
    other: int
    sent: list[str]


@dataclass(frozen=True, slots=True)
class Renumbering:
    """A plan's entries numbered after the run's stored shards, and how many moved or are new."""

    entries: list[PlanEntry]
    moved: int
    new: int
    following: int


def params_key(params_json: str) -> str:
    """Returns a params object's RFC 8785 text (stored rows of format 1 used Python's)."""
    return canonical_json(json.loads(params_json or "{}"))


def other_params(
    entries: Sequence[PlanEntry], stored: Mapping[str, StoredPlan]
) -> OtherParams | None:
    """Returns the new shards with params none of the stored shards has (None: none such)."""
    have = sorted({params_key(s.plan.params_json) for s in stored.values() if s.plan is not None})
    if not have:
        return None
    new = [e for e in entries if e.shard_id not in stored]
    other = [e for e in new if canonical_json(dict(e.params)) not in have]
    if not other:
        return None
    sent = sorted({canonical_json(dict(e.params)) for e in other})
    return OtherParams(stored=len(stored), have=have, other=len(other), sent=sent)


def plan_differences(
    entry: PlanEntry, labels: Mapping[str, str], stored: StoredPlan
) -> dict[str, dict[str, Any]]:
    """Returns the fields in which a re-plan of a stored shard differs: {field: stored, sent}."""
    plan = stored.plan
    if plan is None:
        return {}
    pairs: dict[str, tuple[Any, Any]] = {
        "input": (plan.input_ref, entry.input_ref),
        "input_bytes": (plan.input_bytes, entry.input_bytes),
        "input_blake3": (plan.input_blake3, entry.input_blake3),
        "params": (params_key(plan.params_json), canonical_json(dict(entry.params))),
        "expected_outputs": (list(plan.expected_outputs), list(entry.expected_outputs)),
        "labels": (dict(plan.labels), dict(labels)),
    }
    return {k: {"stored": a, "sent": b} for k, (a, b) in pairs.items() if a != b}


def renumbered(entries: Sequence[PlanEntry], stored: Mapping[str, int]) -> Renumbering:
    """Returns the entries with the stored shards' indexes kept and the new ones after them."""
    if not stored:
        return Renumbering(list(entries), moved=0, new=len(entries), following=0)
    first_new = following = max(stored.values()) + 1
    out: list[PlanEntry] = []
    for entry in entries:
        index = stored.get(entry.shard_id)
        if index is None:
            index, following = following, following + 1
        out.append(dataclasses.replace(entry, plan_index=index))
    moved = sum(a.plan_index != b.plan_index for a, b in zip(entries, out, strict=True))
    new = sum(entry.shard_id not in stored for entry in entries)
    return Renumbering(out, moved=moved, new=new, following=first_new)
