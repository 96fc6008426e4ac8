"""`shardledger status RUN`: the run summary, its lifecycle and first pass, as tables, plain blocks or JSON."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from shardledger_cli.cli import EXIT_OK, EXIT_PROBLEMS, client_from
from shardledger_cli.output import by_state, count_shards, equation, iso_us, print_json, print_table
from shardledger_cli.parsing import output_format

if TYPE_CHECKING:
    from shard_client.client import LedgerClient

__all__ = ["add_run_sequences", "in_run", "lifecycle_line", "render_summary", "run_status"]


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
    console: Any = None
    if not plain:  # a pipe gets tab-separated blocks: rich is not even imported
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
