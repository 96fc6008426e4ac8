"""`shardledger report`: a run's report (what failures cost, checkpoint advice), by label, as HTML."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any, Final

from shardledger_cli.cli import EXIT_OK, EXIT_USAGE, CommandError, at_least, client_from
from shardledger_cli.commands.trend import RUN_SCAN
from shardledger_cli.costs import checkpoint_advice_of, run_costs
from shardledger_cli.field_metrics import FIELD_METRICS, by_label
from shardledger_cli.output import atomic_output, equation, print_json
from shardledger_cli.parsing import json_help
from shardledger_cli.run_data import RunData, load_run

__all__ = ["print_costs", "register", "run_report", "run_report_json"]

DEFAULT_LAST: Final = 20

DESCRIPTION: Final = """\
One run's report: the ledger equation, first pass against now, what the
failures cost in GPU time (reruns, duplicates, results that failed verification,
hangs) and the checkpoint interval the run's own numbers advise (report 1, §3.2
and §4.3; definitions in docs/metrics.md).

--by LABEL compares groups instead, over the RUNs given (default: the --last N
most recently updated runs): report 1's table (§2.2) with one column per value
of the label (provider, pool, region, image, or any label a run or attempt
carries): shard missing rate, silent empty-output share, truncations,
preemptions / reclaims, hangs needing intervention, fingerprint drift and the
first-pass reconciliation rate.

--html FILE writes one self-contained page (inline SVG, no script, nothing
fetched at view time) for RUN, with a trend over the --last N runs.

Examples:
  shardledger report night-01                      # equation, costs, checkpoint advice
  shardledger report night-01 --json               # the same as one JSON object
  shardledger report --by provider --last 30       # report 1's platform table
  shardledger report night-01 night-02 --by pool --json   # one JSON line per pool
  shardledger report night-01 --html night-01.html # a page to send round

exit codes: 0 the report was produced; 2 usage (no RUN, or several without
--by); 3 server unreachable; 4 refused (e.g. unknown run); 5 the --html file
cannot be written"""


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """Adds the report command."""
    p = sub.add_parser(
        "report",
        parents=[common],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="a run's report (costs, checkpoint advice), report 1's table by label, HTML",
        description=DESCRIPTION,
    )
    p.add_argument("runs", nargs="*", metavar="RUN", help="run ids")
    p.add_argument("--by", metavar="LABEL", help="compare groups of this label's values")
    p.add_argument(
        "--last",
        type=at_least(1),
        default=DEFAULT_LAST,
        metavar="N",
        help=f"runs for --by without RUNs, and the HTML trend (default {DEFAULT_LAST})",
    )
    p.add_argument("--html", metavar="FILE", help="write a self-contained HTML report of RUN")
    json_help(p, single="the report (a run's figures, or the --by table)")
    p.set_defaults(func=run_report)


def _recent(client: Any, namespace: str, last: int) -> list[str]:
    """Returns the last runs by creation, newest first (as `trend` picks them)."""
    runs = client.list_runs(namespace=namespace, page_size=RUN_SCAN)
    created = sorted(runs, key=lambda r: (r.create_time.seconds, r.create_time.nanos, r.run_id))
    return [r.run_id for r in reversed(created[-last:])]


def run_report(args: argparse.Namespace) -> int:
    """Prints the run report, the by-label table, or writes the HTML page."""
    client = client_from(args)
    if args.by:
        if args.html:
            raise CommandError("--html reports one run; leave out --by", EXIT_USAGE)
        names = args.runs or _recent(client, args.namespace, args.last)
        runs = [load_run(client, r, namespace=args.namespace) for r in names]
        return _print_by(runs, args.by, as_json=args.json)
    if len(args.runs) != 1:
        raise CommandError("name one RUN (or compare several with --by LABEL)", EXIT_USAGE)
    data = load_run(client, args.runs[0], namespace=args.namespace)
    if args.html:
        from shardledger_cli.html_report import render_html

        recent = [r for r in _recent(client, args.namespace, args.last) if r != data.run_id]
        history = [load_run(client, r, namespace=args.namespace) for r in reversed(recent)]
        page = render_html(data, history=history)
        with atomic_output(args.html) as out:
            out.write(page)
        print(f"wrote {args.html} ({len(page)} bytes, no external resources)")
        return EXIT_OK
    report = run_report_json(data)
    if args.json:
        print_json(report)
    else:
        _print_run(report)
    return EXIT_OK


def run_report_json(data: RunData) -> dict[str, Any]:
    """Returns the one-run report as the JSON object `report RUN --json` prints."""
    s = data.summary
    return {
        "run_id": data.run_id,
        "namespace": s["namespace"],
        "labels": data.tables.labels,
        "summary": s,
        "costs": run_costs(data),
        "checkpoint_advice": checkpoint_advice_of(data).as_json(),
    }


def _pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.3f} GPU-h" if seconds >= 36 else f"{seconds:.1f} GPU-s"


def _print_run(r: dict[str, Any]) -> None:
    s, c, a = r["summary"], r["costs"], r["checkpoint_advice"]
    labels = ", ".join(f"{k}={v}" for k, v in r["labels"].items()) or "none"
    print(f"run {r['run_id']} (namespace {r['namespace']}; labels {labels})")
    print(equation(s))
    fp = s.get("first_pass") or {}
    print(
        f"completion         first pass {_pct(fp.get('completion_rate', 0.0))}"
        f"  now {_pct(s['completion_rate'])}"
    )
    print(
        f"silent errors      first pass {_pct(fp.get('silent_error_rate', 0.0))}"
        f"  now {_pct(s['silent_error_rate'])}"
    )
    print(
        f"reconciliation     {_pct(fp.get('reconciliation_rate', 0.0))} verified on the first"
        " attempt"
    )
    print_costs(c, a)


def print_costs(c: dict[str, Any], a: dict[str, Any]) -> None:
    """Prints what the failures cost and the checkpoint advice (report and status --costs)."""
    print("what failures cost (report 1, §4.3)")
    print(f"  GPU time         {_hours(c['gpu_s'])}, of which counted {_hours(c['counted_gpu_s'])}")
    lost = c["lost_gpu_s"]
    print(
        f"  recomputed       {_hours(c['recomputed_gpu_s'])}: reruns {_hours(lost['reruns'])},"
        f" duplicates {_hours(lost['duplicates'])}, failed verification"
        f" {_hours(lost['silent'])}, hung {_hours(lost['hung'])}"
    )
    print(
        f"  hangs            {c['hangs']}, {c['hang_lost_s']:.1f} s lost before they were stopped"
    )
    print(f"  did not count    {_pct(c['not_counted_share'])} of the run's GPU time")
    print("checkpoint interval (report 1, §3.2: minimise p·t/2 + (T/t)·w)")
    T, w, p = a["shard_duration_s"], a["checkpoint_write_s"], a["reclaim_probability"]
    print(
        f"  inputs           T {_num(T, 's')}, w {_num(w, 's')}, p {_num(p, '')}"
        f" over {a['attempts']} attempts"
    )
    if a["interval_s"] is None:
        print(f"  advice           none: {a['reason']}")
    else:
        steps = f" (about {a['interval_steps']} steps)" if a["interval_steps"] else ""
        print(
            f"  advice           checkpoint every {a['interval_s']:.3g} s{steps};"
            f" expected waste {a['expected_waste_s']:.2f} s per shard ({a['reason']})"
        )


def _num(x: float | None, unit: str) -> str:
    return "unknown" if x is None else f"{x:.4g}{' ' + unit if unit else ''}".rstrip()


def _print_by(runs: Sequence[RunData], label: str, *, as_json: bool) -> int:
    groups = [g.as_json(label) for g in by_label(runs, label)]
    if as_json:
        for g in groups:
            print(json.dumps(g, sort_keys=True))
        return EXIT_OK
    from rich.console import Console
    from rich.table import Column, Table

    table = Table(
        f"by {label}",
        *(Column(g["value"], justify="right") for g in groups),
        title=f"{len(runs)} runs (report 1, §2.2; docs/metrics.md)",
    )
    table.add_row("runs", *(str(len(g["runs"])) for g in groups))
    table.add_row("shards", *(str(g["shards"]) for g in groups))
    for key, name in FIELD_METRICS:
        cells = [_pct(g[key]) if key.endswith(("rate", "share")) else str(g[key]) for g in groups]
        table.add_row(name, *cells)
    Console(markup=False, highlight=False).print(table)
    return EXIT_OK
