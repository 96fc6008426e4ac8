"""Benchmarks the ledger at the size of a big night: a full replay rebuild, RSS, bytes/event.

    python -m tools.bench.replay --shards 1000000 --events 10000000

1. Writes a run of N shards and M events into a temp SQLite ledger through the
   store's own write path (validated events, canonical rows, the hash chain):
   every shard is planned and started, gets heartbeats, and nine in ten commit
   and pass verification; the rest stay running.
2. Full replay rebuild: `shardledger db rebuild`'s replay (ledger_server.rebuild)
   reads every event back, checks it against the hash chain, folds it into the
   projections (the server's own fold), and writes the shard rows and counters
   into the empty projection tables. Reported in events/s, with reading the rows
   and parsing their JSON measured alone as the baseline (the floor of any rebuild).
3. Serves the file with `shardledger serve` in its own process, fills its shard
   cache with heartbeats of every running shard, asks for the status and the
   resume list, and reads the server's peak RSS (VmHWM) from /proc.
4. Database bytes per event: the file's size (after a checkpoint) / M.

Targets (issue #8): rebuild >= 100,000 events/s; server RSS <= 500 MB; status
<= 200 ms; bytes/event reported. JSON goes to bench-results/replay.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import grpc

from ledger_server.chain import GENESIS_HASH, chain_hash, encode_row, parse_row
from ledger_server.compact import HOT_RECORDS
from ledger_server.events import (
    ArtifactCommitted,
    ArtifactVerified,
    AttemptStarted,
    Event,
    Heartbeat,
    Payload,
    ShardPlanned,
)
from ledger_server.rebuild import rebuild_run
from ledger_server.store.sqlite import SqliteStore
from ledger_server.validation import check_namespace, validate
from shard_client.canonical import fingerprint_digest
from shard_client.client import LedgerClient
from tools.bench.projections import save_result, shard_id

RUN: Final = "night"
NAMESPACE: Final = check_namespace("")  # the default namespace, as the server stores it
DIGEST: Final = "ab" * 32
FP: Final = fingerprint_digest({"gpu": "H100"})  # the ledger refuses any other for the map
HOUR_US: Final = 3600 * 1_000_000
WAVE: Final = 10_000  # shards in flight at once: their heartbeats interleave in the log
FLUSH: Final = 20_000  # rows per store flush while writing


def _events(shards: int, total: int) -> Iterator[Event]:
    """Yields the night's events in log order: plans, then waves of attempts.

    Every shard is planned and started; nine in ten commit and pass verification, one
    in ten still runs. The heartbeats per attempt make the total come to `total`
    (give or take one per shard).
    """
    running = shards // 10
    beats = max(0, round((total - 2 * shards - 2 * (shards - running)) / shards))
    for i in range(shards):
        yield Event(
            f"p-{i}",
            "",
            RUN,
            shard_id(i),
            "",
            0,
            ShardPlanned(
                f"s3://night/{i:08d}.bin", 1 << 20, "", f'{{"seed":{i}}}', ("out",), "", i
            ),
        )
    for wave in range(0, shards, WAVE):
        members = range(wave, min(wave + WAVE, shards))
        for i in members:
            yield _ev(i, "s", AttemptStarted("node-1", 42, HOUR_US, {"gpu": "H100"}, FP))
        for step in range(beats):
            for i in members:
                yield _ev(i, f"h{step}", Heartbeat(step, step / max(beats, 1), {"loss": 0.5}))
        for i in members:
            if i % 10 == 9:
                continue  # still running at the end of the night
            path = f"/out/{shard_id(i)}.bin"
            yield _ev(i, "c", ArtifactCommitted("out", path, 1 << 20, DIGEST, ""))
            yield Event(
                f"v-{i}",
                "",
                RUN,
                shard_id(i),
                "",
                0,
                ArtifactVerified("out", path, DIGEST, "passed", "", ""),
            )


def _ev(i: int, tag: str, payload: Payload) -> Event:
    return Event(f"{tag}-{i}", "", RUN, shard_id(i), "a1", 0, payload)


def write_night(
    store: SqliteStore,
    shards: int,
    total: int,
    *,
    start_us: int = 1_700_000_000_000_000,
    step_us: int = 1,
) -> int:
    """Writes the events through the store's write path; returns how many.

    The ledger receives event n at start_us + n * step_us (its clock, which the
    projections and the field figures read).
    """
    count, head, receive = 0, GENESIS_HASH, start_us
    with store.write() as tx:
        run = tx.create_run(NAMESPACE, RUN, now_us=receive, genesis=GENESIS_HASH)
        for event in _events(shards, total):
            count += 1
            row = encode_row(
                validate(event).canonical,
                run_sequence=count,
                receive_time_us=receive + count * step_us,
            )
            head = chain_hash(head, row)
            tx.insert_event(
                run_pk=run.run_pk,
                run_sequence=count,
                event_id=event.event_id,
                row=row,
                row_hash=head,
            )
            if count % FLUSH == 0:
                tx.flush()
                print(f"\r  wrote {count:,} events", end="", file=sys.stderr, flush=True)
        tx.update_run(
            run.run_pk, event_count=count, head_hash=head, now_us=receive + count * step_us
        )
    print(file=sys.stderr)
    return count


def rebuild(store: SqliteStore, records_in_memory: int = HOT_RECORDS) -> dict[str, Any]:
    """Runs `db rebuild`'s replay on the run (its projections are empty); returns the timings."""
    view = store.read()
    run = view.get_run(NAMESPACE, RUN)
    assert run is not None
    start = time.perf_counter()
    parsed = sum(1 for s in view.iter_events(run.run_pk) if parse_row(s.row))
    parse_s = time.perf_counter() - start
    report = rebuild_run(store, run, write=True, records_in_memory=records_in_memory)
    assert report.written and report.events == parsed
    return {
        "events": report.events,
        "shards": report.shards,
        "read_parse_only_events_per_s": round(parsed / parse_s),
        "replay_events_per_s": round(parsed / report.replay_seconds),
        "write_projections_s": round(report.write_seconds, 2),
        "rebuild_s": round(report.seconds, 2),
        "rebuild_events_per_s": round(parsed / report.seconds),
        "ratio_to_read_parse": round(parse_s / report.seconds, 3),
        "records_in_memory": records_in_memory,
        "rebuild_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }


def _vm(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) // 1024
    raise KeyError(key)


def serve_checks(db: str, shards: int) -> dict[str, Any]:
    """Runs `shardledger serve` on the file; measures status, resume and the server's RSS."""
    port_file = Path(db).with_suffix(".port")
    cmd = [sys.executable, "-m", "shardledger_cli", "serve", "--db", db, "--listen", "127.0.0.1:0"]
    cmd += ["--port-file", str(port_file), "--log-level", "warning"]
    server = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    try:
        while not port_file.exists():
            time.sleep(0.05)
        client = LedgerClient(f"127.0.0.1:{port_file.read_text()}", timeout_s=600)
        from shard_client.api.shardledger.v1 import ledger_pb2 as pb

        running = [i for i in range(shards) if i % 10 == 9]
        start = time.perf_counter()
        for k in range(0, len(running), 1000):
            client.append(
                [
                    pb.ShardEvent(
                        event_id=f"late-{i}",
                        run_id=RUN,
                        shard_id=shard_id(i),
                        attempt_id="a1",
                        heartbeat=pb.Heartbeat(step=10_000, progress=0.99),
                    )
                    for i in running[k : k + 1000]
                ]
            )
        beats_s = time.perf_counter() - start
        samples = []
        for _ in range(5):
            t = time.perf_counter()
            summary = client.summary(RUN)
            samples.append(time.perf_counter() - t)
        start = time.perf_counter()
        lines = sum(1 for _ in client.resume(RUN))
        resume_s = time.perf_counter() - start
        return {
            "late_heartbeats": len(running),
            "late_heartbeats_per_s": round(len(running) / beats_s),
            "status_ms_median": round(sorted(samples)[2] * 1000, 2),
            "status_running": int(json.loads(summary)["running"]),
            "resume_lines": lines,
            "resume_lines_per_s": round(lines / resume_s),
            "server_rss_mb": _vm(server.pid, "VmRSS"),
            "server_peak_rss_mb": _vm(server.pid, "VmHWM"),
        }
    except grpc.RpcError as exc:
        raise SystemExit(f"the server refused a benchmark call: {exc}") from None
    finally:
        server.terminate()
        server.wait()


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark and saves bench-results/replay.json."""
    parser = argparse.ArgumentParser(prog="python -m tools.bench.replay", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--shards", type=int, default=100_000, help="shards in the run")
    parser.add_argument("--events", type=int, default=1_000_000, help="events in the run")
    parser.add_argument(
        "--records-in-memory",
        type=int,
        default=HOT_RECORDS,
        help="as `db rebuild --records-in-memory`: 0 keeps every record as an object",
    )
    parser.add_argument("--dir", default=None, help="where the temp SQLite file goes")
    parser.add_argument("--out", default="bench-results/replay.json", help="JSON result file")
    args = parser.parse_args(argv)
    if args.events < args.shards * 4:
        parser.error("--events must be at least 4 per shard (plan, start, commit, verify)")
    result: dict[str, Any] = {
        "env": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "grpcio": grpc.__version__,
        },
        "shards": args.shards,
    }
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-replay-") as tmp:
        db = str(Path(tmp) / "ledger.db")
        store = SqliteStore(db)
        start = time.perf_counter()
        result["events"] = write_night(store, args.shards, args.events)
        result["write_events_per_s"] = round(result["events"] / (time.perf_counter() - start))
        result["rebuild"] = rebuild(store, args.records_in_memory)
        store.execute_raw("PRAGMA wal_checkpoint(TRUNCATE)")
        store.close()
        size = os.path.getsize(db)
        result["db_bytes"] = size
        result["db_bytes_per_event"] = round(size / result["events"], 1)
        result["serve"] = serve_checks(db, args.shards)
    result["targets"] = {
        "rebuild_events_per_s": 100_000,
        "server_rss_mb": 500,
        "status_ms": 200,
    }
    print(json.dumps(result, indent=2))
    save_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
