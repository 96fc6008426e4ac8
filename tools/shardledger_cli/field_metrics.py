"""Report 1's platform table (§2.2) from the ledger: the seven figures, by any label.

Pure functions of fetched runs (`RunData`); docs/metrics.md defines each figure
in the same words. A shard belongs to the group of the labels it first ran under
(its first attempt's over the run's; a shard that never started, the run's); an
attempt-level count (reclaims, hangs, truncations) to the labels of the attempt.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from ledger_server.analysis import (
    EMPTY_REASONS,
    HANG_TAG,
    RECLAIM_TAGS,
    TRUNCATED_REASONS,
    AttemptRow,
    RunTables,
)
from shardledger_cli.run_data import RunData

__all__ = ["FIELD_METRICS", "GroupFigures", "by_label", "first_attempt_verified"]

NO_LABEL: Final = "(none)"
# (key, label as report 1's table names it), in its row order.
FIELD_METRICS: Final = (
    ("missing_rate", "shard missing rate"),
    ("silent_empty_share", "silent empty-output share"),
    ("truncations", "output truncations"),
    ("reclaims", "preemptions / reclaims"),
    ("hangs", "hangs needing intervention"),
    ("fingerprint_drift", "fingerprint drift"),
    ("first_pass_reconciliation_rate", "first-pass reconciliation rate"),
)


@dataclass(slots=True)
class GroupFigures:
    """The counts of one label value over the selected runs, and the figures they give."""

    value: str
    runs: set[str] = field(default_factory=set)
    shards: int = 0
    missing: int = 0
    silent_empty: int = 0
    truncations: int = 0
    reclaims: int = 0
    hangs: int = 0
    fingerprints: list[str] = field(default_factory=list)
    first_attempt_verified: int = 0

    def as_json(self, label: str) -> dict[str, Any]:
        """Returns the group as the JSON line `report --by --json` prints."""
        shards = self.shards or 1
        return {
            "label": label,
            "value": self.value,
            "runs": sorted(self.runs),
            "shards": self.shards,
            "missing": self.missing,
            "missing_rate": self.missing / shards,
            "silent_empty": self.silent_empty,
            "silent_empty_share": self.silent_empty / shards,
            "truncations": self.truncations,
            "reclaims": self.reclaims,
            "hangs": self.hangs,
            "fingerprints": len(self.fingerprints),
            "fingerprint_drift": max(len(self.fingerprints) - 1, 0),
            "first_attempt_verified": self.first_attempt_verified,
            "first_pass_reconciliation_rate": self.first_attempt_verified / shards,
        }


def first_attempt_verified(tables: RunTables, expected: dict[str, Sequence[str]]) -> set[str]:
    """Returns the shards whose very first attempt ran in the first pass and was verified.

    The first pass closes at the run's first verdict; the attempt's every expected
    output (or, with none declared, every output it committed) has a passing
    latest verdict on its own commit.
    """
    first: dict[str, AttemptRow] = {}
    for attempt in sorted(tables.attempts.values(), key=lambda a: a.started_sequence):
        first.setdefault(attempt.shard_id, attempt)
    latest: dict[tuple[str, str], str] = {}
    for v in tables.verdicts:
        if v["attempt_id"]:
            latest[(v["attempt_id"], v["name"])] = v["result"]
    committed: dict[str, set[str]] = defaultdict(set)
    for a in tables.artifacts:
        committed[a["attempt_id"]].add(a["name"])
    closed = tables.first_verdict_sequence
    out = set()
    for shard_id, attempt in first.items():
        if not closed or attempt.started_sequence > closed:
            continue
        names = expected.get(shard_id) or sorted(committed[attempt.attempt_id])
        if names and all(latest.get((attempt.attempt_id, n)) == "passed" for n in names):
            out.add(shard_id)
    return out


def _group(groups: dict[str, GroupFigures], labels: dict[str, str], label: str) -> GroupFigures:
    value = labels.get(label) or NO_LABEL
    return groups.setdefault(value, GroupFigures(value))


def by_label(runs: Iterable[RunData], label: str) -> list[GroupFigures]:
    """Returns the seven figures per value of ``label`` over the runs, sorted by value."""
    groups: dict[str, GroupFigures] = {}
    for data in runs:
        t = data.tables
        expected = {sid: json.loads(p["expected_outputs"]) for sid, p in t.plans.items()}
        empty = {
            v["shard_id"]
            for v in t.verdicts
            if v["result"] == "failed" and v["reason"] in EMPTY_REASONS
        }
        verified_first = first_attempt_verified(t, expected)
        first_labels: dict[str, dict[str, str]] = {}
        for attempt in sorted(t.attempts.values(), key=lambda a: a.started_sequence):
            first_labels.setdefault(attempt.shard_id, t.attempt_labels(attempt.attempt_id))
            g = _group(groups, t.attempt_labels(attempt.attempt_id), label)
            g.runs.add(data.run_id)
            if attempt.failed_tag in RECLAIM_TAGS:
                g.reclaims += 1
            if attempt.failed_tag == HANG_TAG:
                g.hangs += 1
            if attempt.fingerprint and attempt.fingerprint not in g.fingerprints:
                g.fingerprints.append(attempt.fingerprint)
        for view in data.views:
            sid = view["shard_id"]
            g = _group(groups, first_labels.get(sid, t.labels), label)
            g.runs.add(data.run_id)
            g.shards += 1
            g.missing += view["state"] in ("missing", "stale")
            # A stale shard's attempt went silent: someone has to stop it (report 1, §3.4).
            g.hangs += view["state"] == "stale"
            g.first_attempt_verified += sid in verified_first
            g.silent_empty += _silent_empty(view, sid in empty)
        for v in t.verdicts:
            if v["result"] == "failed" and v["reason"] in TRUNCATED_REASONS:
                _group(groups, t.attempt_labels(v["attempt_id"] or ""), label).truncations += 1
    return [groups[k] for k in sorted(groups)]


def _silent_empty(view: dict[str, Any], failed_empty: bool) -> bool:
    """Returns whether the shard reported success and left nothing usable (empty or absent)."""
    if view["state"] == "failed" and view["detail"] == "incomplete":
        return True
    return view["state"] == "verify_failed" and failed_empty
