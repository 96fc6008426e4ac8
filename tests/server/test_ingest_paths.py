"""The fast ingest paths give the answers the careful ones would.

The single SQLite writer keeps shard records in memory, writes a heartbeat as two
numbers instead of the whole record, and inserts events without looking their ids
up first (the unique index catches a resent id and the group is redone with the
lookups). Each test drives a real server or LedgerService and checks what a user reads,
including after a restart with a cold cache.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ledger_server import codec
from ledger_server.batch import DUPLICATE
from ledger_server.config import ServerConfig
from ledger_server.errors import EventRejected
from ledger_server.record import ShardRecord
from ledger_server.replay import replay_run
from ledger_server.server import RunningServer, create_server
from ledger_server.service import LedgerService
from ledger_server.store import open_store
from ledger_server.store.sqlite import SqliteStore
from ledger_server.validation import validate
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from shard_client.errors import Conflict, LifecycleError
from tests.builders import committed, event, planned, started
from tests.pg import pg_cluster, pg_url  # noqa: F401  (fixtures)


def _beat(step: int, shard: str = "shard-0", event_id: str | None = None) -> pb.ShardEvent:
    return event(
        shard_id=shard,
        attempt_id="att-1",
        event_id=event_id,
        heartbeat=pb.Heartbeat(step=step, progress=0.5),
    )


def _serve(url: str) -> RunningServer:
    return create_server(ServerConfig(database=url, listen="127.0.0.1:0"))


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Returns an empty database of each backend."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    return str(request.getfixturevalue("pg_url"))


@pytest.fixture
def api(url: str) -> Iterator[tuple[RunningServer, LedgerClient]]:
    running = _serve(url)
    client = LedgerClient(f"127.0.0.1:{running.port}", timeout_s=10, retry_deadline_s=5)
    yield running, client
    client.close()
    running.stop(0.5)


def _last_step(client: LedgerClient, shard: str = "shard-0") -> int:
    """Returns the shard's last step as `shardledger shards` shows it."""
    views = [json.loads(s.view_json) for s in client.shards("run-1") if s.shard_id == shard]
    assert len(views) == 1
    return int(views[0]["last_step"])


def test_heartbeats_survive_a_restart_and_fold_into_the_next_full_write(url: str) -> None:
    running = _serve(url)
    client = LedgerClient(f"127.0.0.1:{running.port}", timeout_s=10)
    client.append([planned(), started()])
    for step in range(1, 6):
        client.append([_beat(step)])
    assert _last_step(client) == 5
    store = running.ledger.store
    run_pk = running.ledger.run("", "run-1").run_pk
    (row,) = [r for r in store.read().iter_shards(run_pk) if r.shard_id == "shard-0"]
    # The record was written at the start; the heartbeats moved only the beat columns.
    assert row.beat_step == 5 and row.record is not None
    assert ShardRecord.from_json(row.record).attempts["att-1"].last_step == -1
    running.stop(0.5)
    client.close()

    running = _serve(url)  # a cold cache: the writer reads the row back
    client = LedgerClient(f"127.0.0.1:{running.port}", timeout_s=10)
    try:
        assert _last_step(client) == 5
        client.append([_beat(6), committed()])
        run_pk = running.ledger.run("", "run-1").run_pk
        (row,) = list(running.ledger.store.read().iter_shards(run_pk))
        assert (row.state, row.beat_us, row.beat_step) == ("committed", None, None)
        assert row.record is not None
        assert ShardRecord.from_json(row.record).attempts["att-1"].last_step == 6
        replayed = replay_run(running.ledger.iter_events("", "run-1"))
        assert row.record == replayed.records["shard-0"].to_json().encode()
    finally:
        client.close()
        running.stop(0.5)


def test_heartbeat_moves_the_stale_deadline(api: tuple[RunningServer, LedgerClient]) -> None:
    running, client = api
    client.append([planned(), started(timeout_s=1)])
    first = running.ledger.run("", "run-1")
    (row,) = list(running.ledger.store.read().iter_shards(first.run_pk))
    assert row.deadline_us is not None
    client.append([_beat(1)])
    (moved,) = list(running.ledger.store.read().iter_shards(first.run_pk))
    assert moved.deadline_us is not None and moved.deadline_us > row.deadline_us
    assert moved.beat_us == moved.deadline_us - 1_000_000


def test_resent_events_answer_duplicate_with_their_first_sequence(
    api: tuple[RunningServer, LedgerClient],
) -> None:
    running, client = api
    plan, start = planned(), started()
    beats = [_beat(1), _beat(2)]
    first = client.append([plan, start, *beats])
    # Resent alone, each takes the path that would otherwise misjudge it: a plan would
    # look "already planned", a start "started twice", a heartbeat would be inserted.
    for sent, original in zip([plan, start, *beats], first, strict=True):
        (again,) = client.append([sent])
        assert (again.outcome, again.sequence) == (
            pb.APPEND_OUTCOME_DUPLICATE,
            original.sequence,
        )
    assert running.ledger.run("", "run-1").event_count == 4
    changed = _beat(9, event_id=beats[0].event_id)
    with pytest.raises(Conflict, match=r"was stored at sequence \d+ with different content"):
        client.append([changed])
    assert _last_step(client) == 2


def test_refused_batch_leaves_no_trace_in_the_cached_records(
    api: tuple[RunningServer, LedgerClient],
) -> None:
    running, client = api
    client.append([planned(), started(), _beat(3)])
    with pytest.raises(LifecycleError, match="event 1: attempt never-started"):
        client.append([_beat(50), committed(attempt_id="never-started")])
    assert _last_step(client) == 3
    # The next heartbeat folds into the record as stored, not the refused one.
    client.append([_beat(4)])
    assert _last_step(client) == 4
    assert running.ledger.run("", "run-1").event_count == 3 + 1


def _validated(*messages: pb.ShardEvent) -> list[object]:
    return [validate(codec.decode_event(m)).event for m in messages]


def test_one_id_in_two_batches_of_one_group_is_stored_once(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "ledger.db")
    ledger = LedgerService(store)
    try:
        ledger.append(_validated(planned(), started()))  # type: ignore[arg-type]
        beat = _beat(1)
        # Hold the write lock so the writer blocks inside the first group; the two
        # batches submitted meanwhile are then committed together as the next group.
        with store._write_lock:
            blocker = ledger.submit(_validated(_beat(0)))  # type: ignore[arg-type]
            while ledger._committer._queue.qsize():
                threading.Event().wait(0.01)
            one = ledger.submit(_validated(beat))  # type: ignore[arg-type]
            two = ledger.submit(_validated(beat))  # type: ignore[arg-type]
        blocker.result(10)
        (a,), (b,) = one.result(10), two.result(10)
        assert (b.sequence, b.outcome) == (a.sequence, DUPLICATE)
        assert ledger.run("", "run-1").event_count == 4
        assert ledger.stats["groups_retried"] >= 1
    finally:
        ledger.close()
        store.close()


def test_event_rejected_names_the_batch_index_after_the_careful_retry(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'ledger.db'}")
    ledger = LedgerService(store)
    try:
        ledger.append(_validated(planned(), started()))  # type: ignore[arg-type]
        with pytest.raises(EventRejected) as caught:
            ledger.append(_validated(_beat(1), _beat(2, shard="ghost")))  # type: ignore[arg-type]
        assert caught.value.index == 1
        assert ledger.run("", "run-1").event_count == 2
    finally:
        ledger.close()
        store.close()
