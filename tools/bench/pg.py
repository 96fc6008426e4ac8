"""Benchmarks batched ingest on PostgreSQL: one and two replicas against raw inserts.

    python -m tools.bench.pg [--database-url postgresql://USER@HOST/postgres] [--seconds 6]

Each phase runs in a fresh database on the same server:

- raw: 8 connections, each committing transactions of 100 pre-built event rows
  (executemany, pipelined) straight into the events table: the database's own
  ceiling for this batch shape, measured in the same run;
- ledger x1 / x2: `shardledger serve` processes on the database, 8 client threads
  each appending 100 events per call (50 new shards: planned + started) to its
  own run, spread over the replicas;
- sqlite x1: the same load on one server over its embedded SQLite file, for
  reference (what the ledger's own work costs without PostgreSQL).

Prints events/s, the ratio to raw, append latency, and the versions that matter
(grpcio, psycopg, libpq, PostgreSQL); saves JSON under bench-results/. Without
--database-url a repository checkout starts a throwaway durable cluster (fsync on).
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
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit, urlunsplit

import grpc
import psycopg

from ledger_server.chain import GENESIS_HASH, chain_hash
from ledger_server.store.postgres import PostgresStore
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient

CLIENTS: Final = 8
BATCH: Final = 100
DIGEST: Final = "a" * 64


def _database(admin_url: str) -> str:
    name = f"bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return urlunsplit(urlsplit(admin_url)._replace(path="/" + name))


def _run_for(
    seconds: float, work: Callable[[int, threading.Event], tuple[int, list[float]]]
) -> dict[str, Any]:
    stop = threading.Event()
    results: list[tuple[int, list[float]]] = [(0, [])] * CLIENTS

    def worker(i: int) -> None:
        results[i] = work(i, stop)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(CLIENTS)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    events = sum(n for n, _ in results)
    latencies = sorted(x for _, lat in results for x in lat)
    return {
        "events": events,
        "seconds": round(elapsed, 3),
        "events_per_s": round(events / elapsed),
        "latency_ms_p50": round(statistics.median(latencies) * 1000, 2) if latencies else None,
        "latency_ms_p99": round(latencies[int(len(latencies) * 0.99)] * 1000, 2)
        if latencies
        else None,
    }


def bench_raw(url: str, seconds: float) -> dict[str, Any]:
    """Measures 100-row transactions straight into the events table, 8 connections."""
    PostgresStore(url).close()  # the schema
    with psycopg.connect(url, autocommit=True) as conn:
        pks = [
            row[0]
            for row in conn.execute(
                "INSERT INTO runs (namespace, run_id, event_count, head_hash, created_us,"
                " updated_us) SELECT 'default', 'raw-' || i, 0, %s, 0, 0"
                " FROM generate_series(1, %s) AS i RETURNING run_pk",
                (GENESIS_HASH, CLIENTS),
            )
        ]
    body = b'{"event":{"kind":"heartbeat","payload":{}},"receive_time_us":0,"run_sequence":0}'

    def work(i: int, stop: threading.Event) -> tuple[int, list[float]]:
        done, latencies, prev = 0, [], GENESIS_HASH
        with psycopg.connect(url) as conn:
            conn.execute("SET synchronous_commit = on")
            conn.commit()
            while not stop.is_set():
                rows = []
                for _ in range(BATCH):
                    prev = chain_hash(prev, body)
                    done += 1
                    rows.append((pks[i], done, uuid.uuid4().hex, body, prev))
                t0 = time.perf_counter()
                with conn.cursor() as cur:
                    cur.executemany(
                        'INSERT INTO events (run_pk, run_seq, event_id, "row", hash)'
                        " VALUES (%s, %s, %s, %s, %s)",
                        rows,
                    )
                conn.commit()
                latencies.append(time.perf_counter() - t0)
        return done, latencies

    return _run_for(seconds, work)


@contextmanager
def _replicas(url: str, count: int, workdir: Path) -> Iterator[list[str]]:
    procs, targets = [], []
    try:
        for n in range(count):
            port_file = workdir / f"replica-{n}.port"
            port_file.unlink(missing_ok=True)
            procs.append(
                subprocess.Popen(
                    [
                        *(sys.executable, "-m", "shardledger_cli", "serve", "--db", url),
                        *("--listen", "127.0.0.1:0", "--port-file", str(port_file)),
                        *("--signing-key", str(workdir / "key.pem"), "--log-level", "warning"),
                    ],
                    stderr=subprocess.DEVNULL,
                )
            )
            deadline = time.monotonic() + 60
            while not port_file.exists():
                if procs[-1].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("a replica did not start")
                time.sleep(0.05)
            targets.append(f"127.0.0.1:{port_file.read_text()}")
        yield targets
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)


def _batch(run: str, start: int) -> list[pb.ShardEvent]:
    events = []
    for k in range(start, start + BATCH // 2):
        shard = f"s{k}"
        events.append(
            pb.ShardEvent(
                event_id=uuid.uuid4().hex,
                run_id=run,
                shard_id=shard,
                planned=pb.ShardPlanned(
                    input_ref=f"/data/{shard}",
                    input_bytes=1,
                    input_blake3=DIGEST,
                    params_json="{}",
                    expected_outputs=["out"],
                    plan_index=k,
                ),
            )
        )
        events.append(
            pb.ShardEvent(
                event_id=uuid.uuid4().hex,
                run_id=run,
                shard_id=shard,
                attempt_id="a1",
                started=pb.AttemptStarted(host="h", pid=1, fingerprint_digest=DIGEST),
            )
        )
        events[-1].started.heartbeat_timeout.seconds = 600
    return events


def bench_ledger(url: str, replicas: int, seconds: float, workdir: Path) -> dict[str, Any]:
    """Measures 100-event appends through `count` replicas, 8 client threads."""
    with _replicas(url, replicas, workdir) as targets:
        clients = [LedgerClient(targets[i % len(targets)], timeout_s=60) for i in range(CLIENTS)]
        for c in clients:
            c.append(_batch(f"warm-{uuid.uuid4().hex}", 0))

        def work(i: int, stop: threading.Event) -> tuple[int, list[float]]:
            done, latencies, run = 0, [], f"bench-{i}-{uuid.uuid4().hex[:6]}"
            while not stop.is_set():
                batch = _batch(run, done // 2)
                t0 = time.perf_counter()
                clients[i].append(batch)
                latencies.append(time.perf_counter() - t0)
                done += len(batch)
            return done, latencies

        return _run_for(seconds, work)


def _versions(url: str) -> dict[str, str]:
    with psycopg.connect(url) as conn:
        server = str(conn.execute("SHOW server_version").fetchone()[0])  # type: ignore[index]
        settings = {
            name: str(conn.execute(f"SHOW {name}").fetchone()[0])  # type: ignore[index]
            for name in ("fsync", "synchronous_commit", "shared_buffers")
        }
    return {
        "grpcio": grpc.__version__,
        "psycopg": psycopg.__version__,
        "libpq": str(psycopg.pq.version()),
        "postgresql": server,
        "python": platform.python_version(),
        "cpus": str(os.cpu_count()),
        **{f"pg_{k}": v for k, v in settings.items()},
    }


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark and prints and saves its figures."""
    parser = argparse.ArgumentParser(prog="python -m tools.bench.pg", description=__doc__)
    parser.add_argument("--database-url", default=None, help="admin URL (CREATE DATABASE)")
    parser.add_argument("--seconds", type=float, default=6.0, help="per phase")
    parser.add_argument("--out", default="bench-results/bench_pg.json")
    args = parser.parse_args(argv)
    cluster = None
    admin = args.database_url
    if admin is None:
        from tests.pg import start_cluster  # a repository checkout only

        cluster = start_cluster(durable=True)
        admin = cluster.admin_url
    try:
        with tempfile.TemporaryDirectory() as tmp:
            results = {
                "raw": bench_raw(_database(admin), args.seconds),
                "ledger_x1": bench_ledger(_database(admin), 1, args.seconds, Path(tmp)),
                "ledger_x2": bench_ledger(_database(admin), 2, args.seconds, Path(tmp)),
                # The same server on its embedded SQLite: tells the database's share apart
                # from the ledger's own Python work.
                "sqlite_x1": bench_ledger(
                    f"sqlite:///{Path(tmp) / 'ledger.db'}", 1, args.seconds, Path(tmp)
                ),
            }
        versions = _versions(admin)
    finally:
        if cluster is not None:
            cluster.destroy()
    raw = results["raw"]["events_per_s"]
    for phase in results.values():
        phase["ratio_to_raw"] = round(phase["events_per_s"] / raw, 3) if raw else None
    report = {"clients": CLIENTS, "batch": BATCH, "results": results, "versions": versions}
    for name, r in results.items():
        print(
            f"{name:>10}: {r['events_per_s']:>9,} events/s  ratio {r['ratio_to_raw']:.2f}"
            f"  p50 {r['latency_ms_p50']} ms  p99 {r['latency_ms_p99']} ms"
        )
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
