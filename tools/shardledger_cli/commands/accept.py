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
import dataclasses
import json
from typing import Any, Final

from ledger_server.acceptance import AcceptanceRun, Step, Thresholds, accept
from ledger_server.drift import shard_artifacts
from shardledger_cli.cli import (
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_USAGE,
    CommandError,
    at_least,
    client_from,
)
from shardledger_cli.local_ledger import serve_db_option
from shardledger_cli.output import print_json, print_table
from shardledger_cli.parsing import add_format_option, json_help, output_format

__all__ = ["register", "run_accept"]

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


def _load(client: Any, run_id: str, namespace: str) -> AcceptanceRun:
    summary = json.loads(client.summary(run_id, namespace=namespace))
    views = (json.loads(v.view_json) for v in client.shards(run_id, namespace=namespace))
    return AcceptanceRun(run_id, summary, shard_artifacts(views))


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
    thresholds = Thresholds(
        min_rounds=args.min_rounds,
        min_completion=args.min_completion,
        max_silent=args.max_silent,
        min_consistency=args.min_consistency,
    )
    steps = accept(rounds, thresholds, **optional)
    accepted = all(s.status != "fail" for s in steps)
    verdict = "accept" if accepted else "reject"
    report: dict[str, Any] = {
        "verdict": verdict,
        "thresholds": dataclasses.asdict(thresholds),
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
