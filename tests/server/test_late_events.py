"""Attempts whose events waited in a spool are counted, so status says the figures were behind."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from ledger_server.replay import replay_run
from ledger_server.server import RunningServer
from ledger_server.summary import run_summary
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from tests.builders import committed, event, planned, started


def made_ago(event: pb.ShardEvent, seconds: float) -> pb.ShardEvent:
    """Returns the event as if the job had made it `seconds` ago (its client time)."""
    stamp = Timestamp()
    stamp.FromNanoseconds(time.time_ns() - int(seconds * 1e9))
    event.client_time.CopyFrom(stamp)
    return event


def test_an_attempt_whose_events_waited_in_a_spool_past_its_timeout_is_late(
    client: LedgerClient,
) -> None:
    client.append([planned("night", "s0", 0), planned("night", "s1", 1)])
    # s0's job ran ten minutes while the ledger was away: its start waited in the spool
    # ten minutes longer than its commit, made just before the spool drained. s1's
    # events arrived as they were made.
    client.append(
        [
            made_ago(started("night", "s0", "a0"), 600),
            made_ago(committed("night", "s0", "a0"), 1),
            made_ago(started("night", "s1", "a1"), 1),
            made_ago(committed("night", "s1", "a1"), 0.5),
        ]
    )
    summary = json.loads(client.summary("night"))
    assert summary["late_attempts"] == 1


@pytest.mark.parametrize("skew_s", [-600, 600])
def test_a_job_clock_ten_minutes_off_makes_no_attempt_late(
    client: LedgerClient, skew_s: int
) -> None:
    client.append([planned("night", "s0", 0)])
    # Every event arrives as it is made, stamped by a clock ten minutes off.
    client.append([made_ago(started("night", "s0", "a0"), -skew_s)])
    client.append([made_ago(heartbeat("night", "s0", "a0"), -skew_s)])
    client.append([made_ago(committed("night", "s0", "a0"), -skew_s)])
    assert json.loads(client.summary("night"))["late_attempts"] == 0


@pytest.mark.parametrize("skew_s", [-600, 0, 600])
def test_a_commit_that_waited_past_the_timeout_is_late_whatever_the_job_clock(
    client: LedgerClient, skew_s: int
) -> None:
    client.append([planned("night", "s0", 0)])
    # The start arrives at once; the commit was made 90 s (1.5 timeouts) before it
    # arrives: it waited in a spool. A job clock ahead by ten minutes used to hide it.
    client.append([made_ago(started("night", "s0", "a0"), -skew_s)])
    client.append([made_ago(committed("night", "s0", "a0"), 90 - skew_s)])
    assert json.loads(client.summary("night"))["late_attempts"] == 1


def test_heartbeats_drained_late_make_the_attempt_late_and_replay_agrees(
    client: LedgerClient, server: RunningServer
) -> None:
    client.append([planned("night", "s0", 0), planned("night", "s1", 1)])
    client.append([made_ago(started("night", s, f"a-{s}"), 0) for s in ("s0", "s1")])
    # s0's job was cut off for two minutes: its beats drain together when it is back.
    client.append(
        [made_ago(heartbeat("night", "s0", "a-s0", step), 120 - step) for step in range(3)]
    )
    client.append([made_ago(heartbeat("night", "s1", "a-s1", 1), 0)])
    served = json.loads(client.summary("night"))
    assert served["late_attempts"] == 1
    assert replayed_summary(server, "night")["late_attempts"] == 1


def heartbeat(run: str, shard: str, attempt: str, step: int = 1) -> pb.ShardEvent:
    """Returns a plain heartbeat of the attempt."""
    return event(run, shard, attempt, heartbeat=pb.Heartbeat(step=step))


def replayed_summary(server: RunningServer, run: str) -> dict[str, Any]:
    """Returns the run's summary as a fresh replay of its stored events computes it."""
    fresh = replay_run(server.ledger.iter_events("", run))
    now = time.time_ns() // 1000
    return run_summary(
        fresh.counters(),
        stale=fresh.stale_count(now),
        run_id=run,
        namespace="default",
        last_event_us=fresh.last_receive_us,
        now_us=now,
    )


def test_events_without_a_client_time_are_never_late(client: LedgerClient) -> None:
    client.append([planned("night", "s0", 0), started("night", "s0", "a0")])
    client.append([committed("night", "s0", "a0")])
    assert json.loads(client.summary("night"))["late_attempts"] == 0


def verdict(run: str, shard: str, attempt: str, digest: str) -> pb.ShardEvent:
    """Returns a passing verdict on the attempt's commit of `out` at /out/x (the builders')."""
    return pb.ShardEvent(
        event_id=f"v-{shard}-{attempt}",
        run_id=run,
        shard_id=shard,
        attempt_id=attempt,
        verified=pb.ArtifactVerified(
            name="out",
            path="/out/x",
            blake3_hex=digest,
            result=pb.VERIFICATION_RESULT_PASSED,
        ),
    )


def test_a_commit_drained_after_the_first_verdict_is_not_part_of_the_first_pass(
    client: LedgerClient,
) -> None:
    client.append([planned("night", "s0", 0), planned("night", "s1", 1)])
    s0 = committed("night", "s0", "a0")
    client.append([started("night", "s0", "a0"), s0, started("night", "s1", "a1")])
    # The morning's verify: s0 passes; s1's job had ended while the ledger was away.
    client.append([verdict("night", "s0", "a0", s0.artifact_committed.blake3_hex)])
    before = json.loads(client.summary("night"))["first_pass"]
    # Later a spool drains s1's commit, and a verify passes it.
    s1 = made_ago(committed("night", "s1", "a1"), 3600)
    client.append([s1])
    client.append([verdict("night", "s1", "a1", s1.artifact_committed.blake3_hex)])
    after = json.loads(client.summary("night"))
    assert after["verified"] == 2  # the shard is fine now
    assert after["first_pass"] == before  # but the night as first reconciled did not have it
    assert before["verified"] == 1


def test_each_attempt_shows_its_host_clock_skew_and_whether_it_was_late(
    client: LedgerClient,
) -> None:
    client.append([planned("night", "s0", 0)])
    # The first attempt's host runs ten minutes ahead and its commit waited 90 s in a
    # spool; the rerun's host keeps time.
    client.append([made_ago(started("night", "s0", "a0"), -600)])
    client.append([made_ago(committed("night", "s0", "a0"), -510)])
    client.append([made_ago(started("night", "s0", "a1"), 0)])
    (view,) = client.shards("night")
    rows = {r["attempt_id"]: r for r in json.loads(view.view_json)["attempt_history"]}
    # From the start, delivered at once: within a second of the skew (the call's time).
    assert abs(rows["a0"]["clock_skew_us"] - 600_000_000) < 1_000_000
    assert abs(rows["a1"]["clock_skew_us"]) < 1_000_000
    assert (rows["a0"]["late"], rows["a1"]["late"]) == (True, False)
    assert [a.clock_skew_us for a in view.view.attempt_history] == [
        rows["a0"]["clock_skew_us"],
        rows["a1"]["clock_skew_us"],
    ]


def test_a_start_drained_from_a_spool_after_the_job_moved_on_is_late_and_both_clocks_shown(
    client: LedgerClient,
) -> None:
    client.append([planned("night", "s0", 0)])
    # The job started 27 s ago while the ledger was away; its start waited in the spool
    # and arrives with its commit, made just now: less than the heartbeat timeout apart.
    client.append([made_ago(started("night", "s0", "a0"), 27)])
    client.append([made_ago(committed("night", "s0", "a0"), 0)])
    assert json.loads(client.summary("night"))["late_attempts"] == 1
    (view,) = client.shards("night")
    (row,) = json.loads(view.view_json)["attempt_history"]
    assert row["late"] is True and row["span_clock"] == "job"
    # 27 s, give or take each call's own time in transit.
    assert abs(row["delivery_gap_us"] - 27_000_000) < 3_000_000
    assert abs(row["started_us"] - row["client_started_us"] - 27_000_000) < 3_000_000
    (typed,) = view.view.attempt_history
    assert (typed.client_started_us, typed.delivery_gap_us) == (
        row["client_started_us"],
        row["delivery_gap_us"],
    )


def test_a_start_and_end_that_travelled_alike_are_not_late_whatever_the_skew(
    client: LedgerClient,
) -> None:
    client.append([planned("night", "s0", 0)])
    client.append([made_ago(started("night", "s0", "a0"), 600)])  # a clock 10 min behind
    client.append([made_ago(committed("night", "s0", "a0"), 600)])
    assert json.loads(client.summary("night"))["late_attempts"] == 0
