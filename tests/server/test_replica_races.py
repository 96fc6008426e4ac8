"""Replicas racing on one PostgreSQL: one event id twice, one new run twice, locks, late commits."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from ledger_server.audit import verify_store
from ledger_server.config import ServerConfig
from ledger_server.server import RunningServer, create_server
from ledger_server.store.base import StoreError
from ledger_server.store.postgres import PostgresStore
from ledger_server.store.postgres_sql import MIGRATIONS, server_role_grants
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from shard_client.errors import LedgerClientError, LedgerUnavailable
from tests import pg
from tests.builders import committed, planned, started

# The PostgreSQL fixtures, found by pytest under these names.
pg_cluster = pg.pg_cluster
pg_url = pg.pg_url


def _in_process(url: str, tmp_path: Path, count: int) -> list[RunningServer]:
    key = str(tmp_path / "signing-key.pem")
    return [
        create_server(ServerConfig(database=url, listen="127.0.0.1:0", signing_key=key))
        for _ in range(count)
    ]


def test_same_batch_sent_to_two_replicas_at_once_is_stored_once(
    pg_url: str, tmp_path: Path
) -> None:
    servers = _in_process(pg_url, tmp_path, 2)
    clients = [LedgerClient(f"127.0.0.1:{s.port}") for s in servers]
    try:
        with ThreadPoolExecutor(2) as pool:
            for round_no in range(20):
                # Even rounds create a new run in the race; odd ones append to an existing one.
                run = f"race-{round_no - round_no % 2}"
                shard = f"s{round_no}"
                batch = [planned(run, shard), started(run, shard, "a1")]
                answers = list(pool.map(lambda c, b=batch: c.append(b), clients))
                for per_event in zip(*answers, strict=True):
                    assert len({r.sequence for r in per_event}) == 1
                    assert sorted(r.outcome for r in per_event) == [
                        pb.APPEND_OUTCOME_APPENDED,
                        pb.APPEND_OUTCOME_DUPLICATE,
                    ]
                # Different event ids for one brand-new run, at once: both land, one chain.
                fresh = f"fresh-{round_no}"
                both = list(
                    pool.map(
                        lambda c, i, run=fresh: c.append([planned(run, f"p{i}")]),
                        clients,
                        range(2),
                    )
                )
                assert all(r[0].outcome == pb.APPEND_OUTCOME_APPENDED for r in both)
    finally:
        for s in servers:
            s.stop(0.5)
    store = PostgresStore(pg_url)
    try:
        reports = verify_store(store)
    finally:
        store.close()
    assert len(reports) == 30 and all(r.ok for r in reports)
    assert {r.events for r in reports if r.run_id.startswith("fresh-")} == {2}


def test_one_event_id_raced_into_two_runs_is_stored_once_and_refused_once(
    pg_url: str, tmp_path: Path
) -> None:
    servers = _in_process(pg_url, tmp_path, 2)
    clients = [LedgerClient(f"127.0.0.1:{s.port}", retry_deadline_s=0) for s in servers]
    try:
        clients[0].append([planned("x", "seed"), planned("y", "seed")])
        with ThreadPoolExecutor(2) as pool:
            for round_no in range(10):
                # Different runs take different locks, so both writers get as far as the
                # unique index: the loser's violation must become a clean answer, not an error.
                shared = f"e{round_no}"
                batches = [[planned(run, f"s{round_no}")] for run in ("x", "y")]
                for batch in batches:
                    batch[0].event_id = shared

                def send(i: int, batches: list[list[pb.ShardEvent]] = batches) -> str:
                    try:
                        return pb.AppendOutcome.Name(clients[i].append(batches[i])[0].outcome)
                    except LedgerClientError as exc:
                        return getattr(exc, "reason", type(exc).__name__)

                assert sorted(pool.map(send, range(2))) == [
                    "APPEND_OUTCOME_APPENDED",
                    "EVENT_ID_REUSED",
                ]
    finally:
        for s in servers:
            s.stop(0.5)


def test_one_run_waits_for_its_lock_while_other_runs_proceed(pg_url: str, tmp_path: Path) -> None:
    import psycopg

    servers = _in_process(pg_url, tmp_path, 2)
    one, other = (LedgerClient(f"127.0.0.1:{s.port}", timeout_s=20) for s in servers)
    try:
        one.append([planned("busy", "s0"), planned("free", "s0")])
        with psycopg.connect(pg_url) as holder:  # another replica mid-group on "busy"
            holder.execute("SELECT 1 FROM runs WHERE run_id = 'busy' FOR UPDATE")
            with ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(one.append, [started("busy", "s0", "a1")])
                start = time.monotonic()
                other.append([started("free", "s0", "a1")])
                assert time.monotonic() - start < 2.0
                time.sleep(0.5)
                assert not waiting.done(), "an append to a locked run did not wait"
                holder.rollback()
                assert waiting.result(10)[0].outcome == pb.APPEND_OUTCOME_APPENDED
    finally:
        for s in servers:
            s.stop(0.5)


def test_a_replica_gone_silent_mid_group_frees_its_run_locks_within_the_write_timeout(
    pg_url: str, tmp_path: Path
) -> None:
    # A replica cut off from the database (tests/contract/test_netns_faults.py) leaves its
    # session idle in its transaction, the run locked, and the server keeps that session
    # for as long as its TCP connection looks alive: hours without a reset. The store's
    # sessions end such a transaction after write_timeout, so another replica's append to
    # the run goes through after about that long (it waited up to 60 s).
    url = f"{pg_url}?write_timeout=1.5"
    (server,) = _in_process(url, tmp_path, 1)
    client = LedgerClient(f"127.0.0.1:{server.port}", timeout_s=20, retry_deadline_s=20)
    silent = PostgresStore(url)
    try:
        client.append([planned("busy", "s0")])
        with pytest.raises(StoreError), silent.write() as tx:
            tx.conn.execute("SELECT 1 FROM runs WHERE run_id = 'busy' FOR UPDATE")
            start = time.monotonic()
            # The append waits for the run lock, until the database ends the silent session.
            (result,) = client.append([started("busy", "s0", "a1")])
            waited = time.monotonic() - start
            assert result.outcome == pb.APPEND_OUTCOME_APPENDED
            assert 1.0 < waited < 6.0, waited
        # Its own group ended with the session: rolled back, never committed.
    finally:
        silent.close()
        client.close()
        server.stop(0.5)


def test_store_sessions_end_silent_transactions_and_find_a_vanished_replica_host(
    pg_url: str,
) -> None:
    # Both ends of a store's session find a replica host that vanished without a reset
    # (tests/contract/test_netns_faults.py cuts one off mid-group): the server drops an
    # idle transaction after write_timeout, and, as the client does, probes the
    # connection after 5 s of silence, every 2 s, 3 times, rather than the kernel's hours.
    store = PostgresStore(f"{pg_url}?write_timeout=1.5")
    try:
        (row,) = store.execute_raw(
            "SELECT current_setting('idle_in_transaction_session_timeout'),"
            " current_setting('tcp_keepalives_idle'), current_setting('tcp_keepalives_interval'),"
            " current_setting('tcp_keepalives_count')"
        )
    finally:
        store.close()
    assert tuple(row) == ("1500ms", "5", "2", "3")


def test_list_events_never_skips_an_event_that_commits_late(pg_url: str) -> None:
    import psycopg

    store = PostgresStore(pg_url)
    try:
        (run_pk,) = store.execute_raw(
            "INSERT INTO runs (namespace, run_id, event_count, head_hash, created_us, updated_us)"
            " VALUES ('default', 'late', 0, '\\x00', 0, 0) RETURNING run_pk"
        )[0]
        insert = (
            'INSERT INTO events (run_pk, run_seq, event_id, "row", hash)'
            " VALUES (%s, %s, %s, '\\x7b7d', '\\x00') RETURNING seq"
        )
        store.execute_raw(insert, (run_pk, 1, "e1"))
        with psycopg.connect(pg_url) as slow, psycopg.connect(pg_url, autocommit=True) as fast:
            # A writer that ignores the run lock (the lock is what normally prevents this):
            # the lower sequence number commits after the higher one.
            (low,) = slow.execute(insert, (run_pk, 2, "e2")).fetchone()  # type: ignore[misc]
            (high,) = fast.execute(insert, (run_pk, 3, "e3")).fetchone()  # type: ignore[misc]
            assert low < high
            view = store.read()
            assert [e.event_id for e in view.list_events(run_pk, after_sequence=0, limit=10)] == [
                "e1"
            ]
            slow.commit()
        page = store.read().list_events(run_pk, after_sequence=0, limit=10)
        assert [e.event_id for e in page] == ["e1", "e2", "e3"]
    finally:
        store.close()


def test_replicas_migrating_at_once_apply_each_migration_once(pg_url: str) -> None:
    with ThreadPoolExecutor(6) as pool:
        stores = list(pool.map(lambda _: PostgresStore(pg_url), range(6)))
    try:
        applied = stores[0].applied_migrations()
        assert [(v, n) for v, n, _ in applied] == [(v, n) for v, n, _ in MIGRATIONS]
        assert {s.schema_version() for s in stores} == {MIGRATIONS[-1][0]}
    finally:
        for s in stores:
            s.close()


def _as_role(url: str, role: str, password: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{role}:{password}@{host}"))


def test_server_role_grants_allow_appends_and_refuse_rewrites(pg_url: str, tmp_path: Path) -> None:
    import psycopg

    role, password = f"sl_app_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    owner = PostgresStore(pg_url)
    try:
        owner.execute_raw(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
        for statement in server_role_grants(role):
            owner.execute_raw(statement)
        # Even with the triggers gone, the privileges alone refuse a rewrite.
        owner.execute_raw("ALTER TABLE events DISABLE TRIGGER USER")
        app_url = _as_role(pg_url, role, password)
        (running,) = _in_process(app_url, tmp_path, 1)
        try:
            LedgerClient(f"127.0.0.1:{running.port}").append([planned(), started()])
        finally:
            running.stop(0.5)
        with psycopg.connect(app_url, autocommit=True) as conn:
            for sql in ("UPDATE events SET hash = hash", "DELETE FROM events", "TRUNCATE events"):
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    conn.execute(sql)
        assert owner.execute_raw("SELECT COUNT(*) FROM events") == [(2,)]
    finally:
        owner.execute_raw(f"DROP OWNED BY {role}")
        owner.execute_raw(f"DROP ROLE {role}")
        owner.close()


def test_database_errors_reach_clients_as_unavailable(pg_url: str, tmp_path: Path) -> None:
    (running,) = _in_process(pg_url + "?pool_timeout=1", tmp_path, 1)
    client = LedgerClient(f"127.0.0.1:{running.port}", timeout_s=5)
    try:
        client.append([planned()])
        store = PostgresStore(pg_url)
        try:
            # Cut every server session, as a failover would.
            store.execute_raw(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = 'shardledger' AND pid <> pg_backend_pid()"
            )
        finally:
            store.close()
        # The pool drops dead connections at checkout: the next append just works.
        assert client.append([started()])[0].outcome == pb.APPEND_OUTCOME_APPENDED
        running.ledger.store.close()  # now nothing can reach the database
        with pytest.raises(LedgerClientError) as caught:
            client.append([committed()], retry=False)
        assert isinstance(caught.value, LedgerUnavailable)
    finally:
        running.stop(0.5)
