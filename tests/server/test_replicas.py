"""Replica processes on one PostgreSQL: SIGKILLed under load, the database crashing under load."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from ledger_server import projections as proj
from ledger_server.audit import verify_store
from ledger_server.chain import recorded
from ledger_server.record import record_from_row
from ledger_server.replay import replay_run
from ledger_server.store import open_store
from ledger_server.store.postgres import POOL_OPTIONS, PostgresStore
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.api.shardledger.v1 import ledger_pb2_grpc as pb_grpc
from shard_client.client import LedgerClient
from shard_client.errors import LedgerUnavailable
from tests import campaign, pg
from tests.builders import committed, planned, started
from tests.pg import PgCluster

# The PostgreSQL fixtures, found by pytest under these names.
pg_cluster = pg.pg_cluster
pg_url = pg.pg_url

ROOT = Path(__file__).resolve().parents[2]
REPLICA = ROOT / "tests" / "helpers" / "pg_replica.py"
KILLS = campaign.kills(6)
SHARED_RUNS = ("r0", "r1", "r2")


class Replica:
    """One server process on the shared database."""

    def __init__(self, url: str, workdir: Path, name: str) -> None:
        self.url, self.name = url, name
        self.port_file = workdir / f"{name}.port"
        self.key = str(workdir / "signing-key.pem")
        self.proc: subprocess.Popen[bytes] | None = None
        self.target = ""

    def start(self) -> None:
        """Starts the process and waits until it serves."""
        self.port_file.unlink(missing_ok=True)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, str(REPLICA), self.url, str(self.port_file), self.key],
            cwd=ROOT,
            env=env,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while not self.port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"replica {self.name} did not start")
            time.sleep(0.02)
        self.target = f"127.0.0.1:{self.port_file.read_text()}"

    def kill(self) -> None:
        """SIGKILLs the process: no drain, no rollback, mid-transaction."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        """Stops the process cleanly."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture
def replicas(pg_url: str, tmp_path: Path) -> Iterator[tuple[Replica, Replica]]:
    """Starts two replicas on one fresh database."""
    a, b = Replica(pg_url, tmp_path, "a"), Replica(pg_url, tmp_path, "b")
    a.start()
    b.start()
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()


def _batch(rng: random.Random) -> list[pb.ShardEvent]:
    run = rng.choice(SHARED_RUNS)
    events: list[pb.ShardEvent] = []
    for _ in range(rng.randint(1, 6)):
        shard = uuid.uuid4().hex[:12]
        events += [planned(run, shard), started(run, shard, "a1")]
        if rng.random() < 0.3:
            events.append(committed(run, shard, "a1"))
    return events


class Load:
    """Client threads appending to shared runs through whichever replica is up."""

    def __init__(
        self, replicas: tuple[Replica, ...], workers: int, *, retry_s: float, acked: dict[str, int]
    ) -> None:
        self.replicas = replicas
        self.retry_s = retry_s
        self.acked = dict(acked)
        self.unavailable = 0
        self.failures: list[BaseException] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._work, args=(w,)) for w in range(workers)]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)

    def _append(
        self, clients: dict[str, LedgerClient], batch: list[pb.ShardEvent], turn: int
    ) -> None:
        give_up = time.monotonic() + self.retry_s
        while True:
            replica = self.replicas[turn % len(self.replicas)]
            client = clients.setdefault(replica.target, LedgerClient(replica.target, timeout_s=5))
            try:
                results = client.append(batch, retry=False)
            except LedgerUnavailable:
                # In doubt: the batch may or may not be stored. Resend the same event ids,
                # to the next replica; idempotency makes that safe either way.
                with self.lock:
                    self.unavailable += 1
                if time.monotonic() > give_up:
                    raise
                turn += 1
                time.sleep(0.05)
                continue
            assert [r.event_id for r in results] == [e.event_id for e in batch]
            with self.lock:
                for r in results:
                    assert self.acked.setdefault(r.event_id, r.sequence) == r.sequence
            return

    def _work(self, worker: int) -> None:
        rng = random.Random(worker)
        clients: dict[str, LedgerClient] = {}
        turn = worker
        try:
            while not self.stop.is_set():
                self._append(clients, _batch(rng), turn)
                turn += 1
        except BaseException as exc:
            self.failures.append(exc)


class Tailer:
    """Follows one run on one replica and records every event it is sent."""

    def __init__(self, target: str, run_id: str) -> None:
        self.channel = grpc.insecure_channel(target)
        stub = pb_grpc.LedgerServiceStub(self.channel)
        self.stream = stub.TailEvents(pb.TailEventsRequest(run_id=run_id))
        self.seen: list[tuple[int, str]] = []
        self.thread = threading.Thread(target=self._follow)
        self.thread.start()

    def _follow(self) -> None:
        try:
            for response in self.stream:
                self.seen.append((response.event.run_sequence, response.event.event_id))
        except grpc.RpcError:
            pass  # cancelled

    def close(self) -> None:
        """Stops following."""
        self.stream.cancel()
        self.thread.join(10)
        self.channel.close()


def assert_stored_projections_equal_replay(url: str) -> None:
    """Asserts every run's stored shard rows and counters equal a fresh replay of its events."""
    store = open_store(url)
    try:
        view = store.read()
        for run in view.list_runs(None, 1 << 30):
            replay = replay_run(recorded(e) for e in view.iter_events(run.run_pk))
            assert view.counters(run.run_pk) == {k: n for k, n in replay.counters().items() if n}
            rows = [
                (
                    r.shard_id,
                    r.state,
                    r.detail,
                    r.deadline_us,
                    r.plan_line,
                    json.loads(record_from_row(r.record or b"", r.beat_us, r.beat_step).to_json()),
                )
                for r in view.iter_shards(run.run_pk)
            ]
            assert rows == [
                (
                    r.shard_id,
                    *proj.base_state(r),
                    proj.deadline_us(r),
                    r.plan_line,
                    json.loads(r.to_json()),
                )
                for r in replay.ordered()
            ]
    finally:
        store.close()


def assert_ledger_holds_exactly(
    url: str, acked: dict[str, int], *, suite: str, kills: int, **extra: object
) -> None:
    """Asserts every acknowledged event is stored once at its sequence, nothing else, chains ok.

    The tally goes to the campaign report as SUITE first (tests/campaign.py).
    """
    store = PostgresStore(url)
    try:
        rows = store.execute_raw("SELECT event_id, seq FROM events")
        reports = verify_store(store)
    finally:
        store.close()
    stored = dict(rows)
    lost = [e for e in acked if e not in stored]
    moved = [e for e in acked if e in stored and stored[e] != acked[e]]
    campaign.report(
        suite,
        {
            "kills": kills,
            "acknowledged": len(acked),
            "lost": len(lost),
            "moved": len(moved),
            "duplicated": len(rows) - len(stored),
            "unacknowledged_stored": len(set(stored) - set(acked)),
            "chains_ok": bool(reports) and all(r.ok for r in reports),
            **extra,
        },
    )
    assert len(acked) > 100, "the load was too light to mean anything"
    assert lost == moved == []
    assert len(rows) == len(stored), "an event is stored twice"
    assert len(stored) == len(acked), "an event is stored that nobody acknowledged"
    assert reports and all(r.ok for r in reports), [r for r in reports if not r.ok]
    assert_stored_projections_equal_replay(url)


def _seed(target: str) -> dict[str, int]:
    results = LedgerClient(target).append([planned(run, "seed") for run in SHARED_RUNS])
    return {r.event_id: r.sequence for r in results}


@pytest.mark.slow
def test_replica_sigkilled_repeatedly_loses_nothing_and_tail_never_skips(
    replicas: tuple[Replica, Replica], pg_url: str
) -> None:
    a, b = replicas
    seeded = _seed(a.target)
    tailer = Tailer(a.target, "r0")
    rng = random.Random(7)
    try:
        with Load((a, b), workers=6, retry_s=30, acked=seeded) as load:
            for _ in range(KILLS):
                time.sleep(rng.uniform(0.2, 0.5))
                b.kill()
                b.start()
            time.sleep(0.3)
        assert load.failures == []
        store = PostgresStore(pg_url)
        try:
            total = store.read().get_run("default", "r0")
        finally:
            store.close()
        assert total is not None
        deadline = time.monotonic() + 15
        while len(tailer.seen) < total.event_count and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        tailer.close()
    assert load.unavailable > 0, "no append ever hit a killed replica"
    assert [seq for seq, _ in tailer.seen] == list(range(1, total.event_count + 1))
    assert_ledger_holds_exactly(pg_url, load.acked, suite="pg_replica_sigkill", kills=KILLS)


@pytest.mark.slow
def test_database_crash_under_load_is_unavailable_then_loses_nothing(
    replicas: tuple[Replica, Replica],
    pg_cluster: PgCluster,
    pg_url: str,
) -> None:
    if not pg_cluster.controllable:
        pytest.skip("the tests may not stop an external PostgreSQL server")
    a, b = replicas
    with Load((a, b), workers=4, retry_s=60, acked=_seed(a.target)) as load:
        time.sleep(0.7)
        pg_cluster.stop("immediate")  # no checkpoint, no clean shutdown: crash recovery follows
        # Down for longer than the pool waits for a connection: a call that only waits for a
        # checkout (not one whose transaction the crash cut) must fail UNAVAILABLE too, so
        # the clients see the outage however the crash fell between their transactions.
        time.sleep(POOL_OPTIONS["pool_timeout"] + 1.0)
        pg_cluster.start()
        pg_cluster.wait_ready()
        before = len(load.acked)
        deadline = time.monotonic() + 30
        while len(load.acked) < before + 50 and time.monotonic() < deadline and not load.failures:
            time.sleep(0.1)
    assert load.failures == []
    assert load.unavailable > 0, "no client saw the database go away"
    assert len(load.acked) >= before + 50, "appends did not resume after the restart"
    assert_ledger_holds_exactly(pg_url, load.acked, suite="pg_database_crash", kills=1)
