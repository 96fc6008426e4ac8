"""Ruler drift and cross-run consistency: outputs of the same shards compared between runs.

Pure: functions of shard views (the JSON a ShardView carries), no grpc or SQL.
`shardledger trend` and `shardledger accept` show what these compute
(docs/metrics.md). A digest that changed while the environment fingerprint stayed
the same is drift (non-determinism, a silent library change); a digest that
changed together with the fingerprint is expected, because numbers are only
comparable inside one fingerprint group.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import blake3

__all__ = [
    "ShardArtifacts",
    "compare_rulers",
    "consistency_of",
    "consistency_pairs",
    "outputs_digest",
    "shard_artifacts",
]


@dataclass(frozen=True, slots=True)
class ShardArtifacts:
    """What one shard of a run produced: its state, fingerprint group and output digests."""

    state: str
    fingerprint: str
    digests: dict[str, str]


def shard_artifacts(views: Iterable[dict[str, Any]]) -> dict[str, ShardArtifacts]:
    """Returns each shard's fingerprint and output digests from its shard views."""
    return {
        v["shard_id"]: ShardArtifacts(
            state=v["state"],
            fingerprint=v.get("fingerprint", ""),
            digests={name: a["blake3"] for name, a in v.get("artifacts", {}).items()},
        )
        for v in views
    }


def consistency_of(
    previous: dict[str, ShardArtifacts], current: dict[str, ShardArtifacts]
) -> dict[str, Any]:
    """Returns how many outputs of the same input in the same fingerprint group kept their digest.

    Only verified shards on both sides, and only outputs whose attempts recorded the
    same fingerprint: across groups numbers are not expected to match (docs/metrics.md).
    """
    compared = consistent = 0
    for shard_id in previous.keys() & current.keys():
        a, b = previous[shard_id], current[shard_id]
        if not (
            a.state == b.state == "verified" and a.fingerprint and a.fingerprint == b.fingerprint
        ):
            continue
        for name in a.digests.keys() & b.digests.keys():
            compared += 1
            consistent += a.digests[name] == b.digests[name]
    return {
        "compared_outputs": compared,
        "consistent": consistent,
        "consistency_rate": consistent / compared if compared else None,
    }


def consistency_pairs(
    run_ids: Sequence[str], artifacts: Mapping[str, dict[str, ShardArtifacts]]
) -> list[dict[str, Any]]:
    """Returns each run's consistency with the latest earlier run that shares shards with it.

    `run_ids` are oldest first; a run that shares no shard with an earlier one has no pair.
    """
    pairs = []
    for i, current in enumerate(run_ids):
        shards = artifacts[current].keys()
        earlier = (p for p in reversed(run_ids[:i]) if artifacts[p].keys() & shards)
        previous = next(earlier, None)
        if previous is not None:
            pair = {"run_id": current, "previous_run_id": previous}
            pairs.append(pair | consistency_of(artifacts[previous], artifacts[current]))
    return pairs


def outputs_digest(shards: dict[str, ShardArtifacts]) -> dict[str, Any]:
    """Returns one blake3 over every (shard, output, digest) of a run, and how many outputs."""
    rows = sorted(
        (sid, name, digest) for sid, s in shards.items() for name, digest in s.digests.items()
    )
    material = "\n".join("\t".join(r) for r in rows).encode()
    return {"outputs": len(rows), "digest": blake3.blake3(material).hexdigest()}


def compare_rulers(
    previous: dict[str, ShardArtifacts], current: dict[str, ShardArtifacts]
) -> dict[str, Any]:
    """Returns the outputs whose digest changed, split by whether the fingerprint changed too."""
    drift: list[dict[str, str]] = []
    across: list[dict[str, str]] = []
    unattributed: list[dict[str, str]] = []
    compared = unchanged = 0
    for shard_id in sorted(previous.keys() & current.keys()):
        before, after = previous[shard_id], current[shard_id]
        for name in sorted(before.digests.keys() & after.digests.keys()):
            compared += 1
            if before.digests[name] == after.digests[name]:
                unchanged += 1
                continue
            change = {
                "shard_id": shard_id,
                "output": name,
                "previous_fingerprint": before.fingerprint,
                "fingerprint": after.fingerprint,
                "previous_blake3": before.digests[name],
                "blake3": after.digests[name],
            }
            if not before.fingerprint or not after.fingerprint:
                unattributed.append(change)
            elif before.fingerprint == after.fingerprint:
                drift.append(change)
            else:
                across.append(change)
    return {
        "compared_outputs": compared,
        "unchanged": unchanged,
        "drift": drift,
        "across_groups": across,
        "unattributed": unattributed,
        "only_in_previous": sorted(previous.keys() - current.keys()),
        "only_in_current": sorted(current.keys() - previous.keys()),
    }
