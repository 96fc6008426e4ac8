"""Prometheus metrics: server counters on a private registry and per-run gauges read at scrape time.

Two kinds of series live here:

- ``LedgerMetrics`` counts what the server does (append latency, events
  appended and rejected, batch and group-commit sizes). The servicer and the
  ledger call its ``observe_*`` methods.
- ``RunCollector`` turns run summaries into gauges when Prometheus scrapes.
  Label cardinality is bounded: only runs updated inside the active window,
  plus the K most recently updated finished runs, are exported, never every
  run the ledger has ever seen.

The registry is private (not prometheus_client's global one), so two servers
in one process (tests) never collide and nothing else leaks into /metrics.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from ledger_server.config import split_listen
from ledger_server.errors import LedgerError
from ledger_server.service import LedgerService
from ledger_server.states import ShardState
from ledger_server.store.base import RunRow, StoreError
from ledger_server.summary import DUPLICATE_KINDS
from shard_client.vocabulary import FAILURE_TAGS

__all__ = [
    "REJECT_REASONS",
    "SHARD_STATES",
    "LedgerMetrics",
    "RunCollector",
    "RunExport",
    "bind_address",
    "start_metrics_server",
    "stop_metrics_server",
]

log = structlog.get_logger("shardledger.metrics")

# Every ErrorInfo reason the server can refuse with (ledger, store and auth).
# Anything else is counted as OTHER, so a new reason can never grow the label set.
REJECT_REASONS: Final = (
    *("INVALID_FIELD", "LIMIT_EXCEEDED", "RUN_NOT_FOUND", "EVENT_ID_REUSED", "PLAN_CONFLICT"),
    # LIFECYCLE_VIOLATION and its precise variants (projections.check_lifecycle).
    *("LIFECYCLE_VIOLATION", "SHARD_NOT_PLANNED", "ATTEMPT_ALREADY_STARTED"),
    *("ATTEMPT_NOT_STARTED", "ATTEMPT_ENDED", "ARTIFACT_NOT_COMMITTED"),
    *("LEDGER_ERROR", "SHUTTING_DOWN", "STORE_UNAVAILABLE", "RESOURCE_EXHAUSTED"),
    *("MALFORMED_REQUEST", "EVENT_NOT_FOUND", "LEDGER_CORRUPT", "SIGNING_KEY_MISSING"),
    # Authentication and authorization refusals (auth.py), counted per call.
    *("TOKEN_MISSING", "TOKEN_MALFORMED", "TOKEN_INVALID", "TOKEN_REVOKED", "TOKEN_EXPIRED"),
    *("ROLE_FORBIDDEN", "NAMESPACE_FORBIDDEN", "RUN_PREFIX_FORBIDDEN"),
    *("UNAUTHENTICATED", "PERMISSION_DENIED", "OTHER"),
)
# The run_shards states; "planned" counts every planned shard, the others partition it.
SHARD_STATES: Final = ("planned", "verified", "failed", "missing", "running", "stale", "unverified")
# verify_failed shards are exported under one tag, because verify reasons are free text.
VERIFY_FAILED_TAG: Final = "verify_failed"
COUNT_BUCKETS: Final = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 20_000)
# Appends commit in about a millisecond on a local disk, and in seconds under fsync stalls.
_SUB_SECOND: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5)
LATENCY_BUCKETS: Final = (*_SUB_SECOND, 1.0, 2.5, 5.0, 10.0)
_US: Final = 1_000_000


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
            "Calls refused by authentication or authorization, by reason.",
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
        # Every reason is exported from the start, so rate() sees 0 and not an absent series.
        for reason in REJECT_REASONS:
            self.events_rejected.labels(reason)
            self.calls_rejected.labels(reason)
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
        except (LedgerError, StoreError) as exc:
            reason = exc.reason if isinstance(exc, LedgerError) else "STORE_UNAVAILABLE"
            self.observe_append(time.perf_counter() - start, events, reason)
            raise
        self.observe_append(time.perf_counter() - start, events, None)

    def observe_group(self, jobs: int, events: int) -> None:
        """Records one group commit of jobs batches holding events events."""
        self.group_jobs.observe(jobs)
        self.group_events.observe(events)

    def observe_rejected_call(self, reason: str, *, events: int = 0) -> None:
        """Records a call refused by authentication or authorization (the interceptor's hook)."""
        label = reason_label(reason)
        self.calls_rejected.labels(label).inc()
        if events:
            self.events_rejected.labels(label).inc(events)


@dataclass(frozen=True, slots=True)
class RunExport:
    """Which runs get per-run series: the bound on label cardinality."""

    # Runs updated within this many seconds are active and always exported (up to the cap).
    active_window_s: float = 24 * 3600.0
    # At most this many finished runs (older than the window), most recently updated first.
    finished_runs: int = 50
    # A hard cap on active runs, so a burst of tiny runs cannot explode the series count.
    max_active_runs: int = 500
    # Running shards read per run for the heartbeat age; beyond it the age is a lower bound.
    heartbeat_scan_limit: int = 10_000


# The per-run gauges: shardledger_run_<key>{namespace, run_id[, extra label]}.
RUN_FAMILIES: Final[dict[str, tuple[str, str | None]]] = {
    "shards": (
        "Shards by state; planned counts every planned shard and the other states"
        " partition it (failed includes verify_failed, unverified is committed).",
        "state",
    ),
    "failed_by_tag": (
        "Failed shards by failure tag (verify_failed: an artifact failed verification).",
        "tag",
    ),
    "duplicates": (
        "Shards with duplicate commits, by kind (wasted, nondeterministic, zombie).",
        "kind",
    ),
    "completion_ratio": ("Verified shards over planned shards.", None),
    "silent_error_ratio": (
        "Shards that reported success but did not verify, over planned shards.",
        None,
    ),
    "first_pass_completion_ratio": (
        "Shards verified by an attempt of the run's first pass, over planned shards"
        " (history: reruns never change it).",
        None,
    ),
    "first_pass_silent_error_ratio": (
        "Shards whose first pass reported success but did not verify, over planned shards.",
        None,
    ),
    "first_pass_reconciliation_ratio": (
        "Shards verified on their very first attempt, over planned shards.",
        None,
    ),
    "recomputed_ratio": ("Shards that ran more than once or after the first pass.", None),
    "repaired_shards": ("Shards whose rerun replaced a failed or missing result.", None),
    "numeric_shards": ("Shards whose latest attempt reported NaN or infinite metrics.", None),
    "late_attempts": ("Attempts whose events arrived late from a spool.", None),
    "oldest_heartbeat_age_seconds": (
        "Age of the oldest last-seen time among running and stale shards (absent when none).",
        None,
    ),
    "last_event_age_seconds": (
        "Seconds since the run's last event was received (server clock).",
        None,
    ),
    "events_total": ("Events in the run's chain.", None),
}


def _families() -> dict[str, GaugeMetricFamily]:
    return {
        key: GaugeMetricFamily(
            f"shardledger_run_{key}",
            doc,
            labels=["namespace", "run_id", *([extra] if extra else [])],
        )
        for key, (doc, extra) in RUN_FAMILIES.items()
    }


class RunCollector(Collector):
    """Computes per-run gauges from the ledger's projections at each scrape."""

    def __init__(self, ledger: LedgerService, export: RunExport | None = None) -> None:
        self.ledger = ledger
        self.export = export if export is not None else RunExport()

    def select_runs(self, rows: list[RunRow], now_us: int) -> tuple[list[RunRow], list[RunRow]]:
        """Returns the active and the finished runs to export from runs newest first."""
        e = self.export
        cutoff = now_us - int(e.active_window_s * _US)
        active = [r for r in rows if r.updated_us >= cutoff][: e.max_active_runs]
        finished = [r for r in rows if r.updated_us < cutoff][: e.finished_runs]
        return active, finished

    def collect(self) -> Iterator[Metric]:
        """Yields every per-run family, plus the collector's own health."""
        started = time.perf_counter()
        up = GaugeMetricFamily(
            "shardledger_metrics_collect_up", "1 when the last per-run collection succeeded."
        )
        exported = GaugeMetricFamily(
            "shardledger_metrics_exported_runs", "Runs with per-run series.", labels=["kind"]
        )
        try:
            families, ledger_age, counts = self._collect_runs()
        except Exception as exc:  # a scrape must still answer, so failure is a series, not a 500
            log.error("metrics_collect_failed", error=str(exc))
            up.add_metric([], 0.0)
            yield up
            return
        up.add_metric([], 1.0)
        for kind, count in counts.items():
            exported.add_metric([kind], float(count))
        yield up
        yield exported
        yield from families.values()
        if ledger_age is not None:
            age = GaugeMetricFamily(
                "shardledger_ledger_last_event_age_seconds",
                "Seconds since the ledger received any event (server clock).",
            )
            age.add_metric([], ledger_age)
            yield age
        took = GaugeMetricFamily(
            "shardledger_metrics_collect_seconds", "Time the last per-run collection took."
        )
        took.add_metric([], time.perf_counter() - started)
        yield took

    def _collect_runs(self) -> tuple[dict[str, GaugeMetricFamily], float | None, dict[str, int]]:
        now_us = self.ledger.clock()
        e = self.export
        # One more than can be exported: the newest-first order puts every active run ahead.
        rows = self.ledger.list_runs(None, limit=e.max_active_runs + e.finished_runs + 1)
        active, finished = self.select_runs(rows, now_us)
        families = _families()
        for run in (*active, *finished):
            self._add_run(families, run, now_us)
        ledger_age = max(0.0, (now_us - rows[0].updated_us) / _US) if rows else None
        return families, ledger_age, {"active": len(active), "finished": len(finished)}

    def _add_run(self, f: dict[str, GaugeMetricFamily], run: RunRow, now_us: int) -> None:
        s = self.ledger.summary(run.namespace, run.run_id, now=now_us)
        key = [run.namespace, run.run_id]
        for state in SHARD_STATES:
            # Each state is the summary key of the same name, except the total.
            value = s["submitted"] if state == "planned" else s[state]
            f["shards"].add_metric([*key, state], float(value))
        tags: dict[str, int] = s["failure_tags"]
        for tag in FAILURE_TAGS:
            f["failed_by_tag"].add_metric([*key, tag], float(tags.get(tag, 0)))
        f["failed_by_tag"].add_metric([*key, VERIFY_FAILED_TAG], float(s["verify_failed"]))
        for kind in DUPLICATE_KINDS:
            f["duplicates"].add_metric([*key, kind], float(s["duplicates"].get(kind, 0)))
        f["completion_ratio"].add_metric(key, float(s["completion_rate"]))
        f["silent_error_ratio"].add_metric(key, float(s["silent_error_rate"]))
        fp = s["first_pass"]
        f["first_pass_completion_ratio"].add_metric(key, float(fp["completion_rate"]))
        f["first_pass_silent_error_ratio"].add_metric(key, float(fp["silent_error_rate"]))
        f["first_pass_reconciliation_ratio"].add_metric(key, float(fp["reconciliation_rate"]))
        f["recomputed_ratio"].add_metric(key, float(s["recomputed_rate"]))
        f["repaired_shards"].add_metric(key, float(s["repairs"]))
        f["numeric_shards"].add_metric(key, float(s["numeric"]))
        f["late_attempts"].add_metric(key, float(s["late_attempts"]))
        f["last_event_age_seconds"].add_metric(key, max(0.0, (now_us - run.updated_us) / _US))
        f["events_total"].add_metric(key, float(run.event_count))
        if s["running"] or s["stale"]:
            oldest = self._oldest_last_seen(run.run_pk)
            if oldest is not None:
                f["oldest_heartbeat_age_seconds"].add_metric(key, max(0.0, (now_us - oldest) / _US))

    def _oldest_last_seen(self, run_pk: int) -> int | None:
        """Returns the earliest last-seen time among the run's running shards."""
        rows = self.ledger.store.read().iter_shards(run_pk, states=[ShardState.RUNNING.value])
        oldest: int | None = None
        for index, row in enumerate(rows):
            if index >= self.export.heartbeat_scan_limit:
                break
            seen = _last_seen_us(row.record, row.beat_us)
            if seen is not None and (oldest is None or seen < oldest):
                oldest = seen
        return oldest


def _last_seen_us(record: bytes | None, beat_us: int | None) -> int | None:
    # json.loads of the stored record, not ShardRecord.from_json: only one field is needed.
    # A heartbeat after the record was written moved beat_us instead (see record_from_row).
    if record is None:
        return None
    data: dict[str, Any] = json.loads(record)
    attempt = data["attempts"].get(data["latest_attempt"])
    if not attempt:
        return None
    return max(int(attempt["last_seen_us"]), beat_us if beat_us is not None else 0)


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
