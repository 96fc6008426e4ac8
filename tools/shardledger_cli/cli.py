# Over 400 lines on purpose: the command table (80 lines), the common flags, the client and main share the exit codes and lazy imports.
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
import importlib.util
import math
import os
import sys
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, Final, Literal

from shardledger_cli.parsing import JSON_RULE, Parser

if TYPE_CHECKING:
    from ledger_server.store import Store

EXIT_OK: Final = 0
EXIT_PROBLEMS: Final = 1
EXIT_USAGE: Final = 2
EXIT_UNAVAILABLE: Final = 3
EXIT_REJECTED: Final = 4
EXIT_LOCAL: Final = 5

_C: Final = "shardledger_cli.commands."
# Every command, in --help's order: its name, the module whose register(subparsers, common)
# adds it (and sets args.func), and its help line. A run imports only the module of the
# command it names; the others stand in the parser as their name and help line, so
# `shardledger --help` and a typo's "did you mean" import no command at all
# (tests/cli/test_startup.py holds this table to what the modules register).
COMMANDS: Final = (
    ("serve", _C + "serve", "run the ledger server (embedded SQLite by default)"),
    ("plan", _C + "plan", "register a run's shards from a manifest or a directory of inputs"),
    ("status", _C + "reads", "a run's summary: submitted = verified + failed + missing + ..."),
    ("shards", _C + "reads", "list a run's shards, optionally in one state"),
    ("resume", _C + "reads", "exactly the shards that must run again"),
    ("events", _C + "reads", "print a run's events, or follow them"),
    ("runs", _C + "reads", "list runs, most recently updated first"),
    ("verify", _C + "verify", "re-read committed artifacts and record PASSED/FAILED verdicts"),
    (
        "spool",
        _C + "spool",
        "inspect or drain events kept in local spools while the ledger was unreachable",
    ),
    ("audit", _C + "audit", "verify chains and signed heads, prove events, replay the past"),
    (
        "watch",
        _C + "watch",
        "find stale attempts; with --kill-stale, diagnose and stop them (signals, scancel,"
        " kubectl, Ray) and record failed(timeout)",
    ),
    (
        "demo",
        "shardledger_cli.demo.command",
        "run a night end to end: inject every failure form, find each in the ledger, resume",
    ),
    ("token", _C + "token", "create, list and revoke access tokens"),
    ("export", _C + "export", "write a run as a self-verifying JSONL file"),
    ("import", _C + "export", "check an exported run and write it into a database"),
    (
        "archive",
        _C + "archive",
        "move settled runs' events to a directory or object store, leaving a tombstone",
    ),
    ("restore", _C + "archive", "bring an archived run back into the hot store, byte for byte"),
    (
        "trend",
        _C + "trend",
        "completion, silent errors and failure tags over recent runs; ruler drift",
    ),
    (
        "report",
        _C + "field_report",
        "a run's report (costs, checkpoint advice), the platform table by label, HTML",
    ),
    (
        "accept",
        _C + "accept",
        "five-step platform acceptance: pass or fail, with the evidence",
    ),
    (
        "sample",
        _C + "sample",
        "plan a seeded, stratified sample of a run's verified shards as a reference run",
    ),
    (
        "compare",
        _C + "compare",
        "compare a run with its reference sample; estimate the silent error rate",
    ),
    (
        "notify",
        _C + "notify",
        "post a run's report (verified / failed / missing, first pass) to a webhook",
    ),
    (
        "db",
        _C + "db",
        "database maintenance: migrate, copy SQLite to PostgreSQL, grants, rebuild projections",
    ),
    (
        "exec",
        "shardledger_cli.exec.command",
        "run any program as one attempt at a shard: started, heartbeats, atomic commits of its"
        " outputs, failed(tag) from its exit",
    ),
    ("version", _C + "meta", "print the installed version (also --version) and what it runs on"),
    ("help", _C + "meta", "print the help of a command (the same as COMMAND --help)"),
)
COMMAND_MODULES: Final = tuple(dict.fromkeys(module for _, module, _ in COMMANDS))

# Import names of the server extra's packages: the server's (see ledger_server/__init__.py),
# rich and sqlite_utils. ledger_server is not imported to learn them: without the extra it cannot be.
SERVER_EXTRA_MODULES: Final = (
    "cryptography",
    "grpc_health",
    "grpc_reflection",
    "prometheus_client",
    "rich",
    "sqlite_utils",
    "structlog",
)
INSTALL_HINT: Final = "pip install 'shardledger[server]'"

EPILOG: Final = """\
exit codes: 0 ok, 1 problems found, 2 usage, 3 server unreachable, 4 refused by server, 5 local error
`shardledger help COMMAND` (or COMMAND --help) for any command; every --help ends with examples.

Examples: a typical night
  shardledger serve &                                   # embedded SQLite ledger on 127.0.0.1:50551
  shardledger plan night-01 --manifest jobs.jsonl      # register every shard
  ... jobs run with shard_client ...
  shardledger plan night-01 --close                    # no job starts any more: it can settle
  shardledger verify night-01 --root /data/out         # re-read every committed artifact
  shardledger status night-01                          # submitted = verified + failed + missing ...
  shardledger resume night-01 -o rerun.jsonl           # exactly what must run again
  shardledger notify night-01 --url "$CHAT_HOOK"       # the morning report, as JSON
"""


class CommandError(Exception):
    """A local failure with a message for the user and an exit code."""

    def __init__(self, message: str, code: int = EXIT_LOCAL) -> None:
        super().__init__(message)
        self.code = code


def positive_seconds(text: str) -> float:
    """Returns a finite number of seconds above zero (an argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"must be a finite number of seconds above 0, not {text!r}"
        )
    return value


def at_least(minimum: int) -> Callable[[str], int]:
    """Returns an argparse type for whole numbers >= minimum, with a message that says so."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, not {value}")
        return value

    return parse


# --quiet: no progress on stderr (shardledger_cli.output.progress reads it).
QUIET = False


def common_parent() -> argparse.ArgumentParser:
    """Returns the options every client command shares."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("connection")
    group.add_argument(
        "--server",
        metavar="HOST:PORT",
        default=None,
        help="ledger address: HOST:PORT, [IPV6]:PORT, unix:PATH or dns:///HOST:PORT"
        " (default: $SHARDLEDGER_SERVER or 127.0.0.1:50551)",
    )
    group.add_argument("--namespace", default="", help="tenant namespace (default: 'default')")
    group.add_argument(
        "--timeout",
        type=positive_seconds,
        default=10.0,
        help="per-call deadline in seconds (default 10)",
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
    parent.add_argument("--json", action="store_true", help=JSON_RULE)
    parent.add_argument(
        "--quiet",
        action="store_true",
        help="no progress on stderr (by default a bar on a terminal, and a line every 10 s"
        " of long work when piped)",
    )
    return parent


def client_from(args: argparse.Namespace, *, probe: bool = True) -> Any:
    """Returns a LedgerClient for the common options.

    With probe (the default), an address where nothing listens raises LedgerUnavailable
    at once; a command that outlives ledger restarts (watch --interval, spool drain)
    passes probe=False and keeps its own retries.
    """
    from shard_client.client import LedgerClient

    local = getattr(args, "channel_credentials", None)
    if local is not None:
        # The ledger a read command serves itself from --db (local_ledger.served).
        return LedgerClient(
            args.server,
            timeout_s=args.timeout,
            retry_deadline_s=max(args.timeout, 5.0),
            credentials=local,
        )
    token = None
    if getattr(args, "token_file", None):
        try:
            with open(args.token_file) as fh:
                token = fh.read().strip()
        except OSError as exc:
            raise CommandError(
                f"cannot read token file {args.token_file}: {exc.strerror}"
            ) from None
    address = checked_address(args)
    _check_client_tls(args)
    try:
        client = LedgerClient(
            address,
            timeout_s=args.timeout,
            retry_deadline_s=max(args.timeout, 5.0),
            token=token,
            tls_ca=getattr(args, "tls_ca", None),
            tls_cert=getattr(args, "tls_cert", None),
            tls_key=getattr(args, "tls_key", None),
        )
    except (OSError, ValueError) as exc:
        raise CommandError(f"bad TLS options: {exc}") from None
    if probe:
        refuse_fast(client.target)
    return client


def checked_address(args: argparse.Namespace) -> str:
    """Returns the ledger address the options name (--server, $SHARDLEDGER_SERVER, the default).

    A malformed one (a URL, a bare port) is a usage error at once, naming the accepted
    forms (shard_client.address): gRPC would wait out the call's deadline before saying so.
    """
    from shard_client.address import AddressError, check_address
    from shard_client.client import ENV_TARGET, default_target

    given = getattr(args, "server", None)
    source = "--server" if given else f"${ENV_TARGET}" if os.environ.get(ENV_TARGET) else "address"
    try:
        return check_address(given or default_target(), source=source)
    except AddressError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None


# How long the connect probe waits: a refused or unresolvable address answers at
# once; a host that does not answer in this time may be slow, so gRPC gets --timeout.
PROBE_TIMEOUT_S: Final = 1.0


def refuse_fast(target: str) -> None:
    """Raises LedgerUnavailable at once when nothing listens at a HOST:PORT target.

    gRPC retries a refused connection with backoff until the call's deadline, and
    the CLI retries UNAVAILABLE for 5 s more: an absent server took 10 s to report.
    One TCP connect tells "nobody there" apart from "slow" without waiting for either,
    and a name that does not resolve within RESOLVE_TIMEOUT_S fails naming the name.
    Other target forms (unix:, a list of replicas) are left to gRPC.
    """
    import socket

    from shard_client.address import endpoint_of, resolve_within
    from shard_client.errors import LedgerUnavailable

    endpoint = endpoint_of(target)
    if endpoint is None:
        return
    try:
        addresses = resolve_within(endpoint.host, endpoint.port)
    except OSError as exc:
        raise LedgerUnavailable(str(exc)) from None
    refused: OSError | None = None
    for address in dict.fromkeys(addresses):  # localhost: ::1 may refuse, 127.0.0.1 listen
        try:
            with socket.create_connection((address, endpoint.port), timeout=PROBE_TIMEOUT_S):
                return
        except TimeoutError:
            return  # maybe slow, not absent: the call's own deadline decides
        except OSError as exc:
            refused = exc
    reason = (refused.strerror or str(refused)) if refused else "no address"
    raise LedgerUnavailable(f"{reason} (nothing listens on port {endpoint.port})")


def _run_hint(exc: Any, args: argparse.Namespace) -> str:
    """Returns "; did you mean RUN?" for an unknown run id, from the runs of its namespace.

    The same list `shardledger runs` shows, asked of the same ledger; when it cannot
    be asked (the ledger went away, a --db ledger already closed) the refusal stands alone.
    """
    import difflib

    from shard_client.errors import LedgerClientError

    run_id = exc.metadata.get("run_id", "")
    if not run_id or getattr(args, "channel_credentials", None) is not None:
        return ""
    try:
        client = client_from(args, probe=False)
        try:
            runs = [r.run_id for r in client.list_runs(namespace=args.namespace, page_size=1000)]
        finally:
            client.close()
    except (LedgerClientError, CommandError):
        return ""  # a hint, not the answer: the refusal above is what the user must see
    close = difflib.get_close_matches(run_id, runs, n=3, cutoff=0.6)
    listed = "`shardledger runs` lists them"
    if not close:
        return f" ({listed})"
    return f"; did you mean {' or '.join(close)}? ({listed})"


def _check_client_tls(args: argparse.Namespace) -> None:
    """Raises CommandError unless each TLS file given (flag or environment) is readable PEM.

    gRPC takes any bytes as a CA and fails only at the handshake, which reads as
    "unreachable"; a bad file is a local error, named before connecting.
    """
    files: tuple[tuple[str, str | None, str, Literal["certificate", "private key"]], ...] = (
        ("--tls-ca", getattr(args, "tls_ca", None), "SHARDLEDGER_TLS_CA", "certificate"),
        ("--tls-cert", getattr(args, "tls_cert", None), "SHARDLEDGER_TLS_CERT", "certificate"),
        ("--tls-key", getattr(args, "tls_key", None), "SHARDLEDGER_TLS_KEY", "private key"),
    )
    for option, given, env, kind in files:
        path = given or os.environ.get(env)
        if not path:
            continue
        source = option if given else f"${env}"
        from ledger_server.startup import read_pem  # cryptography: only when TLS is used

        try:
            read_pem(path, kind)
        except OSError as exc:
            raise CommandError(f"cannot read {source} {path}: {exc.strerror}") from None
        except ValueError as exc:
            raise CommandError(f"{source} {path}: {exc}") from None


def open_ledger(spec: str, *, create: bool = False, read_only: bool = False) -> Store:
    """Opens the ledger a --db names (a SQLite path, sqlite:///PATH or postgresql://...).

    A SQLite ledger must exist unless create; a new one is created only in an
    existing directory. A mistyped path otherwise becomes a new, empty ledger that
    quietly answers "nothing here", and its parents would be created on the way.
    read_only opens an existing ledger so that nothing is written (open_store).
    """
    from ledger_server.store import open_store, redact_url, sqlite_path
    from ledger_server.store.base import StoreError
    from ledger_server.store.sqlite import SqliteStore

    path = sqlite_path(spec)
    try:
        if path is None:
            return open_store(spec, read_only=read_only)
        if create and not read_only and not os.path.lexists(path):
            parent = os.path.dirname(path) or "."
            if not os.path.isdir(parent):
                raise CommandError(
                    f"cannot create a ledger at {spec}: no directory {parent} (create it first)"
                )
            return SqliteStore(path)
        if not os.path.lexists(path):
            raise CommandError(
                f"no ledger at {spec}: no such file"
                " (check --db; `shardledger serve --db PATH` creates a new ledger)"
            )
        return SqliteStore(path, must_exist=True, read_only=read_only)
    except ValueError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    except StoreError as exc:
        # The store's own refusals name the path already ("no ledger at PATH: no such file").
        text = (
            str(exc)
            if path and path in str(exc)
            else f"cannot open the ledger at {redact_url(spec)}: {exc}"
        )
        raise CommandError(text) from None


class _VersionAction(argparse.Action):
    """--version: the version line, read (importlib.metadata: tens of ms) only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(
            option_strings,
            dest,
            nargs=0,
            default=argparse.SUPPRESS,
            help="show program's version number and exit",
        )

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        from shardledger_cli.versions import version_line

        sys.stdout.write(version_line() + "\n")  # on stdout, as argparse's own action
        parser.exit()


def parser_for(argv: Sequence[str]) -> argparse.ArgumentParser:
    """Returns the parser a run with these arguments needs: only its command's module loaded.

    The command is the first argument that is not an option (the top-level parser has
    only --help and --version); `help COMMAND` loads every module, as its text needs.
    """
    word = next((a for a in argv if not a.startswith("-")), None)
    load = {module for name, module, _ in COMMANDS if name == word}
    # A help asked for anywhere (`-h status`, `status --help`) may print the whole
    # command list: the other commands stand in. A run parses its command alone.
    helping = any(a in ("-h", "--help") for a in argv)
    return build_parser(load=load, stand_ins=helping or not load)


def build_parser(
    modules: Sequence[str] = COMMAND_MODULES,
    *,
    load: Collection[str] | None = None,
    stand_ins: bool = True,
) -> argparse.ArgumentParser:
    """Returns the parser with every available command group.

    ``load``: the modules to import and register (None: all of ``modules``); every other
    command of ``modules`` is a stand-in with its name and help line (COMMANDS), enough
    for the top-level help and for choosing among the names, unless ``stand_ins`` is
    False (a run of one command: their ArgumentParsers and gettext lookups would cost a
    read a third of its start-up and change nothing it prints).
    """
    parser = Parser(
        prog="shardledger",
        description="An integrity ledger for batch GPU jobs: plan shards, record every event, "
        "verify artifacts, and get back exactly the shards that must run again.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    common = common_parent()
    for name in modules:
        if load is not None and name not in load:
            if not stand_ins:
                continue
            for command, where, line in COMMANDS:
                if where == name:
                    sub.add_parser(command, help=line, add_help=False)
            continue
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue  # a command group not built yet
            raise
        module.register(sub, common)
    _examples_last(parser)
    return parser


def _examples_last(parser: argparse.ArgumentParser) -> None:
    """Moves every Examples block of a parser's texts into one, at the very end of its help.

    Some commands wrote their examples into the description (above the options) and
    some had a second block in the epilog: --help ends with one Examples block, for
    every command and subcommand.
    """
    from shardledger_cli.parsing import EXAMPLES_HEADING

    found: list[str] = []

    def take(text: str | None) -> str:
        out: list[str] = []
        inside = False
        for line in (text or "").split("\n"):
            if line.strip() == EXAMPLES_HEADING:
                inside = True
                continue
            if inside and line.startswith("  "):
                if line not in found:
                    found.append(line)
                continue
            if inside and not line.strip():
                continue  # the blank line that closed the block
            inside = False
            out.append(line)
        return "\n".join(out).strip("\n")

    parser.description = take(parser.description) or None
    rest = take(parser.epilog)
    if found:
        block = f"{EXAMPLES_HEADING}\n" + "\n".join(found)
        parser.epilog = f"{rest}\n\n{block}" if rest else block
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _examples_last(child)


def missing_server_extra() -> list[str]:
    """Returns the import names of the server extra's packages that are not installed."""
    return [name for name in SERVER_EXTRA_MODULES if importlib.util.find_spec(name) is None]


def server_extra_message(missing: Sequence[str]) -> str:
    """Returns what a base install tells the user: which packages are missing, what to run."""
    return (
        f"shardledger: the command line needs {', '.join(missing)} (not installed): {INSTALL_HINT}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI and returns its exit code."""
    missing = missing_server_extra()
    if missing:
        print(server_extra_message(missing), file=sys.stderr)
        return EXIT_LOCAL
    words = sys.argv[1:] if argv is None else list(argv)
    parser = parser_for(words)
    if not words:
        parser.print_help()  # a bare `shardledger` asks what there is
        return EXIT_OK
    args = parser.parse_args(words)
    global QUIET
    QUIET = bool(getattr(args, "quiet", False))
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except CommandError as exc:
        print(f"shardledger: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `shardledger resume RUN | head` closes the pipe early: not an error.
        sys.stderr.close()
        return EXIT_OK
    except SystemExit as exc:
        # rich's Console answers a closed stdout with SystemExit(1) raised while handling
        # the BrokenPipeError (Console.on_broken_pipe, stdout already on /dev/null).
        if isinstance(exc.__context__, BrokenPipeError):
            return EXIT_OK
        raise
    except Exception as exc:
        code = _ledger_error_exit(exc, args)
        if code is None:
            raise
        return code


def _ledger_error_exit(exc: Exception, args: argparse.Namespace) -> int | None:
    """Says what a ledger error means and returns its exit code; None for any other error.

    The SDK's errors are imported only once the command has loaded them: an exception
    raised before they were can be none of them.
    """
    errors = sys.modules.get("shard_client.errors")
    if errors is None:
        return None
    if isinstance(exc, errors.LedgerUnavailable):
        from shard_client.client import default_target

        target = getattr(args, "server", None) or default_target()
        print(f"shardledger: ledger unreachable at {target}: {exc}", file=sys.stderr)
        print(
            "  start one with `shardledger serve` or set --server / $SHARDLEDGER_SERVER",
            file=sys.stderr,
        )
        return EXIT_UNAVAILABLE
    if isinstance(exc, errors.LedgerRejected):
        hint = _run_hint(exc, args) if exc.reason == "RUN_NOT_FOUND" else ""
        print(f"shardledger: refused ({exc.reason}): {exc}{hint}", file=sys.stderr)
        return EXIT_REJECTED
    return None
