"""A COMMIT that waits for a missing synchronous standby is bounded, reported and never acknowledged.

A primary with a synchronous standby (tests/pg.py, `start_replicated_pair`) serves a
ledger; the standby is stopped, so every COMMIT on the primary waits for it (PostgreSQL
would wait forever: nothing here changes synchronous_standby_names, as a failover
manager might). The server cancels a COMMIT still waiting after --pg-commit-wait-bound,
answers its appends UNAVAILABLE with a RetryInfo (never DEADLINE_EXCEEDED), says
NOT_SERVING, counts it, logs the wait, and refuses the calls behind it at once until
its probe's own write commits in time. The cancelled COMMIT is committed on the primary
only: a resend of the same events must not be acknowledged before the standby holds
them, and once it does, it is answered with the original sequences (idempotency).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import grpc
import psycopg
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from structlog.testing import capture_logs

from ledger_server.codec import decode_event
from ledger_server.config import ServerConfig
from ledger_server.server import SERVICE_NAME, RunningServer, create_server
from ledger_server.service import LedgerService
from ledger_server.store.base import StoreCommitWaitExceeded
from ledger_server.store.postgres import PostgresStore
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.api.shardledger.v1 import ledger_pb2_grpc as pb_grpc
from shard_client.client import LedgerClient
from tests.builders import planned, started
from tests.pg import PgCluster
from tests.server.test_pg_failover import _refusal, pair

pytestmark = pytest.mark.postgres

__all__ = ["pair"]  # the fixture, imported for pytest

BOUND_S: Final = 1.0
# The clients' call deadline: far above the bound, so a hang would show as DEADLINE_EXCEEDED.
DEADLINE_S: Final = 10.0
SERVING: Final = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING: Final = health_pb2.HealthCheckResponse.NOT_SERVING


def _rows(url: str, event_id: str) -> list[tuple[int]]:
    with psycopg.connect(url, autocommit=True) as conn:
        return [
            (int(r[0]),)
            for r in conn.execute("SELECT seq FROM events WHERE event_id = %s", (event_id,))
        ]


@pytest.fixture
def served(
    pair: tuple[PgCluster, PgCluster], tmp_path: Path
) -> Iterator[tuple[RunningServer, str]]:
    """Serves a fresh database of the pair's primary with a 1 s commit-wait bound."""
    primary, _ = pair
    url = primary.create_database()
    running = create_server(
        ServerConfig(
            database=url,
            listen="127.0.0.1:0",
            signing_key=str(tmp_path / "key.pem"),
            pg_commit_wait_bound_s=BOUND_S,
        )
    )
    try:
        yield running, url
    finally:
        running.stop(0.5)


def _status(channel: grpc.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return int(stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5).status)


def _wait_status(channel: grpc.Channel, wanted: int, timeout_s: float) -> float:
    start = time.monotonic()
    while _status(channel) != wanted and time.monotonic() < start + timeout_s:
        time.sleep(0.02)
    return time.monotonic() - start


def _sample(running: RunningServer, name: str, **labels: str) -> float:
    return running.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.slow
def test_commit_waiting_for_a_stopped_standby_is_refused_at_the_bound_and_reported(
    pair: tuple[PgCluster, PgCluster], served: tuple[RunningServer, str]
) -> None:
    _, standby = pair
    running, url = served
    target = f"127.0.0.1:{running.port}"
    channel = grpc.insecure_channel(target)
    ledger = pb_grpc.LedgerServiceStub(channel)
    try:
        LedgerClient(target).append([planned("r0", "s0")])
        assert _status(channel) == SERVING
        standby.stop("fast")
        stuck = started("r0", "s0")
        with capture_logs() as logs:
            sent = time.monotonic()
            with pytest.raises(grpc.RpcError) as caught:
                ledger.AppendEvents(pb.AppendEventsRequest(events=[stuck]), timeout=DEADLINE_S)
            refusal = _refusal(0, sent, caught.value)
            # Answered at the bound, not at the deadline, and told when to resend.
            assert (refusal.code, refusal.reason, refusal.retry_info) == (
                grpc.StatusCode.UNAVAILABLE,
                "STORE_UNAVAILABLE",
                True,
            )
            assert refusal.done - refusal.sent < DEADLINE_S / 2
            assert "pg-commit-wait-bound" in (caught.value.details() or "")
            # The calls behind it are refused at once, before touching the database.
            sent = time.monotonic()
            with pytest.raises(grpc.RpcError) as caught:
                ledger.AppendEvents(
                    pb.AppendEventsRequest(events=[planned("r1", "s0")]), timeout=DEADLINE_S
                )
            behind = _refusal(0, sent, caught.value)
            assert (behind.code, behind.retry_info) == (grpc.StatusCode.UNAVAILABLE, True)
            assert behind.done - behind.sent < BOUND_S
            assert _wait_status(channel, NOT_SERVING, 5) < 5
        exceeded = [e for e in logs if e["event"] == "store_commit_wait_exceeded"]
        assert exceeded and exceeded[0]["bound_s"] == BOUND_S
        assert exceeded[0]["waited_s"] >= BOUND_S
        assert (
            _sample(running, "shardledger_store_commit_wait_exceeded_total", source="append") >= 1
        )
        assert _sample(running, "shardledger_serving") == 0
        # The probe's write waits for the standby as an append's COMMIT does: still down.
        deadline = time.monotonic() + 10 * BOUND_S
        while (
            _sample(running, "shardledger_store_commit_wait_exceeded_total", source="probe") < 1
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert _sample(running, "shardledger_store_commit_wait_exceeded_total", source="probe") >= 1
        assert _status(channel) == NOT_SERVING

        # The cancelled COMMIT is on the primary only (it may or may not survive a failover).
        assert len(_rows(url, stuck.event_id)) == 1
        standby.start()
        assert _wait_status(channel, SERVING, 30) < 30
        # The client resends the refused event with its id: acknowledged once, at the row's
        # sequence, and nothing stored twice.
        results = LedgerClient(target).append([stuck, planned("r1", "s0")])
        [(seq,)] = _rows(url, stuck.event_id)
        assert [r.outcome for r in results] == [
            pb.APPEND_OUTCOME_DUPLICATE,
            pb.APPEND_OUTCOME_APPENDED,
        ]
        assert results[0].sequence == seq
    finally:
        channel.close()


@pytest.mark.slow
def test_resend_of_an_unreplicated_commit_is_not_acknowledged_until_the_standby_has_it(
    pair: tuple[PgCluster, PgCluster],
) -> None:
    primary, standby = pair
    url = primary.create_database()
    # No server and no probe: every resend reaches the database.
    store = PostgresStore(url, commit_wait_bound_s=BOUND_S)
    ledger = LedgerService(store)
    try:
        ledger.append([decode_event(planned("r0", "s0"))])
        standby.stop("fast")
        event = decode_event(started("r0", "s0"))
        with pytest.raises(StoreCommitWaitExceeded):
            ledger.append([event])
        [(seq,)] = _rows(url, event.event_id)  # committed locally, visible on the primary
        # The resend finds the row, but answering DUPLICATE takes the run's row lock, a WAL
        # record: that COMMIT waits for the standby too, and is not acknowledged either.
        with pytest.raises(StoreCommitWaitExceeded):
            ledger.append([event])
        standby.start()
        [result] = ledger.append([event])
        assert (result.sequence, _rows(url, event.event_id)) == (seq, [(seq,)])
    finally:
        ledger.close()
        store.close()


@pytest.mark.slow
def test_commit_whose_wait_an_operator_cancels_is_not_acknowledged(
    pair: tuple[PgCluster, PgCluster],
) -> None:
    primary, standby = pair
    url = primary.create_database()
    store = PostgresStore(url, commit_wait_bound_s=0)  # no bound: only the operator cancels
    ledger = LedgerService(store)
    try:
        ledger.append([decode_event(planned("r0", "s0"))])
        standby.stop("fast")

        def cancel_when_waiting() -> None:
            with psycopg.connect(primary.admin_url, autocommit=True) as conn:
                for _ in range(500):
                    row = conn.execute(
                        "SELECT pg_cancel_backend(pid) FROM pg_stat_activity"
                        " WHERE wait_event = 'SyncRep' AND application_name = 'shardledger'"
                    ).fetchone()
                    if row == (True,):
                        return
                    time.sleep(0.02)
            standby.start()  # never found waiting: release the COMMIT, so the test fails, not hangs

        canceller = threading.Thread(target=cancel_when_waiting)
        canceller.start()
        # PostgreSQL answers the cancelled COMMIT with success and a WARNING; the append fails.
        with pytest.raises(StoreCommitWaitExceeded, match="committed locally"):
            ledger.append([decode_event(started("r0", "s0"))])
        canceller.join()
    finally:
        if standby.postmaster_pid() is None:
            standby.start()
        ledger.close()
        store.close()


def test_serve_refuses_a_negative_commit_wait_bound() -> None:
    from ledger_server.startup import StartupError

    with pytest.raises(StartupError, match="--pg-commit-wait-bound"):
        create_server(ServerConfig(listen="127.0.0.1:0", pg_commit_wait_bound_s=-1))
