"""`shardledger archive` and `restore`: a settled run leaves the hot store for a bundle and comes back.

Real servers on loopback over real SQLite files (and PostgreSQL where there is
one), the CLI in process, bundles in a local directory (tests/storage holds the
S3 ones).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ledger_server.archiver import FAILPOINT_ENV, STEPS
from ledger_server.config import ServerConfig
from ledger_server.server import RunningServer, create_server
from ledger_server.store import open_store
from ledger_server.store.base import Store
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from shard_client.errors import LedgerRejected
from tests.builders import DIGEST_A, committed, event, planned, run_cli, started
from tests.pg import pg_cluster, pg_url

__all__ = ["pg_cluster", "pg_url"]

RUN, OPEN_RUN = "night-01", "night-02"
pytestmark = pytest.mark.usefixtures("quiet_logs")


def verified(run_id: str, shard_id: str, attempt_id: str) -> pb.ShardEvent:
    check = pb.ArtifactVerified(
        name="out", path="/out/x", blake3_hex=DIGEST_A, result=pb.VERIFICATION_RESULT_PASSED
    )
    return event(run_id, shard_id, attempt_id, verified=check)


def failed(run_id: str, shard_id: str, attempt_id: str) -> pb.ShardEvent:
    return event(run_id, shard_id, attempt_id, failed=pb.AttemptFailed(tag=pb.FAILURE_TAG_OOM))


def beat(run_id: str, shard_id: str, attempt_id: str, step: int) -> pb.ShardEvent:
    return event(run_id, shard_id, attempt_id, heartbeat=pb.Heartbeat(step=step))


def settled_night(client: LedgerClient, run_id: str, shards: int = 6) -> None:
    """Appends a night that settles: verified, failed and never-started shards, then a close."""
    client.append([planned(run_id, f"s{i}", i) for i in range(shards)])
    for i in range(shards - 1):
        attempt = f"a{i}"
        client.append([started(run_id, f"s{i}", attempt), beat(run_id, f"s{i}", attempt, 1)])
        if i % 3 == 2:
            client.append([failed(run_id, f"s{i}", attempt)])
        else:
            client.append([committed(run_id, f"s{i}", attempt), verified(run_id, f"s{i}", attempt)])
    client.close_submission(run_id, reason="the night is over", expected_shards=shards)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return str(tmp_path / "ledger.db")
    url: str = request.getfixturevalue("pg_url")
    return url


def serve(database: str, tmp_path: Path) -> RunningServer:
    key = str(tmp_path / "ledger.key.pem")
    return create_server(ServerConfig(database=database, listen="127.0.0.1:0", signing_key=key))


@pytest.fixture
def night(database: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Plays a settled night and an open one, then stops the server (a SQLite file has one writer)."""
    running = serve(database, tmp_path)
    client = LedgerClient(f"127.0.0.1:{running.port}", timeout_s=10)
    try:
        settled_night(client, RUN)
        client.append([planned(OPEN_RUN, "s0", 0), started(OPEN_RUN, "s0", "a0")])
        before = {
            "summary": json.loads(client.summary(RUN)),
            "report": client.run_report(RUN).report,
        }
    finally:
        client.close()
        running.stop(0.5)
    yield {"db": database, "key": str(tmp_path / "ledger.key.pem"), **before}


def rows(store: Store, run_id: str) -> list[tuple[Any, ...]]:
    """Returns the run's event rows as stored, every column."""
    run = store.read().get_run("default", run_id)
    assert run is not None
    return [tuple(r) for r in store.read().iter_events(run.run_pk)]


def archive(
    capsys: pytest.CaptureFixture[str], night: dict[str, Any], to: Path, *more: str
) -> tuple[int, str, str]:
    return run_cli(
        capsys,
        "archive",
        *more,
        "--to",
        str(to),
        "--db",
        night["db"],
        "--signing-key",
        night["key"],
    )


def test_archive_moves_a_settled_run_and_restore_brings_it_back_byte_identical(
    night: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = open_store(night["db"])
    original = rows(store, RUN)
    counters = store.read().counters(store.read().get_run("default", RUN).run_pk)  # type: ignore[union-attr]
    store.close()

    code, out, err = archive(capsys, night, tmp_path / "archive", RUN, "--json")
    assert code == 0, err
    outcome = json.loads(out)
    assert outcome["action"] == "archived" and outcome["events"] == len(original)
    bundle = tmp_path / "archive" / "default" / RUN
    assert sorted(p.name for p in bundle.iterdir()) == [
        "events.jsonl",
        "head.json",
        "manifest.json",
    ]
    assert outcome["size_bytes"] == sum(p.stat().st_size for p in bundle.iterdir())

    store = open_store(night["db"])
    run = store.read().get_run("default", RUN)
    assert run is not None and run.archived and run.event_count == len(original)
    assert list(store.read().iter_events(run.run_pk)) == []
    assert list(store.read().iter_shards(run.run_pk)) == []
    store.close()
    # The bundle's events are an export: `import` checks it offline, as an auditor would.
    other = str(tmp_path / "auditor.db")
    code, out, err = run_cli(
        capsys, "import", str(bundle / "events.jsonl"), "--db", other, "--json"
    )
    assert code == 0, err
    assert json.loads(out)["events"] == len(original)
    # A ledger read with no server (--db) reads the bundle too.
    code, out, err = run_cli(capsys, "events", RUN, "--db", night["db"], "--json")
    assert code == 0, err
    assert len(out.splitlines()) == len(original)

    code, out, err = run_cli(capsys, "restore", RUN, "--db", night["db"], "--json")
    assert code == 0, err
    assert json.loads(out)["action"] == "restored"
    store = open_store(night["db"])
    assert rows(store, RUN) == original
    run = store.read().get_run("default", RUN)
    assert run is not None and not run.archived
    assert store.read().counters(run.run_pk) == counters
    store.close()


def test_an_archived_run_answers_reads_from_its_tombstone_and_its_bundle(
    night: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    running = serve(night["db"], tmp_path)
    client = LedgerClient(f"127.0.0.1:{running.port}", timeout_s=10)
    try:
        before_events = [(e.sequence, e.row_hash) for e in client.list_events(RUN)]
        before_shards = [s.view_json for s in client.shards(RUN)]
        before_resume = [(r.shard_id, r.reason) for r in client.resume(RUN)]
    finally:
        client.close()
        running.stop(0.5)
    assert archive(capsys, night, tmp_path / "archive", RUN)[0] == 0

    running = serve(night["db"], tmp_path)
    server = f"127.0.0.1:{running.port}"
    client = LedgerClient(server, timeout_s=10)
    try:
        (info,) = [r for r in client.list_runs() if r.run_id == RUN]
        assert info.archived and info.archive_location.endswith(f"/default/{RUN}")
        summary = json.loads(client.summary(RUN))
        for key in ("verified", "failed", "missing", "submitted", "lifecycle", "event_count"):
            assert summary[key] == night["summary"][key], key
        assert summary["archive"]["location"] == info.archive_location
        assert summary["archive"]["tree_head"]["tree_size"] == summary["event_count"]
        assert client.run_report(RUN).report == night["report"]
        assert [(e.sequence, e.row_hash) for e in client.list_events(RUN)] == before_events
        assert [s.view_json for s in client.shards(RUN)] == before_shards
        assert [(r.shard_id, r.reason) for r in client.resume(RUN)] == before_resume
        with pytest.raises(LedgerRejected) as refused:
            client.append([beat(RUN, "s0", "a0", 2)])
        assert refused.value.reason == "RUN_ARCHIVED"
        code, out, err = run_cli(capsys, "audit", "verify", RUN, "--server", server, "--json")
        assert code == 0, out + err
        some = next(iter(client.list_events(RUN))).event_id
        code, out, err = run_cli(capsys, "audit", "prove", RUN, "--event", some, "--server", server)
        assert code == 0, out + err
        code, out, err = run_cli(
            capsys,
            "audit",
            "replay",
            RUN,
            "--until",
            str(before_events[-1][0]),
            "--server",
            server,
            "--json",
        )
        assert code == 0, out + err
        # Following an archived run streams its bundle and ends: it takes no more events.
        code, out, err = run_cli(capsys, "events", RUN, "--follow", "--server", server, "--json")
        assert code == 0, err
        assert len(out.splitlines()) == len(before_events)
        code, out, _ = run_cli(capsys, "runs", "--server", server, "--json")
        listed = {json.loads(line)["run_id"]: json.loads(line) for line in out.splitlines()}
        assert listed[RUN]["archived"] and not listed[OPEN_RUN]["archived"]
    finally:
        client.close()
        running.stop(0.5)


def test_an_archived_runs_resume_list_and_shards_read_with_spilling_are_the_hot_ones_exactly(
    database: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ledger_server.archive_read import archived_resume, archived_shard_rows

    running = serve(database, tmp_path)
    client = LedgerClient(f"127.0.0.1:{running.port}", timeout_s=10)
    try:
        settled_night(client, RUN, shards=40)
    finally:
        client.close()
        running.stop(0.5)
    at = int(time.time() * 1e6)
    store = open_store(database)
    run = store.read().get_run("default", RUN)
    assert run is not None
    hot_resume = list(store.read().iter_resume(run.run_pk, at))
    hot_shards = [
        (r.shard_id, r.plan_index, r.state, r.detail, r.plan_line)
        for r in store.read().iter_shards(run.run_pk)
    ]
    store.close()
    assert len(hot_resume) == 14 and len(hot_shards) == 40  # 13 failed, 1 never started
    night = {"db": database, "key": str(tmp_path / "ledger.key.pem")}
    assert archive(capsys, night, tmp_path / "archive", RUN)[0] == 0

    store = open_store(database)
    tombstone = store.read().get_tombstone(run.run_pk)
    store.close()
    assert tombstone is not None
    # Three records as objects, the other 37 spilled to the replay's temp file and read back;
    # and (forty shards are under the default bound) all of them as objects.
    assert list(archived_resume(tombstone, at, hot=3)) == hot_resume
    assert list(archived_resume(tombstone, at)) == hot_resume
    archived = [
        (r.shard_id, r.plan_index, r.state, r.detail, r.plan_line)
        for r in archived_shard_rows(tombstone, hot=3)
    ]
    assert archived == hot_shards


def test_one_flipped_byte_in_the_bundle_fails_audit_verify_and_restore(
    night: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert archive(capsys, night, tmp_path / "archive", RUN)[0] == 0
    events = tmp_path / "archive" / "default" / RUN / "events.jsonl"
    pristine = tmp_path / "pristine"
    shutil.copytree(events.parent, pristine / "default" / RUN)
    data = bytearray(events.read_bytes())
    at = data.index(b'"step":1') + len(b'"step":')
    data[at] = ord("7")  # one byte of one row
    events.write_bytes(bytes(data))

    code, out, err = run_cli(capsys, "audit", "verify", RUN, "--db", night["db"], "--json")
    assert code == 1, out + err
    assert "events.jsonl" in out + err
    code, _, err = run_cli(capsys, "restore", RUN, "--db", night["db"])
    assert code == 1 and "events.jsonl" in err and "stays archived" in err

    # A truncated bundle, and a missing one, are named too.
    events.write_bytes(pristine.joinpath("default", RUN, "events.jsonl").read_bytes()[:-40])
    code, out, err = run_cli(capsys, "audit", "verify", RUN, "--db", night["db"], "--json")
    assert code == 1 and "truncated" in out + err
    events.unlink()
    code, out, err = run_cli(capsys, "audit", "verify", RUN, "--db", night["db"], "--json")
    assert code == 1 and "no " in out + err and "events.jsonl" in out + err

    code, _, err = run_cli(capsys, "restore", RUN, "--from", str(pristine), "--db", night["db"])
    assert code == 0, err


def test_open_and_unknown_runs_are_refused_and_nothing_moves(
    night: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = open_store(night["db"])
    kept = rows(store, OPEN_RUN)
    store.close()
    code, out, _ = archive(capsys, night, tmp_path / "archive", OPEN_RUN, "nope", "--json")
    assert code == 1
    refused = {json.loads(line)["run_id"]: json.loads(line) for line in out.splitlines()}
    assert refused[OPEN_RUN]["action"] == "refused" and "not settled" in refused[OPEN_RUN]["reason"]
    assert refused["nope"]["action"] == "refused" and "does not exist" in refused["nope"]["reason"]
    assert not (tmp_path / "archive").exists()
    store = open_store(night["db"])
    assert rows(store, OPEN_RUN) == kept
    store.close()


def test_dry_run_says_what_would_move_and_moves_nothing(
    night: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = archive(capsys, night, tmp_path / "archive", RUN, "--dry-run")
    assert code == 0, err
    assert out.startswith(f"would archive default/{RUN}: ") and " bytes to " in out
    assert not (tmp_path / "archive").exists()
    store = open_store(night["db"])
    run = store.read().get_run("default", RUN)
    assert run is not None and not run.archived and rows(store, RUN)
    store.close()


def test_an_unwritable_location_leaves_the_run_hot_and_says_why(
    night: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the archive should be")
    code, _, err = archive(capsys, night, blocker, RUN)
    assert code == 1 and "cannot write" in err and "stays hot" in err
    store = open_store(night["db"])
    run = store.read().get_run("default", RUN)
    assert run is not None and not run.archived and len(rows(store, RUN)) == run.event_count
    store.close()


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs mounted in tmp_path and filled to its last byte (root: CI runs as root)."""
    mount = tmp_path / "full"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            with pytest.raises(OSError, match="No space left"):
                while True:
                    os.write(fd, b"\0" * 4096)
        finally:
            os.close(fd)
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.parametrize("where", ["archive", "staging"])
def test_a_full_disk_leaves_the_run_hot_and_says_why(
    where: str,
    night: dict[str, Any],
    full_disk: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The archive's file system full, or the one the bundle is staged in (TMPDIR)."""
    import tempfile

    to = full_disk / "archive" if where == "archive" else tmp_path / "archive"
    if where == "staging":
        monkeypatch.setattr(tempfile, "tempdir", str(full_disk))
    code, _, err = archive(capsys, night, to, RUN)
    assert code == 1 and "No space left on device" in err and "stays hot" in err, err
    assert ("cannot write" if where == "archive" else "cannot stage the bundle") in err
    assert state_of(night["db"], RUN) == "hot"
    # Nothing half-written keeps the space: only the filler (and empty directories) remain.
    left = [p for p in full_disk.rglob("*") if p.is_file() and p.name != "filler"]
    assert left == []


def state_of(database: str, run_id: str, *, purged: bool = True) -> str:
    """Returns "hot" or "archived"; fails the test on anything in between.

    purged=False: an archived run may still hold dead rows (a purge cut short).
    """
    store = open_store(database)
    try:
        run = store.read().get_run("default", run_id)
        assert run is not None
        stored = len(rows(store, run_id))
        tombstone = store.read().get_tombstone(run.run_pk)
        if run.archived:
            assert tombstone is not None, "archived without a tombstone"
            assert stored == 0 or not purged, "the purge left event rows"
            return "archived"
        assert tombstone is None and stored == run.event_count, "neither hot nor archived"
        return "hot"
    finally:
        store.close()


@pytest.mark.parametrize("step", STEPS)
def test_a_kill_at_any_step_leaves_the_run_hot_or_archived_and_a_rerun_finishes(
    step: str, night: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    to = tmp_path / "archive"
    argv = ["archive", RUN, "--to", str(to), "--db", night["db"], "--signing-key", night["key"]]
    env = {**os.environ, FAILPOINT_ENV: step}
    killed = subprocess.run(
        [sys.executable, "-m", "shardledger_cli", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    expected = "archived" if step in ("after_commit", "mid_purge") else "hot"
    assert state_of(night["db"], RUN, purged=False) == expected

    code, _, err = run_cli(capsys, *argv)
    if expected == "hot":
        assert code == 0, err
    else:
        assert code == 1 and "archived already" in err
    assert state_of(night["db"], RUN) == "archived"
    code, out, err = run_cli(capsys, "audit", "verify", RUN, "--db", night["db"], "--json")
    assert code == 0, out + err


KILLED_MID_PURGE = """
import sys
from pathlib import Path
from ledger_server.archiver import archive_run
from ledger_server.service import now_us
from ledger_server.signing import SigningKey
from ledger_server.store import open_store
database, key, to = sys.argv[1:]
store = open_store(database)
signing = SigningKey.from_pem(Path(key).read_bytes())
archive_run(store, signing, "default", "night-01", to, now_us=now_us(), purge_chunk=4)
"""


@pytest.mark.parametrize("finisher", ["archive", "restore", "server"])
def test_a_kill_between_purge_chunks_leaves_an_archived_run_that_reads_whole_and_is_finished(
    finisher: str, night: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = open_store(night["db"])
    original = rows(store, RUN)
    whole = len(original) + stored_shards(store, RUN)
    store.close()
    to = tmp_path / "archive"
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_MID_PURGE, night["db"], night["key"], str(to)],
        env={**os.environ, FAILPOINT_ENV: "mid_purge"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert state_of(night["db"], RUN, purged=False) == "archived"
    store = open_store(night["db"])
    left = len(rows(store, RUN)) + stored_shards(store, RUN)
    store.close()
    assert left == whole - 4, "the kill came after one chunk of four rows"

    # Reads answer from the tombstone and the bundle, never from the rows still there.
    code, out, err = run_cli(capsys, "events", RUN, "--db", night["db"], "--json")
    assert code == 0, err
    assert [int(json.loads(line)["sequence"]) for line in out.splitlines()] == [
        r[0] for r in original
    ]
    code, out, err = run_cli(capsys, "audit", "verify", RUN, "--db", night["db"], "--json")
    assert code == 0, out + err
    last = str(original[-1][0])
    code, out, err = run_cli(
        capsys, "audit", "replay", RUN, "--until", last, "--db", night["db"], "--json"
    )
    assert code == 0, out + err
    assert json.loads(out)["summary"]["event_count"] == len(original)
    # status exits 1 for this night's failed and missing shards, archived or not.
    code, out, err = run_cli(capsys, "status", RUN, "--db", night["db"], "--json")
    assert code == 1 and json.loads(out)["missing"] == 1, err
    assert json.loads(out)["archive"]["location"].endswith(f"/default/{RUN}")

    if finisher == "archive":
        code, _, err = archive(capsys, night, to, RUN)
        assert code == 1 and "archived already" in err
        assert state_of(night["db"], RUN) == "archived"
    elif finisher == "restore":
        code, _, err = run_cli(capsys, "restore", RUN, "--db", night["db"])
        assert code == 0, err
        store = open_store(night["db"])
        assert rows(store, RUN) == original
        store.close()
    else:
        config = ServerConfig(
            database=night["db"],
            listen="127.0.0.1:0",
            signing_key=night["key"],
            archive_to=str(to),
            archive_after_s=3600.0,  # nothing else is due: the step only finishes the purge
            archive_every_s=0.05,
        )
        running = create_server(config)
        try:
            wait_for(
                lambda: (
                    state_of(night["db"], RUN, purged=False) == "archived"
                    and not rows_of(night["db"], RUN)
                ),
                "the purge's end",
            )
        finally:
            running.stop(0.5)
        assert state_of(night["db"], RUN) == "archived"


def stored_shards(store: Store, run_id: str) -> int:
    """Returns how many shard rows the run has in the store, whatever its tombstone says."""
    run = store.read().get_run("default", run_id)
    assert run is not None
    return len(list(store.read().iter_shards(run.run_pk)))


def rows_of(database: str, run_id: str) -> list[tuple[Any, ...]]:
    """Returns the run's stored event rows, opening the ledger for the call."""
    store = open_store(database)
    try:
        return rows(store, run_id)
    finally:
        store.close()


def metric(running: RunningServer, name: str) -> float:
    """Returns one sample of the server's /metrics, as Prometheus would scrape it."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{running.metrics_port}/metrics") as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} is not exported")


def wait_for(check: Any, what: str, timeout_s: float = 60.0) -> None:
    """Polls check() until it is true; the deadline only bounds a hung test."""
    import time

    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("writable", [True, False], ids=["archives", "fails"])
def test_the_server_archives_settled_runs_in_the_background_and_counts_it(
    writable: bool, database: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    to = tmp_path / "archive"
    if not writable:
        to.write_text("a file where the archive should be")
    config = ServerConfig(
        database=database,
        listen="127.0.0.1:0",
        signing_key=str(tmp_path / "ledger.key.pem"),
        metrics_listen="127.0.0.1:0",
        archive_to=str(to),
        archive_after_s=0.0,
        archive_every_s=0.05,
    )
    running = create_server(config)
    client = LedgerClient(f"127.0.0.1:{running.port}", timeout_s=10)
    try:
        settled_night(client, RUN)
        client.append([planned(OPEN_RUN, "s0", 0), started(OPEN_RUN, "s0", "a0")])
        if writable:
            wait_for(lambda: metric(running, "shardledger_archive_runs_total") == 1, "the archive")
            (info,) = [r for r in client.list_runs() if r.run_id == RUN]
            assert info.archived
            assert metric(running, "shardledger_archive_bytes_total") > 0
            assert metric(running, "shardledger_archive_last_success_time_seconds") > 0
            assert metric(running, "shardledger_archive_failures_total") == 0
            server = f"127.0.0.1:{running.port}"
            code, out, err = run_cli(capsys, "audit", "verify", RUN, "--server", server)
            assert code == 0, out + err
        else:
            wait_for(lambda: metric(running, "shardledger_archive_failures_total") >= 2, "failures")
            assert metric(running, "shardledger_archive_runs_total") == 0
            assert metric(running, "shardledger_archive_last_failure_time_seconds") > 0
            assert not any(r.archived for r in client.list_runs())
        # The open run is never archived, and takes appends throughout.
        client.append([beat(OPEN_RUN, "s0", "a0", 1)])
        (info,) = [r for r in client.list_runs() if r.run_id == OPEN_RUN]
        assert not info.archived
    finally:
        client.close()
        running.stop(0.5)


def test_db_rebuild_leaves_archived_runs_out_and_says_why_when_named(
    night: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert archive(capsys, night, tmp_path / "archive", RUN)[0] == 0
    code, out, err = run_cli(capsys, "db", "rebuild", "--check", "--db", night["db"], "--json")
    assert code == 0, out + err
    assert RUN not in out and OPEN_RUN in out
    code, _, err = run_cli(capsys, "db", "rebuild", "--run", RUN, "--check", "--db", night["db"])
    assert code == 5 and "is archived" in err


@pytest.mark.parametrize("step", ["before_upload", "mid_transaction", "after_commit", "mid_purge"])
def test_a_server_killed_while_it_archives_restarts_with_the_run_hot_or_archived(
    step: str, night: dict[str, Any], tmp_path: Path
) -> None:
    """The server's retention: a failpoint in its child (the bundle) or in itself (the commit)."""
    import time

    def start(failpoint: str) -> tuple[subprocess.Popen[bytes], Path]:
        port_file = tmp_path / f"port-{failpoint or 'none'}"
        command = [sys.executable, "-m", "shardledger_cli", "serve", "--db", night["db"]]
        command += ["--listen", "127.0.0.1:0", "--port-file", str(port_file)]
        command += ["--signing-key", night["key"], "--log-level", "warning"]
        command += ["--archive-to", str(tmp_path / "archive"), "--archive-after", "0s"]
        command += ["--archive-every", "0.1"]
        env = {**os.environ, FAILPOINT_ENV: failpoint}
        return subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL), port_file

    server, _ = start(step)
    deadline = time.monotonic() + 60
    if step == "before_upload":
        # The bundle's child dies; the server lives on, counting the failure: stop it so.
        time.sleep(3)
        assert server.poll() is None
        server.send_signal(signal.SIGKILL)
    assert server.wait(deadline - time.monotonic()) == -signal.SIGKILL
    expected = "archived" if step in ("after_commit", "mid_purge") else "hot"
    assert state_of(night["db"], RUN, purged=False) == expected

    def archived() -> bool:
        store = open_store(night["db"])
        try:
            run = store.read().get_run("default", RUN)
            return run is not None and run.archived and not rows(store, RUN)
        finally:
            store.close()

    server, port_file = start("")
    try:
        wait_for(lambda: port_file.exists(), "the restarted server")
        wait_for(archived, "the archive after restart")
    finally:
        server.terminate()
        server.wait(30)
    assert state_of(night["db"], RUN) == "archived"


def test_a_namespace_kept_hot_by_policy_is_never_archived(tmp_path: Path) -> None:
    config = ServerConfig(
        database=str(tmp_path / "ledger.db"),
        listen="127.0.0.1:0",
        signing_key=str(tmp_path / "ledger.key.pem"),
        metrics_listen="127.0.0.1:0",
        archive_to=str(tmp_path / "archive"),
        archive_after_s=0.0,
        archive_every_s=0.05,
        archive_namespaces=(("keep", None),),
    )
    running = create_server(config)
    client = LedgerClient(f"127.0.0.1:{running.port}", timeout_s=10)
    try:
        kept = [planned(RUN, "s0", 0)]
        for ev in kept:
            ev.namespace = "keep"
        client.append(kept)
        client.close_submission(RUN, namespace="keep", expected_shards=1)
        settled_night(client, RUN)  # the same run id in the default namespace
        wait_for(lambda: metric(running, "shardledger_archive_runs_total") == 1, "the archive")
        listed = [*client.list_runs(), *client.list_runs(namespace="keep")]
        archived = {(r.namespace, r.run_id): r.archived for r in listed}
        assert archived == {("default", RUN): True, ("keep", RUN): False}
        # Steps go on finding nothing due: the kept run stays hot.
        time.sleep(0.3)
        assert metric(running, "shardledger_archive_runs_total") == 1
        assert not json.loads(client.summary(RUN, namespace="keep")).get("archive")
    finally:
        client.close()
        running.stop(0.5)


def test_namespace_policies_parse_and_bad_ones_are_refused() -> None:
    from ledger_server.retention import RetentionPolicy, parse_namespace_policy

    assert parse_namespace_policy("audit=90d") == ("audit", 90 * 86400.0)
    assert parse_namespace_policy("keep=never") == ("keep", None)
    for bad in ("audit", "=7d", "audit=soon"):
        with pytest.raises(ValueError, match=r"NAMESPACE=DURATION|not a duration"):
            parse_namespace_policy(bad)
    policy = RetentionPolicy(7 * 86400.0, "/a", per_namespace=(("keep", None), ("audit", 1.0)))
    assert (policy.after_for("keep"), policy.after_for("audit")) == (None, 1.0)
    assert policy.after_for("default") == 7 * 86400.0
