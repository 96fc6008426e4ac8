"""`shardledger status|shards|resume|events|runs`: their help and flags; status and runs."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from ledger_server.states import QUERY_ALIASES, QUERY_STATES, canonical_query
from shardledger_cli.cli import EXIT_OK, EXIT_PROBLEMS, at_least, client_from
from shardledger_cli.commands.events import run_events
from shardledger_cli.commands.resume import RESUME_FORMATS, run_resume
from shardledger_cli.commands.shards import run_shards
from shardledger_cli.local_ledger import serve_db_option
from shardledger_cli.output import (
    REASON_KEY,
    by_state,
    count_shards,
    equation,
    iso_us,
    print_json,
    print_table,
    ts_us,
)
from shardledger_cli.parsing import add_format_option, examples, json_help, output_format

if TYPE_CHECKING:
    from shard_client.client import LedgerClient

__all__ = ["lifecycle_line", "register", "render_summary", "run_runs", "run_status"]


HELP: Final = {
    "status": """a run's summary: submitted = verified + failed + missing + ...

Print the run summary: the reconciliation equation, the run's lifecycle (open,
submission closed, settled: see `plan --close`; reopened: `plan --reopen`), completion rate
(verified / submitted), silent error rate, failure tags, duplicates and
fingerprint groups (every name is defined in docs/concepts.md). --json prints the summary object the server computed;
its "lifecycle" object says whether the run is settled and since when.

--costs adds what the failures cost in GPU time and the checkpoint interval
the run's numbers advise (report 1, §4.3 and §3.2; docs/metrics.md), under the
keys "costs" and "checkpoint_advice", as the server keeps them (GetRunReport).


exit codes: 0 every planned shard is verified; 1 some shard is not;
3 server unreachable; 4 refused (e.g. unknown run)""",
    "shards": f"""list a run's shards, optionally in one state

List the run's shards in plan order, streamed (a million shards print without
a table in memory): aligned columns on a terminal, tab-separated columns when
piped (--format plain), or one JSON object per shard (--json). Shard ids are
never cut.
RANKS is "alive/world" for a multi-rank (torchrun) attempt: the ranks still
heartbeating; the view's "ranks" has each rank's state, host and pid.
HOST and JOB are the latest attempt's. --attempts lists every attempt instead, one
row each (a rerun shard's first-pass job too): ATTEMPT (1 for the shard's first),
ATTEMPT ID, OUTCOME (what that attempt came to: verified, unverified,
verify_failed, failed, running, stale, or superseded when a newer attempt started
before it ended), DETAIL, HOST, JOB, STARTED and ENDED; --state and --limit still
choose shards, and a shard never started has no row. --attempts --json prints one
object per attempt.

states: {", ".join(QUERY_STATES)}
  (old names accepted for one release: {", ".join(f"{k} = {v}" for k, v in QUERY_ALIASES.items())})
exit codes: 0 listed (even when empty); 3 unreachable; 4 refused""",
    "resume": f"""exactly the shards that must run again

Stream the resume list: every planned shard without a confirmed (committed
and verified) artifact, in plan order. Before the first `verify` every
committed shard is in it as unverified; a hint on stderr says so.

formats:
  jsonl        the original plan lines as stored, one per line (default);
               --reasons adds a "{REASON_KEY}" key to each
  ids          one shard id per line
  slurm-array  plan_index ranges like 3-5,9,12-14 for `sbatch --array=`

-o FILE replaces FILE atomically (temp file, fsync, rename); a count of
shards by reason goes to stderr. exit codes: 0 nothing to re-run (with
--exit-zero: the list was written, empty or not); 1 shards must re-run;
3 unreachable; 4 refused; 5 the output file could not be written. In a
`set -e` script take the list with --exit-zero: a non-empty list is not a
failure of the script.""",
    "events": """print a run's events, or follow them

Print one line per event: its sequence in the run (SEQ: 1 for the run's first
event, the number --after takes), receive time, shard, attempt, kind and a short
payload; piped (--format plain), tab-separated under a header line. --json
prints JSON lines (the protobuf JSON mapping), with both the run's "run_sequence"
and the ledger-wide "sequence". --follow keeps streaming new events until Ctrl-C,
which exits 0.""",
    "runs": "list runs, most recently updated first\n\nList the namespace's runs, newest first.",
}

EXAMPLES: Final = {
    "status": (
        "shardledger status night-01",
        "shardledger status night-01 --json | jq .completion_rate",
        "shardledger status night-01 --costs             # GPU time lost, checkpoint advice",
        "shardledger status night-01 --format plain     # no box tables, for logs and mail",
        "shardledger status night-01 --db copy/ledger.db  # a ledger file, no server",
    ),
    "shards": (
        "shardledger shards night-01",
        "shardledger shards night-01 --state stale",
        "shardledger shards night-01 --state failed --json | jq -r .shard_id",
        "shardledger shards night-01 --format plain | cut -f2,3",
        "shardledger shards night-01 --state failed --db copy/ledger.db",
    ),
    "resume": (
        "shardledger resume night-01 -o rerun.jsonl     # exit 1 while something must rerun",
        "shardledger resume night-01 --format ids",
        "ARRAY=$(shardledger resume night-01 --format slurm-array --exit-zero)   # set -e safe",
        '[ -z "$ARRAY" ] || sbatch --array="${ARRAY}%64" job.sbatch',
        "shardledger resume night-01 --json | jq -r .reason | sort | uniq -c",
        "shardledger resume night-01 --db copy/ledger.db --format ids",
    ),
    "events": (
        "shardledger events night-01",
        "shardledger events night-01 --shard s-3c52ba9ca020",
        "shardledger events night-01 --after 1200 --follow",
        "shardledger events night-01 --json | jq -c 'select(.failed)'",
        "shardledger events night-01 --db copy/ledger.db --shard s-3c52ba9ca020",
    ),
    "runs": (
        "shardledger runs",
        "shardledger runs --namespace team-a --limit 10",
        "shardledger runs --json | jq -r .run_id",
        "shardledger runs --db copy/ledger.db          # which runs a ledger file holds",
    ),
}
JSON_SHAPES: Final = {
    "status": {"single": "the run summary the server computed"},
    "shards": {"lines": "one shard view per shard"},
    "resume": {"lines": "one {shard_id, plan_index, reason, plan_line} object per shard"},
    "events": {
        "lines": "one event (the protobuf JSON mapping, with run_sequence and the global"
        " sequence) per event"
    },
    "runs": {"lines": "one run"},
}


def query_state(text: str) -> str:
    """Returns the query state a --state names, an old name mapped to its new one."""
    try:
        return canonical_query(text)
    except ValueError:
        return text  # left to the choices check, which suggests the closest name


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """Adds the status, shards, resume, events and runs commands."""
    funcs = {"status": run_status, "shards": run_shards, "resume": run_resume}
    funcs |= {"events": run_events, "runs": run_runs}
    parsers = {}
    for name, func in funcs.items():
        summary, _, description = HELP[name].partition("\n\n")
        p = sub.add_parser(
            name,
            parents=[common],
            help=summary,
            description=description,
            epilog=examples(*EXAMPLES[name]),
        )
        json_help(p, **JSON_SHAPES[name])
        if name != "runs":
            p.add_argument("run", help="run id")
        if name in ("status", "shards", "events", "runs"):
            add_format_option(p)
        serve_db_option(p, func, refuse=_no_follow if name == "events" else None)
        parsers[name] = p
    parsers["status"].add_argument(
        "--costs", action="store_true", help="add GPU time lost to failures and checkpoint advice"
    )
    p = parsers["shards"]
    p.add_argument(
        "--state",
        type=query_state,
        choices=QUERY_STATES,
        default="",
        help="only shards in this state",
    )
    p.add_argument("--limit", type=at_least(0), default=0, help="at most N shards (0: all)")
    p.add_argument(
        "--attempts",
        action="store_true",
        help="one row per attempt instead of per shard (a rerun shard's earlier jobs too):"
        " attempt, outcome, host, job, started, ended",
    )
    p = parsers["resume"]
    p.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    p.add_argument("--format", choices=RESUME_FORMATS, default="jsonl", help="output format")
    p.add_argument("--reasons", action="store_true", help=f"jsonl only: add {REASON_KEY!r}")
    p.add_argument(
        "--exit-zero",
        action="store_true",
        help="exit 0 when the list was written, empty or not (a `set -e` script's"
        " ARRAY=$(shardledger resume RUN --format slurm-array --exit-zero))",
    )
    p = parsers["events"]
    p.add_argument(
        "--after",
        type=at_least(0),
        default=0,
        metavar="SEQ",
        help="events after SEQ, the sequence in the run that the output shows (SEQ)",
    )
    p.add_argument(
        "--shard",
        metavar="SHARD_ID",
        default="",
        help="only this shard's events: its id, or the start of it as the CLI prints it"
        " (s-3c52ba9ca020…); an unknown one exits 4",
    )
    p.add_argument("--follow", "-f", action="store_true", help="stream new events as they commit")
    parsers["runs"].add_argument("--limit", type=at_least(1), default=100, help="at most N runs")


def _no_follow(args: argparse.Namespace) -> str:
    """Returns why events --follow cannot read a ledger file, or ""."""
    if not args.follow:
        return ""
    return (
        "--follow waits for events a server commits, and --db reads the ledger with no"
        " server: leave out --follow, or follow through the server that writes it (--server)"
    )


def run_status(args: argparse.Namespace) -> int:
    """Prints the run summary; exits 0 only when every planned shard is verified."""
    client = client_from(args)
    summary: dict[str, Any] = json.loads(client.summary(args.run, namespace=args.namespace))
    add_run_sequences(client, summary, namespace=args.namespace)
    if getattr(args, "costs", False):
        from shardledger_cli.commands.field_report import print_costs, run_report_json

        extra = run_report_json(client, args.run, namespace=args.namespace)
        summary |= {k: extra[k] for k in ("costs", "checkpoint_advice")}
    fmt = output_format(args)
    if fmt == "json":
        print_json(summary)
    else:
        render_summary(summary, plain=fmt == "plain")
        if "costs" in summary:
            print_costs(summary["costs"], summary["checkpoint_advice"], plain=fmt == "plain")
    done = summary["submitted"] > 0 and summary["verified"] == summary["submitted"]
    return EXIT_OK if done else EXIT_PROBLEMS


# The summary's moments, held as ledger-wide sequences: (section, moment).
MOMENTS: Final = (
    ("lifecycle", "submission_closed_at"),
    ("lifecycle", "reopened_at"),
    ("first_pass", "closed_at"),
)


def add_run_sequences(client: LedgerClient, s: dict[str, Any], *, namespace: str) -> None:
    """Adds MOMENT_run_sequence beside each MOMENT_sequence: that event's number in the run.

    The number `events RUN` shows (SEQ), read from the event itself (one ListEvents of
    one event each); None where the moment has not happened.
    """
    for part, moment in MOMENTS:
        section = s.get(part)
        if not section or f"{moment}_sequence" not in section:
            continue
        wide = section[f"{moment}_sequence"]
        own = None
        if wide:
            first = next(
                iter(
                    client.list_events(
                        s["run_id"], namespace=namespace, after_sequence=wide - 1, page_size=1
                    )
                ),
                None,
            )
            if first is not None and first.sequence == wide:
                own = first.run_sequence
        section[f"{moment}_run_sequence"] = own


def render_summary(s: dict[str, Any], *, plain: bool = False) -> None:
    """Prints the summary on stdout: lines and rich tables, or plain blocks when plain.

    Plain: a "# summary" block of FIELD/VALUE rows first, then one block per table.
    """
    from rich.console import Console

    # markup off: shard ids, tags and reasons are data, never rich markup.
    console = Console(file=sys.stdout, markup=False, highlight=False, soft_wrap=True)
    fields: list[tuple[str, str]] = []

    def say(field: str, value: str, *, key: str = "") -> None:
        """One line: "field   value" on a terminal; a summary row (named key) when plain."""
        if plain:
            fields.append((key or field.strip(), value))
        else:
            console.print(f"{field:<19}{value}")

    life = lifecycle_line(s)
    if plain:
        fields += [("run", str(s["run_id"])), ("namespace", str(s["namespace"]))]
        fields += [("as of", iso_us(s.get("as_of_us"))), ("events", str(s.get("event_count", 0)))]
        fields += [("head", str(s.get("head_hash", ""))), ("equation", equation(s))]
        fields += [("lifecycle", life[19:])]  # the line's own label is the field name
    else:
        console.print(
            f"run {s['run_id']} (namespace {s['namespace']}) as of {iso_us(s.get('as_of_us'))}, "
            f"{s.get('event_count', 0)} events, head {str(s.get('head_hash', ''))[:16]}",
            style="bold",
        )
        console.print(equation(s))
        console.print(life)
    sub = s["submitted"] or 1
    counts = by_state(s)
    # One row per state, each the set `shards RUN --state NAME` lists: they add up to
    # submitted. failed is a job's own failure; verify_failed, outputs that failed verify.
    rows = [
        (
            f"{key} ({meaning})" if meaning else key,
            str(counts[key]),
            f"{100 * counts[key] / sub:.1f} %",
        )
        for key, meaning in (
            ("verified", ""),
            ("failed", "its latest attempt failed: failure tags below"),
            ("verify_failed", "its outputs failed verification"),
            ("missing", "planned, never started"),
            ("running", ""),
            ("stale", "silent past its heartbeat timeout"),
            ("unverified", "committed, not yet verified"),
        )
    ]
    tables: list[
        tuple[str, tuple[str, ...], list[tuple[str, str, str]] | list[tuple[str, str]]]
    ] = []
    tables.append(("shards", ("state", "shards", "share"), rows))
    if not plain:
        print_table(*tables.pop(), plain=False, console=console)
    say(
        "unconfirmed",
        f"{count_shards(s.get('unconfirmed', s['submitted'] - s['verified']))}  (every state but"
        f" verified: `shardledger resume {s['run_id']}` lists them)",
    )
    say("completion rate", f"{100 * s['completion_rate']:.2f} %  (verified / submitted)")
    say(
        "silent error rate",
        f"{100 * s['silent_error_rate']:.2f} %  "
        f"({s['silent_errors']} reported success but failed verification or were incomplete)",
    )
    dups = ", ".join(f"{k} {n}" for k, n in sorted(s["duplicates"].items()))
    say("duplicates", f"{s['duplicate_shards']} shards: {dups}")
    say(
        "repairs",
        f"{count_shards(s.get('repairs', 0))}  "
        "(a rerun replaced a failed, corrupted or missing result)",
    )
    say("attempts", str(s["attempts"]))
    _first_pass(say, s)
    if s.get("numeric"):
        say(
            "numeric pollution",
            f"{count_shards(s['numeric'])} reported NaN/Inf metrics"
            f" (shardledger shards {s['run_id']} --json shows the first step)",
        )
    if s.get("late_attempts"):
        say(
            "late events",
            f"{s['late_attempts']} attempts' events arrived late from a"
            " spool: the figures above were wrong until they did",
        )
    # The last column says what each table counts: shards, or attempts (a shard rerun
    # three times is three attempts).
    for title, key, head, unit in (
        ("failure tags (failed shards, by their latest attempt)", "failure_tags", "tag", "shards"),
        ("failure tags (every failed attempt)", "attempt_failure_tags", "tag", "attempts"),
        ("verification failures (verify_failed shards)", "verify_failures", "reason", "shards"),
        ("fingerprint groups (latest attempt)", "fingerprint_groups", "fingerprint", "shards"),
    ):
        tallies: dict[str, int] = s.get(key) or {}
        ordered = sorted(tallies.items(), key=lambda kv: (-kv[1], kv[0]))
        if ordered:
            tables.append((title, (head, unit), [(k, str(n)) for k, n in ordered]))
    if plain:
        print_table("summary", ("field", "value"), fields, plain=True)
    for title, heads, cells in tables:
        print_table(title, heads, cells, plain=plain, console=console)


def in_run(section: dict[str, Any], moment: str) -> Any:
    """Returns a summary moment as the run's own event number (SEQ in `events RUN`).

    A server older than the run's numbering gives only the ledger-wide sequence: that
    one is shown, marked as such.
    """
    own = section.get(f"{moment}_run_sequence")
    if own:
        return own
    wide = section.get(f"{moment}_sequence")
    return f"{wide} (ledger-wide sequence)" if wide else None


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
        reopened = in_run(life, "reopened_at")
        return (
            "lifecycle          open"
            + (f" (reopened at event {reopened}, {life['reopened_at']})" if reopened else "")
            + f": jobs may still start (`shardledger plan {s['run_id']} --close` once none will)"
        )
    words = {"unverified": "committed, not verified", "unplanned": "announced, not planned"}
    waiting = ", ".join(
        f"{count_shards(n)} {words.get(what, what)}" for what, n in life["waiting_on"].items() if n
    )
    return f"lifecycle          submission closed, waiting on {waiting}"


def _first_pass(say: Callable[..., None], s: dict[str, Any]) -> None:
    """Says the first-pass figures beside the current ones (history no rerun rewrites)."""
    fp = s.get("first_pass")
    if not fp:
        return
    when = (
        f"closed at event {in_run(fp, 'closed_at')} (the run's first verdict)"
        if fp["closed"]
        else "still open: no verdict yet, so every attempt so far belongs to it"
    )
    say("first pass", when)
    say(
        "  completion",
        f"{100 * fp['completion_rate']:.2f} %  now {100 * s['completion_rate']:.2f} %",
        key="first pass completion",
    )
    say(
        "  silent errors",
        f"{100 * fp['silent_error_rate']:.2f} %  now {100 * s['silent_error_rate']:.2f} %",
        key="first pass silent errors",
    )
    say(
        "  reconciliation",
        f"{100 * fp['reconciliation_rate']:.2f} %  (verified on the first attempt / submitted)",
        key="first pass reconciliation",
    )
    say(
        "  recomputed",
        f"{100 * s.get('recomputed_rate', 0.0):.2f} %  "
        f"({count_shards(s.get('recomputed', 0))} ran more than once or after the first pass)",
        key="recomputed",
    )


def run_runs(args: argparse.Namespace) -> int:
    """Lists runs, most recently updated first."""
    runs = client_from(args).list_runs(namespace=args.namespace, page_size=args.limit)
    keys = ("run_id", "namespace", "event_count", "create_time", "update_time", "head_hash")
    times = [(iso_us(ts_us(r.create_time)), iso_us(ts_us(r.update_time))) for r in runs]
    rows = [
        dict(zip(keys, (r.run_id, r.namespace, r.event_count, *t, r.head_hash.hex()), strict=True))
        | {"archived": r.archived, "archive_location": r.archive_location}
        for r, t in zip(runs, times, strict=True)
    ]
    fmt = output_format(args)
    if fmt == "json":
        for row in rows:
            sys.stdout.write(json.dumps(row, sort_keys=True) + "\n")
        return EXIT_OK
    from rich.console import Console

    # The head is shortened to 16 hex digits (`audit` shows it whole); nothing else is cut.
    cells = [
        [str(row[k])[: 16 if k == "head_hash" else None] for k in keys]
        + [row["archive_location"] if row["archived"] else "hot"]
        for row in rows
    ]
    console = Console(file=sys.stdout, markup=False, highlight=False)
    heads = ("run", "namespace", "events", "created", "updated", "head", "stored")
    print_table(None, heads, cells, plain=fmt == "plain", console=console)
    return EXIT_OK
