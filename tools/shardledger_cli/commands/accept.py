"""`shardledger accept`: the five-step platform acceptance (docs/metrics.md), with its thresholds.

1. a ruler sample run over at least 3 rounds (the same shards each round);
2. the four metrics of every round: verified completion, silent errors,
   cross-batch consistency with the previous round, and resume misses;
3. an interruption test: the run killed midway and resumed has no duplicate
   results and no gaps;
4. an environment comparison: every fingerprint seen is one the reference run had;
5. a multi-GPU run: every result set holds exactly its input ids, all verified.

Reject when verified completion < 99 %, silent errors > 1 % or consistency < 95 %
in any round (common thresholds, each configurable), or when a step given
fails. A step not given (no --interruption, --reference or --multi-gpu run) is
listed as skipped.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Any, Final

from shardledger_cli.cli import (
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_USAGE,
    CommandError,
    at_least,
    client_from,
)
from shardledger_cli.commands.trend import ShardArtifacts, consistency_of, shard_artifacts
from shardledger_cli.local_ledger import serve_db_option
from shardledger_cli.output import count_shards, print_json, print_table
from shardledger_cli.parsing import add_format_option, json_help, output_format

__all__ = ["register", "run_accept"]

ID_SET_REASONS: Final = ("id_set_mismatch", "id_set_unreadable")

EXAMPLES: Final = """
Examples:
  shardledger accept --runs ruler-1,ruler-2,ruler-3
  shardledger accept --runs ruler-1,ruler-2,ruler-3 --interruption kill-test \\
      --reference baseline-night --multi-gpu gather-test --json
  shardledger accept --runs r1,r2,r3 --min-completion 0.995 --max-silent 0.005

exit codes: 0 accepted; 1 rejected; 2 usage; 3 server unreachable; 4 refused
(e.g. an unknown run)"""


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a share between 0 and 1, not {text!r}")
    return value


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """Adds the accept command."""
    p = sub.add_parser(
        "accept",
        parents=[common],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="five-step platform acceptance: pass or fail, with the evidence",
        description=(__doc__ or "").split("\n", 1)[1] + EXAMPLES,
    )
    p.add_argument(
        "--runs", required=True, metavar="R1,R2,...", help="the ruler rounds, oldest first"
    )
    p.add_argument("--interruption", metavar="RUN", help="step 3: the killed-and-resumed run")
    p.add_argument("--reference", metavar="RUN", help="step 4: the reference environment's run")
    p.add_argument("--multi-gpu", metavar="RUN", help="step 5: a multi-GPU run with keyed results")
    p.add_argument("--min-rounds", type=at_least(1), default=3, help="default 3")
    p.add_argument("--min-completion", type=_rate, default=0.99, help="default 0.99")
    p.add_argument("--max-silent", type=_rate, default=0.01, help="default 0.01")
    p.add_argument("--min-consistency", type=_rate, default=0.95, help="default 0.95")
    json_help(p, single="the acceptance verdict, each step with its figures and threshold")
    add_format_option(p)
    serve_db_option(p, run_accept)


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


@dataclass(frozen=True, slots=True)
class _Run:
    run_id: str
    summary: dict[str, Any]
    shards: dict[str, ShardArtifacts]


def _load(client: Any, run_id: str, namespace: str) -> _Run:
    summary = json.loads(client.summary(run_id, namespace=namespace))
    views = (json.loads(v.view_json) for v in client.shards(run_id, namespace=namespace))
    return _Run(run_id, summary, shard_artifacts(views))


def _pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def _rounds(rounds: list[_Run], min_rounds: int) -> Step:
    step = Step(1, "ruler sample over rounds")
    sets = [frozenset(r.shards) for r in rounds]
    step.details = {"rounds": len(rounds), "shards": [len(s) for s in sets]}
    if len(rounds) < min_rounds:
        step.fail(f"{len(rounds)} rounds, fewer than {min_rounds}")
    if len(set(sets)) > 1:
        step.fail("the rounds are not the same shards (a ruler sample never changes)")
    return step


def _metrics(rounds: list[_Run], args: argparse.Namespace) -> Step:
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
        if s["completion_rate"] < args.min_completion:
            step.fail(
                f"{r.run_id}: completion {_pct(s['completion_rate'])} < {_pct(args.min_completion)}"
            )
        if s["silent_error_rate"] > args.max_silent:
            step.fail(
                f"{r.run_id}: silent errors {_pct(s['silent_error_rate'])} > {_pct(args.max_silent)}"
            )
        if i:
            c = consistency_of(rounds[i - 1].shards, r.shards)
            row["consistency_rate"] = c["consistency_rate"]
            if c["consistency_rate"] is None:
                step.fail(
                    f"{r.run_id}: no output in the same fingerprint group as the round before"
                )
            elif c["consistency_rate"] < args.min_consistency:
                step.fail(
                    f"{r.run_id}: consistency {_pct(c['consistency_rate'])}"
                    f" < {_pct(args.min_consistency)}"
                )
        per_round.append(row)
    step.details = {"rounds": per_round}
    return step


def _interruption(run: _Run | None) -> Step:
    step = Step(3, "interruption test: duplicates and gaps")
    if run is None:
        step.status = "skipped"
        step.reasons.append("no --interruption run")
        return step
    s = run.summary
    duplicates, gaps = s["duplicates"]["wasted"], s["submitted"] - s["verified"]
    step.details = {"run_id": run.run_id, "duplicates": duplicates, "gaps": gaps}
    if duplicates:
        step.fail(f"{count_shards(duplicates)} with a second result (duplicated work)")
    if gaps:
        step.fail(f"{count_shards(gaps)} with no verified result after the resume (gaps)")
    return step


def _environment(rounds: list[_Run], reference: _Run | None) -> Step:
    step = Step(4, "environment comparison with the reference")
    if reference is None:
        step.status = "skipped"
        step.reasons.append("no --reference run")
        return step
    known = set(reference.summary["fingerprint_groups"])
    seen = {fp for r in rounds for fp in r.summary["fingerprint_groups"]}
    step.details = {"reference": reference.run_id, "new_fingerprints": sorted(seen - known)}
    if seen - known:
        step.fail(
            f"{len(seen - known)} fingerprint(s) the reference never had: the environment drifted"
        )
    return step


def _multi_gpu(run: _Run | None) -> Step:
    step = Step(5, "multi-GPU result ID-set completeness")
    if run is None:
        step.status = "skipped"
        step.reasons.append("no --multi-gpu run")
        return step
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
        step.fail(f"{count_shards(s['submitted'] - s['verified'])} not verified")
    return step


def run_accept(args: argparse.Namespace) -> int:
    """Evaluates the five steps; exits 0 when the platform is accepted, 1 when rejected."""
    names = [r for r in args.runs.split(",") if r]
    if not names:
        raise CommandError("--runs names no run", EXIT_USAGE)
    client = client_from(args)
    rounds = [_load(client, r, args.namespace) for r in names]
    optional = {
        key: _load(client, getattr(args, key), args.namespace) if getattr(args, key) else None
        for key in ("interruption", "reference", "multi_gpu")
    }
    steps = [
        _rounds(rounds, args.min_rounds),
        _metrics(rounds, args),
        _interruption(optional["interruption"]),
        _environment(rounds, optional["reference"]),
        _multi_gpu(optional["multi_gpu"]),
    ]
    accepted = all(s.status != "fail" for s in steps)
    verdict = "accept" if accepted else "reject"
    report: dict[str, Any] = {
        "verdict": verdict,
        "thresholds": {
            "min_rounds": args.min_rounds,
            "min_completion": args.min_completion,
            "max_silent": args.max_silent,
            "min_consistency": args.min_consistency,
        },
        "steps": [
            {
                "step": s.number,
                "name": s.name,
                "status": s.status,
                "reasons": s.reasons,
                **s.details,
            }
            for s in steps
        ],
    }
    fmt = output_format(args)
    if fmt == "json":
        print_json(report)
    else:
        _print(steps, verdict, plain=fmt == "plain")
    return EXIT_OK if accepted else EXIT_PROBLEMS


def _print(steps: list[Step], verdict: str, *, plain: bool) -> None:
    """Prints each step and the verdict: lines, or a "# steps" and a "# verdict" block."""
    failed = [r for s in steps for r in s.reasons if s.status == "fail"]
    if plain:
        rows = [(s.number, s.name, s.status, "; ".join(s.reasons)) for s in steps]
        print_table("steps", ("step", "name", "status", "reasons"), rows, plain=True)
        first = failed[0] if failed else ""
        print_table("verdict", ("verdict", "reason"), [(verdict, first)], plain=True)
        return
    for s in steps:
        print(f"{s.number}. {s.name}: {s.status.upper()}")
        for reason in s.reasons:
            print(f"     {reason}")
    print(f"verdict: {verdict.upper()}" + (f" ({failed[0]})" if failed else ""))
