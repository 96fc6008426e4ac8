"""What each attempt at a shard came to (`shards --attempts`): pure, time passed in.

Events go through projections.check and fold as the writer feeds them, and
attempts.attempt_history reads the record at a chosen instant.
"""

from __future__ import annotations

import itertools

from ledger_server import projections as proj
from ledger_server.attempts import attempt_history
from ledger_server.events import (
    ArtifactCommitted,
    ArtifactVerified,
    AttemptFailed,
    AttemptStarted,
    Event,
    Payload,
    RecordedEvent,
    ShardPlanned,
)
from ledger_server.record import ShardRecord
from ledger_server.summary import shard_view

SECOND = 1_000_000
DIGEST_A, DIGEST_B = "a" * 64, "b" * 64
PLAN = ShardPlanned("file:///in/0", 1, "", "{}", ("out",), "", 0)
_ids = itertools.count(1)


class Shard:
    """One shard's record, fed event by event at given server times."""

    def __init__(self) -> None:
        self.record: ShardRecord | None = None
        self.sequence = 0
        self.feed(PLAN, "", 0)

    def feed(self, payload: Payload, attempt_id: str, at_s: float) -> None:
        ev = Event(f"ev-{next(_ids)}", "default", "run-1", "s0", attempt_id, 1, payload)
        assert proj.check(self.record, ev)
        self.sequence += 1
        now = int(at_s * SECOND)
        self.record = proj.fold(self.record, RecordedEvent(ev, self.sequence, 0, now, b""))

    def start(self, attempt_id: str, at_s: float, *, host: str = "gpu-1", job: str = "") -> None:
        slurm = {"kind": "slurm", "job_id": job, "node": host} if job else {}
        started = AttemptStarted(host, 7, 10 * SECOND, {}, "", scheduler=slurm)
        self.feed(started, attempt_id, at_s)

    def commit(self, attempt_id: str, at_s: float, digest: str = DIGEST_A) -> None:
        self.feed(ArtifactCommitted("out", "/out/s0", 3, digest, ""), attempt_id, at_s)

    def verdict(self, at_s: float, digest: str, reason: str = "") -> None:
        result = "failed" if reason else "passed"
        self.feed(ArtifactVerified("out", "/out/s0", digest, result, reason, ""), "", at_s)

    def history(self, at_s: float) -> list[tuple[str, str, str]]:
        assert self.record is not None
        rows = attempt_history(self.record, int(at_s * SECOND))
        return [(r["attempt_id"], r["outcome"], r["detail"]) for r in rows]


def test_a_rerun_shard_lists_its_first_job_with_its_own_outcome_host_job_and_times() -> None:
    shard = Shard()
    shard.start("a0", 1, host="gpu-1", job="100")
    shard.feed(AttemptFailed("preempted", "reclaimed"), "a0", 2)
    shard.start("a1", 3, host="gpu-2", job="200")
    shard.commit("a1", 4)
    shard.verdict(5, DIGEST_A)
    assert shard.record is not None
    rows = shard_view(shard.record, 6 * SECOND)["attempt_history"]
    assert [(r["attempt_id"], r["outcome"], r["detail"], r["host"]) for r in rows] == [
        ("a0", "failed", "preempted", "gpu-1"),
        ("a1", "verified", "", "gpu-2"),
    ]
    assert [r["scheduler"]["job_id"] for r in rows] == ["100", "200"]
    assert [(r["started_us"], r["ended_us"]) for r in rows] == [
        (1 * SECOND, 2 * SECOND),
        (3 * SECOND, 4 * SECOND),
    ]


def test_an_attempt_replaced_before_it_ended_is_superseded_and_the_latest_goes_stale() -> None:
    shard = Shard()
    shard.start("a0", 1)
    shard.start("a1", 2)  # the launcher reran it without waiting for a0 to end
    assert shard.history(5) == [("a0", "superseded", ""), ("a1", "running", "")]
    assert shard.history(20) == [("a0", "superseded", ""), ("a1", "stale", "")]


def test_a_complete_set_is_judged_by_its_own_verdicts_and_by_what_its_path_still_holds() -> None:
    shard = Shard()
    shard.start("a0", 1)
    shard.commit("a0", 2)
    shard.feed(AttemptFailed("killed", "after its commit"), "a0", 3)
    assert shard.history(4) == [("a0", "unverified", "")]  # its set is whole: verify decides
    shard.start("a1", 5)
    shard.commit("a1", 6, DIGEST_B)  # other bytes on the same path
    assert shard.history(7) == [("a0", "verify_failed", "overwritten"), ("a1", "unverified", "")]
    shard.verdict(8, DIGEST_B, reason="empty")
    assert shard.history(9)[1] == ("a1", "verify_failed", "empty")
