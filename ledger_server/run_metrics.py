"""Per-run Prometheus gauges, computed from the ledger's projections at each scrape.

Label cardinality is bounded: only runs updated inside the active window, plus
the K most recently updated finished runs, are exported, never every run the
ledger has ever seen. The field figures (GPU time by cost bucket, first pass by
the well-known labels) keep at most `RunExport.max_label_values` values of each
label per run, the rest summed as "(other)".
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from ledger_server import field
from ledger_server.service import LedgerService, counters_at
from ledger_server.states import PARTITION
from ledger_server.store.base import RunRow
from ledger_server.summary import DUPLICATE_KINDS
from shard_client.labels import WELL_KNOWN_LABELS
from shard_client.vocabulary import FAILURE_TAGS

__all__ = [
    "FIRST_PASS_FIGURES",
    "OTHER_VALUE",
    "RUN_FAMILIES",
    "SERIES_PER_LABEL_VALUE",
    "SERIES_PER_RUN",
    "SHARD_STATES",
    "VERIFY_FAILED_TAG",
    "RunCollector",
    "RunExport",
]

# The same logger as the server counters: one name for everything /metrics logs.
log = structlog.get_logger("shardledger.metrics")

# The run_shards states, each the set `shardledger shards --state NAME` lists: they
# partition the submitted shards (failed is a loud failure, verify_failed an artifact
# that failed verification, unverified is committed), so sum by (run_id) is the
# submitted count.
SHARD_STATES: Final = PARTITION
# verify_failed shards are exported under one tag, because verify reasons are free text.
VERIFY_FAILED_TAG: Final = "verify_failed"
# CompareRuns' integer figures, exported per value of each well-known label. hangs and
# reclaims count first-pass attempts, truncations count outputs, the rest count shards.
FIRST_PASS_FIGURES: Final = (
    "shards",
    "first_pass_verified",
    "first_attempt_verified",
    "silent_errors",
    "missing",
    "hangs",
    "reclaims",
    "truncations",
)
# The label values past RunExport.max_label_values, summed (a run's "(none)" is kept:
# it is the shards without the label, which no other value could hold).
OTHER_VALUE: Final = "(other)"
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
    # Values of each well-known label exported per run, most shards first; the rest are
    # summed as "(other)". 0 exports no per-label series.
    max_label_values: int = 10

    def series_per_run(self) -> int:
        """Returns the most series one exported run can have, its label values included."""
        values = self.max_label_values + 2 if self.max_label_values > 0 else 0  # (none), (other)
        return SERIES_PER_RUN + len(WELL_KNOWN_LABELS) * values * SERIES_PER_LABEL_VALUE


# The per-run families: shardledger_run_<key>{namespace, run_id, *extra labels}, all
# gauges except events_total (a counter: a run's chain only grows, and a restarted
# server reads the same value back from the store, so rate() never sees a reset).
RUN_FAMILIES: Final[dict[str, tuple[str, tuple[str, ...]]]] = {
    "shards": (
        "Shards by state, each the set `shards --state` lists; the states partition the"
        " submitted shards (failed: a loud failure; verify_failed: an artifact failed"
        " verification; unverified: committed, not yet verified).",
        ("state",),
    ),
    "submitted_shards": ("Planned shards (the sum of every state).", ()),
    "failed_shards": (
        "Failed shards by failure tag (verify_failed: an artifact failed verification).",
        ("tag",),
    ),
    "duplicate_shards": (
        "Shards with duplicate commits, by kind (wasted, nondeterministic, zombie).",
        ("kind",),
    ),
    "completion_ratio": ("Verified shards over submitted shards.", ()),
    "silent_error_ratio": (
        "Shards that reported success but did not verify, over submitted shards.",
        (),
    ),
    "first_pass_completion_ratio": (
        "Shards verified by an attempt of the run's first pass, over submitted shards"
        " (history: reruns never change it).",
        (),
    ),
    "first_pass_silent_error_ratio": (
        "Shards whose first pass reported success but did not verify, over submitted shards.",
        (),
    ),
    "first_pass_reconciliation_ratio": (
        "Shards verified on their very first attempt, over submitted shards.",
        (),
    ),
    "recomputed_ratio": ("Shards that ran more than once or after the first pass.", ()),
    "repaired_shards": ("Shards whose rerun replaced a failed or missing result.", ()),
    "numeric_shards": ("Shards whose latest attempt reported NaN or infinite metrics.", ()),
    "late_attempts": ("Attempts whose events arrived late from a spool.", ()),
    "oldest_heartbeat_timestamp_seconds": (
        "Unix time of the oldest last-seen among running and stale shards (absent when none).",
        (),
    ),
    "last_event_timestamp_seconds": (
        "Unix time the run's last event was received (server clock).",
        (),
    ),
    "submission_closed": (
        "1 once the planner declared the run's submission complete (plan --close);"
        " 0 again after plan --reopen, until the next close.",
        (),
    ),
    "settled": (
        "1 while the run is settled: submission closed and no shard running, stale"
        " or awaiting verification.",
        (),
    ),
    "settled_timestamp_seconds": (
        "Unix time the run settled, from stored events (absent while it is not settled).",
        (),
    ),
    "events": ("Events in the run's chain.", ()),
    # A gauge, not a counter: when an attempt ends its GPU time moves from running to
    # the bucket it ends in, and a bucket can change when a later verdict moves the
    # shard's counted attempt.
    "gpu_seconds": (
        "GPU-seconds of the run's attempts by cost bucket (running, hung, counted, zombies,"
        " silent, duplicates, reruns; docs/metrics.md); open attempts count up to now.",
        ("bucket",),
    ),
    "first_pass_shards": (
        "First-pass figures by value of a well-known label (provider, pool, region, image):"
        " hangs and reclaims count attempts, truncations outputs, the rest shards; at most"
        " RunExport.max_label_values values per label, the rest summed as (other).",
        ("label", "value", "figure"),
    ),
    "gpu_seconds_by_label": (
        "GPU-seconds by cost bucket and value of a well-known label (provider, pool, region,"
        " image); at most RunExport.max_label_values values per label, the rest as (other).",
        ("label", "value", "bucket"),
    ),
}
_COUNTERS: Final = frozenset({"events"})
# One series per (label, value, figure or bucket): bounded by RunExport.series_per_run().
_LABEL_FAMILIES: Final = ("first_pass_shards", "gpu_seconds_by_label")
# Series one exported run adds at most, without the per-label families (a run whose
# shards have no well-known label has none): the docs multiply it by the runs kept.
SERIES_PER_RUN: Final = (
    len(RUN_FAMILIES)
    - 4  # shards, failed_shards, duplicate_shards, gpu_seconds: counted by their values
    - len(_LABEL_FAMILIES)
    + len(SHARD_STATES)
    + len(FAILURE_TAGS)
    + 1  # verify_failed
    + len(DUPLICATE_KINDS)
    + len(field.COST_BUCKETS)
)
# Series one value of one well-known label adds: a figure each, a bucket each.
SERIES_PER_LABEL_VALUE: Final = len(FIRST_PASS_FIGURES) + len(field.COST_BUCKETS)
# One sample of a run's field figures: its family, label values and value.
_FieldSample = tuple[str, list[str], float]


def _families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
    out: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
    for key, (doc, extra) in RUN_FAMILIES.items():
        family = CounterMetricFamily if key in _COUNTERS else GaugeMetricFamily
        out[key] = family(f"shardledger_run_{key}", doc, labels=["namespace", "run_id", *extra])
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
            families, ledger_last, counts, field_failed = self._collect_runs()
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
        failed = GaugeMetricFamily(
            "shardledger_metrics_field_failed_runs",
            "Exported runs whose field figures (GPU time, first pass by label) failed in the"
            " last collection; their other series are exported.",
        )
        failed.add_metric([], float(field_failed))
        yield failed
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
    ) -> tuple[
        dict[str, GaugeMetricFamily | CounterMetricFamily], float | None, dict[str, int], int
    ]:
        now_us = self.ledger.clock()
        e = self.export
        # One more than can be exported: the newest-first order puts every active run ahead.
        rows = self.ledger.list_runs(None, limit=e.max_active_runs + e.finished_runs + 1)
        active, finished = self.select_runs(rows, now_us)
        families = _families()
        field_failed = 0
        for run in (*active, *finished):
            field_failed += not self._add_run(families, run, now_us)
        # A timestamp, not an age: it survives restarts and `time() - x` ages it in the rule.
        ledger_last = rows[0].updated_us / _US if rows else None
        counts = {"active": len(active), "finished": len(finished)}
        return families, ledger_last, counts, field_failed

    def _add_run(
        self, f: dict[str, GaugeMetricFamily | CounterMetricFamily], run: RunRow, now_us: int
    ) -> bool:
        """Adds one run's series; returns False when its field figures had to be left out."""
        s = self.ledger.summary(run.namespace, run.run_id, now=now_us)
        key = [run.namespace, run.run_id]
        states: dict[str, int] = s["by_state"]
        for state in SHARD_STATES:
            f["shards"].add_metric([*key, state], float(states.get(state, 0)))
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
            # The minimum of an index (shard_open by last-seen), not a pass over the shards.
            oldest = self.ledger.store.read().oldest_open_seen(run.run_pk)
            if oldest is not None:
                f["oldest_heartbeat_timestamp_seconds"].add_metric(key, oldest / _US)
        try:
            samples = self._field_samples(run, now_us)
        except Exception as exc:  # the field figures are new: the run's other series stay
            log.error("metrics_field_failed", run_id=run.run_id, error=str(exc))
            return False
        for family, labels, value in samples:
            f[family].add_metric([*key, *labels], value)
        return True

    def _field_samples(self, run: RunRow, now_us: int) -> list[_FieldSample]:
        """Returns the run's field-figure samples: LedgerService.report's and compare's figures.

        The run's summed counters plus its open attempts at now_us (the writer's sums and
        the stale ones a range of the deadline index finds), added once and handed to
        field.compare for each label: no running shard's record is read.
        """
        total = counters_at(self.ledger.store.read(), run, now_us)
        costs = field.costs(total)
        gpu_s = {
            "counted": costs["counted_gpu_s"],
            "running": costs["running_gpu_s"],
            **costs["lost_gpu_s"],
        }
        out: list[_FieldSample] = [
            ("gpu_seconds", [bucket], float(gpu_s[bucket])) for bucket in field.COST_BUCKETS
        ]
        if self.export.max_label_values <= 0:
            return out
        for label in WELL_KNOWN_LABELS:
            groups = field.compare([(run.run_id, total, ())], label)
            for g in _bounded(groups, self.export.max_label_values):
                value = [label, g["value"]]
                for figure in FIRST_PASS_FIGURES:
                    out.append(("first_pass_shards", [*value, figure], float(g[figure])))
                for bucket in field.COST_BUCKETS:
                    gpu = float(g["gpu_s_by_bucket"][bucket])
                    out.append(("gpu_seconds_by_label", [*value, bucket], gpu))
        return out


def _bounded(groups: Sequence[dict[str, Any]], most: int) -> list[dict[str, Any]]:
    """Returns a label's groups with at most `most` values, the rest summed as "(other)".

    The values with the most shards (then GPU time) are kept; "(none)", the shards
    without the label, is kept too. A label that no shard has gives no groups.
    """
    named = [g for g in groups if g["value"] != field.NO_LABEL]
    if not named:
        return []
    named.sort(key=lambda g: (-g["shards"], -g["gpu_s"], g["value"]))
    kept = [*named[:most], *(g for g in groups if g["value"] == field.NO_LABEL)]
    rest = named[most:]
    if rest:
        kept.append(
            {
                "value": OTHER_VALUE,
                **{figure: sum(g[figure] for g in rest) for figure in FIRST_PASS_FIGURES},
                "gpu_s_by_bucket": {
                    b: sum(g["gpu_s_by_bucket"][b] for g in rest) for b in field.COST_BUCKETS
                },
            }
        )
    return kept
