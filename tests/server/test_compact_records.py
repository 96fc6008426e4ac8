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
