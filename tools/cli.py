"""The `shardledger` command line: one entry point, one module per command group.

Exit codes (stable, for scripts):
    0  success, and the answer is "all good" where a command judges
    1  the command worked and found problems (unconfirmed shards, failed verification, ...)
    2  usage error: bad flags or arguments (argparse's own code)
    3  the ledger server could not be reached
    4  the server refused the request (not found, invalid, conflict, ...)
    5  a local failure (file not found, unreadable manifest, ...)
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Final

from shard_client.errors import LedgerRejected, LedgerUnavailable

EXIT_OK: Final = 0
EXIT_PROBLEMS: Final = 1
EXIT_USAGE: Final = 2
EXIT_UNAVAILABLE: Final = 3
EXIT_REJECTED: Final = 4
EXIT_LOCAL: Final = 5

# Each module defines register(subparsers, common) and sets args.func.
COMMAND_MODULES: Final = (
    "tools.cmd_serve",
    "tools.cmd_plan",
    "tools.cmd_report",
    "tools.cmd_verify",
    "tools.cmd_spool",
    "tools.cmd_audit",
    "tools.cmd_watch",
    "tools.cmd_demo",
    "tools.cmd_token",
    "tools.cmd_export",
    "tools.cmd_trend",
    "tools.cmd_db",
)

EPILOG: Final = """\
typical night:
  shardledger serve &                                   # embedded SQLite ledger on 127.0.0.1:50551
  shardledger plan night-01 --manifest jobs.jsonl      # register every shard
  ... jobs run with shard_client ...
  shardledger verify night-01 --root /data/out         # re-read every committed artifact
  shardledger status night-01                          # submitted = verified + failed + missing ...
  shardledger resume night-01 -o rerun.jsonl           # exactly what must run again

exit codes: 0 ok, 1 problems found, 2 usage, 3 server unreachable, 4 refused by server, 5 local error
"""


class CommandError(Exception):
    """A local failure with a message for the user and an exit code."""

    def __init__(self, message: str, code: int = EXIT_LOCAL) -> None:
        super().__init__(message)
        self.code = code


def common_parent() -> argparse.ArgumentParser:
    """Returns the options every client command shares."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("connection")
    group.add_argument(
        "--server",
        metavar="HOST:PORT",
        default=None,
        help="ledger address (default: $SHARDLEDGER_SERVER or 127.0.0.1:50551)",
    )
    group.add_argument("--namespace", default="", help="tenant namespace (default: 'default')")
    group.add_argument(
        "--timeout", type=float, default=10.0, help="per-call deadline in seconds (default 10)"
    )
    group.add_argument(
        "--token-file",
        metavar="FILE",
        default=None,
        help="file holding a bearer token (default: $SHARDLEDGER_TOKEN); never pass tokens as arguments",
    )
    group.add_argument(
        "--tls-ca", metavar="PEM", default=None, help="CA to trust (default: $SHARDLEDGER_TLS_CA)"
    )
    group.add_argument(
        "--tls-cert", metavar="PEM", default=None, help="client certificate for mutual TLS"
    )
    group.add_argument("--tls-key", metavar="PEM", default=None, help="client key for mutual TLS")
    parent.add_argument(
        "--json", action="store_true", help="print machine-readable JSON instead of text"
    )
    return parent


def client_from(args: argparse.Namespace) -> Any:
    """Returns a LedgerClient for the common options."""
    from shard_client.client import LedgerClient

    token = None
    if getattr(args, "token_file", None):
        try:
            with open(args.token_file) as fh:
                token = fh.read().strip()
        except OSError as exc:
            raise CommandError(
                f"cannot read token file {args.token_file}: {exc.strerror}"
            ) from None
    try:
        return LedgerClient(
            args.server,
            timeout_s=args.timeout,
            retry_deadline_s=max(args.timeout, 5.0),
            token=token,
            tls_ca=getattr(args, "tls_ca", None),
            tls_cert=getattr(args, "tls_cert", None),
            tls_key=getattr(args, "tls_key", None),
        )
    except (OSError, ValueError) as exc:
        raise CommandError(f"bad TLS options: {exc}") from None


def progress(label: str, total: int) -> AbstractContextManager[Callable[[int], None]]:
    """Returns a context yielding advance(n): a rich progress bar when stderr is a terminal."""
    if not sys.stderr.isatty() or total < 2:
        return nullcontext(lambda n: None)

    @contextmanager
    def bar() -> Iterator[Callable[[int], None]]:
        from rich.console import Console
        from rich.progress import Progress

        with Progress(console=Console(stderr=True), transient=True) as shown:
            task = shown.add_task(label, total=total)
            yield lambda n: shown.advance(task, n)

    return bar()


def print_json(value: Any) -> None:
    """Prints one JSON document on stdout."""
    sys.stdout.write(json.dumps(value, indent=2, sort_keys=True) + "\n")


def build_parser(modules: Sequence[str] = COMMAND_MODULES) -> argparse.ArgumentParser:
    """Returns the full parser with every available command group."""
    parser = argparse.ArgumentParser(
        prog="shardledger",
        description="An integrity ledger for batch GPU jobs: plan shards, record every event, "
        "verify artifacts, and get back exactly the shards that must run again.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    common = common_parent()
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue  # a command group not built yet
            raise
        module.register(sub, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI and returns its exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except LedgerUnavailable as exc:
        print(
            f"shardledger: ledger unreachable at {getattr(args, 'server', None) or 'default'}: {exc}",
            file=sys.stderr,
        )
        print(
            "  start one with `shardledger serve` or set --server / $SHARDLEDGER_SERVER",
            file=sys.stderr,
        )
        return EXIT_UNAVAILABLE
    except LedgerRejected as exc:
        print(f"shardledger: refused ({exc.reason}): {exc}", file=sys.stderr)
        return EXIT_REJECTED
    except CommandError as exc:
        print(f"shardledger: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `shardledger resume RUN | head` closes the pipe early: not an error.
        sys.stderr.close()
        return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
