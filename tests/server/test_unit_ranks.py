"""Multi-rank attempts in the fold: joining, per-rank liveness, completeness, checkpoint parts.

Pure: projections.check and fold fed directly, time passed in (no server, no store);
the last tests go through a real server and the record's stored form.
"""

from __future__ import annotations

import itertools

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration

from ledger_server import projections as proj
from ledger_server.errors import LifecycleViolation
from ledger_server.events import (
    ArtifactCommitted,
    AttemptFailed,
    AttemptStarted,
    CheckpointSaved,
    Event,
    Heartbeat,
    Payload,
    RecordedEvent,
    ShardPlanned,
)
from ledger_server.record import RECORD_VERSION, ShardRecord
from ledger_server.states import QueryState, ShardState
from ledger_server.summary import shard_view
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.checkpoint_records import RecordedCheckpoint, complete_parts
from shard_client.client import LedgerClient
from shard_client.errors import InvalidArgument, LifecycleError
from tests.builders import event, planned

DIGEST = "ef" * 32
SECOND = 1_000_000
TIMEOUT = 10 * SECOND
PLAN = ShardPlanned("file:///in/0", 1, "", "{}", ("weights.rank{rank}", "model"), "", 0)
_ids = itertools.count(1)


def _event(payload: Payload, attempt_id: str = "a1") -> Event:
    attempt = "" if isinstance(payload, ShardPlanned) else attempt_id
    return Event(f"ev-{next(_ids)}", "default", "run-1", "shard-1", attempt, 1, payload)


def _start(rank: int, world: int = 2, attempt_id: str = "a1", restart: int = 0) -> Event:
    started = AttemptStarted(
        f"host-{rank}",
        100 + rank,
        TIMEOUT,
        {},
        "",
        rank=rank,
        world_size=world,
        launch_id="L",
        restart_count=restart,
    )
    return _event(started, attempt_id)


def _beat(rank: int, finished: bool = False, attempt_id: str = "a1") -> Event:
    return _event(Heartbeat(1, 0.5, {}, rank=rank, rank_finished=finished), attempt_id)


def _commit(name: str, rank: int, attempt_id: str = "a1") -> Event:
    return _event(ArtifactCommitted(name, f"/out/{name}", 3, DIGEST, "", rank=rank), attempt_id)


class Shard:
    """Feeds events through check() and fold() as the writer does."""

    def __init__(self) -> None:
        self.record: ShardRecord | None = None
        self.sequence = 0
        self.feed(_event(PLAN))

    def feed(self, ev: Event, now_us: int = 0) -> None:
        assert proj.check(self.record, ev)
        self.sequence += 1
        self.record = proj.fold(self.record, RecordedEvent(ev, self.sequence, 0, now_us, b""))

    @property
    def rec(self) -> ShardRecord:
        assert self.record is not None
        return self.record

    def state(self, now_us: int) -> tuple[str, str]:
        return proj.live_state(self.rec, now_us)


def test_every_rank_joins_one_attempt_and_the_first_rank_does_not_stay_the_attempts_host() -> None:
    shard = Shard()
    shard.feed(_start(1))
    shard.feed(_start(0))
    (attempt,) = shard.rec.attempts.values()
    assert sorted(attempt.ranks) == [0, 1]
    assert (attempt.host, attempt.pid) == ("host-0", 100)  # rank 0's, whichever came first


def test_a_rank_starting_twice_or_with_another_world_size_is_refused() -> None:
    shard = Shard()
    shard.feed(_start(0))
    with pytest.raises(LifecycleViolation, match="rank 0 of attempt a1 already started"):
        proj.check(shard.rec, _start(0))
    with pytest.raises(LifecycleViolation, match="world_size 4"):
        proj.check(shard.rec, _start(1, world=4))


def test_an_event_of_a_rank_that_never_started_is_refused() -> None:
    shard = Shard()
    shard.feed(_start(0))
    with pytest.raises(LifecycleViolation) as info:
        proj.check(shard.rec, _beat(1))
    assert info.value.reason == "RANK_NOT_STARTED"


def test_the_attempt_is_stale_once_any_rank_is_silent_past_its_timeout() -> None:
    shard = Shard()
    shard.feed(_start(0), 0)
    shard.feed(_start(1), 0)
    shard.feed(_beat(0), 8 * SECOND)
    assert shard.state(9 * SECOND)[0] == ShardState.RUNNING
    # Rank 0 is alive at 11 s; rank 1 was last seen at 0 s: the attempt is stale.
    assert shard.state(11 * SECOND)[0] == QueryState.STALE
    view = shard_view(shard.rec, 11 * SECOND)
    assert [r["state"] for r in view["ranks"]] == ["alive", "silent"]
    assert view["ranks_alive"] == 1


def test_a_rank_that_never_joined_counts_as_silent_from_the_attempts_start() -> None:
    shard = Shard()
    shard.feed(_start(0), 0)
    shard.feed(_beat(0), 9 * SECOND)
    assert shard.state(11 * SECOND)[0] == QueryState.STALE
    assert shard_view(shard.rec, 11 * SECOND)["ranks"][1]["state"] == "not_started"


def test_a_rank_that_failed_fails_the_attempt_and_the_other_ranks_events_are_refused() -> None:
    shard = Shard()
    shard.feed(_start(0))
    shard.feed(_start(1))
    shard.feed(_event(AttemptFailed("nccl", "Gloo: connection closed", rank=1)))
    assert shard.state(0) == (ShardState.FAILED, "nccl")
    with pytest.raises(LifecycleViolation) as info:
        proj.check(shard.rec, _beat(0))
    assert info.value.reason == "ATTEMPT_ENDED"
    with pytest.raises(LifecycleViolation):
        proj.check(shard.rec, _start(0, attempt_id="a1"))


def test_the_shard_is_committed_only_with_every_ranks_outputs() -> None:
    shard = Shard()
    shard.feed(_start(0))
    shard.feed(_start(1))
    shard.feed(_commit("weights.rank0", 0))
    shard.feed(_commit("model", 0))
    assert shard.state(0)[0] == ShardState.RUNNING
    shard.feed(_commit("weights.rank1", 1))
    assert shard.state(0)[0] == ShardState.COMMITTED


def test_every_rank_finishing_with_an_output_missing_is_incomplete() -> None:
    shard = Shard()
    shard.feed(_start(0))
    shard.feed(_start(1))
    shard.feed(_commit("weights.rank0", 0))
    shard.feed(_commit("model", 0))
    shard.feed(_beat(0, finished=True))
    # Rank 0 left cleanly, rank 1 is still at work: its silence is what may still end it.
    assert shard.state(0)[0] == ShardState.RUNNING
    assert proj.deadline_us(shard.rec) == TIMEOUT
    shard.feed(_beat(1, finished=True))
    assert shard.state(0) == (ShardState.FAILED, "incomplete")


def test_a_sharded_checkpoint_counts_only_once_every_part_is_saved() -> None:
    shard = Shard()
    shard.feed(_start(0))
    shard.feed(_start(1))
    part = CheckpointSaved(4, "/ck/ckpt-4.rank0.pt", 3, DIGEST, rank=0, world_size=2)
    shard.feed(_event(part))
    (attempt,) = shard.rec.attempts.values()
    assert attempt.last_checkpoint == "" and attempt.checkpoint_parts == {4: [0]}
    other = CheckpointSaved(4, "/ck/ckpt-4.rank1.pt", 3, DIGEST, rank=1, world_size=2)
    shard.feed(_event(other))
    assert attempt.last_step == 4 and attempt.checkpoint_parts == {}


def test_the_record_with_ranks_round_trips_through_its_stored_form() -> None:
    shard = Shard()
    shard.feed(_start(0), 5)
    shard.feed(_start(1), 6)
    shard.feed(_event(CheckpointSaved(2, "/ck/a", 3, DIGEST, rank=1, world_size=2)))
    shard.feed(_beat(1, finished=True), 7)
    text = shard.rec.to_json()
    assert f'"v":{RECORD_VERSION}' in text
    again = ShardRecord.from_json(text)
    assert again.attempts == shard.rec.attempts


def test_complete_parts_leaves_out_a_step_one_rank_never_saved() -> None:
    def part(step: int, rank: int, seq: int) -> RecordedCheckpoint:
        return RecordedCheckpoint(step, f"/ck/{step}.{rank}", DIGEST, "a1", seq, rank, 2)

    recorded = [part(4, 0, 9), part(2, 1, 6), part(2, 0, 5)]
    assert [c.step for c in complete_parts(recorded, 1)] == [2]
    assert [c.path for c in complete_parts(recorded, 0)] == ["/ck/2.0"]


# --- through a real server -------------------------------------------------------------


def _started_pb(rank: int, world: int) -> pb.ShardEvent:
    return event(
        "run-1",
        "shard-0",
        "att-r",
        started=pb.AttemptStarted(
            host="node",
            pid=10 + rank,
            heartbeat_timeout=Duration(seconds=30),
            rank=rank,
            world_size=world,
            launch_id="launch-1",
        ),
    )


def test_the_server_joins_ranks_and_refuses_a_rank_outside_the_world(
    client: LedgerClient,
) -> None:
    client.append([planned("run-1", "shard-0", outputs=("w.rank{rank}",))])
    client.append([_started_pb(0, 2), _started_pb(1, 2)])
    with pytest.raises(InvalidArgument, match=r"started\.rank"):
        client.append([_started_pb(2, 2)])
    with pytest.raises(LifecycleError) as info:
        client.append([_started_pb(1, 2)])
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    (view,) = client.shards("run-1")
    assert '"world_size":2' in view.view_json
