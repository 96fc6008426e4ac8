"""Server assembly: create_server(config) and serve() with a clean SIGTERM drain."""

from __future__ import annotations

import ipaddress
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Final

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ledger_server.ledger import Ledger
from ledger_server.servicer import LedgerServicer
from ledger_server.signing import SigningKey
from ledger_server.store import open_store
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
    extra_options: tuple[tuple[str, Any], ...] = field(default_factory=tuple)


class RequestLogInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """Logs one structured line per request: method, code, duration."""

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None or details.method.startswith("/grpc.reflection"):
            return handler
        method = details.method

        def finish(context: grpc.ServicerContext, start: float, failed: bool) -> None:
            code = context.code() if failed else None  # type: ignore[attr-defined]
            log.info(
                "request_handled",
                method=method,
                code=(code.name if code else "UNKNOWN") if failed else "OK",
                duration_ms=round((time.perf_counter() - start) * 1000, 3),
                peer=context.peer(),
            )

        def logged(behavior: Callable[..., Any], streaming: bool) -> Callable[..., Any]:
            def unary(request: Any, context: grpc.ServicerContext) -> Any:
                start, failed = time.perf_counter(), True
                try:
                    result = behavior(request, context)
                    failed = False
                    return result
                finally:
                    finish(context, start, failed)

            def stream(request: Any, context: grpc.ServicerContext) -> Any:
                start, failed = time.perf_counter(), True
                try:
                    yield from behavior(request, context)
                    failed = False
                finally:
                    finish(context, start, failed)

            return stream if streaming else unary

        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                logged(handler.unary_unary, False),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                logged(handler.unary_stream, True),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


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

    def stop(self, grace_s: float = 5.0) -> None:
        """Flips health to NOT_SERVING, drains in-flight calls, closes the database."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()
        self.ledger.close()
        self.ledger.store.close()
        log.info("server_stopped", port=self.port)


def create_server(config: ServerConfig) -> RunningServer:
    """Builds and starts a server; returns it with the bound port."""
    if not config.insecure and not is_loopback(config.listen):
        raise SystemExit(
            f"refusing to serve plaintext on non-loopback address {config.listen}: "
            "anyone on the network could write to the ledger; pass --insecure to accept that"
        )
    store = open_store(config.database)
    ledger = Ledger(store)
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
        interceptors=[RequestLogInterceptor()],
        options=options,
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
    )
    key = SigningKey.load_or_create(config.signing_key or default_key_path(config.database))
    ledger_pb2_grpc.add_LedgerServiceServicer_to_server(
        LedgerServicer(ledger, signing_key=key), server
    )
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if config.reflection:
        names = (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port(config.listen)
    if port == 0:
        ledger.close()
        store.close()
        raise SystemExit(f"could not listen on {config.listen}: address in use or invalid")
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("server_started", listen=config.listen, port=port, database=config.database)
    return RunningServer(server, port, ledger, health_servicer)


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
