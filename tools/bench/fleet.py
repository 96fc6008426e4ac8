# Over 400 lines on purpose: one benchmark script read top to bottom (clients, readers, /proc figures, levels); bench_overload reuses its parts.
"""A fleet on one ledger: thousands of open channels at the SDK's cadence, plus readers.

    python -m tools.bench fleet [--seconds S] [--connections 1000,5000,10000]

For each level a fresh server (``shardledger serve``, its own process, so its
CPU and RSS are its own) takes N simulated jobs from a few client processes,
each job on its own channel and TCP connection, as real jobs are: ``started``,
then a heartbeat every interval (the SDK's default 15 s, compressed by
--speedup), a checkpoint every fourth beat, and the artifact commit at the end
of its life (--seconds). Meanwhile a reader asks for ``status``, the resume list
and ``/metrics`` once a second. Reported per level: commit and heartbeat
acknowledgement p50/p99, events/s, the server's CPU (cores) and RSS, its open
file descriptors, and the readers' latencies. The same-run baseline is the
smallest level: how the figures move as connections grow.

Each client process raises its soft RLIMIT_NOFILE to the hard limit (a
connection is a descriptor on each side); the server raises its own at start.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import itertools
import math
import multiprocessing as mp
import os
import queue
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from ledger_server.config import ENGINES
from ledger_server.server import raise_fd_limit
from shard_client import backoff
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from shard_client.errors import from_rpc_error, status_code
from tools.bench.cpulimit import cpu_share as cpu_limit

DEFAULT_INTERVAL_S = 15.0  # ShardOptions: heartbeat_timeout 60 s / 4
CLIENT_PROCS = 4
CLIENTS = ("aio", "threads")
APPEND = "/shardledger.v1.LedgerService/AppendEvents"
STREAM_APPEND = "/shardledger.v1.LedgerService/StreamAppendEvents"
# How a job sends: a unary AppendEvents call per event, or messages on one open
# StreamAppendEvents stream per job (the SDK's default).
PATHS = ("stream", "unary")
RUN = "fleet"
# The SDK's deadline per call (LedgerClient.timeout_s).
CALL_TIMEOUT_S = 10.0
# grpc.aio's details for a write on a call that had already ended (cygrpc.InternalError).
_AIO_WRITE_ON_ENDED = "Internal error from Core"
# What the SDK's sender keeps (spools) and sends again rather than giving up on.
_RETRIED = frozenset(
    {
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
    }
)


def _pct(samples: list[float], q: float) -> float:
    if not samples:
        return 0.0
    ordered = sorted(samples)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


def _request(run: str, shard: str, seq: int, stream: bool = False, **payload: Any) -> bytes:
    event = pb.ShardEvent(event_id=f"{shard}-{seq}", run_id=run, shard_id=shard, **payload)
    if "planned" not in payload:
        event.attempt_id = "a"
    event.client_time.GetCurrentTime()
    if stream:
        return pb.StreamAppendEventsRequest(batch_id=seq, events=[event]).SerializeToString()
    return pb.AppendEventsRequest(events=[event]).SerializeToString()


def _kind(k: int, elapsed: float, seconds: float) -> str:
    """Returns what a job's k-th event is: started, then beats (every 4th a checkpoint), the commit last."""
    if k == 0:
        return "started"
    if elapsed >= seconds:
        return "commit"
    return "checkpoint" if k % 4 == 0 else "heartbeat"


def _body(run: str, kind: str, shard: str, seq: int, k: int, stream: bool = False) -> bytes:
    """Returns the request of a job's k-th event of this kind."""
    if kind == "started":
        started = pb.AttemptStarted(host="h", pid=1, heartbeat_timeout={"seconds": 60})
        return _request(run, shard, seq, stream, started=started)
    if kind == "commit":
        committed = pb.ArtifactCommitted(
            name="out", path=f"/out/{shard}", size_bytes=1, blake3_hex="ab" * 32
        )
        return _request(run, shard, seq, stream, artifact_committed=committed)
    if kind == "checkpoint":
        saved = pb.CheckpointSaved(step=k, path=f"/ck/{shard}", size_bytes=1, blake3_hex="cd" * 32)
        return _request(run, shard, seq, stream, checkpoint=saved)
    beat = pb.Heartbeat(step=k, progress=0.5, metrics={"loss": 0.1})
    return _request(run, shard, seq, stream, heartbeat=beat)


class _Job:
    """One simulated job's channel and where it is in its life."""

    __slots__ = ("busy", "call", "channel", "k", "seq", "shard")

    def __init__(self, target: str, shard: str) -> None:
        # A local subchannel pool gives every channel its own TCP connection, as separate
        # job processes have; by default channels to one target share one in a process.
        self.channel = grpc.insecure_channel(
            target, options=[("grpc.use_local_subchannel_pool", 1)]
        )
        self.call = self.channel.unary_unary(APPEND, None, None)
        self.shard, self.k, self.seq = shard, 0, 0
        self.busy = False  # an event of this job is in flight or waiting to be resent


def _client(
    target: str,
    run: str,
    shards: list[str],
    interval: float,
    seconds: float,
    out: Any,
    cpus: list[int] | None = None,
) -> None:
    """One client process: a channel per job, each job's events at their times.

    An overloaded or unreachable ledger (RESOURCE_EXHAUSTED, UNAVAILABLE) is
    retried with the same event as the SDK's sender does from its spool: after the
    refusal's RetryInfo delay when it has one, else a capped, jittered exponential
    step (both `shard_client.backoff.retry_wait`, the sender's cap). The latency of
    an event runs from its first send to its acknowledgement.
    """
    raise_fd_limit()
    if cpus:
        os.sched_setaffinity(0, cpus)
    jobs = [_Job(target, s) for s in shards]
    lat: dict[str, list[float]] = {"started": [], "heartbeat": [], "checkpoint": [], "commit": []}
    errors: list[str] = []
    # Answers that sent an event again: OVERLOADED (with a RetryInfo delay), gRPC's own
    # RESOURCE_EXHAUSTED (none), and UNAVAILABLE / DEADLINE_EXCEEDED / CANCELLED.
    counts = {"sent": 0, "overloaded": 0, "exhausted": 0, "unavailable": 0, "advised_s": 0.0}
    samples: list[str] = []  # the first few resends' codes and details, as gRPC said them
    acked: list[float] = []  # when each acknowledgement came (CLOCK_MONOTONIC)
    lock = threading.Lock()
    inflight = [0]
    again: queue.SimpleQueue[tuple[float, int, str, bytes, float, int]] = queue.SimpleQueue()
    begin = time.monotonic()
    order = itertools.count()
    # (due, tiebreak, job, kind, body, first sent, failures): kind "" is the job's next event.
    heap: list[tuple[float, int, int, str, bytes, float, int]] = [
        (begin + interval * j / len(jobs), next(order), j, "", b"", 0.0, 0)
        for j in range(len(jobs))
    ]

    def done(j: int, kind: str, body: bytes, first: float, failures: int, future: Any) -> None:
        code = future.code()
        advised = None
        if code in _RETRIED:
            advised = from_rpc_error(future.exception()).retry_after_s
        with lock:
            inflight[0] -= 1
            jobs[j].busy = code in _RETRIED  # still owed to the ledger
            if code == grpc.StatusCode.OK:
                acked.append(time.monotonic())
                lat[kind].append(1000 * (acked[-1] - first))
            elif code in _RETRIED:
                wait = _resend_wait(counts, samples, code, future.details(), advised, failures)
                inflight[0] += 1  # still owed an answer
                again.put((time.monotonic() + wait, j, kind, body, first, failures + 1))
            else:
                errors.append(str(code))

    while True:
        while not again.empty():
            due, j, kind, body, first, failures = again.get()
            heapq.heappush(heap, (due, next(order), j, kind, body, first, failures))
        with lock:
            idle = not heap and inflight[0] == 0
        if idle:
            break
        if not heap or heap[0][0] > time.monotonic():
            time.sleep(0.005 if not heap else min(0.05, max(0.0, heap[0][0] - time.monotonic())))
            continue
        due, _, j, kind, body, first, failures = heapq.heappop(heap)
        job = jobs[j]
        if not kind and job.busy:
            # The SDK delivers a job's events in order: the next waits for the last's answer.
            heapq.heappush(heap, (due + 0.1, next(order), j, "", b"", 0.0, 0))
            continue
        if not kind:  # the job's next event, on its schedule
            job.seq += 1
            kind = _kind(job.k, due - begin, seconds)
            body, first = _body(run, kind, job.shard, job.seq, job.k), time.monotonic()
            counts["sent"] += 1
            if kind != "commit":
                job.k += 1
                heapq.heappush(heap, (due + interval, next(order), j, "", b"", 0.0, 0))
        with lock:
            inflight[0] += 1 if failures == 0 else 0
        job.busy = True
        future = job.call.future(body, timeout=CALL_TIMEOUT_S)
        future.add_done_callback(functools.partial(done, j, kind, body, first, failures))
    for job in jobs:
        job.channel.close()
    out.put((lat, errors, counts, begin, time.monotonic(), samples, acked))


def _resend_wait(
    counts: dict[str, Any],
    samples: list[str],
    code: grpc.StatusCode,
    details: str | None,
    advised: float | None,
    failures: int,
) -> float:
    """Counts one answer that sends an event again (by kind) and returns the wait before it.

    OVERLOADED with a RetryInfo delay, gRPC's own RESOURCE_EXHAUSTED (none), or an
    unreachable ledger (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED: counted by code, the
    first five kept as said); the wait is the sender's: the advised delay, else its
    capped, jittered step after this many failures.
    """
    if advised is not None:
        counts["overloaded"] += 1
        counts["advised_s"] += advised
    elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        counts["exhausted"] += 1
    else:
        counts["unavailable"] += 1
        name = f"code_{code.name}"
        counts[name] = counts.get(name, 0) + 1
        if len(samples) < 5:
            samples.append(f"{code.name}: {details}")
    step = backoff.FIRST_DELAY_S * 2 ** min(failures, 16)
    return backoff.retry_wait(
        advised, min(step, backoff.SENDER_MAX_DELAY_S), cap_s=backoff.SENDER_MAX_DELAY_S
    )


def _advised_s(exc: Any) -> float | None:
    """Returns a refusal's RetryInfo delay (None: none), from an asyncio call's trailers.

    ``from_rpc_error`` reads it through ``grpc.Call``, which an asyncio error is not; the
    details travel the same way, as ``grpc-status-details-bin``.
    """
    from google.rpc import status_pb2

    trailers: list[tuple[str, Any]] = list(exc.trailing_metadata() or ())
    for key, value in trailers:
        if key == "grpc-status-details-bin":
            return _retry_delay_s(status_pb2.Status.FromString(bytes(value)).details)
    return None


def _retry_delay_s(details: Any) -> float | None:
    """Returns the RetryInfo delay among a status's details (None: none)."""
    from google.rpc import error_details_pb2

    for detail in details:
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            return max(float(retry.retry_delay.ToNanoseconds()) / 1e9, 0.0)
    return None


def _aio_client(
    target: str,
    run: str,
    shards: list[str],
    interval: float,
    seconds: float,
    out: Any,
    cpus: list[int] | None = None,
    path: str = "unary",
) -> None:
    """One asyncio client process for every job: a channel each, one event loop for all.

    The threaded client (``_client``) pays a gRPC polling thread per busy channel, and
    at 10,000 channels its four processes took 1.4 of the machine's two cores: the
    load generator decided the result. Here one loop drives every job's coroutine,
    each on its own channel and TCP connection, with the same events, schedule and
    resends (RetryInfo delay, else the sender's capped, jittered step) as ``_client``.
    """
    import asyncio

    raise_fd_limit()
    if cpus:
        os.sched_setaffinity(0, cpus)
    out.put(asyncio.run(_aio_fleet(target, run, shards, interval, seconds, path)))


async def _aio_fleet(
    target: str, run: str, shards: list[str], interval: float, seconds: float, path: str
) -> tuple[Any, ...]:
    import asyncio

    from grpc import aio

    lat: dict[str, list[float]] = {"started": [], "heartbeat": [], "checkpoint": [], "commit": []}
    errors: list[str] = []
    counts = {"sent": 0, "overloaded": 0, "exhausted": 0, "unavailable": 0, "advised_s": 0.0}
    samples: list[str] = []
    acked: list[float] = []
    channels: list[Any] = []
    begin = time.monotonic()

    async def job(index: int, shard: str) -> None:
        channel = aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        channels.append(channel)
        call = channel.unary_unary(APPEND, None, None)  # bytes in, bytes out: _body serializes
        due = begin + interval * index / len(shards)
        k = seq = 0
        while True:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            seq += 1
            kind = _kind(k, due - begin, seconds)
            body, first, failures = _body(run, kind, shard, seq, k), time.monotonic(), 0
            counts["sent"] += 1
            # The SDK delivers a job's events in order: the next waits for this one's answer.
            while True:
                try:
                    await call(body, timeout=CALL_TIMEOUT_S)
                except aio.AioRpcError as exc:
                    code = exc.code()
                    if code not in _RETRIED:
                        errors.append(f"{code}: {(exc.details() or '')[:160]}")
                        break
                    wait = _resend_wait(
                        counts, samples, code, exc.details(), _advised_s(exc), failures
                    )
                    failures += 1
                    await asyncio.sleep(wait)
                    continue
                acked.append(time.monotonic())
                lat[kind].append(1000 * (acked[-1] - first))
                break
            if kind == "commit":
                return
            k += 1
            due += interval

    async def stream_job(index: int, shard: str) -> None:
        """The same job on one StreamAppendEvents stream, as the SDK sends: a batch, its answer."""
        channel = aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        channels.append(channel)
        open_stream = channel.stream_stream(STREAM_APPEND, None, None)
        call: Any = None
        due = begin + interval * index / len(shards)
        k = seq = 0
        while True:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            seq += 1
            kind = _kind(k, due - begin, seconds)
            body, first, failures = _body(run, kind, shard, seq, k, True), time.monotonic(), 0
            counts["sent"] += 1
            while True:
                code, details, advised = None, "", None
                try:
                    if call is None:
                        call = open_stream()  # type: ignore[call-arg]  # long-lived: no deadline
                    await call.write(body)
                    raw = await asyncio.wait_for(call.read(), CALL_TIMEOUT_S)
                except TimeoutError:  # the SDK ends the stream and sends again
                    code, details = grpc.StatusCode.DEADLINE_EXCEEDED, "no answer on the stream"
                    call.cancel()
                    call = None
                except aio.AioRpcError as exc:
                    code, details, advised = exc.code(), exc.details() or "", _advised_s(exc)
                    if (code, details) == (grpc.StatusCode.INTERNAL, _AIO_WRITE_ON_ENDED):
                        # grpc.aio's answer to a write on a stream the server (or its
                        # core) already ended: the stream ended; the SDK's sync stream
                        # sees that call's own status and sends again on a new one.
                        code, details = grpc.StatusCode.UNAVAILABLE, "stream ended under a write"
                    call = None
                else:
                    if raw is aio.EOF:  # type: ignore[attr-defined]
                        code, details, call = grpc.StatusCode.UNAVAILABLE, "stream ended", None
                    else:
                        answer = pb.StreamAppendEventsResponse.FromString(raw)
                        if answer.HasField("error"):
                            code = status_code(answer.error.code)
                            details = answer.error.message
                            advised = _retry_delay_s(answer.error.details)
                if code is None:
                    acked.append(time.monotonic())
                    lat[kind].append(1000 * (acked[-1] - first))
                    break
                if code not in _RETRIED:
                    errors.append(f"{code}: {details[:160]}")
                    break
                wait = _resend_wait(counts, samples, code, details, advised, failures)
                failures += 1
                await asyncio.sleep(wait)
            if kind == "commit":
                if call is not None:
                    await call.done_writing()
                return
            k += 1
            due += interval

    each = stream_job if path == "stream" else job
    await asyncio.gather(*(each(i, s) for i, s in enumerate(shards)))
    end = time.monotonic()
    await asyncio.gather(*(c.close() for c in channels))
    return lat, errors, counts, begin, end, samples, acked


def _proc_stat(pid: int) -> tuple[float, int, int, int]:
    """Returns (CPU seconds, RSS KiB, peak RSS KiB, open descriptors) of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return cpu, int(status["VmRSS"].split()[0]), int(status["VmHWM"].split()[0]), fds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _loop_lag_s(scrape: Any) -> float | None:
    """Returns the event loop's lag from a /metrics scrape (None: no such gauge, threads)."""
    for line in bytes(scrape).decode(errors="replace").splitlines():
        if line.startswith("shardledger_event_loop_lag_seconds "):
            return float(line.split()[1])
    return None


def _reader(
    target: str, run: str, metrics_url: str, stop: threading.Event, out: dict[str, list[float]]
) -> None:
    client = LedgerClient(target)
    while not stop.wait(1.0):
        for name, call in (
            ("status", lambda: client.summary(run)),
            ("resume", lambda: sum(1 for _ in client.resume(run))),
            ("metrics", lambda: urllib.request.urlopen(metrics_url, timeout=30).read()),
        ):
            start = time.monotonic()
            try:
                got = call()
            except Exception:  # a reader's failure is a figure, not the benchmark's end
                out.setdefault(f"{name}_errors", []).append(1.0)
                continue
            out.setdefault(name, []).append(1000 * (time.monotonic() - start))
            if name == "metrics":
                lag = _loop_lag_s(got)
                if lag is not None:
                    out.setdefault("loop_lag", []).append(1000 * lag)
    client.close()


@dataclass(slots=True)
class Served:
    """A `shardledger serve` process started for a benchmark."""

    process: subprocess.Popen[bytes]
    target: str
    metrics_url: str
    # The server's CPU cgroup, where it runs in one ("": not limited).
    cpu_limit: str = ""


@contextmanager
def served(
    server_args: Sequence[str] = (),
    *,
    src: str | None = None,
    cpus: Sequence[int] | None = None,
    cpu_share: float | None = None,
) -> Iterator[Served]:
    """Runs `shardledger serve` on a fresh ledger in its own process until the block ends.

    ``src``: run the server of another checkout (its directory goes first on the
    server's PYTHONPATH), so one run can measure a before and an after; ``cpus``:
    pin the server to these CPUs (taskset); ``cpu_share``: hold it to that share of
    one core (tools/bench/cpulimit.py).
    """
    with tempfile.TemporaryDirectory() as tmp:
        port_file, metrics_port = Path(tmp) / "port", _free_port()
        env = dict(os.environ)
        if src is not None:
            env["PYTHONPATH"] = os.pathsep.join(
                [str(Path(src).resolve()), str(Path(src).resolve() / "tools")]
            )
        pin = ["taskset", "-c", ",".join(map(str, cpus))] if cpus else []
        server = subprocess.Popen(
            [
                *pin,
                sys.executable,
                "-m",
                "shardledger_cli",
                "serve",
                *("--db", f"{tmp}/l.db", "--listen", "127.0.0.1:0"),
                *("--port-file", str(port_file), "--log-level", "warning"),
                *("--metrics-listen", f"127.0.0.1:{metrics_port}"),
                *server_args,
            ],
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=src,
        )
        with contextlib.ExitStack() as stack:
            limit = stack.enter_context(cpu_limit(server.pid, cpu_share)) if cpu_share else ""
            # Registered after the limit, so it runs first: the group empties before it goes.
            stack.callback(server.wait, 60)
            stack.callback(server.terminate)
            while not port_file.exists() or not port_file.read_text():
                if server.poll() is not None:
                    raise RuntimeError("the server did not start")
                time.sleep(0.05)
            target = f"127.0.0.1:{port_file.read_text().strip()}"
            yield Served(server, target, f"http://127.0.0.1:{metrics_port}/metrics", limit)


def plan(target: str, run: str, shards: list[str]) -> None:
    """Plans the jobs' shards, a thousand per append."""
    client = LedgerClient(target)
    for base in range(0, len(shards), 1000):
        client.append(
            [
                pb.ShardEvent(
                    event_id=f"plan-{s}",
                    run_id=run,
                    shard_id=s,
                    planned=pb.ShardPlanned(input_ref=f"/in/{s}", plan_index=i),
                )
                for i, s in enumerate(shards[base : base + 1000], base)
            ]
        )
    client.close()


def drive(
    server: Served,
    run: str,
    connections: int,
    *,
    seconds: float,
    interval: float,
    client_cpus: Sequence[int] | None = None,
    client: str = "aio",
    path: str = "unary",
) -> dict[str, Any]:
    """Runs ``connections`` jobs of one run against a served ledger; returns their figures.

    client: "aio" (one asyncio process for every job, ``_aio_client``) or "threads"
    (CLIENT_PROCS processes of gRPC futures, ``_client``).
    """
    shards = [f"{run}-j{i}" for i in range(connections)]
    plan(server.target, run, shards)
    stop = threading.Event()
    reads: dict[str, list[float]] = {}
    reader = threading.Thread(
        target=_reader, args=(server.target, run, server.metrics_url, stop, reads)
    )
    ctx = mp.get_context("spawn")
    results_queue: Any = ctx.Queue()
    cpus = list(client_cpus) if client_cpus else None
    if client not in CLIENTS:
        raise ValueError(f"client {client!r}: one of {', '.join(CLIENTS)}")
    if path not in PATHS or (path == "stream" and client != "aio"):
        raise ValueError(f"path {path!r}: one of {', '.join(PATHS)} (stream: the aio client)")
    # One asyncio process, or as many as the descriptor limit needs (a channel is one).
    per_process = max(1, int(0.9 * resource.getrlimit(resource.RLIMIT_NOFILE)[0]))
    count = math.ceil(connections / per_process) if client == "aio" else CLIENT_PROCS
    procs = [
        ctx.Process(
            target=_aio_client if client == "aio" else _client,
            args=(server.target, run, shards[p::count], interval, seconds, results_queue, cpus)
            + ((path,) if client == "aio" else ()),
        )
        for p in range(count)
    ]
    pid = server.process.pid
    cpu0, *_ = _proc_stat(pid)
    load_cpu0 = 0.0
    wall0 = time.monotonic()
    server_cpu = [(wall0, cpu0)]  # (CLOCK_MONOTONIC, the server's CPU seconds) each second
    for p in procs:
        p.start()
    reader.start()
    peak_fds = 0
    results: list[Any] = []
    load_cpu: dict[int, float] = {}
    while len(results) < len(procs):
        try:
            results.append(results_queue.get(timeout=1.0))
        except queue.Empty:
            now_cpu, _, _, now_fds = _proc_stat(pid)
            server_cpu.append((time.monotonic(), now_cpu))
            peak_fds = max(peak_fds, now_fds)
            for p in procs:
                if p.pid is not None and p.is_alive():
                    # It may end between the check and the read.
                    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                        load_cpu[p.pid] = _proc_stat(p.pid)[0]
    wall = time.monotonic() - wall0
    cpu1, rss, peak_rss, fds = _proc_stat(pid)
    stop.set()
    reader.join()
    for p in procs:
        p.join()
    lat: dict[str, list[float]] = {}
    errors: list[str] = []
    counts: dict[str, float] = {}
    # CLOCK_MONOTONIC is one clock for every process: the drive runs from the first
    # client's first send to the last client's last answer (no spawn, no connect).
    drive_s = max(r[4] for r in results) - min(r[3] for r in results)
    resent: list[str] = []
    acked: list[float] = []
    for part, errs, tally, _, _, said, times in results:
        acked.extend(times)
        for kind, samples in part.items():
            lat.setdefault(kind, []).extend(samples)
        errors.extend(errs)
        resent.extend(said)
        for key, value in tally.items():
            counts[key] = counts.get(key, 0) + value
    events = sum(len(v) for v in lat.values())
    refusals = int(counts["overloaded"] + counts["exhausted"])
    return {
        "connections": connections,
        "offered_events_per_s": round(connections / interval),
        "sent_events": int(counts["sent"]),
        "events": events,
        "events_per_s": round(events / drive_s),
        "errors": len(errors),
        "refused": refusals,
        "refused_overloaded": int(counts["overloaded"]),
        "refused_grpc_limit": int(counts["exhausted"]),
        "advised_delay_mean_s": round(counts["advised_s"] / max(counts["overloaded"], 1), 3),
        "resent_unavailable": int(counts["unavailable"]),
        "resent_by_code": {k[5:]: int(v) for k, v in sorted(counts.items()) if k[:5] == "code_"},
        "resent_samples": sorted(set(resent))[:5],
        "retried_overloaded": refusals + int(counts["unavailable"]),
        "error_codes": sorted(set(errors))[:5],
        "commit_ack_ms": {"p50": _pct(lat["commit"], 0.5), "p99": _pct(lat["commit"], 0.99)},
        "heartbeat_ack_ms": {
            "p50": _pct(lat["heartbeat"], 0.5),
            "p99": _pct(lat["heartbeat"], 0.99),
        },
        "client": f"{client} ({len(procs)} process{'es' if len(procs) > 1 else ''})",
        "path": path,
        "client_cpu_cores": round((sum(load_cpu.values()) - load_cpu0) / wall, 2),
        "server_cpu_cores": round((cpu1 - cpu0) / wall, 2),
        "server_cpu_us_per_event": round(1e6 * (cpu1 - cpu0) / max(events, 1)),
        "server_rss_mb": round(rss / 1024),
        "server_peak_rss_mb": round(peak_rss / 1024),
        "server_open_fds_peak": max(peak_fds, fds),
        "status_ms_p50": _pct(reads.get("status", []), 0.5),
        "status_ms_p99": _pct(reads.get("status", []), 0.99),
        "resume_ms_p50": _pct(reads.get("resume", []), 0.5),
        "metrics_ms_p50": _pct(reads.get("metrics", []), 0.5),
        # The server's own gauge, read once a second (asyncio engines; the loop-lag bound
        # refuses while the least of its last four probes is above --admission-loop-lag).
        "event_loop_lag_ms": {
            "p50": _pct(reads.get("loop_lag", []), 0.5),
            "max": max(reads.get("loop_lag", [0.0])),
        },
        "reader_errors": sum(len(v) for k, v in reads.items() if k.endswith("_errors")),
        "drive_s": round(drive_s, 1),
        "steady": _steady(server_cpu, acked, min(r[3] for r in results), interval, seconds),
    }


def _steady(
    server_cpu: list[tuple[float, float]],
    acked: list[float],
    begin: float,
    interval: float,
    seconds: float,
) -> dict[str, Any]:
    """The server's CPU per acknowledged event while every job is running: no channel opens.

    A job opens its channel and stream and sends ``started`` within the first
    ``interval`` of the drive, and commits ``seconds`` after its start: between the
    two (a second's margin each side) the server sees heartbeats and checkpoints on
    open channels only, a long-lived fleet's steady state. Measured between the
    server CPU samples (one a second) that fall in that window.
    """
    start, end = begin + interval + 1.0, begin + seconds - 1.0
    inside = [s for s in server_cpu if start <= s[0] <= end]
    if len(inside) < 2 or inside[-1][0] - inside[0][0] < 5.0:
        return {
            "measured": False,
            "why": f"no 5 s between the last job's start ({interval:.1f} s) and the first"
            f" commit ({seconds:g} s): raise --seconds",
        }
    (t0, c0), (t1, c1) = inside[0], inside[-1]
    events = sum(1 for t in acked if t0 <= t <= t1)
    return {
        "measured": True,
        "window_s": round(t1 - t0, 1),
        "acked_events_per_s": round(events / (t1 - t0)),
        "server_cpu_cores": round((c1 - c0) / (t1 - t0), 2),
        "server_cpu_us_per_event": round(1e6 * (c1 - c0) / max(events, 1)),
    }


def _level(
    connections: int,
    seconds: float,
    interval: float,
    max_workers: int | None,
    *,
    client: str,
    pin: tuple[list[int], list[int]] | None,
    engine: str,
    path: str = "unary",
) -> dict[str, Any]:
    args: list[str] = ["--engine", engine, "--max-append-streams", str(max(connections, 1) + 64)]
    if max_workers is not None:
        # Overload is measured by latency and retries, not by refusals at the door.
        args += ["--max-workers", str(max_workers), "--max-concurrent-rpcs", str(8 * max_workers)]
    server_cpus, client_cpus = pin if pin else (None, None)
    with served(args, cpus=server_cpus) as server:
        return drive(
            server,
            RUN,
            connections,
            seconds=seconds,
            interval=interval,
            client_cpus=client_cpus,
            client=client,
            path=path,
        )


# Descriptors for a fleet: a connection is one on each side, and 20,000 channels pass
# the 20,000 many machines allow a process by default.
FLEET_FDS = 65_536
# Descriptors a server needs beside its connections (the ledger, its WAL, logs, metrics).
FD_MARGIN = 256


def _raise_fd_hard_limit(want: int = FLEET_FDS) -> int:
    """Raises this process's descriptor limits (hard too, where allowed: root); returns the soft one.

    The server and the clients are this process's children and inherit them.
    """
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard < want:
        # Not root: the hard limit stands, and raise_fd_limit takes it.
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
    return raise_fd_limit()


def bench_fleet(
    seconds: float = 30.0,
    connections: tuple[int, ...] = (1000, 5000, 10000),
    speedup: float = 2.0,
    max_workers: int | None = None,
    client: str = "aio",
    pin: bool = True,
    engine: str = ENGINES[0],
    paths: tuple[str, ...] = PATHS,
) -> dict[str, Any]:
    """Commit latency, server CPU and RSS as open channels grow, SDK cadence compressed.

    paths: each level runs once per path (a fresh server each), the stream's figures
    beside the unary ones of the same run as its baseline.

    pin: on a machine of two or more cores, the server on core 0 and the load (client
    processes, readers, this process) on core 1 (taskset / sched_setaffinity), so the
    server's figures are one core's, whatever the load generator costs.
    """
    fds = _raise_fd_hard_limit()
    interval = DEFAULT_INTERVAL_S / speedup
    cores = sorted(os.sched_getaffinity(0))
    placement: tuple[list[int], list[int]] | None = None
    if pin and len(cores) >= 2:
        placement = ([cores[0]], [cores[1]])
        os.sched_setaffinity(0, placement[1])
    processes = (
        "one asyncio client process" if client == "aio" else f"{CLIENT_PROCS} client processes"
    )
    out: dict[str, Any] = {
        "workload": f"{processes}, one channel per job; a heartbeat every"
        f" {interval:g} s (the SDK's 15 s / {speedup:g}), a checkpoint every 4th beat, the commit"
        f" after {seconds:g} s; status, resume and /metrics once a second",
        "placement": (
            f"server on CPU {placement[0][0]}, load on CPU {placement[1][0]}"
            if placement
            else "unpinned"
        ),
        "fd_limit": fds,
        "server_max_workers": max_workers or "default (1024)",
        "server_engine": engine,
        "levels": [],
        "target": "10,000 connections at 1x: p99 commit ack <= 250 ms, server CPU <= 0.3 ms per"
        " acknowledged event, server RSS <= 1 GB",
    }
    for n in connections:
        if n + FD_MARGIN > fds:
            # The server holds a descriptor per connection: past its limit it refuses them.
            out["levels"].append(
                {
                    "connections": n,
                    "skipped": f"the server would need {n + FD_MARGIN:,} descriptors and a"
                    f" process may hold {fds:,} here (its hard RLIMIT_NOFILE; raising it needs"
                    " CAP_SYS_RESOURCE, which this process lacks)",
                }
            )
            print(out["levels"][-1], flush=True)
            continue
        by_path = {}
        for path in paths if client == "aio" else ("unary",):
            level = _level(
                n,
                seconds,
                interval,
                max_workers,
                client=client,
                pin=placement,
                engine=engine,
                path=path,
            )
            print(level, flush=True)
            out["levels"].append(level)
            by_path[path] = level
        if "stream" in by_path and "unary" in by_path:
            stream, unary = by_path["stream"], by_path["unary"]
            stream["vs_unary_same_level"] = {
                "server_cpu_per_event": round(
                    stream["server_cpu_us_per_event"] / max(unary["server_cpu_us_per_event"], 1), 2
                ),
                "commit_p99": round(
                    stream["commit_ack_ms"]["p99"] / max(unary["commit_ack_ms"]["p99"], 0.01), 2
                ),
                "events_per_s": round(stream["events_per_s"] / max(unary["events_per_s"], 1), 2),
            }
    measured = [level for level in out["levels"] if "skipped" not in level]
    if not measured:
        return out
    base = measured[0]
    for level in measured:
        level["commit_p99_vs_smallest"] = round(
            level["commit_ack_ms"]["p99"] / max(base["commit_ack_ms"]["p99"], 0.01), 2
        )
        level["cpu_per_event_vs_smallest"] = round(
            (level["server_cpu_cores"] / max(level["events_per_s"], 1))
            / max(base["server_cpu_cores"] / max(base["events_per_s"], 1), 1e-12),
            2,
        )
    return out
