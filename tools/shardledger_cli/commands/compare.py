"""`shardledger compare RUN RUN-ref`: output by output against a reference run; the silent error rate.

Re-compute a sample in a reference environment and compare (docs/metrics.md).
Each output of a shard verified in both runs is compared:

  same fingerprint group   strictly: the same digest, or, for an output given a
                           --tolerance, the numbers within it
  different groups         structure only (both verified): numbers need not match
                           across environments (docs/metrics.md)

The estimated silent error rate is disagreements / strictly compared outputs,
with a Wilson score interval; above --threshold (default 0.5 %, a common
line) the command exits 1.

Tolerances (--tolerance NAME=SPEC, repeatable), on .npy, .npz (every array) and
.json/.jsonl (every number, in order) files:
  max_abs:1e-6                      |a - b| <= 1e-6 everywhere
  rel:1e-5                          |a - b| <= 1e-5 * |b| everywhere
  allclose:rtol=1e-5,atol=1e-8      numpy.allclose
  validator:package.module:func     func(path, reference_path) -> bool
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Final

from ledger_server.reference import UnreadableNumbers, compare_outputs, parse_tolerance
from shardledger_cli.cli import (
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_USAGE,
    CommandError,
    client_from,
)
from shardledger_cli.local_ledger import serve_db_option
from shardledger_cli.output import print_json, print_table
from shardledger_cli.parsing import add_format_option, json_help, output_format

__all__ = ["register", "run_compare"]

EXAMPLES: Final = """
Examples:
  shardledger compare night-01 night-01-ref
  shardledger compare night-01 night-01-ref --tolerance logits=max_abs:1e-5 --json
  shardledger compare night-01 night-01-ref --tolerance emb=allclose:rtol=1e-4,atol=1e-6 \\
      --root /data/night-01 --ref-root /ref/night-01-ref --threshold 0.01

exit codes: 0 the estimated silent error rate is at most --threshold; 1 it is above
(or nothing could be compared); 2 usage (a bad --tolerance); 3 server unreachable;
4 refused (e.g. an unknown run); 5 a file a tolerance needs cannot be read"""


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """Adds the compare command."""
    p = sub.add_parser(
        "compare",
        parents=[common],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="compare a run with its reference sample; estimate the silent error rate",
        description=(__doc__ or "").split("\n", 1)[1] + EXAMPLES,
    )
    p.add_argument("run", help="the run that was sampled")
    p.add_argument("reference", help="the reference run (`shardledger sample ... --as`)")
    p.add_argument(
        "--tolerance", action="append", default=[], metavar="NAME=SPEC", help="repeatable"
    )
    p.add_argument("--threshold", type=float, default=0.005, help="default 0.005 (0.5 %%)")
    p.add_argument("--confidence", type=float, default=0.95, help="interval level (default 0.95)")
    p.add_argument("--root", default="", help="where RUN's files are (default: as recorded)")
    p.add_argument("--ref-root", default="", help="where the reference's files are")
    json_help(
        p, single="the comparison: agreement rate, each disagreement, the silent error estimate"
    )
    add_format_option(p)
    serve_db_option(p, run_compare)


def _views(client: Any, run: str, namespace: str) -> dict[str, dict[str, Any]]:
    return {
        v["shard_id"]: v
        for v in (json.loads(x.view_json) for x in client.shards(run, namespace=namespace))
    }


def run_compare(args: argparse.Namespace) -> int:
    """Compares every output of the shards verified in both runs; exits 1 above the threshold."""
    try:
        tolerances = dict(parse_tolerance(t) for t in args.tolerance)
    except ValueError as exc:
        raise CommandError(f"bad --tolerance: {exc}", EXIT_USAGE) from None
    if not 0 < args.confidence < 1 or not 0 <= args.threshold <= 1:
        raise CommandError("--confidence must lie in (0, 1) and --threshold in [0, 1]", EXIT_USAGE)
    client = client_from(args)
    client.summary(args.reference, namespace=args.namespace)  # an unknown run is refused here
    first = next(iter(client.list_events(args.reference, namespace=args.namespace, page_size=1)))
    sample_of = dict(first.planned.labels).get("sample_of")
    runs, refs = (
        _views(client, args.run, args.namespace),
        _views(client, args.reference, args.namespace),
    )
    try:
        figures = compare_outputs(
            runs,
            refs,
            tolerances=tolerances,
            threshold=args.threshold,
            confidence=args.confidence,
            root=args.root,
            ref_root=args.ref_root,
        )
    except UnreadableNumbers as exc:
        raise CommandError(str(exc)) from None
    report = {
        "run_id": args.run,
        "reference_run_id": args.reference,
        "sample_of": sample_of,
        **figures,
    }
    fmt = output_format(args)
    if fmt == "json":
        print_json(report)
    elif fmt == "plain":
        _print_plain(report)
    else:
        _print(report)
    return EXIT_PROBLEMS if report["above_threshold"] else EXIT_OK


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f} %"


def _print(r: dict[str, Any]) -> None:
    print(f"compare {r['run_id']} with reference {r['reference_run_id']}")
    print(
        f"  compared      {r['compared_outputs']} outputs in the same fingerprint group,"
        f" agreement {_pct(r['agreement_rate'])}; {r['structure_only']} across groups"
        " (structure only)"
    )
    skipped = ", ".join(f"{k.replace('_', ' ')} {n}" for k, n in r["not_compared"].items() if n)
    if skipped:
        print(f"  not compared  {skipped}")
    for d in r["disagreements"][:20]:
        numbers = ", ".join(f"{k} {d[k]:.3g}" for k in ("max_abs", "max_rel") if k in d)
        print(
            f"  DISAGREES     {d['shard_id']} {d['output']}: {d['blake3'][:12]} vs"
            f" {d['reference_blake3'][:12]}" + (f" ({numbers})" if numbers else "")
        )
    i = r["interval"]
    print(
        f"  silent errors {_pct(r['silent_error_rate'])} estimated"
        f" ({100 * i['confidence']:.0f} % Wilson interval {_pct(i['low'])} to {_pct(i['high'])});"
        f" threshold {_pct(r['threshold'])}: {'ABOVE' if r['above_threshold'] else 'ok'}"
    )


def _print_plain(r: dict[str, Any]) -> None:
    """Prints a "# comparison" block of FIELD/VALUE rows and a "# disagreements" block."""
    i = r["interval"]
    fields = [
        ("run", r["run_id"]),
        ("reference", r["reference_run_id"]),
        ("compared outputs", r["compared_outputs"]),
        ("agreed", r["agreed"]),
        ("agreement rate", _pct(r["agreement_rate"])),
        ("structure only", r["structure_only"]),
        *((f"not compared: {k.replace('_', ' ')}", n) for k, n in r["not_compared"].items()),
        ("silent error rate", _pct(r["silent_error_rate"])),
        (f"{100 * i['confidence']:.0f} % interval", f"{_pct(i['low'])} to {_pct(i['high'])}"),
        ("threshold", _pct(r["threshold"])),
        ("above threshold", "yes" if r["above_threshold"] else "no"),
    ]
    print_table("comparison", ("field", "value"), fields, plain=True)
    heads = ("shard", "output", "blake3", "reference blake3", "max abs", "max rel")
    rows = [
        [d["shard_id"], d["output"], d["blake3"], d["reference_blake3"]]
        + [f"{d[k]:.3g}" if k in d else "" for k in ("max_abs", "max_rel")]
        for d in r["disagreements"]
    ]
    print_table("disagreements", heads, rows, plain=True)
