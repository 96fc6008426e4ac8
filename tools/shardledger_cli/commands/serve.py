"""`shardledger serve`: run the ledger server."""

from __future__ import annotations

import argparse
import math
import os
import sys

from ledger_server.config import DEFAULT_DB, DEFAULT_LISTEN, ENGINES, ServerConfig
from ledger_server.server import LOG_FORMATS, configure_logging, serve
from ledger_server.startup import StartupError
from ledger_server.store import redact_url
from shardledger_cli.cli import EXIT_LOCAL, EXIT_USAGE, CommandError
from shardledger_cli.parsing import DefaultsHelpFormatter, add_db_option, examples, whole_number

positive_int = whole_number(1)  # an argparse type: an int of at least 1


def _duration(text: str) -> float:
    from ledger_server.retention import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _namespace_policy(text: str) -> tuple[str, float | None]:
    from ledger_server.retention import parse_namespace_policy

    try:
        return parse_namespace_policy(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def non_negative_seconds(text: str) -> float:
    """Returns a finite number of seconds >= 0 (an argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, not {text!r}")
    return value


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """Adds the serve command."""
    p = sub.add_parser(
        "serve",
        epilog=examples(
            "shardledger serve                                  # ./ledger.db on 127.0.0.1:50551",
            "shardledger serve --db /srv/ledger/ledger.db --listen 0.0.0.0:50551 --tls-cert server.pem --tls-key server.key",
            "shardledger serve --db postgresql://ledger@db/ledger --metrics-listen 0.0.0.0:9464",
            "shardledger serve --listen 127.0.0.1:0 --port-file port.txt &   # a free port, written to port.txt",
        ),
        help="run the ledger server (embedded SQLite by default)",
        description="Run the gRPC ledger server. With no flags it stores events in ./ledger.db "
        "and listens on 127.0.0.1:50551. SIGTERM flips health to NOT_SERVING, drains in-flight "
        "calls and closes the database cleanly.",
        formatter_class=DefaultsHelpFormatter,
    )
    add_db_option(
        p,
        default=DEFAULT_DB,
        help="a SQLite file (or sqlite:///PATH), created when new in an existing directory,"
        " one server per file; or postgresql://USER@HOST/DB, whose replicas must share"
        " --signing-key",
    )
    p.add_argument(
        "--listen", default=DEFAULT_LISTEN, help="HOST:PORT to listen on (port 0 picks one)"
    )
    p.add_argument(
        "--max-workers",
        type=positive_int,
        default=1024,
        help="threads that run reads (and appends, with --engine threads or aio-executor);"
        " appends waiting for a commit are never more than three quarters of this many, so"
        " reads keep the last quarter",
    )
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default=ENGINES[0],
        help="what serves the calls: aio (grpc.aio; one event loop takes every call and"
        " awaits each append's group commit, reads run on --max-workers threads),"
        " aio-executor (the same, appends on those threads too), threads (grpcio's threaded"
        " server: every call on a thread of its own)",
    )
    p.add_argument(
        "--admission-delay",
        type=non_negative_seconds,
        default=2.0,
        metavar="SECONDS",
        help="admit appends while the events waiting for the group commit take at most this"
        " long at its measured rate (and within the handler threads appends may hold); refuse"
        " the rest at once with RESOURCE_EXHAUSTED, reason OVERLOADED and a RetryInfo delay;"
        " 0 admits every append",
    )
    p.add_argument(
        "--admission-loop-lag",
        type=non_negative_seconds,
        default=0.25,
        metavar="SECONDS",
        help="asyncio engines: while the event loop runs this late over several probes in a"
        " row (calls waiting on the loop, where the commit queue cannot see them), refuse"
        " appends the same way (OVERLOADED, with a RetryInfo delay); 0 does not watch the"
        " loop",
    )
    p.add_argument(
        "--admission-min-events",
        type=positive_int,
        default=1000,
        metavar="N",
        help="events the commit queue always admits, whatever its measured rate (two of the"
        " SDK's full batches)",
    )
    p.add_argument(
        "--max-concurrent-rpcs",
        type=positive_int,
        default=2048,
        help="the last resort behind admission: RPCs in flight beyond this (reads too) get"
        " RESOURCE_EXHAUSTED from gRPC, with no delay",
    )
    p.add_argument(
        "--max-append-streams",
        type=positive_int,
        default=20_000,
        help="StreamAppendEvents streams held at once (one per job process that appends);"
        " past it a new one is refused STREAMS_EXHAUSTED and the SDK sends unary"
        " (the threaded engine holds at most a quarter of --max-workers)",
    )
    p.add_argument(
        "--no-reflection", action="store_true", help="do not serve gRPC server reflection"
    )
    p.add_argument(
        "--insecure", action="store_true", help="allow plaintext on a non-loopback address"
    )
    p.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        default=None,
        help="serve Prometheus /metrics on this address (plain HTTP; port 0 picks one)",
    )
    tls = p.add_argument_group("TLS and authentication")
    tls.add_argument(
        "--tls-cert",
        default=os.environ.get("SHARDLEDGER_TLS_SERVER_CERT"),
        help="server certificate chain (PEM; env SHARDLEDGER_TLS_SERVER_CERT)",
    )
    tls.add_argument(
        "--tls-key",
        default=os.environ.get("SHARDLEDGER_TLS_SERVER_KEY"),
        help="server private key (PEM; env SHARDLEDGER_TLS_SERVER_KEY)",
    )
    tls.add_argument(
        "--client-ca",
        default=os.environ.get("SHARDLEDGER_TLS_CLIENT_CA"),
        help="require client certificates signed by this CA: mutual TLS (env SHARDLEDGER_TLS_CLIENT_CA)",
    )
    tls.add_argument(
        "--auth",
        choices=["auto", "tokens", "off"],
        default="auto",
        help="tokens: every call but health/reflection needs a bearer token (see `shardledger token`); "
        "auto: tokens unless listening on loopback",
    )
    tls.add_argument(
        "--signing-key",
        default=None,
        help="ed25519 key that signs tree heads (default: DB.signing-key.pem)",
    )
    p.add_argument(
        "--grace",
        type=non_negative_seconds,
        default=10.0,
        help="seconds to drain in-flight calls on SIGTERM",
    )
    p.add_argument(
        "--store-probe-interval",
        type=non_negative_seconds,
        default=1.0,
        metavar="SECONDS",
        help="seconds between background checks that the database takes writes (health"
        " follows them; every 0.25 s while it does not)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="info: start, stop and problems; debug adds one request_handled line per call",
    )
    p.add_argument(
        "--log-format",
        default="auto",
        choices=LOG_FORMATS,
        help="console: readable lines; json: one JSON object a line; auto (default): console"
        " on a terminal, json when stderr is a pipe or a file",
    )
    p.add_argument(
        "--access-log",
        action="store_true",
        help="log every handled call (request_handled: method, code, duration, peer, token id)"
        " at info",
    )
    retention = p.add_argument_group(
        "retention",
        "archive settled runs in the background (`shardledger archive`, docs/operations.md"
        ' "Retention and archive")',
    )
    retention.add_argument(
        "--archive-to",
        metavar="URL",
        default=None,
        help="archive settled runs here: a directory or an fsspec URL (s3://BUCKET/PREFIX);"
        " off when not given",
    )
    retention.add_argument(
        "--archive-after",
        metavar="DURATION",
        type=_duration,
        default=7 * 86400.0,
        help="archive a run this long after it settled: 7d, 12h, 30m, 90s (default 7d)",
    )
    retention.add_argument(
        "--archive-namespace",
        metavar="NS=DURATION",
        type=_namespace_policy,
        action="append",
        default=[],
        help="another --archive-after for one namespace, or NS=never to keep its runs hot;"
        " repeat for more",
    )
    retention.add_argument(
        "--archive-every",
        metavar="DURATION",
        type=_duration,
        default=60.0,
        help="look for a run to archive this often; one run per look (default 60s)",
    )
    p.add_argument(
        "--pg-commit-wait-bound",
        type=non_negative_seconds,
        default=5.0,
        metavar="SECONDS",
        help="PostgreSQL: cancel a COMMIT still waiting for its synchronous standby after"
        " this long, answer its appends UNAVAILABLE (clients resend; event ids make that"
        " safe), go NOT_SERVING and refuse appends until a probe's write commits in time"
        " (0: no bound, a COMMIT may wait forever)",
    )
    p.add_argument(
        "--port-file", default=None, help="write the bound port to this file once serving"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Runs the server until SIGTERM."""
    if args.port_file:
        check_port_file(args.port_file)
    configure_logging(args.log_level, args.log_format)
    database = args.db
    config = ServerConfig(
        database=database,
        listen=args.listen,
        max_workers=args.max_workers,
        engine=args.engine,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        max_append_streams=args.max_append_streams,
        admission_delay_s=args.admission_delay,
        admission_loop_lag_s=args.admission_loop_lag,
        admission_min_events=args.admission_min_events,
        reflection=not args.no_reflection,
        insecure=args.insecure,
        grace_s=args.grace,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        client_ca=args.client_ca,
        auth=args.auth,
        signing_key=args.signing_key,
        metrics_listen=args.metrics_listen,
        store_probe_interval_s=args.store_probe_interval,
        access_log=args.access_log,
        archive_to=args.archive_to,
        archive_after_s=args.archive_after,
        archive_every_s=args.archive_every,
        archive_namespaces=tuple(args.archive_namespace),
        pg_commit_wait_bound_s=args.pg_commit_wait_bound,
    )

    def ready(port: int) -> None:
        print(
            f"shardledger serving on {args.listen.rsplit(':', 1)[0]}:{port}"
            f" (db {redact_url(database)})",
            file=sys.stderr,
        )
        if args.port_file:
            try:
                with open(args.port_file + ".tmp", "w") as fh:
                    fh.write(str(port))
                os.replace(args.port_file + ".tmp", args.port_file)
            except OSError as exc:
                raise CommandError(
                    f"cannot write --port-file {args.port_file}: {exc.strerror}; the server stopped"
                ) from None

    try:
        return serve(config, ready=ready)
    except StartupError as exc:
        raise CommandError(exc.message, EXIT_USAGE if exc.usage else EXIT_LOCAL) from None


def check_port_file(path: str) -> None:
    """Raises CommandError unless the port can be written to path (checked before binding)."""
    parent = os.path.dirname(path) or "."
    if os.path.isdir(path):
        raise CommandError(f"--port-file {path} is a directory: give a file path inside it")
    if not os.path.isdir(parent):
        raise CommandError(f"--port-file {path}: no directory {parent}")
    if not os.access(parent, os.W_OK):
        raise CommandError(f"--port-file {path}: cannot write in {parent}")
