"""Where the server's CPU per event goes: one 100-heartbeat append at a time, profiled.

    python -m tools.bench.profile_ingest [--batches N] [--top K] [--stages]

The servicer's path runs in this thread (parse the request, decode, validate,
queue) and the writer's in its own (fold, rows, statements, commit); each gets
its own cProfile, printed by total time. ``--stages`` times each stage alone
(process CPU time, the writer thread's included), in microseconds per event, which is what a change is judged
by (the profiles say where to look; cProfile's overhead inflates small calls).
No gRPC: the wire is the same for every server, and echo measures it.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from collections.abc import Callable
from typing import Any

from ledger_server import codec
from ledger_server.committer import GroupCommitter
from ledger_server.service import LedgerService
from ledger_server.store.sqlite import SqliteStore
from ledger_server.validation import validate
from shard_client.api.shardledger.v1 import ledger_pb2 as pb

SHARDS = 2000
PER_CALL = 100


def _requests(batches: int) -> tuple[list[bytes], list[bytes]]:
    """Returns (setup requests: plans and starts, heartbeat requests) as wire bytes."""
    setup = []
    for kind in ("planned", "started"):
        for base in range(0, SHARDS, 1000):
            events = []
            for i in range(base, base + 1000):
                e = pb.ShardEvent(event_id=f"{kind}-{i}", run_id="prof", shard_id=f"s{i}")
                if kind == "planned":
                    e.planned.input_ref, e.planned.plan_index = f"in{i}", i
                else:
                    e.attempt_id = "a"
                    e.started.host, e.started.pid = "h", 1
                    e.started.heartbeat_timeout.seconds = 600
                events.append(e)
            setup.append(pb.AppendEventsRequest(events=events).SerializeToString())
    beats = []
    for c in range(batches):
        events = [
            pb.ShardEvent(
                event_id=f"hb-{c}-{j}",
                run_id="prof",
                shard_id=f"s{(c * PER_CALL + j) % SHARDS}",
                attempt_id="a",
                heartbeat=pb.Heartbeat(step=c, progress=0.5, metrics={"loss": 0.1}),
            )
            for j in range(PER_CALL)
        ]
        beats.append(pb.AppendEventsRequest(events=events).SerializeToString())
    return setup, beats


def _append(service: LedgerService, wire: bytes) -> None:
    request = pb.AppendEventsRequest.FromString(wire)
    service.append([codec.decode_event(m) for m in request.events])


def _stages(beats: list[bytes], service: LedgerService) -> dict[str, float]:
    """Times each stage of the path alone, in µs per event."""
    n = len(beats) * PER_CALL

    def timed(fn: Callable[[], Any]) -> float:
        # CPU time of the whole process (the writer thread included), not wall time: on a
        # shared machine the wall clock also counts other people's work.
        start = time.process_time()
        fn()
        return round(1e6 * (time.process_time() - start) / n, 2)

    parsed = [pb.AppendEventsRequest.FromString(w) for w in beats]
    decoded = [[codec.decode_event(m) for m in r.events] for r in parsed]
    out = {
        "parse_request": timed(lambda: [pb.AppendEventsRequest.FromString(w) for w in beats]),
        "decode": timed(lambda: [[codec.decode_event(m) for m in r.events] for r in parsed]),
        "validate": timed(lambda: [[validate(e) for e in b] for b in decoded]),
    }

    def append_all() -> None:
        for wire in beats:
            _append(service, wire)

    out["append_total"] = timed(append_all)
    return out


def main(argv: list[str] | None = None) -> int:
    """Profiles the append path and prints the top functions of each thread."""
    from ledger_server.server import configure_logging

    configure_logging("warning")
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.profile_ingest",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--stages", action="store_true", help="time each stage, no profiler")
    args = parser.parse_args(argv)
    writer_profile = cProfile.Profile()
    original = GroupCommitter._write_group
    measuring = False

    def profiled_group(self: GroupCommitter, jobs: Any, *, careful: bool) -> Any:
        # Only the heartbeat groups, not the setup's plans and starts.
        if not measuring:
            return original(self, jobs, careful=careful)
        writer_profile.enable()
        try:
            return original(self, jobs, careful=careful)
        finally:
            writer_profile.disable()

    GroupCommitter._write_group = profiled_group  # type: ignore[method-assign]
    setup, beats = _requests(args.batches)
    with tempfile.TemporaryDirectory() as tmp:
        store = SqliteStore(f"{tmp}/p.db")
        service = LedgerService(store)
        for wire in setup:
            _append(service, wire)
        measuring = not args.stages
        if args.stages:
            for name, us in _stages(beats, service).items():
                print(f"{name:>16}: {us:8.2f} µs/event")
        else:
            caller = cProfile.Profile()
            caller.enable()
            for wire in beats:
                _append(service, wire)
            caller.disable()
            service.close()
            for title, profile in (("request thread", caller), ("writer thread", writer_profile)):
                text = io.StringIO()
                stats = pstats.Stats(profile, stream=text)
                stats.sort_stats("tottime").print_stats(args.top)
                print(f"== {title}\n{text.getvalue()}")
        store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
