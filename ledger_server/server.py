"""Server assembly: create_server(config) and serve() with a clean SIGTERM drain."""

from __future__ import annotations

import ipaddress
import logging
import signal
import sys
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Final

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ledger_server.interceptor import RequestInterceptor
from ledger_server.ledger import Ledger
from ledger_server.metrics import LedgerMetrics, start_metrics_server, stop_metrics_server
from ledger_server.servicer import LedgerServicer
from ledger_server.signing import SigningKey
from ledger_server.store import open_store, redact_url
from ledger_server.store.base import StoreError
from shard_client.api.shardledger.v1 import ledger_pb2, ledger_pb2_grpc

SERVICE_NAME: Final = ledger_pb2.DESCRIPTOR.services_by_name["LedgerService"].full_name
DEFAULT_LISTEN: Final = "127.0.0.1:50551"
DEFAULT_DB: Final = "ledger.db"
MAX_MESSAGE_BYTES: Final = 16 * 1024 * 1024

log = structlog.get_logger("shardledger.server")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything `shardledger serve` can set."""

    database: str = DEFAULT_DB
    listen: str = DEFAULT_LISTEN
    max_workers: int = 32
    # In-flight RPCs beyond this are refused with RESOURCE_EXHAUSTED instead
    # of queueing without bound (memory growth under overload).
    max_concurrent_rpcs: int = 256
    max_message_bytes: int = MAX_MESSAGE_BYTES
    reflection: bool = True
    insecure: bool = False
    grace_s: float = 10.0
    # Ed25519 key that signs tree heads; created on first start (default: beside the database).
    signing_key: str | None = None
    # TLS: server certificate chain and key (PEM files); with client_ca, clients must
    # present a certificate signed by it (mutual TLS).
    tls_cert: str | None = None
    tls_key: str | None = None
    client_ca: str | None = None
    # "tokens": every call but health/reflection needs a bearer token; "off": open;
    # "auto": tokens unless listening on loopback.
    auth: str = "auto"
    # Prometheus /metrics (plain HTTP): HOST:PORT, port 0 picks one; None turns it off.
    metrics_listen: str | None = None
    extra_options: tuple[tuple[str, Any], ...] = field(default_factory=tuple)


def default_key_path(database: str) -> str:
    """Returns where the signing key lives by default: beside the SQLite file."""
    path = database[len("sqlite:///") :] if database.startswith("sqlite:///") else database
    if "://" in path or path == ":memory:":
        return "shardledger-signing-key.pem"
    return path + ".signing-key.pem"


def is_loopback(listen: str) -> bool:
    """Returns whether a HOST:PORT listen address is on loopback only."""
    host = listen.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(slots=True)
class RunningServer:
    """A started server and the parts a caller may need."""

    server: grpc.Server
    port: int
    ledger: Ledger
    health: health.HealthServicer
    interceptor: RequestInterceptor
    metrics: LedgerMetrics
    metrics_http: Any = None
    metrics_port: int | None = None

    def stop(self, grace_s: float = 5.0) -> None:
        """Flips health to NOT_SERVING, drains in-flight calls, closes the database."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()
        if self.metrics_http is not None:
            stop_metrics_server(self.metrics_http)
        self.ledger.close()
        self.ledger.store.close()
        log.info("server_stopped", port=self.port)


def create_server(config: ServerConfig) -> RunningServer:
    """Builds and starts a server; returns it with the bound port."""
    tls = config.tls_cert is not None or config.tls_key is not None
    if tls and not (config.tls_cert and config.tls_key):
        raise SystemExit("TLS needs both --tls-cert and --tls-key")
    if config.client_ca and not tls:
        raise SystemExit("--client-ca (mutual TLS) needs --tls-cert and --tls-key")
    if not tls and not config.insecure and not is_loopback(config.listen):
        raise SystemExit(
            f"refusing to serve plaintext on non-loopback address {config.listen}: "
            "anyone on the network could read and write the ledger; "
            "give --tls-cert/--tls-key, or pass --insecure to accept that"
        )
    if config.auth not in ("auto", "tokens", "off"):
        raise SystemExit(f"--auth must be auto, tokens or off, not {config.auth!r}")
    credentials = _server_credentials(config) if tls else None
    store = open_store(config.database)
    try:
        store.claim_writer()  # a second server on one SQLite file refuses to start
    except StoreError as exc:
        store.close()
        raise SystemExit(f"cannot serve {redact_url(config.database)}: {exc}") from None
    metrics = LedgerMetrics()
    ledger = Ledger(store, on_group=metrics.observe_group)
    require_tokens = config.auth == "tokens" or (
        config.auth == "auto" and not is_loopback(config.listen)
    )
    interceptor = RequestInterceptor(
        tokens=store if require_tokens else None,
        clock=ledger.clock,
        on_rejected=metrics.observe_rejected_call,
    )
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        # Clients ping every 30 s (see shard_client); allow that without calls in flight.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.so_reuseport", 0),
        *config.extra_options,
    ]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix="rpc"),
        interceptors=[interceptor],
        options=options,
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
    )
    key = SigningKey.load_or_create(config.signing_key or default_key_path(config.database))
    servicer = LedgerServicer(ledger, signing_key=key, interceptor=interceptor, metrics=metrics)
    ledger_pb2_grpc.add_LedgerServiceServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if config.reflection:
        names = (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, server)
    if credentials is not None:
        port = server.add_secure_port(config.listen, credentials)
    elif is_loopback(config.listen):
        # Local credentials let clients attach bearer tokens on loopback (gRPC refuses
        # to send call credentials over a plain insecure channel); plain clients still connect.
        local = grpc.local_server_credentials(grpc.LocalConnectionType.LOCAL_TCP)
        port = server.add_secure_port(config.listen, local)
    else:
        port = server.add_insecure_port(config.listen)
    if port == 0:
        ledger.close()
        store.close()
        raise SystemExit(f"could not listen on {config.listen}: address in use or invalid")
    server.start()
    metrics_http, metrics_port = None, None
    if config.metrics_listen:
        metrics_http, metrics_port = start_metrics_server(metrics, ledger, config.metrics_listen)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "server_started",
        listen=config.listen,
        port=port,
        database=redact_url(config.database),
        tls=tls,
        mutual_tls=bool(config.client_ca),
        auth="tokens" if require_tokens else "off",
        metrics_port=metrics_port,
    )
    return RunningServer(
        server, port, ledger, health_servicer, interceptor, metrics, metrics_http, metrics_port
    )


def _server_credentials(config: ServerConfig) -> grpc.ServerCredentials:
    def read(path: str, what: str) -> bytes:
        try:
            with open(path, "rb") as fh:
                return fh.read()
        except OSError as exc:
            raise SystemExit(f"cannot read {what} {path}: {exc.strerror}") from None

    assert config.tls_cert is not None and config.tls_key is not None
    pair = (read(config.tls_key, "TLS key"), read(config.tls_cert, "TLS certificate"))
    if config.client_ca:
        return grpc.ssl_server_credentials(
            [pair], root_certificates=read(config.client_ca, "client CA"), require_client_auth=True
        )
    return grpc.ssl_server_credentials([pair])


def configure_logging(level: str = "info") -> None:
    """Sets up one-line JSON logs on stderr (the server owns logging; the SDK never does)."""
    logging.basicConfig(format="%(message)s", stream=sys.stderr, level=level.upper())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


def serve(config: ServerConfig, *, ready: Callable[[int], None] | None = None) -> int:
    """Runs a server until SIGTERM or SIGINT, then drains and exits 0."""
    running = create_server(config)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("shutdown_requested", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if ready is not None:
        ready(running.port)
    stop.wait()
    running.stop(config.grace_s)
    return 0
