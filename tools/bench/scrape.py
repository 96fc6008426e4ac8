"""Benchmarks a `/metrics` scrape and a run report against many open shards, old and new.

    python -m tools.bench scrape                          # 10,000 and 100,000 running shards
    python -m tools.bench.scrape --shards 10000 --baseline-rev HEAD~1

For each size, a night is appended through the ledger's own writer (LedgerService
on a temp SQLite file): every shard planned with a provider label, started and
beating, --stale-percent of them (default 50) with a one-minute heartbeat timeout and
the rest with one hour; the clock then moves two minutes on, so that share of the
open attempts is hung and the rest running (0: a healthy fleet, every shard beating).
Then, in this process (the server's, where the collector runs):

* the CPU time (time.process_time) of one whole per-run collection (RunCollector:
  what a /metrics scrape costs the server beyond the text encoding), median of
  --repeat;
* the wall and CPU time of LedgerService.report (GetRunReport's answer).

The same-run baseline is the revision before this change (``--baseline-rev``, a
`git archive` of its ledger_server and shard_client in a temp directory): this
script runs again there in a child process, on its own night of the same shape,
through the same public calls. Targets (issue 52): <= 10 ms of server CPU per
scrape at 10,000 running shards; a report <= 1 s at 100,000 open shards. JSON goes
to bench-results/scrape.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

TARGET_SCRAPE_CPU_S: Final = 0.010
TARGET_REPORT_S: Final = 1.0
T0: Final = 1_700_000_000_000_000
BATCH: Final = 20_000  # rows per store flush while writing
REPO: Final = Path(__file__).resolve().parents[2]


def _night(path: str, shards: int, stale_pct: int = 50) -> tuple[Any, list[int]]:
    """Writes the night's events and rebuilds its projections; returns the ledger and its clock.

    The rows go in through the store's write path and the projections come from
    `db rebuild`'s replay (as tools.bench.replay writes its night): the same rows and
    counters the writer keeps, in a fraction of the time the appends take.
    """
    from ledger_server.chain import GENESIS_HASH, chain_hash, encode_row
    from ledger_server.events import AttemptStarted, Event, Heartbeat, ShardPlanned
    from ledger_server.rebuild import rebuild_run
    from ledger_server.service import LedgerService
    from ledger_server.store.sqlite import SqliteStore
    from ledger_server.validation import check_namespace, validate

    def ev(kind: str, i: int, attempt: str, payload: Any) -> Event:
        return Event(f"{kind}-{i}", "", "night", f"s{i:07d}", attempt, 0, payload)

    providers = ("A", "B", "C")

    def timeout_us(i: int) -> int:
        # The first stale_pct percent of the shards get a one-minute timeout (stale by now).
        return 60_000_000 if i * 100 < stale_pct * shards else 3_600_000_000

    phases: list[tuple[int, Callable[[int], Any]]] = [
        (
            T0,
            lambda i: ev(
                "p",
                i,
                "",
                ShardPlanned(
                    f"/in/{i}", 1, "", "{}", ("out",), "", i, {"provider": providers[i % 3]}
                ),
            ),
        ),
        (
            T0 + 1_000_000,
            lambda i: ev(
                "s",
                i,
                "a",
                AttemptStarted("node", 1, timeout_us(i), {}, "", labels={"pool": "p"}),
            ),
        ),
        (T0 + 11_000_000, lambda i: ev("h", i, "a", Heartbeat(1, 0.5, {}))),
    ]
    store = SqliteStore(path)
    count, head = 0, GENESIS_HASH
    with store.write() as tx:
        run = tx.create_run(check_namespace(""), "night", now_us=T0, genesis=GENESIS_HASH)
        for receive_us, make in phases:
            for i in range(shards):
                count += 1
                event = make(i)
                row = encode_row(
                    validate(event).canonical, run_sequence=count, receive_time_us=receive_us + i
                )
                head = chain_hash(head, row)
                tx.insert_event(
                    run_pk=run.run_pk,
                    run_sequence=count,
                    event_id=event.event_id,
                    row=row,
                    row_hash=head,
                )
                if count % BATCH == 0:
                    tx.flush()
        tx.update_run(run.run_pk, event_count=count, head_hash=head, now_us=receive_us + shards)
    (stored,) = store.read().list_runs(None, 1)
    rebuild_run(store, stored, write=True)
    # Two minutes after the heartbeats: the one-minute attempts are stale.
    now = [T0 + 131_000_000]
    return LedgerService(store, clock=lambda: now[0]), now


def measure(shards: int, repeat: int, stale_pct: int = 50) -> dict[str, Any]:
    """Builds a night of ``shards`` open shards and times scrapes and reports on it."""
    from ledger_server.run_metrics import RunCollector

    with tempfile.TemporaryDirectory(prefix="bench-scrape-") as tmp:
        started = time.perf_counter()
        ledger, now = _night(os.path.join(tmp, "ledger.db"), shards, stale_pct)
        built_s = time.perf_counter() - started
        collector = RunCollector(ledger)
        scrape_cpu, scrape_wall, report_wall, report_cpu = [], [], [], []
        series = 0
        for _ in range(repeat):
            cpu, wall = time.process_time(), time.perf_counter()
            series = sum(len(family.samples) for family in collector.collect())
            scrape_cpu.append(time.process_time() - cpu)
            scrape_wall.append(time.perf_counter() - wall)
        for _ in range(repeat):
            cpu, wall = time.process_time(), time.perf_counter()
            report = ledger.report("", "night")
            report_cpu.append(time.process_time() - cpu)
            report_wall.append(time.perf_counter() - wall)
        summary = ledger.summary("", "night")
        beat_cpu_us = _heartbeat_cpu_us(ledger, now, min(shards, 10_000))
        ledger.close()
    return {
        "shards": shards,
        "running": summary["running"],
        "stale": summary["stale"],
        "series": series,
        "build_s": built_s,
        "scrape_cpu_s": statistics.median(scrape_cpu),
        "scrape_wall_s": statistics.median(scrape_wall),
        "report_s": statistics.median(report_wall),
        "report_cpu_s": statistics.median(report_cpu),
        "report_running_gpu_s": report["costs"]["running_gpu_s"],
        "report_hung_gpu_s": report["costs"]["lost_gpu_s"]["hung"],
        "heartbeat_cpu_us": beat_cpu_us,
    }


def _heartbeat_cpu_us(ledger: Any, now: list[int], beats: int) -> float:
    """Returns the CPU time per appended heartbeat (batches of 500): the writer's own cost."""
    from ledger_server.events import Event, Heartbeat

    events = [
        Event(f"h2-{i}", "", "night", f"s{i:07d}", "a", 0, Heartbeat(2, 0.6, {}))
        for i in range(beats)
    ]
    now[0] += 1_000_000
    cpu = time.process_time()
    for start in range(0, beats, 500):
        ledger.append(events[start : start + 500])
    return (time.process_time() - cpu) / beats * 1e6


def _baseline(rev: str, sizes: list[int], repeat: int, stale_pct: int) -> list[dict[str, Any]]:
    """Runs this script against ``rev``'s ledger_server, in a child process."""
    with tempfile.TemporaryDirectory(prefix="bench-scrape-base-") as tmp:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", rev, "ledger_server", "shard_client"],
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        out = os.path.join(tmp, "result.json")
        argv = [sys.executable, __file__, "--only-measure", "-o", out, "--repeat", str(repeat)]
        argv += ["--stale-percent", str(stale_pct)]
        for size in sizes:
            argv += ["--shards", str(size)]
        env = dict(os.environ, PYTHONPATH=tmp)
        subprocess.run(argv, env=env, cwd=tmp, check=True)
        result: list[dict[str, Any]] = json.loads(Path(out).read_text())
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--shards", type=int, action="append", help="open shards (repeatable)")
    parser.add_argument("--repeat", type=int, default=5, help="scrapes and reports timed per size")
    parser.add_argument(
        "--baseline-rev", default="3a23a2e", help="the revision measured as the baseline"
    )
    parser.add_argument(
        "--stale-percent",
        type=int,
        default=50,
        help="percent of the open attempts with a one-minute timeout, stale when measured",
    )
    parser.add_argument("--no-baseline", action="store_true", help="measure this tree only")
    parser.add_argument("--only-measure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("-o", "--output", default=str(REPO / "bench-results" / "scrape.json"))
    args = parser.parse_args(argv)
    sizes = args.shards or [10_000, 100_000]
    runs = [measure(n, args.repeat, args.stale_percent) for n in sizes]
    if args.only_measure:
        Path(args.output).write_text(json.dumps(runs))
        return 0
    base = (
        []
        if args.no_baseline
        else _baseline(args.baseline_rev, sizes, args.repeat, args.stale_percent)
    )
    result: dict[str, Any] = {
        "env": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "load_average": os.getloadavg(),
        "targets": {"scrape_cpu_s": TARGET_SCRAPE_CPU_S, "report_s": TARGET_REPORT_S},
        "baseline_rev": None if args.no_baseline else args.baseline_rev,
        "stale_percent": args.stale_percent,
        "sizes": [],
    }
    for i, new in enumerate(runs):
        row: dict[str, Any] = {"new": new}
        if base:
            old = base[i]
            row["baseline"] = old
            row["scrape_cpu_ratio"] = new["scrape_cpu_s"] / old["scrape_cpu_s"]
            row["report_ratio"] = new["report_s"] / old["report_s"]
            row["heartbeat_cpu_ratio"] = new["heartbeat_cpu_us"] / old["heartbeat_cpu_us"]
            row["same_figures"] = (
                abs(new["report_running_gpu_s"] - old["report_running_gpu_s"]) < 1e-6
                and abs(new["report_hung_gpu_s"] - old["report_hung_gpu_s"]) < 1e-6
                and new["series"] == old["series"]
            )
        row["scrape_target_met"] = new["scrape_cpu_s"] <= TARGET_SCRAPE_CPU_S
        row["report_target_met"] = new["report_s"] <= TARGET_REPORT_S
        result["sizes"].append(row)
        line = (
            f"{new['shards']:>7} open ({new['running']} running, {new['stale']} stale):"
            f" scrape {new['scrape_cpu_s'] * 1e3:.2f} ms CPU, report {new['report_s'] * 1e3:.1f} ms"
            f" ({new['report_cpu_s'] * 1e3:.1f} ms CPU)"
        )
        if base:
            line += (
                f" | baseline scrape {base[i]['scrape_cpu_s'] * 1e3:.1f} ms CPU"
                f" ({row['scrape_cpu_ratio']:.4f}x), report {base[i]['report_s'] * 1e3:.0f} ms"
                f" ({row['report_ratio']:.3f}x; {base[i]['report_cpu_s'] * 1e3:.0f} ms CPU),"
                f" same figures: {row['same_figures']}"
            )
        print(line, flush=True)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"saved {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
