"""A run's lifecycle: open, submission closed, settled; what status, replay and a restart say."""

from __future__ import annotations

import json
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest

from ledger_server.config import ServerConfig
from ledger_server.replay import replay_run
from ledger_server.server import RunningServer, create_server
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from shard_client.errors import LedgerRejected
from shard_client.ids import submission_closed_event
from tests.builders import DIGEST_A, committed, event, planned, run_cli, started

RUN = "night-1"


def lifecycle(client: LedgerClient, run_id: str = RUN) -> dict[str, object]:
    life: dict[str, object] = json.loads(client.summary(run_id))["lifecycle"]
    return life


def verified(run_id: str, shard_id: str, attempt_id: str) -> pb.ShardEvent:
    return event(
        run_id,
        shard_id,
        attempt_id,
        verified=pb.ArtifactVerified(
            name="out", path="/out/x", blake3_hex=DIGEST_A, result=pb.VERIFICATION_RESULT_PASSED
        ),
    )


def failed(run_id: str, shard_id: str, attempt_id: str) -> pb.ShardEvent:
    return event(run_id, shard_id, attempt_id, failed=pb.AttemptFailed(tag=pb.FAILURE_TAG_KILLED))


def test_a_run_settles_once_closed_and_every_shard_has_ended(client: LedgerClient) -> None:
    client.append([planned(RUN, f"s{i}", i) for i in range(3)])
    client.append([started(RUN, "s0", "a0"), started(RUN, "s1", "a1")])
    assert lifecycle(client)["state"] == "open"

    close = client.close_submission(RUN, reason="one wave", expected_shards=3)
    assert close.outcome == pb.APPEND_OUTCOME_APPENDED
    life = lifecycle(client)
    assert life["state"] == "submission_closed"
    assert life["submission_closed_at_sequence"] == close.sequence
    assert life["expected_shards"] == 3
    assert life["waiting_on"] == {"running": 2, "stale": 0, "unverified": 0, "unplanned": 0}
    assert life["settled_at"] is None

    client.append([committed(RUN, "s0", "a0"), failed(RUN, "s1", "a1")])
    # s0's output is committed but not verified: the run still waits for the verifier.
    assert lifecycle(client)["waiting_on"] == {
        "running": 0,
        "stale": 0,
        "unverified": 1,
        "unplanned": 0,
    }
    client.append([verified(RUN, "s0", "a0")])
    life = lifecycle(client)
    # s2 never started: a settled run may have missing shards (the alerts say so).
    assert life["state"] == "settled" and life["settled"] is True
    summary = json.loads(client.summary(RUN))
    assert (summary["verified"], summary["failed"], summary["missing"]) == (1, 1, 1)
    last = client.list_events(RUN)
    last_receive = max(e.receive_time.ToMicroseconds() for e in last)
    assert life["settled_at_us"] == last_receive
    assert datetime.fromisoformat(str(life["settled_at"])).timestamp() == last_receive / 1e6


def test_a_rerun_unsettles_the_run_and_its_end_settles_it_again(client: LedgerClient) -> None:
    client.append([planned(RUN, "s0"), started(RUN, "s0", "a0"), failed(RUN, "s0", "a0")])
    client.close_submission(RUN)
    first = lifecycle(client)["settled_at_us"]
    assert first is not None

    client.append([started(RUN, "s0", "a0-rerun")])
    assert lifecycle(client)["state"] == "submission_closed"
    client.append([committed(RUN, "s0", "a0-rerun"), verified(RUN, "s0", "a0-rerun")])
    life = lifecycle(client)
    assert life["state"] == "settled"
    assert isinstance(life["settled_at_us"], int) and life["settled_at_us"] > int(str(first))


def test_an_identical_replan_of_a_settled_run_changes_nothing(client: LedgerClient) -> None:
    client.append([planned(RUN, "s0"), started(RUN, "s0", "a0"), failed(RUN, "s0", "a0")])
    client.close_submission(RUN)
    before = lifecycle(client)

    (again,) = client.append([planned(RUN, "s0")])

    assert again.outcome == pb.APPEND_OUTCOME_ALREADY_PLANNED
    assert lifecycle(client) == before  # nothing stored, so the run did not move


def test_fewer_planned_shards_than_announced_keep_the_run_unsettled(client: LedgerClient) -> None:
    client.append([planned(RUN, "s0")])
    client.close_submission(RUN, expected_shards=2)
    life = lifecycle(client)
    assert life["state"] == "submission_closed"
    assert life["waiting_on"] == {"running": 0, "stale": 0, "unverified": 0, "unplanned": 1}

    client.append([planned(RUN, "s1", 1)])
    assert lifecycle(client)["state"] == "settled"


def test_closing_again_is_idempotent_and_a_different_close_does_not_move_the_first(
    client: LedgerClient,
) -> None:
    client.append([planned(RUN, "s0")])
    first = client.close_submission(RUN, reason="done")
    again = client.close_submission(RUN, reason="done")
    assert again.outcome == pb.APPEND_OUTCOME_DUPLICATE
    assert again.sequence == first.sequence
    other = client.close_submission(RUN, reason="closed twice by another planner")
    assert other.outcome == pb.APPEND_OUTCOME_APPENDED
    assert lifecycle(client)["submission_closed_at_sequence"] == first.sequence


def test_a_close_with_submitted_until_takes_effect_then_and_an_earlier_close_wins(
    server: RunningServer, client: LedgerClient
) -> None:
    client.append([planned(RUN, "s0")])
    now_us = server.ledger.clock()
    until = datetime.fromtimestamp(now_us / 1e6 + 3600, UTC)
    client.close_submission(RUN, reason="window ends", submitted_until=until)

    life = server.ledger.summary("default", RUN)["lifecycle"]
    assert (life["state"], life["submission_closed"]) == ("open", False)
    assert life["submission_closes_at"] == until.isoformat(timespec="microseconds")
    later = server.ledger.summary("default", RUN, now=now_us + 3601 * 1_000_000)["lifecycle"]
    assert later["state"] == "settled"
    assert later["settled_at_us"] == int(until.timestamp() * 1_000_000)

    # Done early: a plain close now closes earlier, so it stands.
    client.close_submission(RUN, reason="all done")
    assert lifecycle(client)["state"] == "settled"


def test_closing_an_unknown_run_is_refused_and_creates_nothing(client: LedgerClient) -> None:
    with pytest.raises(LedgerRejected) as info:
        client.close_submission("no-such-run")
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    assert info.value.reason == "RUN_NOT_FOUND"
    assert [r.run_id for r in client.list_runs()] == []


@pytest.mark.parametrize(("shard_id", "attempt_id"), [("s0", ""), ("", "a0")])
def test_a_close_naming_a_shard_or_attempt_is_invalid(
    client: LedgerClient, shard_id: str, attempt_id: str
) -> None:
    client.append([planned(RUN, "s0")])
    bad = submission_closed_event(RUN)
    bad.shard_id, bad.attempt_id = shard_id, attempt_id
    with pytest.raises(LedgerRejected) as info:
        client.append([bad])
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "submission_closed" in str(info.value)
    assert lifecycle(client)["submission_closed"] is False


def test_a_restarted_server_and_a_replay_report_the_same_lifecycle(db_path: Path) -> None:
    config = ServerConfig(database=str(db_path), listen="127.0.0.1:0")
    first: RunningServer = create_server(config)
    c = LedgerClient(f"127.0.0.1:{first.port}", timeout_s=10)
    try:
        c.append([planned(RUN, "s0"), started(RUN, "s0", "a0"), failed(RUN, "s0", "a0")])
        c.close_submission(RUN, reason="r", expected_shards=1)
        before = lifecycle(c)
        stored = Counter(first.ledger.store.read().counters(first.ledger.run("", RUN).run_pk))
        replayed = replay_run(first.ledger.iter_events("default", RUN)).counters()
    finally:
        c.close()
        first.stop(0.5)
    assert {k: v for k, v in replayed.items() if v} == {k: v for k, v in stored.items() if v}
    second = create_server(config)
    c = LedgerClient(f"127.0.0.1:{second.port}", timeout_s=10)
    try:
        assert lifecycle(c) == before
        assert before["state"] == "settled"
    finally:
        c.close()
        second.stop(0.5)


def test_plan_close_from_the_cli_and_status_shows_the_lifecycle(
    capsys: pytest.CaptureFixture[str], client: LedgerClient, target: str, tmp_path: Path
) -> None:
    manifest = tmp_path / "plan.jsonl"
    manifest.write_text(
        json.dumps({"input": "s3://b/0", "input_blake3": DIGEST_A, "input_bytes": 1}) + "\n"
    )
    code, out, err = run_cli(
        capsys, "plan", RUN, "--manifest", str(manifest), "--server", target, "--json"
    )
    assert code == 0, err
    code, out, _ = run_cli(capsys, "status", RUN, "--server", target, "--format", "table")
    assert "lifecycle          open: jobs may still start" in out
    # Piped (plain), the same line is the summary block's lifecycle field.
    code, out, _ = run_cli(capsys, "status", RUN, "--server", target)
    assert "\nlifecycle\topen: jobs may still start" in out

    code, out, err = run_cli(
        capsys, "plan", RUN, "--close", "--reason", "last wave", "--server", target, "--json"
    )
    assert code == 0, err
    answer = json.loads(out)
    assert answer["closed"] is True and answer["close_outcome"] == "appended"
    code, out, _ = run_cli(capsys, "status", RUN, "--server", target)
    # The one shard never started: nothing is waited on, the run is settled.
    assert "\nlifecycle\tsettled at " in out
    code, out, _ = run_cli(capsys, "status", RUN, "--server", target, "--json")
    assert json.loads(out)["lifecycle"]["state"] == "settled"
    code, out, _ = run_cli(capsys, "trend", "--server", target, "--json")
    (row,) = json.loads(out)["runs"]
    assert row["lifecycle"] == "settled" and row["settled_at"] is not None

    code, out, _ = run_cli(
        capsys, "plan", RUN, "--close", "--reason", "last wave", "--server", target
    )
    assert code == 0
    assert out.startswith(f"run {RUN}: submission closed at sequence ")
    assert "(already closed so)" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--reason", "x"), "--reason goes with --close or --reopen"),
        (("--expected", "3"), "--expected and --submitted-until go with --close"),
        (("--reopen", "--submitted-until", "2026-12-02T07:00Z"), "go with --close"),
        (("--close", "--submitted-until", "2026-12-02T07:00"), "needs a time zone"),
        (("--close", "--submitted-until", "tomorrow"), "not an ISO 8601 time"),
        ((), "give --manifest FILE, --inputs DIR, --close or --reopen"),
        (("--reopen", "--dry-run"), "--dry-run goes with --manifest or --inputs"),
        (("--close", "--expected", "-1"), "--expected must be between 0 and 2,147,483,647"),
        # The summary carries the count as int32: a larger one would poison the run.
        (("--close", "--expected", "3000000000"), "--expected must be between 0 and"),
        (("--close", "--dry-run"), "--dry-run goes with --manifest or --inputs"),
    ],
)
def test_plan_close_usage_errors_send_nothing(
    capsys: pytest.CaptureFixture[str],
    client: LedgerClient,
    target: str,
    argv: tuple[str, ...],
    message: str,
) -> None:
    client.append([planned(RUN, "s0")])
    code, _, err = run_cli(capsys, "plan", RUN, *argv, "--server", target)
    assert code == 2
    assert message in err
    assert lifecycle(client)["submission_closed"] is False


def test_plan_close_of_an_unknown_run_exits_4(
    capsys: pytest.CaptureFixture[str], client: LedgerClient, target: str
) -> None:
    code, _, err = run_cli(capsys, "plan", "nope", "--close", "--server", target)
    assert code == 4
    assert "cannot close run nope: RUN_NOT_FOUND" in err


def test_status_gives_each_moment_as_the_run_s_own_event_number_too(
    client: LedgerClient, capsys: pytest.CaptureFixture[str]
) -> None:
    # Another run's events come first, so the ledger-wide sequences and the run's differ.
    client.append([planned("other", f"o{i}", i) for i in range(5)])
    client.append([planned(RUN, "s0"), started(RUN, "s0", "a0"), committed(RUN, "s0", "a0")])
    client.append([verified(RUN, "s0", "a0")])  # the run's first verdict: event 4
    close = client.close_submission(RUN, reason="one wave")
    reopen = client.reopen_submission(RUN, reason="a late wave")
    events = {e.sequence: e.run_sequence for e in client.list_events(RUN)}

    _, out, err = run_cli(capsys, "status", RUN, "--server", client.target, "--json")
    summary = json.loads(out)
    life, first = summary["lifecycle"], summary["first_pass"]
    assert life["reopened_at_sequence"] == reopen.sequence
    assert life["reopened_at_run_sequence"] == events[reopen.sequence] == 6
    assert first["closed_at_run_sequence"] == events[first["closed_at_sequence"]] == 4
    assert close.sequence != events[close.sequence]
    assert life["submission_closed_at_run_sequence"] is None  # reopened since: no close stands
    _, out, err = run_cli(capsys, "status", RUN, "--server", client.target)
    assert "first pass\tclosed at event 4 (the run's first verdict)" in out, out + err
    assert "open (reopened at event 6, " in out
