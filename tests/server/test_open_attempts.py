"""A scrape and a report read the writer's sums of the open attempts, not every running shard.

After each kind of event (started, heartbeat, checkpoint, committed, verified,
failed, reclaimed and rerun) and after time alone turns a shard stale, the figures
from the open.* counters and the shard_open rows equal what the old full scan of
every running shard's row computed at the same moment, by label too; the stale
count, the oldest last-seen time and `db rebuild --check` agree.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from ledger_server import field
from ledger_server.events import (
    ArtifactCommitted,
    ArtifactVerified,
    AttemptFailed,
    AttemptStarted,
    CheckpointSaved,
    Event,
    Heartbeat,
    ShardPlanned,
)
from ledger_server.open_attempts import field_counters
from ledger_server.rebuild import rebuild_run
from ledger_server.record import latest_attempt_from_row
from ledger_server.service import LedgerService, counters_at, open_parts
from ledger_server.store import open_store
from ledger_server.store.base import ReadView, RunRow
from tests import pg

# The PostgreSQL fixtures, found by pytest under these names.
pg_cluster = pg.pg_cluster
pg_url = pg.pg_url

T0 = 1_700_000_000_000_000
DIGEST = "a" * 64
LABELS = ("provider", "pool")


def old_counters(view: ReadView, run: RunRow, at: int) -> Counter[str]:
    """The field counters as the full scan built them: each running shard's row parsed."""
    total = field_counters(view.counters(run.run_pk))
    for part in open_parts(view, run, at):
        field.add_open(total, part)
    return total


def old_stale(view: ReadView, run: RunRow, at: int) -> int:
    rows = view.iter_shards(run.run_pk, states=["running"])
    return sum(1 for r in rows if r.deadline_us is not None and r.deadline_us < at)


def old_oldest(view: ReadView, run: RunRow) -> int | None:
    seen = []
    for row in view.iter_shards(run.run_pk, states=["running"]):
        assert row.record is not None
        attempt = latest_attempt_from_row(row.record, row.beat_us)[0]
        assert attempt is not None
        seen.append(attempt.last_seen_us)
    return min(seen, default=None)


class Night:
    """A ledger on a real SQLite file whose clock the test moves."""

    def __init__(self, url: str) -> None:
        self.now = T0
        self.store = open_store(url)
        self.ledger = LedgerService(self.store, clock=lambda: self.now)
        self.n = 0

    def at(self, t_s: float, *events: Event) -> None:
        self.now = T0 + int(t_s * 1_000_000)
        if events:
            self.ledger.append(list(events))

    def ev(self, shard: int, attempt: str, payload: Any) -> Event:
        self.n += 1
        return Event(f"e{self.n}", "", "night", f"s{shard}", attempt, 0, payload)

    def plan(self, shard: int, provider: str) -> Event:
        labels = {"provider": provider, "gpus": "2"} if shard % 3 == 0 else {"provider": provider}
        plan = ShardPlanned(f"/in/{shard}", 1, "", "{}", ("out",), "", shard, labels=labels)
        return self.ev(shard, "", plan)

    def start(self, shard: int, attempt: str, timeout_s: int, pool: str = "") -> Event:
        labels = {"pool": pool} if pool else {}
        payload = AttemptStarted("node", 1, timeout_s * 1_000_000, {}, "", labels=labels)
        return self.ev(shard, attempt, payload)

    def stale(self) -> int:
        """Returns how many attempts the new read counts stale now."""
        return self.store.read().count_stale(self.ledger.run("", "night").run_pk, self.now)

    def check(self) -> None:
        """The new read equals the old full scan, now, for every figure the scrape exports."""
        view = self.store.read()
        run = self.ledger.run("", "night")
        at = self.now
        new, old = counters_at(view, run, at), old_counters(view, run, at)
        assert +new == +old
        for label in LABELS:
            assert field.compare([("night", new, ())], label) == field.compare(
                [("night", old, ())], label
            )
        report = self.ledger.report("", "night", now=at)
        labels = report["labels"]
        old_report = field.run_report(
            field_counters(view.counters(run.run_pk)), open_parts(view, run, at), labels=labels
        )
        assert {k: report[k] for k in old_report} == old_report
        assert view.count_stale(run.run_pk, at) == old_stale(view, run, at)
        assert view.oldest_open_seen(run.run_pk) == old_oldest(view, run)
        assert rebuild_run(self.store, run, write=False).consistent


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Returns an empty database of each backend."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    return str(request.getfixturevalue("pg_url"))


def test_every_kind_of_event_and_time_alone_keep_the_sums_equal_to_a_full_scan(url: str) -> None:
    night = Night(url)
    night.at(0, *(night.plan(i, "A" if i < 4 else "B") for i in range(8)))
    night.check()
    night.at(10, *(night.start(i, "a1", 30 if i % 2 else 3600, pool="p1") for i in range(6)))
    night.check()  # started
    night.at(15, *(night.ev(i, "a1", Heartbeat(1, 0.1, {})) for i in range(6)))
    night.check()  # heartbeat
    night.at(20, night.ev(2, "a1", CheckpointSaved(5, "/ck/2", 10, DIGEST, write_us=2_000)))
    night.check()  # checkpoint: a hang now loses only what came after it
    commit = ArtifactCommitted("out", "/out/s0", 5, DIGEST, "application/octet-stream")
    night.at(25, night.ev(0, "a1", commit))
    night.check()  # committed: it leaves the open attempts for the counted bucket
    night.at(30, night.ev(0, "", ArtifactVerified("out", "/out/s0", DIGEST, "passed", "", "")))
    night.check()  # verified
    night.at(35, night.ev(4, "a1", AttemptFailed("oom", "out of memory")))
    night.check()  # failed
    night.at(40)
    night.check()  # nothing happens, and nothing is stale yet
    assert night.stale() == 0  # the truth this night was built with, not the old scan's
    night.at(60)
    night.check()  # time alone: shards 1, 3 and 5 (30 s timeouts, last seen at 15 s) are stale
    assert night.stale() == 3
    night.at(61, night.ev(1, "a1", Heartbeat(2, 0.2, {})))
    night.check()  # a stale shard beats again: running, its span grown
    assert night.stale() == 2
    night.at(62, night.ev(3, "a1", AttemptFailed("preempted", "reclaimed")))
    night.at(63, night.start(3, "a2", 30, pool="p2"))
    night.check()  # reclaimed, and rerun elsewhere: a rerun of the first pass's attempt
    night.at(64, night.start(6, "a1", 3600), night.start(7, "a1", 30))
    night.at(65, night.ev(6, "a1", Heartbeat(1, 0.1, {})), night.ev(6, "a1", Heartbeat(2, 0.1, {})))
    night.check()  # several heartbeats of one shard in one batch
    night.at(500)
    night.check()  # everything short-lived is stale; the long ones run on
    assert night.stale() == 4  # shards 1, 3 (a2), 5 and 7: the 30 s attempts still open


def test_a_scrape_reads_no_running_shards_row(url: str) -> None:
    """The figures come from the counters and the open rows alone: rows left unread."""
    night = Night(url)
    night.at(0, *(night.plan(i, "A") for i in range(3)))
    night.at(10, *(night.start(i, "a1", 30) for i in range(3)))
    night.at(100)
    view = night.store.read()
    run = night.ledger.run("", "night")
    expected = old_counters(view, run, night.now)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a report parsed the shard rows")

    view.iter_shards = refuse  # type: ignore[method-assign]
    try:
        assert +counters_at(view, run, night.now) == +expected
    finally:
        del view.iter_shards
