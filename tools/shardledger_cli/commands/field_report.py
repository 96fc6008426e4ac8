"""`shardledger report`: a run's report (what failures cost, checkpoint advice), by label, as HTML."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any, Final

from shardledger_cli.cli import (
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_USAGE,
    CommandError,
    at_least,
    client_from,
)
from shardledger_cli.commands.trend import RUN_SCAN
from shardledger_cli.figures import compare_runs
from shardledger_cli.figures import run_report as fetch_report
from shardledger_cli.local_ledger import serve_db_option
from shardledger_cli.output import atomic_output, equation, print_json, print_table
from shardledger_cli.parsing import add_format_option, json_help, output_format

__all__ = ["print_costs", "register", "run_report", "run_report_json"]

DEFAULT_LAST: Final = 20
# (key, label as the platform table names it), in its row order; then the rest we add.
FIELD_METRICS: Final = (
    ("missing_rate", "shard missing rate"),
    ("silent_empty_share", "silent empty-output share"),
    ("truncations", "output truncations"),
    ("reclaims", "preemptions / reclaims"),
    ("hangs", "hangs needing intervention"),
    ("fingerprint_drift", "fingerprint drift"),
    ("first_pass_reconciliation_rate", "first-pass reconciliation rate"),
    ("first_pass_completion_rate", "first-pass completion rate"),
    ("silent_error_rate", "first-pass silent error rate"),
)

DESCRIPTION: Final = """\
One run's report: the ledger equation, first pass against now, what the
failures cost in GPU time (reruns, duplicates, results that failed verification,
hangs) and the checkpoint interval the run's own numbers advise (definitions
in docs/metrics.md).

--by LABEL compares groups instead, over the RUNs given (default: the --last N
most recently updated runs): the platform table with one column per value
of the label (provider, pool, region, image, or any label a run or attempt
carries): shard missing rate, silent empty-output share, truncations,
preemptions / reclaims, hangs needing intervention, fingerprint drift and the
first-pass reconciliation rate.

--html FILE writes one self-contained page (inline SVG, no script, nothing
fetched at view time) for RUN, with a trend over the --last N runs.

Examples:
  shardledger report night-01                      # equation, costs, checkpoint advice
  shardledger report night-01 --json               # the same as one JSON object
  shardledger report --by provider --last 30       # the platform table
  shardledger report night-01 night-02 --by pool --json   # one JSON line per pool
  shardledger report night-01 --html night-01.html # a page to send round
  shardledger report --by provider --db copy/ledger.db   # a ledger file, no server

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
        help="a run's report (costs, checkpoint advice), the platform table by label, HTML",
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
    json_help(p, single="the report (a run's figures); with --by, one JSON line per group")
    add_format_option(p)
    serve_db_option(p, run_report)


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
        if not names:
            raise CommandError(
                f"no runs in namespace {args.namespace or 'default'!r} to compare", EXIT_PROBLEMS
            )
        groups = compare_runs(client, list(names), args.by, namespace=args.namespace)
        return _print_by(groups, len(names), args.by, fmt=output_format(args))
    if len(args.runs) != 1:
        raise CommandError("name one RUN (or compare several with --by LABEL)", EXIT_USAGE)
    report = run_report_json(client, args.runs[0], namespace=args.namespace)
    if args.html:
        from shardledger_cli.html_report import render_html

        run_id = report["run_id"]
        views = [json.loads(v.view_json) for v in client.shards(run_id, namespace=args.namespace)]
        recent = [r for r in _recent(client, args.namespace, args.last) if r != run_id]
        history = [
            json.loads(client.summary(r, namespace=args.namespace)) for r in reversed(recent)
        ]
        page = render_html(report, views, history=history)
        with atomic_output(args.html) as out:
            out.write(page)
        size = len(page.encode("utf-8"))  # bytes on disk: len(page) counts characters
        print(f"wrote {args.html} ({size} bytes, no external resources)")
        return EXIT_OK
    fmt = output_format(args)
    if fmt == "json":
        print_json(report)
    else:
        _print_run(report, plain=fmt == "plain")
    return EXIT_OK


def run_report_json(client: Any, run_id: str, *, namespace: str = "") -> dict[str, Any]:
    """Returns the one-run report as the JSON object `report RUN --json` prints."""
    return fetch_report(client, run_id, namespace=namespace)


def _pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.3f} GPU-h" if seconds >= 36 else f"{seconds:.1f} GPU-s"


def _print_run(r: dict[str, Any], *, plain: bool) -> None:
    s, c, a = r["summary"], r["costs"], r["checkpoint_advice"]
    labels = ", ".join(f"{k}={v}" for k, v in r["labels"].items()) or "none"
    fp = s.get("first_pass") or {}
    rows = [
        (
            "completion",
            f"first pass {_pct(fp.get('completion_rate', 0.0))}  now {_pct(s['completion_rate'])}",
        ),
        (
            "silent errors",
            f"first pass {_pct(fp.get('silent_error_rate', 0.0))}"
            f"  now {_pct(s['silent_error_rate'])}",
        ),
        (
            "reconciliation",
            f"{_pct(fp.get('reconciliation_rate', 0.0))} verified on the first attempt",
        ),
    ]
    if plain:
        head = [("run", r["run_id"]), ("namespace", r["namespace"]), ("labels", labels)]
        print_table(
            "report", ("field", "value"), [*head, ("equation", equation(s)), *rows], plain=True
        )
    else:
        print(f"run {r['run_id']} (namespace {r['namespace']}; labels {labels})")
        print(equation(s))
        print("".join(f"{k:<19}{v}\n" for k, v in rows), end="")
    print_costs(c, a, plain=plain)


def print_costs(c: dict[str, Any], a: dict[str, Any], *, plain: bool = False) -> None:
    """Prints what the failures cost and the checkpoint advice (report and status --costs).

    Plain: a "# costs" and a "# checkpoint interval" block of FIELD/VALUE rows.
    """
    costs, advice = _cost_rows(c), _advice_rows(a)
    if plain:
        print_table("costs", ("field", "value"), costs, plain=True)
        print_table("checkpoint interval", ("field", "value"), advice, plain=True)
        return
    print("what failures cost (GPU time; docs/metrics.md)")
    print("".join(f"  {k:<17}{v}\n" for k, v in costs), end="")
    print("checkpoint interval (minimises p·t/2 + (T/t)·w; docs/metrics.md)")
    print("".join(f"  {k:<17}{v}\n" for k, v in advice), end="")


def _cost_rows(c: dict[str, Any]) -> list[tuple[str, str]]:
    lost = c["lost_gpu_s"]
    rows = [
        (
            "GPU time",
            f"{_hours(c['gpu_s'])}: counted {_hours(c['counted_gpu_s'])},"
            f" still running {_hours(c['running_gpu_s'])}",
        ),
        (
            "did not count",
            f"{_hours(c['not_counted_gpu_s'])}: reruns after a failure"
            f" {_hours(lost['reruns'])}, failed verification {_hours(lost['silent'])},"
            f" duplicates {_hours(lost['duplicates'])}, zombies {_hours(lost['zombies'])},"
            f" hung {_hours(lost['hung'])}",
        ),
        (
            "hangs",
            f"{c['hangs']}, {c['hang_lost_s']:.1f} s of work lost since their last checkpoint",
        ),
        ("share", f"{_pct(c['not_counted_share'])} of the run's GPU time did not count"),
    ]
    if c["gpus_unknown_attempts"]:
        rows.append(
            (
                "note",
                f"{c['gpus_unknown_attempts']} attempts did not say how many GPUs"
                " they held: counted as one each",
            )
        )
    return rows


def _advice_rows(a: dict[str, Any]) -> list[tuple[str, str]]:
    T, w, p = a["shard_duration_s"], a["checkpoint_write_s"], a["reclaim_probability"]
    inputs = f"T {_num(T, 's')}, w {_num(w, 's')}, p {_num(p, '')} over {a['attempts']} attempts"
    if a["interval_s"] is None:
        return [("inputs", inputs), ("advice", f"none: {a['reason']}")]
    steps = f" (about {a['interval_steps']} steps)" if a["interval_steps"] else ""
    return [
        ("inputs", inputs),
        (
            "advice",
            f"checkpoint every {a['interval_s']:.3g} s{steps};"
            f" expected waste {a['expected_waste_s']:.2f} s per shard ({a['reason']})",
        ),
    ]


def _num(x: float | None, unit: str) -> str:
    return "unknown" if x is None else f"{x:.4g}{' ' + unit if unit else ''}".rstrip()


def _print_by(groups: Sequence[dict[str, Any]], runs: int, label: str, *, fmt: str) -> int:
    if fmt == "json":
        for g in groups:
            print(json.dumps(g, sort_keys=True))
        return EXIT_OK
    rows = [
        ["runs", *(str(len(g["runs"])) for g in groups)],
        ["shards", *(str(g["shards"]) for g in groups)],
    ]
    for key, name in FIELD_METRICS:
        cells = [_pct(g[key]) if key.endswith(("rate", "share")) else str(g[key]) for g in groups]
        rows.append([name, *cells])
    rows.append(["GPU time", *(_hours(g["gpu_s"]) for g in groups)])
    rows.append(["GPU time not counted", *(_hours(g["lost_gpu_s"]) for g in groups)])
    heads = [f"by {label}", *(g["value"] for g in groups)]
    if fmt == "plain":
        print_table(None, heads, rows, plain=True, upper=False)  # headers are label values
        return EXIT_OK
    from rich.console import Console
    from rich.table import Column, Table

    table = Table(
        heads[0],
        *(Column(h, justify="right") for h in heads[1:]),
        title=f"{runs} runs (docs/metrics.md defines each row)",
    )
    for row in rows:
        table.add_row(*row)
    Console(markup=False, highlight=False).print(table)
    return EXIT_OK
