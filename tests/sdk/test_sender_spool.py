"""The batching sender and the durable spool: the ledger blinks, the job runs on, nothing is lost or doubled."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.duration_pb2 import Duration

from ledger_server.config import ServerConfig
from ledger_server.server import RunningServer, create_server
from shard_client import (
    Ledger,
    LedgerClient,
    LedgerUnavailable,
    LifecycleError,
    PlanEntry,
    Sender,
    backoff,
)
from shard_client import plan_events as make_plan_events
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.options import ShardOptionKwargs
from shard_client.spool import Spool
from shard_client.spooldir import drain_spool_dirs
from shardledger_cli.cli import main as cli

REPO = Path(__file__).resolve().parents[2]
RUN = "night-02"


class Servers:
    """Starts (and restarts, on the same port) real servers over one SQLite file."""

    def __init__(self, db: Path) -> None:
        self.db = db
        self.port = 0
        self.running: RunningServer | None = None

    @property
    def target(self) -> str:
        """Returns the address, stable across restarts."""
        return f"127.0.0.1:{self.port}"

    def start(self) -> RunningServer:
        """Starts the server, on the port it had before if it ran already."""
        self.running = create_server(
            ServerConfig(database=str(self.db), listen=f"127.0.0.1:{self.port}")
        )
        self.port = self.running.port
        return self.running

    def stop(self) -> None:
        """Stops the server (the database file stays)."""
        if self.running is not None:
            self.running.stop(0)
            self.running = None


@pytest.fixture
def servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Servers]:
    """Returns a started server that a test may stop and restart."""
    monkeypatch.setenv("SHARDLEDGER_SPOOL_DIR", str(tmp_path / "spool"))
    s = Servers(tmp_path / "ledger.db")
    s.start()
    yield s
    s.stop()


def plan(target: str, *shard_ids: str) -> None:
    """Registers shards in RUN."""
    entries = [
        PlanEntry(
            shard_id=s, input_ref=f"/in/{s}", input_bytes=1, input_blake3="ab" * 32, plan_index=i
        )
        for i, s in enumerate(shard_ids)
    ]
    LedgerClient(target).append(make_plan_events(RUN, entries))


def raw(shard_id: str, attempt_id: str, **payload: Any) -> pb.ShardEvent:
    """Returns an attempt event with a fresh id."""
    return pb.ShardEvent(
        event_id=uuid.uuid4().hex, run_id=RUN, shard_id=shard_id, attempt_id=attempt_id, **payload
    )


def started(shard_id: str, attempt_id: str) -> pb.ShardEvent:
    """Returns a started event."""
    timeout = Duration(seconds=600)
    return raw(
        shard_id, attempt_id, started=pb.AttemptStarted(host="h", pid=1, heartbeat_timeout=timeout)
    )


def beat(shard_id: str, attempt_id: str, step: int) -> pb.ShardEvent:
    """Returns a heartbeat event."""
    return raw(shard_id, attempt_id, heartbeat=pb.Heartbeat(step=step))


def stored_ids(target: str) -> list[str]:
    """Returns the event ids of RUN in ledger order."""
    return [e.event_id for e in LedgerClient(target).list_events(RUN)]


def test_server_restart_mid_job_delivers_every_event_exactly_once_in_order(
    servers: Servers, tmp_path: Path
) -> None:
    plan(servers.target, "a")
    ledger = Ledger(servers.target, unavailable_after_s=0.3)
    emitted: list[str] = []
    # Every progress() call one event: the test counts deliveries, not heartbeats.
    options: ShardOptionKwargs = {
        "heartbeat_timeout": 600,
        "fingerprint": False,
        "coalesce_progress": False,
    }
    with ledger.shard(RUN, "a", **options) as shard:
        emitted.append(shard.attempt_id)
        for step in range(300):
            emitted.append(shard.progress(step, step / 300).event_id)
            time.sleep(0.002)
            if step == 100:
                servers.stop()
            if step == 200:
                begin = time.monotonic()
                with shard.atomic_write(tmp_path / "out.bin") as f:
                    f.write(b"written while the ledger was down")
                assert time.monotonic() - begin < 5  # spooled, not stuck
            if step == 250:
                servers.start()
    assert ledger.sender.drain(timeout=30)
    ledger.close()
    events = list(LedgerClient(servers.target).list_events(RUN))
    ids = [e.event_id for e in events]
    assert len(ids) == len(set(ids)) == 1 + 1 + 300 + 1  # plan, started, progress, artifact
    assert [e.attempt_id for e in events[1:2]] == [emitted[0]]
    assert [i for i in ids if i in set(emitted[1:])] == emitted[1:]
    steps = [e.heartbeat.step for e in events if e.HasField("heartbeat")]
    assert steps == list(range(300))
    kinds = [e.WhichOneof("payload") for e in events]
    assert kinds.index("artifact_committed") == 2 + 201  # after the step-200 heartbeat
    assert not os.path.exists(ledger.sender.spool_dir)  # drained and cleaned up


class CountingClient(LedgerClient):
    """A LedgerClient that records the size of every append."""

    def __init__(self, target: str) -> None:
        super().__init__(target)
        self.batches: list[int] = []

    def append(
        self,
        events: Sequence[pb.ShardEvent],
        *,
        retry: bool = True,
        deadline_s: float | None = None,
    ) -> list[pb.AppendResult]:
        self.batches.append(len(events))
        return super().append(events, retry=retry, deadline_s=deadline_s)


def test_events_of_concurrent_shards_are_coalesced_into_few_appends(servers: Servers) -> None:
    shards = [f"c{i}" for i in range(8)]
    plan(servers.target, *shards)
    client = CountingClient(servers.target)
    ledger = Ledger(client=client)

    def work(shard_id: str) -> None:
        with ledger.shard(RUN, shard_id, fingerprint=False, coalesce_progress=False) as shard:
            for step in range(250):
                shard.progress(step)
            shard.commit(_touch(servers.db.parent / f"{shard_id}.out"))

    threads = [threading.Thread(target=work, args=(s,)) for s in shards]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ledger.close()
    assert sum(client.batches) >= 8 * 252
    assert max(client.batches) > 100 and len(client.batches) < 200


def _touch(path: Path) -> Path:
    path.write_bytes(b"x")
    return path


def test_refused_event_is_set_aside_and_the_rest_of_its_batch_is_stored(
    servers: Servers, caplog: pytest.LogCaptureFixture
) -> None:
    plan(servers.target, "r")
    sender = Sender(LedgerClient(servers.target), linger_s=0.2)
    events = [
        started("r", "att"),
        beat("r", "att", 1),
        beat("r", "never-started", 2),
        beat("r", "att", 3),
    ]
    with caplog.at_level(logging.WARNING, logger="shard_client"):
        acks = [sender.emit(e) for e in events]
        assert sender.flush(10)
    assert [a.outcome for a in acks] == ["appended", "appended", "rejected", "appended"]
    with pytest.raises(LifecycleError):
        acks[2].result()
    assert stored_ids(servers.target)[1:] == [events[i].event_id for i in (0, 1, 3)]
    assert "event_rejected" in caplog.text
    [line] = (Path(sender.spool_dir) / "rejected.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert (record["event_id"], record["reason"]) == (events[2].event_id, "ATTEMPT_NOT_STARTED")
    sender.close()


def test_queue_overflow_spills_to_the_spool_without_blocking_and_keeps_order(
    servers: Servers,
) -> None:
    plan(servers.target, "o")
    sender = Sender(LedgerClient(servers.target), max_queue=20, linger_s=0.2)
    events = [started("o", "att")] + [beat("o", "att", i) for i in range(500)]
    # That emit never waits for the network is proven without a clock in
    # test_sender_faults (an overflow while the append in flight hangs).
    acks = [sender.emit(e) for e in events]
    assert any(a.spooled for a in acks)  # some went to disk, none were dropped
    assert sender.drain(30)
    assert all(a.acknowledged for a in acks)
    assert stored_ids(servers.target)[1:] == [e.event_id for e in events]
    sender.close()


def test_policy_raise_fails_the_acks_and_then_emit_raises(tmp_path: Path) -> None:
    sender = Sender(
        LedgerClient("127.0.0.1:1"),
        policy="raise",
        unavailable_after_s=0.2,
        spool_root=str(tmp_path),
    )
    ack = sender.emit(beat("x", "att", 1))
    with pytest.raises(LedgerUnavailable):
        ack.result(10)
    assert ack.outcome == "failed"
    with pytest.raises(LedgerUnavailable):
        sender.emit(beat("x", "att", 2))
    sender.close()
    assert not os.listdir(tmp_path)


def test_retries_wait_jittered_delays_that_double_so_refused_jobs_spread_out(
    tmp_path: Path,
) -> None:
    """Jobs refused together (an overloaded or restarting ledger) must not retry in step."""
    asked: list[float] = []
    lock = threading.Lock()

    def jittered(delay_s: float) -> float:
        # This sender's own jitter: senders of earlier tests still retrying in this
        # process (and every client's RPC retries) draw from backoff.jittered, never here.
        with lock:
            asked.append(delay_s)
        return backoff.jittered(delay_s, draw=lambda: 0.0)  # the shortest wait it can draw

    sender = Sender(
        LedgerClient("127.0.0.1:1"),
        policy="block",
        max_backoff_s=0.4,
        spool_root=str(tmp_path),
        jitter=jittered,
    )

    def waits() -> list[float]:
        with lock:
            return list(asked)

    ack = sender.emit(beat("x", "att", 1))
    deadline = time.monotonic() + 60
    while 0.4 not in waits() and time.monotonic() < deadline:
        time.sleep(0.05)
    seen = waits()
    assert not ack.acknowledged
    sender.close(timeout=0.1)
    # Every wait is jittered, from the first delay, doubling up to the cap.
    first = backoff.FIRST_DELAY_S
    assert seen[:4] == [first, 2 * first, 4 * first, 8 * first], seen
    assert seen == sorted(seen) and max(seen) == 0.4, seen


def test_policy_block_holds_events_until_the_ledger_returns(servers: Servers) -> None:
    plan(servers.target, "b")
    sender = Sender(LedgerClient(servers.target), policy="block", max_backoff_s=0.2)
    sender.emit(started("b", "att")).result(10)
    servers.stop()
    ack = sender.emit(beat("b", "att", 1))
    assert not ack.wait(0.5) and not sender.flush(0.1)
    servers.start()
    assert ack.wait(20) and ack.acknowledged and not ack.spooled
    assert not os.path.exists(sender.spool_dir)
    sender.close()


JOB = """
import sys
from shard_client import Ledger
ledger = Ledger(unavailable_after_s=0.2)
with ledger.shard({run!r}, "left", fingerprint=False, coalesce_progress=False) as shard:
    for step in range(20):
        shard.progress(step)
    with shard.atomic_write("left.out") as f:
        f.write(b"done while the ledger was away")
print(ledger.sender.spool_dir)
"""


def test_spool_of_a_job_that_ended_during_an_outage_is_drained_by_the_cli(
    servers: Servers, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan(servers.target, "left")
    target = servers.target
    servers.stop()
    spool_root = tmp_path / "job-spool"
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        SHARDLEDGER_SERVER=target,
        SHARDLEDGER_SPOOL_DIR=str(spool_root),
        SHARDLEDGER_EXIT_WAIT="0.5",  # the ledger stays down: no point waiting for it
    )
    job = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(JOB.format(run=RUN))],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert job.returncode == 0, job.stderr  # the job never dies because the ledger blinked
    spool_dir = job.stdout.strip()
    assert Path(spool_dir).parent == spool_root

    assert cli(["spool", "status", "--dir", str(spool_root), "--json"]) == 0
    [status] = map(json.loads, capsys.readouterr().out.splitlines())
    assert status["pending"] == 1 + 20 + 1 and status["target"] == target and status["oldest"]

    assert cli(["spool", "drain", "--dir", str(spool_root), "--timeout", "0.5"]) == 3
    capsys.readouterr()
    servers.start()
    assert cli(["spool", "drain", "--dir", str(spool_root), "--json"]) == 0
    [result] = map(json.loads, capsys.readouterr().out.splitlines())
    assert (result["sent"], result["rejected"], result["status"]) == (22, 0, "drained")
    assert not os.path.exists(spool_dir)
    shards = {s.shard_id: s.state for s in LedgerClient(target).shards(RUN)}
    assert shards == {"left": "unverified"}


def test_a_damaged_spool_is_named_and_the_others_are_still_drained(
    servers: Servers, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan(servers.target, "d")
    root = tmp_path / "spools"
    for name, records in (
        ("host-1-bad", [beat("d", "att", 9)]),
        ("host-2-good", [started("d", "att")]),
    ):
        with Spool(root / name) as spool:
            spool.append([e.SerializeToString() for e in records])
        (root / name / "target").write_text(servers.target + "\n")
    (root / "host-1-bad" / "acked").write_text("garbage\n")

    assert cli(["spool", "status", "--dir", str(root), "--format", "table"]) == 1
    out = capsys.readouterr().out
    assert f"{root / 'host-1-bad'}: DAMAGED" in out and f"{root / 'host-2-good'}: 1 pending" in out
    # Piped (plain): one tab-separated row a directory, the damaged one with its error.
    assert cli(["spool", "status", "--dir", str(root)]) == 1
    header, *lines = capsys.readouterr().out.splitlines()
    rows = {
        Path(line.split("\t")[0]).name: dict(zip(header.split("\t"), line.split("\t"), strict=True))
        for line in lines
    }
    assert rows["host-1-bad"]["ERROR"] and not rows["host-2-good"]["ERROR"], rows
    assert (rows["host-2-good"]["PENDING"], rows["host-2-good"]["TARGET"]) == ("1", servers.target)
    assert cli(["spool", "drain", "--dir", str(root), "--json"]) == 1
    results = {
        Path(r["directory"]).name: r for r in map(json.loads, capsys.readouterr().out.splitlines())
    }
    assert results["host-1-bad"]["status"] == "damaged" and results["host-1-bad"]["error"]
    assert (results["host-2-good"]["sent"], results["host-2-good"]["status"]) == (1, "drained")
    assert (root / "host-1-bad" / "acked").read_text() == "garbage\n"  # left for an operator


def test_a_drain_the_ledger_denies_says_so_exits_4_and_keeps_the_events(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SHARDLEDGER_TOKEN", raising=False)
    running = create_server(
        ServerConfig(database=str(tmp_path / "l.db"), listen="127.0.0.1:0", auth="tokens")
    )
    target = f"127.0.0.1:{running.port}"
    root = tmp_path / "spools"
    try:
        for name in ("host-1-a", "host-2-b"):
            with Spool(root / name) as spool:
                spool.append([beat("d", "att", 1).SerializeToString()])
            (root / name / "target").write_text(target + "\n")
        assert cli(["spool", "drain", "--dir", str(root)]) == 4
    finally:
        running.stop(0.5)
    captured = capsys.readouterr()
    assert captured.out.count("1 left, the ledger DENIED access") == 2
    assert "a writer token is needed" in captured.err and "unreachable" not in captured.err
    for name in ("host-1-a", "host-2-b"):
        with Spool(root / name) as spool:
            assert spool.pending_count() == 1


def test_leftover_spool_with_a_refused_event_sets_it_aside_and_acks_it(
    servers: Servers, tmp_path: Path
) -> None:
    plan(servers.target, "a")
    directory = tmp_path / "leftover" / "host-1-abc"
    records = [
        started("a", "att"),
        beat("a", "att", 1),
        beat("unplanned", "att", 2),
        beat("a", "att", 3),
    ]
    with Spool(directory) as spool:
        spool.append([e.SerializeToString() for e in records])
    (directory / "target").write_text(servers.target + "\n")
    [result] = drain_spool_dirs(str(tmp_path / "leftover"))
    assert (result.sent, result.rejected, result.remaining, result.status) == (3, 1, 0, "drained")
    [line] = (directory / "rejected.jsonl").read_text().splitlines()
    assert json.loads(line)["reason"] == "SHARD_NOT_PLANNED"
    assert stored_ids(servers.target)[1:] == [records[i].event_id for i in (0, 1, 3)]
    # Draining again sends nothing twice.
    [again] = drain_spool_dirs(str(tmp_path / "leftover"))
    assert (again.sent, again.rejected) == (0, 0)


def test_drain_skips_a_spool_that_a_live_process_still_owns(
    servers: Servers, tmp_path: Path
) -> None:
    directory = tmp_path / "live" / "host-2-def"
    with Spool(directory) as spool:
        spool.append([beat("a", "att", 1).SerializeToString()])
        [result] = drain_spool_dirs(str(tmp_path / "live"), target=servers.target)
        assert result.status == "locked"
        assert spool.pending_count() == 1
