"""Events per shard-hour from a job that calls progress() every step at 50 steps/s.

    python -m tools.bench coalesce [--seconds S]

Each simulated shard is a thread inside one job process, calling
``shard.progress(step, loss=..., lr=...)`` 50 times a second for S seconds,
first with ``coalesce_progress=False`` (every call an event: the SDK before
issue 22, the same-run baseline) and then with the default coalescing. The
interval is 1 s so that a short run holds many intervals; events per
shard-hour at the default interval (heartbeat_timeout / 4 = 15 s) follow as
3600 / 15 plus the attempt's fixed events, and the measured rate at 1 s says
whether the SDK keeps to one beat per interval. Bytes are the stored rows'.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ledger_server.config import ServerConfig
from ledger_server.server import create_server
from shard_client import Ledger
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient

STEPS_PER_S = 50
DEFAULT_INTERVAL_S = 15.0  # ShardOptions: heartbeat_timeout 60 s / 4


def _job(
    target: str, run: str, shards: int, seconds: float, *, coalesce: bool, out_dir: Path
) -> list[int]:
    """Runs `shards` threads, each one attempt calling progress() every step; returns call ns."""
    ledger = Ledger(target)
    samples: list[int] = []

    def work(shard_id: str) -> None:
        with ledger.shard(
            run,
            shard_id,
            heartbeat_interval=1.0,
            fingerprint=False,
            watchdog=False,
            coalesce_progress=coalesce,
        ) as shard:
            begin, step = time.monotonic(), 0
            while (now := time.monotonic()) - begin < seconds:
                called = time.perf_counter_ns()
                shard.progress(
                    step, min(1.0, (now - begin) / seconds), loss=1 / (step + 1), lr=1e-3
                )
                samples.append(time.perf_counter_ns() - called)  # list.append is atomic
                step += 1
                time.sleep(max(0.0, begin + step / STEPS_PER_S - time.monotonic()))
            shard.progress(step, 1.0, loss=1 / (step + 1), lr=1e-3)
            with shard.atomic_write(out_dir / f"{run}-{shard_id}.out") as f:
                f.write(b"done")

    threads = [threading.Thread(target=work, args=(f"s{i}",)) for i in range(shards)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ledger.close()
    return samples


def _plan(client: LedgerClient, run: str, shards: int) -> None:
    client.append(
        [
            pb.ShardEvent(
                event_id=f"plan-{run}-{i}",
                run_id=run,
                shard_id=f"s{i}",
                planned=pb.ShardPlanned(input_ref=f"in{i}", plan_index=i),
            )
            for i in range(shards)
        ]
    )


def _count(client: LedgerClient, run: str) -> tuple[int, int, int]:
    """Returns (heartbeats, other non-plan events, bytes of every non-plan event)."""
    beats = other = size = 0
    for e in client.list_events(run):
        kind = e.WhichOneof("payload")
        if kind == "planned":
            continue
        size += e.ByteSize()
        if kind == "heartbeat":
            beats += 1
        else:
            other += 1
    return beats, other, size


def bench_coalesce(seconds: float = 10.0, shards: int = 8) -> dict[str, Any]:
    """Events per shard-hour with and without coalescing, 50 progress() calls/s per shard."""
    out: dict[str, Any] = {
        "workload": f"{shards} shards in one job, progress() every step at {STEPS_PER_S} steps/s"
        f" for {seconds:g} s, heartbeat_interval 1 s",
    }
    with tempfile.TemporaryDirectory() as tmp:
        running = create_server(ServerConfig(database=f"{tmp}/l.db", listen="127.0.0.1:0"))
        target = f"127.0.0.1:{running.port}"
        client = LedgerClient(target)
        try:
            for mode, coalesce in (("every_call", False), ("coalesced", True)):
                run = f"coalesce-{mode.replace('_', '-')}"
                _plan(client, run, shards)
                begin = time.monotonic()
                calls = sorted(
                    _job(target, run, shards, seconds, coalesce=coalesce, out_dir=Path(tmp))
                )
                wall = time.monotonic() - begin
                beats, other, size = _count(client, run)
                per_shard_hour = 3600 / wall
                out[mode] = {
                    "heartbeats_per_shard": round(beats / shards, 1),
                    "other_events_per_shard": round(other / shards, 1),
                    "heartbeats_per_shard_hour": round(beats / shards * per_shard_hour),
                    "bytes_per_shard_hour": round(size / shards * per_shard_hour),
                    "progress_call_us": {
                        "p50": round(calls[len(calls) // 2] / 1000, 1),
                        "p99": round(calls[int(len(calls) * 0.99)] / 1000, 1),
                    },
                }
        finally:
            running.stop(1)
    every, merged = out["every_call"], out["coalesced"]
    out["reduction"] = round(
        every["heartbeats_per_shard_hour"] / merged["heartbeats_per_shard_hour"]
    )
    # At the default interval: one beat per 15 s, whatever the step rate.
    out["coalesced_default_interval_heartbeats_per_shard_hour"] = round(3600 / DEFAULT_INTERVAL_S)
    out["every_call_heartbeats_per_shard_hour_at_50_steps_s"] = STEPS_PER_S * 3600
    out["target"] = "at most ~1 heartbeat per heartbeat_interval per shard"
    return out
