"""The demo's injected faults: which shards get which failure form, and the ground-truth comparison.

Every form is chosen from the seed alone, on disjoint shards, so the same
``--seed`` injects the same faults into the same plan indexes on every run, and
the ledger's answer can be checked against what was done to it.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from shardledger_cli.output import count_shards

# The failure forms of a batch night (docs/concepts.md), one injected fault each.
SILENT_MISSING: Final = "silent_missing"
TRUNCATION: Final = "truncation"
EMPTY_OUTPUT: Final = "empty_output"
NAN_WEIGHTS: Final = "nan_weights"
HANG: Final = "hang"
DUPLICATE_RETRY: Final = "duplicate_retry"
ENV_DRIFT: Final = "env_drift"
FORMS: Final = (
    SILENT_MISSING,
    TRUNCATION,
    EMPTY_OUTPUT,
    NAN_WEIGHTS,
    HANG,
    DUPLICATE_RETRY,
    ENV_DRIFT,
)
# Object-storage forms (`demo --storage s3`): the job SIGKILLed mid-upload, and an
# object replaced or deleted in the bucket after its commit.
TORN_UPLOAD: Final = "torn_upload"
REPLACED_OBJECT: Final = "replaced_object"
DELETED_OBJECT: Final = "deleted_object"
STORAGE_FORMS: Final = (TORN_UPLOAD, REPLACED_OBJECT, DELETED_OBJECT)
# Forms that kill their worker process: never started while the ledger is down.
LETHAL: Final = frozenset({TRUNCATION, HANG, TORN_UPLOAD})

# The resume reason the ledger must give each failing form (docs/projections.md).
EXPECTED_REASON: Final[Mapping[str, str]] = {
    SILENT_MISSING: "failed:incomplete",
    TRUNCATION: "failed:timeout",
    HANG: "failed:timeout",
    EMPTY_OUTPUT: "verify_failed:empty",
    NAN_WEIGHTS: "verify_failed:nan_or_inf",
    TORN_UPLOAD: "failed:timeout",
    REPLACED_OBJECT: "verify_failed:version_mismatch",
    DELETED_OBJECT: "verify_failed:missing",
}
MIN_SHARDS: Final = 20


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """Plan index -> failure form for the shards that get one; the rest run clean."""

    by_index: dict[int, str]
    extra_forms: tuple[str, ...] = ()

    @classmethod
    def choose(cls, shards: int, seed: int, *, extra: Sequence[str] = ()) -> FaultPlan:
        """Returns disjoint, seeded fault shards: about 2-4 % of the run in total.

        ``extra`` forms (the object-storage ones) are injected as well, as many as each
        local form.
        """
        if shards < MIN_SHARDS:
            raise ValueError(f"the demo needs at least {MIN_SHARDS} shards")
        each = max(1, round(shards / 200))
        counts = {form: each for form in (*FORMS, *extra)}
        # One drifted shard would be a group of one; a few make the split visible.
        counts[ENV_DRIFT] = max(2, round(shards / 100))
        rng = random.Random(f"shardledger-demo-faults/{seed}")
        chosen = rng.sample(range(shards), sum(counts.values()))
        by_index: dict[int, str] = {}
        for form in (*FORMS, *extra):
            for _ in range(counts[form]):
                by_index[chosen.pop()] = form
        return cls(dict(sorted(by_index.items())), tuple(extra))

    def form_of(self, index: int) -> str | None:
        """Returns the failure form injected at a plan index, or None."""
        return self.by_index.get(index)

    def indexes(self, form: str) -> list[int]:
        """Returns the plan indexes of one form, ascending."""
        return [i for i, f in self.by_index.items() if f == form]

    def expected(self, shard_ids: Sequence[str]) -> dict[str, str]:
        """Returns shard id -> the resume reason its fault must produce."""
        return {
            shard_ids[i]: EXPECTED_REASON[form]
            for i, form in self.by_index.items()
            if form in EXPECTED_REASON
        }


@dataclass(frozen=True, slots=True)
class Check:
    """One ground-truth assertion about the ledger and whether it held."""

    name: str
    ok: bool
    detail: str
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """Returns the check as JSON."""
        return {"name": self.name, "ok": self.ok, "detail": self.detail, "problems": self.problems}


def check_resume_list(expected: Mapping[str, str], found: Mapping[str, str]) -> Check:
    """Checks the resume list is exactly the injected failures, each with its reason."""
    problems = []
    for shard_id in sorted(set(expected) | set(found)):
        want, got = expected.get(shard_id), found.get(shard_id)
        if want is None:
            problems.append(f"{shard_id}: in the resume list ({got}) but no fault was injected")
        elif got is None:
            problems.append(f"{shard_id}: injected ({want}) but missing from the resume list")
        elif want != got:
            problems.append(f"{shard_id}: expected {want}, the ledger says {got}")
    detail = f"{count_shards(len(found))} listed, {len(expected)} injected failures"
    return Check("resume list = injected failures", not problems, detail, problems)


def check_duplicates(dup_ids: Sequence[str], views: Mapping[str, Mapping[str, Any]]) -> Check:
    """Checks each retried shard is verified and counted as wasted, not non-deterministic."""
    problems = []
    for shard_id in dup_ids:
        view = views[shard_id]
        kinds = list(view["duplicates"])
        if view["state"] != "verified":
            problems.append(f"{shard_id}: state {view['state']}, expected verified")
        if "wasted" not in kinds:
            problems.append(f"{shard_id}: duplicates {kinds}, expected wasted")
        if "nondeterministic" in kinds:
            problems.append(f"{shard_id}: two attempts committed different bytes")
    return Check(
        "duplicate retry = wasted, verified", not problems, f"{len(dup_ids)} retried", problems
    )


def check_drift(
    drift_ids: Sequence[str], views: Mapping[str, Mapping[str, Any]], summary: Mapping[str, Any]
) -> Check:
    """Checks the drifted shards are verified and form the second of exactly two groups."""
    problems = []
    groups = summary["fingerprint_groups"]
    if len(groups) != 2:
        problems.append(f"{len(groups)} fingerprint groups, expected 2")
    drifted = {views[s]["fingerprint"] for s in drift_ids}
    if len(drifted) != 1 or groups.get(next(iter(drifted)), 0) != len(drift_ids):
        problems.append("the drifted shards do not form one group of their own")
    problems += [
        f"{s}: state {views[s]['state']}, expected verified"
        for s in drift_ids
        if views[s]["state"] != "verified"
    ]
    sizes = " + ".join(str(n) for n in sorted(groups.values(), reverse=True))
    return Check("environment drift = 2 fingerprint groups", not problems, sizes, problems)


def check_summary(summary: Mapping[str, Any], *, shards: int, plan: FaultPlan) -> Check:
    """Checks the reconciliation equation and the silent errors against the injected faults."""
    failing = sum(1 for form in plan.by_index.values() if form in EXPECTED_REASON)
    silent = len(plan.indexes(SILENT_MISSING) + plan.indexes(EMPTY_OUTPUT))
    silent += len(plan.indexes(NAN_WEIGHTS))
    # Committed, then changed in the bucket: reported success that verify refutes.
    silent += len(plan.indexes(REPLACED_OBJECT) + plan.indexes(DELETED_OBJECT))
    want = {
        "submitted": shards,
        "verified": shards - failing,
        "failed": failing,
        "missing": 0,
        "running": 0,
        "stale": 0,
        "unverified": 0,
        "silent_errors": silent,
    }
    problems = [f"{k} = {summary[k]}, expected {v}" for k, v in want.items() if summary[k] != v]
    # In the equation's own terms: the summary's "failed" counts verify_failed too.
    verify_failed = summary["verify_failed"]
    detail = (
        f"verified {summary['verified']} + failed {summary['failed'] - verify_failed}"
        f" + verify_failed {verify_failed} of {shards}"
    )
    return Check("reconciliation and silent errors", not problems, detail, problems)
