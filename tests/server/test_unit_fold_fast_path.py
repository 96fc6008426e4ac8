"""The writer's heartbeat fast path folds exactly what the generic check + fold would.

`projections.fold_live_beat` takes most of a night's events (a live attempt's
plain heartbeat) past the generic dispatch. Its contract: when it says True,
the record is what `check()` + `fold()` make of the event; when it says False,
nothing changed. Random shard histories check both halves, so a change to how
the generic fold treats a heartbeat (per-rank liveness, say) that the fast
path does not follow fails here.
"""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from ledger_server import projections as proj
from ledger_server.errors import LedgerError
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
from ledger_server.record import ShardRecord

ATTEMPTS = ("a", "b", "c")
T0 = 1_000_000

payloads = st.one_of(
    st.builds(
        AttemptStarted,
        host=st.just("h"),
        pid=st.just(1),
        heartbeat_timeout_us=st.sampled_from((1_000_000, 60_000_000)),
        fingerprint=st.just({}),
        fingerprint_digest=st.just(""),
    ),
    st.builds(
        Heartbeat,
        step=st.integers(0, 50),
        progress=st.just(0.5),
        metrics=st.just({"loss": 0.1}),
        nonfinite_metrics=st.sampled_from(((), (), ("loss",))),
        first_step=st.just(0),
        progress_calls=st.sampled_from((0, 3)),
    ),
    st.builds(
        CheckpointSaved,
        step=st.integers(0, 50),
        path=st.just("/ck"),
        size_bytes=st.just(1),
        blake3_hex=st.just("a" * 64),
    ),
    st.builds(
        ArtifactCommitted,
        name=st.just("out"),
        path=st.just("/out"),
        size_bytes=st.just(1),
        blake3_hex=st.just("b" * 64),
        media_type=st.just(""),
    ),
    st.builds(AttemptFailed, tag=st.just("oom"), message=st.just("")),
)
histories = st.lists(
    st.tuples(st.sampled_from(ATTEMPTS), payloads, st.integers(-5_000_000, 5_000_000)),
    max_size=40,
)


def _event(seq: int, attempt_id: str, payload: Payload) -> Event:
    return Event(f"e{seq}", "default", "r", "s", attempt_id, T0, payload)


def _planned() -> ShardRecord:
    plan = ShardPlanned("in", 1, "", "{}", ("out",), "", 0)
    return proj.fold(None, RecordedEvent(_event(0, "", plan), 1, 1, T0, b""))


def _generic(record: ShardRecord, event: Event, seq: int, now: int) -> bool:
    """check() + fold(); returns whether the event was accepted."""
    try:
        proj.check(record, event)
    except LedgerError:
        return False
    proj.fold(record, RecordedEvent(event, seq, seq, now, b""))
    return True


@settings(max_examples=300, deadline=None)
@given(histories)
def test_the_fast_path_agrees_with_check_and_fold_on_random_histories(
    history: list[tuple[str, Payload, int]],
) -> None:
    generic, fast = _planned(), _planned()
    fast_taken = 0
    for seq, (attempt_id, payload, skew) in enumerate(history, 2):
        event, now = _event(seq, attempt_id, payload), T0 + seq * 1_000_000 + skew
        accepted = _generic(generic, event, seq, now)
        before = copy.deepcopy(fast)
        if proj.fold_live_beat(fast, event, now):
            fast_taken += 1
            assert accepted, "the fast path took an event the generic check refuses"
        else:
            assert fast.to_json() == before.to_json(), "a declined fast path changed the record"
            _generic(fast, event, seq, now)
        assert fast.to_json() == generic.to_json()
        assert proj.deadline_us(fast) == proj.deadline_us(generic)


def test_only_a_live_latest_attempts_plain_heartbeat_takes_the_fast_path() -> None:
    record = _planned()
    beat = Heartbeat(5, 0.5, {})
    assert not proj.fold_live_beat(record, _event(2, "a", beat), T0)  # never started
    _generic(record, _event(2, "a", AttemptStarted("h", 1, 60_000_000, {}, "")), 2, T0)
    _generic(record, _event(3, "b", AttemptStarted("h", 1, 60_000_000, {}, "")), 3, T0)
    assert not proj.fold_live_beat(record, _event(4, "a", beat), T0)  # superseded
    assert not proj.fold_live_beat(record, _event(4, "b", Heartbeat(5, 0.5, {}, ("x",))), T0)
    assert proj.fold_live_beat(record, _event(4, "b", beat), T0 + 7)
    assert (record.attempts["b"].last_step, record.attempts["b"].last_seen_us) == (5, T0 + 7)
    _generic(record, _event(5, "b", AttemptFailed("oom", "")), 5, T0)
    assert not proj.fold_live_beat(record, _event(6, "b", beat), T0)  # ended
