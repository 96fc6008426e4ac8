"""`shardledger verify` re-reads real files and records verdicts on a real server."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest
from google.protobuf.duration_pb2 import Duration

from ledger_server.config import ServerConfig
from ledger_server.server import RunningServer, create_server
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.checks import CheckResult
from shard_client.client import LedgerClient
from shardledger_cli.cli import main
from shardledger_cli.commands.verify import Commit, Recorder, verdict_event

_IDS = itertools.count()


@pytest.fixture
def running(tmp_path: Path) -> Iterator[RunningServer]:
    """A real server on a fresh SQLite file."""
    server = create_server(ServerConfig(database=str(tmp_path / "ledger.db"), listen="127.0.0.1:0"))
    yield server
    server.stop(0.5)


@pytest.fixture
def client(running: RunningServer) -> Iterator[LedgerClient]:
    """A client of the fixture server."""
    c = LedgerClient(f"127.0.0.1:{running.port}")
    yield c
    c.close()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """The directory artifacts live in."""
    out = tmp_path / "out"
    out.mkdir()
    return out


def commit_shard(client: LedgerClient, run: str, shard: str, path: str, data: bytes) -> None:
    """Plans a shard, starts an attempt and commits an artifact describing data."""

    def ev(attempt: str = "", **payload: Any) -> pb.ShardEvent:
        return pb.ShardEvent(
            event_id=f"v{next(_IDS)}", run_id=run, shard_id=shard, attempt_id=attempt, **payload
        )

    started = pb.AttemptStarted(host="h", pid=1, heartbeat_timeout=Duration(seconds=600))
    commit = pb.ArtifactCommitted(
        name="out", path=path, size_bytes=len(data), blake3_hex=blake3.blake3(data).hexdigest()
    )
    client.append(
        [
            ev(planned=pb.ShardPlanned(input_ref=f"/in/{shard}", expected_outputs=["out"])),
            ev("a1", started=started),
            ev("a1", artifact_committed=commit),
        ]
    )


def verify(
    running: RunningServer, capsys: pytest.CaptureFixture[str], *argv: str
) -> tuple[int, dict[str, Any]]:
    """Runs `shardledger verify --json` and returns its exit code and report."""
    code = main(["verify", *argv, "--json", "--server", f"127.0.0.1:{running.port}"])
    return code, json.loads(capsys.readouterr().out)


def verdicts(client: LedgerClient, run: str) -> list[pb.ShardEvent]:
    """Returns the run's verified events."""
    return [e for e in client.list_events(run) if e.WhichOneof("payload") == "verified"]


@pytest.fixture
def mixed_run(client: LedgerClient, root: Path) -> str:
    """A run of four shards: one good file and three broken ways."""
    good = b"good bytes\n"
    (root / "good.bin").write_bytes(good)
    commit_shard(client, "mixed", "s-good", str(root / "good.bin"), good)
    (root / "short.bin").write_bytes(b"trunc")
    commit_shard(client, "mixed", "s-size", str(root / "short.bin"), b"truncated!")
    (root / "flip.bin").write_bytes(b"0123456789")
    commit_shard(client, "mixed", "s-digest", "flip.bin", b"0123456780")  # relative to --root
    commit_shard(client, "mixed", "s-missing", str(root / "gone.bin"), b"never written")
    return "mixed"


@pytest.mark.timeout(60)
def test_verify_records_a_verdict_per_artifact_and_exits_1_on_failures(
    running: RunningServer,
    client: LedgerClient,
    root: Path,
    mixed_run: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, report = verify(running, capsys, mixed_run, "--root", str(root))
    assert code == 1
    assert (report["checked"], report["passed"], report["failed"], report["appended"]) == (
        4,
        1,
        3,
        4,
    )
    reasons = {f["shard_id"]: f["reason"] for f in report["failures"]}
    assert reasons == {
        "s-size": "size_mismatch",
        "s-digest": "digest_mismatch",
        "s-missing": "missing",
    }
    recorded = {
        e.shard_id: (e.attempt_id, e.verified.result, e.verified.reason)
        for e in verdicts(client, mixed_run)
    }
    assert recorded["s-good"] == ("a1", pb.VERIFICATION_RESULT_PASSED, "")
    assert recorded["s-missing"] == ("a1", pb.VERIFICATION_RESULT_FAILED, "missing")
    summary = json.loads(client.summary(mixed_run))
    assert (summary["verified"], summary["verify_failed"]) == (1, 3)


@pytest.mark.timeout(60)
def test_verify_again_is_harmless_and_appends_nothing(
    running: RunningServer,
    client: LedgerClient,
    root: Path,
    mixed_run: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    verify(running, capsys, mixed_run, "--root", str(root))
    before = len(list(client.list_events(mixed_run)))
    code, report = verify(running, capsys, mixed_run, "--root", str(root))
    assert len(list(client.list_events(mixed_run))) == before
    assert (report["checked"], report["skipped"], report["appended"]) == (0, 4, 0)
    assert code == 1  # the earlier failures still stand
    assert report["skipped_failed"] == 3
    main(["verify", mixed_run, "--root", str(root), "--server", f"127.0.0.1:{running.port}"])
    assert (
        "4 skipped as they already have a verdict (3 of them failed: use --recheck to read them"
        " again)" in capsys.readouterr().out
    )


@pytest.mark.timeout(60)
def test_verify_recheck_reads_again_and_records_new_verdicts(
    running: RunningServer,
    client: LedgerClient,
    root: Path,
    mixed_run: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    verify(running, capsys, mixed_run, "--root", str(root))
    (root / "short.bin").write_bytes(b"truncated!")  # the operator restored the file
    code, report = verify(
        running, capsys, mixed_run, "--root", str(root), "--recheck", "--workers", "2"
    )
    assert (report["checked"], report["passed"], report["appended"]) == (4, 2, 4)
    assert len(verdicts(client, mixed_run)) == 8
    assert code == 1
    assert json.loads(client.summary(mixed_run))["verified"] == 2


def test_verify_exits_0_when_every_artifact_passes(
    running: RunningServer, client: LedgerClient, root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for n in range(3):
        data = f"shard {n}\n".encode()
        (root / f"{n}.json").write_text(json.dumps({"n": n}))
        (root / f"{n}.bin").write_bytes(data)
        commit_shard(client, "clean", f"s{n}", f"{n}.bin", data)
    code, report = verify(running, capsys, "clean", "--root", str(root))
    assert code == 0
    assert (report["passed"], report["failed"]) == (3, 0)
    assert json.loads(client.summary("clean"))["completion_rate"] == 1.0


def test_a_commit_another_attempt_overwrote_is_superseded_not_a_digest_mismatch(
    running: RunningServer, client: LedgerClient, root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A retry race: a zombie and its retry rename onto one path.
    first, second = b"zombie's bytes\n", b"retry's bytes\n"
    commit_shard(client, "race", "s0", "out.bin", first)
    started = pb.AttemptStarted(host="h", pid=2, heartbeat_timeout=Duration(seconds=600))
    again = pb.ArtifactCommitted(
        name="out",
        path="out.bin",
        size_bytes=len(second),
        blake3_hex=blake3.blake3(second).hexdigest(),
    )
    client.append(
        [
            pb.ShardEvent(
                event_id="race-s", run_id="race", shard_id="s0", attempt_id="a2", started=started
            ),
            pb.ShardEvent(
                event_id="race-c",
                run_id="race",
                shard_id="s0",
                attempt_id="a2",
                artifact_committed=again,
            ),
        ]
    )
    (root / "out.bin").write_bytes(second)  # what the rename left on disk
    code, report = verify(running, capsys, "race", "--root", str(root))
    assert code == 0, report["failures"]
    assert (report["checked"], report["passed"], report["superseded"]) == (1, 1, 1)
    [verdict] = verdicts(client, "race")
    assert verdict.verified.blake3_hex == blake3.blake3(second).hexdigest()
    assert (
        main(["verify", "race", "--root", str(root), "--server", f"127.0.0.1:{running.port}"]) == 0
    )
    assert "1 superseded by a later commit to the same path" in capsys.readouterr().out


def test_verify_text_output_names_each_failure(
    running: RunningServer, client: LedgerClient, root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    commit_shard(client, "text", "s0", "missing.bin", b"x")
    (root / "here.bin").write_bytes(b"y")
    commit_shard(client, "text", "s1", "here.bin", b"y")
    server = f"127.0.0.1:{running.port}"
    code = main(["verify", "text", "--root", str(root), "--server", server, "--format", "table"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAILED s0 a1 out missing.bin missing: " in out
    assert "2 checked (2 files read), 1 passed, 1 failed" in out
    # Piped (plain, the default off a terminal): one tab-separated row per failure under
    # a header, the count as a "#" note; the verdicts are already recorded, so "earlier".
    assert main(["verify", "text", "--root", str(root), "--server", server]) == 1
    header, *rows, note = capsys.readouterr().out.splitlines()
    assert header.split("\t")[:6] == ["VERDICT", "SHARD", "ATTEMPT", "NAME", "PATH", "REASON"]
    assert [r.split("\t")[:7] for r in rows] == [
        ["FAILED", "s0", "a1", "out", "missing.bin", "missing", "earlier"]
    ]
    assert note.startswith("# verify text: 0 checked") and "2 skipped" in note


def test_verify_with_a_root_that_is_not_a_directory_exits_5(
    running: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("x")
    server = f"127.0.0.1:{running.port}"
    code = main(["verify", "any", "--root", str(tmp_path / "nope"), "--server", server])
    assert code == 5
    assert "does not exist" in capsys.readouterr().err
    assert main(["verify", "any", "--root", str(tmp_path / "file"), "--server", server]) == 5
    assert "is not a directory" in capsys.readouterr().err


def test_a_retried_verdict_has_the_same_id_and_is_stored_once(
    client: LedgerClient, root: Path
) -> None:
    data = b"abc"
    (root / "a.bin").write_bytes(data)
    commit_shard(client, "retry", "s0", "a.bin", data)
    commit = Commit("s0", "a1", "out", "a.bin", 3, blake3.blake3(data).hexdigest(), "", "c1")
    result = CheckResult(passed=True, reason="ok", detail="checked size, blake3")
    first = verdict_event(commit, result, namespace="", run_id="retry", generation=0)
    again = verdict_event(commit, result, namespace="", run_id="retry", generation=0)
    assert first.event_id == again.event_id
    outcomes = [r.outcome for r in client.append([first]) + client.append([again])]
    assert outcomes == [pb.APPEND_OUTCOME_APPENDED, pb.APPEND_OUTCOME_DUPLICATE]
    recheck = verdict_event(commit, result, namespace="", run_id="retry", generation=1)
    assert recheck.event_id != first.event_id
    other_attempt = Commit("s0", "a2", "out", "a.bin", 3, commit.blake3_hex, "", "c2")
    twin = verdict_event(other_attempt, result, namespace="", run_id="retry", generation=0)
    assert (twin.event_id != first.event_id, twin.attempt_id) == (True, "a2")


def test_verify_help_documents_outside_root_and_exit_codes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    out = capsys.readouterr().out
    assert "outside_root" in out and "exit codes:" in out and "--recheck" in out
    assert "record nothing" in out and "Examples:" in out


def test_a_refused_verdict_does_not_cost_the_rest_of_its_batch(
    client: LedgerClient, root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = b"abc"
    commit_shard(client, "race", "s0", "a.bin", data)
    good = Commit("s0", "a1", "out", "a.bin", 3, blake3.blake3(data).hexdigest(), "")
    # As if the job re-committed between the scan and the append: this one was never committed.
    stale = Commit("s0", "a1", "out", "a.bin", 3, "0" * 64, "")
    passed = CheckResult(passed=True, reason="ok", detail="")
    recorder = Recorder(client)
    for commit in (good, stale):
        recorder.add(verdict_event(commit, passed, namespace="", run_id="race", generation=0))
    recorder.flush()
    assert (recorder.appended, recorder.refused) == (1, 1)
    assert "ARTIFACT_NOT_COMMITTED" in capsys.readouterr().err
