"""The field figures in Prometheus: GPU time by cost bucket, first pass by the well-known labels."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from collections.abc import Iterable
from pathlib import Path

import pytest
import structlog
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from ledger_server import field
from ledger_server.events import (
    ArtifactCommitted,
    AttemptStarted,
    Event,
    Heartbeat,
    Payload,
    ShardPlanned,
)
from ledger_server.metrics import LedgerMetrics, start_metrics_server, stop_metrics_server
from ledger_server.run_metrics import (
    FIRST_PASS_FIGURES,
    OTHER_VALUE,
    SERIES_PER_LABEL_VALUE,
    SERIES_PER_RUN,
    RunCollector,
    RunExport,
)
from ledger_server.server import RunningServer
from ledger_server.service import LedgerService
from ledger_server.store.sqlite import SqliteStore
from tests.nights import play_night

pytestmark = pytest.mark.usefixtures("spool_in_tmp")

ROOT = Path(__file__).resolve().parents[2]
NIGHT = "night-b"
# Provider B's night: one shard of each outcome, with what the platform table says of it.
OUTCOMES = ("ok", "empty", "truncated", "preempted", "hang", "missing")
NIGHT_TRUTH = {
    "shards": 6,
    "first_pass_verified": 2,  # s0, and s3's rerun (still the first pass)
    "first_attempt_verified": 1,  # s0 alone: s3 was preempted first
    "silent_errors": 2,  # the empty and the truncated output
    "missing": 2,  # s5 never started; s4's attempt is stale
    "hangs": 1,
    "reclaims": 1,
    "truncations": 1,
}
FIRST_PASS = "shardledger_run_first_pass_shards"
BY_LABEL = "shardledger_run_gpu_seconds_by_label"
GPU = "shardledger_run_gpu_seconds"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples_of(families: Iterable[Metric]) -> Samples:
    """Returns every sample, keyed by name and sorted labels."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def scrape(server: RunningServer, export: RunExport | None = None) -> str:
    """Returns one HTTP scrape of /metrics for the server's ledger."""
    httpd, port = start_metrics_server(LedgerMetrics(), server.ledger, "127.0.0.1:0", export=export)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            assert response.status == 200
            return str(response.read().decode())
    finally:
        stop_metrics_server(httpd)


def parse(text: str) -> Samples:
    """Returns the samples of an exposition text."""
    return samples_of(text_string_to_metric_families(text))


def gpu_seconds(samples: Samples, run_id: str) -> dict[str, float]:
    """Returns a run's shardledger_run_gpu_seconds by bucket."""
    return {
        dict(labels)["bucket"]: v
        for (name, labels), v in samples.items()
        if name == GPU and ("run_id", run_id) in labels
    }


def by_value(
    samples: Samples, name: str, run_id: str, label: str, key: str
) -> dict[str, dict[str, float]]:
    """Returns one label's series of a run as {value: {figure or bucket: sample}}."""
    out: dict[str, dict[str, float]] = {}
    for (n, labels), v in samples.items():
        d = dict(labels)
        if n == name and d["run_id"] == run_id and d["label"] == label:
            out.setdefault(d["value"], {})[d[key]] = v
    return out


def report_gpu_seconds(report: dict[str, object]) -> dict[str, float]:
    """Returns GetRunReport's costs as {bucket: GPU-seconds}."""
    costs = report["costs"]
    assert isinstance(costs, dict)
    return {"counted": costs["counted_gpu_s"], "running": costs["running_gpu_s"]} | dict(
        costs["lost_gpu_s"]
    )


@pytest.fixture
def night(
    capsys: pytest.CaptureFixture[str], target: str, server: RunningServer, tmp_path: Path
) -> RunningServer:
    """Plays provider B's night on the spot pool through the SDK; returns its server."""
    with structlog.testing.capture_logs():
        play_night(
            capsys,
            target,
            tmp_path / "out",
            NIGHT,
            OUTCOMES,
            labels={"provider": "B", "pool": "spot"},
        )
    return server


def test_a_labelled_nights_series_are_its_run_report_and_compare_figures(
    night: RunningServer,
) -> None:
    samples = parse(scrape(night))
    report = night.ledger.report("", NIGHT)

    gpu = gpu_seconds(samples, NIGHT)
    assert gpu == report_gpu_seconds(report)
    assert list(gpu) == list(field.COST_BUCKETS)
    assert gpu["counted"] > 0 and gpu["silent"] > 0 and gpu["reruns"] > 0  # s3's preemption
    assert gpu["running"] == 0  # nothing runs after the night; the hang is stale
    for label in ("provider", "pool"):
        [group] = night.ledger.compare("", [NIGHT], label)
        figures = by_value(samples, FIRST_PASS, NIGHT, label, "figure")
        assert figures == {group["value"]: {f: float(group[f]) for f in FIRST_PASS_FIGURES}}
        buckets = by_value(samples, BY_LABEL, NIGHT, label, "bucket")
        assert buckets == {group["value"]: group["gpu_s_by_bucket"]}
    assert by_value(samples, FIRST_PASS, NIGHT, "provider", "figure") == {"B": NIGHT_TRUTH}
    # No shard has a region or an image: those labels add no series at all.
    assert {dict(labels)["label"] for (n, labels) in samples if n == FIRST_PASS} == {
        "provider",
        "pool",
    }
    assert samples[("shardledger_metrics_field_failed_runs", ())] == 0


def test_label_values_past_the_cap_are_summed_as_other_and_unlabelled_shards_kept_as_none(
    server: RunningServer,
) -> None:
    sizes = {"p0": 5, "p1": 4, "p2": 3, "p3": 2, "p4": 1, "p5": 1, "": 2}
    events: list[Event] = []
    for provider, n in sizes.items():
        for _ in range(n):
            i = len(events)
            labels = {"provider": provider} if provider else {}
            plan = ShardPlanned(f"/in/{i}", 1, "", "{}", ("out",), "", i, labels=labels)
            events.append(Event(f"p-{i}", "", "wide", f"s{i}", "", 0, plan))
    server.ledger.append(events)
    export = RunExport(max_label_values=3)

    samples = parse(scrape(server, export))

    groups = by_value(samples, FIRST_PASS, "wide", "provider", "figure")
    shards = {value: figures["shards"] for value, figures in groups.items()}
    assert shards == {"p0": 5, "p1": 4, "p2": 3, OTHER_VALUE: 4, field.NO_LABEL: 2}
    assert groups[OTHER_VALUE]["missing"] == 4  # p3, p4 and p5's shards, summed
    submitted = (("namespace", "default"), ("run_id", "wide"))
    assert sum(shards.values()) == samples[("shardledger_run_submitted_shards", submitted)]
    run_series = [labels for (_, labels) in samples if ("run_id", "wide") in labels]
    label_series = [labels for labels in run_series if ("label", "provider") in labels]
    assert len(label_series) == 5 * SERIES_PER_LABEL_VALUE
    assert len(run_series) - len(label_series) <= SERIES_PER_RUN
    assert len(run_series) <= export.series_per_run()

    # 0 turns the per-label families off; the run's cost buckets stay.
    off = parse(scrape(server, RunExport(max_label_values=0)))
    assert not by_value(off, FIRST_PASS, "wide", "provider", "figure")
    assert gpu_seconds(off, "wide") == dict.fromkeys(field.COST_BUCKETS, 0.0)


T0 = 1_700_000_000_000_000


def test_an_open_attempt_counts_to_its_last_event_then_moves_to_the_bucket_it_ends_in(
    tmp_path: Path,
) -> None:
    now = [T0]
    ledger = LedgerService(SqliteStore(str(tmp_path / "ledger.db")), clock=lambda: now[0])
    collector = RunCollector(ledger)

    def at(t_s: float, *events: Event) -> None:
        now[0] = T0 + int(t_s * 1_000_000)
        if events:
            ledger.append(list(events))

    def ev(tag: str, shard: int, payload: Payload) -> Event:
        attempt = "" if tag == "plan" else "a"
        return Event(f"{tag}-{shard}", "", "night", f"s{shard}", attempt, 0, payload)

    def start(shard: int, timeout_s: int, provider: str) -> Event:
        labels = {"provider": provider}
        payload = AttemptStarted("node", 1, timeout_s * 1_000_000, {}, "", labels=labels)
        return ev("start", shard, payload)

    at(
        0,
        *(ev("plan", i, ShardPlanned(f"/in/{i}", 1, "", "{}", ("out",), "", i)) for i in range(2)),
    )
    at(10, start(0, 3600, "B"), start(1, 30, "C"))
    at(20, ev("beat", 1, Heartbeat(1, 0.1, {})))  # s1 then goes silent: stale at 50 s
    at(70, ev("beat", 0, Heartbeat(2, 0.2, {})))
    at(75)  # a scrape between events: open attempts count up to their last event

    during = samples_of(collector.collect())
    report = ledger.report("", "night", now=now[0])
    assert gpu_seconds(during, "night") == report_gpu_seconds(report)
    assert gpu_seconds(during, "night")["running"] == 60.0  # 10 s to 70 s, one GPU
    assert gpu_seconds(during, "night")["hung"] == 10.0  # 10 s to 20 s, then stale
    buckets = by_value(during, BY_LABEL, "night", "provider", "bucket")
    assert (buckets["B"]["running"], buckets["C"]["hung"]) == (60.0, 10.0)
    figures = by_value(during, FIRST_PASS, "night", "provider", "figure")
    assert (figures["C"]["hangs"], figures["C"]["missing"], figures["B"]["missing"]) == (1, 1, 0)
    oldest = (("namespace", "default"), ("run_id", "night"))
    assert during[("shardledger_run_oldest_heartbeat_timestamp_seconds", oldest)] == (T0 / 1e6 + 20)

    commit = ArtifactCommitted("out", "/out/s0", 5, "a" * 64, "application/octet-stream")
    at(200, ev("commit", 0, commit))

    after = gpu_seconds(samples_of(collector.collect()), "night")
    assert after == report_gpu_seconds(ledger.report("", "night", now=now[0]))
    assert (after["running"], after["counted"], after["hung"]) == (0.0, 190.0, 10.0)


def test_a_failing_field_figure_leaves_the_runs_other_series_and_is_counted(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = ShardPlanned("/in/0", 1, "", "{}", ("out",), "", 0, labels={"provider": "B"})
    server.ledger.append([Event("p-0", "", "night", "s0", "", 0, plan)])

    def broken(*args: object, **kwargs: object) -> list[dict[str, object]]:
        raise RuntimeError("a bug in the field figures")

    monkeypatch.setattr(field, "compare", broken)
    with structlog.testing.capture_logs() as logs:
        samples = samples_of(RunCollector(server.ledger).collect())

    assert samples[("shardledger_metrics_collect_up", ())] == 1
    assert samples[("shardledger_metrics_field_failed_runs", ())] == 1
    run = (("namespace", "default"), ("run_id", "night"))
    assert samples[("shardledger_run_submitted_shards", run)] == 1
    assert gpu_seconds(samples, "night") == {}  # a run's field series come whole or not at all
    assert any(
        e["event"] == "metrics_field_failed"
        and e["run_id"] == "night"
        and e["log_level"] == "error"
        for e in logs
    )


@pytest.mark.prometheus
@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_a_labelled_scrape_passes_promtool_check_metrics(night: RunningServer) -> None:
    text = scrape(night).encode()
    for family in (GPU, FIRST_PASS, BY_LABEL):
        assert f"# TYPE {family} gauge".encode() in text

    result = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, timeout=30, check=False
    )

    assert (result.returncode, result.stdout, result.stderr) == (0, b"", b"")


def documented_queries() -> list[str]:
    """Returns the PromQL blocks of docs/alerts.md's section on the field figures."""
    text = (ROOT / "docs" / "alerts.md").read_text()
    section = text.split("\n## GPU time and first pass by label\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```promql\n(.*?)```", section, flags=re.DOTALL)


def series(name: str, run_id: str, value: str, **labels: str) -> str:
    """Returns a promtool input series name for one run and provider value."""
    extra = "".join(f',{k}="{v}"' for k, v in labels.items())
    return (
        f'{name}{{namespace="default",run_id="{run_id}",label="provider",value="{value}"{extra}}}'
    )


@pytest.mark.prometheus
@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_the_documented_queries_give_lost_gpu_hours_and_reconciliation_of_a_known_week(
    tmp_path: Path,
) -> None:
    lost, per_run, pooled = documented_queries()

    def silent(run_id: str, value: str) -> str:
        return series(BY_LABEL, run_id, value, bucket="silent")

    def figure(run_id: str, name: str) -> str:
        return series(FIRST_PASS, run_id, "B", figure=name)

    # One sample a day, the week ending at day 8; values are each run's total so far.
    inputs = {
        silent("r-old", "A"): "3600 3600 10800 10800 10800 10800 10800 10800 10800",  # +2 h
        silent("r-new", "A"): "_ _ _ 0 3600 3600 3600 3600 3600",  # +1 h, started this week
        silent("r-gone", "B"): "_ _ 1800 3600 7200",  # +2 h, then no longer exported
        silent("r-ancient", "A"): "36000 36000",  # all of it before the week
        series(BY_LABEL, "r-old", "A", bucket="counted"): "0 1e6 2e6 3e6 4e6 5e6 6e6 7e6 8e6",
        figure("r1", "first_attempt_verified"): "0 1 2 3 3 3 3 3 3",
        figure("r1", "shards"): "4 4 4 4 4 4 4 4 4",
        figure("r1", "missing"): "4 3 2 1 1 1 1 1 1",
        figure("r2", "first_attempt_verified"): "0 0 0 0 0 0 1 1 1",
        figure("r2", "shards"): "_ _ _ _ _ _ 2 2 2",
        figure("r3", "first_attempt_verified"): "_ _ 0 0",
        figure("r3", "shards"): "_ _ 2 2",
    }
    run_labels = '{{namespace="default",run_id="{}",label="provider",value="B"}}'
    expr_tests = [
        (lost, [('{value="A"}', 3.0), ('{value="B"}', 2.0)]),
        (per_run, [(run_labels.format("r1"), 0.75), (run_labels.format("r2"), 0.5)]),
        (pooled, [("{}", 0.5)]),  # (3 + 1 + 0) / (4 + 2 + 2)
    ]
    rules = tmp_path / "none.yml"
    rules.write_text("groups: []\n")
    spec = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1d",
        "tests": [
            {
                "interval": "1d",
                "input_series": [{"series": s, "values": v} for s, v in inputs.items()],
                "promql_expr_test": [
                    {
                        "expr": expr,
                        "eval_time": "8d",
                        "exp_samples": [{"labels": lb, "value": v} for lb, v in expected],
                    }
                    for expr, expected in expr_tests
                ],
            }
        ],
    }
    test_file = tmp_path / "queries_test.yml"
    test_file.write_text(json.dumps(spec, indent=1))  # JSON is YAML

    result = subprocess.run(
        ["promtool", "test", "rules", str(test_file)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert result.returncode == 0, result.stdout + result.stderr
