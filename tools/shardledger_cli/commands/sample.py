"""`shardledger sample RUN --as RUN-ref`: a seeded, stratified sample of verified shards as a new run.

Format checks cannot see a result that is well-formed and wrong;
only re-computing a sample in a reference environment can. After a night, pick a
fixed share of its verified shards (default 5 %, at least 20), stratified by
fingerprint group (each group in proportion, largest remainders first) and chosen
by a seeded hash of the shard id, so the same seed picks the same shards. They
are planned, with their original definitions and plan lines, as a new run
labelled ``sample_of=RUN`` (plus the origin's labels, seed and fraction): run it
with the same launchers in the reference environment (``shardledger resume
RUN-ref`` hands back its plan lines), then ``shardledger compare RUN RUN-ref``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, Final

from ledger_server.reference import stratified_sample, verified_groups
from shard_client.errors import LedgerRejected
from shard_client.ids import PlanEntry, check_id
from shardledger_cli.cli import (
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_REJECTED,
    EXIT_USAGE,
    CommandError,
    at_least,
    client_from,
)
from shardledger_cli.commands.plan import send_plan
from shardledger_cli.local_ledger import serve_db_option, unless_dry_run
from shardledger_cli.output import print_json, print_note, print_table
from shardledger_cli.parsing import add_format_option, json_help, output_format

__all__ = ["register", "run_sample"]

SAMPLE_OF_LABEL: Final = "sample_of"

EXAMPLES: Final = """
Examples:
  shardledger sample night-01 --as night-01-ref                 # 5 %, at least 20, seed 0
  shardledger sample night-01 --as night-01-ref --fraction 0.1 --min 50 --seed 7
  shardledger sample night-01 --as night-01-ref --dry-run --json   # what would be picked
  shardledger resume night-01-ref -o ref-jobs.jsonl             # then launch them as usual

exit codes: 0 the sample run is planned (or, with --dry-run, printed); 1 the run
has no verified shard to sample; 2 usage; 3 server unreachable; 4 refused (an
unknown run, or --as names a run planned with other shards)"""


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"a share above 0 and at most 1, not {text!r}")
    return value


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """Adds the sample command."""
    p = sub.add_parser(
        "sample",
        parents=[common],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="plan a seeded, stratified sample of a run's verified shards as a reference run",
        description=(__doc__ or "").split("\n", 1)[1] + EXAMPLES,
    )
    p.add_argument("run", help="the run to sample")
    p.add_argument("--as", dest="sample_run", required=True, metavar="RUN-ref", help="new run id")
    p.add_argument("--fraction", type=_fraction, default=0.05, help="share to pick (default 0.05)")
    p.add_argument("--min", type=at_least(1), default=20, help="at least this many (default 20)")
    p.add_argument("--seed", default="0", help="the same seed picks the same shards (default 0)")
    p.add_argument("--dry-run", action="store_true", help="print the pick; plan nothing")
    json_help(p, single="the sample run: which shards were picked, by fingerprint group")
    add_format_option(p)
    serve_db_option(
        p,
        run_sample,
        refuse=unless_dry_run("sample plans the reference run", "print the pick", "plan it"),
    )


def _origin(client: Any, run: str, namespace: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Returns the run's plans by shard id (as events carry them) and its labels."""
    plans: dict[str, Any] = {}
    labels: dict[str, str] = {}
    for e in client.list_events(run, namespace=namespace, page_size=5000):
        if e.HasField("planned"):
            plans.setdefault(e.shard_id, e.planned)
            labels = labels or dict(e.planned.labels)
    return plans, labels


def run_sample(args: argparse.Namespace) -> int:
    """Picks the sample and plans it as a new run linked to its origin by labels."""
    try:
        check_id("run id", args.sample_run)
    except ValueError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    if args.sample_run == args.run:
        raise CommandError("--as must name a new run, not the sampled one", EXIT_USAGE)
    client = client_from(args)
    views = [json.loads(v.view_json) for v in client.shards(args.run, namespace=args.namespace)]
    groups = verified_groups(views)
    picked = stratified_sample(groups, fraction=args.fraction, minimum=args.min, seed=args.seed)
    chosen = sorted((sid for ids in picked.values() for sid in ids), key=lambda s: s)
    report: dict[str, Any] = {
        "run_id": args.sample_run,
        "sample_of": args.run,
        "seed": args.seed,
        "fraction": args.fraction,
        "min": args.min,
        "verified": sum(len(ids) for ids in groups.values()),
        "sampled": len(chosen),
        "groups": {
            g: {"verified": len(groups[g]), "sampled": len(ids)} for g, ids in picked.items()
        },
        "shards": chosen,
        "planned": False,
    }
    if not chosen:
        _print(report, fmt=output_format(args))
        print(f"shardledger: run {args.run} has no verified shard to sample", file=sys.stderr)
        return EXIT_PROBLEMS
    if not args.dry_run:
        report["planned"] = True
        code = _plan(client, args, chosen)
        if code != EXIT_OK:
            return code
    _print(report, fmt=output_format(args))
    return EXIT_OK


def _existing(client: Any, run: str, namespace: str) -> tuple[set[str], dict[str, str]] | None:
    """Returns the shards and labels of the run if it exists (None: a new run id)."""
    try:
        client.summary(run, namespace=namespace)
    except LedgerRejected as exc:
        if exc.reason == "RUN_NOT_FOUND":
            return None
        raise
    plans, labels = _origin(client, run, namespace)
    return set(plans), labels


def _plan(client: Any, args: argparse.Namespace, chosen: Sequence[str]) -> int:
    plans, labels = _origin(client, args.run, args.namespace)
    entries = [
        PlanEntry(
            shard_id=sid,
            input_ref=plans[sid].input_ref,
            input_bytes=plans[sid].input_bytes,
            input_blake3=plans[sid].input_blake3,
            params=json.loads(plans[sid].params_json or "{}"),
            expected_outputs=tuple(plans[sid].expected_outputs),
            plan_line=plans[sid].plan_line,
            plan_index=i,
        )
        for i, sid in enumerate(chosen)
    ]
    link = labels | {
        SAMPLE_OF_LABEL: args.run,
        "sample_seed": str(args.seed)[:256],
        "sample_fraction": str(args.fraction),
    }
    existing = _existing(client, args.sample_run, args.namespace)
    if existing is not None and existing != (set(chosen), link):
        # A sample run is one pick: adding another seed's shards to it would blur both.
        raise CommandError(
            f"refused: run {args.sample_run} already exists with other shards or labels;"
            " pick another --as",
            EXIT_REJECTED,
        )
    outcome = send_plan(client, args.sample_run, entries, namespace=args.namespace, labels=link)
    if outcome.conflicts or outcome.refused:
        first = (outcome.conflicts or outcome.refused)[0]
        raise CommandError(
            f"refused: run {args.sample_run} cannot take this sample ({first[0].shard_id}:"
            f" {first[1]}); pick another --as",
            EXIT_REJECTED,
        )
    return EXIT_OK


def _print(report: dict[str, Any], *, fmt: str) -> None:
    if fmt == "json":
        print_json(report)
        return
    plain = fmt == "plain"
    verb = "planned" if report["planned"] else "would plan"
    if plain:
        keys = ("run_id", "sample_of", "seed", "fraction", "min", "verified", "sampled")
        fields = [(k.replace("_", " "), report[k]) for k in keys]
        fields.append(("planned", "yes" if report["planned"] else "no"))
        print_table("sample", ("field", "value"), fields, plain=True)
        groups = [(g, n["verified"], n["sampled"]) for g, n in report["groups"].items()]
        print_table("groups", ("fingerprint", "verified", "sampled"), groups, plain=True)
        print_table("shards", ("shard",), [(sid,) for sid in report["shards"]], plain=True)
    else:
        print(
            f"{verb} {report['sampled']} of {report['verified']} verified shards of"
            f" {report['sample_of']} as run {report['run_id']} (seed {report['seed']})"
        )
        for group, n in report["groups"].items():
            print(f"  fingerprint {group[:16]}: {n['sampled']} of {n['verified']}")
    if report["planned"]:
        print_note(
            f"  next: shardledger resume {report['run_id']} -o ref-jobs.jsonl,"
            f" run them in the reference environment, then shardledger compare"
            f" {report['sample_of']} {report['run_id']}",
            plain=plain,
        )
