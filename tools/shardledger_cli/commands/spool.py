"""`shardledger spool status|drain`: inspect and deliver events that jobs kept in local spools."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Final

from shard_client.client import LedgerClient
from shard_client.spooldir import (
    ENV_SPOOL_DIR,
    REJECTED_FILE,
    SpoolStatus,
    drain_spool_dirs,
    find_spool_dirs,
    spool_base,
    spool_status,
)
from shardledger_cli.cli import EXIT_OK, EXIT_PROBLEMS, EXIT_REJECTED, EXIT_UNAVAILABLE, client_from
from shardledger_cli.output import print_json_lines, print_note, print_table
from shardledger_cli.parsing import add_format_option, examples, json_help, output_format

DESCRIPTION: Final = f"""\
When a job cannot reach the ledger it keeps its events in a durable spool on the
local disk and keeps running; the job itself drains the spool once the ledger
answers. A job that ended before that leaves its spool behind, one directory per
process under ${ENV_SPOOL_DIR} (default ~/.cache/shardledger/spool/<server>).

  status   pending events, bytes and the oldest pending event of every spool
  drain    send the spools of finished processes to the ledger, in order; events
           are idempotent, so a spool sent twice stores nothing twice. Events the
           ledger refuses are set aside in rejected.jsonl beside the spool.

exit codes: 0 ok; 1 (drain) some event was refused, or a spool is damaged (named,
the others are still drained); 3 the ledger was unreachable; 4 the ledger denied
access (the events stay spooled)
"""


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """Adds the spool command group."""
    p = sub.add_parser(
        "spool",
        epilog=examples(
            "shardledger spool status", "shardledger spool drain --server ledger.example:50551"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="inspect or drain events kept in local spools while the ledger was unreachable",
        description=DESCRIPTION,
    )
    actions = p.add_subparsers(dest="spool_command", metavar="ACTION", required=True)
    status = actions.add_parser(
        "status",
        epilog=examples(
            "shardledger spool status",
            "shardledger spool status --dir /local/spool --json",
            "shardledger spool status --format plain | awk -F'\\t' 'NR > 1 && $3 > 0'",
        ),
        parents=[common],
        help="show pending events per spool directory",
    )
    drain = actions.add_parser(
        "drain",
        epilog=examples(
            "shardledger spool drain",
            "shardledger spool drain --dir /local/spool --server ledger.example:50551 --tls-ca ca.pem",
        ),
        parents=[common],
        help="send finished processes' spools to the ledger",
    )
    for action in (status, drain):
        action.add_argument(
            "--dir",
            default=None,
            help=f"spool root or one spool directory (default: ${ENV_SPOOL_DIR} or "
            "~/.cache/shardledger/spool)",
        )
    json_help(status, lines="one spool directory")
    add_format_option(status)
    status.set_defaults(func=run_status)
    json_help(drain, lines="one spool directory and what was sent")
    drain.set_defaults(func=run_drain)


def _root(args: argparse.Namespace) -> str:
    return os.path.abspath(args.dir) if args.dir else spool_base()


def run_status(args: argparse.Namespace) -> int:
    """Prints one line (or JSON object) per spool directory."""
    rows = [spool_status(d) for d in find_spool_dirs(_root(args))]
    fmt = output_format(args)
    if fmt == "json":
        print_json_lines(dataclasses.asdict(r) for r in rows)
        return EXIT_OK
    if not rows:
        print_note(f"no spools under {_root(args)}", plain=fmt == "plain")
    if fmt == "plain":
        heads = [f.name.replace("_", " ") for f in dataclasses.fields(SpoolStatus)]
        cells = [[str(v) for v in dataclasses.astuple(r)] for r in rows]
        print_table(None, heads, cells, plain=True)
        _rejected_notes(rows, plain=True)
        return EXIT_PROBLEMS if any(r.error for r in rows) else EXIT_OK
    if not rows:
        return EXIT_OK
    for r in rows:
        if r.error:
            print(f"{r.directory}: DAMAGED, {r.error}  -> {r.target or '?'}")
            continue
        pending = "? (in use)" if r.pending < 0 else str(r.pending)
        owner = f"  owner pid {r.owner_pid}" if r.owner_pid else ""
        oldest = f"  oldest {r.oldest}" if r.oldest else ""
        rejected = f"  rejected {r.rejected}" if r.rejected else ""
        print(
            f"{r.directory}: {pending} pending, {r.size_bytes} bytes"
            f"{oldest}{rejected}  -> {r.target or '(no ledger recorded)'}{owner}"
        )
    _rejected_notes(rows, plain=False)
    return EXIT_PROBLEMS if any(r.error for r in rows) else EXIT_OK


def _rejected_notes(rows: list[SpoolStatus], *, plain: bool) -> None:
    """Says where each spool's refused events are, and how the spool is cleared.

    No drain resends a refused event (the ledger would refuse it again), so a spool
    holding only those stays listed until someone reads why and removes it.
    """
    for r in rows:
        if not r.rejected or r.error:
            continue
        where = os.path.join(r.directory, REJECTED_FILE)
        if r.pending == 0 and not r.owner_pid:
            then = f"nothing is pending: once read, `rm -r {r.directory}` clears it"
        else:
            then = "`shardledger spool drain` sends what is pending; the refused stay"
        print_note(
            f"{r.directory}: {r.rejected} event(s) the ledger refused are in {where}, each"
            f" with its reason; no drain resends them; {then}",
            plain=plain,
        )


def run_drain(args: argparse.Namespace) -> int:
    """Drains every spool no live process owns; exit 3 when a ledger was unreachable."""

    def client_for(target: str) -> LedgerClient:
        client: LedgerClient = client_from(
            argparse.Namespace(**{**vars(args), "server": target}), probe=False
        )
        return client

    results = drain_spool_dirs(
        _root(args), target=args.server, client_factory=client_for, connect_timeout_s=args.timeout
    )
    if args.json:
        print_json_lines(dataclasses.asdict(r) for r in results)
    else:
        for r in results:
            if r.status == "locked":
                print(f"{r.directory}: skipped, a live process owns it")
            elif r.status == "damaged":
                print(f"{r.directory}: skipped, DAMAGED: {r.error}")
            elif r.status == "denied":
                print(f"{r.directory}: {r.remaining} left, the ledger DENIED access: {r.error}")
            else:
                print(
                    f"{r.directory}: {r.sent} sent, {r.rejected} rejected, "
                    f"{r.remaining} left ({r.status})"
                )
        sent = sum(r.sent for r in results)
        rejected = sum(r.rejected for r in results)
        print(f"drained {len(results)} spool(s): {sent} events sent, {rejected} rejected")
    if any(r.status == "unavailable" for r in results):
        print("shardledger: ledger unreachable; the remaining events stay spooled", file=sys.stderr)
        return EXIT_UNAVAILABLE
    if any(r.status == "denied" for r in results):
        print(
            "shardledger: the ledger denied access (check --token-file or $SHARDLEDGER_TOKEN:"
            " a writer token is needed); the remaining events stay spooled",
            file=sys.stderr,
        )
        return EXIT_REJECTED
    return EXIT_PROBLEMS if any(r.rejected or r.error for r in results) else EXIT_OK
