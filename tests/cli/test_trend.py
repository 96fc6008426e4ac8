"""`shardledger trend` against a real server: the run trend and ruler drift detection."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence

import pytest
import structlog
from google.protobuf.duration_pb2 import Duration

from ledger_server.drift import ShardArtifacts, compare_rulers
from ledger_server.server import RunningServer
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.canonical import fingerprint_digest
from shard_client.client import LedgerClient
from shardledger_cli.cli import EXIT_OK, EXIT_PROBLEMS, build_parser
from tests.builders import FINGERPRINT_DIGEST, committed, event, planned, started

FP_OLD = fingerprint_digest({"driver": "550"})  # the fingerprint group of every ruler run so far
FP_NEW = fingerprint_digest({"driver": "560"})  # numbers are not comparable across it


@pytest.fixture(autouse=True)
def quiet_server_logs() -> Iterator[None]:
    """Keeps the in-process server's log lines out of the CLI's captured stdout."""
    with structlog.testing.capture_logs():
        yield


def digest(n: int) -> str:
    """Returns a distinct fake blake3 hex digest."""
    return f"{n:064x}"


def trend(server: RunningServer, *argv: str) -> int:
    """Runs `shardledger trend` against the server and returns its exit code."""
    args = build_parser(("shardledger_cli.commands.trend",)).parse_args(
        ["trend", "--server", f"127.0.0.1:{server.port}", *argv]
    )
    code: int = args.func(args)
    return code


def shard_done(
    run_id: str,
    shard_id: str,
    fingerprint: str,
    blake3: str,
    *,
    verdict: pb.VerificationResult | None = pb.VERIFICATION_RESULT_PASSED,
) -> list[pb.ShardEvent]:
    """Returns the events of one attempt that commits (and verifies) one output."""
    attempt = f"{run_id}-{shard_id}"
    start = pb.AttemptStarted(
        host="node-1",
        pid=1,
        heartbeat_timeout=Duration(seconds=60),
        fingerprint={"driver": "550" if fingerprint == FP_OLD else "560"},
        fingerprint_digest=fingerprint,
    )
    path = f"/out/{run_id}/{shard_id}"
    events = [
        event(run_id, shard_id, attempt, started=start),
        committed(run_id, shard_id, attempt, digest=blake3, path=path),
    ]
    if verdict is not None:
        reason = "" if verdict == pb.VERIFICATION_RESULT_PASSED else "empty"
        result = pb.ArtifactVerified(
            name="out", path=path, blake3_hex=blake3, result=verdict, reason=reason
        )
        events.append(event(run_id, shard_id, verified=result))
    return events


def ruler_run(client: LedgerClient, run_id: str, outputs: Sequence[tuple[str, str] | None]) -> None:
    """Plans one shard per entry and completes it with (fingerprint, digest) when given."""
    client.append([planned(run_id, f"r{i}", i) for i in range(len(outputs))])
    for i, output in enumerate(outputs):
        if output is not None:
            client.append(shard_done(run_id, f"r{i}", *output))


def test_a_digest_change_inside_one_fingerprint_group_is_drift_and_exits_1(
    server: RunningServer, client: LedgerClient, capsys: pytest.CaptureFixture[str]
) -> None:
    ruler_run(client, "ruler-001", [(FP_OLD, digest(1)), (FP_OLD, digest(2)), (FP_OLD, digest(3))])
    ruler_run(client, "night-7", [(FP_OLD, digest(9))])
    ruler_run(
        client, "ruler-002", [(FP_OLD, digest(1)), (FP_OLD, digest(20)), (FP_NEW, digest(30))]
    )
    capsys.readouterr()

    code = trend(server, "--json")

    report = json.loads(capsys.readouterr().out)
    assert code == EXIT_PROBLEMS
    assert report["drift_found"] is True
    [comparison] = report["ruler_comparisons"]
    assert (comparison["run_id"], comparison["previous_run_id"]) == ("ruler-002", "ruler-001")
    assert (comparison["compared_outputs"], comparison["unchanged"]) == (3, 1)
    assert [(d["shard_id"], d["previous_blake3"], d["blake3"]) for d in comparison["drift"]] == [
        ("r1", digest(2), digest(20))
    ]
    assert [d["shard_id"] for d in comparison["across_groups"]] == ["r2"]


def test_ruler_changes_only_across_fingerprint_groups_exit_0(
    server: RunningServer, client: LedgerClient, capsys: pytest.CaptureFixture[str]
) -> None:
    ruler_run(client, "ruler-001", [(FP_OLD, digest(1)), (FP_OLD, digest(2))])
    ruler_run(client, "ruler-002", [(FP_NEW, digest(10)), (FP_NEW, digest(20))])
    capsys.readouterr()

    code = trend(server)

    out = capsys.readouterr().out
    assert code == EXIT_OK
    assert "ruler-002" in out and "ruler-001" in out
    assert "no drift" in out


def test_trend_shows_completion_silent_errors_and_tags_of_the_last_runs(
    server: RunningServer, client: LedgerClient, capsys: pytest.CaptureFixture[str]
) -> None:
    ruler_run(client, "night-1", [(FP_OLD, digest(1))])
    client.append([planned("night-2", f"s{i}", i) for i in range(4)])
    client.append(shard_done("night-2", "s0", FP_OLD, digest(1)))
    client.append(shard_done("night-2", "s1", FP_OLD, digest(2), verdict=None))
    client.append(
        shard_done("night-2", "s3", FP_OLD, digest(3), verdict=pb.VERIFICATION_RESULT_FAILED)
    )
    client.append(
        [
            started("night-2", "s2", "a2"),
            event("night-2", "s2", "a2", failed=pb.AttemptFailed(tag=pb.FAILURE_TAG_OOM)),
        ]
    )
    capsys.readouterr()

    code = trend(server, "--json", "--last", "1")

    report = json.loads(capsys.readouterr().out)
    assert code == EXIT_OK
    [row] = report["runs"]
    assert row["run_id"] == "night-2"
    assert (row["submitted"], row["verified"], row["completion_rate"]) == (4, 1, 0.25)
    assert (row["silent_errors"], row["silent_error_rate"]) == (1, 0.25)  # s3: looked done
    assert row["failure_tags"] == {"oom": 1}
    assert row["verify_failures"] == {"empty": 1}
    assert row["fingerprint_groups"] == {FP_OLD: 3, FINGERPRINT_DIGEST: 1}
    assert report["ruler_comparisons"] == []


def test_the_last_runs_are_the_newest_created_even_after_an_old_run_is_written_again(
    server: RunningServer, client: LedgerClient, capsys: pytest.CaptureFixture[str]
) -> None:
    for night in ("night-1", "night-2", "night-3"):
        client.append([planned(night, "s0", 0)])
    client.append(shard_done("night-1", "s0", FP_OLD, digest(1)))  # e.g. a late verify --recheck
    capsys.readouterr()

    assert trend(server, "--json", "--last", "2") == EXIT_OK

    assert [r["run_id"] for r in json.loads(capsys.readouterr().out)["runs"]] == [
        "night-2",
        "night-3",
    ]


def test_shards_in_only_one_ruler_run_are_an_id_set_difference_not_drift() -> None:
    before = {
        "r0": ShardArtifacts("verified", FP_OLD, {"out": digest(1)}),
        "r1": ShardArtifacts("verified", FP_OLD, {"out": digest(2)}),
    }
    after = {
        "r0": ShardArtifacts("verified", "", {"out": digest(5)}),  # fingerprint unknown
        "r9": ShardArtifacts("verified", FP_OLD, {"out": digest(9)}),
    }

    result = compare_rulers(before, after)

    assert result["drift"] == []
    assert [u["shard_id"] for u in result["unattributed"]] == ["r0"]
    assert (result["only_in_previous"], result["only_in_current"]) == (["r1"], ["r9"])
