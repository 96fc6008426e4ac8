"""CompactRecords: a replay's records in bounded memory land on the rows a dict replay builds."""

from __future__ import annotations

from pathlib import Path

import pytest

from ledger_server import compact, rebuild
from ledger_server.compact import CompactRecords
from ledger_server.events import AttemptStarted, Event, Heartbeat, ShardPlanned
from ledger_server.replay import RunReplay
from ledger_server.service import LedgerService
from ledger_server.store.sqlite import SqliteStore


def _replay(ledger: LedgerService, records: CompactRecords | None) -> RunReplay:
    replay = RunReplay() if records is None else RunReplay(records=records)
    run = ledger.run("", "night")
    with rebuild.gc_paused():
        for _ in rebuild.fold_rows(replay, ledger.store.read().iter_events(run.run_pk)):
            pass
    return replay


def test_unstarted_shards_folded_a_page_at_a_time_match_the_dict_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = LedgerService(SqliteStore(str(tmp_path / "ledger.db")))
    plans = [
        Event(
            f"p{i}",
            "",
            "night",
            f"s{i}",
            "",
            0,
            ShardPlanned(f"/in/{i}", 1, "", "{}", ("out",), "", i),
        )
        for i in range(9)
    ]
    ledger.append(plans)
    ledger.append(
        [
            Event(f"a{i}", "", "night", f"s{i}", "a", 0, AttemptStarted("n", 1, 60_000_000, {}, ""))
            for i in (1, 4, 7)
        ]
    )
    ledger.append([Event("h4", "", "night", "s4", "a", 0, Heartbeat(3, 0.5, {}))])
    monkeypatch.setattr(compact, "_PLAN_PAGE", 2)  # six unstarted shards: three pages
    records = CompactRecords(hot=1)
    spilled_rows, spilled_counters = rebuild.take_projections(_replay(ledger, records))
    dict_rows, dict_counters = rebuild.take_projections(_replay(ledger, None))
    assert [r.shard_id for r in spilled_rows] == [f"s{i}" for i in range(9)]
    assert list(spilled_rows) == list(dict_rows)
    assert spilled_counters == dict_counters
    assert len(spilled_rows) == 9


def _plan(i: int, plan_index: int) -> Event:
    return Event(
        f"p{i}",
        "",
        "night",
        f"s{i}",
        "",
        0,
        ShardPlanned(f"/in/{i}", 1, "", "{}", ("out",), "", plan_index),
    )


def _start(i: int) -> Event:
    return Event(f"a{i}", "", "night", f"s{i}", "a", 0, AttemptStarted("n", 1, 60_000_000, {}, ""))


def test_plans_out_of_plan_order_come_back_sorted_like_the_dict_replay(tmp_path: Path) -> None:
    ledger = LedgerService(SqliteStore(str(tmp_path / "ledger.db")))
    # Planned in reverse plan order, in two appends, the second re-planning nothing.
    ledger.append([_plan(i, 8 - i) for i in range(5)])
    ledger.append([_plan(i, 8 - i) for i in range(5, 9)])
    ledger.append([_start(i) for i in (0, 3, 8)])
    ledger.append([Event("h3", "", "night", "s3", "a", 0, Heartbeat(2, 0.5, {}))])
    spilled_rows, spilled_counters = rebuild.take_projections(
        _replay(ledger, CompactRecords(hot=2))
    )
    dict_rows, dict_counters = rebuild.take_projections(_replay(ledger, None))
    assert [(r.plan_index, r.shard_id) for r in spilled_rows] == [
        (8 - i, f"s{i}") for i in range(8, -1, -1)
    ]
    assert list(spilled_rows) == list(dict_rows)
    assert spilled_counters == dict_counters


def test_a_record_spilled_while_live_is_brought_back_by_its_next_event(tmp_path: Path) -> None:
    ledger = LedgerService(SqliteStore(str(tmp_path / "ledger.db")))
    ledger.append([_plan(i, i) for i in range(3)])
    ledger.append([_start(0), _start(1), _start(2)])
    beats = [(0, 5), (2, 5), (0, 6)]
    ledger.append(
        [
            Event(f"h{i}-{step}", "", "night", f"s{i}", "a", 0, Heartbeat(step, 0.5, {}))
            for i, step in beats
        ]
    )
    records = CompactRecords(hot=1)
    replay = _replay(ledger, records)
    assert records.reloaded >= 2  # s0 and s2 came back from their spilled rows
    dict_replay = _replay(ledger, None)
    assert len(records) == 3 and "s1" in records and "s9" not in records
    assert sorted(r.to_json() for r in records.values()) == sorted(
        r.to_json() for r in dict_replay.records.values()
    )
    assert replay.counters() == dict_replay.counters()
    spilled_rows, spilled_counters = rebuild.take_projections(replay)
    dict_rows, dict_counters = rebuild.take_projections(dict_replay)
    assert list(spilled_rows) == list(dict_rows)
    assert spilled_counters == dict_counters
