"""What `shardledger serve` can set, with the defaults it starts from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

from ledger_server.store.urls import sqlite_path

DEFAULT_DB: Final = "ledger.db"
DEFAULT_LISTEN: Final = "127.0.0.1:50551"
MAX_MESSAGE_BYTES: Final = 16 * 1024 * 1024
# What serves the calls (ServerConfig.engine); the first is the default.
ENGINES: Final = ("aio", "aio-executor", "threads")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything `shardledger serve` can set."""

    database: str = DEFAULT_DB
    listen: str = DEFAULT_LISTEN
    # Handler threads. An admitted append holds one until its group commits; appends
    # never take the last quarter (admission.read_reserve), which reads keep.
    max_workers: int = 1024
    # Appends wait for the committer at most this long at its measured rate; beyond it,
    # and beyond the threads appends may hold, they are refused at once with
    # RESOURCE_EXHAUSTED (OVERLOADED) and a RetryInfo delay (admission.py). 0 admits all.
    admission_delay_s: float = 2.0
    # The asyncio engines: while the event loop runs this late over several probes in a
    # row (a standing queue of messages that admission's queue cannot see), appends are
    # refused the same way (admission.py). 0 does not watch the loop.
    admission_loop_lag_s: float = 0.25
    # The queue always admits this many events (two of the SDK's full batches), also
    # before a commit has measured the rate.
    admission_min_events: int = 1000
    # The last resort behind admission: gRPC refuses every RPC (reads too) beyond this
    # many in flight, RESOURCE_EXHAUSTED without a delay, before any handler runs.
    # Above max_workers, so that admission acts first; bounded, so that memory is.
    max_concurrent_rpcs: int = 2048
    # StreamAppendEvents streams held open at once (one per job process that appends);
    # past it a new stream is refused RESOURCE_EXHAUSTED STREAMS_EXHAUSTED and the SDK
    # sends unary. The asyncio engines let gRPC hold this many calls on top of
    # max_concurrent_rpcs; the threaded engine holds a thread per stream, so it takes at
    # most a quarter of max_workers.
    max_append_streams: int = 20_000
    max_message_bytes: int = MAX_MESSAGE_BYTES
    # "aio": grpc.aio, appends awaited on the event loop, reads on max_workers threads;
    # "aio-executor": the same with appends on those threads too; "threads": grpcio's
    # threaded server, every call on one of max_workers threads (ledger_server/aio.py).
    engine: str = "aio"
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
    # Seconds between background probes of the store while it takes writes (health follows
    # them); while it fails the probe runs every 0.25 s (store.base.PROBE_RETRY_S).
    store_probe_interval_s: float = 1.0
    # One info line per handled call (request_handled); otherwise they are debug lines.
    access_log: bool = False
    # Retention (ledger_server/retention.py): runs settled more than archive_after_s ago
    # are archived under archive_to (a directory or fsspec URL), one per archive_every_s.
    archive_to: str | None = None
    archive_after_s: float = 7 * 86400.0
    archive_every_s: float = 60.0
    # Per namespace: (namespace, seconds), or (namespace, None) to keep its runs hot.
    archive_namespaces: tuple[tuple[str, float | None], ...] = ()
    # PostgreSQL: a COMMIT still waiting (for its synchronous standby) after this many
    # seconds is cancelled and not acknowledged; the replica reports it and refuses calls
    # with UNAVAILABLE until a probe's write commits in time (store/pg_commit.py). 0: no
    # bound (a COMMIT may wait forever). Equal to postgres.DEFAULT_COMMIT_WAIT_BOUND_S.
    pg_commit_wait_bound_s: float = 5.0
    extra_options: tuple[tuple[str, Any], ...] = field(default_factory=tuple)


def default_key_path(database: str) -> str:
    """Returns where the signing key lives by default: beside the SQLite file."""
    path = sqlite_path(database)
    if path is None or path == ":memory:":
        return "shardledger-signing-key.pem"
    return path + ".signing-key.pem"


def split_listen(listen: str, option: str = "--listen") -> tuple[str, int]:
    """Returns (host, port) of a HOST:PORT address, or raises ValueError naming the option.

    An empty host (":9464") means every interface.
    """
    host, sep, port = listen.rpartition(":")
    bare = host.strip("[]")
    if not sep or not port.isdigit() or (":" in bare and host != f"[{bare}]"):
        raise ValueError(
            f"{option} {listen!r} is not HOST:PORT (e.g. 127.0.0.1:50551, [::1]:0;"
            " IPv6 addresses go in brackets)"
        )
    if int(port) > 65535:
        raise ValueError(
            f"{option} {listen}: port {port} is out of range 0-65535 (0 picks a free one)"
        )
    return bare, int(port)
