# Over 400 lines on purpose: four ingest benchmarks sharing one harness and one entry point.
"""Ingest benchmarks: each measures its own baseline in the same run and prints ratios.

    python -m tools.bench unary     durable single-event appends vs a bare grpcio echo server
    python -m tools.bench batched   100-event appends (chain + projections) vs the minimal durable server and raw SQLite
    python -m tools.bench artifact  SDK atomic_write vs raw write+fsync+rename (256 MiB and 4 KiB)
    python -m tools.bench sdk       heartbeat thread CPU and emit blocking time, server up and down
    python -m tools.bench coalesce  events per shard-hour, progress() every step, coalesced or not
    python -m tools.bench fleet     1,000 / 5,000 / 10,000 open channels at the SDK's cadence + readers
    python -m tools.bench engines   unary and batched on each engine (aio, aio-executor, threads)
    python -m tools.bench overload  10,000 channels at 1x then 2x the cadence (tools.bench.overload)
    python -m tools.bench cli       CPU of `--help`, `status`, `resume` vs `python -c pass` (tools.bench.cli)
    python -m tools.bench peers     in process: the ledger vs eventsourcing (bench extra) and raw SQLite
    python -m tools.bench stream    server CPU of a streamed append vs a unary one, with echo baselines (tools.bench.stream)
    python -m tools.bench job       what the SDK costs a job: per process, shard, heartbeat, commit (tools.bench.job)
    python -m tools.bench report    `report` vs `status` on a 1,000,000-shard / 8.8M-event night (~10 min)
    python -m tools.bench retention a compressed year with and without archiving (tools.bench.retention)
    python -m tools.bench scrape    /metrics CPU and report time at 10,000 and 100,000 open shards, old and new (tools.bench.scrape)
    python -m tools.bench all       everything but report, job, retention and scrape; JSON lands in bench-results/ingest.json

No timing is asserted anywhere in the test suite: numbers live here and in docs/performance.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import platform
import secrets
import sqlite3
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import blake3
import grpc

from ledger_server.config import ENGINES, ServerConfig
from ledger_server.server import create_server
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from tools.bench.cli import bench_cli
from tools.bench.coalesce import bench_coalesce
from tools.bench.echo import echo_server, process_cpu_s
from tools.bench.fleet import bench_fleet
from tools.bench.job import bench_job
from tools.bench.job import report as show_job
from tools.bench.peers import bench_peers
from tools.bench.projections import save_result
from tools.bench.report import bench_report
from tools.bench.stream import bench_stream

RESULTS = Path("bench-results")
ECHO_METHOD = "/bench.Echo/Echo"
# "sdk": ids as shard_client's new_event_id makes them (a random per-process prefix and a
# counter), so each client's ids land near each other in the unique index; "uuid4": ids
# from a foreign client, random across the whole index. Both sides of a ratio use the same.
ID_STYLES = ("sdk", "uuid4")
# The targets (docs/performance.md): unary appends/s over a bare echo's, same run; the
# minimal durable server's CPU per event over the ledger's, batched, same run.
UNARY_TARGET = 0.70
BATCHED_CPU_TARGET = 0.35
id_style = "sdk"


def _id_source() -> Callable[[], str]:
    """Returns one client process's event id generator in the chosen style."""
    if id_style == "uuid4":
        return lambda: uuid.uuid4().hex
    prefix, counter = secrets.token_hex(10), itertools.count()
    return lambda: f"{prefix}-{next(counter):x}"


def _env() -> dict[str, Any]:
    return {
        "grpcio": grpc.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


# --- load generation ---------------------------------------------------------


def _aio_echo_server() -> tuple[Callable[[], None], int]:
    """A bare grpc.aio echo on its own event loop thread: the floor of the asyncio engine.

    Returns (stop, port). The unary target is against the threaded echo; this one says
    how much of the ratio grpc.aio's own per-call cost takes before the ledger adds any.
    """
    import asyncio

    ready = threading.Event()
    box: list[grpc.aio.Server] = []
    ports: list[int] = []
    loop = asyncio.new_event_loop()

    async def echo(request: bytes, context: Any) -> bytes:
        return request

    async def start() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
                ),
            )
        )
        ports.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        box.append(server)
        ready.set()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        loop.run_forever()

    thread = threading.Thread(target=run, name="bench-aio-echo", daemon=True)
    thread.start()
    ready.wait()

    def stop() -> None:
        done = asyncio.run_coroutine_threadsafe(box[0].stop(0), loop)
        done.result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)

    return stop, ports[0]


def _minimal_server(path: str) -> tuple[grpc.Server, int]:
    """The minimal durable gRPC server: fields read in Python, one executemany and commit per call.

    The same-run baseline for batched ingest: it answers AppendEvents at the ledger's
    own method path (with an empty response) and keeps each event's id, run, shard,
    kind and bytes in SQLite (WAL, synchronous=FULL, a unique index on the id). No
    chain, no projections, no validation: what the stack reaches at its simplest.
    """
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute(
        "CREATE TABLE events (seq INTEGER PRIMARY KEY, event_id TEXT NOT NULL UNIQUE,"
        " run_id TEXT NOT NULL, shard_id TEXT NOT NULL, kind TEXT, body BLOB NOT NULL)"
    )
    lock = threading.Lock()

    def append(request: bytes, context: grpc.ServicerContext) -> bytes:
        events = pb.AppendEventsRequest.FromString(request).events
        rows = [
            (e.event_id, e.run_id, e.shard_id, e.WhichOneof("payload"), e.SerializeToString())
            for e in events
        ]
        with lock:
            conn.execute("BEGIN")
            conn.executemany(
                "INSERT OR IGNORE INTO events (event_id, run_id, shard_id, kind, body)"
                " VALUES (?, ?, ?, ?, ?)",
                rows,
            )
            conn.execute("COMMIT")
        return b""

    handler = grpc.method_handlers_generic_handler(
        "shardledger.v1.LedgerService",
        {"AppendEvents": grpc.unary_unary_rpc_method_handler(append)},
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def _client_proc(
    kind: str, port: int, threads: int, seconds: float, payloads: list[bytes], out: Any
) -> None:
    """Runs `threads` closed-loop callers for `seconds`; reports the call count."""
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    method = ECHO_METHOD if kind == "echo" else "/shardledger.v1.LedgerService/AppendEvents"
    call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    stop = time.monotonic() + seconds
    counts = [0] * threads
    errors = [0] * threads

    def loop(i: int) -> None:
        j = i
        while time.monotonic() < stop:
            try:
                call(payloads[j % len(payloads)], timeout=30)
                counts[i] += 1
            except grpc.RpcError:
                errors[i] += 1
            j += threads

    ts = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    out.put((sum(counts), sum(errors)))


def _drive(
    kind: str, port: int, *, procs: int, threads: int, seconds: float, payloads: list[list[bytes]]
) -> dict[str, float]:
    queue: Any = mp.get_context("spawn").Queue()
    ctx = mp.get_context("spawn")
    workers = [
        ctx.Process(target=_client_proc, args=(kind, port, threads, seconds, payloads[i], queue))
        for i in range(procs)
    ]
    start = time.monotonic()
    # The server under test runs in this process: its CPU time (every thread, user and
    # system) over the drive, per call, is what one call costs the server.
    cpu_before = process_cpu_s()
    for w in workers:
        w.start()
    results = [queue.get() for _ in workers]
    cpu_s = process_cpu_s() - cpu_before
    for w in workers:
        w.join()
    elapsed = time.monotonic() - start
    calls = sum(r[0] for r in results)
    return {
        "calls": calls,
        "errors": sum(r[1] for r in results),
        "seconds": seconds,
        "calls_per_s": calls / seconds,
        "wall_s": elapsed,
        "server_cpu_us_per_call": round(1e6 * cpu_s / max(calls, 1), 1),
    }


def _heartbeat_payloads(
    client: LedgerClient, run_id: str, shards: int, per_call: int, count: int
) -> list[bytes]:
    new_id = _id_source()
    plans = []
    starts = []
    for i in range(shards):
        plans.append(
            pb.ShardEvent(
                event_id=new_id(),
                run_id=run_id,
                shard_id=f"s{i}",
                planned=pb.ShardPlanned(input_ref=f"in{i}", plan_index=i),
            )
        )
        starts.append(
            pb.ShardEvent(
                event_id=new_id(),
                run_id=run_id,
                shard_id=f"s{i}",
                attempt_id="a",
                started=pb.AttemptStarted(host="h", pid=1, heartbeat_timeout={"seconds": 600}),
            )
        )
    for k in range(0, shards, 1000):
        client.append(plans[k : k + 1000])
        client.append(starts[k : k + 1000])
    out = []
    for c in range(count):
        events = [
            pb.ShardEvent(
                event_id=new_id(),
                run_id=run_id,
                shard_id=f"s{(c * per_call + j) % shards}",
                attempt_id="a",
                heartbeat=pb.Heartbeat(step=c, progress=0.5, metrics={"loss": 0.1}),
            )
            for j in range(per_call)
        ]
        out.append(pb.AppendEventsRequest(events=events).SerializeToString())
    return out


# --- benchmarks -----------------------------------------------------------------


def bench_unary(
    seconds: float = 5.0, procs: int = 2, threads: int = 32, engine: str = ENGINES[0]
) -> dict[str, Any]:
    """Durable single-event appends vs a bare echo of the same bytes, 64 in flight."""
    with tempfile.TemporaryDirectory() as tmp:
        running = create_server(
            ServerConfig(
                database=f"{tmp}/l.db",
                listen="127.0.0.1:0",
                max_concurrent_rpcs=1024,
                engine=engine,
            )
        )
        client = LedgerClient(f"127.0.0.1:{running.port}")
        per_proc = int(seconds * 4000)
        payloads = [
            _heartbeat_payloads(client, f"unary-{p}", 256, 1, per_proc) for p in range(procs)
        ]
        bare, echo_port = echo_server()
        echo = _drive(
            "echo", echo_port, procs=procs, threads=threads, seconds=seconds, payloads=payloads
        )
        bare.stop(0)
        stop_aio_echo, aio_echo_port = _aio_echo_server()
        aio_echo = _drive(
            "echo", aio_echo_port, procs=procs, threads=threads, seconds=seconds, payloads=payloads
        )
        stop_aio_echo()
        ours = _drive(
            "ledger", running.port, procs=procs, threads=threads, seconds=seconds, payloads=payloads
        )
        groups = running.ledger.stats["groups"]
        events = running.ledger.stats["events"]
        running.stop(1)
    return {
        "workload": f"{procs * threads} concurrent unary callers, 1 heartbeat per call",
        "engine": engine,
        "event_ids": id_style,
        "echo_calls_per_s": round(echo["calls_per_s"]),
        "durable_appends_per_s": round(ours["calls_per_s"]),
        "ratio_to_echo": round(ours["calls_per_s"] / echo["calls_per_s"], 3),
        # CPU time of the server's process (all threads, user + system) per call: the
        # echo server's is gRPC's own cost; the difference is what the ledger adds.
        "echo_server_cpu_us_per_call": echo["server_cpu_us_per_call"],
        "server_cpu_us_per_call": ours["server_cpu_us_per_call"],
        # A bare grpc.aio echo, same run: what the asyncio engine's gRPC costs alone.
        "aio_echo_calls_per_s": round(aio_echo["calls_per_s"]),
        "aio_echo_ratio_to_echo": round(aio_echo["calls_per_s"] / echo["calls_per_s"], 3),
        "aio_echo_server_cpu_us_per_call": aio_echo["server_cpu_us_per_call"],
        "ratio_to_aio_echo": round(ours["calls_per_s"] / aio_echo["calls_per_s"], 3),
        "errors": ours["errors"],
        "events_per_group_commit": round(events / max(groups, 1), 1),
        "target": ">= 0.70 x echo",
        "met": ours["calls_per_s"] / echo["calls_per_s"] >= UNARY_TARGET,
    }


def _raw_sqlite_rate(rows: int, row_bytes: int, clients: int) -> float:
    """Inserts the same shape of rows, 1,000 per transaction, synchronous=FULL, same indexes.

    The ids are made as the clients make theirs (one id source per client process,
    interleaved), so the unique index sees the same key pattern as the ledger's.
    """
    sources = [_id_source() for _ in range(clients)]
    with tempfile.TemporaryDirectory() as tmp:
        conn = sqlite3.connect(f"{tmp}/raw.db", isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute(
            "CREATE TABLE events (seq INTEGER PRIMARY KEY, run_pk INTEGER NOT NULL, run_seq INTEGER NOT NULL,"
            " event_id TEXT NOT NULL UNIQUE, row BLOB NOT NULL, hash BLOB NOT NULL)"
        )
        conn.execute("CREATE UNIQUE INDEX events_by_run ON events (run_pk, seq)")
        body = os.urandom(row_bytes)
        start = time.perf_counter()
        for base in range(0, rows, 1000):
            conn.execute("BEGIN")
            conn.executemany(
                "INSERT INTO events (run_pk, run_seq, event_id, row, hash) VALUES (?, ?, ?, ?, ?)",
                [(1, base + i, sources[i % clients](), body, os.urandom(32)) for i in range(1000)],
            )
            conn.execute("COMMIT")
        elapsed = time.perf_counter() - start
        conn.close()
    return rows / elapsed


def bench_batched(
    seconds: float = 5.0,
    procs: int = 2,
    threads: int = 4,
    engine: str = ENGINES[0],
    raw_rows: int = 200_000,
    minimal: bool = True,
) -> dict[str, Any]:
    """100-event appends from 8 clients vs the minimal durable server and raw SQLite inserts.

    minimal: also drive the minimal durable server (_minimal_server) with the same requests,
    the baseline of the per-event CPU target (issue 52: its CPU per event over ours >= 0.35).
    """
    with tempfile.TemporaryDirectory() as tmp:
        running = create_server(
            ServerConfig(database=f"{tmp}/l.db", listen="127.0.0.1:0", engine=engine)
        )
        client = LedgerClient(f"127.0.0.1:{running.port}")
        per_proc = int(seconds * 300)
        payloads = [
            _heartbeat_payloads(client, f"batch-{p}", 2000, 100, per_proc) for p in range(procs)
        ]
        ours = _drive(
            "ledger", running.port, procs=procs, threads=threads, seconds=seconds, payloads=payloads
        )
        row = running.ledger.store.read().list_events(1, after_sequence=5000, limit=1)
        row_bytes = len(row[0].row) if row else 300
        running.stop(1)
        baseline: dict[str, Any] = {}
        if minimal:
            plain, port = _minimal_server(f"{tmp}/minimal.db")
            simple = _drive(
                "ledger", port, procs=procs, threads=threads, seconds=seconds, payloads=payloads
            )
            plain.stop(0)
            baseline = {
                "minimal_server_events_per_s": round(simple["calls_per_s"] * 100),
                "ratio_to_minimal_server": round(ours["calls_per_s"] / simple["calls_per_s"], 3),
                "minimal_server_cpu_us_per_event": round(simple["server_cpu_us_per_call"] / 100, 1),
                "cpu_ratio_to_minimal_server": round(
                    simple["server_cpu_us_per_call"] / ours["server_cpu_us_per_call"], 3
                ),
                "cpu_target": f">= {BATCHED_CPU_TARGET} x the minimal durable server's CPU per event",
                "cpu_target_met": simple["server_cpu_us_per_call"] / ours["server_cpu_us_per_call"]
                >= BATCHED_CPU_TARGET,
            }
    events_per_s = ours["calls_per_s"] * 100
    raw = _raw_sqlite_rate(raw_rows, row_bytes, procs)
    return {
        **baseline,
        "workload": f"{procs * threads} clients, 100 heartbeats per append, chain + projections",
        "engine": engine,
        "event_ids": id_style,
        "events_per_s": round(events_per_s),
        "raw_sqlite_rows_per_s": round(raw),
        "ratio_to_raw_sqlite": round(events_per_s / raw, 3),
        "server_cpu_us_per_event": round(ours["server_cpu_us_per_call"] / 100, 1),
        "row_bytes": row_bytes,
        "errors": ours["errors"],
        "target": ">= 50,000 events/s and >= 0.60 x raw SQLite",
    }


def _raw_atomic_write(path: Path, data: bytes, chunk: int) -> None:
    tmp = path.with_name(path.name + ".raw-tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        for i in range(0, len(data), chunk):
            os.write(fd, view[i : i + chunk])
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _timed(fn: Callable[[], None], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bench_artifact(big_mib: int = 256, repeat: int = 11) -> dict[str, Any]:
    """SDK atomic_write (streaming blake3) vs raw write+fsync+rename of the same bytes."""
    from shard_client.atomic import atomic_write

    out: dict[str, Any] = {}
    chunk = 4 * 1024 * 1024
    for label, size, reps in (("256MiB", big_mib * 1024 * 1024, repeat), ("4KiB", 4096, 200)):
        data = os.urandom(size)
        with tempfile.TemporaryDirectory(dir=".") as tmp:
            target = Path(tmp) / "artifact.bin"

            def raw(target: Path = target, data: bytes = data) -> None:
                _raw_atomic_write(target, data, chunk)

            def sdk(target: Path = target, data: bytes = data) -> None:
                with atomic_write(target) as fh:
                    view = memoryview(data)
                    for i in range(0, len(data), chunk):
                        fh.write(view[i : i + chunk])

            # Interleaved, so disk writeback from one side does not land on the other's runs.
            raw_samples, sdk_samples = [], []
            # os.sync() first, outside the timing: otherwise each run pays for the previous
            # run's dirty pages and the figures measure writeback order, not the code.
            for _ in range(reps):
                os.sync()
                raw_samples.append(_timed(raw, 1))
                os.sync()
                sdk_samples.append(_timed(sdk, 1))
            raw_s, sdk_s = statistics.median(raw_samples), statistics.median(sdk_samples)

            def hash_only(data: bytes = data) -> None:
                blake3.blake3(data).digest()

            hash_s = _timed(hash_only, reps)
        out[label] = {
            "raw_write_fsync_rename_ms": round(raw_s * 1000, 3),
            "sdk_atomic_write_ms": round(sdk_s * 1000, 3),
            "blake3_only_ms": round(hash_s * 1000, 3),
            "ratio": round(sdk_s / raw_s, 3),
            "overhead_ms": round((sdk_s - raw_s) * 1000, 3),
        }
    out["target"] = "256 MiB: <= 1.10 x raw; 4 KiB: <= raw + 1.5 ms"
    return out


def _thread_cpu_s(native_id: int) -> float:
    """Returns user+system CPU seconds of one thread of this process (Linux /proc)."""
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _percentiles(samples_ns: list[int]) -> dict[str, float]:
    ordered = sorted(samples_ns)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000

    return {"p50_us": pick(0.5), "p99_us": pick(0.99), "max_us": ordered[-1] / 1000}


def bench_sdk(seconds: float = 10.0, events: int = 20_000) -> dict[str, Any]:
    """SDK inside a job: heartbeat thread CPU, and how long emit blocks (server up, then down)."""
    import subprocess
    import sys

    from shard_client import Ledger

    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        cmd = [
            sys.executable,
            "-m",
            "shardledger_cli",
            "serve",
            "--db",
            f"{tmp}/l.db",
            "--listen",
            "127.0.0.1:0",
            "--port-file",
            str(port_file),
            "--log-level",
            "warning",
        ]
        server = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
        while not port_file.exists():
            time.sleep(0.05)
        target = f"127.0.0.1:{port_file.read_text()}"
        client = LedgerClient(target)
        client.append(
            [
                pb.ShardEvent(
                    event_id=uuid.uuid4().hex,
                    run_id="sdk",
                    shard_id="s0",
                    planned=pb.ShardPlanned(input_ref="x"),
                )
            ]
        )
        ledger = Ledger(target, spool_dir=f"{tmp}/spool")
        out: dict[str, Any] = {}
        with ledger.shard(
            "sdk",
            "s0",
            heartbeat_timeout=60,
            heartbeat_interval=1.0,
            fingerprint=False,
            sigterm_grace=None,
            coalesce_progress=False,  # every call an emit: what this measures
        ) as shard:
            beater = next(
                t for t in threading.enumerate() if t.name.startswith("shard_client-heartbeat")
            )
            assert beater.native_id is not None
            cpu0, wall0 = _thread_cpu_s(beater.native_id), time.monotonic()
            time.sleep(seconds)
            cpu = _thread_cpu_s(beater.native_id) - cpu0
            out["heartbeat_thread_cpu_percent"] = round(100 * cpu / (time.monotonic() - wall0), 4)
            for phase in ("server_up", "server_down"):
                if phase == "server_down":
                    server.kill()
                    server.wait()
                samples = []
                for i in range(events):
                    start = time.perf_counter_ns()
                    shard.progress(i, loss=0.5)
                    samples.append(time.perf_counter_ns() - start)
                out[f"emit_{phase}"] = _percentiles(samples)
            # Baseline in the same run: appending to a deque under a lock, the least an
            # in-process queue can cost.
            import collections

            lock, base = threading.Lock(), []
            dq: collections.deque[int] = collections.deque()
            for i in range(events):
                start = time.perf_counter_ns()
                with lock:
                    dq.append(i)
                base.append(time.perf_counter_ns() - start)
            out["baseline_locked_deque_append"] = _percentiles(base)
            # Bring the ledger back on the same address so the spool drains before exit.
            restart = [*cmd[:6], "--listen", target, "--log-level", "warning"]
            server = subprocess.Popen(restart, stderr=subprocess.DEVNULL)
            with shard.atomic_write(Path(tmp) / "out.json", name="out", mode="w") as fh:
                fh.write("{}")
        ledger.flush(120)
        ledger.close()
        server.terminate()
        server.wait()
    out["target"] = (
        "heartbeat thread <= 1 % of a core; emit p99 <= 1 ms, also while the server is down"
    )
    return out


def bench_engines(seconds: float = 5.0, rounds: int = 2) -> dict[str, Any]:
    """Unary and batched appends on each engine, in turn, beside the same run's baselines.

    Rounds alternate the order of the engines (on this machine the second of two
    identical runs tends to win), and each engine's figure is its median over rounds.
    """
    samples: dict[str, dict[str, list[dict[str, Any]]]] = {
        e: {"unary": [], "batched": []} for e in ENGINES
    }
    for n in range(rounds):
        for engine in ENGINES if n % 2 == 0 else ENGINES[::-1]:
            samples[engine]["unary"].append(bench_unary(seconds, engine=engine))
            samples[engine]["batched"].append(bench_batched(seconds, engine=engine, minimal=True))
            print(engine, samples[engine]["unary"][-1], samples[engine]["batched"][-1], flush=True)

    def median(engine: str, kind: str, key: str) -> float:
        return float(statistics.median(s[key] for s in samples[engine][kind]))

    threads = ENGINES[-1]
    table = {}
    for engine in ENGINES:
        unary = median(engine, "unary", "durable_appends_per_s")
        batched = median(engine, "batched", "events_per_s")
        table[engine] = {
            "unary_appends_per_s": round(unary),
            "unary_ratio_to_echo": round(median(engine, "unary", "ratio_to_echo"), 3),
            "unary_server_cpu_us_per_call": round(
                median(engine, "unary", "server_cpu_us_per_call"), 1
            ),
            "unary_vs_threads": round(unary / median(threads, "unary", "durable_appends_per_s"), 3),
            "batched_events_per_s": round(batched),
            "batched_ratio_to_raw_sqlite": round(
                median(engine, "batched", "ratio_to_raw_sqlite"), 3
            ),
            "batched_server_cpu_us_per_event": round(
                median(engine, "batched", "server_cpu_us_per_event"), 1
            ),
            "batched_vs_threads": round(batched / median(threads, "batched", "events_per_s"), 3),
            "batched_ratio_to_minimal_server": round(
                median(engine, "batched", "ratio_to_minimal_server"), 3
            ),
            # The minimal server's CPU per event over ours: the issue's >= 0.35 target.
            "batched_cpu_ratio_to_minimal_server": round(
                median(engine, "batched", "cpu_ratio_to_minimal_server"), 3
            ),
        }
    return {
        "workload": "bench unary (64 callers, 1 event per call, beside a grpcio echo) and bench"
        f" batched (8 clients, 100 events per call, beside raw SQLite), {rounds} rounds",
        "engines": table,
        "samples": samples,
    }


def bench_overload_both(seconds: float = 30.0) -> dict[str, Any]:
    """10,000 channels at 1x then 2x the SDK's cadence against one server (tools/bench/overload.py)."""
    from ledger_server.server import raise_fd_limit
    from tools.bench.overload import measure

    raise_fd_limit()
    result: dict[str, Any] = measure(
        ".", [], connections=10_000, seconds=seconds, speedups=[1.0, 2.0], pin=True
    )
    return result


BENCHES: dict[str, Callable[..., dict[str, Any]]] = {
    "unary": bench_unary,
    "batched": bench_batched,
    "artifact": bench_artifact,
    "sdk": bench_sdk,
    "coalesce": bench_coalesce,
    "fleet": bench_fleet,
    "engines": bench_engines,
    "overload": bench_overload_both,
    "cli": bench_cli,
    "peers": bench_peers,
    "report": bench_report,
    "job": bench_job,
    "stream": bench_stream,
}
# How long each driven benchmark runs unless --seconds says otherwise.
DEFAULT_SECONDS = {
    "unary": 5.0,
    "batched": 5.0,
    "coalesce": 10.0,
    "fleet": 30.0,
    "engines": 5.0,
    "overload": 30.0,
    "peers": 5.0,
    "stream": 5.0,
}


def main(argv: list[str] | None = None) -> int:
    """Runs the chosen benchmarks, prints them and saves JSON."""
    from ledger_server.server import configure_logging

    # One log line per request is the product's default; a benchmark measures the ledger.
    configure_logging("warning")
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("which", choices=[*BENCHES, "retention", "scrape", "all"])
    parser.add_argument(
        "-o",
        "--output",
        default=None,
        help="JSON result file (default bench-results/ingest.json; report: report.json)",
    )
    parser.add_argument(
        "--ids",
        choices=ID_STYLES,
        default="sdk",
        help="event ids as the SDK makes them (default) or random uuid4 (foreign clients)",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="how long unary, batched, coalesce, fleet and peers run (default: 5, 5, 10, 30 and 5)",
    )
    parser.add_argument(
        "--connections",
        default="1000,5000,10000",
        help="fleet: the numbers of open channels to measure, comma-separated",
    )
    parser.add_argument(
        "--max-workers",
        type=int,
        default=None,
        help="fleet: the server's --max-workers, its in-flight limit 8x that (default: its own)",
    )
    parser.add_argument(
        "--speedup",
        type=float,
        default=2.0,
        help="fleet: the SDK's 15 s heartbeat interval divided by this (default: 2; 1 is the"
        " real cadence, whose rate 10,000 real jobs would send)",
    )
    parser.add_argument(
        "--fleet-paths",
        default="unary,stream",
        help="fleet: how jobs send, each path on a fresh server at every level: unary"
        " (AppendEvents per event) and stream (one StreamAppendEvents stream per job, the"
        " SDK's default); default both, the stream compared with unary at each level",
    )
    parser.add_argument(
        "--fleet-client",
        choices=("aio", "threads"),
        default="aio",
        help="fleet: one asyncio process multiplexing every job's channel (default), or four"
        " processes of gRPC futures (the earlier generator, for comparison)",
    )
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default=ENGINES[0],
        help="unary, batched and fleet: the server's engine (engines measures each in turn)",
    )
    parser.add_argument(
        "--no-pin",
        action="store_true",
        help="fleet: leave the server and the load unpinned (default: the server on one core,"
        " the load on another)",
    )
    args = parser.parse_args(argv)
    if args.speedup <= 0:
        parser.error("--speedup must be positive")
    if args.max_workers is not None and args.max_workers < 1:
        parser.error("--max-workers must be positive")
    if args.seconds is not None and args.seconds <= 0:
        parser.error("--seconds must be positive")
    try:
        connections = tuple(int(n) for n in args.connections.split(","))
    except ValueError:
        parser.error(f"--connections {args.connections!r}: give numbers, e.g. 1000,5000")
    if not connections or min(connections) < 1:
        parser.error("--connections must be positive numbers")
    global id_style
    id_style = args.ids
    if args.which == "retention":
        # Its own file and its own knobs (python -m tools.bench.retention --help).
        from tools.bench.retention import main as bench_retention_main

        code: int = bench_retention_main(["-o", args.output] if args.output else [])
        return code
    if args.which == "scrape":
        # Its own file and its own knobs (python -m tools.bench.scrape --help).
        from tools.bench.scrape import main as bench_scrape_main

        scrape_code: int = bench_scrape_main(["-o", args.output] if args.output else [])
        return scrape_code
    if args.which == "report":
        # Its own file, as `python -m tools.bench.report` writes it (not a key of ingest.json).
        result = bench_report()
        print(json.dumps(result, indent=2), flush=True)
        save_result(args.output or str(RESULTS / "report.json"), result)
        return 0
    if args.which == "job":
        result = bench_job()
        show_job(result)
        save_result(args.output or str(RESULTS / "job.json"), result)
        return 0
    names = (
        [n for n in BENCHES if n not in ("report", "job")] if args.which == "all" else [args.which]
    )
    report: dict[str, Any] = {"env": _env()}
    for name in names:
        print(f"== {name}", flush=True)
        key = (
            name if id_style == "sdk" or name not in ("unary", "batched") else f"{name}_{id_style}"
        )
        kwargs: dict[str, Any] = {}
        if name in DEFAULT_SECONDS:
            kwargs["seconds"] = args.seconds or DEFAULT_SECONDS[name]
        if name == "fleet":
            kwargs["connections"] = connections
            kwargs["max_workers"] = args.max_workers
            kwargs["speedup"] = args.speedup
            kwargs["client"] = args.fleet_client
            kwargs["pin"] = not args.no_pin
            kwargs["engine"] = args.engine
            kwargs["paths"] = tuple(args.fleet_paths.split(","))
        if name in ("unary", "batched"):
            kwargs["engine"] = args.engine
        report[key] = BENCHES[name](**kwargs)
        print(json.dumps(report[key], indent=2), flush=True)
    out = Path(args.output or RESULTS / "ingest.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(out.read_text()) if out.exists() else {}
    previous.update(report)
    out.write_text(json.dumps(previous, indent=2) + "\n")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
