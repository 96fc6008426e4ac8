"""A closed run takes no new shards (RUN_CLOSED) until a run_reopened event opens it again."""

from __future__ import annotations

import json
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest

from ledger_server.chain import chain_hash, row_bytes
from ledger_server.codec import decode_event
from ledger_server.config import ServerConfig
from ledger_server.errors import RunClosed, RunNotClosed
from ledger_server.importer import ImportRow, import_run
from ledger_server.replay import replay_run
from ledger_server.server import RunningServer, create_server
from ledger_server.service import LedgerService
from ledger_server.store.sqlite import SqliteStore
from ledger_server.validation import validate
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from shard_client.errors import LedgerRejected
from shard_client.ids import run_reopened_event, submission_closed_event
from tests.builders import event, planned, started

RUN = "night-1"


def lifecycle(client: LedgerClient, run_id: str = RUN) -> dict[str, object]:
    life: dict[str, object] = json.loads(client.summary(run_id))["lifecycle"]
    return life


def failed(shard_id: str, attempt_id: str) -> pb.ShardEvent:
    return event(RUN, shard_id, attempt_id, failed=pb.AttemptFailed(tag=pb.FAILURE_TAG_KILLED))


def settled_run(client: LedgerClient, shards: int = 3) -> pb.AppendResult:
    """Plans shards s0.. (s0 fails, the rest never start) and closes: the run is settled."""
    client.append([planned(RUN, f"s{i}", i) for i in range(shards)])
    client.append([started(RUN, "s0", "a0"), failed("s0", "a0")])
    close = client.close_submission(RUN, reason="last wave", expected_shards=shards)
    assert lifecycle(client)["state"] == "settled"
    return close


def refusal(client: LedgerClient, events: list[pb.ShardEvent]) -> LedgerRejected:
    with pytest.raises(LedgerRejected) as info:
        client.append(events)
    return info.value


def test_a_new_shard_of_a_closed_run_is_refused_with_run_closed_and_nothing_is_stored(
    client: LedgerClient,
) -> None:
    close = settled_run(client)
    before = (list(client.list_events(RUN)), lifecycle(client))

    # An identical re-plan rides along with the new shard: the batch is refused whole.
    refused = refusal(client, [planned(RUN, "s0", 0), planned(RUN, "s3", 3)])

    assert refused.code == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.reason == "RUN_CLOSED"
    closed_at = lifecycle(client)["submission_closed_at_us"]
    assert isinstance(closed_at, int)
    when = datetime.fromtimestamp(closed_at // 1_000_000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert str(refused) == (
        f"event 1: run {RUN} was closed at sequence {close.sequence} ({when}):"
        " plan --reopen to add shards"
    )
    assert refused.metadata["closed_at_sequence"] == str(close.sequence)
    assert refused.metadata["shard_id"] == "s3"
    assert (list(client.list_events(RUN)), lifecycle(client)) == before


def test_an_identical_replan_of_a_closed_run_is_still_already_planned(
    client: LedgerClient,
) -> None:
    settled_run(client)
    results = client.append([planned(RUN, f"s{i}", i) for i in range(3)])
    assert [r.outcome for r in results] == [pb.APPEND_OUTCOME_ALREADY_PLANNED] * 3
    assert lifecycle(client)["state"] == "settled"


def test_a_close_that_announced_more_shards_takes_them_up_to_its_count(
    client: LedgerClient,
) -> None:
    client.append([planned(RUN, "s0")])
    client.close_submission(RUN, expected_shards=2)
    (late,) = client.append([planned(RUN, "s1", 1)])  # announced, planned late
    assert late.outcome == pb.APPEND_OUTCOME_APPENDED
    assert refusal(client, [planned(RUN, "s2", 2)]).reason == "RUN_CLOSED"
    # Within one batch too: the count includes the shards the batch planned before.
    client.reopen_submission(RUN)
    client.close_submission(RUN, expected_shards=3)
    assert refusal(client, [planned(RUN, "s2", 2), planned(RUN, "s3", 3)]).reason == "RUN_CLOSED"
    (ok,) = client.append([planned(RUN, "s2", 2)])
    assert ok.outcome == pb.APPEND_OUTCOME_APPENDED


def test_a_close_still_ahead_takes_new_shards_until_it_takes_effect(
    server: RunningServer, client: LedgerClient
) -> None:
    client.append([planned(RUN, "s0")])
    until = datetime.fromtimestamp(server.ledger.clock() / 1e6 + 3600, UTC)
    client.close_submission(RUN, reason="window", submitted_until=until)
    (added,) = client.append([planned(RUN, "s1", 1)])
    assert added.outcome == pb.APPEND_OUTCOME_APPENDED
    client.close_submission(RUN, reason="done early")  # closes now: it stands
    assert refusal(client, [planned(RUN, "s2", 2)]).reason == "RUN_CLOSED"


def test_reopen_accepts_new_shards_until_the_next_close(client: LedgerClient) -> None:
    close = settled_run(client)

    reopen = client.reopen_submission(RUN, reason="a late wave")

    assert reopen.outcome == pb.APPEND_OUTCOME_APPENDED
    life = lifecycle(client)
    assert (life["state"], life["settled"], life["submission_closed"]) == ("open", False, False)
    assert life["reopened_at_sequence"] == reopen.sequence > close.sequence
    assert (life["submission_closed_at_sequence"], life["expected_shards"]) == (None, None)
    assert isinstance(life["reopened_at"], str) and life["reopened_at_us"] is not None
    stored = list(client.list_events(RUN))
    assert stored[-1].WhichOneof("payload") == "run_reopened"
    assert (stored[-1].shard_id, stored[-1].run_reopened.reason) == ("", "a late wave")

    (added,) = client.append([planned(RUN, "s3", 3)])
    assert added.outcome == pb.APPEND_OUTCOME_APPENDED
    summary = json.loads(client.summary(RUN))
    assert (summary["submitted"], summary["missing"]) == (4, 3)

    # The same words as the close the reopen undid: a new close, not a retry of that one.
    again = client.close_submission(RUN, reason="last wave", expected_shards=3)
    assert again.outcome == pb.APPEND_OUTCOME_APPENDED and again.sequence > reopen.sequence
    life = lifecycle(client)
    assert (life["state"], life["submission_closed_at_sequence"]) == ("settled", again.sequence)
    assert life["reopened_at_sequence"] == reopen.sequence  # history, as settled_at is
    assert refusal(client, [planned(RUN, "s4", 4)]).reason == "RUN_CLOSED"


def test_reopening_a_run_that_is_not_closed_is_refused(client: LedgerClient) -> None:
    client.append([planned(RUN, "s0")])
    never = refusal(client, [run_reopened_event(RUN)])
    assert never.code == grpc.StatusCode.FAILED_PRECONDITION
    assert never.reason == "RUN_NOT_CLOSED"
    assert f"run {RUN} is not closed (it was never closed)" in str(never)

    client.close_submission(RUN)
    first = client.reopen_submission(RUN)
    with pytest.raises(LedgerRejected) as info:
        client.reopen_submission(RUN)  # a second reopen: nothing stands to undo
    assert info.value.reason == "RUN_NOT_CLOSED"
    assert f"it was reopened at sequence {first.sequence}" in str(info.value)
    assert info.value.metadata["reopened_at_sequence"] == str(first.sequence)


def test_a_resent_reopen_is_a_duplicate_and_an_unknown_run_is_not_found(
    client: LedgerClient,
) -> None:
    settled_run(client, shards=1)
    reopen = run_reopened_event(RUN, reason="r")
    (first,) = client.append([reopen])
    (again,) = client.append([reopen])
    assert (again.outcome, again.sequence) == (pb.APPEND_OUTCOME_DUPLICATE, first.sequence)

    with pytest.raises(LedgerRejected) as info:
        client.reopen_submission("no-such-run")
    assert (info.value.code, info.value.reason) == (grpc.StatusCode.NOT_FOUND, "RUN_NOT_FOUND")


@pytest.mark.parametrize(("shard_id", "attempt_id"), [("s0", ""), ("", "a0")])
def test_a_reopen_naming_a_shard_or_attempt_is_invalid(
    client: LedgerClient, shard_id: str, attempt_id: str
) -> None:
    settled_run(client, shards=1)
    bad = run_reopened_event(RUN)
    bad.shard_id, bad.attempt_id = shard_id, attempt_id
    refused = refusal(client, [bad])
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "run_reopened" in str(refused)


def test_close_reopen_and_plan_in_one_batch_fold_in_order(client: LedgerClient) -> None:
    client.append([planned(RUN, "s0")])
    close = submission_closed_event(RUN, reason="x")
    # Closed, then a new shard: refused, and the close of that batch with it.
    assert refusal(client, [close, planned(RUN, "s1", 1)]).reason == "RUN_CLOSED"
    assert lifecycle(client)["submission_closed"] is False
    # Closed, reopened, then the new shard: every event lands.
    results = client.append([close, run_reopened_event(RUN), planned(RUN, "s1", 1)])
    assert [r.outcome for r in results] == [pb.APPEND_OUTCOME_APPENDED] * 3
    life = lifecycle(client)
    assert (life["state"], life["reopened_at_sequence"]) == ("open", results[1].sequence)


def test_a_restarted_server_and_a_replay_agree_on_a_reopened_run(db_path: Path) -> None:
    config = ServerConfig(database=str(db_path), listen="127.0.0.1:0")
    first: RunningServer = create_server(config)
    c = LedgerClient(f"127.0.0.1:{first.port}", timeout_s=10)
    try:
        settled_run(c)
        c.reopen_submission(RUN, reason="late")
        c.append([planned(RUN, "s3", 3)])
        before = lifecycle(c)
        stored = Counter(first.ledger.store.read().counters(first.ledger.run("", RUN).run_pk))
        replayed = replay_run(first.ledger.iter_events("default", RUN)).counters()
    finally:
        c.close()
        first.stop(0.5)
    assert {k: v for k, v in replayed.items() if v} == {k: v for k, v in stored.items() if v}
    assert before["state"] == "open" and before["reopened_at_sequence"]
    second = create_server(config)
    c = LedgerClient(f"127.0.0.1:{second.port}", timeout_s=10)
    try:
        assert lifecycle(c) == before
    finally:
        c.close()
        second.stop(0.5)


def _rows(events: list[pb.ShardEvent], start_us: int) -> list[ImportRow]:
    """Returns the events as a chained export, as if a ledger had stored them in order."""
    rows, head = [], bytes(32)
    for n, message in enumerate(events, start=1):
        valid = validate(decode_event(message))
        row = row_bytes(valid.event, run_sequence=n, receive_time_us=start_us + n)
        head = chain_hash(head, row)
        rows.append(ImportRow(n, row, head))
    return rows


def test_an_import_folds_a_reopen_and_refuses_what_the_live_ledger_refuses(
    tmp_path: Path,
) -> None:
    t0 = 1_800_000_000_000_000
    close, reopen = submission_closed_event(RUN), run_reopened_event(RUN)
    history = [planned(RUN, "s0"), close, reopen, planned(RUN, "s1", 1)]
    source = SqliteStore(tmp_path / "live.db")
    ledger = LedgerService(source)
    try:
        ledger.append([decode_event(e) for e in history])
        run = ledger.run("default", RUN)
        exported = [
            ImportRow(r.run_sequence, r.row, r.row_hash)
            for r in source.read().iter_events(run.run_pk)
        ]
        target = SqliteStore(tmp_path / "copy.db")
        try:
            result = import_run(target, namespace="default", run_id=RUN, rows=exported)
            assert (result.events, result.shards) == (4, 2)
            copied = target.read().get_run("default", RUN)
            assert copied is not None
            # The same counters, the sequences aside (an import numbers its rows anew).
            names = {k for k in source.read().counters(run.run_pk) if "submission" not in k}
            assert {
                k: v for k, v in target.read().counters(copied.run_pk).items() if k in names
            } == {k: v for k, v in source.read().counters(run.run_pk).items() if k in names}
            assert "submission:reopened" in target.read().counters(copied.run_pk)
            assert "submission:closed" not in target.read().counters(copied.run_pk)
        finally:
            target.close()
    finally:
        ledger.close()
        source.close()
    for name, (bad, error) in {
        "new-shard": ([planned(RUN, "s0"), close, planned(RUN, "s1", 1)], RunClosed),
        "reopen": ([planned(RUN, "s0"), reopen], RunNotClosed),
    }.items():
        store = SqliteStore(tmp_path / f"{name}.db")
        try:
            with pytest.raises(error):
                import_run(store, namespace="default", run_id=RUN, rows=_rows(bad, t0))
            assert store.read().get_run("default", RUN) is None  # all or nothing
        finally:
            store.close()
