"""The sender under the faults a review found: a hung ledger, a spill racing a drain,
an event no ledger could store, a fork, a reused message, a close that cannot finish."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shard_client import LedgerClient, LedgerRejected, Sender
from shard_client.sender import MAX_EVENT_BYTES, new_event_id
from shard_client.spooldir import REJECTED_FILE, drain_spool_dirs
from tests.sdk.test_sender_spool import RUN, Servers, beat, plan, started, stored_ids

pytest_plugins = ["tests.sdk.test_sender_spool"]  # the servers fixture


@pytest.fixture
def hung_target() -> Iterator[str]:
    """Returns an address that accepts connections and never answers (a hung ledger)."""
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)
    yield f"127.0.0.1:{hung.getsockname()[1]}"
    hung.close()


def test_an_overflowing_emit_does_not_wait_for_the_append_in_flight(
    hung_target: str, tmp_path: Path
) -> None:
    # The append hangs for 5 s; the emits below take milliseconds.
    sender = Sender(
        LedgerClient(hung_target, timeout_s=5), spool_root=str(tmp_path), max_queue=5, linger_s=0.01
    )
    first = sender.emit(beat("h", "att", 0))
    deadline = time.monotonic() + 10
    while not sender._gate.locked() and time.monotonic() < deadline:
        time.sleep(0.01)  # wait until the thread is inside its append, holding the gate
    assert sender._gate.locked(), "the sender never started its append"
    acks = [sender.emit(beat("h", "att", i)) for i in range(1, 8)]
    # Every emit returned while the append is still in flight: the overflow (the batch
    # in flight first, as the older) went to disk without waiting for the network.
    assert sender._gate.locked()
    assert first.spooled and any(a.spooled for a in acks)
    sender.close(10)


def test_a_spill_while_the_drain_finds_the_spool_empty_is_still_drained(
    servers: Servers,
) -> None:
    plan(servers.target, "r")
    sender = Sender(LedgerClient(servers.target), max_queue=3, linger_s=0.01)
    acks = [
        sender.emit(e) for e in [started("r", "att")] + [beat("r", "att", i) for i in range(10)]
    ]
    assert any(a.spooled for a in acks)  # the queue overflowed: the spool drains first
    spool = sender._spool
    assert spool is not None
    count = spool.pending_count
    late = [beat("r", "att", 100 + i) for i in range(4)]
    emitter = threading.Thread(target=lambda: [sender.emit(e) for e in late])
    fired = threading.Event()

    def failpoint() -> int:
        # The drain just emptied the spool: another thread emits (and spills) right then.
        n = count()
        if (
            n == 0
            and threading.current_thread().name == "shard_client-sender"
            and not fired.is_set()
        ):
            fired.set()
            emitter.start()  # its 4th emit overflows the queue and spills
            time.sleep(0.3)
        return n

    spool.pending_count = failpoint  # type: ignore[method-assign]
    assert sender.drain(10) and fired.wait(10)
    emitter.join(10)  # the late events were emitted before the newer ones below
    newer = [beat("r", "att", 200 + i) for i in range(2)]
    assert all(sender.emit(e).wait(10) for e in newer)
    assert sender.drain(10)
    ids = stored_ids(servers.target)
    assert all(e.event_id in ids for e in late), "spilled events stranded in the spool"
    assert max(ids.index(e.event_id) for e in late) < min(ids.index(e.event_id) for e in newer)
    sender.close()


def test_an_event_no_ledger_could_store_is_refused_at_emit_and_the_rest_flows(
    servers: Servers, caplog: pytest.LogCaptureFixture
) -> None:
    plan(servers.target, "w")
    sender = Sender(LedgerClient(servers.target), unavailable_after_s=0.3, max_backoff_s=0.2)
    assert sender.emit(started("w", "att")).wait_acknowledged(10)
    big = beat("w", "att", 1)
    big.heartbeat.metrics["x" * (MAX_EVENT_BYTES + 1)] = 1.0
    with caplog.at_level(logging.WARNING, logger="shard_client"):
        refused = sender.emit(big)
    assert refused.settled and refused.outcome == "rejected"
    assert isinstance(refused.error, LedgerRejected) and refused.error.reason == "LIMIT_EXCEEDED"
    ok = sender.emit(beat("w", "att", 2))
    assert ok.wait_acknowledged(10) and sender.drain(10)
    [line] = (Path(sender.spool_dir) / REJECTED_FILE).read_text().splitlines()
    record = json.loads(line)
    assert (record["event_id"], record["reason"]) == (big.event_id, "LIMIT_EXCEEDED")
    assert len(line) < 10_000  # the identity of the event, not its megabytes
    assert "event_rejected" in caplog.text
    assert big.event_id not in stored_ids(servers.target)
    sender.close()


def test_a_forked_child_does_not_keep_the_parents_spool_locked(tmp_path: Path) -> None:
    # A sender whose spool the parent already closed: its old descriptor numbers are
    # reused by the next spool, and the child must not close those a second time.
    done = Sender(
        LedgerClient("127.0.0.1:1"), spool_root=str(tmp_path / "done"), unavailable_after_s=0.1
    )
    assert done.emit(beat("f", "att", 0)).wait(10)
    done.close(2)
    sender = Sender(LedgerClient("127.0.0.1:1"), spool_root=str(tmp_path), unavailable_after_s=0.1)
    ack = sender.emit(beat("f", "att", 1))
    assert ack.wait(10) and ack.spooled  # the parent's spool is open and locked
    read, write = os.pipe()
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a DataLoader-like worker that outlives the parent's use of the spool
        os.close(write)
        # The at-fork hook has run once fork() returns here; until then the child's
        # copies of the descriptors exist (no fork can avoid that instant).
        os.write(ready_write, b"r")
        os.read(read, 1)
        os._exit(0)
    os.close(read)
    os.close(ready_write)
    try:
        assert os.read(ready_read, 1) == b"r"
        os.close(ready_read)
        sender.close(2)  # the parent is done: its event waits for `shardledger spool drain`
        [result] = drain_spool_dirs(sender.spool_dir, target="127.0.0.1:1", connect_timeout_s=0.2)
        assert result.status != "locked"
    finally:
        os.close(write)
        os.waitpid(pid, 0)


def test_a_message_reused_after_emit_is_stored_as_it_was_at_each_emit(
    servers: Servers,
) -> None:
    plan(servers.target, "m")
    sender = Sender(LedgerClient(servers.target))
    assert sender.emit(started("m", "att")).wait_acknowledged(10)
    event = beat("m", "att", 0)
    sent = []
    for step in range(5):
        event.event_id = new_event_id()
        event.heartbeat.step = step
        sent.append((event.event_id, step))
        sender.emit(event)
    assert sender.flush(10)
    stored = [
        (e.event_id, e.heartbeat.step)
        for e in LedgerClient(servers.target).list_events(RUN)
        if e.HasField("heartbeat")
    ]
    assert stored == sent
    sender.close()


def test_close_reports_the_batch_still_in_flight_as_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sender = Sender(
        LedgerClient("127.0.0.1:1"), spool_root=str(tmp_path), policy="block", max_backoff_s=0.2
    )
    for i in range(10):
        sender.emit(beat("b", "att", i))
    deadline = time.monotonic() + 10
    while not sender._inflight and time.monotonic() < deadline:
        time.sleep(0.01)  # the thread took the events as its batch and retries them
    with caplog.at_level(logging.ERROR, logger="shard_client"):
        sender.close(0.5)
    assert "events_lost count=10" in caplog.text


def test_events_are_copied_at_emit_so_the_ack_matches_the_event(servers: Servers) -> None:
    plan(servers.target, "c")
    sender = Sender(LedgerClient(servers.target))
    event = started("c", "att")
    ack = sender.emit(event)
    event.event_id = "changed-after-emit"
    assert ack.wait_acknowledged(10)
    assert ack.event_id in stored_ids(servers.target)
    assert "changed-after-emit" not in stored_ids(servers.target)
    sender.close()


def test_a_call_that_hangs_past_unavailable_after_spools_when_it_fails_not_a_second_later(
    hung_target: str, tmp_path: Path
) -> None:
    # A link that drops packets (tests/contract/test_netns_faults.py): the append hangs for
    # its whole 2 s deadline. That is 2 s without an answer, past unavailable_after_s
    # (1 s), so the event spools as that call fails, instead of after a second hung call.
    sender = Sender(
        LedgerClient(hung_target, timeout_s=2), spool_root=str(tmp_path), unavailable_after_s=1
    )
    began = time.monotonic()
    ack = sender.emit(beat("h", "att", 0))
    assert ack.wait(10)
    took = time.monotonic() - began
    assert ack.spooled
    # One deadline (2 s) and the time to write the spool; a second hung call ends at 4 s.
    assert took < 3.5, f"spooled after {took:.2f} s"
    sender.close(0)
