"""What a message on a stream costs the ledger beside a unary call, in one run.

    python -m tools.bench stream [--seconds S]

Closed-loop callers (2 processes x 32 threads) send single-heartbeat appends, each
waiting for its answer before the next: as unary AppendEvents calls, then as
messages on one StreamAppendEvents stream per caller thread, against the same
in-process ledger (asyncio engine, a fresh SQLite file). The same-run baselines: a
bare grpcio echo server, unary and on a bidirectional stream, with the same bytes.
Reported: calls (or messages) per second and the server process's CPU per call.
Targets (issue 52): a streamed append <= 0.25x the server CPU of a unary one, and
single-event unary appends >= 0.7x the echo's rate.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import tempfile
import threading
import time
from typing import Any

import grpc

from ledger_server.config import ServerConfig
from ledger_server.server import create_server
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from tools.bench.echo import echo_server, process_cpu_s

ECHO = "/bench.Echo/Echo"
ECHO_STREAM = "/bench.Echo/EchoStream"
APPEND = "/shardledger.v1.LedgerService/AppendEvents"
STREAM_APPEND = "/shardledger.v1.LedgerService/StreamAppendEvents"


def _caller(
    method: str,
    streaming: bool,
    port: int,
    threads: int,
    seconds: float,
    payloads: list[bytes],
    out: Any,
) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stop = time.monotonic() + seconds
    counts, errors = [0] * threads, [0] * threads

    def unary(i: int) -> None:
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        j = i
        while time.monotonic() < stop:
            try:
                call(payloads[j % len(payloads)], timeout=30)
                counts[i] += 1
            except grpc.RpcError:
                errors[i] += 1
            j += threads

    def stream(i: int) -> None:
        bidi = channel.stream_stream(method, request_serializer=None, response_deserializer=None)
        outgoing: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        answers: Any = bidi(iter(outgoing.get, None))
        j = i
        try:
            while time.monotonic() < stop:
                outgoing.put(payloads[j % len(payloads)])
                next(answers)
                counts[i] += 1
                j += threads
        except grpc.RpcError:
            errors[i] += 1
        outgoing.put(None)
        for _ in answers:
            pass

    target = stream if streaming else unary
    workers = [threading.Thread(target=target, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    out.put((sum(counts), sum(errors)))


def _drive(
    method: str,
    streaming: bool,
    port: int,
    payloads: list[list[bytes]],
    seconds: float,
    threads: int,
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    procs = [
        ctx.Process(target=_caller, args=(method, streaming, port, threads, seconds, p, results))
        for p in payloads
    ]
    cpu0 = process_cpu_s()
    for p in procs:
        p.start()
    done = [results.get() for _ in procs]
    cpu = process_cpu_s() - cpu0
    for p in procs:
        p.join()
    calls = sum(d[0] for d in done)
    return {
        "per_s": round(calls / seconds),
        "errors": sum(d[1] for d in done),
        "server_cpu_us_per_call": round(1e6 * cpu / max(calls, 1), 1),
    }


def _payloads(
    client: LedgerClient, run: str, shards: int, count: int, streamed: bool
) -> list[bytes]:
    client.append(
        [
            pb.ShardEvent(
                event_id=f"{run}-plan-{i}",
                run_id=run,
                shard_id=f"s{i}",
                planned=pb.ShardPlanned(input_ref=f"in{i}", plan_index=i),
            )
            for i in range(shards)
        ]
    )
    client.append(
        [
            pb.ShardEvent(
                event_id=f"{run}-start-{i}",
                run_id=run,
                shard_id=f"s{i}",
                attempt_id="a",
                started=pb.AttemptStarted(host="h", pid=1, heartbeat_timeout={"seconds": 600}),
            )
            for i in range(shards)
        ]
    )
    out = []
    for c in range(count):
        event = pb.ShardEvent(
            event_id=f"{run}-beat-{c}",
            run_id=run,
            shard_id=f"s{c % shards}",
            attempt_id="a",
            heartbeat=pb.Heartbeat(step=c, progress=0.5, metrics={"loss": 0.1}),
        )
        request: Any = (
            pb.StreamAppendEventsRequest(batch_id=c + 1, events=[event])
            if streamed
            else pb.AppendEventsRequest(events=[event])
        )
        out.append(request.SerializeToString())
    return out


def bench_stream(seconds: float = 5.0, procs: int = 2, threads: int = 32) -> dict[str, Any]:
    """Server CPU per streamed append vs per unary append, with bare-echo baselines."""
    with tempfile.TemporaryDirectory() as tmp:
        running = create_server(
            ServerConfig(database=f"{tmp}/l.db", listen="127.0.0.1:0", max_concurrent_rpcs=1024)
        )
        client = LedgerClient(f"127.0.0.1:{running.port}", stream_appends=False)
        count = int(seconds * 4000)
        unary_payloads = [_payloads(client, f"u{p}", 256, count, False) for p in range(procs)]
        stream_payloads = [_payloads(client, f"s{p}", 256, count, True) for p in range(procs)]
        client.close()
        bare, echo_port = echo_server()
        echo = _drive(ECHO, False, echo_port, unary_payloads, seconds, threads)
        echo_stream = _drive(ECHO_STREAM, True, echo_port, stream_payloads, seconds, threads)
        bare.stop(0)
        unary = _drive(APPEND, False, running.port, unary_payloads, seconds, threads)
        stream = _drive(STREAM_APPEND, True, running.port, stream_payloads, seconds, threads)
        running.stop(1)
    return {
        "workload": f"{procs} processes x {threads} closed-loop callers, one heartbeat per"
        " append; the ledger on the asyncio engine, in this process",
        "echo_unary": echo,
        "echo_stream": echo_stream,
        "ledger_unary": unary,
        "ledger_stream": stream,
        "stream_cpu_vs_unary": round(
            stream["server_cpu_us_per_call"] / max(unary["server_cpu_us_per_call"], 0.1), 3
        ),
        "echo_stream_cpu_vs_echo_unary": round(
            echo_stream["server_cpu_us_per_call"] / max(echo["server_cpu_us_per_call"], 0.1), 3
        ),
        "unary_rate_vs_echo": round(unary["per_s"] / max(echo["per_s"], 1), 3),
        "stream_rate_vs_unary": round(stream["per_s"] / max(unary["per_s"], 1), 3),
        "targets": {
            "stream_cpu_vs_unary": "<= 0.25",
            "unary_rate_vs_echo": ">= 0.70",
        },
    }
