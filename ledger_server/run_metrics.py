"""Per-run Prometheus gauges, computed from the ledger's projections at each scrape.

Label cardinality is bounded: only runs updated inside the active window, plus
the K most recently updated finished runs, are exported, never every run the
ledger has ever seen.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from ledger_server.service import LedgerService
from ledger_server.states import ShardState
from ledger_server.store.base import RunRow
from ledger_server.summary import DUPLICATE_KINDS
from shard_client.vocabulary import FAILURE_TAGS

__all__ = [
    "RUN_FAMILIES",
    "SERIES_PER_RUN",
    "SHARD_STATES",
    "VERIFY_FAILED_TAG",
    "RunCollector",
    "RunExport",
]

# The same logger as the server counters: one name for everything /metrics logs.
log = structlog.get_logger("shardledger.metrics")

# The run_shards states: they partition the submitted shards (failed includes
# verify_failed, unverified is committed), so sum by (run_id) is the submitted count.
SHARD_STATES: Final = ("verified", "failed", "missing", "running", "stale", "unverified")
# verify_failed shards are exported under one tag, because verify reasons are free text.
VERIFY_FAILED_TAG: Final = "verify_failed"
_US: Final = 1_000_000


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


# The per-run families: shardledger_run_<key>{namespace, run_id[, extra label]}, all
# gauges except events_total (a counter: a run's chain only grows, and a restarted
# server reads the same value back from the store, so rate() never sees a reset).
RUN_FAMILIES: Final[dict[str, tuple[str, str | None]]] = {
    "shards": (
        "Shards by state; the states partition the submitted shards"
        " (failed includes verify_failed, unverified is committed).",
        "state",
    ),
    "submitted_shards": ("Planned shards (the sum of every state).", None),
    "failed_shards": (
        "Failed shards by failure tag (verify_failed: an artifact failed verification).",
        "tag",
    ),
    "duplicate_shards": (
        "Shards with duplicate commits, by kind (wasted, nondeterministic, zombie).",
        "kind",
    ),
    "completion_ratio": ("Verified shards over submitted shards.", None),
    "silent_error_ratio": (
        "Shards that reported success but did not verify, over submitted shards.",
        None,
    ),
    "first_pass_completion_ratio": (
        "Shards verified by an attempt of the run's first pass, over submitted shards"
        " (history: reruns never change it).",
        None,
    ),
    "first_pass_silent_error_ratio": (
        "Shards whose first pass reported success but did not verify, over submitted shards.",
        None,
    ),
    "first_pass_reconciliation_ratio": (
        "Shards verified on their very first attempt, over submitted shards.",
        None,
    ),
    "recomputed_ratio": ("Shards that ran more than once or after the first pass.", None),
    "repaired_shards": ("Shards whose rerun replaced a failed or missing result.", None),
    "numeric_shards": ("Shards whose latest attempt reported NaN or infinite metrics.", None),
    "late_attempts": ("Attempts whose events arrived late from a spool.", None),
    "oldest_heartbeat_timestamp_seconds": (
        "Unix time of the oldest last-seen among running and stale shards (absent when none).",
        None,
    ),
    "last_event_timestamp_seconds": (
        "Unix time the run's last event was received (server clock).",
        None,
    ),
    "submission_closed": (
        "1 once the planner declared the run's submission complete (plan --close).",
        None,
    ),
    "settled": (
        "1 while the run is settled: submission closed and no shard running, stale"
        " or awaiting verification.",
        None,
    ),
    "settled_timestamp_seconds": (
        "Unix time the run settled, from stored events (absent while it is not settled).",
        None,
    ),
    "events": ("Events in the run's chain.", None),
}
_COUNTERS: Final = frozenset({"events"})
# Series one exported run adds at most: a bound the docs multiply by the runs kept.
SERIES_PER_RUN: Final = (
    len(SHARD_STATES) + len(FAILURE_TAGS) + 1 + len(DUPLICATE_KINDS) + len(RUN_FAMILIES) - 3
)


def _families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
    out: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
    for key, (doc, extra) in RUN_FAMILIES.items():
        family = CounterMetricFamily if key in _COUNTERS else GaugeMetricFamily
        labels = ["namespace", "run_id", *([extra] if extra else [])]
        out[key] = family(f"shardledger_run_{key}", doc, labels=labels)
    return out


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
            families, ledger_last, counts = self._collect_runs()
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
        if ledger_last is not None:
            last = GaugeMetricFamily(
                "shardledger_ledger_last_event_timestamp_seconds",
                "Unix time the ledger last received an event (server clock).",
            )
            last.add_metric([], ledger_last)
            yield last
        took = GaugeMetricFamily(
            "shardledger_metrics_collect_duration_seconds",
            "Time the last per-run collection took.",
        )
        took.add_metric([], time.perf_counter() - started)
        yield took

    def _collect_runs(
        self,
    ) -> tuple[dict[str, GaugeMetricFamily | CounterMetricFamily], float | None, dict[str, int]]:
        now_us = self.ledger.clock()
        e = self.export
        # One more than can be exported: the newest-first order puts every active run ahead.
        rows = self.ledger.list_runs(None, limit=e.max_active_runs + e.finished_runs + 1)
        active, finished = self.select_runs(rows, now_us)
        families = _families()
        for run in (*active, *finished):
            self._add_run(families, run, now_us)
        # A timestamp, not an age: it survives restarts and `time() - x` ages it in the rule.
        ledger_last = rows[0].updated_us / _US if rows else None
        return families, ledger_last, {"active": len(active), "finished": len(finished)}

    def _add_run(
        self, f: dict[str, GaugeMetricFamily | CounterMetricFamily], run: RunRow, now_us: int
    ) -> None:
        s = self.ledger.summary(run.namespace, run.run_id, now=now_us)
        key = [run.namespace, run.run_id]
        for state in SHARD_STATES:
            f["shards"].add_metric([*key, state], float(s[state]))
        f["submitted_shards"].add_metric(key, float(s["submitted"]))
        tags: dict[str, int] = s["failure_tags"]
        for tag in FAILURE_TAGS:
            f["failed_shards"].add_metric([*key, tag], float(tags.get(tag, 0)))
        f["failed_shards"].add_metric([*key, VERIFY_FAILED_TAG], float(s["verify_failed"]))
        for kind in DUPLICATE_KINDS:
            f["duplicate_shards"].add_metric([*key, kind], float(s["duplicates"].get(kind, 0)))
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
        f["last_event_timestamp_seconds"].add_metric(key, run.updated_us / _US)
        f["events"].add_metric(key, float(run.event_count))
        life = s["lifecycle"]
        f["submission_closed"].add_metric(key, 1.0 if life["submission_closed"] else 0.0)
        f["settled"].add_metric(key, 1.0 if life["settled"] else 0.0)
        if life["settled"]:
            f["settled_timestamp_seconds"].add_metric(key, life["settled_at_us"] / _US)
        if s["running"] or s["stale"]:
            oldest = self._oldest_last_seen(run.run_pk)
            if oldest is not None:
                f["oldest_heartbeat_timestamp_seconds"].add_metric(key, oldest / _US)

    def _oldest_last_seen(self, run_pk: int) -> int | None:
        """Returns the earliest last-seen time among the run's running shards.

        A shard's last-seen time is its record's, or the heartbeat row's when a later
        heartbeat moved it (the larger of the two). Parsing every record cost ~10 µs a
        shard, 108 ms a scrape at 10,000 running shards and 450 ms under a fleet's load,
        all of it holding the GIL the appends need. A shard with a heartbeat row was
        seen at or after its `beat_us`, so those rows are taken in `beat_us` order and
        parsed only while one could still be the oldest: usually one parse.
        """
        rows = self.ledger.store.read().iter_shards(run_pk, states=[ShardState.RUNNING.value])
        oldest: int | None = None
        beats: list[tuple[int, bytes | None]] = []
        for index, row in enumerate(rows):
            if index >= self.export.heartbeat_scan_limit:
                break
            if row.beat_us is not None:
                beats.append((row.beat_us, row.record))
                continue
            seen = _last_seen_us(row.record, None)
            if seen is not None and (oldest is None or seen < oldest):
                oldest = seen
        beats.sort(key=lambda beat: beat[0])
        for beat_us, record in beats:
            if oldest is not None and beat_us >= oldest:
                break  # this shard and every later one was seen at or after `oldest`
            seen = _last_seen_us(record, beat_us)
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
