"""The five-step platform acceptance (docs/metrics.md): each step judged against its thresholds.

Pure: functions of run summaries (the JSON GetRunSummary serves) and shard artifacts
(ledger_server.drift). `shardledger accept` reads the runs and renders the verdict.

1. a ruler sample run over at least N rounds (the same shards each round);
2. the four metrics of every round: verified completion, silent errors,
   cross-batch consistency with the previous round, and resume misses;
3. an interruption test: the run killed midway and resumed has no duplicate
   results and no gaps;
4. an environment comparison: every fingerprint seen is one the reference run had;
5. a multi-GPU run: every result set holds exactly its input ids, all verified.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from ledger_server.drift import ShardArtifacts, consistency_of

__all__ = ["AcceptanceRun", "Step", "Thresholds", "accept"]

ID_SET_REASONS: Final = ("id_set_mismatch", "id_set_unreadable")


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Where acceptance draws its lines (common values by default)."""

    min_rounds: int = 3
    min_completion: float = 0.99
    max_silent: float = 0.01
    min_consistency: float = 0.95


@dataclass(frozen=True, slots=True)
class AcceptanceRun:
    """One run as acceptance reads it: its summary and its shards' outputs."""

    run_id: str
    summary: dict[str, Any]
    shards: dict[str, ShardArtifacts]


@dataclass(slots=True)
class Step:
    """One acceptance step: its outcome, why, and the numbers it judged."""

    number: int
    name: str
    status: str = "pass"
    reasons: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def fail(self, reason: str) -> None:
        """Marks the step failed for this reason."""
        self.status = "fail"
        self.reasons.append(reason)

    def skip(self, reason: str) -> Step:
        """Marks the step skipped (its run was not given) and returns it."""
        self.status = "skipped"
        self.reasons.append(reason)
        return self


def accept(
    rounds: Sequence[AcceptanceRun],
    thresholds: Thresholds,
    *,
    interruption: AcceptanceRun | None = None,
    reference: AcceptanceRun | None = None,
    multi_gpu: AcceptanceRun | None = None,
) -> list[Step]:
    """Returns the five steps judged; the platform is accepted when none failed."""
    return [
        _rounds(rounds, thresholds.min_rounds),
        _metrics(rounds, thresholds),
        _interruption(interruption),
        _environment(rounds, reference),
        _multi_gpu(multi_gpu),
    ]


def _shards(n: int) -> str:
    return f"{n} shard" if n == 1 else f"{n} shards"


def _pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def _rounds(rounds: Sequence[AcceptanceRun], min_rounds: int) -> Step:
    step = Step(1, "ruler sample over rounds")
    sets = [frozenset(r.shards) for r in rounds]
    step.details = {"rounds": len(rounds), "shards": [len(s) for s in sets]}
    if len(rounds) < min_rounds:
        step.fail(f"{len(rounds)} rounds, fewer than {min_rounds}")
    if len(set(sets)) > 1:
        step.fail("the rounds are not the same shards (a ruler sample never changes)")
    return step


def _metrics(rounds: Sequence[AcceptanceRun], limits: Thresholds) -> Step:
    step = Step(2, "the four metrics of every round")
    per_round = []
    for i, r in enumerate(rounds):
        s = r.summary
        row: dict[str, Any] = {
            "run_id": r.run_id,
            "completion_rate": s["completion_rate"],
            "silent_error_rate": s["silent_error_rate"],
            "resume_misses": s["submitted"] - s["verified"],
            "consistency_rate": None,
        }
        if s["completion_rate"] < limits.min_completion:
            step.fail(
                f"{r.run_id}: completion {_pct(s['completion_rate'])}"
                f" < {_pct(limits.min_completion)}"
            )
        if s["silent_error_rate"] > limits.max_silent:
            step.fail(
                f"{r.run_id}: silent errors {_pct(s['silent_error_rate'])}"
                f" > {_pct(limits.max_silent)}"
            )
        if i:
            c = consistency_of(rounds[i - 1].shards, r.shards)
            row["consistency_rate"] = c["consistency_rate"]
            if c["consistency_rate"] is None:
                step.fail(
                    f"{r.run_id}: no output in the same fingerprint group as the round before"
                )
            elif c["consistency_rate"] < limits.min_consistency:
                step.fail(
                    f"{r.run_id}: consistency {_pct(c['consistency_rate'])}"
                    f" < {_pct(limits.min_consistency)}"
                )
        per_round.append(row)
    step.details = {"rounds": per_round}
    return step


def _interruption(run: AcceptanceRun | None) -> Step:
    step = Step(3, "interruption test: duplicates and gaps")
    if run is None:
        return step.skip("no --interruption run")
    s = run.summary
    duplicates, gaps = s["duplicates"]["wasted"], s["submitted"] - s["verified"]
    step.details = {"run_id": run.run_id, "duplicates": duplicates, "gaps": gaps}
    if duplicates:
        step.fail(f"{_shards(duplicates)} with a second result (duplicated work)")
    if gaps:
        step.fail(f"{_shards(gaps)} with no verified result after the resume (gaps)")
    return step


def _environment(rounds: Sequence[AcceptanceRun], reference: AcceptanceRun | None) -> Step:
    step = Step(4, "environment comparison with the reference")
    if reference is None:
        return step.skip("no --reference run")
    known = set(reference.summary["fingerprint_groups"])
    seen = {fp for r in rounds for fp in r.summary["fingerprint_groups"]}
    step.details = {"reference": reference.run_id, "new_fingerprints": sorted(seen - known)}
    if seen - known:
        step.fail(
            f"{len(seen - known)} fingerprint(s) the reference never had: the environment drifted"
        )
    return step


def _multi_gpu(run: AcceptanceRun | None) -> Step:
    step = Step(5, "multi-GPU result ID-set completeness")
    if run is None:
        return step.skip("no --multi-gpu run")
    s = run.summary
    mismatched = sum(s["verify_failures"].get(r, 0) for r in ID_SET_REASONS)
    step.details = {
        "run_id": run.run_id,
        "id_set_mismatches": mismatched,
        "unverified": s["submitted"] - s["verified"],
    }
    if mismatched:
        step.fail(f"{mismatched} result sets do not hold exactly their input ids")
    if s["submitted"] != s["verified"]:
        step.fail(f"{_shards(s['submitted'] - s['verified'])} not verified")
    return step
