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
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from ledger_server.service import LedgerService
from ledger_server.states import ShardState
from ledger_server.store.base import RunRow
from ledger_server.summary import DUPLICATE_KINDS
from shard_client.vocabulary import FAILURE_TAGS

__all__ = ["RUN_FAMILIES", "SHARD_STATES", "VERIFY_FAILED_TAG", "RunCollector", "RunExport"]

# The same logger as the server counters: one name for everything /metrics logs.
log = structlog.get_logger("shardledger.metrics")

# The run_shards states, named as the run summary names them: "submitted" counts every
# planned shard, the others partition it. "planned" is the old name of "submitted",
# exported beside it for one release so dashboards can move (docs/concepts.md).
SHARD_STATES: Final = (
    "submitted",
    "verified",
    "failed",
    "missing",
    "running",
    "stale",
    "unverified",
    "planned",
)
_TOTALS: Final = frozenset({"submitted", "planned"})
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


# The per-run gauges: shardledger_run_<key>{namespace, run_id[, extra label]}.
RUN_FAMILIES: Final[dict[str, tuple[str, str | None]]] = {
    "shards": (
        "Shards by state; submitted counts every planned shard and the other states"
        " partition it (failed includes verify_failed; planned: the old name of submitted).",
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
            value = s["submitted"] if state in _TOTALS else s[state]
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
