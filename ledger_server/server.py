# Over 400 lines on purpose: the server assembled in the order it starts (store and upgrade, retention, engine, bind, TLS, logging, fd limit) and serve() with its drain, read top to bottom.
"""Server assembly: create_server(config) and serve() with a clean SIGTERM drain."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import select
import signal
import socket
import sys
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Final, Literal

import grpc
import structlog
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ledger_server.admission import Admission, read_reserve
from ledger_server.aio import AioInterceptor, AioServer, health_handler, probe_loop
from ledger_server.archiver import Outcome
from ledger_server.config import ServerConfig, default_key_path
from ledger_server.framework import HEALTH_SERVICE_NAME, LedgerHealth, enable_reflection
from ledger_server.interceptor import RequestInterceptor
from ledger_server.metrics import LedgerMetrics, start_metrics_server, stop_metrics_server
from ledger_server.rebuild import RunRebuild
from ledger_server.retention import Retention, RetentionPolicy
from ledger_server.service import LedgerService
from ledger_server.signing import SigningKey
from ledger_server.startup import (
    StartupError,
    check_config,
    check_free,
    create_signing_key,
    existing_signing_key,
    is_loopback,
    open_database,
    read_pem,
)
from ledger_server.store import Store
from ledger_server.store.base import StoreError
from ledger_server.store.urls import redact_url
from ledger_server.store_health import StoreHealth, StoreProbe
from ledger_server.stream_append import StreamingServicer
from ledger_server.upgrade import stale_runs, upgrade_projections
from shard_client.api.shardledger.v1 import ledger_pb2, ledger_pb2_grpc

SERVICE_NAME: Final = ledger_pb2.DESCRIPTOR.services_by_name["LedgerService"].full_name
log = structlog.get_logger("shardledger.server")
# How long past the grace a stop may wait for grpcio before it cancels every call.
STOP_MARGIN_S: Final = 3.0
# A backstop: the main thread looks for a stop request at least this often.
WAKE_CHECK_S: Final = 1.0
# Seconds a call may wait for the polling thread before gRPC's core cancels it (see _start).
UNREQUESTED_CALL_S: Final = 5


@dataclass(slots=True)
class RunningServer:
    """A started server and the parts a caller may need."""

    server: grpc.Server | AioServer
    port: int
    ledger: LedgerService
    health: LedgerHealth
    interceptor: RequestInterceptor
    metrics: LedgerMetrics
    metrics_http: Any = None
    metrics_port: int | None = None
    probe: StoreProbe | None = None
    pool: futures.ThreadPoolExecutor | None = None  # the asyncio engine's read threads
    retention: Retention | None = None  # serve --archive-to

    def stop(self, grace_s: float = 5.0) -> None:
        """Flips health to NOT_SERVING, drains in-flight calls, closes the database."""
        self.health.enter_graceful_shutdown()
        if self.retention is not None:
            self.retention.stop()
        if self.probe is not None:
            self.probe.stop()
        # grpcio's graceful stop can wait forever on a call that never finishes (a stuck
        # stream, a framework service that failed to decode a request): the drain is
        # bounded, and then every call is cancelled so a SIGTERM always ends the process.
        if not self.server.stop(grace_s).wait(grace_s + STOP_MARGIN_S):
            log.warning("shutdown_forced", grace_s=grace_s, margin_s=STOP_MARGIN_S)
            self.server.stop(0).wait(STOP_MARGIN_S)
        _release(self.server, self.pool)
        if self.metrics_http is not None:
            stop_metrics_server(self.metrics_http)
        self.ledger.close()
        self.ledger.store.close()
        log.info("server_stopped", port=self.port)


def _log_upgrade(result: RunRebuild) -> None:
    log.info(
        "projections_upgraded",
        namespace=result.namespace,
        run_id=result.run_id,
        shards=result.shards,
        events=result.events,
        seconds=round(result.seconds, 3),
    )


def create_server(config: ServerConfig) -> RunningServer:
    """Builds and starts a server; returns it with the bound port.

    Every option is checked before the database is opened, so a refused start
    creates no ledger file; raises StartupError with a message naming the option.
    """
    check_config(config)
    tls = config.tls_cert is not None or config.tls_key is not None
    credentials = _server_credentials(config) if tls else None
    key_path = config.signing_key or default_key_path(config.database)
    key = existing_signing_key(key_path)
    check_free(config.listen, "--listen")
    if config.metrics_listen:
        check_free(config.metrics_listen, "--metrics-listen")
    store = open_database(config.database, commit_wait_bound_s=config.pg_commit_wait_bound_s)
    try:
        try:
            store.claim_writer()  # a second server on one SQLite file refuses to start
        except StoreError as exc:
            raise StartupError(f"cannot serve {redact_url(config.database)}: {exc}") from None
        if key is None:
            key = create_signing_key(key_path)
        # Records of an older format are rebuilt from their events before any write.
        upgrade_projections(store, on_run=_log_upgrade)
        metrics = LedgerMetrics()
        admission = Admission(
            delay_s=config.admission_delay_s,
            min_events=config.admission_min_events,
            max_calls=max(1, config.max_workers - read_reserve(config.max_workers)),
            # The threaded engine has no event loop to watch.
            loop_lag_s=config.admission_loop_lag_s if config.engine != "threads" else 0.0,
        )
        ledger = LedgerService(store, on_group=metrics.observe_group, admission=admission)
    except BaseException:
        store.close()
        raise
    try:
        running = _start(config, ledger, metrics, key=key, credentials=credentials)
    except BaseException:
        ledger.close()
        store.close()
        raise
    if config.archive_to:
        running.retention = _retention(config, ledger, key, metrics)
    return running


def _retention(
    config: ServerConfig, ledger: LedgerService, key: SigningKey, metrics: LedgerMetrics
) -> Retention:
    """Starts the background archive of settled runs (serve --archive-to)."""
    assert config.archive_to is not None
    policy = RetentionPolicy(
        config.archive_after_s,
        config.archive_to,
        config.archive_every_s,
        config.archive_namespaces,
    )

    def observe(outcome: Outcome) -> None:
        metrics.observe_archive(outcome.ok, outcome.size_bytes, ledger.clock() / 1e6)

    key_path = config.signing_key or default_key_path(config.database)
    retention = Retention(
        ledger, key, policy, on_outcome=observe, child=(config.database, key_path)
    )
    retention.start()
    log.info(
        "retention_started",
        archive_to=config.archive_to,
        archive_after_s=config.archive_after_s,
        archive_every_s=config.archive_every_s,
    )
    return retention


def create_read_only_server(
    store: Store,
    *,
    database: str,
    listen: str,
    credentials: grpc.ServerCredentials | None = None,
    signing_key: SigningKey | None = None,
) -> RunningServer:
    """Serves the read RPCs from a store opened read-only (open_store(url, read_only=True)).

    What `shardledger status --db FILE` (and the other read commands) talk to, so they
    answer through the same servicer, service and projections as a server. A start
    writes nothing: no writer lock is claimed, no signing key created (without one,
    the tree-head RPCs are refused) and no projections upgraded; a ledger whose shard
    records need that upgrade raises StartupError. Appends are refused by the store
    (STORE_READ_ONLY). The server owns the store from here: stop() closes it.
    """
    try:
        stale = stale_runs(store)
        if stale:
            names = ", ".join(f"{r.namespace}/{r.run_id}" for r in stale[:3])
            more = f" and {len(stale) - 3} more" if len(stale) > 3 else ""
            raise StartupError(
                f"{redact_url(database)}: the shard records of"
                f" {len(stale)} run{'s' if len(stale) != 1 else ''} ({names}{more})"
                " are of an older format, which only a rewrite from their events brings up to"
                " date, and the ledger is open read-only: run `shardledger db rebuild --db COPY`"
                " on a copy and read the copy"
            )
        metrics = LedgerMetrics()
        ledger = LedgerService(store, on_group=metrics.observe_group)
    except BaseException:
        store.close()
        raise
    config = ServerConfig(database=database, listen=listen, auth="off", reflection=False)
    try:
        return _start(config, ledger, metrics, key=signing_key, credentials=credentials)
    except BaseException:
        ledger.close()
        store.close()
        raise


def _start(
    config: ServerConfig,
    ledger: LedgerService,
    metrics: LedgerMetrics,
    *,
    key: SigningKey | None,
    credentials: grpc.ServerCredentials | None,
) -> RunningServer:
    require_tokens = config.auth == "tokens" or (
        config.auth == "auto" and not is_loopback(config.listen)
    )
    interceptor = RequestInterceptor(
        tokens=ledger.store if require_tokens else None,
        clock=ledger.clock,
        on_rejected=metrics.observe_rejected_call,
        access_log=config.access_log,
    )
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        # Clients ping every 30 s (see shard_client); allow that without calls in flight.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.so_reuseport", 0),
        # A call waits in gRPC's core until the server's one polling thread takes it; when
        # that thread is starved of the GIL (overload on few cores), core cancels calls
        # waiting longer than this (CANCELLED, which the SDK sends again). Its default,
        # 30 s, hands Python calls whose client gave up at its 10 s deadline long before.
        ("grpc.server_max_unrequested_time_in_server", UNREQUESTED_CALL_S),
        *config.extra_options,
    ]
    streams = config.max_append_streams
    if config.engine == "threads":  # a thread per stream: reads keep the rest
        streams = min(streams, max(1, config.max_workers // 4))
    servicer = StreamingServicer(
        ledger, signing_key=key, interceptor=interceptor, metrics=metrics, stream_slots=streams
    )
    slots = servicer.stream_slots
    metrics.append_streams.set_function(lambda: slots.open)
    metrics.append_streams_limit.set(slots.limit)
    health_servicer = LedgerHealth()
    server: grpc.Server | AioServer
    pool = None
    if config.engine == "threads":
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix="rpc"),
            interceptors=[interceptor],
            options=options,
            maximum_concurrent_rpcs=config.max_concurrent_rpcs,
        )
        ledger_pb2_grpc.add_LedgerServiceServicer_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        if config.reflection:
            enable_reflection((SERVICE_NAME, HEALTH_SERVICE_NAME), server)
        port = _bind(server, config.listen, credentials)
        server.start()
    else:
        pool = futures.ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix="rpc")
        server = AioServer()

        adapter = AioInterceptor(
            interceptor,
            servicer,
            pool,
            append_on_loop=config.engine == "aio",
            max_calls=config.max_concurrent_rpcs,
        )
        server.before_stop.append(adapter.end_streams)
        admission = ledger.admission
        watch_loop = admission is not None and admission.loop_lag_s > 0

        def build() -> Any:
            aio = grpc.aio.server(
                interceptors=[adapter],
                options=options,
                # Each open append stream is a call in flight for its whole life: gRPC's limit
                # leaves room for them, and the adapter holds the other calls to
                # --max-concurrent-rpcs (health always answers).
                maximum_concurrent_rpcs=config.max_concurrent_rpcs + config.max_append_streams,
            )
            ledger_pb2_grpc.add_LedgerServiceServicer_to_server(servicer, aio)
            aio.add_generic_rpc_handlers([health_handler(health_servicer)])
            if config.reflection:
                enable_reflection((SERVICE_NAME, HEALTH_SERVICE_NAME), aio)
            server.server = aio
            if watch_loop:
                assert admission is not None
                probe = asyncio.get_running_loop().create_task(probe_loop(admission.observe_loop))

                def stop_probe() -> None:
                    probe.cancel()

                server.before_stop.append(stop_probe)
                metrics.loop_lag.set_function(lambda: admission.lag_s)
            bound = _bind(aio, config.listen, credentials)
            return _started(aio, bound)

        try:
            port = server.run(build)
        except BaseException:
            server.stop(0).wait(STOP_MARGIN_S)
            _release(server, pool)
            raise
    metrics_http, metrics_port = None, None
    if config.metrics_listen:
        try:
            metrics_http, metrics_port = start_metrics_server(
                metrics, ledger, config.metrics_listen
            )
        except OSError as exc:
            server.stop(0).wait(STOP_MARGIN_S)
            _release(server, pool)
            raise StartupError(
                f"cannot serve metrics on {config.metrics_listen}: {exc.strerror};"
                " pick another --metrics-listen"
            ) from None
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    store_health = StoreHealth(
        health_servicer, ("", SERVICE_NAME), on_change=metrics.observe_health
    )
    metrics.on_store_write = store_health.observe
    probe = StoreProbe(ledger.store, store_health, interval_s=config.store_probe_interval_s)
    probe.on_probe = metrics.observe_probe
    probe.start()
    log.info(
        "server_started",
        listen=config.listen,
        port=port,
        database=redact_url(config.database),
        tls=credentials is not None,
        mutual_tls=bool(config.client_ca),
        auth="tokens" if require_tokens else "off",
        metrics_port=metrics_port,
        store_probe_interval_s=config.store_probe_interval_s,
        pg_commit_wait_bound_s=config.pg_commit_wait_bound_s,
        engine=config.engine,
    )
    return RunningServer(
        server,
        port,
        ledger,
        health_servicer,
        interceptor,
        metrics,
        metrics_http,
        metrics_port,
        probe,
        pool,
    )


def _release(server: grpc.Server | AioServer, pool: futures.ThreadPoolExecutor | None) -> None:
    """Ends what serves the calls besides gRPC (after its stop): the loop thread, the read pool."""
    if isinstance(server, AioServer):
        server.close()
    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)


async def _started(server: grpc.aio.Server, port: int) -> int:
    await server.start()
    return port


def _bind(
    server: grpc.Server | grpc.aio.Server, listen: str, credentials: grpc.ServerCredentials | None
) -> int:
    """Binds listen and returns the port, or raises StartupError."""
    try:
        if credentials is not None:
            return server.add_secure_port(listen, credentials)
        if is_loopback(listen):
            # Local credentials let clients attach bearer tokens on loopback (gRPC refuses
            # to send call credentials over a plain insecure channel); plain clients still connect.
            local = grpc.local_server_credentials(grpc.LocalConnectionType.LOCAL_TCP)
            return server.add_secure_port(listen, local)
        return server.add_insecure_port(listen)
    except RuntimeError:
        # grpcio raises a bare "Failed to bind" (older releases returned port 0).
        raise StartupError(
            f"cannot listen on {listen}: gRPC could not bind it (taken since the check,"
            " or not an address of this machine); pick another --listen"
        ) from None


def _server_credentials(config: ServerConfig) -> grpc.ServerCredentials:
    def read(path: str, kind: Literal["certificate", "private key"], option: str) -> bytes:
        try:
            return read_pem(path, kind)
        except OSError as exc:
            raise StartupError(f"cannot read {option} {path}: {exc.strerror}") from None
        except ValueError as exc:
            raise StartupError(f"{option} {path}: {exc}") from None

    assert config.tls_cert is not None and config.tls_key is not None
    key = read(config.tls_key, "private key", "--tls-key")
    chain = read(config.tls_cert, "certificate", "--tls-cert")
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    cert_key = x509.load_pem_x509_certificates(chain)[0].public_key().public_bytes(der, public)
    own_key = serialization.load_pem_private_key(key, password=None).public_key()
    if own_key.public_bytes(der, public) != cert_key:
        raise StartupError(
            f"--tls-key {config.tls_key} is not the key of --tls-cert {config.tls_cert}"
            " (the certificate's public key differs)"
        )
    if config.client_ca:
        return grpc.ssl_server_credentials(
            [(key, chain)],
            root_certificates=read(config.client_ca, "certificate", "--client-ca"),
            require_client_auth=True,
        )
    return grpc.ssl_server_credentials([(key, chain)])


LOG_FORMATS: Final = ("auto", "console", "json")


def configure_logging(level: str = "info", log_format: str = "json") -> None:
    """Sets up the server's logs on stderr (the server owns logging; the SDK never does).

    ``json``: one JSON object a line, for a collector; ``console``: structlog's
    human-readable lines; ``auto``: console on a terminal, JSON when stderr is a pipe
    or a file.
    """
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r}: expected one of {', '.join(LOG_FORMATS)}")
    if log_format == "auto":
        log_format = "console" if sys.stderr.isatty() else "json"
    renderer: structlog.typing.Processor = (
        structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        if log_format == "console"
        else structlog.processors.JSONRenderer()
    )
    logging.basicConfig(format="%(message)s", stream=sys.stderr, level=level.upper())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


def raise_fd_limit() -> int:
    """Raises the process's soft limit on open descriptors to its hard limit; returns it.

    Every client connection holds a descriptor, and many systems start a process
    at a soft limit of 1,024 while allowing far more: a ledger for a fleet of
    10,000 jobs would refuse connections past the first thousand.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        log.info("fd_limit_raised", soft=soft, now=hard)
    return hard


def serve(config: ServerConfig, *, ready: Callable[[int], None] | None = None) -> int:
    """Runs a server until SIGTERM or SIGINT, then drains and exits 0."""
    raise_fd_limit()
    running = create_server(config)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("shutdown_requested", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # The kernel hands a process's signal to any thread that does not block it, and
    # Python runs handlers only on the main thread, between bytecodes: a main thread
    # asleep on a lock (Event.wait) is not woken when another thread takes the signal,
    # and a SIGTERM was ignored for good that way (seen in CI, then made at will by
    # sending it to one of gRPC's threads with tgkill). The C-level handler writes to
    # the wakeup socket from whichever thread it runs on; the main thread waits on that.
    waker, woken = socket.socketpair()
    for end in (waker, woken):
        end.setblocking(False)
    previous = signal.set_wakeup_fd(waker.fileno(), warn_on_full_buffer=False)
    try:
        if ready is not None:
            try:
                ready(running.port)
            except BaseException:
                running.stop(0)
                raise
        while not stop.is_set():
            select.select([woken], [], [], WAKE_CHECK_S)
            with contextlib.suppress(BlockingIOError):
                while woken.recv(512):
                    pass
    finally:
        signal.set_wakeup_fd(previous)
        waker.close()
        woken.close()
    running.stop(config.grace_s)
    return 0
