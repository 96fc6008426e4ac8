"""Appends through ledger replicas without pause, and watches their health, logging what clients see.

Runs on a host of the test's network (tests/patroni.py), where the replicas can be
reached. ``patroni_load.py OUT STOP TARGET...``: worker threads append random batches to
shared runs, each through the next replica in turn; a refused batch (or one whose answer
never came) is resent, with the same event ids, to the next replica until acknowledged.
A health thread asks every replica's health every 50 ms. Every acknowledgement, refusal
and change of health is one JSON line in OUT, with its wall time. Once the file STOP
exists the workers finish their batch in hand (in doubt until acknowledged) and exit.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Final

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.api.shardledger.v1 import ledger_pb2_grpc as pb_grpc
from tests.builders import planned
from tests.server.test_replicas import SHARED_RUNS, _batch

WORKERS: Final = 3
DEADLINE_S: Final = 10.0
GIVE_UP_S: Final = 180.0


class Log:
    """The JSON lines file, written by every thread."""

    def __init__(self, path: Path) -> None:
        self.out = open(path, "a", buffering=1)  # noqa: SIM115 (held for the process)
        self.lock = threading.Lock()

    def write(self, **fields: Any) -> None:
        with self.lock:
            self.out.write(json.dumps({"t": time.time(), **fields}) + "\n")


def _refusal(exc: grpc.RpcError) -> dict[str, Any]:
    reason, retry_info = "", False
    status = rpc_status.from_call(exc) if isinstance(exc, grpc.Call) else None
    details: list[any_pb2.Any] = list(status.details) if status is not None else []
    for detail in details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason = info.reason
        retry_info = retry_info or detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR)
    return {"code": exc.code().name, "reason": reason, "retry_info": retry_info}


def append(log: Log, stubs: list[tuple[str, Any]], batch: list[pb.ShardEvent], turn: int) -> int:
    """Sends batch until a replica acknowledges it; returns the next turn."""
    give_up = time.monotonic() + GIVE_UP_S
    request = pb.AppendEventsRequest(events=batch)
    while True:
        target, stub = stubs[turn % len(stubs)]
        turn += 1
        sent = time.monotonic()
        try:
            response = stub.AppendEvents(request, timeout=DEADLINE_S)
        except grpc.RpcError as exc:
            log.write(kind="refused", target=target, s=time.monotonic() - sent, **_refusal(exc))
            if time.monotonic() > give_up:
                log.write(kind="gave_up", events=[e.event_id for e in batch])
                raise
            time.sleep(0.05)
            continue
        log.write(
            kind="ack",
            target=target,
            s=time.monotonic() - sent,
            events=[[r.event_id, r.sequence] for r in response.results],
        )
        return turn


def work(log: Log, targets: list[str], stop: Path, worker: int) -> None:
    rng = random.Random(worker)
    stubs = [(t, pb_grpc.LedgerServiceStub(grpc.insecure_channel(t))) for t in targets]
    turn = worker
    while not stop.exists():
        turn = append(log, stubs, _batch(rng), turn)


def watch_health(log: Log, targets: list[str], stop: Path) -> None:
    stubs = [(t, health_pb2_grpc.HealthStub(grpc.insecure_channel(t))) for t in targets]
    last: dict[str, str] = {}
    while not stop.exists():
        for target, stub in stubs:
            try:
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(
                    stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
                )
            except grpc.RpcError as exc:
                status = exc.code().name
            if last.get(target) != status:
                last[target] = status
                log.write(kind="health", target=target, status=status)
        time.sleep(0.05)


def watch_patroni(log: Log, nodes: dict[str, str], stop: Path) -> None:
    """Logs each change of a Patroni member's role and state (GET /patroni) with its time."""
    last: dict[str, tuple[str, str, int, int]] = {}
    while not stop.exists():
        for name, address in nodes.items():
            try:
                with urllib.request.urlopen(f"http://{address}/patroni", timeout=0.5) as answer:
                    state = json.loads(answer.read())
            except urllib.error.HTTPError as exc:  # 503: not running, and says how
                state = json.loads(exc.read() or b"{}")
            except (OSError, ValueError):
                state = {"role": "unreachable", "state": "unreachable"}
            # A leader's synchronous standbys now streaming from it: in strict synchronous
            # mode it commits nothing before the first.
            sync = sum(
                1
                for r in state.get("replication") or []
                if r.get("state") == "streaming" and r.get("sync_state") in ("sync", "quorum")
            )
            seen = (
                str(state.get("role")),
                str(state.get("state")),
                int(state.get("timeline") or 0),
                sync,
            )
            if last.get(name) != seen:
                last[name] = seen
                log.write(
                    kind="role", node=name, role=seen[0], state=seen[1], timeline=seen[2], sync=sync
                )
        time.sleep(0.1)


def main() -> int:
    out, stop, *targets = sys.argv[1:]
    log = Log(Path(out))
    seed = [planned(run, "seed") for run in SHARED_RUNS]
    for event in seed:
        # Fixed ids: a later load on the same ledger resends the same plan, answered DUPLICATE.
        event.event_id = f"seed-{event.run_id}"
    stubs = [(t, pb_grpc.LedgerServiceStub(grpc.insecure_channel(t))) for t in targets]
    append(log, stubs, seed, 0)
    log.write(kind="started")
    threads = [
        threading.Thread(target=work, args=(log, targets, Path(stop), w)) for w in range(WORKERS)
    ]
    threads.append(threading.Thread(target=watch_health, args=(log, targets, Path(stop))))
    # PATRONI_NODES: "pg1=10.x.0.4:8008,pg2=..." (tests/patroni.py sets it).
    nodes = dict(
        item.split("=", 1) for item in os.environ.get("PATRONI_NODES", "").split(",") if item
    )
    threads.append(threading.Thread(target=watch_patroni, args=(log, nodes, Path(stop))))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    log.write(kind="stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
