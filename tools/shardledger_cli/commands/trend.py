"""`shardledger trend`: completion, silent errors and failure tags over runs, and ruler drift.

A ruler run re-runs a fixed sample of shards (same ids, same inputs) so that
drift shows up between nights. Two ruler runs are compared artifact by
artifact: a digest that changed while the environment fingerprint stayed the
same is drift (non-determinism, a silent library change); a digest that
changed together with the fingerprint is expected, because numbers are only
comparable inside one fingerprint group.
"""

from __future__ import annotations

import argparse
import json
import sys
from itertools import pairwise
from typing import TYPE_CHECKING, Any, Final

from ledger_server.drift import (
    ShardArtifacts,
    compare_rulers,
    consistency_pairs,
    outputs_digest,
    shard_artifacts,
)
from shardledger_cli.cli import EXIT_OK, EXIT_PROBLEMS, at_least, client_from
from shardledger_cli.local_ledger import serve_db_option
from shardledger_cli.output import print_json, print_note, print_table
from shardledger_cli.parsing import add_format_option, examples, json_help, output_format

if TYPE_CHECKING:
    from google.protobuf.timestamp_pb2 import Timestamp

    from shard_client.api.shardledger.v1.ledger_pb2 import RunInfo
    from shard_client.client import LedgerClient

DEFAULT_LAST: Final = 20
DEFAULT_RULER_PREFIX: Final = "ruler-"
# ListRuns answers at most this many runs (the server's page cap): the history rulers are
# paired from. A ruler run older than that has no predecessor to compare with.
RUN_SCAN: Final = 5000
SHOWN_CHANGES: Final = 20


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """Adds the trend command."""
    p = sub.add_parser(
        "trend",
        epilog=examples(
            "shardledger trend", "shardledger trend --last 30 --ruler-prefix ruler- --json"
        ),
        parents=[common],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="completion, silent errors and failure tags over recent runs; ruler drift",
        description="For the most recent runs (oldest first): lifecycle (open, closed,\n"
        "settled, reopened: only a settled run's figures are final), completion rate (verified /\n"
        "submitted), silent error rate, failure tags and fingerprint groups.\n\n"
        "Ruler runs (run id starting with --ruler-prefix) re-run a fixed sample set.\n"
        "Each is compared with the ruler run created before it, output by output:\n"
        "  drift         the digest changed inside the same fingerprint group\n"
        "  across groups the digest changed with the fingerprint (expected)\n"
        "  unattributed  the digest changed and a fingerprint is unknown\n"
        "Shards present in only one of the two are listed as an ID-set difference.\n\n"
        "Consistency: each run against the latest earlier run that\n"
        "shares shards with it: of the outputs of verified shards in the same\n"
        "fingerprint group on both sides, the share with the same digest. Each ruler\n"
        "run also gets one digest over all its outputs (a ruler run: a changed\n"
        "ruler digest is drift, look now).\n\n"
        "Columns of the runs table (--columns A,B,...; a terminal shows "
        f"{','.join(DEFAULT_COLUMNS)},\nplain output every column):\n"
        f"{columns_help()}\n\n"
        "Examples:\n"
        "  shardledger trend                       # the last 20 runs, rulers compared\n"
        "  shardledger trend --last 60 --json | jq '.consistency[] | .consistency_rate'\n"
        "  shardledger trend --ruler-prefix nightly-ruler-\n"
        "  shardledger trend --columns run,created,completion,first-pass,groups\n"
        "  shardledger trend --format plain | cut -f1,7   # run, completion\n"
        "  shardledger trend --db copy/ledger.db          # a ledger file, no server\n\n"
        "exit codes: 0 no drift; 1 drift found; 3 server unreachable; 4 refused",
    )
    p.add_argument(
        "--last",
        type=at_least(1),
        default=DEFAULT_LAST,
        help=f"runs to show (default {DEFAULT_LAST})",
    )
    p.add_argument(
        "--ruler-prefix",
        default=DEFAULT_RULER_PREFIX,
        metavar="P",
        help=f"run ids of ruler runs start with this (default {DEFAULT_RULER_PREFIX!r})",
    )
    p.add_argument(
        "--columns",
        type=parse_columns,
        default=(),
        metavar="A,B,...",
        help="the runs table's columns, in this order (`--columns help` lists them; default on"
        f" a terminal: {','.join(DEFAULT_COLUMNS)}; plain: every column)",
    )
    json_help(p, single="the trend report")
    add_format_option(p)
    serve_db_option(p, run_trend)


def run_trend(args: argparse.Namespace) -> int:
    """Prints the trend report; exits 1 when a ruler run drifted."""
    if args.columns == ("help",):
        print(columns_help())
        return EXIT_OK
    client = client_from(args)
    try:
        report = build_report(
            client, namespace=args.namespace, last=args.last, ruler_prefix=args.ruler_prefix
        )
    finally:
        client.close()
    fmt = output_format(args)
    if fmt == "json":
        print_json(report)
    else:
        print_report(report, plain=fmt == "plain", columns=args.columns)
    return EXIT_PROBLEMS if report["drift_found"] else EXIT_OK


def build_report(
    client: LedgerClient, *, namespace: str, last: int, ruler_prefix: str
) -> dict[str, Any]:
    """Returns the trend of the last runs and the comparison of each ruler run with its previous."""
    listed = client.list_runs(namespace=namespace, page_size=RUN_SCAN)  # newest update first
    # The last runs by creation: a verify --recheck of an old night must not push a new one out.
    recent = sorted(listed, key=_created_us)[-last:] if last > 0 else []
    rows = [_run_row(info, client, ruler_prefix) for info in recent]
    rulers = sorted(
        (r for r in listed if ruler_prefix and r.run_id.startswith(ruler_prefix)), key=_created_us
    )
    shown = {r.run_id for r in recent}
    cache: dict[str, dict[str, ShardArtifacts]] = {}
    comparisons = [
        {
            "run_id": current.run_id,
            "previous_run_id": previous.run_id,
            **compare_rulers(
                _artifacts(client, previous, cache), _artifacts(client, current, cache)
            ),
        }
        for previous, current in pairwise(rulers)
        if current.run_id in shown
    ]
    arts = {r.run_id: _artifacts(client, r, cache) for r in recent}
    consistency = consistency_pairs([r.run_id for r in recent], arts)
    ruler_digests = [
        {"run_id": r.run_id, **outputs_digest(_artifacts(client, r, cache))} for r in rulers
    ]
    return {
        "namespace": namespace or "default",
        "runs": rows,
        "ruler_prefix": ruler_prefix,
        "ruler_comparisons": comparisons,
        "drift_found": any(c["drift"] for c in comparisons),
        "consistency": consistency,
        "ruler_digests": ruler_digests,
    }


def _us(timestamp: Timestamp) -> int:
    return int(timestamp.seconds) * 1_000_000 + int(timestamp.nanos) // 1000


def _created_us(info: RunInfo) -> tuple[int, str]:
    return _us(info.create_time), info.run_id


def _run_row(info: RunInfo, client: LedgerClient, ruler_prefix: str) -> dict[str, Any]:
    s = json.loads(client.summary(info.run_id, namespace=info.namespace))
    return {
        "run_id": info.run_id,
        "created": info.create_time.ToJsonString(),
        "ruler": bool(ruler_prefix) and info.run_id.startswith(ruler_prefix),
        "submitted": s["submitted"],
        "verified": s["verified"],
        "completion_rate": s["completion_rate"],
        "silent_errors": s["silent_errors"],
        "silent_error_rate": s["silent_error_rate"],
        "failure_tags": s["failure_tags"],
        "attempt_failure_tags": s["attempt_failure_tags"],
        "verify_failures": s["verify_failures"],
        "fingerprint_groups": s["fingerprint_groups"],
        # History no rerun rewrites: the night as it was launched.
        "first_pass": s["first_pass"],
        "repairs": s["repairs"],
        "recomputed_rate": s["recomputed_rate"],
        "numeric": s["numeric"],
        # open, submission_closed or settled: a run's figures are final only once settled.
        "lifecycle": (s.get("lifecycle") or {}).get("state", "unknown"),
        "settled_at": (s.get("lifecycle") or {}).get("settled_at"),
        # A run reopened to add shards (plan --reopen): its latest reopen, or None.
        "reopened_at_sequence": (s.get("lifecycle") or {}).get("reopened_at_sequence"),
    }


def _lifecycle_cell(row: dict[str, Any]) -> str:
    """Returns the table's lifecycle cell: "closed" for submission_closed, "reopened" if open again."""
    state = str(row["lifecycle"])
    if state == "open" and row.get("reopened_at_sequence"):
        return "reopened"
    return state.replace("submission_closed", "closed")


def _artifacts(
    client: LedgerClient, info: RunInfo, cache: dict[str, dict[str, ShardArtifacts]]
) -> dict[str, ShardArtifacts]:
    if info.run_id not in cache:
        views = (
            json.loads(v.view_json) for v in client.shards(info.run_id, namespace=info.namespace)
        )
        cache[info.run_id] = shard_artifacts(views)
    return cache[info.run_id]


# --- text output ------------------------------------------------------------


def _percent(rate: float) -> str:
    return f"{rate * 100:.2f}%"


def _counts(values: dict[str, int], *, short: bool = False) -> str:
    items = sorted(values.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{k[:8] if short else k} {v}" for k, v in items) or "-"


def _run_cell(r: dict[str, Any], plain: bool) -> str:
    return str(r["run_id"]) if plain else r["run_id"] + (" (ruler)" if r["ruler"] else "")


def _silent_cell(r: dict[str, Any]) -> str:
    return f"{r['silent_errors']} ({_percent(r['silent_error_rate'])})"


def _first_silent_cell(r: dict[str, Any]) -> str:
    fp = r["first_pass"]
    return f"{fp['silent_errors']} ({_percent(fp['silent_error_rate'])})"


def _tags_cell(r: dict[str, Any]) -> str:
    return _counts({**r["failure_tags"], **_prefixed("verify:", r["verify_failures"])})


# --columns NAME: (header, what it shows, its cell); the runs table's columns in this order.
RUN_COLUMNS: Final[dict[str, tuple[str, str, Any]]] = {
    "run": ("run", "run id; on a terminal '(ruler)' marks a ruler run", _run_cell),
    "ruler": ("ruler", "yes for a ruler run", lambda r, p: "yes" if r["ruler"] else "no"),
    "created": ("created", "creation time", lambda r, p: r["created"]),
    "lifecycle": ("lifecycle", "open, closed, settled, reopened", lambda r, p: _lifecycle_cell(r)),
    "submitted": ("submitted", "planned shards", lambda r, p: str(r["submitted"])),
    "verified": ("verified", "verified shards", lambda r, p: str(r["verified"])),
    "completion": (
        "completion",
        "verified / submitted",
        lambda r, p: _percent(r["completion_rate"]),
    ),
    "first-pass": (
        "first pass",
        "completion of the first pass",
        lambda r, p: _percent(r["first_pass"]["completion_rate"]),
    ),
    "silent": ("silent errors", "silent errors (their rate)", lambda r, p: _silent_cell(r)),
    "first-pass-silent": (
        "first-pass silent",
        "silent errors of the first pass",
        lambda r, p: _first_silent_cell(r),
    ),
    "reconciled": (
        "reconciled first",
        "verified on the first attempt / submitted",
        lambda r, p: _percent(r["first_pass"]["reconciliation_rate"]),
    ),
    "tags": (
        "failure tags",
        "shards by failure tag and verify: reason",
        lambda r, p: _tags_cell(r),
    ),
    "groups": (
        "fingerprint groups",
        "fingerprint groups (8 hex digits each)",
        lambda r, p: _counts(r["fingerprint_groups"], short=True),
    ),
}
# What fits 80 columns on a terminal; plain output has every column unless --columns.
DEFAULT_COLUMNS: Final = ("run", "lifecycle", "completion", "silent", "tags")


def columns_help() -> str:
    """Returns the --columns list for the help text and `--columns help`."""
    width = max(map(len, RUN_COLUMNS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what, _cell) in RUN_COLUMNS.items()]
    return "\n".join(lines)


def parse_columns(text: str) -> tuple[str, ...]:
    """Returns the --columns names, in the order given; "help" is left to the command."""
    if text == "help":
        return ("help",)
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in RUN_COLUMNS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown column {unknown[0]!r}" if unknown else "no column named"
        ) from None
    return names


def _rich_table(console: Any, title: str, headers: list[str], rows: list[list[str]]) -> None:
    """Prints a rich table whose headers are never cut: cells fold, the page widens if need be."""
    from rich.table import Column, Table

    def numeric(i: int) -> bool:
        return bool(rows) and all(r[i].rstrip("%").replace(".", "").isdigit() for r in rows)

    columns = [
        Column(h, justify="right" if numeric(i) else "left", overflow="fold", min_width=len(h))
        for i, h in enumerate(headers)
    ]
    table = Table(*columns, title=title, title_justify="left")
    for row in rows:
        table.add_row(*row)
    need = sum(len(h) + 3 for h in headers) + 1
    if need > console.width:
        console.width = need  # rows wrap on a narrow screen; a header is never "cre…"
    console.print(table)


def print_report(
    report: dict[str, Any], *, plain: bool = False, columns: tuple[str, ...] = ()
) -> None:
    """Prints the report: rich tables on stdout, or plain blocks ("# runs", ...) when plain."""
    from rich.console import Console

    # markup off: run ids and tags are data, never rich markup.
    console = Console(file=sys.stdout, markup=False, highlight=False)
    if not report["runs"]:
        print_note(f"no runs in namespace {report['namespace']}", plain=plain)
        return
    chosen = columns or (tuple(RUN_COLUMNS) if plain else DEFAULT_COLUMNS)
    headers = [RUN_COLUMNS[c][0] for c in chosen]
    rows = [[RUN_COLUMNS[c][2](r, plain) for c in chosen] for r in report["runs"]]
    if plain:
        print_table("runs", headers, rows, plain=True)
    else:
        _rich_table(console, "runs (oldest first)", headers, rows)
    _print_consistency(report, plain=plain)
    _print_rulers(console, report, plain=plain)


def _print_consistency(report: dict[str, Any], *, plain: bool) -> None:
    pairs = report.get("consistency", [])
    if plain:
        keys = ("run_id", "previous_run_id", "consistency_rate", "consistent", "compared_outputs")
        rows = [["" if c[k] is None else c[k] for k in keys] for c in pairs]
        heads = ("run", "previous", "consistency rate", "consistent", "compared")
        print_table("consistency", heads, rows, plain=True)
        digests = [
            (r["run_id"], r["digest"], r["outputs"]) for r in report.get("ruler_digests", [])
        ]
        print_table("ruler digests", ("run", "digest", "outputs"), digests, plain=True)
        return
    for c in pairs:
        rate = c["consistency_rate"]
        shown = "no outputs in one fingerprint group" if rate is None else _percent(rate)
        print(
            f"consistency {c['run_id']} vs {c['previous_run_id']}: {shown}"
            f" ({c['consistent']} of {c['compared_outputs']} same-group outputs kept their digest)"
        )
    for r in report.get("ruler_digests", []):
        print(f"ruler digest {r['run_id']}: {r['digest'][:16]} over {r['outputs']} outputs")


def _prefixed(prefix: str, values: dict[str, int]) -> dict[str, int]:
    return {prefix + k: v for k, v in values.items()}


def _print_rulers(console: Any, report: dict[str, Any], *, plain: bool) -> None:
    comparisons = report["ruler_comparisons"]
    if not comparisons:
        print_note(f"no ruler run to compare (prefix {report['ruler_prefix']!r})", plain=plain)
        return
    headers = ["run", "previous", "compared", "unchanged", "drift", "across groups"]
    headers += ["unattributed", "id-set difference"]
    rows = [
        [
            c["run_id"],
            c["previous_run_id"],
            str(c["compared_outputs"]),
            str(c["unchanged"]),
            str(len(c["drift"])),
            str(len(c["across_groups"])),
            str(len(c["unattributed"])),
            f"-{len(c['only_in_previous'])} +{len(c['only_in_current'])}",
        ]
        for c in comparisons
    ]
    if plain:
        print_table("rulers", headers, rows, plain=True)
    else:
        _rich_table(console, "ruler runs vs. their previous ruler run", headers, rows)
    drift = [(c["run_id"], d) for c in comparisons for d in c["drift"]]
    if not drift:
        print_note("no drift: every changed digest changed with its fingerprint group", plain=plain)
        return
    headers = ["run", "shard", "output", "fingerprint", "previous blake3", "blake3"]
    # Plain output has every change, whole; a terminal the first SHOWN_CHANGES, shortened.
    cut = (None, None, None) if plain else (12, 16, 16)
    rows = [
        [
            run_id,
            d["shard_id"],
            d["output"],
            d["fingerprint"][: cut[0]],
            d["previous_blake3"][: cut[1]],
            d["blake3"][: cut[2]],
        ]
        for run_id, d in (drift if plain else drift[:SHOWN_CHANGES])
    ]
    if plain:
        print_table("drift", headers, rows, plain=True)
        return
    _rich_table(console, "drift: digest changed inside one fingerprint group", headers, rows)
    if len(drift) > SHOWN_CHANGES:
        print(f"... and {len(drift) - SHOWN_CHANGES} more (see --json)")
