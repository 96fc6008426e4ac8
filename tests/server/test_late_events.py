"""Attempts whose events waited in a spool are counted, so status says the figures were behind."""

from __future__ import annotations

import json
import time

from google.protobuf.timestamp_pb2 import Timestamp

from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from tests.builders import committed, planned, started


def made_ago(event: pb.ShardEvent, seconds: float) -> pb.ShardEvent:
    """Returns the event as if the job had made it `seconds` ago (its client time)."""
    stamp = Timestamp()
    stamp.FromNanoseconds(time.time_ns() - int(seconds * 1e9))
    event.client_time.CopyFrom(stamp)
    return event


def test_an_attempt_whose_commit_arrived_long_after_it_was_made_is_late(
    client: LedgerClient,
) -> None:
    client.append([planned("night", "s0", 0), planned("night", "s1", 1)])
    # s0's job committed ten minutes before the ledger heard of it (it sat in a spool);
    # s1's events arrived as they were made.
    client.append(
        [
            made_ago(started("night", "s0", "a0"), 600),
            made_ago(committed("night", "s0", "a0"), 590),
            made_ago(started("night", "s1", "a1"), 1),
            made_ago(committed("night", "s1", "a1"), 0.5),
        ]
    )
    summary = json.loads(client.summary("night"))
    assert summary["late_attempts"] == 1


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
