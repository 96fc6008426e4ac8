"""Input identity in the projections: incremental = fresh replay = rows = compact, on one history.

A started event that saw another input, a revision of the plan's input that changes
its bytes, one that only refreshes its identity, a refused commit: the writer's
records must be exactly what a replay of the stored events builds (every path a
rebuild takes), and the states are the documented ones.
"""

from __future__ import annotations

import dataclasses

import pytest

from ledger_server import projections as proj
from ledger_server.compact import CompactRecords
from ledger_server.errors import EventRejected
from ledger_server.events import (
    ArtifactCommitted,
    ArtifactVerified,
    AttemptFailed,
    AttemptStarted,
    Event,
    Payload,
    ShardPlanned,
)
from ledger_server.rebuild import fold_rows, gc_paused, take_projections
from ledger_server.record import record_from_row
from ledger_server.replay import RunReplay, replay_run
from tests.server.test_projections_replay import RUN, Harness, harness

DIGEST = "ab" * 32
OTHER = "cd" * 32
OUT = "ef" * 32


def plan(
    sid: str, *, size: int = 100, blake: str = DIGEST, revision: bool = False, **kw: int
) -> Event:
    payload = ShardPlanned(
        f"/in/{sid}",
        size,
        blake,
        "{}",
        ("a",),
        "",
        int(sid[1:]),
        input_mtime_ns=kw.get("mtime", 1_733_284_800_123_456_789),
        input_inode=kw.get("inode", 42),
        input_device=kw.get("device", 2049),
        input_revision=revision,
    )
    suffix = f"-r{size}{blake[:2]}{kw.get('mtime', 0)}" if revision else ""
    return Event(f"p-{sid}{suffix}", "", RUN, sid, "", 0, payload)


def start(sid: str, attempt: str, *, size: int = 100, blake: str = "", mtime: int = 0) -> Event:
    payload = AttemptStarted(
        "node",
        1,
        100,
        {},
        "",
        input_ref=f"/in/{sid}",
        input_bytes=size,
        input_mtime_ns=mtime or 1_733_284_800_123_456_789,
        input_inode=42,
        input_device=2049,
        input_blake3=blake,
    )
    return Event(f"st-{sid}-{attempt}", "", RUN, sid, attempt, 0, payload)


def event(sid: str, attempt: str, name: str, payload: Payload) -> Event:
    return Event(f"{name}-{sid}-{attempt}", "", RUN, sid, attempt, 0, payload)


def commit(sid: str, attempt: str) -> Event:
    return event(sid, attempt, "c", ArtifactCommitted("a", f"/o/{sid}/{attempt}", 1, OUT, ""))


def verify(sid: str, attempt: str) -> Event:
    return event(
        sid, attempt, "v", ArtifactVerified("a", f"/o/{sid}/{attempt}", OUT, "passed", "", "")
    )


def test_input_changes_and_revisions_fold_the_same_incrementally_and_in_replay() -> None:
    with harness() as h:
        ledger = h.ledger

        def append(*events: Event, at: int) -> None:
            h.clock.now = at
            ledger.append(list(events), timeout=10)

        def states(now: int) -> dict[str, str]:
            return {r.shard_id: r.reason for r in ledger.resume("", RUN, now=now)}

        append(*(plan(f"s{i}") for i in range(4)), at=1_000)
        # s0 reads the planned input; s1 sees it grown; s2 sees another mtime but the same
        # bytes (it re-hashed); s3 runs and verifies, and its input is revised later.
        append(
            start("s0", "a0"),
            start("s1", "a0", size=120),
            start("s2", "a0", blake=DIGEST, mtime=7),
            start("s3", "a0"),
            at=1_100,
        )
        with pytest.raises(EventRejected) as refused:
            append(commit("s1", "a0"), at=1_150)
        assert refused.value.reason == "INPUT_CHANGED"
        append(event("s1", "a0", "f", AttemptFailed("input_changed", "grew")), at=1_160)
        append(commit("s0", "a0"), commit("s2", "a0"), commit("s3", "a0"), at=1_200)
        append(verify("s0", "a0"), verify("s2", "a0"), verify("s3", "a0"), at=1_300)
        assert states(1_300) == {"s1": "failed:input_changed"}
        h_check(h, 1_300)

        # A revision that only refreshes the identity keeps s0's result; one that changes
        # s3's bytes takes its result away until a rerun on the new bytes.
        append(
            plan("s0", revision=True, mtime=99),
            plan("s3", size=80, blake=OTHER, revision=True),
            at=1_400,
        )
        assert states(1_400) == {"s1": "failed:input_changed", "s3": "failed:input_changed"}
        h_check(h, 1_400)
        with pytest.raises(EventRejected):
            # The old attempt computed on the old bytes: it may not commit again.
            late = dataclasses.replace(commit("s3", "a0"), event_id="c-s3-a0-late")
            append(late, at=1_450)
        append(start("s3", "a1", size=80, blake=OTHER), at=1_500)
        append(commit("s3", "a1"), at=1_510)
        append(verify("s3", "a1"), at=1_520)
        # s1's rerun sees the planned input again.
        append(start("s1", "a1"), at=1_530)
        append(commit("s1", "a1"), at=1_540)
        append(verify("s1", "a1"), at=1_550)
        assert states(1_600) == {}
        h_check(h, 1_600)
        # A revision sent twice is stored once; one that changes the params is a conflict.
        h.clock.now = 1_700
        [result] = ledger.append([plan("s3", size=80, blake=OTHER, revision=True)], timeout=10)
        assert result.outcome in ("duplicate", "already_planned")
        changed = Event(
            "p-s2-params",
            "",
            RUN,
            "s2",
            "",
            0,
            ShardPlanned("/in/s2", 100, DIGEST, '{"lr":1}', ("a",), "", 2, input_revision=True),
        )
        with pytest.raises(EventRejected):
            ledger.append([changed], timeout=10)
        h_check(h, 1_700)


def h_check(h: Harness, now: int) -> None:
    """The harness's comparison of every projection path, without its reference model."""
    ledger = h.ledger
    events = list(ledger.iter_events("", RUN))
    fresh = replay_run(events)
    run = ledger.run("", RUN)
    from_rows = RunReplay()
    with gc_paused():
        assert sum(
            1 for _ in fold_rows(from_rows, ledger.store.read().iter_events(run.run_pk))
        ) == len(events)
    assert {k: r.to_json() for k, r in from_rows.records.items()} == {
        k: r.to_json() for k, r in fresh.records.items()
    }
    compact = RunReplay(records=CompactRecords(hot=1))
    with gc_paused():
        for _ in fold_rows(compact, ledger.store.read().iter_events(run.run_pk)):
            pass
    assert list(take_projections(compact)[0]) == list(take_projections(replay_run(events))[0])
    for row in ledger.store.read().iter_shards(run.run_pk):
        assert row.record is not None
        stored = record_from_row(row.record, row.beat_us, row.beat_step)
        assert stored.to_json() == fresh.records[row.shard_id].to_json()
        assert proj.resume_reason(stored, now) == proj.resume_reason(
            fresh.records[row.shard_id], now
        )
