"""Prometheus metrics: server counters on a private registry and per-run gauges read at scrape time.

Two kinds of series live here:

- ``LedgerMetrics`` counts what the server does (append latency, events
  appended and rejected, batch and group-commit sizes). The servicer and the
  ledger call its ``observe_*`` methods.
- ``RunCollector`` (run_metrics.py) turns run summaries into
  gauges when Prometheus scrapes, for a bounded set of runs.

The registry is private (not prometheus_client's global one), so two servers
in one process (tests) never collide and nothing else leaks into /metrics.
"""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from ledger_server.config import split_listen
from ledger_server.errors import LedgerError
from ledger_server.run_metrics import RunCollector, RunExport
from ledger_server.service import LedgerService
from ledger_server.store.base import StoreCommitWaitExceeded, StoreError

__all__ = [
    "CALL_REJECT_REASONS",
    "REJECT_REASONS",
    "STORE_FAULTS",
    "LedgerMetrics",
    "bind_address",
    "start_metrics_server",
    "stop_metrics_server",
]

log = structlog.get_logger("shardledger.metrics")

# Every kind of storage fault (store.base: StoreError and its subclasses' reasons).
STORE_FAULTS: Final = (
    *("STORE_UNAVAILABLE", "STORE_FULL", "STORE_IO_ERROR"),
    *("STORE_READ_ONLY", "STORE_CORRUPT", "STORE_SYNC_FAILED"),
)
# Every ErrorInfo reason the server can refuse with (ledger, store and auth).
# Anything else is counted as OTHER, so a new reason can never grow the label set.
REJECT_REASONS: Final = (
    *("INVALID_FIELD", "LIMIT_EXCEEDED", "RUN_NOT_FOUND", "EVENT_ID_REUSED", "PLAN_CONFLICT"),
    "FINGERPRINT_DIGEST_MISMATCH",
    # LIFECYCLE_VIOLATION and its precise variants (projections.check_lifecycle).
    *("LIFECYCLE_VIOLATION", "SHARD_NOT_PLANNED", "ATTEMPT_ALREADY_STARTED"),
    *("ATTEMPT_NOT_STARTED", "ATTEMPT_ENDED", "ARTIFACT_NOT_COMMITTED", "INPUT_CHANGED"),
    # The run's own life cycle (summary.check_new_shard, check_reopen).
    *("RUN_CLOSED", "RUN_NOT_CLOSED", "RUN_ARCHIVED"),
    *("LEDGER_ERROR", "SHUTTING_DOWN", "RESOURCE_EXHAUSTED", "OVERLOADED", *STORE_FAULTS),
    *("MALFORMED_REQUEST", "EVENT_NOT_FOUND", "LEDGER_CORRUPT", "SIGNING_KEY_MISSING"),
    "ARCHIVE_BROKEN",  # an archived run whose bundle differs from its tombstone (archive.py)
    "STREAMS_EXHAUSTED",  # a new append stream past --max-append-streams (stream_append.py)
    # A response that cannot hold a recorded value (servicer.built).
    "RESPONSE_FIELD_OUT_OF_RANGE",
    # Authentication and authorization refusals (auth.py), counted per call.
    *("TOKEN_MISSING", "TOKEN_MALFORMED", "TOKEN_INVALID", "TOKEN_REVOKED", "TOKEN_EXPIRED"),
    *("ROLE_FORBIDDEN", "NAMESPACE_FORBIDDEN", "RUN_PREFIX_FORBIDDEN"),
    *("UNAUTHENTICATED", "PERMISSION_DENIED", "OTHER"),
)
# The reasons shardledger_calls_rejected carries: only the interceptor's refusals of a
# call (auth.py). Exporting every append reason there too read as auth failures that
# could happen, and were never counted.
CALL_REJECT_REASONS: Final = (
    *("TOKEN_MISSING", "TOKEN_MALFORMED", "TOKEN_INVALID", "TOKEN_REVOKED", "TOKEN_EXPIRED"),
    *("ROLE_FORBIDDEN", "NAMESPACE_FORBIDDEN", "RUN_PREFIX_FORBIDDEN"),
    *("UNAUTHENTICATED", "PERMISSION_DENIED", "OTHER"),
)
COUNT_BUCKETS: Final = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 20_000)
# Appends commit in about a millisecond on a local disk, and in seconds under fsync stalls.
_SUB_SECOND: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5)
LATENCY_BUCKETS: Final = (*_SUB_SECOND, 1.0, 2.5, 5.0, 10.0)


def reason_label(reason: str) -> str:
    """Returns the bounded label value for a rejection reason."""
    return reason if reason in REJECT_REASONS else "OTHER"


class LedgerMetrics:
    """Server-side counters and histograms on a private registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.append_seconds = Histogram(
            "shardledger_append_duration_seconds",
            "Wall time of one AppendEvents call, from decode to durable commit.",
            ["result"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.events_appended = Counter(
            "shardledger_events_appended",
            "Events acknowledged (newly stored or idempotent retries).",
            registry=r,
        )
        self.events_rejected = Counter(
            "shardledger_events_rejected",
            "Events in refused batches (a refused batch writes nothing), by reason.",
            ["reason"],
            registry=r,
        )
        self.calls_rejected = Counter(
            "shardledger_calls_rejected",
            "Calls refused by authentication (TOKEN_*) or authorization (*_FORBIDDEN), by"
            " reason; appends refused for their content are shardledger_events_rejected.",
            ["reason"],
            registry=r,
        )

        def sizes(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=COUNT_BUCKETS, registry=r)

        self.batch_events = sizes(
            "shardledger_append_batch_events", "Events per AppendEvents call."
        )
        self.group_jobs = sizes(
            "shardledger_group_commit_batches", "Append batches folded into one group commit."
        )
        self.group_events = sizes(
            "shardledger_group_commit_events", "Events committed by one group commit."
        )
        self.store_write_errors = Counter(
            "shardledger_store_write_errors",
            "Appends whose write transaction failed in the store, by kind of fault.",
            ["kind"],
            registry=r,
        )
        self.store_writable = Gauge(
            "shardledger_store_writable",
            "1 while the latest write transaction committed, 0 since one failed.",
            registry=r,
        )
        self.store_writable.set(1)
        self.serving = Gauge(
            "shardledger_serving",
            "1 while health says SERVING (the store takes writes, by the last append or probe),"
            " 0 while NOT_SERVING.",
            registry=r,
        )
        self.serving.set(1)
        self.health_transitions = Counter(
            "shardledger_health_transitions",
            "Changes of the health status driven by the store, by the status changed to.",
            ["to"],
            registry=r,
        )
        self.health_changed_time = Gauge(
            "shardledger_health_last_transition_time_seconds",
            "Unix time of the latest change of the store-driven health status (0: none yet).",
            registry=r,
        )
        self.commit_wait_exceeded = Counter(
            "shardledger_store_commit_wait_exceeded",
            "Appends and probes whose COMMIT waited past --pg-commit-wait-bound (for a synchronous"
            " standby) and was cancelled, so not acknowledged; by source (append or probe).",
            ["source"],
            registry=r,
        )
        self.store_probe_failures = Counter(
            "shardledger_store_probe_failures",
            "Background probes of the store that found it unable to take a write, by kind.",
            ["kind"],
            registry=r,
        )
        self.append_streams = Gauge(
            "shardledger_append_streams",
            "StreamAppendEvents streams open now (one per job process that appends).",
            registry=r,
        )
        self.loop_lag = Gauge(
            "shardledger_event_loop_lag_seconds",
            "How late the asyncio engine's event loop runs (the least of its last probes);"
            " past --admission-loop-lag appends are refused OVERLOADED.",
            registry=r,
        )
        self.append_streams_limit = Gauge(
            "shardledger_append_streams_limit",
            "The most append streams this server holds (--max-append-streams).",
            registry=r,
        )
        self.archive_runs = Counter(
            "shardledger_archive_runs",
            "Runs this server's retention archived (serve --archive-after).",
            registry=r,
        )
        self.archive_bytes = Counter(
            "shardledger_archive_bytes",
            "Bytes of the bundles this server's retention archived.",
            registry=r,
        )
        self.archive_failures = Counter(
            "shardledger_archive_failures",
            "Archive attempts of this server's retention that failed; the run stayed hot.",
            registry=r,
        )
        self.archive_last_success = Gauge(
            "shardledger_archive_last_success_time_seconds",
            "Unix time of the latest run the retention archived (0: none yet).",
            registry=r,
        )
        self.archive_last_failure = Gauge(
            "shardledger_archive_last_failure_time_seconds",
            "Unix time of the retention's latest failed archive (0: none yet).",
            registry=r,
        )
        # Called with the store error of a failed append, or None after one that committed.
        self.on_store_write: Callable[[StoreError | None], None] | None = None
        # Every reason is exported from the start, so rate() sees 0 and not an absent series.
        for reason in REJECT_REASONS:
            self.events_rejected.labels(reason)
        for reason in CALL_REJECT_REASONS:
            self.calls_rejected.labels(reason)
        for kind in STORE_FAULTS:
            self.store_write_errors.labels(kind)
            self.store_probe_failures.labels(kind)
        for source in ("append", "probe"):
            self.commit_wait_exceeded.labels(source)
        for status in ("SERVING", "NOT_SERVING"):
            self.health_transitions.labels(status)
        # Bound once: labels() takes a lock and builds a key on every call of the hot path.
        self._append_ok = self.append_seconds.labels("ok")
        self._append_rejected = self.append_seconds.labels("rejected")

    def observe_append(self, duration_s: float, events: int, reason: str | None) -> None:
        """Records one AppendEvents call: accepted when reason is None, else refused."""
        self.batch_events.observe(events)
        if reason is None:
            self._append_ok.observe(duration_s)
            self.events_appended.inc(events)
            return
        self._append_rejected.observe(duration_s)
        self.events_rejected.labels(reason_label(reason)).inc(events)

    @contextmanager
    def timed_append(self, events: int) -> Iterator[None]:
        """Times the enclosed append and records it, with the reason when it raises."""
        start = time.perf_counter()
        try:
            yield
        except StoreError as exc:
            self.observe_append(time.perf_counter() - start, events, exc.reason)
            self.observe_store_write(exc)
            raise
        except LedgerError as exc:
            self.observe_append(time.perf_counter() - start, events, exc.reason)
            raise
        self.observe_append(time.perf_counter() - start, events, None)
        self.observe_store_write(None)

    def observe_store_write(self, error: StoreError | None) -> None:
        """Records whether an append's write transaction committed (None) or failed."""
        if error is not None:
            kind = error.reason if error.reason in STORE_FAULTS else "STORE_UNAVAILABLE"
            self.store_write_errors.labels(kind).inc()
            if isinstance(error, StoreCommitWaitExceeded):
                self.commit_wait_exceeded.labels("append").inc()
        self.store_writable.set(0 if error is not None else 1)
        if self.on_store_write is not None:
            self.on_store_write(error)

    def observe_health(self, serving: bool, at: float) -> None:
        """Records a change of the store-driven health status at unix time at."""
        self.serving.set(1 if serving else 0)
        self.health_transitions.labels("SERVING" if serving else "NOT_SERVING").inc()
        self.health_changed_time.set(at)

    def observe_probe(self, error: StoreError | None) -> None:
        """Records one background probe of the store (None: a write could commit)."""
        if error is not None:
            kind = error.reason if error.reason in STORE_FAULTS else "STORE_UNAVAILABLE"
            self.store_probe_failures.labels(kind).inc()
            if isinstance(error, StoreCommitWaitExceeded):
                self.commit_wait_exceeded.labels("probe").inc()

    def observe_archive(self, ok: bool, size_bytes: int, at: float) -> None:
        """Counts one archive the retention finished (ok) or that failed."""
        if ok:
            self.archive_runs.inc()
            self.archive_bytes.inc(size_bytes)
            self.archive_last_success.set(at)
        else:
            self.archive_failures.inc()
            self.archive_last_failure.set(at)

    def observe_group(self, jobs: int, events: int) -> None:
        """Records one group commit of jobs batches holding events events."""
        self.group_jobs.observe(jobs)
        self.group_events.observe(events)

    def observe_rejected_call(self, reason: str, *, events: int = 0) -> None:
        """Records a call refused by authentication or authorization (the interceptor's hook)."""
        self.calls_rejected.labels(reason if reason in CALL_REJECT_REASONS else "OTHER").inc()
        if events:
            self.events_rejected.labels(reason_label(reason)).inc(events)


class _QuietHandler(WSGIRequestHandler):
    """Serves a request without an access-log line, and gives up on a stalled client."""

    # The server is single-threaded: a client that connects and sends nothing must not block it.
    timeout = 10

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _IPv4Server(WSGIServer):
    """A single-threaded WSGI server.

    One thread serves every scrape on purpose: the store keeps one read
    connection per thread, so a thread per request would open (and keep) a
    new SQLite connection at every scrape.
    """

    def server_bind(self) -> None:
        """Binds without HTTPServer's reverse DNS lookup, which can stall on a host without DNS."""
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)
        self.setup_environ()


class _IPv6Server(_IPv4Server):
    address_family = socket.AF_INET6


def bind_address(listen: str) -> tuple[str, int]:
    """Returns the (host, port) /metrics binds: an empty host (":9464") is every IPv4 interface."""
    host, port = split_listen(listen, "--metrics-listen")
    return host or "0.0.0.0", port


def start_metrics_server(
    metrics: LedgerMetrics, ledger: LedgerService, listen: str, *, export: RunExport | None = None
) -> tuple[WSGIServer, int]:
    """Serves /metrics for the ledger on a background thread; returns the server and bound port."""
    metrics.registry.register(RunCollector(ledger, export))
    host, port = bind_address(listen)
    server_class = _IPv6Server if ":" in host else _IPv4Server
    httpd = make_server(
        host,
        port,
        make_wsgi_app(metrics.registry),
        server_class=server_class,
        handler_class=_QuietHandler,
    )
    bound = int(httpd.server_address[1])
    thread = threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    log.info("metrics_server_started", listen=listen, port=bound)
    return httpd, bound


def stop_metrics_server(httpd: WSGIServer) -> None:
    """Stops serving and closes the listening socket."""
    httpd.shutdown()
    httpd.server_close()
