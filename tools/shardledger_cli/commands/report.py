"""`shardledger status|shards|resume|events|runs`: their help and flags; status and runs."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Final

from ledger_server.states import QUERY_STATES
from shardledger_cli.cli import EXIT_OK, EXIT_PROBLEMS, at_least, client_from
from shardledger_cli.commands.events import run_events
from shardledger_cli.commands.resume import RESUME_FORMATS, run_resume
from shardledger_cli.commands.shards import run_shards
from shardledger_cli.output import REASON_KEY, count_shards, equation, iso_us, print_json, ts_us

__all__ = ["lifecycle_line", "register", "render_summary", "run_runs", "run_status"]


HELP: Final = {
    "status": """a run's summary: submitted = verified + failed + missing + ...

Print the run summary: the reconciliation equation, the run's lifecycle (open,
submission closed, settled: see `plan --close`), completion rate
(verified / submitted), silent error rate, failure tags, duplicates and
fingerprint groups. --json prints the summary object the server computed;
its "lifecycle" object says whether the run is settled and since when.

--costs adds what the failures cost in GPU time and the checkpoint interval
the run's numbers advise (report 1, §4.3 and §3.2; docs/metrics.md), under the
keys "costs" and "checkpoint_advice"; it reads every event of the run.

Examples:
  shardledger status night-01
  shardledger status night-01 --costs
  shardledger status night-01 --json | jq .first_pass

exit codes: 0 every planned shard is verified; 1 some shard is not;
3 server unreachable; 4 refused (e.g. unknown run)""",
    "shards": f"""list a run's shards, optionally in one state

List the run's shards in plan order as columns, streamed (a million shards
print without a table in memory). --json prints one JSON array of views.
RANKS is "alive/world" for a multi-rank (torchrun) attempt: the ranks still
heartbeating; the view's "ranks" has each rank's state, host and pid.

states: {", ".join(QUERY_STATES)}
exit codes: 0 listed (even when empty); 3 unreachable; 4 refused""",
    "resume": f"""exactly the shards that must run again

Stream the resume list: every planned shard without a confirmed (committed
and verified) artifact, in plan order.

formats:
  jsonl        the original plan lines as stored, one per line (default);
               --reasons adds a "{REASON_KEY}" key to each
  ids          one shard id per line
  slurm-array  plan_index ranges like 3-5,9,12-14 for `sbatch --array=`

--json writes one JSON object per shard instead, {
        "shard_id", "plan_index", "reason", "plan_line"
    } with the plan line parsed (jsonl format only).

-o FILE replaces FILE atomically (temp file, fsync, rename); a count of
shards by reason goes to stderr. exit codes: 0 nothing to re-run; 1 shards must re-run; 3 unreachable;
4 refused; 5 the output file could not be written""",
    "events": """print a run's events, or follow them

Print one line per event: sequence, receive time, shard, attempt, kind and a
short payload. --json prints JSON lines (the protobuf JSON mapping). --follow
keeps streaming new events until Ctrl-C, which exits 0.""",
    "runs": "list runs, most recently updated first\n\nList the namespace's runs, newest first.",
}


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """Adds the status, shards, resume, events and runs commands."""
    funcs = {"status": run_status, "shards": run_shards, "resume": run_resume}
    funcs |= {"events": run_events, "runs": run_runs}
    parsers = {}
    for name, func in funcs.items():
        summary, _, description = HELP[name].partition("\n\n")
        raw = argparse.RawDescriptionHelpFormatter
        p = sub.add_parser(
            name, parents=[common], formatter_class=raw, help=summary, description=description
        )
        if name != "runs":
            p.add_argument("run", help="run id")
        p.set_defaults(func=func)
        parsers[name] = p
    parsers["status"].add_argument(
        "--costs", action="store_true", help="add GPU time lost to failures and checkpoint advice"
    )
    p = parsers["shards"]
    p.add_argument("--state", choices=QUERY_STATES, default="", help="only shards in this state")
    p.add_argument("--limit", type=at_least(0), default=0, help="at most N shards (0: all)")
    p = parsers["resume"]
    p.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    p.add_argument("--format", choices=RESUME_FORMATS, default="jsonl", help="output format")
    p.add_argument("--reasons", action="store_true", help=f"jsonl only: add {REASON_KEY!r}")
    p = parsers["events"]
    p.add_argument("--after", type=at_least(0), default=0, metavar="SEQ", help="events after SEQ")
    p.add_argument("--follow", "-f", action="store_true", help="stream new events as they commit")
    parsers["runs"].add_argument("--limit", type=at_least(1), default=100, help="at most N runs")


def run_status(args: argparse.Namespace) -> int:
    """Prints the run summary; exits 0 only when every planned shard is verified."""
    client = client_from(args)
    summary: dict[str, Any] = json.loads(client.summary(args.run, namespace=args.namespace))
    if getattr(args, "costs", False):
        from shardledger_cli.commands.field_report import print_costs, run_report_json
        from shardledger_cli.run_data import load_run

        extra = run_report_json(load_run(client, args.run, namespace=args.namespace))
        summary |= {k: extra[k] for k in ("costs", "checkpoint_advice")}
    if args.json:
        print_json(summary)
    else:
        render_summary(summary)
        if "costs" in summary:
            print_costs(summary["costs"], summary["checkpoint_advice"])
    done = summary["submitted"] > 0 and summary["verified"] == summary["submitted"]
    return EXIT_OK if done else EXIT_PROBLEMS


def render_summary(s: dict[str, Any]) -> None:
    """Prints the summary as rich tables on stdout."""
    from rich.console import Console
    from rich.table import Column, Table

    # markup off: shard ids, tags and reasons are data, never rich markup.
    console = Console(file=sys.stdout, markup=False, highlight=False, soft_wrap=True)
    console.print(
        f"run {s['run_id']} (namespace {s['namespace']}) as of {iso_us(s.get('as_of_us'))}, "
        f"{s.get('event_count', 0)} events, head {str(s.get('head_hash', ''))[:16]}",
        style="bold",
    )
    console.print(equation(s))
    console.print(lifecycle_line(s))
    sub = s["submitted"] or 1
    right = ("shards", "share")
    states = Table("state", *(Column(c, justify="right") for c in right), title="shards")
    for key, label in (
        ("verified", "verified"),
        ("failed", "failed (incl. verify failed)"),
        ("verify_failed", "  of which verify failed"),
        ("missing", "missing (never started)"),
        ("running", "running"),
        ("stale", "stale (silent past timeout)"),
        ("unverified", "committed, not verified"),
    ):
        states.add_row(label, str(s[key]), f"{100 * s[key] / sub:.1f} %")
    console.print(states)
    console.print(f"completion rate    {100 * s['completion_rate']:.2f} %  (verified / submitted)")
    console.print(
        f"silent error rate  {100 * s['silent_error_rate']:.2f} %  "
        f"({s['silent_errors']} reported success but failed verification or were incomplete)"
    )
    dups = ", ".join(f"{k} {n}" for k, n in sorted(s["duplicates"].items()))
    console.print(f"duplicates         {s['duplicate_shards']} shards: {dups}")
    console.print(
        f"repairs            {count_shards(s.get('repairs', 0))}  "
        "(a rerun replaced a failed, corrupted or missing result)"
    )
    console.print(f"attempts           {s['attempts']}")
    _first_pass(console, s)
    if s.get("numeric"):
        console.print(
            f"numeric pollution  {count_shards(s['numeric'])} reported NaN/Inf metrics"
            f" (shardledger shards {s['run_id']} --json shows the first step)"
        )
    if s.get("late_attempts"):
        console.print(
            f"late events        {s['late_attempts']} attempts' events arrived late from a"
            " spool: the figures above were wrong until they did"
        )
    for title, key, head in (
        ("failure tags (latest attempt of failed shards)", "failure_tags", "tag"),
        ("failure tags (every failed attempt)", "attempt_failure_tags", "tag"),
        ("verification failures", "verify_failures", "reason"),
        ("fingerprint groups (latest attempt)", "fingerprint_groups", "fingerprint"),
    ):
        _counts_table(console, title, head, s.get(key) or {})


def lifecycle_line(s: dict[str, Any]) -> str:
    """Returns one line saying whether the run is over, and if not what it waits on."""
    life = s.get("lifecycle")
    if not life:
        return "lifecycle          unknown (the server predates run lifecycles)"
    if life["settled"]:
        return f"lifecycle          settled at {life['settled_at']}: nothing more will run"
    if life.get("submission_closes_at"):
        return f"lifecycle          open until {life['submission_closes_at']} (--submitted-until)"
    if not life["submission_closed"]:
        return (
            "lifecycle          open: jobs may still start"
            f" (`shardledger plan {s['run_id']} --close` once none will)"
        )
    words = {"unverified": "committed, not verified", "unplanned": "announced, not planned"}
    waiting = ", ".join(
        f"{count_shards(n)} {words.get(what, what)}" for what, n in life["waiting_on"].items() if n
    )
    return f"lifecycle          submission closed, waiting on {waiting}"


def _first_pass(console: Any, s: dict[str, Any]) -> None:
    """Prints the first-pass figures beside the current ones (history no rerun rewrites)."""
    fp = s.get("first_pass")
    if not fp:
        return
    when = (
        f"closed at sequence {fp['closed_at_sequence']} (the run's first verdict)"
        if fp["closed"]
        else "still open: no verdict yet, so every attempt so far belongs to it"
    )
    console.print(f"first pass         {when}")
    console.print(
        f"  completion       {100 * fp['completion_rate']:.2f} %  now {100 * s['completion_rate']:.2f} %"
    )
    console.print(
        f"  silent errors    {100 * fp['silent_error_rate']:.2f} %  "
        f"now {100 * s['silent_error_rate']:.2f} %"
    )
    console.print(
        f"  reconciliation   {100 * fp['reconciliation_rate']:.2f} %  "
        "(verified on the first attempt / submitted)"
    )
    console.print(
        f"  recomputed       {100 * s.get('recomputed_rate', 0.0):.2f} %  "
        f"({count_shards(s.get('recomputed', 0))} ran more than once or after the first pass)"
    )


def _counts_table(console: Any, title: str, head: str, counts: dict[str, int]) -> None:
    from rich.table import Column, Table

    if not counts:
        return
    table = Table(head, Column("shards", justify="right"), title=title)
    for key, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        table.add_row(key, str(n))
    console.print(table)


def run_runs(args: argparse.Namespace) -> int:
    """Lists runs, most recently updated first."""
    runs = client_from(args).list_runs(namespace=args.namespace, page_size=args.limit)
    keys = ("run_id", "namespace", "event_count", "create_time", "update_time", "head_hash")
    times = [(iso_us(ts_us(r.create_time)), iso_us(ts_us(r.update_time))) for r in runs]
    rows = [
        dict(zip(keys, (r.run_id, r.namespace, r.event_count, *t, r.head_hash.hex()), strict=True))
        for r, t in zip(runs, times, strict=True)
    ]
    if args.json:
        print_json(rows)
        return EXIT_OK
    from rich.console import Console
    from rich.table import Table

    table = Table(*("run", "namespace", "events", "created", "updated", "head"))
    for row in rows:
        table.add_row(*(str(row[k])[: 16 if k == "head_hash" else None] for k in keys))
    Console(file=sys.stdout, markup=False, highlight=False).print(table)
    return EXIT_OK
