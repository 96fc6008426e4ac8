"""Read commands on a ledger file (--db PATH|URL): the ledger served read-only, in process.

`status --db F` (and shards, resume, events, runs, report, trend, export, compare,
accept, notify, verify --dry-run, sample --dry-run, watch without acting) open F read-only, start the real gRPC server over it on a Unix socket in
a private directory, and point the command's client there. Every command then runs
its ordinary code path against the same servicer, service and projections a
`shardledger serve --db F` would use, so it answers exactly what it would answer
through a server, and nothing is written: not the file, not a writer lock, not a
signing key (ledger_server.server.create_read_only_server). The socket, and not a
loopback port, keeps the ledger from every other user of the machine meanwhile.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Final

from shardledger_cli.cli import EXIT_LOCAL, EXIT_USAGE, CommandError, open_ledger
from shardledger_cli.parsing import add_db_option

if TYPE_CHECKING:
    from ledger_server.signing import SigningKey

__all__ = ["DB_HELP", "require_signing_key", "serve_db_option", "served", "unless_dry_run"]

Command = Callable[[argparse.Namespace], int]

DB_HELP: Final = (
    "read this ledger itself, with no server: a SQLite file (PATH or sqlite:///PATH) or"
    " postgresql://...; opened read-only, nothing is written to it; not with --server"
    ' (docs/operations.md, "Reading a ledger without a server")'
)
# The options that name or reach a server: with --db there is none, so each is a mistake.
SERVER_OPTIONS: Final = (
    ("server", "--server"),
    ("token_file", "--token-file"),
    ("tls_ca", "--tls-ca"),
    ("tls_cert", "--tls-cert"),
    ("tls_key", "--tls-key"),
)
# AF_UNIX paths hold 107 bytes; a long $TMPDIR gets the socket under /tmp instead.
MAX_SOCKET_PATH: Final = 100


def serve_db_option(
    parser: argparse.ArgumentParser,
    func: Command,
    *,
    refuse: Callable[[argparse.Namespace], str] | None = None,
) -> None:
    """Adds --db to a read command and sets its func to run over the file when --db is given.

    refuse(args) returns why these arguments cannot run on a read-only ledger ("" when
    they can): a usage error (exit 2) before anything is opened.
    """
    group = next((g for g in parser._action_groups if g.title == "connection"), parser)
    # Not $SHARDLEDGER_DATABASE_URL: a variable set for `serve` must not turn every read
    # command away from the server (as for audit verify --db).
    add_db_option(group, required=False, env=False, help=DB_HELP)

    def run(args: argparse.Namespace) -> int:
        if not args.db:
            return func(args)
        given = [flag for name, flag in SERVER_OPTIONS if getattr(args, name, None)]
        if given:
            raise CommandError(
                f"--db and {given[0]} are mutually exclusive: --db reads the ledger itself,"
                f" with no server, and {given[0]} is for a server",
                EXIT_USAGE,
            )
        why = refuse(args) if refuse is not None else ""
        if why:
            raise CommandError(why, EXIT_USAGE)
        with served(args):
            return func(args)

    run.__doc__ = func.__doc__
    parser.set_defaults(func=run)


def unless_dry_run(does: str, dry: str, act: str) -> Callable[[argparse.Namespace], str]:
    """Returns a refuse(args) for serve_db_option: a command that writes unless --dry-run.

    does: what the command writes ("verify records a verdict on every commit it reads");
    dry: what --dry-run does instead; act: the command's writing form, for --server.
    """

    def refuse(args: argparse.Namespace) -> str:
        if args.dry_run:
            return ""
        return (
            f"{does}, and --db opens the ledger read-only: add --dry-run to {dry}, or {act}"
            " through the server that writes the ledger (`shardledger serve --db FILE`, then"
            " --server)"
        )

    return refuse


@contextmanager
def served(args: argparse.Namespace) -> Iterator[None]:
    """Serves args.db read-only for the block and points args' client at it (args.server)."""
    import grpc
    import structlog

    from ledger_server.server import configure_logging, create_read_only_server
    from ledger_server.startup import StartupError

    if not structlog.is_configured():
        # The server logs its start and stop; stdout is the command's alone.
        configure_logging("warning")
    store = open_ledger(args.db, read_only=True)  # exit 5 for a missing, empty or foreign file
    try:
        directory = _private_directory()
    except OSError as exc:
        store.close()
        raise CommandError(f"cannot create a directory for the ledger's socket: {exc}") from None
    target = f"unix:{os.path.join(directory, 'ledger.sock')}"
    try:
        running = create_read_only_server(
            store,
            database=args.db,
            listen=target,
            credentials=grpc.local_server_credentials(grpc.LocalConnectionType.UDS),
            signing_key=_signing_key(args.db),
        )
    except StartupError as exc:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)
        raise CommandError(exc.message, EXIT_USAGE if exc.usage else EXIT_LOCAL) from None
    args.server = target
    args.channel_credentials = grpc.local_channel_credentials(grpc.LocalConnectionType.UDS)
    try:
        yield
    finally:
        running.stop(0)
        import shutil

        shutil.rmtree(directory, ignore_errors=True)


def _private_directory() -> str:
    """Returns a new directory only this user may enter (mkdtemp: mode 0700)."""
    import tempfile  # a read served from --db only

    directory = tempfile.mkdtemp(prefix="shardledger-db-")
    if len(directory) + len("/ledger.sock") <= MAX_SOCKET_PATH:
        return directory
    os.rmdir(directory)
    return tempfile.mkdtemp(prefix="shardledger-db-", dir="/tmp")


def _signing_key(database: str) -> SigningKey | None:
    """Returns the ledger's signing key from beside it (never created), or None."""
    from ledger_server.config import default_key_path
    from ledger_server.startup import StartupError, existing_signing_key

    try:
        return existing_signing_key(default_key_path(database))
    except StartupError:
        return None  # only export needs it, and says so (require_signing_key)


def require_signing_key(database: str) -> None:
    """Raises CommandError (exit 5) unless the ledger's signing key lies beside it, readable."""
    from ledger_server.config import default_key_path
    from ledger_server.startup import StartupError, existing_signing_key

    path = default_key_path(database)
    try:
        key = existing_signing_key(path)
    except StartupError as exc:
        raise CommandError(f"{exc.message}: export signs the run's head with it") from None
    if key is None:
        raise CommandError(
            f"no signing key at {path}: export signs the run's head with the ledger's key,"
            " which `shardledger serve` keeps beside the ledger file; copy it there with the"
            " file (or export through a server)"
        )
