"""Prometheus /metrics, scraped over HTTP from a live server while faults are injected."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from wsgiref.simple_server import WSGIServer

import pytest
from prometheus_client.parser import text_string_to_metric_families

import ledger_server
from ledger_server.codec import decode_event
from ledger_server.errors import LedgerError
from ledger_server.metrics import (
    CALL_REJECT_REASONS,
    REJECT_REASONS,
    LedgerMetrics,
    bind_address,
    start_metrics_server,
    stop_metrics_server,
)
from ledger_server.run_metrics import SERIES_PER_RUN, SHARD_STATES, RunExport
from ledger_server.server import RunningServer
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from tests.builders import DIGEST_A, DIGEST_B, committed, event, planned, started

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    """Returns every sample of one HTTP scrape, keyed by name and sorted labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
        text = response.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def scrape_until(port: int, done: Callable[[Samples], bool], timeout_s: float = 5.0) -> Samples:
    """Scrapes until done(samples) holds (the server clock decides staleness) or fails."""
    deadline = time.monotonic() + timeout_s
    while not done(samples := scrape(port)):
        assert time.monotonic() < deadline, "the scraped metrics never reached the expected state"
        time.sleep(0.1)
    return samples


def run_value(samples: Samples, name: str, run_id: str, **labels: str) -> float | None:
    """Returns one per-run sample of the default namespace, or None when absent."""
    key = tuple(sorted({"namespace": "default", "run_id": run_id, **labels}.items()))
    return samples.get((name, key))


def exported_runs(samples: Samples) -> set[str]:
    """Returns the run ids that have per-run series."""
    return {
        dict(labels)["run_id"]
        for (name, labels) in samples
        if name == "shardledger_run_events_total"
    }


def start(server: RunningServer, export: RunExport | None = None) -> tuple[WSGIServer, int]:
    """Starts a metrics endpoint for the server's ledger on an ephemeral loopback port."""
    return start_metrics_server(LedgerMetrics(), server.ledger, "127.0.0.1:0", export=export)


@pytest.fixture
def metrics_port(server: RunningServer) -> Iterator[int]:
    """Serves /metrics for the fixture server with the default export bounds."""
    httpd, port = start(server)
    yield port
    stop_metrics_server(httpd)


def test_gauges_follow_missing_stale_duplicate_and_failed_shards_during_a_run(
    client: LedgerClient, metrics_port: int
) -> None:
    run = "night-1"
    client.append([planned(run, f"s{i}", i) for i in range(5)])

    before = scrape(metrics_port)
    assert run_value(before, "shardledger_run_submitted_shards", run) == 5
    assert run_value(before, "shardledger_run_shards", run, state="planned") is None
    assert run_value(before, "shardledger_run_shards", run, state="missing") == 5
    assert run_value(before, "shardledger_run_shards", run, state="stale") == 0
    assert run_value(before, "shardledger_run_events_total", run) == 5
    assert run_value(before, "shardledger_run_oldest_heartbeat_timestamp_seconds", run) is None
    assert run_value(before, "shardledger_run_submission_closed", run) == 0
    assert run_value(before, "shardledger_run_settled", run) == 0
    assert run_value(before, "shardledger_run_settled_timestamp_seconds", run) is None

    client.append(
        [
            started(run, "s0", "a0", timeout_s=1),  # goes silent: stale after a second
            started(run, "s1", "a1"),
            committed(run, "s1", "a1", digest=DIGEST_A),
            # A second launch of s1 computes it again: same group, new digest.
            started(run, "s1", "a1-again"),
            committed(run, "s1", "a1-again", digest=DIGEST_B),
            started(run, "s2", "a2"),
            event(run, "s2", "a2", failed=pb.AttemptFailed(tag=pb.FAILURE_TAG_OOM)),
            # s4 reported success, and its artifact failed verification.
            started(run, "s4", "a4"),
            committed(run, "s4", "a4"),
            event(
                run,
                "s4",
                verified=pb.ArtifactVerified(
                    name="out",
                    path="/out/x",
                    blake3_hex=DIGEST_A,
                    result=pb.VERIFICATION_RESULT_FAILED,
                    reason="truncated: 3 of 5 bytes",
                ),
            ),
        ]
    )
    during = scrape(metrics_port)
    assert run_value(during, "shardledger_run_shards", run, state="running") == 1
    assert run_value(during, "shardledger_run_shards", run, state="missing") == 1
    assert run_value(during, "shardledger_run_shards", run, state="unverified") == 1
    # One name per count, as `shards --state` lists them: failed is the loud failure only.
    assert run_value(during, "shardledger_run_shards", run, state="failed") == 1
    assert run_value(during, "shardledger_run_shards", run, state="verify_failed") == 1
    assert run_value(during, "shardledger_run_failed_shards", run, tag="oom") == 1
    assert run_value(during, "shardledger_run_failed_shards", run, tag="verify_failed") == 1
    assert run_value(during, "shardledger_run_duplicate_shards", run, kind="wasted") == 1
    assert run_value(during, "shardledger_run_duplicate_shards", run, kind="nondeterministic") == 1
    assert run_value(during, "shardledger_run_duplicate_shards", run, kind="zombie") == 0
    assert run_value(during, "shardledger_run_completion_ratio", run) == 0.0
    partition = [run_value(during, "shardledger_run_shards", run, state=s) for s in SHARD_STATES]
    # The states partition the submitted shards: sum by (run_id) counts each shard once.
    assert sum(v or 0 for v in partition) == 5

    after = scrape_until(
        metrics_port, lambda s: run_value(s, "shardledger_run_shards", run, state="stale") == 1
    )
    assert run_value(after, "shardledger_run_shards", run, state="running") == 0
    # Timestamps, not ages: the heartbeat of the silent attempt is over a second old.
    oldest = run_value(after, "shardledger_run_oldest_heartbeat_timestamp_seconds", run)
    assert oldest is not None and time.time() - oldest >= 1.0
    last_event = run_value(after, "shardledger_run_last_event_timestamp_seconds", run)
    assert last_event is not None and oldest <= last_event <= time.time()
    assert after[("shardledger_metrics_collect_up", ())] == 1


def test_a_settled_run_exports_its_lifecycle_and_settled_time(
    client: LedgerClient, metrics_port: int
) -> None:
    run = "night-1"
    client.append([planned(run, "s0"), started(run, "s0", "a0")])
    client.close_submission(run)
    closed = scrape(metrics_port)
    assert run_value(closed, "shardledger_run_submission_closed", run) == 1
    assert run_value(closed, "shardledger_run_settled", run) == 0
    assert run_value(closed, "shardledger_run_settled_timestamp_seconds", run) is None

    client.append([event(run, "s0", "a0", failed=pb.AttemptFailed(tag=pb.FAILURE_TAG_KILLED))])
    settled = scrape(metrics_port)
    assert run_value(settled, "shardledger_run_settled", run) == 1
    at = run_value(settled, "shardledger_run_settled_timestamp_seconds", run)
    assert at == run_value(settled, "shardledger_run_last_event_timestamp_seconds", run)
    assert at is not None and at <= time.time()
    # The documented bound: a settled run has no heartbeat timestamp, so one under it.
    series = [labels for (_, labels) in settled if ("run_id", run) in labels]
    assert len(series) == SERIES_PER_RUN - 1


@pytest.mark.prometheus
@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_a_live_scrape_passes_promtool_check_metrics(
    client: LedgerClient, metrics_port: int
) -> None:
    run = "night-1"
    client.append([planned(run, f"s{i}", i) for i in range(3)])
    client.append([started(run, "s0", "a0"), started(run, "s1", "a1", timeout_s=1)])
    client.append([committed(run, "s0", "a0")])
    client.close_submission(run)
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read()
    # Every family of the exposition is present: the check saw each name and type.
    assert b"# TYPE shardledger_run_events_total counter" in text
    assert b"shardledger_run_settled{" in text

    result = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, timeout=30, check=False
    )

    assert (result.returncode, result.stdout, result.stderr) == (0, b"", b"")


def test_only_active_runs_and_the_k_most_recent_finished_runs_are_exported(
    server: RunningServer, client: LedgerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    for i in range(5):
        client.append([planned(f"old-{i}")])
    time.sleep(1.2)  # the old runs' last events are at least 1.2 s before the live ones'
    client.append([planned("live-0"), planned("live-1")])
    # The scrape's "now" is 0.1 s after the live runs' events, whenever it really runs:
    # the live runs are inside the 1 s active window and the old ones outside it, on a
    # loaded machine too.
    last_us = max(r.update_time.ToMicroseconds() for r in client.list_runs())
    monkeypatch.setattr(server.ledger, "clock", lambda: last_us + 100_000)
    httpd, port = start(server, RunExport(active_window_s=1.0, finished_runs=2))
    try:
        samples = scrape(port)
    finally:
        stop_metrics_server(httpd)

    assert exported_runs(samples) == {"live-0", "live-1", "old-4", "old-3"}
    assert samples[("shardledger_metrics_exported_runs", (("kind", "active"),))] == 2
    assert samples[("shardledger_metrics_exported_runs", (("kind", "finished"),))] == 2
    last = samples[("shardledger_ledger_last_event_timestamp_seconds", ())]
    assert last == pytest.approx(last_us / 1e6, abs=1e-3)


def test_active_runs_beyond_the_hard_cap_are_not_exported(
    server: RunningServer, client: LedgerClient
) -> None:
    client.append([planned(f"burst-{i}") for i in range(6)])
    httpd, port = start(server, RunExport(max_active_runs=3, finished_runs=0))
    try:
        assert len(exported_runs(scrape(port))) == 3
    finally:
        stop_metrics_server(httpd)


def test_server_counters_record_appends_rejections_and_group_commits(
    server: RunningServer,
) -> None:
    metrics = LedgerMetrics()
    httpd, port = start_metrics_server(metrics, server.ledger, "127.0.0.1:0")
    try:
        metrics.observe_append(0.003, 10, None)
        metrics.observe_append(0.001, 4, "PLAN_CONFLICT")
        metrics.observe_append(0.001, 2, "SOMETHING_NEW")
        metrics.observe_group(jobs=3, events=16)
        metrics.observe_rejected_call("TOKEN_EXPIRED")
        samples = scrape(port)
    finally:
        stop_metrics_server(httpd)

    def rejected(reason: str) -> float:
        return samples[("shardledger_events_rejected_total", (("reason", reason),))]

    assert samples[("shardledger_events_appended_total", ())] == 10
    assert rejected("PLAN_CONFLICT") == 4
    assert rejected("OTHER") == 2  # an unknown reason never adds a label value
    assert all(rejected(r) == 0 for r in REJECT_REASONS if r not in ("PLAN_CONFLICT", "OTHER"))
    calls = "shardledger_calls_rejected_total"
    assert samples[(calls, (("reason", "TOKEN_EXPIRED"),))] == 1
    # An append's own reasons are no call refusal: that series carries auth reasons only.
    assert (calls, (("reason", "PLAN_CONFLICT"),)) not in samples
    assert {dict(labels)["reason"] for name, labels in samples if name == calls} == set(
        CALL_REJECT_REASONS
    )
    assert samples[("shardledger_append_duration_seconds_count", (("result", "ok"),))] == 1
    assert samples[("shardledger_append_duration_seconds_count", (("result", "rejected"),))] == 2
    assert samples[("shardledger_append_batch_events_sum", ())] == 16
    assert samples[("shardledger_group_commit_batches_sum", ())] == 3
    assert samples[("shardledger_group_commit_events_sum", ())] == 16


def test_timed_append_records_latency_and_the_reason_of_a_refused_append(
    server: RunningServer,
) -> None:
    metrics = LedgerMetrics()
    httpd, port = start_metrics_server(metrics, server.ledger, "127.0.0.1:0")
    try:
        with metrics.timed_append(1):
            server.ledger.append([decode_event(planned("run-1"))])
        with pytest.raises(LedgerError), metrics.timed_append(1):
            server.ledger.append([decode_event(started("run-1", "never-planned"))])
        samples = scrape(port)
    finally:
        stop_metrics_server(httpd)

    assert samples[("shardledger_events_appended_total", ())] == 1
    lifecycle = (("reason", "SHARD_NOT_PLANNED"),)
    assert samples[("shardledger_events_rejected_total", lifecycle)] == 1
    assert samples[("shardledger_append_duration_seconds_count", (("result", "ok"),))] == 1


def test_a_failing_store_is_reported_as_a_series_not_an_http_error(
    server: RunningServer, client: LedgerClient, metrics_port: int
) -> None:
    client.append([planned("run-1")])
    assert scrape(metrics_port)[("shardledger_metrics_collect_up", ())] == 1
    server.ledger.store.close()  # every read connection, including the scraper's, is gone

    samples = scrape(metrics_port)

    assert samples[("shardledger_metrics_collect_up", ())] == 0
    assert not exported_runs(samples)


def test_every_reason_the_append_and_auth_paths_raise_has_its_own_label() -> None:
    sources = (
        "errors.py",
        "events.py",
        "validation.py",
        "projections.py",
        "service.py",
        "committer.py",
        "batch.py",
        "auth.py",
        "servicer.py",
    )
    raised = set()
    for name in sources:
        path = Path(ledger_server.__file__).parent / name
        if path.exists():
            raised |= set(re.findall(r'reason\s*=\s*"([A-Z_]+)"', path.read_text()))
    assert raised and not raised - set(REJECT_REASONS)


@pytest.mark.parametrize(
    ("listen", "expected"),
    [
        ("127.0.0.1:9464", ("127.0.0.1", 9464)),
        (":9464", ("0.0.0.0", 9464)),
        ("[::1]:0", ("::1", 0)),
    ],
)
def test_listen_addresses_parse_to_host_and_port(listen: str, expected: tuple[str, int]) -> None:
    assert bind_address(listen) == expected


def test_a_listen_address_without_a_port_is_refused() -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        bind_address("localhost")


def test_the_oldest_heartbeat_is_exact_across_heartbeat_rows_and_records(tmp_path: Path) -> None:
    # The scrape reads the minimum of the open attempts' last-seen index instead of
    # parsing each running shard; it must still be the minimum of every running shard's
    # last-seen time as its row tells it, a heartbeat that came in with an earlier clock
    # (a clock step back) included.
    from prometheus_client import CollectorRegistry, generate_latest

    from ledger_server.events import AttemptStarted, Event, Heartbeat, ShardPlanned
    from ledger_server.record import latest_attempt_from_row
    from ledger_server.run_metrics import RunCollector
    from ledger_server.service import LedgerService
    from ledger_server.store.sqlite import SqliteStore

    now = [1_000_000_000]
    ledger = LedgerService(SqliteStore(str(tmp_path / "ledger.db")), clock=lambda: now[0])

    def at(t_s: float, *events: Event) -> None:
        now[0] = int(1_000_000_000 + t_s * 1_000_000)
        ledger.append(list(events))

    def ev(i: int, tag: str, payload: object) -> Event:
        attempt = "" if tag == "p" else "a"
        return Event(f"{tag}-{i}", "", "night", f"s{i}", attempt, 0, payload)  # type: ignore[arg-type]

    at(0, *(ev(i, "p", ShardPlanned(f"/in/{i}", 1, "", "{}", ("out",), "", i)) for i in range(5)))
    starts = {i: ev(i, "s", AttemptStarted("node", 1, 3_600_000_000, {}, "")) for i in range(5)}
    at(10, starts[0])  # no heartbeat: the record's time, 10 s
    at(20, starts[1])
    at(30, starts[2])
    at(40, starts[3])
    at(50, starts[4])
    at(60, ev(1, "h1", Heartbeat(1, 0.1, {})))  # heartbeat rows: 60 s and 70 s
    at(70, ev(2, "h1", Heartbeat(1, 0.1, {})))
    at(5, ev(3, "h1", Heartbeat(1, 0.1, {})))  # a clock step back: row 5 s, record 40 s
    run = ledger.run("", "night")

    def reference() -> int | None:
        rows = ledger.store.read().iter_shards(run.run_pk, states=["running"])
        seen = []
        for row in rows:
            assert row.record is not None
            attempt = latest_attempt_from_row(row.record, row.beat_us)[0]
            assert attempt is not None
            seen.append(attempt.last_seen_us)
        return min(seen, default=None)

    registry = CollectorRegistry()
    registry.register(RunCollector(ledger))

    def scraped() -> float:
        text = generate_latest(registry).decode()
        family = "shardledger_run_oldest_heartbeat_timestamp_seconds"
        (line,) = [x for x in text.splitlines() if x.startswith(family + "{")]
        return float(line.rsplit(" ", 1)[1])

    assert ledger.store.read().oldest_open_seen(run.run_pk) == reference() == 1_010_000_000
    assert scraped() == 1_010.0
    at(80, ev(0, "h1", Heartbeat(1, 0.1, {})))  # shard 0 beats: now shard 3 (record 40 s) is
    assert ledger.store.read().oldest_open_seen(run.run_pk) == reference() == 1_040_000_000
    assert scraped() == 1_040.0


def test_the_cardinality_the_docs_state_is_what_the_export_computes() -> None:
    """docs/alerts.md sizes Prometheus by SERIES_PER_RUN: the figures there are the code's."""
    repo = Path(__file__).parents[2]
    text = " ".join((repo / "docs" / "alerts.md").read_text().split())
    per_run = RunExport().series_per_run()
    assert f"at most {SERIES_PER_RUN} series without its label values" in text
    assert f"{len(SHARD_STATES)} states" in text
    assert f"and {per_run} in all per run" in text
    assert f"550 × {per_run} = {550 * per_run:,}" in text
    assert f"550 × {SERIES_PER_RUN} = {550 * SERIES_PER_RUN:,}" in text
    readme = " ".join((repo / "deploy" / "prometheus" / "README.md").read_text().split())
    assert f"at most {SERIES_PER_RUN} series per run" in readme
