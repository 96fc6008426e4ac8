"""`shardledger db rebuild`: check or repair a run's projections by replaying its events."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Final

from ledger_server.compact import HOT_RECORDS
from ledger_server.config import DEFAULT_DB
from ledger_server.errors import LedgerError
from ledger_server.rebuild import RebuildRefused, RunRebuild, rebuild_run
from ledger_server.store import open_store, redact_url, sqlite_path
from ledger_server.store.base import RunRow, Store, StoreError, WriterBusy
from ledger_server.store.sqlite import SqliteStore
from ledger_server.validation import check_namespace
from shardledger_cli.cli import EXIT_LOCAL, EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, CommandError
from shardledger_cli.output import count_shards, print_json, progress
from shardledger_cli.parsing import add_db_option, add_json_option, whole_number

DESCRIPTION: Final = """\
Replay each run's events and compare the result with its stored projections
(shard rows, heartbeat columns, summary counters): what `status`, `shards` and
`resume` answer from. Without --check, a run whose projections differ gets them
rewritten from the replay in one transaction; a consistent run is left alone.

Every row is checked against the run's hash chain before it is folded, so
projections are never rebuilt from rows the chain does not vouch for (run
`shardledger audit verify --db` to see what changed). Stop the server writing to the
database first: a rebuild refuses a run that moves while it is replayed, and a
running server keeps shard records in memory that would not see the rewrite (on
SQLite a rewrite beside a live server is refused; --check only reads).

Examples:
  shardledger db rebuild --check                     # ./ledger.db, or $SHARDLEDGER_DATABASE_URL
  shardledger db rebuild --db postgresql://ledger@db/ledger --run night-42 --json

exit codes: 0 consistent (or rewritten), 1 --check found projections that differ,
2 a bad argument, 5 refused: a broken chain or a run that moved (that run is named
and left as it was, the others are still rebuilt), no such run or
ledger, or a database error
"""


def register(dbsub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds `db rebuild`."""
    r = dbsub.add_parser(
        "rebuild",
        help="replay runs to check (or repair) their shard rows and counters",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_db_option(r, default=DEFAULT_DB)
    r.add_argument("--run", dest="run_id", help="only this run (default: every run)")
    r.add_argument("--namespace", default="", help="the run's namespace (default: default)")
    r.add_argument(
        "--check", action="store_true", help="compare only; exit 1 if any run's projections differ"
    )
    r.add_argument(
        "--records-in-memory",
        type=whole_number(0),
        default=HOT_RECORDS,
        metavar="N",
        help=(
            "shard records kept as objects while replaying (~4 KB each); the others are"
            " spilled to a temporary file in $TMPDIR (~1.7 KB each; a run of more shards"
            " than N costs ~1.1-1.2x the CPU). 0 keeps them all: fastest, most memory"
            f" (default: {HOT_RECORDS:,})"
        ),
    )
    add_json_option(r, single="every run's verdict")
    r.set_defaults(func=run_rebuild)


def _runs(store: Store, args: argparse.Namespace) -> list[RunRow]:
    view = store.read()
    if args.run_id is None:
        # An archived run has no hot rows to rebuild: restore rebuilds its projections.
        hot = (r for r in view.list_runs(None, 1 << 62) if not r.archived)
        return sorted(hot, key=lambda r: r.run_pk)
    try:
        namespace = check_namespace(args.namespace)
    except LedgerError as exc:
        raise CommandError(f"--namespace: {exc}", code=EXIT_USAGE) from None
    run = view.get_run(namespace, args.run_id)
    if run is None:
        raise CommandError(
            f"no run {args.run_id} in namespace {namespace} at {redact_url(args.db)}",
            code=EXIT_LOCAL,
        )
    if run.archived:
        raise CommandError(
            f"run {args.run_id} is archived: it has no hot rows to rebuild (`shardledger"
            " restore` brings it back and rebuilds its projections)",
            code=EXIT_LOCAL,
        )
    return [run]


def run_rebuild(args: argparse.Namespace) -> int:
    """Replays the selected runs; rewrites differing projections unless --check."""
    url = args.db
    path = sqlite_path(url)
    if path is not None and not Path(path).is_file():
        # Opening would create an empty ledger: a typo must not look like one.
        raise CommandError(f"no ledger at {url}", code=EXIT_LOCAL)
    try:
        # An existing ledger only: an empty or foreign file is refused and left as it was.
        store = SqliteStore(path, must_exist=True) if path is not None else open_store(url)
    except (StoreError, ValueError) as exc:
        raise CommandError(f"cannot open {redact_url(args.db)}: {exc}", code=EXIT_LOCAL) from None
    reports: list[RunRebuild] = []
    refused: list[tuple[RunRow, str]] = []
    try:
        runs = _runs(store, args)
        with progress("replaying events", sum(r.event_count for r in runs)) as advance:
            for run in runs:
                try:
                    reports.append(
                        rebuild_run(
                            store,
                            run,
                            write=not args.check,
                            advance=advance,
                            records_in_memory=args.records_in_memory,
                        )
                    )
                except RebuildRefused as exc:  # this run is left as it is; the others go on
                    refused.append((run, str(exc)))
    except WriterBusy as exc:
        raise CommandError(f"refused: {exc}; {_written(reports)}", code=EXIT_LOCAL) from None
    except StoreError as exc:
        raise CommandError(f"database error: {exc}; {_written(reports)}", EXIT_LOCAL) from None
    finally:
        store.close()
    return _report(args, reports, refused)


def _written(reports: list[RunRebuild]) -> str:
    """Says what an aborted rebuild had already rewritten (each run commits on its own)."""
    done = [f"{r.namespace}/{r.run_id}" for r in reports if r.written]
    return f"runs already rewritten: {', '.join(done)}" if done else "nothing was written"


def _report(
    args: argparse.Namespace, reports: list[RunRebuild], refused: list[tuple[RunRow, str]]
) -> int:
    differing = [r for r in reports if not r.consistent]
    if args.json:
        print_json(
            {
                "database": redact_url(args.db),
                "check_only": args.check,
                "runs": [
                    {
                        "namespace": r.namespace,
                        "run_id": r.run_id,
                        "events": r.events,
                        "shards": r.shards,
                        "differing_shards": r.differing_shards,
                        "counters_differ": r.counters_differ,
                        "rewritten": r.written,
                        "seconds": round(r.seconds, 3),
                        "replay_seconds": round(r.replay_seconds, 3),
                        "write_seconds": round(r.write_seconds, 3),
                    }
                    for r in reports
                ],
                "refused": [
                    {"namespace": run.namespace, "run_id": run.run_id, "reason": why}
                    for run, why in refused
                ],
            }
        )
    else:
        for r in reports:
            rate = r.events / r.seconds if r.seconds else 0.0
            verdict = (
                "consistent"
                if r.consistent
                else (
                    f"{r.differing_shards} shard rows differ"
                    + (", counters differ" if r.counters_differ else "")
                )
            )
            action = " -> rewritten" if r.written else ""
            print(
                f"{r.namespace}/{r.run_id}: {r.events} events, {count_shards(r.shards)}"
                f" ({rate:,.0f} events/s): {verdict}{action}"
            )
        for run, why in refused:
            print(f"{run.namespace}/{run.run_id}: REFUSED, left as it was: {why}")
        if not reports and not refused:
            print("no runs")
    if refused:
        return EXIT_LOCAL
    return EXIT_PROBLEMS if args.check and differing else EXIT_OK
