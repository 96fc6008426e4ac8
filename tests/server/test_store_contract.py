"""One store contract, run against every backend through a real server and the real client."""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from ledger_server import projections as proj
from ledger_server.audit import verify_store
from ledger_server.chain import recorded
from ledger_server.config import ServerConfig
from ledger_server.replay import RunReplay, replay_run
from ledger_server.server import RunningServer, create_server
from ledger_server.store import open_store
from ledger_server.summary import run_summary, shard_view
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from shard_client.errors import LedgerRejected
from shard_client.ids import run_reopened_event, submission_closed_event
from tests import pg
from tests.builders import DIGEST_A, DIGEST_B, committed, event, planned, started

# The PostgreSQL fixtures, found by pytest under these names.
pg_cluster = pg.pg_cluster
pg_url = pg.pg_url

BACKENDS = ["sqlite", "postgres"]


class Backend:
    """Raw access to one backend's database, beside the server under test."""

    name = ""

    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, sql: str) -> list[tuple[Any, ...]]:
        """Runs SQL outside the server and returns its rows."""
        raise NotImplementedError

    def count_events(self) -> int:
        """Returns how many event rows are stored."""
        return int(self.query("SELECT COUNT(*) FROM events")[0][0])

    def heads(self) -> list[tuple[Any, ...]]:
        """Returns every run head."""
        return [
            (ns, run, n, bytes(h))
            for ns, run, n, h in self.query(
                "SELECT namespace, run_id, event_count, head_hash FROM runs ORDER BY run_pk"
            )
        ]

    def edit_row_bypassing_immutability(self, seq: int) -> None:
        """Does what an attacker with the owner's rights could: rewrite one stored row."""
        raise NotImplementedError


class SqliteBackend(Backend):
    name = "sqlite"

    def query(self, sql: str) -> list[tuple[Any, ...]]:
        with sqlite3.connect(self.url[len("sqlite:///") :]) as conn:
            return conn.execute(sql).fetchall()

    def edit_row_bypassing_immutability(self, seq: int) -> None:
        self.query("DROP TRIGGER events_no_update")
        self.query(f"UPDATE events SET row = replace(row, 'node-1', 'node-X') WHERE seq = {seq}")


class PostgresBackend(Backend):
    name = "postgres"

    def query(self, sql: str) -> list[tuple[Any, ...]]:
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            cur = conn.execute(sql)
            return cur.fetchall() if cur.description else []

    def edit_row_bypassing_immutability(self, seq: int) -> None:
        self.query("ALTER TABLE events DISABLE TRIGGER USER")
        self.query(
            "UPDATE events SET row = convert_to(replace(convert_from(row, 'UTF8'),"
            f" 'node-1', 'node-X'), 'UTF8') WHERE seq = {seq}"
        )


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """Returns an empty database of each backend."""
    if request.param == "sqlite":
        return SqliteBackend(f"sqlite:///{tmp_path / 'ledger.db'}")
    return PostgresBackend(request.getfixturevalue("pg_url"))


def _start(backend: Backend, tmp_path: Path) -> RunningServer:
    key = str(tmp_path / "signing-key.pem")
    return create_server(ServerConfig(database=backend.url, listen="127.0.0.1:0", signing_key=key))


@pytest.fixture
def served(backend: Backend, tmp_path: Path) -> Iterator[RunningServer]:
    """Starts a real server on the backend."""
    running = _start(backend, tmp_path)
    yield running
    running.stop(0.5)


@pytest.fixture
def api(served: RunningServer) -> Iterator[LedgerClient]:
    """Returns a client of the served backend."""
    client = LedgerClient(f"127.0.0.1:{served.port}", timeout_s=10, retry_deadline_s=5)
    yield client
    client.close()


def _verified(
    shard: str, *, result: pb.VerificationResult = pb.VERIFICATION_RESULT_PASSED
) -> pb.ShardEvent:
    reason = "" if result == pb.VERIFICATION_RESULT_PASSED else "empty"
    return event(
        shard_id=shard,
        verified=pb.ArtifactVerified(
            name="out", path="/out/x", blake3_hex=DIGEST_A, result=result, reason=reason
        ),
    )


def _every_kind() -> list[pb.ShardEvent]:
    return [
        planned(),
        started(),
        event(attempt_id="att-1", heartbeat=pb.Heartbeat(step=7, progress=0.25, metrics={"l": 1})),
        event(
            attempt_id="att-1",
            checkpoint=pb.CheckpointSaved(step=7, path="/ck/7", size_bytes=9, blake3_hex=DIGEST_B),
        ),
        committed(),
        _verified("shard-0"),
        started(attempt_id="att-2"),
        event(attempt_id="att-2", failed=pb.AttemptFailed(tag=pb.FAILURE_TAG_OOM, message="OOM")),
        submission_closed_event(
            "run-1",
            reason="done",
            expected_shards=1,
            submitted_until=datetime(2026, 12, 2, 7, tzinfo=UTC),
        ),
        run_reopened_event("run-1", reason="a late wave"),
    ]


def _night(run: str = "night", namespace: str = "") -> list[pb.ShardEvent]:
    """Returns a history that leaves shards in every state the projections know."""
    batch: list[pb.ShardEvent] = []
    for i in range(8):
        batch.append(planned(run, f"s{i}", index=i))
    for i in range(1, 8):
        batch.append(started(run, f"s{i}", "a1"))
    for i in (2, 3, 4, 6):
        batch.append(committed(run, f"s{i}", "a1"))
    batch += [
        _verified("s3"),
        _verified("s4", result=pb.VERIFICATION_RESULT_FAILED),
        event(run, "s5", "a1", failed=pb.AttemptFailed(tag=pb.FAILURE_TAG_NCCL, message="x")),
        started(run, "s6", "a2"),
        committed(run, "s6", "a2", digest=DIGEST_B),
        event(run, "s7", "a1", heartbeat=pb.Heartbeat(step=3, progress=0.5)),
    ]
    for e in batch:
        e.run_id, e.namespace = run, namespace
    return batch


def test_every_event_kind_round_trips_with_server_fields(api: LedgerClient) -> None:
    sent = _every_kind()
    results = api.append(sent)
    assert [r.outcome for r in results] == [pb.APPEND_OUTCOME_APPENDED] * len(sent)
    got = list(api.list_events("run-1"))
    assert [e.event_id for e in got] == [e.event_id for e in sent]
    for mine, stored in zip(sent, got, strict=True):
        kind = mine.WhichOneof("payload")
        assert stored.WhichOneof("payload") == kind
        assert getattr(stored, kind) == getattr(mine, kind)
        assert stored.sequence > 0 and len(stored.row_hash) == 32
        assert stored.receive_time.seconds > 0
    assert [e.run_sequence for e in got] == list(range(1, len(sent) + 1))
    assert [e.sequence for e in got] == sorted(r.sequence for r in results)


def test_retried_batch_is_acknowledged_once_with_original_sequences(
    api: LedgerClient, backend: Backend
) -> None:
    batch = [planned(), started()]
    first = api.append(batch)
    again = api.append(batch)
    assert [r.sequence for r in again] == [r.sequence for r in first]
    assert [r.outcome for r in again] == [pb.APPEND_OUTCOME_DUPLICATE] * 2
    assert backend.count_events() == 2


def test_retry_after_a_server_restart_is_still_idempotent(backend: Backend, tmp_path: Path) -> None:
    batch = [planned(), started()]
    running = _start(backend, tmp_path)
    first = LedgerClient(f"127.0.0.1:{running.port}").append(batch)
    running.stop(0.5)
    running = _start(backend, tmp_path)
    try:
        again = LedgerClient(f"127.0.0.1:{running.port}").append(batch)
    finally:
        running.stop(0.5)
    assert [(r.sequence, r.outcome) for r in again] == [
        (r.sequence, pb.APPEND_OUTCOME_DUPLICATE) for r in first
    ]
    assert backend.count_events() == 2


def test_identical_replan_is_acknowledged_without_a_new_row(
    api: LedgerClient, backend: Backend
) -> None:
    first = api.append([planned()])
    replan = api.append([planned()])
    assert (replan[0].outcome, replan[0].sequence) == (
        pb.APPEND_OUTCOME_ALREADY_PLANNED,
        first[0].sequence,
    )
    assert backend.count_events() == 1


def _bad(name: str) -> tuple[list[pb.ShardEvent], grpc.StatusCode, str]:
    reused = planned(shard_id="shard-0")
    reused.event_id = "plan-0"
    reused.planned.input_ref = "/elsewhere"
    conflicting = planned()
    conflicting.planned.params_json = '{"lr": 0.2}'
    precondition = grpc.StatusCode.FAILED_PRECONDITION
    cases = {
        "empty run id": ([planned(run_id="")], grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD"),
        "unknown run": (
            [event(run_id="nope", attempt_id="a", heartbeat=pb.Heartbeat())],
            grpc.StatusCode.NOT_FOUND,
            "RUN_NOT_FOUND",
        ),
        "never planned": (
            [event(shard_id="ghost", attempt_id="a", heartbeat=pb.Heartbeat())],
            precondition,
            "SHARD_NOT_PLANNED",
        ),
        "artifact before start": (
            [committed(attempt_id="never")],
            precondition,
            "ATTEMPT_NOT_STARTED",
        ),
        "event id reused": ([reused], grpc.StatusCode.ALREADY_EXISTS, "EVENT_ID_REUSED"),
        "plan conflict": ([conflicting], grpc.StatusCode.ALREADY_EXISTS, "PLAN_CONFLICT"),
        "new run spoiled by a later event": (
            [planned("fresh"), started("fresh"), committed("fresh", attempt_id="zz")],
            precondition,
            "ATTEMPT_NOT_STARTED",
        ),
        # The close in the batch is refused with the new shard after it.
        "new shard of a closed run": (
            [submission_closed_event("run-1"), planned(shard_id="shard-9", index=9)],
            precondition,
            "RUN_CLOSED",
        ),
        "reopen of a run not closed": (
            [run_reopened_event("run-1")],
            precondition,
            "RUN_NOT_CLOSED",
        ),
    }
    return cases[name]


@pytest.mark.parametrize(
    "case",
    [
        "empty run id",
        "unknown run",
        "never planned",
        "artifact before start",
        "event id reused",
        "plan conflict",
        "new run spoiled by a later event",
        "new shard of a closed run",
        "reopen of a run not closed",
    ],
)
def test_bad_input_gets_its_code_and_reason_and_writes_nothing(
    api: LedgerClient, backend: Backend, case: str
) -> None:
    plan = planned()
    plan.event_id = "plan-0"
    api.append([plan, started()])
    before = (backend.count_events(), backend.heads())
    batch, code, reason = _bad(case)
    with pytest.raises(grpc.RpcError) as caught:
        api.stub.AppendEvents(pb.AppendEventsRequest(events=batch), timeout=5)
    status = rpc_status.from_call(cast(grpc.Call, caught.value))
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert (caught.value.code(), info.reason) == (code, reason)
    assert (backend.count_events(), backend.heads()) == before


def test_database_refuses_update_and_delete_of_events(api: LedgerClient, backend: Backend) -> None:
    api.append(_every_kind())
    for sql in ("UPDATE events SET hash = hash WHERE seq > 0", "DELETE FROM events"):
        with pytest.raises(Exception, match="append-only") as refused:
            backend.query(sql)
        assert type(refused.value).__module__.split(".")[0] in ("sqlite3", "psycopg")
    assert backend.count_events() == len(_every_kind())
    store = open_store(backend.url)
    try:
        assert store.integrity_check() == "ok"
    finally:
        store.close()


def test_chains_verify_and_an_edited_row_is_named(api: LedgerClient, backend: Backend) -> None:
    results = api.append(_every_kind())
    api.append([planned(run_id="run-2")])
    store = open_store(backend.url)
    try:
        assert [(r.run_id, r.ok, r.events) for r in verify_store(store)] == [
            ("run-1", True, len(_every_kind())),
            ("run-2", True, 1),
        ]
        backend.edit_row_bypassing_immutability(results[1].sequence)
        broken = verify_store(store, run_id="run-1")[0]
    finally:
        store.close()
    assert (broken.ok, broken.first_bad_sequence) == (False, results[1].sequence)


def _replay(url: str, namespace: str, run_id: str) -> RunReplay:
    store = open_store(url)
    try:
        view = store.read()
        run = view.get_run(namespace, run_id)
        assert run is not None
        return replay_run(recorded(e) for e in view.iter_events(run.run_pk))
    finally:
        store.close()


def assert_projections_match_replay(
    client: LedgerClient, url: str, run_id: str, namespace: str = ""
) -> None:
    """Asserts the served summary, shard views and resume list equal a fresh replay."""
    ns = namespace or "default"
    replay = _replay(url, ns, run_id)
    summary = json.loads(client.summary(run_id, namespace=namespace))
    at = summary.pop("as_of_us")
    for key in ("event_count", "head_hash"):
        summary.pop(key)
    expected = run_summary(
        replay.counters(),
        stale=replay.stale_count(at),
        run_id=run_id,
        namespace=ns,
        last_event_us=replay.last_receive_us,
        now_us=at,
    )
    assert summary == json.loads(json.dumps(expected))
    views = [json.loads(v.view_json) for v in client.shards(run_id, namespace=namespace)]
    assert views == [json.loads(json.dumps(shard_view(r, at))) for r in replay.ordered()]
    resume = [
        (e.shard_id, e.plan_line, e.reason) for e in client.resume(run_id, namespace=namespace)
    ]
    assert resume == [
        (r.shard_id, r.plan_line, proj.resume_reason(r, at))
        for r in replay.ordered()
        if proj.resume_reason(r, at) is not None
    ]


def test_projections_equal_a_fresh_replay(api: LedgerClient, backend: Backend) -> None:
    api.append(_night())
    api.append(_night("night-2", namespace="team-b")[:9])
    api.append(_night("night-2", namespace="team-b")[9:12])
    api.close_submission("night-2", namespace="team-b", reason="no job starts any more")
    # Reopened for a late shard and closed again: the counters a replay sums are the same.
    api.reopen_submission("night-2", namespace="team-b", reason="a late shard")
    late = planned("night-2", "s9", index=9)
    late.namespace = "team-b"
    api.append([late])
    api.close_submission("night-2", namespace="team-b", reason="no job starts any more")
    summary = json.loads(api.summary("night"))
    assert (summary["submitted"], summary["verified"], summary["missing"]) == (8, 1, 1)
    assert summary["duplicate_shards"] == 1 and summary["failure_tags"] == {"nccl": 1}
    assert_projections_match_replay(api, backend.url, "night")
    assert_projections_match_replay(api, backend.url, "night-2", namespace="team-b")


def test_a_closed_run_refuses_new_shards_until_it_is_reopened(
    api: LedgerClient, backend: Backend
) -> None:
    api.append([planned(shard_id=f"s{i}", index=i) for i in range(2)])
    close = api.close_submission("run-1", expected_shards=2)
    before = backend.count_events()
    with pytest.raises(LedgerRejected) as refused:
        api.append([planned(shard_id="s0", index=0), planned(shard_id="s2", index=2)])
    assert (refused.value.code, refused.value.reason) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "RUN_CLOSED",
    )
    assert f"was closed at sequence {close.sequence} (" in str(refused.value)
    assert backend.count_events() == before
    (same,) = api.append([planned(shard_id="s0", index=0)])
    assert same.outcome == pb.APPEND_OUTCOME_ALREADY_PLANNED

    reopen = api.reopen_submission("run-1")
    (added,) = api.append([planned(shard_id="s2", index=2)])
    assert added.outcome == pb.APPEND_OUTCOME_APPENDED
    life = json.loads(api.summary("run-1"))["lifecycle"]
    assert (life["state"], life["reopened_at_sequence"]) == ("open", reopen.sequence)
    with pytest.raises(LedgerRejected) as again:
        api.reopen_submission("run-1")
    assert again.value.reason == "RUN_NOT_CLOSED"
    api.close_submission("run-1", expected_shards=2)
    assert json.loads(api.summary("run-1"))["lifecycle"]["state"] == "settled"
    assert_projections_match_replay(api, backend.url, "run-1")


def test_list_events_pages_and_tail_follows_new_events(api: LedgerClient) -> None:
    api.append([planned(shard_id=f"s{i}", index=i) for i in range(25)])
    listed = list(api.list_events("run-1", page_size=7))
    assert [e.shard_id for e in listed] == [f"s{i}" for i in range(25)]
    later = list(api.list_events("run-1", after_sequence=listed[19].sequence))
    assert [e.shard_id for e in later] == [f"s{i}" for i in range(20, 25)]
    stream = api.stub.TailEvents(
        pb.TailEventsRequest(run_id="run-1", after_sequence=listed[-1].sequence), timeout=10
    )
    api.append([started(shard_id="s3")])
    assert next(stream).event.WhichOneof("payload") == "started"
    stream.cancel()


def test_concurrent_appends_to_one_run_form_one_chain(
    served: RunningServer, backend: Backend
) -> None:
    LedgerClient(f"127.0.0.1:{served.port}").append([planned("shared", "seed")])
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        client = LedgerClient(f"127.0.0.1:{served.port}")
        try:
            for n in range(10):
                shard = f"w{worker}-{n}"
                client.append([planned("shared", shard), started("shared", shard, "a")])
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=work, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    store = open_store(backend.url)
    try:
        reports = verify_store(store)
    finally:
        store.close()
    assert [(r.run_id, r.ok, r.events) for r in reports] == [("shared", True, 121)]
