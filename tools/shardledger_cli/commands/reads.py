"""`shardledger status|shards|resume|events|runs`, the read commands: their help, examples and flags."""

from __future__ import annotations

import argparse
from typing import Final

from ledger_server.states import QUERY_ALIASES, QUERY_STATES, canonical_query
from shardledger_cli.cli import at_least
from shardledger_cli.commands.events import run_events
from shardledger_cli.commands.resume import RESUME_FORMATS, run_resume
from shardledger_cli.commands.runs import run_runs
from shardledger_cli.commands.shards import run_shards
from shardledger_cli.commands.status import run_status
from shardledger_cli.local_ledger import serve_db_option
from shardledger_cli.output import REASON_KEY
from shardledger_cli.parsing import add_format_option, examples, json_help

__all__ = ["query_state", "register"]


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
