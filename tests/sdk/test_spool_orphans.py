"""Spools never hide events: the exit waits a bounded time, and the next SDK process drains
what a job left while the ledger was away, without anyone running `spool drain` (issue 17, 6)."""

from __future__ import annotations

import logging
import os
import re
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from shard_client import Ledger, LedgerClient, Sender, drain_spool_dirs
from shard_client.orphans import OrphanDrainer
from shard_client.sender import exit_wait_from_env
from shard_client.spool import Spool
from shard_client.spooldir import find_spool_dirs
from tests.sdk.test_sender_spool import RUN, Servers, beat, plan, started

pytest_plugins = ["tests.sdk.test_sender_spool"]  # the servers fixture

REPO = Path(__file__).resolve().parents[2]

JOB = """
import sys
from shard_client import Ledger

ledger = Ledger(unavailable_after_s=0.2)
with ledger.shard({run!r}, sys.argv[1], fingerprint=False, coalesce_progress=False) as shard:
    for step in range(5):
        shard.progress(step, step / 5, loss=1.0)
    with shard.atomic_write(sys.argv[1] + ".out") as f:
        f.write(b"result")
print(ledger.sender.spool_dir)
"""


def run_job(
    shard_id: str, target: str, tmp_path: Path, *, exit_wait: str
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Runs one job process on the shared spool root; returns it and its wall time."""
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        SHARDLEDGER_SERVER=target,
        SHARDLEDGER_SPOOL_DIR=str(tmp_path / "node-spool"),
        SHARDLEDGER_EXIT_WAIT=exit_wait,
    )
    began = time.monotonic()
    job = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(JOB.format(run=RUN)), shard_id],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return job, time.monotonic() - began


def states(target: str) -> dict[str, str]:
    """Returns each shard's state as `shardledger status` counts it."""
    return {s.shard_id: s.state for s in LedgerClient(target).shards(RUN)}


def test_the_next_job_drains_what_a_job_left_during_an_outage_without_being_asked(
    servers: Servers, tmp_path: Path
) -> None:
    plan(servers.target, "first", "second")
    target = servers.target
    servers.stop()
    first, took = run_job("first", target, tmp_path, exit_wait="60")
    assert first.returncode == 0, first.stderr  # the outage never fails the job
    spool_dir = first.stdout.strip()
    # Nothing listens, so the job did not wait its exit wait (60 s) for an answer that
    # cannot come; it said where its events are and what drains them.
    assert took < 30
    [line] = [x for x in first.stderr.splitlines() if "events_spooled" in x]
    assert f"count=7 directory={spool_dir}:" in line  # started, 5 heartbeats, the commit
    assert f"no ledger answers at {target} (nothing waited for)" in line
    assert f"shardledger spool drain --dir {spool_dir}" in line
    assert find_spool_dirs(str(tmp_path / "node-spool")) == [spool_dir]

    servers.start()
    assert states(target) == {"first": "missing", "second": "missing"}  # what status showed
    second, _ = run_job("second", target, tmp_path, exit_wait="10")
    assert second.returncode == 0, second.stderr
    # Nobody ran `shardledger spool drain`: the second job's SDK sent the first one's spool.
    assert states(target) == {"first": "unverified", "second": "unverified"}
    assert not os.path.exists(spool_dir)
    assert "events_spooled" not in second.stderr


def test_spooled_events_keep_the_client_time_they_were_created_with(
    servers: Servers, tmp_path: Path
) -> None:
    plan(servers.target, "late")
    target = servers.target
    servers.stop()
    job, _ = run_job("late", target, tmp_path, exit_wait="0")
    assert job.returncode == 0, job.stderr
    ended = time.time()
    time.sleep(1.0)
    servers.start()
    ledger = Ledger(target, spool_dir=str(tmp_path / "node-spool"), exit_wait_s=10)
    ledger.emit(started("late", "probe")).wait_acknowledged(10)  # starts the sender and its drain
    assert ledger.sender.orphans is not None and ledger.sender.orphans.join(30)
    ledger.close()
    events = [e for e in LedgerClient(target).list_events(RUN) if e.attempt_id != "probe"]
    attempts = [e for e in events if e.attempt_id]
    assert len(attempts) == 7
    for event in attempts:
        client_s = event.client_time.ToNanoseconds() / 1e9
        assert client_s <= ended < event.receive_time.ToNanoseconds() / 1e9 - 0.5


def test_close_waits_for_a_slow_ledger_that_answers_within_the_exit_wait(
    servers: Servers, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plan(servers.target, "w")
    # Another writer holds the database: the ledger takes calls but cannot commit them,
    # so they end at their deadline (slow, not unreachable) until the writer lets go.
    holder = sqlite3.connect(servers.db, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")
    sender = Sender(
        LedgerClient(servers.target, timeout_s=1),
        spool_root=str(tmp_path / "spool"),
        unavailable_after_s=0.1,
        max_backoff_s=0.3,
        exit_wait_s=60,
    )
    acks = [sender.emit(started("w", "att"))] + [sender.emit(beat("w", "att", i)) for i in range(3)]
    assert all(a.wait(30) and a.spooled for a in acks)
    assert not sender._unreachable  # the ledger answered, slowly: close() must wait for it
    threading.Timer(1.0, holder.rollback).start()
    with caplog.at_level(logging.WARNING, logger="shard_client"):
        sender.close()
    holder.close()
    assert all(a.acknowledged for a in acks)
    assert "events_spooled" not in caplog.text
    assert not os.path.exists(sender.spool_dir)


def test_close_returns_at_once_when_no_ledger_listens_and_every_event_is_spooled(
    servers: Servers, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plan(servers.target, "w")
    servers.stop()
    # unavailable_after_s and the exit wait far longer than the test: a refused connection
    # spools at once, and close() finds the ledger still refusing and does not wait.
    sender = Sender(
        LedgerClient(servers.target),
        spool_root=str(tmp_path / "spool"),
        unavailable_after_s=120,
        exit_wait_s=120,
    )
    acks = [sender.emit(started("w", "att"))] + [sender.emit(beat("w", "att", i)) for i in range(3)]
    assert all(a.wait(60) and a.spooled for a in acks)
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="shard_client"):
        sender.close()
    assert time.monotonic() - began < 60
    assert "events_spooled count=4" in caplog.text
    assert "nothing waited for" in caplog.text
    # Every event is in the spool, and the next process delivers it.
    with Spool(sender.spool_dir) as left:
        assert left.pending_count() == 4
    servers.start()
    [result] = drain_spool_dirs(str(tmp_path / "spool"))
    assert result.status == "drained", result
    stored = {e.event_id for e in LedgerClient(servers.target).list_events(RUN)}
    assert stored >= {a.event_id for a in acks}


def test_the_background_drain_leaves_a_live_owners_spool_and_other_ledgers_spools(
    servers: Servers, tmp_path: Path
) -> None:
    plan(servers.target, "o")
    root = tmp_path / "spools"
    live = Spool(root / "host-1-live")
    live.append([started("o", "a1").SerializeToString()])
    (root / "host-1-live" / "target").write_text(servers.target + "\n")
    with Spool(root / "host-2-elsewhere") as other:
        other.append([started("o", "a2").SerializeToString()])
    (root / "host-2-elsewhere" / "target").write_text("127.0.0.1:1\n")
    with Spool(root / "host-3-dead") as dead:
        dead.append([started("o", "a3").SerializeToString()])
    (root / "host-3-dead" / "target").write_text(servers.target + "\n")
    try:
        client = LedgerClient(servers.target)
        drainer = OrphanDrainer(root=str(root), client=client, exclude="").start()
        assert drainer.join(30)
        assert {Path(r.directory).name: r.status for r in drainer.results} == {
            "host-1-live": "locked",
            "host-3-dead": "drained",
        }
        assert live.pending_count() == 1
        assert [e.attempt_id for e in client.list_events(RUN) if e.attempt_id] == ["a3"]
        with Spool(root / "host-2-elsewhere") as untouched:
            assert untouched.pending_count() == 1
    finally:
        live.close()


def test_the_background_drain_gives_up_after_bounded_attempts_and_says_how_to_drain(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "spools"
    with Spool(root / "host-1-dead") as dead:
        dead.append([beat("x", "a", 1).SerializeToString()])
    (root / "host-1-dead" / "target").write_text("127.0.0.1:1\n")
    drainer = OrphanDrainer(
        root=str(root),
        client=LedgerClient("127.0.0.1:1"),
        exclude="",
        attempts=3,
        first_delay_s=0.05,
        max_delay_s=0.1,
    )
    with caplog.at_level(logging.WARNING, logger="shard_client"):
        assert drainer.start().join(30)
    [line] = [r.getMessage() for r in caplog.records if "orphan_spools_left" in r.getMessage()]
    assert "after 3 attempts" in line and f"shardledger spool drain --dir {root}" in line
    with Spool(root / "host-1-dead") as kept:
        assert kept.pending_count() == 1


@pytest.mark.parametrize(("text", "expected"), [("", 10.0), ("0", 0.0), ("2.5", 2.5)])
def test_exit_wait_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, text: str, expected: float
) -> None:
    monkeypatch.setenv("SHARDLEDGER_EXIT_WAIT", text)
    assert exit_wait_from_env() == expected


@pytest.mark.parametrize("text", ["soon", "-1", "inf", "nan"])
def test_a_malformed_exit_wait_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv("SHARDLEDGER_EXIT_WAIT", text)
    with pytest.raises(ValueError, match=re.escape("$SHARDLEDGER_EXIT_WAIT must be a number")):
        Ledger("127.0.0.1:1")
