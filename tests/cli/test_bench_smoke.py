"""The benchmarks run end to end at a small size and their counts are exact.

No timing is asserted: only that the night the big-night benchmark writes,
rebuilds and serves is the night it describes (the running tenth of the shards
is exactly the resume list), and that the unary benchmark's calls all landed,
so the published figures come from working benchmarks.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


def _bench(module: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Runs one benchmark module as a user would, capturing its output."""
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout
    )


def test_bench_replay_writes_rebuilds_and_serves_the_night_it_describes(tmp_path: Path) -> None:
    out = tmp_path / "replay.json"
    done = _bench(
        "tools.bench.replay",
        *("--shards", "50", "--events", "500", "--dir", str(tmp_path), "--out", str(out)),
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    # 50 plans + 50 starts + 6 heartbeats each, and commit + verify for 45 of them.
    assert result["events"] == 50 * 8 + 45 * 2 == result["rebuild"]["events"]
    assert result["rebuild"]["shards"] == 50
    serve = result["serve"]
    assert serve["status_running"] == serve["resume_lines"] == serve["late_heartbeats"] == 5
    assert 0 < serve["server_rss_mb"] <= serve["server_peak_rss_mb"]
    assert result["db_bytes"] > 0


def test_bench_replay_refuses_too_few_events(tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    done = _bench(
        "tools.bench.replay",
        *("--shards", "10", "--events", "20", "--dir", str(tmp_path), "--out", str(out)),
        timeout=60,
    )
    assert done.returncode == 2
    assert "--events must be at least 4 per shard" in done.stderr
    assert not out.exists()


def test_bench_unary_drives_both_servers_without_errors(tmp_path: Path) -> None:
    out = tmp_path / "ingest.json"
    done = _bench("tools.bench", "unary", "--seconds", "0.5", "-o", str(out))
    assert done.returncode == 0, done.stderr
    unary = json.loads(out.read_text())["unary"]
    assert unary["errors"] == 0
    assert unary["echo_calls_per_s"] > 0 and unary["durable_appends_per_s"] > 0
    assert unary["events_per_group_commit"] >= 1
    assert unary["server_cpu_us_per_call"] > 0 and unary["echo_server_cpu_us_per_call"] > 0
    assert isinstance(unary["met"], bool)
    # The asyncio engine's own floor, a bare grpc.aio echo, ran in the same run.
    assert unary["aio_echo_calls_per_s"] > 0 and unary["aio_echo_server_cpu_us_per_call"] > 0


def test_bench_batched_measures_the_ledger_beside_the_minimal_durable_server(
    tmp_path: Path,
) -> None:
    out = tmp_path / "ingest.json"
    done = _bench("tools.bench", "batched", "--seconds", "0.5", "-o", str(out))
    assert done.returncode == 0, done.stderr
    batched = json.loads(out.read_text())["batched"]
    assert batched["errors"] == 0 and batched["events_per_s"] > 0
    # The per-event CPU target's baseline ran in the same run, and its verdict is recorded.
    assert batched["minimal_server_events_per_s"] > 0
    assert batched["cpu_ratio_to_minimal_server"] > 0
    assert isinstance(batched["cpu_target_met"], bool)


def test_bench_refuses_a_non_positive_duration(tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    done = _bench("tools.bench", "unary", "--seconds", "0", "-o", str(out), timeout=60)
    assert done.returncode == 2
    assert "--seconds must be positive" in done.stderr
    assert not out.exists()


def test_bench_storage_commits_and_uploads_the_same_bytes_and_reports_ratios(
    tmp_path: Path,
) -> None:
    out = tmp_path / "storage.json"
    done = _bench("tools.bench.storage", "--mib", "2", "--repeat", "1", "--out", str(out))
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["artifact_mib"] == 2
    assert set(result["seconds"]) == {"raw", "commit", "commit_digest", "read_back_digest"}
    assert result["ratio_commit_to_raw"] > 0 and result["full_digest_read_back_s"] > 0


def test_bench_peers_measures_the_ledger_and_names_a_missing_peer(tmp_path: Path) -> None:
    out = tmp_path / "ingest.json"
    done = _bench("tools.bench", "peers", "--seconds", "0.05", "-o", str(out))
    assert done.returncode == 0, done.stderr
    peers = json.loads(out.read_text())["peers"]
    assert peers["ledger_batched_events_per_s"] > 0 and peers["raw_sqlite_rows_per_s"] > 0
    # Without the bench extra (CI's test install) the peer is skipped with the reason.
    es = peers["eventsourcing"]
    assert isinstance(es, dict) or es.startswith("skipped: eventsourcing is not installed")


def test_bench_coalesce_sends_fewer_heartbeats_than_calls(tmp_path: Path) -> None:
    out = tmp_path / "ingest.json"
    done = _bench("tools.bench", "coalesce", "--seconds", "0.5", "-o", str(out))
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())["coalesce"]
    every, merged = result["every_call"], result["coalesced"]
    assert merged["heartbeats_per_shard"] < every["heartbeats_per_shard"]
    assert every["other_events_per_shard"] == merged["other_events_per_shard"] == 2


@pytest.mark.parametrize("client", ["aio", "threads"])
def test_bench_fleet_runs_every_job_to_its_commit_without_errors(
    tmp_path: Path, client: str
) -> None:
    out = tmp_path / "ingest.json"
    done = _bench(
        "tools.bench",
        *("fleet", "--seconds", "1", "--connections", "20,100000000", "-o", str(out)),
        *("--fleet-client", client),
    )
    assert done.returncode == 0, done.stderr
    *levels, beyond = json.loads(out.read_text())["fleet"]["levels"]
    # The asyncio client runs each level unary and on streams; the threaded one unary only.
    assert [level["path"] for level in levels] == (
        ["unary", "stream"] if client == "aio" else ["unary"]
    )
    for level in levels:
        assert (level["connections"], level["errors"], level["reader_errors"]) == (20, 0, 0)
        assert level["client"].startswith(client)
        assert level["events"] == level["sent_events"] > 0  # every event acknowledged
        assert level["commit_ack_ms"]["p99"] > 0 and level["server_open_fds_peak"] >= 20
    if client == "aio":
        assert set(levels[1]["vs_unary_same_level"]) == {
            "server_cpu_per_event",
            "commit_p99",
            "events_per_s",
        }
    # A level past what a process may open is said, not attempted.
    assert beyond["connections"] == 100000000 and "descriptors" in beyond["skipped"]


def test_bench_refuses_connections_that_are_no_numbers(tmp_path: Path) -> None:
    done = _bench("tools.bench", "fleet", "--connections", "many", timeout=60)
    assert done.returncode == 2
    assert "--connections 'many': give numbers" in done.stderr


def test_bench_overload_drives_each_speedup_against_one_server_and_reports_the_ratio(
    tmp_path: Path,
) -> None:
    out = tmp_path / "overload.json"
    done = _bench(
        "tools.bench.overload",
        *("--connections", "20", "--seconds", "1", "--speedups", "10,20", "-o", str(out)),
    )
    assert done.returncode == 0, done.stderr
    [run] = json.loads(out.read_text())["runs"]
    assert [phase["speedup"] for phase in run["phases"]] == [10.0, 20.0]
    for phase in run["phases"]:
        # 20 jobs are far below any admission bound: nothing may be refused.
        assert (phase["connections"], phase["errors"], phase["refused"]) == (20, 0, 0)
        assert phase["reader_errors"] == 0
        assert phase["events"] == phase["sent_events"] > 0  # every event acknowledged
    assert run["acknowledged_ratio_last_to_first"] > 0


def _cpu_cgroups() -> Path | None:
    """Returns where CPU cgroups are made here (v2 root or v1 cpu), None where they are not."""
    root = Path("/sys/fs/cgroup")
    if (root / "cgroup.controllers").exists():
        return root if "cpu" in (root / "cgroup.controllers").read_text().split() else None
    return root / "cpu" if (root / "cpu" / "cpu.cfs_quota_us").exists() else None


def test_bench_overload_holds_the_server_to_a_share_of_a_core_and_removes_its_group(
    tmp_path: Path,
) -> None:
    groups = _cpu_cgroups()
    if os.geteuid() != 0 or groups is None:
        pytest.skip("a CPU cgroup needs root and a cpu controller (CI has both)")
    out = tmp_path / "overload.json"
    done = _bench(
        "tools.bench.overload",
        *("--connections", "10", "--seconds", "1", "--speedups", "10", "-o", str(out)),
        *("--server-cpu", "0.5"),
    )
    assert done.returncode == 0, done.stderr
    [run] = json.loads(out.read_text())["runs"]
    assert re.fullmatch(
        r"cgroup v[12] shardledger-bench-\d+-\d+: 5000 of every 10000 us", run["server_cpu_limit"]
    )
    [phase] = run["phases"]
    assert phase["events"] == phase["sent_events"] > 0 and phase["errors"] == 0
    assert phase["backlog_drained_s"] >= 0
    # One second of life leaves no window with every job started and none committed.
    assert phase["steady"]["measured"] is False and "raise --seconds" in phase["steady"]["why"]
    # The group went with the server.
    name = run["server_cpu_limit"].split()[2].rstrip(":")
    assert not (groups / name).exists()


def test_bench_overload_refuses_a_share_of_a_core_out_of_range() -> None:
    done = _bench("tools.bench.overload", "--server-cpu", "2", timeout=60)
    assert done.returncode == 2
    assert "--server-cpu 2: a share of one core, 0.01 to 1" in done.stderr


def test_the_fleets_steady_window_counts_only_events_between_the_last_start_and_the_first_commit() -> (
    None
):
    from tools.bench.fleet import _steady

    # Server CPU sampled each second from t=100: 0.5 s of CPU a second.
    cpu = [(100.0 + s, 0.5 * s) for s in range(0, 61)]
    # Acknowledgements: ten a second over the whole drive.
    acked = [100.0 + i / 10 for i in range(600)]
    got = _steady(cpu, acked, begin=100.0, interval=15.0, seconds=60.0)
    # The window runs from the sample at 116 s to the one at 159 s: 43 s.
    assert got == {
        "measured": True,
        "window_s": 43.0,
        "acked_events_per_s": 10,
        "server_cpu_cores": 0.5,
        "server_cpu_us_per_event": 49884,  # 21.5 s of CPU over 431 events
    }
    short = _steady(cpu, acked, begin=100.0, interval=15.0, seconds=20.0)
    assert short["measured"] is False


def test_the_fleets_reader_takes_the_loop_lag_from_a_real_scrape() -> None:
    from prometheus_client import generate_latest

    from ledger_server.metrics import LedgerMetrics
    from tools.bench.fleet import _loop_lag_s

    metrics = LedgerMetrics()
    metrics.loop_lag.set(0.125)
    assert _loop_lag_s(generate_latest(metrics.registry)) == 0.125
    assert _loop_lag_s(b"# HELP other\nother_metric 1\n") is None


def test_bench_job_runs_every_job_and_the_sdk_keeps_torch_out_and_exits_at_once(
    tmp_path: Path,
) -> None:
    out = tmp_path / "job.json"
    done = _bench(
        "tools.bench.job", "--repeat", "1", "--beat-seconds", "1", "-o", str(out), timeout=600
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    # Every job ran to its end (a failed one raises), with and without the SDK.
    assert set(result["per_process"]) >= {"word count", "word count + SDK", "torch job + SDK"}
    assert result["torch_imported_by_word_count"] is False
    # The ledger down: the exit returned without its 10 s wait (nothing listened).
    assert result["targets"]["exit with the ledger down <= 0.5 s"]["close_s_max"] < 5
    assert result["heartbeat"]["beats"] > 10  # a beat every 20 ms for a second, counted
    assert "met" in result["targets"]["word count: SDK adds <= import grpc + stubs + 100 ms"]


def test_bench_retention_archives_every_night_past_the_policy_and_only_those(
    tmp_path: Path,
) -> None:
    out = tmp_path / "retention.json"
    done = _bench(
        "tools.bench.retention",
        *("--nights", "12", "--shards", "10", "--after", "3", "-o", str(out)),
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    # By night 12, nights 1 to 9 settled at least 3 nights before: archived, the rest hot.
    assert result["with_archive"]["archived_runs"] == 12 - 3
    assert result["without_archive"]["archived_runs"] == 0
    assert result["with_archive"]["marks"][-1]["first_night_archived"]
    assert result["hot_used_ratio_at_end"] < 1


def test_bench_retention_pause_and_read_rss_measure_both_shapes_of_one_night(
    tmp_path: Path,
) -> None:
    pause, rss = tmp_path / "pause.json", tmp_path / "rss.json"
    done = _bench("tools.bench.retention", "--pause", "--shards", "40", "-o", str(pause))
    assert done.returncode == 0, done.stderr
    result = json.loads(pause.read_text())
    for shape in ("one_transaction", "chunked_purge"):
        assert result[shape]["appends_during"] >= 1 and result[shape]["append_ms_max"] > 0
    done = _bench("tools.bench.retention", "--read-rss", "--shards", "40", "-o", str(rss))
    assert done.returncode == 0, done.stderr
    result = json.loads(rss.read_text())
    # Every way reads the same resume list: the four failed shards of forty.
    resumes = {result[w]["resume"] for w in ("objects", "compact_hot_50000", "compact_hot_2000")}
    assert resumes == {4}


def test_bench_scrape_counts_the_open_shards_and_gives_the_baselines_figures(
    tmp_path: Path,
) -> None:
    out = tmp_path / "scrape.json"
    done = _bench("tools.bench.scrape", *("--shards", "40", "--repeat", "1", "-o", str(out)))
    assert done.returncode == 0, done.stderr
    (size,) = json.loads(out.read_text())["sizes"]
    # Half the attempts have a one-minute timeout and were last seen two minutes ago.
    assert (size["new"]["running"], size["new"]["stale"]) == (20, 20)
    # 20 attempts each way, one GPU, 10 s from start to heartbeat.
    assert size["new"]["report_running_gpu_s"] == size["new"]["report_hung_gpu_s"] == 200.0
    # The revision before the writer kept the sums answers the same figures.
    assert size["same_figures"] is True
    assert size["baseline"]["series"] == size["new"]["series"] > 0


def test_bench_stream_measures_the_stream_beside_unary_and_the_echoes(tmp_path: Path) -> None:
    out = tmp_path / "ingest.json"
    done = _bench("tools.bench", "stream", "--seconds", "1", "-o", str(out))
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())["stream"]
    for way in ("echo_unary", "echo_stream", "ledger_unary", "ledger_stream"):
        assert result[way]["per_s"] > 0 and result[way]["errors"] == 0, (way, result[way])
        assert result[way]["server_cpu_us_per_call"] > 0
    assert result["stream_cpu_vs_unary"] > 0 and result["unary_rate_vs_echo"] > 0
