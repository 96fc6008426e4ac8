"""PostgreSQL failover: the primary crashes under load, its synchronous standby is promoted.

A primary and a streaming standby (tests/pg.py, `start_replicated_pair`) serve one
ledger; a server process reaches them through a multi-host libpq URL with
``target_session_attrs=read-write``, so it writes to whichever of the two is the
primary without a restart. The standby is synchronous (``synchronous_standby_names``
names it and the store sets ``synchronous_commit = on``): a COMMIT returns, and the
server acknowledges the append, only once the standby has flushed it. That is the
condition under which "nothing acknowledged is lost across the promotion" can hold;
with an asynchronous standby the last acknowledged commits may never reach it.

The loop test crashes and promotes several times in a row, rebuilding the crashed
primary as the new standby each time, and holds every replica to the recovery bound
of docs/operations.md ("Failover"): acknowledging again within BOUND_S of the new
primary taking writes, refusing (never hanging) calls meanwhile, and NOT_SERVING for
as long as it cannot write. ``python -m tools.campaign --suites failover --failovers 50``
runs it longer.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from ledger_server.config import ServerConfig
from ledger_server.server import SERVICE_NAME, RunningServer, create_server
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.api.shardledger.v1 import ledger_pb2_grpc as pb_grpc
from shard_client.client import LedgerClient
from tests import campaign, pg
from tests.builders import planned, started
from tests.pg import PgCluster
from tests.server.test_replicas import ROOT, Load, Replica, assert_ledger_holds_exactly

pytestmark = pytest.mark.postgres  # its `pair` fixture starts a primary and a standby

# docs/operations.md, "Failover": a replica acknowledges again within this many seconds of
# the new primary taking writes (the probe's 0.25 s retry plus two connects of at most
# 2 s each, the first to a host that never answers).
BOUND_S: Final = 5.0
# The clients' call deadline; a refusal must come back within a small part of it.
DEADLINE_S: Final = 5.0
FAIL_FAST_S: Final = DEADLINE_S / 4
PROBE_INTERVAL_S: Final = ServerConfig().store_probe_interval_s
FAILOVERS: Final = campaign.failovers(3)
# Seconds from the crash to the promotion, in turn: at once (appends in flight, every
# connection just broken), mid-reconnect (the probe retrying, psycopg_pool's own attempts
# under way), and past where psycopg_pool's backoff alone would next try at 3 s.
DELAYS_S: Final = (0.0, 1.3, 3.2)
SERVING: Final = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING: Final = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def pair() -> Iterator[tuple[PgCluster, PgCluster]]:
    """Starts a primary with a synchronous standby; both are removed after the test."""
    if pg.find_bin_dir() is None:
        pytest.skip(pg.SKIP_REASON)
    primary, standby = pg.start_replicated_pair()
    try:
        yield primary, standby
    finally:
        standby.destroy()
        primary.destroy()


def _failover_url(primary: PgCluster, standby: PgCluster, dbname: str) -> str:
    return (
        f"postgresql://postgres@127.0.0.1:{primary.port},127.0.0.1:{standby.port}/{dbname}"
        "?target_session_attrs=read-write"
    )


def _cli(*argv: str) -> tuple[int, dict[str, object]]:
    done = subprocess.run(
        [sys.executable, "-m", "shardledger_cli", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout, done.stderr
    return done.returncode, json.loads(done.stdout)


@pytest.mark.slow
def test_promoted_standby_holds_every_acknowledged_event_and_takes_new_appends(
    pair: tuple[PgCluster, PgCluster], tmp_path: Path
) -> None:
    primary, standby = pair
    db_url = primary.create_database()
    dbname = db_url.rsplit("/", 1)[1]
    standby_url = standby.url(dbname)
    server = Replica(_failover_url(primary, standby, dbname), tmp_path, "failover")
    server.start()
    try:
        seed = LedgerClient(server.target).append([planned(run, "seed") for run in ("r0", "r1")])
        with Load(
            (server,), workers=3, retry_s=60, acked={r.event_id: r.sequence for r in seed}
        ) as load:
            deadline = time.monotonic() + 20
            while len(load.acked) < 300 and time.monotonic() < deadline and not load.failures:
                time.sleep(0.05)
            with load.lock:
                acked_before_kill = dict(load.acked)
            primary.stop("immediate")  # a crash: no checkpoint, no goodbye to the standby
            time.sleep(0.5)
            pg.promote(standby)
            deadline = time.monotonic() + 30
            while (
                len(load.acked) < len(acked_before_kill) + 100
                and time.monotonic() < deadline
                and not load.failures
            ):
                time.sleep(0.1)
        assert load.failures == []
        assert len(load.acked) >= len(acked_before_kill) + 100, "appends did not resume"
        # An append in flight at the crash, and every one until the server's probe finds the
        # promoted standby, is answered UNAVAILABLE at once (and resent): none waits in the
        # connection pool. The loop test below holds the timing to the documented bound.
        print(f"appends answered UNAVAILABLE during the failover: {load.unavailable}")
    finally:
        server.stop()

    # Every event acknowledged before the crash is on the promoted standby, at its sequence,
    # once; so is every event acknowledged after it, and nothing else.
    assert {e: s for e, s in load.acked.items() if e in acked_before_kill} == acked_before_kill
    assert_ledger_holds_exactly(
        standby_url,
        load.acked,
        suite="pg_failover",
        kills=1,
        acknowledged_before_kill=len(acked_before_kill),
    )
    code, report = _cli("audit", "verify", "--db", standby_url, "--json")
    assert (code, report["ok"]) == (0, True), report
    code, report = _cli("db", "rebuild", "--database-url", standby_url, "--check", "--json")
    assert code == 0, report

    # A server given only the new primary's address starts and appends.
    fresh = Replica(standby_url, tmp_path, "after")
    fresh.start()
    try:
        shard = uuid.uuid4().hex[:12]
        results = LedgerClient(fresh.target).append([planned("r0", shard), started("r0", shard)])
        assert [r.outcome for r in results] == [pb.APPEND_OUTCOME_APPENDED] * 2
        assert all(r.sequence > max(load.acked.values()) for r in results)
    finally:
        fresh.stop()


class HealthWatch:
    """Polls one replica's health every 20 ms, keeping (time, status) of every answer."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = health_pb2_grpc.HealthStub(self.channel)
        self.samples: list[tuple[float, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll)
        self.thread.start()

    def _poll(self) -> None:
        request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        while not self.stop.is_set():
            try:
                status = int(self.stub.Check(request, timeout=1).status)
            except grpc.RpcError:
                status = -1
            self.samples.append((time.monotonic(), status))
            self.stop.wait(0.02)

    def statuses(self, start: float, end: float) -> set[int]:
        """Returns the statuses answered between start and end."""
        return {status for at, status in list(self.samples) if start <= at <= end}

    def first(self, status: int, after: float) -> float | None:
        """Returns when status was first answered after a moment, or None."""
        return next((at for at, s in list(self.samples) if at > after and s == status), None)

    def close(self) -> None:
        """Stops polling."""
        self.stop.set()
        self.thread.join(10)
        self.channel.close()


@dataclass(frozen=True, slots=True)
class Call:
    """One AppendEvents call of the failover load."""

    replica: int
    sent: float
    done: float
    code: grpc.StatusCode
    reason: str = ""
    retry_info: bool = False


def _refusal(replica: int, sent: float, exc: grpc.RpcError) -> Call:
    reason, retry_info = "", False
    status = rpc_status.from_call(exc) if isinstance(exc, grpc.Call) else None
    details: list[any_pb2.Any] = list(status.details) if status is not None else []
    for detail in details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason = info.reason
        retry_info = retry_info or detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR)
    return Call(replica, sent, time.monotonic(), exc.code(), reason, retry_info)


class FailoverLoad:
    """Client threads appending through every replica in turn, timing each call."""

    def __init__(
        self, replicas: tuple[Replica, ...], workers: int, *, acked: dict[str, int]
    ) -> None:
        self.targets = [r.target for r in replicas]
        self.acked = dict(acked)
        self.calls: list[Call] = []
        self.failures: list[BaseException] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._work, args=(w,)) for w in range(workers)]

    def __enter__(self) -> FailoverLoad:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)

    def _work(self, worker: int) -> None:
        rng = random.Random(worker)
        channels = [grpc.insecure_channel(t) for t in self.targets]
        stubs = [pb_grpc.LedgerServiceStub(c) for c in channels]
        turn = worker
        try:
            while not self.stop.is_set():
                run = rng.choice(("r0", "r1", "r2"))
                shards = [uuid.uuid4().hex[:12] for _ in range(rng.randint(1, 4))]
                batch = [e for s in shards for e in (planned(run, s), started(run, s, "a1"))]
                turn = self._append(stubs, batch, turn) + 1
        except BaseException as exc:
            self.failures.append(exc)
        finally:
            for c in channels:
                c.close()

    def _append(
        self, stubs: list[pb_grpc.LedgerServiceStub], batch: list[pb.ShardEvent], turn: int
    ) -> int:
        give_up = time.monotonic() + 60
        request = pb.AppendEventsRequest(events=batch)
        while True:
            replica = turn % len(stubs)
            sent = time.monotonic()
            try:
                response = stubs[replica].AppendEvents(request, timeout=DEADLINE_S)
            except grpc.RpcError as exc:
                # In doubt: resend the same event ids to the next replica (idempotent).
                with self.lock:
                    self.calls.append(_refusal(replica, sent, exc))
                if time.monotonic() > give_up:
                    raise
                turn += 1
                time.sleep(0.05)
                continue
            call = Call(replica, sent, time.monotonic(), grpc.StatusCode.OK)
            assert [r.event_id for r in response.results] == [e.event_id for e in batch]
            with self.lock:
                self.calls.append(call)
                for r in response.results:
                    assert self.acked.setdefault(r.event_id, r.sequence) == r.sequence
            return turn

    def acks(self, replica: int, *, sent_after: float) -> list[Call]:
        """Returns the replica's acknowledged calls sent after a moment."""
        with self.lock:
            return [
                c
                for c in self.calls
                if c.replica == replica and c.code == grpc.StatusCode.OK and c.sent > sent_after
            ]

    def wait_acks(self, count: int, *, sent_after: float, timeout_s: float) -> None:
        """Waits until every replica acknowledged count calls sent after a moment."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.failures:
            if all(
                len(self.acks(i, sent_after=sent_after)) >= count for i in range(len(self.targets))
            ):
                return
            time.sleep(0.02)


@dataclass(slots=True)
class Round:
    """What one stop-and-promote round measured, in seconds."""

    delay_s: float
    allowance_s: float
    down_s: float  # from the crash until the new primary took writes
    first_ack_s: list[float]  # per replica, after the new primary took writes
    not_serving_after_stop_s: list[float]  # inf: never seen
    serving_after_promotion_s: list[float]
    serving_while_down: list[bool]


def _allowance(load: FailoverLoad, since: float) -> float:
    # The machine's own slowness, measured: twice the slowest acknowledged append of the
    # steady load just before the crash (a loaded CI machine answers slower everywhere).
    with load.lock:
        slowest = max(
            (
                c.done - c.sent
                for c in load.calls
                if c.sent > since and c.code == grpc.StatusCode.OK
            ),
            default=0.0,
        )
    return max(2 * slowest, 0.5)


@pytest.mark.slow
def test_repeated_failovers_lose_nothing_and_every_replica_writes_again_within_the_bound(
    pair: tuple[PgCluster, PgCluster], tmp_path: Path
) -> None:
    primary, standby = pair
    db_url = primary.create_database()
    dbname = db_url.rsplit("/", 1)[1]
    url = _failover_url(primary, standby, dbname)
    replicas = (Replica(url, tmp_path, "a"), Replica(url, tmp_path, "b"))
    for replica in replicas:
        replica.start()
    watches = [HealthWatch(r.target) for r in replicas]
    rounds: list[Round] = []
    try:
        seed = LedgerClient(replicas[0].target).append(
            [planned(run, "seed") for run in ("r0", "r1", "r2")]
        )
        with FailoverLoad(
            replicas, workers=3, acked={r.event_id: r.sequence for r in seed}
        ) as load:
            steady = time.monotonic()
            for n in range(FAILOVERS):
                load.wait_acks(10, sent_after=steady, timeout_s=30)
                assert load.failures == []
                allowance = _allowance(load, steady)
                delay = DELAYS_S[n % len(DELAYS_S)]
                stopped = time.monotonic()
                primary.stop("immediate")  # a crash: no checkpoint, no goodbye to the standby
                time.sleep(delay)
                promoting = time.monotonic()
                pg.promote(standby)
                writable = time.monotonic()
                load.wait_acks(1, sent_after=promoting, timeout_s=BOUND_S + allowance + 10)
                firsts = []
                for i in range(len(replicas)):
                    acks = load.acks(i, sent_after=promoting)
                    firsts.append(
                        max(min((c.done for c in acks), default=float("inf")) - writable, 0.0)
                    )
                # Health: NOT_SERVING from (at the latest) one probe interval after the crash
                # until the promotion, SERVING again after it.
                detected = stopped + PROBE_INTERVAL_S + allowance
                rounds.append(
                    Round(
                        delay_s=delay,
                        allowance_s=allowance,
                        down_s=writable - stopped,
                        first_ack_s=firsts,
                        not_serving_after_stop_s=[
                            (w.first(NOT_SERVING, stopped) or float("inf")) - stopped
                            for w in watches
                        ],
                        serving_after_promotion_s=[
                            max((w.first(SERVING, promoting) or float("inf")) - writable, 0.0)
                            for w in watches
                        ],
                        serving_while_down=[
                            SERVING in w.statuses(detected, promoting) for w in watches
                        ],
                    )
                )
                # The crashed primary comes back as the new primary's synchronous standby, on
                # its own port: the URL's two hosts trade roles every round.
                pg.rejoin_as_standby(primary, standby)
                primary, standby = standby, primary
                steady = time.monotonic()
            load.wait_acks(10, sent_after=steady, timeout_s=30)
    finally:
        for watch in watches:
            watch.close()
        for replica in replicas:
            replica.stop()

    for n, r in enumerate(rounds):
        print(
            f"failover {n + 1}: promoted {r.delay_s} s after the crash (writable again after"
            f" {r.down_s:.2f} s); first ack per replica"
            f" {[round(s, 2) for s in r.first_ack_s]} s after it took writes; NOT_SERVING"
            f" {[round(s, 2) for s in r.not_serving_after_stop_s]} s after the crash,"
            f" SERVING again {[round(s, 2) for s in r.serving_after_promotion_s]} s"
            f" after the promotion (allowance {r.allowance_s:.2f} s)"
        )
    refused = [c for c in load.calls if c.code != grpc.StatusCode.OK]
    deadline_exceeded = [c for c in refused if c.code == grpc.StatusCode.DEADLINE_EXCEEDED]
    slowest_refusal = max((c.done - c.sent for c in refused), default=0.0)
    print(
        f"{len(refused)} refusals ({sorted({(c.code.name, c.reason) for c in refused})}),"
        f" slowest {slowest_refusal:.3f} s; {len(deadline_exceeded)} DEADLINE_EXCEEDED"
    )
    firsts = [s for r in rounds for s in r.first_ack_s]
    over = [s for r in rounds for s in r.first_ack_s if s > BOUND_S + r.allowance_s]
    assert_ledger_holds_exactly(
        primary.url(dbname),
        load.acked,
        suite="pg_failover_loop",
        kills=len(rounds),
        first_ack_s=[round(s, 3) for s in firsts],
        bound_s=BOUND_S,
        refusals=len(refused),
        slowest_refusal_s=round(slowest_refusal, 3),
        deadline_exceeded=len(deadline_exceeded),
        over_bound=len(over),
    )
    assert load.failures == []
    assert len(rounds) == FAILOVERS
    assert deadline_exceeded == [], "a call waited out its deadline instead of being refused"
    assert {(c.code, c.reason) for c in refused} <= {
        (grpc.StatusCode.UNAVAILABLE, "STORE_UNAVAILABLE")
    }
    assert all(c.retry_info for c in refused), "a refusal without a RetryInfo delay"
    assert slowest_refusal <= FAIL_FAST_S, "a refusal took a large part of the call's deadline"
    for r in rounds:
        assert all(s <= BOUND_S + r.allowance_s for s in r.first_ack_s), r
        # NOT_SERVING is promised while the store stays unwritable past one probe interval;
        # a store writable again sooner (promotion at once) may never be seen down at all.
        detect_s = PROBE_INTERVAL_S + r.allowance_s
        assert all(
            s <= detect_s or (s == float("inf") and r.down_s <= detect_s)
            for s in r.not_serving_after_stop_s
        ), r
        assert all(s <= BOUND_S + r.allowance_s for s in r.serving_after_promotion_s), r
        assert not any(r.serving_while_down), r


def _sample(running: RunningServer, name: str, **labels: str) -> float | None:
    return running.metrics.registry.get_sample_value(name, labels)


@pytest.mark.slow
def test_health_follows_a_probe_of_the_store_while_nothing_is_appended(
    pair: tuple[PgCluster, PgCluster], tmp_path: Path
) -> None:
    primary, standby = pair
    dbname = primary.create_database().rsplit("/", 1)[1]
    config = ServerConfig(
        database=_failover_url(primary, standby, dbname),
        listen="127.0.0.1:0",
        signing_key=str(tmp_path / "key.pem"),
    )
    running = create_server(config)
    target = f"127.0.0.1:{running.port}"
    channel = grpc.insecure_channel(target)
    health = health_pb2_grpc.HealthStub(channel)
    ledger = pb_grpc.LedgerServiceStub(channel)

    def status() -> int:
        request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        return int(health.Check(request, timeout=5).status)

    def wait_for(wanted: int, timeout_s: float) -> float:
        start = time.monotonic()
        while status() != wanted and time.monotonic() < start + timeout_s:
            time.sleep(0.02)
        return time.monotonic() - start

    try:
        start = time.monotonic()
        LedgerClient(target).append([planned("r0", "s0")])
        allowance = max(2 * (time.monotonic() - start), 0.5)
        assert status() == SERVING
        primary.stop("immediate")
        # Nobody appends: only the probe can tell.
        took = wait_for(NOT_SERVING, PROBE_INTERVAL_S + allowance + 5)
        print(f"NOT_SERVING {took:.2f} s after the crash, with no append")
        assert status() == NOT_SERVING and took <= PROBE_INTERVAL_S + allowance
        assert _sample(running, "shardledger_serving") == 0
        assert _sample(running, "shardledger_health_transitions_total", to="NOT_SERVING") == 1
        assert (
            _sample(running, "shardledger_store_probe_failures_total", kind="STORE_UNAVAILABLE")
            or 0
        ) >= 1
        # An append meanwhile is refused at once, with a delay to wait before resending.
        sent = time.monotonic()
        with pytest.raises(grpc.RpcError) as caught:
            ledger.AppendEvents(
                pb.AppendEventsRequest(events=[started("r0", "s0")]), timeout=DEADLINE_S
            )
        refusal = _refusal(0, sent, caught.value)
        assert (refusal.code, refusal.reason, refusal.retry_info) == (
            grpc.StatusCode.UNAVAILABLE,
            "STORE_UNAVAILABLE",
            True,
        )
        assert refusal.done - refusal.sent <= FAIL_FAST_S
        pg.promote(standby)
        took = wait_for(SERVING, BOUND_S + allowance + 5)
        print(f"SERVING {took:.2f} s after the promotion, with no append")
        assert status() == SERVING and took <= BOUND_S + allowance
        assert _sample(running, "shardledger_serving") == 1
        assert _sample(running, "shardledger_health_transitions_total", to="SERVING") == 1
        changed = _sample(running, "shardledger_health_last_transition_time_seconds")
        assert changed is not None and abs(time.time() - took - changed) < 5
        results = LedgerClient(target).append([started("r0", "s0")])
        assert [r.outcome for r in results] == [pb.APPEND_OUTCOME_APPENDED]
    finally:
        channel.close()
        running.stop(0.5)
