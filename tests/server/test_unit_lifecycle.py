"""The life-cycle rules, asserted on projections.check and fold directly (no server, no store)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest

from ledger_server import projections as proj
from ledger_server.errors import LifecycleViolation, PlanConflict
from ledger_server.events import (
    ArtifactCommitted,
    ArtifactVerified,
    AttemptFailed,
    AttemptStarted,
    Event,
    Heartbeat,
    Payload,
    RecordedEvent,
    ShardPlanned,
)
from ledger_server.record import ShardRecord
from ledger_server.states import ShardState

DIGEST = "ef" * 32
PLAN = ShardPlanned("file:///in/0", 1, "", "{}", ("model",), "", 0)
_ids = itertools.count(1)


def _event(payload: Payload, attempt_id: str = "a1") -> Event:
    attempt = "" if isinstance(payload, ShardPlanned) else attempt_id
    return Event(f"ev-{next(_ids)}", "default", "run-1", "shard-1", attempt, 1, payload)


def _start(attempt_id: str = "a1") -> Event:
    return _event(AttemptStarted("host", 1, 60_000_000, {}, ""), attempt_id)


def _commit(attempt_id: str = "a1") -> Event:
    return _event(ArtifactCommitted("model", "/out/m", 3, DIGEST, ""), attempt_id)


def _verify(result: str = "passed", path: str = "/out/m") -> Event:
    return _event(ArtifactVerified("model", path, DIGEST, result, "", ""), "")


class Shard:
    """Feeds events through check() and fold() as the writer does, numbering them."""

    def __init__(self) -> None:
        self.record: ShardRecord | None = None
        self.sequence = 0

    def feed(self, event: Event, now_us: int = 1_000) -> bool:
        if not proj.check(self.record, event):
            return False
        self.sequence += 1
        rec = RecordedEvent(event, self.sequence, self.sequence, now_us, b"")
        self.record = proj.fold(self.record, rec)
        return True

    @property
    def state(self) -> tuple[str, str]:
        assert self.record is not None
        return proj.base_state(self.record)


def _violation(shard: Shard, event: Event) -> dict[str, Any]:
    with pytest.raises(LifecycleViolation) as caught:
        shard.feed(event)
    return {"reason": caught.value.reason, **caught.value.metadata}


def test_a_shard_moves_planned_running_committed_verified() -> None:
    shard = Shard()
    assert shard.feed(_event(PLAN))
    assert shard.state == (ShardState.PLANNED, "")
    shard.feed(_start())
    assert shard.state == (ShardState.RUNNING, "")
    shard.feed(_commit())
    assert shard.state == (ShardState.COMMITTED, "")
    shard.feed(_verify())
    assert shard.state == (ShardState.VERIFIED, "")
    assert shard.record is not None and shard.record.planned_seq == 1


def test_an_event_of_a_shard_never_planned_is_refused() -> None:
    assert _violation(Shard(), _start()) == {"reason": "SHARD_NOT_PLANNED", "shard_id": "shard-1"}


def test_an_identical_plan_is_not_appended_and_a_different_one_conflicts() -> None:
    shard = Shard()
    shard.feed(_event(PLAN))
    assert not shard.feed(_event(PLAN))
    with pytest.raises(PlanConflict) as caught:
        shard.feed(_event(dataclasses.replace(PLAN, input_bytes=2)))
    assert caught.value.metadata == {"shard_id": "shard-1", "existing_sequence": "1"}


def test_an_attempt_starts_once() -> None:
    shard = Shard()
    shard.feed(_event(PLAN))
    shard.feed(_start())
    assert _violation(shard, _start()) == {
        "reason": "ATTEMPT_ALREADY_STARTED",
        "attempt_id": "a1",
        "existing_sequence": "2",
    }


def test_a_heartbeat_of_an_attempt_never_started_is_refused() -> None:
    shard = Shard()
    shard.feed(_event(PLAN))
    event = _event(Heartbeat(1, 0.1, {}), "ghost")
    assert _violation(shard, event) == {"reason": "ATTEMPT_NOT_STARTED", "attempt_id": "ghost"}


def test_an_attempt_that_failed_takes_no_more_events() -> None:
    shard = Shard()
    shard.feed(_event(PLAN))
    shard.feed(_start())
    shard.feed(_event(AttemptFailed("oom", "out of memory")))
    assert shard.state == (ShardState.FAILED, "oom")
    assert _violation(shard, _commit()) == {"reason": "ATTEMPT_ENDED", "attempt_id": "a1"}


def test_a_verdict_needs_a_committed_artifact() -> None:
    shard = Shard()
    shard.feed(_event(PLAN))
    shard.feed(_start())
    assert _violation(shard, _verify()) == {
        "reason": "ARTIFACT_NOT_COMMITTED",
        "shard_id": "shard-1",
        "name": "model",
    }
    shard.feed(_commit())
    assert _violation(shard, _verify(path="/elsewhere"))["reason"] == "ARTIFACT_NOT_COMMITTED"


def test_a_failed_verdict_makes_the_shard_verify_failed_and_a_resume_reason() -> None:
    shard = Shard()
    shard.feed(_event(PLAN))
    shard.feed(_start())
    shard.feed(_commit())
    shard.feed(_event(ArtifactVerified("model", "/out/m", DIGEST, "failed", "digest", ""), ""))
    assert shard.state == (ShardState.VERIFY_FAILED, "digest")
    assert shard.record is not None
    assert proj.resume_reason(shard.record, 2_000) == "verify_failed:digest"


def test_a_silent_running_shard_turns_stale_after_its_heartbeat_timeout() -> None:
    shard = Shard()
    shard.feed(_event(PLAN))
    shard.feed(_start(), now_us=1_000)
    assert shard.record is not None
    assert proj.live_state(shard.record, 1_000 + 60_000_000)[0] == "running"
    assert proj.live_state(shard.record, 1_001 + 60_000_000)[0] == "stale"
    assert proj.resume_reason(shard.record, 1_001 + 60_000_000) == "stale"
