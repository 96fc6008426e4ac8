"""`shardledger db`: apply schema migrations, and move a whole ledger between backends."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Final

from ledger_server import rebuild
from ledger_server.audit import ChainReport, verify_store
from ledger_server.compact import CompactRecords
from ledger_server.config import DEFAULT_DB
from ledger_server.record import RECORD_VERSION
from ledger_server.replay import RunReplay
from ledger_server.store import Store, open_store, redact_url, sqlite_path
from ledger_server.store.base import RunRow, ShardRow, StoredEvent, StoreError, WriterBusy
from ledger_server.upgrade import upgrade_projections
from shardledger_cli.cli import EXIT_OK, EXIT_PROBLEMS, CommandError
from shardledger_cli.commands import rebuild as rebuild_command
from shardledger_cli.output import print_json, progress
from shardledger_cli.parsing import add_db_option, add_json_option, examples

if TYPE_CHECKING:
    from ledger_server.store.postgres import PostgresStore

PG_MAX_IDENTIFIER_BYTES: Final = 63  # NAMEDATALEN - 1

COPY_DESCRIPTION: Final = """\
Copy a whole ledger into an empty PostgreSQL database, run by run: every event
row verbatim (global sequence, run sequence, receive time, row bytes, hash), so
the hash chains, Merkle trees and acknowledged sequence numbers stay valid. The
projections (shard states, summary counters) are rebuilt in the target by
folding each run's events, exactly as the server would have. Each run is copied
in one transaction; after the copy every chain in the target is verified.

Stop the servers writing to the source first. A target that already holds runs
is refused unless --resume, which skips runs already copied whole (same event
count and head hash) and refuses ones that differ. Replicas serving the target
must sign tree heads with the same key as before: copy the key file
(beside the SQLite file, *.signing-key.pem) and pass it to every replica.

exit codes: 0 copied and verified, 1 a chain failed verification, 5 refused or failed
"""


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """Adds the db command group."""
    p = sub.add_parser(
        "db",
        epilog=examples(
            "shardledger db migrate --db postgresql://ledger@db/ledger",
            "shardledger db rebuild --check",
        ),
        help="database maintenance: migrate, copy SQLite to PostgreSQL, grants, rebuild projections",
        description="Database maintenance for either backend.",
    )
    dbsub = p.add_subparsers(dest="db_command", metavar="SUBCOMMAND", required=True)
    m = dbsub.add_parser(
        "migrate",
        epilog=examples(
            "shardledger db migrate                             # ./ledger.db, or $SHARDLEDGER_DATABASE_URL",
            "shardledger db migrate --db postgresql://ledger@db/ledger --json",
        ),
        help="apply pending schema migrations and print the applied versions",
        description="Apply every pending numbered migration (each in one transaction with its "
        "record; concurrent replicas wait on an advisory lock) and print the applied versions.",
    )
    add_db_option(m, default=DEFAULT_DB)
    add_json_option(m, single="the applied migrations")
    m.set_defaults(func=run_migrate)
    c = dbsub.add_parser(
        "copy",
        epilog=examples(
            "shardledger db copy --from sqlite:///ledger.db --to postgresql://ledger@db/ledger",
            "shardledger db copy --from sqlite:///ledger.db --to postgresql://ledger@db/ledger --resume",
        ),
        help="copy a whole ledger (rows verbatim) into PostgreSQL and verify every chain",
        description=COPY_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument("--from", dest="source", required=True, help="source: sqlite:///PATH (or a URL)")
    c.add_argument("--to", dest="target", required=True, help="target: postgresql://USER@HOST/DB")
    c.add_argument(
        "--resume", action="store_true", help="continue an interrupted copy: skip runs copied whole"
    )
    add_json_option(c, single="what was copied and verified")
    c.set_defaults(func=run_copy)
    g = dbsub.add_parser(
        "grants",
        epilog=examples(
            "shardledger db grants --role ledger_server | psql postgresql://owner@db/ledger"
        ),
        help="print the GRANT/REVOKE statements for a least-privilege server role",
        description="Print SQL that lets ROLE append and read but never UPDATE, DELETE or "
        "TRUNCATE events. Run it as the tables' owner (the migration role), after `db migrate`.",
    )
    g.add_argument("--role", required=True, type=role_name, help="the role the replicas connect as")
    g.set_defaults(func=run_grants)
    rebuild_command.register(dbsub)


def role_name(text: str) -> str:
    """Returns a PostgreSQL role name as given (an argparse type); refuses one no role can have."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the role name is empty")
    if "\0" in text:
        raise argparse.ArgumentTypeError("a role name cannot hold a NUL character")
    if len(text.encode()) > PG_MAX_IDENTIFIER_BYTES:
        # PostgreSQL truncates longer names, so the grants would name another role.
        raise argparse.ArgumentTypeError(
            f"{text[:20]!r}... is longer than PostgreSQL's {PG_MAX_IDENTIFIER_BYTES}-byte names"
        )
    return text


def _applied(store: Store) -> list[tuple[int, str, int]]:
    from ledger_server.store.sqlite import SqliteStore

    if isinstance(store, SqliteStore):
        rows = store.execute_raw(
            "SELECT version, name, applied_us FROM schema_migrations ORDER BY version"
        )
        return [(int(v), str(n), int(t)) for v, n, t in rows]  # type: ignore[call-overload]
    applied: Callable[[], list[tuple[int, str, int]]] = store.applied_migrations  # type: ignore[attr-defined]
    return applied()


def _open(url: str) -> Store:
    try:
        return open_store(url)
    except (StoreError, ValueError) as exc:
        raise CommandError(f"cannot open {redact_url(url)}: {exc}") from None


def run_migrate(args: argparse.Namespace) -> int:
    """Applies pending migrations, rebuilds records of an older format, prints the versions."""
    path = sqlite_path(args.db)
    if args.db == DEFAULT_DB and path is not None and not os.path.lexists(path):
        # A named new SQLite file is created and migrated; the default one is not: run
        # in the wrong directory, `db migrate` must not leave an empty ledger behind.
        raise CommandError(
            f"no ledger at {args.db}: no such file (check --db; `shardledger serve --db PATH`"
            " creates a new ledger)"
        )
    store = _open(args.db)
    try:
        applied = _applied(store)
        upgraded, busy = _upgrade(store)
    finally:
        store.close()
    if args.json:
        print_json(
            {
                "database": redact_url(args.db),
                "schema_version": max((v for v, _, _ in applied), default=0),
                "migrations": [{"version": v, "name": n, "applied_us": t} for v, n, t in applied],
                "record_version": RECORD_VERSION,
                "runs_upgraded": upgraded,
                "upgrade_deferred": busy,
            }
        )
        return EXIT_OK
    print(f"{redact_url(args.db)}: schema version {applied[-1][0] if applied else 0}")
    for version, name, applied_us in applied:
        when = datetime.fromtimestamp(applied_us / 1e6, UTC).isoformat(timespec="seconds")
        print(f"  {version:>4}  {name}  (applied {when})")
    if busy:
        print(f"  shard records: {busy}")
    elif upgraded:
        print(
            f"  shard records: {len(upgraded)} runs rebuilt from their events to format {RECORD_VERSION}"
        )
    return EXIT_OK


def _upgrade(store: Store) -> tuple[list[str], str]:
    """Rebuilds runs whose shard records are older; returns (runs, why it waited, if it did)."""
    try:
        store.claim_writer()
    except WriterBusy as exc:
        return [], f"not upgraded now ({exc}); the server upgrades them when it next starts"
    done = upgrade_projections(store)
    return [f"{r.namespace}/{r.run_id}" for r in done], ""


def run_grants(args: argparse.Namespace) -> int:
    """Prints the statements for a least-privilege server role."""
    from ledger_server.store.postgres_sql import server_role_grants

    for statement in server_role_grants(args.role):
        print(statement + ";")
    return EXIT_OK


@dataclass(slots=True)
class CopyReport:
    """What a copy did."""

    copied_runs: int = 0
    skipped_runs: int = 0
    events: int = 0
    tokens: int = 0
    seconds: float = 0.0
    projection_mismatches: list[str] = field(default_factory=list)
    chains: list[ChainReport] = field(default_factory=list)


class _Fold:
    """Folds a run's events into projections while they stream past into the target."""

    def __init__(self, advance: Callable[[int], None]) -> None:
        self.replay = RunReplay(records=CompactRecords())
        self.events = 0
        self._advance = advance
        self._built: tuple[Collection[ShardRow], dict[str, int]] | None = None

    def feed(self, rows: Iterable[StoredEvent]) -> Iterator[StoredEvent]:
        for stored in rebuild.fold_rows(self.replay, rows, self._advance):
            self.events += 1
            yield stored

    def projections(self) -> tuple[Collection[ShardRow], dict[str, int]]:
        if self._built is None:
            self._built = rebuild.take_projections(self.replay)
        return self._built


def copy_ledger(
    source: Store,
    target: PostgresStore,
    *,
    resume: bool,
    advance: Callable[[int], None] = lambda n: None,
) -> CopyReport:
    """Copies every run of source into target (a PostgresStore) and verifies the chains."""
    started = time.monotonic()
    report = CopyReport()
    src = source.read()
    runs = sorted(src.list_runs(None, 1 << 62), key=lambda r: r.run_pk)
    archived = [f"{r.namespace}/{r.run_id}" for r in runs if r.archived]
    if archived:
        # A copy takes rows and projections, not tombstones: refuse rather than copy heads
        # without their events.
        raise CommandError(
            f"the source holds {len(archived)} archived runs ({', '.join(archived[:3])}...):"
            " `shardledger restore` them first, copy, then archive them again"
        )
    present = {(r.namespace, r.run_id): r for r in target.read().list_runs(None, 1 << 62)}
    if present and not resume:
        raise CommandError(
            f"the target already holds {len(present)} runs: refusing to copy into it"
            " (pass --resume to continue an interrupted copy)"
        )
    for run in runs:
        have: RunRow | None = present.get((run.namespace, run.run_id))
        if have is not None:
            if (have.event_count, have.head_hash) != (run.event_count, run.head_hash):
                raise CommandError(
                    f"run {run.namespace}/{run.run_id} differs in the target"
                    f" ({have.event_count} events there, {run.event_count} here): refusing"
                )
            report.skipped_runs += 1
            advance(run.event_count)
            continue
        fold = _Fold(advance)
        with rebuild.gc_paused():
            target.import_run(run, fold.feed(src.iter_events(run.run_pk)), fold.projections)
        report.copied_runs += 1
        report.events += fold.events
        if src.counters(run.run_pk) != fold.projections()[1]:
            # The target holds the replayed counters, which follow from the events alone.
            report.projection_mismatches.append(f"{run.namespace}/{run.run_id}")
    # Access tokens move too (hashes only), or every client would be locked out after the move.
    have_tokens = {t.token_id for t in target.list_tokens()}
    for token in source.list_tokens():
        if token.token_id not in have_tokens:
            target.create_token(token)
            report.tokens += 1
    target.sync_sequences()
    report.chains = verify_store(target)
    report.seconds = time.monotonic() - started
    return report


def run_copy(args: argparse.Namespace) -> int:
    """Copies a ledger into PostgreSQL and verifies it."""
    from ledger_server.store.postgres import PostgresStore

    path = sqlite_path(args.source)
    if path is not None and not Path(path).exists():
        raise CommandError(f"no ledger at {args.source}")
    if not args.target.startswith(("postgresql://", "postgres://")):
        raise CommandError("--to must be a postgresql:// URL")
    source = _open(args.source)
    try:
        target = _open(args.target)
        assert isinstance(target, PostgresStore)
        try:
            total = sum(r.event_count for r in source.read().list_runs(None, 1 << 62))
            with progress("copying events", total) as advance:
                report = copy_ledger(source, target, resume=args.resume, advance=advance)
        finally:
            target.close()
    finally:
        source.close()
    return _print_report(args, report)


def _print_report(args: argparse.Namespace, report: CopyReport) -> int:
    broken = [c for c in report.chains if not c.ok]
    if args.json:
        print_json(
            {
                "copied_runs": report.copied_runs,
                "skipped_runs": report.skipped_runs,
                "events": report.events,
                "tokens": report.tokens,
                "seconds": round(report.seconds, 3),
                "chains_verified": len(report.chains) - len(broken),
                "broken_chains": [c.to_json() for c in broken],
                "source_projection_mismatches": report.projection_mismatches,
            }
        )
    else:
        rate = report.events / report.seconds if report.seconds else 0.0
        print(
            f"copied {report.copied_runs} runs ({report.events} events, {rate:,.0f}/s),"
            f" skipped {report.skipped_runs} already copied, {report.tokens} access tokens"
        )
        print(f"verified {len(report.chains)} chains in the target: {len(broken)} broken")
        for chain in broken:
            print(
                f"  BROKEN {chain.namespace}/{chain.run_id} at {chain.first_bad_sequence}: {chain.problem}"
            )
        for name in report.projection_mismatches:
            print(
                f"  note: the source's projections of {name} disagreed with a replay;"
                " the target holds the replayed ones"
            )
    return EXIT_PROBLEMS if broken else EXIT_OK
