# Over 400 lines on purpose: one benchmark script (populate, measure, report) read top to bottom.
"""Benchmarks the read side at scale: `status` latency and resume-list streaming rate.

    python -m tools.bench.projections --shards 1000000 [--via-grpc] [--profile]

Plans N shards into a LedgerService on a temp SQLite file (batched appends straight
into the LedgerService, or through gRPC with --via-grpc), moves a fraction of them
through their life cycle, then measures, through the real gRPC server and
through the LedgerService directly:

- status: the run summary's latency (median of --repeat calls);
- resume: the resume list's streaming rate in lines/s (gRPC path: the CLI's
  own writer into /dev/null; the server runs in its own process, as deployed);
- baseline: a raw SQLite SELECT of the same number of plan lines, so the
  ratio says what the layers above the database cost.

Targets: status < 1 s (stretch 200 ms); resume >= 100,000 lines/s (stretch
200,000). Results go to bench-results/projections.json.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import platform
import pstats
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import grpc

from ledger_server import codec
from ledger_server.events import (
    ArtifactCommitted,
    ArtifactVerified,
    AttemptFailed,
    AttemptStarted,
    Event,
    Payload,
    ShardPlanned,
)
from ledger_server.service import LedgerService
from ledger_server.servicer import LedgerServicer
from ledger_server.store.sqlite import SqliteStore
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.canonical import canonical_json, fingerprint_digest
from shard_client.client import LedgerClient
from shardledger_cli.output import write_lines

RUN: Final = "bench-run"
SUMMARY_KEYS: Final = (
    "submitted",
    "verified",
    "failed",
    "missing",
    "running",
    "stale",
    "unverified",
)
BATCH: Final = 10_000
DIGEST: Final = "ab" * 32
FP: Final = fingerprint_digest({"gpu": "H100"})  # the ledger refuses any other for the map
TARGETS: Final = {
    "status_s": 1.0,
    "status_stretch_s": 0.2,
    "resume_lines_per_s": 100_000,
    "resume_stretch_lines_per_s": 200_000,
}
# The life-cycle mix of the shards that are not left "planned": (share, fate).
MIX: Final = (
    (0.10, "verified"),
    (0.02, "failed"),
    (0.01, "running"),
    (0.01, "stale"),
    (0.01, "committed"),
    (0.005, "verify_failed"),
)


def shard_id(i: int) -> str:
    """Returns the id of the i-th benchmark shard."""
    return f"shard-{i:08d}"


def ev(i: int, n: int, attempt: str, payload: Payload) -> Event:
    """Returns the n-th event of shard i."""
    return Event(f"bench-{i}-{n}", "", RUN, shard_id(i), attempt, 0, payload)


def plan_events(count: int) -> Iterator[Event]:
    """Yields one planned event per shard."""
    for i in range(count):
        line = canonical_json(
            {"shard_id": shard_id(i), "input": f"s3://bench/in/{i:08d}.bin", "params": {"seed": i}}
        )
        payload = ShardPlanned(
            input_ref=f"s3://bench/in/{i:08d}.bin",
            input_bytes=1 << 20,
            input_blake3="",
            params_json=f'{{"seed":{i}}}',
            expected_outputs=("out",),
            plan_line=line,
            plan_index=i,
        )
        yield ev(i, 0, "", payload)


def life_events(count: int) -> Iterator[Event]:
    """Yields the events that move a share of the shards along their life cycle."""
    i = 0
    for share, fate in MIX:
        for _ in range(int(count * share)):
            timeout = 1 if fate == "stale" else 3600 * 1_000_000
            yield ev(i, 1, "a1", AttemptStarted("node-1", 42, timeout, {"gpu": "H100"}, FP))
            if fate == "failed":
                yield ev(i, 2, "a1", AttemptFailed("oom", "CUDA out of memory"))
            if fate in ("verified", "committed", "verify_failed"):
                path = f"/out/{shard_id(i)}.bin"
                yield ev(i, 2, "a1", ArtifactCommitted("out", path, 100, DIGEST, ""))
                if fate != "committed":
                    result, reason = ("passed", "") if fate == "verified" else ("failed", "size")
                    yield ev(i, 3, "", ArtifactVerified("out", path, DIGEST, result, reason, ""))
            i += 1


def batches(events: Iterator[Event], size: int = BATCH) -> Iterator[list[Event]]:
    """Groups events into lists of at most size."""
    batch: list[Event] = []
    for event in events:
        batch.append(event)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def load(append: Callable[[list[Event]], object], events: Iterator[Event]) -> dict[str, float]:
    """Appends every event in batches; returns count, seconds and events/s."""
    start, n = time.perf_counter(), 0
    for batch in batches(events):
        append(batch)
        n += len(batch)
    seconds = time.perf_counter() - start
    return {"events": n, "seconds": round(seconds, 3), "events_per_s": round(n / seconds)}


def median_latency(call: Callable[[], Any], repeat: int) -> dict[str, float]:
    """Returns the median, min and max of repeat timed calls, in seconds."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def rate(consume: Callable[[], int], repeat: int) -> dict[str, float]:
    """Returns the best and median lines/s of repeat full consumptions."""
    rates, lines = [], 0
    for _ in range(repeat):
        start = time.perf_counter()
        lines = consume()
        rates.append(lines / (time.perf_counter() - start))
    return {
        "lines": lines,
        "best_lines_per_s": max(rates),
        "median_lines_per_s": statistics.median(rates),
    }


def raw_select(db: str, rows: int) -> int:
    """Reads the same number of plan lines with one plain SQLite query."""
    conn = sqlite3.connect(db)
    try:
        n = 0
        sql = "SELECT plan_line FROM shards ORDER BY run_pk, plan_index, shard_id LIMIT ?"
        for (line,) in conn.execute(sql, (rows,)):
            n += len(line) > 0
        return n
    finally:
        conn.close()


def resume_via_grpc(client: LedgerClient) -> int:
    """Streams the resume list through gRPC and the CLI's writer into /dev/null."""
    reasons: Counter[str] = Counter()
    with open(os.devnull, "w") as sink:
        write_lines(client.resume(RUN), sink, reasons, ids=False, with_reason=False)
    return sum(reasons.values())


def resume_direct(ledger: LedgerService) -> int:
    """Consumes the resume list straight from the LedgerService."""
    n = 0
    for item in ledger.resume("", RUN):
        n += len(item.plan_line) > 0
    return n


def resume_server_side(ledger: LedgerService) -> int:
    """Runs the servicer's StreamResumeList and serializes each chunk, without transport."""
    servicer = LedgerServicer(ledger)
    request = pb.StreamResumeListRequest(run_id=RUN)
    n = 0
    for chunk in servicer.StreamResumeList(request, None):  # type: ignore[arg-type]
        n += len(chunk.entries)
        chunk.SerializeToString()
    return n


def profiled(call: Callable[[], Any], top: int = 18) -> str:
    """Runs call under cProfile and returns the top functions by cumulative time."""
    profile = cProfile.Profile()
    profile.enable()
    call()
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


@contextlib.contextmanager
def server_process(db: str) -> Iterator[str]:
    """Runs `shardledger serve` on db in its own process and yields its address.

    A separate process, as in production: a server in the benchmark's own
    process would share one GIL with the client and halve both.
    """
    port_file = db + ".port"
    command = [
        sys.executable,
        "-m",
        "shardledger_cli",
        "serve",
        "--db",
        db,
        "--listen",
        "127.0.0.1:0",
    ]
    command += ["--port-file", port_file, "--log-level", "warning"]
    proc = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(port_file):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start (exit code {proc.poll()})")
            time.sleep(0.05)
        yield f"127.0.0.1:{Path(port_file).read_text().strip()}"
    finally:
        proc.terminate()
        proc.wait(60)


def populate(args: argparse.Namespace, db: str, target: str | None) -> dict[str, Any]:
    """Plans and moves the shards (through gRPC when target is given); returns load figures."""
    figures: dict[str, Any] = {}
    if target is not None:
        client = LedgerClient(target, timeout_s=600)

        def append(batch: list[Event]) -> None:
            client.append([codec.encode_event(e) for e in batch])

        figures["plan"] = load(append, plan_events(args.shards))
        figures["life"] = load(append, life_events(args.shards))
        client.close()
        return figures
    store = SqliteStore(db)
    ledger = LedgerService(store)
    figures["plan"] = load(lambda b: ledger.append(b, timeout=600), plan_events(args.shards))
    figures["life"] = load(lambda b: ledger.append(b, timeout=600), life_events(args.shards))
    ledger.close()
    store.close()
    return figures


def measure(args: argparse.Namespace, db: str) -> dict[str, Any]:
    """Runs the whole benchmark and returns the results."""
    started = time.perf_counter()
    if not args.via_grpc:
        figures = populate(args, db, None)
    with server_process(db) as target:
        if args.via_grpc:
            figures = populate(args, db, target)
        client = LedgerClient(target, timeout_s=600)
        store = SqliteStore(db)
        ledger = LedgerService(store)
        try:
            summary = ledger.summary("", RUN)
            status = {
                "grpc": median_latency(lambda: client.summary(RUN), args.repeat),
                "direct": median_latency(lambda: ledger.summary("", RUN), args.repeat),
            }
            resume = {
                "grpc": rate(lambda: resume_via_grpc(client), args.resume_repeat),
                "direct": rate(lambda: resume_direct(ledger), args.resume_repeat),
                "server_side": rate(lambda: resume_server_side(ledger), args.resume_repeat),
            }
            lines = int(resume["direct"]["lines"])
            baseline = rate(lambda: raw_select(db, lines), args.resume_repeat)
            profiles = {}
            if args.profile:
                profiles["resume_direct"] = profiled(lambda: resume_direct(ledger))
                profiles["resume_server_side"] = profiled(lambda: resume_server_side(ledger))
                profiles["resume_grpc_client"] = profiled(lambda: resume_via_grpc(client))
        finally:
            client.close()
            ledger.close()
            store.close()
    best = {k: v["best_lines_per_s"] for k, v in resume.items()}
    return {
        "shards": args.shards,
        "via_grpc": args.via_grpc,
        "summary": {k: summary[k] for k in SUMMARY_KEYS},
        "load": figures,
        "status_latency": status,
        "resume": resume,
        "raw_sqlite_select": baseline,
        "ratios": {
            "resume_grpc_vs_raw_select": best["grpc"] / baseline["best_lines_per_s"],
            "resume_direct_vs_raw_select": best["direct"] / baseline["best_lines_per_s"],
        },
        "targets": TARGETS,
        "met": {
            "status": status["grpc"]["median_s"] < TARGETS["status_s"],
            "status_stretch": status["grpc"]["median_s"] < TARGETS["status_stretch_s"],
            "resume": best["grpc"] >= TARGETS["resume_lines_per_s"],
            "resume_stretch": best["grpc"] >= TARGETS["resume_stretch_lines_per_s"],
        },
        "environment": {
            "grpcio": grpc.__version__,
            "python": platform.python_version(),
            "sqlite": sqlite3.sqlite_version,
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
            "machine": platform.machine(),
            "db_bytes": os.path.getsize(db),
        },
        "total_seconds": round(time.perf_counter() - started, 1),
        "profiles": profiles,
    }


def report(r: dict[str, Any]) -> str:
    """Returns the human summary of a result."""
    st, rs, env, met = r["status_latency"], r["resume"], r["environment"], r["met"]
    best = {
        k: f"{v['best_lines_per_s']:,.0f}"
        for k, v in (rs | {"raw": r["raw_sqlite_select"]}).items()
    }
    return "\n".join(
        [
            f"shards {r['shards']:,} (planned via gRPC: {r['via_grpc']}), grpcio {env['grpcio']},"
            f" sqlite {env['sqlite']}, {env['cpus']} CPUs, load average {env['load_average'][0]:.1f}",
            f"load    plan {r['load']['plan']['events_per_s']:,} events/s,"
            f" life cycle {r['load']['life']['events_per_s']:,} events/s",
            f"status  gRPC median {st['grpc']['median_s'] * 1e3:.2f} ms,"
            f" direct {st['direct']['median_s'] * 1e3:.2f} ms"
            f"  (target < 1 s: {met['status']}; stretch < 200 ms: {met['status_stretch']})",
            f"resume  {rs['grpc']['lines']:,} lines, lines/s: gRPC {best['grpc']}, direct {best['direct']},"
            f" servicer without transport {best['server_side']}, raw SELECT {best['raw']} rows/s",
            f"ratios  gRPC/raw {r['ratios']['resume_grpc_vs_raw_select']:.3f},"
            f" direct/raw {r['ratios']['resume_direct_vs_raw_select']:.3f}"
            f"  (target >= 100k: {met['resume']}; stretch >= 200k: {met['resume_stretch']})",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark and saves the JSON result."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.projections", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--shards", type=int, default=100_000, help="shards to plan")
    parser.add_argument("--via-grpc", action="store_true", help="plan through gRPC")
    parser.add_argument("--repeat", type=int, default=9, help="status calls to take the median of")
    parser.add_argument("--resume-repeat", type=int, default=3, help="resume streams per path")
    parser.add_argument("--profile", action="store_true", help="cProfile the resume paths")
    parser.add_argument("--dir", default=None, help="where the temp SQLite file goes")
    parser.add_argument("--out", default="bench-results/projections.json", help="JSON result file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-projections-") as tmp:
        result = measure(args, str(Path(tmp) / "ledger.db"))
    print(report(result))
    for name, text in result["profiles"].items():
        print(f"\n--- profile: {name} ---\n{text}")
    save_result(args.out, result)
    return 0


def save_result(out: str, result: dict[str, Any]) -> None:
    """Writes a benchmark's JSON result (sorted keys) and says where."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"saved {out}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
