"""`shardledger archive|restore`: settled runs out of the hot store into object storage, and back.

archive writes each run's bundle (events in the export format, the signed tree
head, a manifest with the blake3 of every file) to the location, reads it back and
checks it whole, and only then, in one transaction, puts a tombstone in the run's
place: the run's final summary and report, the bundle's location and digest, its
signed head. Its events, shard rows and heartbeat rows are then deleted a chunk at
a time (a run killed mid-way is finished by the next archive). `runs` lists the run as
archived; `status`, `report`, `trend`, `compare` and `accept` answer from what
stays hot; `events`, `shards`, `resume` and `audit` read the bundle and check it
against the tombstone. A run that is open, not settled or already archived, or
whose bundle does not read back whole, is refused and nothing is removed.

restore reads the bundle (checked against the tombstone), writes the rows back
byte for byte under their original sequences, rebuilds the projections and drops
the tombstone, in one transaction. The bundle stays where it is.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Final

from ledger_server.validation import check_namespace
from shardledger_cli.cli import EXIT_OK, EXIT_PROBLEMS, CommandError, open_ledger
from shardledger_cli.output import print_json
from shardledger_cli.parsing import add_db_option, add_json_option, examples

if TYPE_CHECKING:
    from ledger_server.archiver import Outcome
    from ledger_server.signing import SigningKey

ARCHIVE_EPILOG: Final = """
A SQLite ledger has one writer: stop its server first, or let the server archive
(`shardledger serve --archive-after 7d --archive-to URL`). The ledger's signing key
(--signing-key, by default beside the SQLite file) signs the archived head.

exit codes: 0 every run archived (or, --dry-run, would be); 1 a run was refused or
its archive failed (each is named, with why; nothing of it was removed);
5 the ledger or the signing key cannot be opened"""


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """Adds the archive and restore commands."""
    raw = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "archive",
        help="move settled runs' events to a directory or object store, leaving a tombstone",
        description=__doc__,
        epilog=examples(
            "shardledger archive night-01 --to s3://ledger-archive/nights --db ledger.db",
            "shardledger archive night-01 night-02 --to /mnt/archive --db ledger.db --dry-run",
            "shardledger archive night-01 --to s3://ledger-archive/nights --db postgresql://ops@db/ledger --json",
            notes=ARCHIVE_EPILOG,
        ),
        formatter_class=raw,
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="run ids")
    p.add_argument(
        "--to",
        required=True,
        metavar="URL",
        help="the archive: a local directory or an fsspec URL (s3://BUCKET/PREFIX); each run"
        " goes to URL/NAMESPACE/RUN/",
    )
    p.add_argument("--namespace", default="", help="the runs' namespace (default: default)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="say what would move and its size (the bundle is built and measured, not uploaded)",
    )
    p.add_argument(
        "--signing-key",
        metavar="PEM",
        help="the ledger's tree-head key (default: beside the SQLite file, as serve keeps it)",
    )
    add_db_option(p)
    add_json_option(
        p, lines="one object per run (action: archived, would_archive, refused, failed)"
    )
    p.set_defaults(func=run_archive)

    p = sub.add_parser(
        "restore",
        help="bring an archived run back into the hot store, byte for byte",
        description=__doc__,
        epilog=examples(
            "shardledger restore night-01 --db ledger.db",
            "shardledger restore night-01 --from s3://ledger-archive-copy/nights --db ledger.db",
            notes="exit codes: 0 restored; 1 refused (not archived) or the bundle does not"
            " check against the tombstone (what differs is named; nothing was written);"
            " 5 the ledger cannot be opened",
        ),
        formatter_class=raw,
    )
    p.add_argument("run", help="run id")
    p.add_argument(
        "--from",
        dest="from_url",
        metavar="URL",
        help="read the bundle under this archive URL instead of where the tombstone says"
        " (a copy: it must still match the tombstone)",
    )
    p.add_argument("--namespace", default="", help="the run's namespace (default: default)")
    add_db_option(p)
    add_json_option(p, single="what was restored")
    p.set_defaults(func=run_restore)


def _signing_key(args: argparse.Namespace) -> SigningKey:
    from ledger_server.config import default_key_path
    from ledger_server.startup import StartupError, existing_signing_key

    path = args.signing_key or default_key_path(args.db)
    try:
        key = existing_signing_key(path)
    except StartupError as exc:
        raise CommandError(exc.message) from None
    if key is None:
        raise CommandError(
            f"no signing key at {path}: archive signs each run's head with the ledger's key"
            " (--signing-key, or beside the SQLite file where serve keeps it); nothing archived"
        )
    return key


def run_archive(args: argparse.Namespace) -> int:
    """Archives each run in turn; one refused run stops none of the others."""
    from ledger_server.archiver import archive_run, finish_purges
    from ledger_server.service import now_us
    from ledger_server.store.base import StoreError

    namespace = check_namespace(args.namespace)
    key = _signing_key(args)
    store = open_ledger(args.db)
    outcomes = []
    try:
        if not args.dry_run:
            finish_purges(store)  # what a killed archive left of its archived runs' rows
        for run_id in args.runs:
            outcome = archive_run(
                store,
                key,
                namespace,
                run_id,
                args.to,
                now_us=now_us(),
                dry_run=args.dry_run,
            )
            outcomes.append(outcome)
            _say(outcome, args.json, lines=True)
    except StoreError as exc:
        raise CommandError(f"cannot archive: {exc}; nothing removed") from None
    finally:
        store.close()
    return EXIT_OK if all(o.ok for o in outcomes) else EXIT_PROBLEMS


def run_restore(args: argparse.Namespace) -> int:
    """Restores one archived run from its bundle."""
    from ledger_server.archiver import restore_run
    from ledger_server.store.base import StoreError

    store = open_ledger(args.db)
    try:
        outcome = restore_run(
            store, check_namespace(args.namespace), args.run, from_url=args.from_url
        )
    except StoreError as exc:
        raise CommandError(f"cannot restore {args.run}: {exc}; nothing written") from None
    finally:
        store.close()
    _say(outcome, args.json)
    return EXIT_OK if outcome.ok else EXIT_PROBLEMS


def _say(outcome: Outcome, as_json: bool, *, lines: bool = False) -> None:
    if as_json and lines:
        sys.stdout.write(json.dumps(outcome.to_json(), sort_keys=True) + "\n")
        return
    if as_json:
        print_json(outcome.to_json())
        return
    run = f"{outcome.namespace}/{outcome.run_id}"
    size = f"{outcome.size_bytes:,} bytes"
    if outcome.action == "archived":
        print(f"archived {run}: {outcome.events} events, {size} to {outcome.location}")
    elif outcome.action == "would_archive":
        print(f"would archive {run}: {outcome.events} events, {size} to {outcome.location}")
    elif outcome.action == "restored":
        print(f"restored {run}: {outcome.events} events from {outcome.location}")
    else:
        print(f"shardledger: {outcome.action} {run}: {outcome.reason}", file=sys.stderr)
