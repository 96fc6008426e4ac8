"""Admission past capacity: appends refused at once with a delay, reads answered, nothing lost.

The group committer's next transaction is held (only the writer thread's, so no
SQLite lock is taken and reads go on), which keeps one append waiting: with an
admission bound of one event, every other append is then refused, by rule and not
by timing.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from ledger_server.admission import LOOP_PROBES, MAX_RETRY_S, Admission
from ledger_server.aio import AioServer
from ledger_server.config import ServerConfig
from ledger_server.errors import Overloaded
from ledger_server.server import RunningServer, create_server
from shard_client import Ack, LedgerClient, Sender, backoff
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.api.shardledger.v1 import ledger_pb2_grpc as pb_grpc
from tests.builders import event, planned, run_cli, started
from tests.server.test_metrics import scrape, scrape_until

RUN = "run-1"
SHARDS = [f"shard-{i}" for i in range(8)]
LAG = ("shardledger_event_loop_lag_seconds", ())


class WriterGate:
    """Holds the group committer's next write transaction until opened."""

    def __init__(self, running: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()
        store = running.ledger.store
        write = store.write

        def gated() -> Any:
            if threading.current_thread().name == "ledger-writer" and not self.opened.is_set():
                self.entered.set()
                self.opened.wait()
            return write()

        monkeypatch.setattr(store, "write", gated)


@pytest.fixture
def tight(tmp_path: Path) -> Iterator[RunningServer]:
    """Returns a server that admits one event at a time into its commit queue."""
    config = ServerConfig(
        database=str(tmp_path / "ledger.db"),
        listen="127.0.0.1:0",
        admission_delay_s=1e-9,
        admission_min_events=1,
    )
    running = create_server(config)
    yield running
    running.stop(0.5)


def _target(running: RunningServer) -> str:
    return f"127.0.0.1:{running.port}"


def _plan(target: str) -> None:
    client = LedgerClient(target)
    client.append([planned(RUN, s, i) for i, s in enumerate(SHARDS)])
    client.close()


def _hold_one_append(running: RunningServer, gate: WriterGate) -> threading.Thread:
    """Starts an append that the gate holds in the commit queue; returns its thread."""
    client = LedgerClient(_target(running), timeout_s=60)
    held = threading.Thread(target=client.append, args=([started(RUN, SHARDS[0])],))
    held.start()
    assert gate.entered.wait(60)
    return held


def _refusal(call: Callable[[], object]) -> tuple[grpc.StatusCode, str, float | None]:
    """Returns a refused call's code, ErrorInfo reason and RetryInfo delay (None: no RetryInfo)."""
    with pytest.raises(grpc.RpcError) as refused:
        call()
    status = rpc_status.from_call(refused.value)  # type: ignore[arg-type]
    reason, delay = "", None
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason = info.reason
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            delay = retry.retry_delay.ToNanoseconds() / 1e9
    return refused.value.code(), reason, delay


def test_a_flood_past_the_bound_is_refused_overloaded_with_a_delay_and_reads_still_answer(
    tight: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    _plan(_target(tight))
    gate = WriterGate(tight, monkeypatch)
    held = _hold_one_append(tight, gate)
    with grpc.insecure_channel(_target(tight)) as channel:
        stub = pb_grpc.LedgerServiceStub(channel)
        flood = []
        for shard in SHARDS[1:] * 5:
            request = pb.AppendEventsRequest(events=[started(RUN, shard)])
            flood.append(_refusal(lambda: stub.AppendEvents(request, timeout=60)))  # noqa: B023
        # Every read answers while the appends are refused.
        listed = stub.ListEvents(pb.ListEventsRequest(run_id=RUN), timeout=60)
        summary = stub.GetRunSummary(pb.GetRunSummaryRequest(run_id=RUN), timeout=60)
        runs = stub.ListRuns(pb.ListRunsRequest(), timeout=60)
        shards = stub.ListShards(pb.ListShardsRequest(run_id=RUN), timeout=60)
        chunks = stub.StreamResumeList(pb.StreamResumeListRequest(run_id=RUN), timeout=60)
        resume = [entry for chunk in chunks for entry in chunk.entries]
    gate.opened.set()
    held.join(60)
    assert len(flood) == 35
    assert {(code, reason) for code, reason, _ in flood} == {
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "OVERLOADED")
    }
    delays = [delay for _, _, delay in flood]
    assert all(delay is not None and 0 < delay <= MAX_RETRY_S for delay in delays), delays
    assert len(listed.events) == len(SHARDS) and len(shards.shards) == len(SHARDS)
    assert [r.run_id for r in runs.runs] == [RUN] and summary.summary_json
    assert len(resume) == len(SHARDS)
    assert tight.ledger.admission is not None
    assert tight.ledger.admission.refused_calls == 35
    rejected = tight.metrics.events_rejected.labels("OVERLOADED")._value.get()
    assert rejected == 35


def test_the_sender_waits_the_advised_delay_and_the_ledger_stores_every_event_once(
    tight: RunningServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    target = _target(tight)
    _plan(target)
    gate = WriterGate(tight, monkeypatch)
    held = _hold_one_append(tight, gate)
    advised: list[float] = []
    own: list[float] = []
    refused = threading.Event()
    lock = threading.Lock()

    def advised_jitter(delay_s: float) -> float:
        with lock:
            advised.append(delay_s)
        refused.set()
        return backoff.stretched(delay_s)

    def jitter(delay_s: float) -> float:
        with lock:
            own.append(delay_s)
        return backoff.jittered(delay_s)

    sender = Sender(
        LedgerClient(target),
        spool_root=str(tmp_path / "spool"),
        max_backoff_s=0.5,
        drain_orphans=False,
        jitter=jitter,
        advised_jitter=advised_jitter,
    )
    events = [started(RUN, s, "att-2") for s in SHARDS[1:]] + [
        event(RUN, s, "att-2", heartbeat=pb.Heartbeat(step=step))
        for step in range(1, 31)
        for s in SHARDS[1:]
    ]
    acks: list[Ack] = [sender.emit(e) for e in events]
    assert refused.wait(60)  # the sender's first append met the full queue
    gate.opened.set()
    held.join(60)
    assert sender.flush(120)
    sender.close()
    with lock:
        assert advised and all(0 < d <= 0.5 for d in advised), advised
        assert own == []  # every refusal said how long to wait: no step of its own
    assert all(a.acknowledged and a.outcome == "appended" for a in acks)
    client = LedgerClient(target)
    stored = {e.event_id: e.sequence for e in client.list_events(RUN)}
    counts = Counter(e.event_id for e in client.list_events(RUN))
    client.close()
    assert max(counts.values()) == 1  # nothing stored twice
    assert {a.event_id: a.sequence for a in acks}.items() <= stored.items()  # nothing lost
    assert len(stored) == len(SHARDS) + 1 + len(events)  # plans, the held start, the sender's


def test_at_no_overload_nothing_is_refused(server: RunningServer, tmp_path: Path) -> None:
    target = _target(server)
    _plan(target)
    client = LedgerClient(target)
    client.append([started(RUN, s) for s in SHARDS])
    sender = Sender(client, spool_root=str(tmp_path / "spool"), drain_orphans=False)
    acks = [
        sender.emit(event(RUN, s, "att-1", heartbeat=pb.Heartbeat(step=step)))
        for step in range(1, 376)
        for s in SHARDS[:4]
    ]

    def beat_alone(shard: str) -> None:
        for step in range(1, 51):
            client.append([event(RUN, shard, "att-1", heartbeat=pb.Heartbeat(step=step))])

    threads = [threading.Thread(target=beat_alone, args=(s,)) for s in SHARDS[4:]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert sender.flush(120)
    sender.close()
    assert all(a.outcome == "appended" for a in acks) and len(acks) == 1500
    assert server.ledger.admission is not None
    assert server.ledger.admission.refused_calls == 0
    # Every admitted append gave its room back.
    assert (server.ledger.admission.events, server.ledger.admission.calls) == (0, 0)
    assert server.metrics.events_rejected.labels("OVERLOADED")._value.get() == 0


# --- the rule itself, with a clock of our own ------------------------------------------------


def _admission(**kwargs: Any) -> Admission:
    """Returns an Admission whose clock stands still: its delays are exact."""
    kwargs = {"delay_s": 1.0, "min_events": 10, "max_calls": 4, **kwargs}
    return Admission(clock=lambda: 100.0, **kwargs)


def test_an_empty_queue_admits_a_batch_larger_than_the_bound() -> None:
    admission = _admission()
    with admission.admitted(500):
        assert (admission.events, admission.calls) == (500, 1)
    assert (admission.events, admission.calls) == (0, 0)


def test_the_bound_is_the_measured_rate_times_the_delay_at_least_the_minimum() -> None:
    admission = _admission(delay_s=2.0)
    assert admission.bound() == 10
    admission.observe_commit(400, 0.1)  # 4,000 events/s
    assert admission.rate == pytest.approx(4000)
    assert admission.bound() == 8000


def test_refusals_take_turns_behind_the_queue_and_each_other() -> None:
    admission = _admission(delay_s=0.1, min_events=10)
    admission.observe_commit(1000, 1.0)  # 1,000 events/s, so 100 may wait; a group takes 1 s
    admission.admit(100)
    delays = []
    for _ in range(3):
        with pytest.raises(Overloaded) as refused:
            admission.admit(50)
        delays.append(refused.value.retry_after_s)
    # 50 events over the bound drain in 0.05 s, but a group takes 1 s; each later
    # refusal comes 50 events (0.05 s) behind the one before.
    assert delays == pytest.approx([1.0, 1.05, 1.1])
    assert refused.value.metadata == {"queued_events": "100", "bound_events": "100"}


def test_appends_never_hold_the_threads_kept_for_reads() -> None:
    admission = _admission(min_events=1000, max_calls=2)
    admission.admit(1)
    admission.admit(1)
    with pytest.raises(Overloaded):
        admission.admit(1)


def test_a_delay_of_zero_admits_everything() -> None:
    admission = _admission(delay_s=0.0, min_events=1, max_calls=1)
    for _ in range(5):
        admission.admit(100)
    assert (admission.events, admission.refused_calls) == (500, 0)


def test_plan_waits_the_advised_delay_and_plans_every_shard_once(
    tight: RunningServer,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from shardledger_cli.commands import plan as plan_command

    target = _target(tight)
    _plan(target)
    gate = WriterGate(tight, monkeypatch)
    held = _hold_one_append(tight, gate)
    waits: list[tuple[float | None, float]] = []

    def retry_wait(advised_s: float | None, step_s: float, *, cap_s: float) -> float:
        wait = backoff.retry_wait(advised_s, step_s, cap_s=cap_s)
        waits.append((advised_s, wait))
        gate.opened.set()  # the refusal was met: let the queue drain
        return wait

    monkeypatch.setattr(
        plan_command, "backoff", SimpleNamespace(retry_wait=retry_wait, grown=backoff.grown)
    )
    inputs = []
    for i in range(3):
        inputs.append(tmp_path / f"in-{i}.txt")
        inputs[-1].write_text(f"input {i}\n")
    manifest = tmp_path / "late.jsonl"
    manifest.write_text("".join(json.dumps({"input": str(p)}) + "\n" for p in inputs))

    code, out, err = run_cli(
        capsys, "plan", "run-2", "--manifest", str(manifest), "--server", target, "--json"
    )
    held.join(60)
    assert code == 0, err
    assert json.loads(out)["new"] == 3
    # The ledger said how long to wait, and plan waited that (spread up to half again).
    assert waits, "plan never met the full queue"
    advised, wait = waits[0]
    assert advised is not None and 0 < advised <= MAX_RETRY_S
    assert advised <= wait <= 1.5 * advised
    client = LedgerClient(target)
    assert len(list(client.list_events("run-2"))) == 3  # each shard planned once
    client.close()


def test_a_flood_on_one_stream_is_refused_batch_by_batch_with_a_delay_and_the_stream_goes_on(
    tight: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    _plan(_target(tight))
    gate = WriterGate(tight, monkeypatch)
    held = _hold_one_append(tight, gate)
    with grpc.insecure_channel(_target(tight)) as channel:
        stub = pb_grpc.LedgerServiceStub(channel)
        outgoing: queue.SimpleQueue[pb.StreamAppendEventsRequest | None] = queue.SimpleQueue()
        answers = stub.StreamAppendEvents(iter(outgoing.get, None), timeout=120)
        flood = []
        for batch_id, shard in enumerate(SHARDS[1:] * 5, start=1):
            outgoing.put(
                pb.StreamAppendEventsRequest(batch_id=batch_id, events=[started(RUN, shard)])
            )
            flood.append(next(answers))  # each answered while the commit queue stays full
        gate.opened.set()
        held.join(60)
        outgoing.put(pb.StreamAppendEventsRequest(batch_id=99, events=[started(RUN, SHARDS[1])]))
        last = next(answers)
        outgoing.put(None)
        assert list(answers) == []
    assert [a.batch_id for a in flood] == list(range(1, 36))
    reasons, delays = set(), []
    for answer in flood:
        assert answer.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        for detail in answer.error.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reasons.add(info.reason)
            if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                retry = error_details_pb2.RetryInfo()
                detail.Unpack(retry)
                delays.append(retry.retry_delay.ToNanoseconds() / 1e9)
    assert reasons == {"OVERLOADED"}
    assert len(delays) == 35 and all(0 < d <= MAX_RETRY_S for d in delays), delays
    # Room again: the same stream takes the next batch.
    assert last.batch_id == 99 and last.appended.results[0].outcome == pb.APPEND_OUTCOME_APPENDED
    assert tight.ledger.admission is not None
    assert tight.ledger.admission.refused_calls == 35


def test_a_loop_late_over_every_probe_refuses_appends_with_its_lag_and_turns_behind_it() -> None:
    admission = _admission(min_events=1000, max_calls=100, loop_lag_s=0.25)
    admission.admit(40)  # admitted while the loop keeps up: the loop's admitted rate
    for _ in range(LOOP_PROBES - 1):
        admission.observe_loop(0.3, 0.05)
    admission.admit(1)  # late on three probes only: one slow stretch is no standing queue
    admission.observe_loop(0.3, 0.05)
    assert admission.lagging and admission.lag_s == pytest.approx(0.3)
    delays = []
    for _ in range(3):
        with pytest.raises(Overloaded) as refused:
            admission.admit(1)
        delays.append(refused.value.retry_after_s)
    # The first comes back when the loop has caught up, each next one a turn later.
    assert delays[0] == pytest.approx(0.3)
    assert delays[0] < delays[1] < delays[2]
    assert delays[2] - delays[1] == pytest.approx(delays[1] - delays[0])
    assert refused.value.metadata["loop_lag_ms"] == "300"
    assert "event loop runs 300 ms behind" in str(refused.value)
    assert admission.refused_for_lag == 3
    admission.observe_loop(0.01, 0.05)  # one probe on time ends the standing queue
    admission.admit(1)


def test_a_loop_lag_bound_of_zero_never_refuses_for_the_loop() -> None:
    admission = _admission(min_events=1000, max_calls=100, loop_lag_s=0.0)
    for _ in range(LOOP_PROBES):
        admission.observe_loop(5.0, 0.05)
    assert not admission.lagging
    admission.admit(1)


def test_a_server_whose_event_loop_falls_behind_refuses_appends_until_it_catches_up(
    tmp_path: Path,
) -> None:
    config = ServerConfig(
        database=str(tmp_path / "ledger.db"), listen="127.0.0.1:0", metrics_listen="127.0.0.1:0"
    )
    running = create_server(config)
    try:
        assert isinstance(running.server, AioServer) and running.metrics_port is not None
        loop, hogging = running.server.loop, threading.Event()
        _plan(_target(running))

        def hog() -> None:  # a callback that holds the loop 0.4 s at a time: a standing queue
            if hogging.is_set():
                time.sleep(0.4)
                loop.call_later(0.01, hog)

        hogging.set()
        loop.call_soon_threadsafe(hog)
        # Four probes in a row late (the metric, as a dashboard sees it) before appending.
        scrape_until(running.metrics_port, lambda samples: samples[LAG] > 0.25, timeout_s=60)
        with grpc.insecure_channel(_target(running)) as channel:
            stub = pb_grpc.LedgerServiceStub(channel)
            refusals = []
            for shard in SHARDS[:3]:
                request = pb.AppendEventsRequest(events=[started(RUN, shard)])
                refusals.append(_refusal(lambda: stub.AppendEvents(request, timeout=60)))  # noqa: B023
            lag = scrape(running.metrics_port)[LAG]
        hogging.clear()
        assert {(code, reason) for code, reason, _ in refusals} == {
            (grpc.StatusCode.RESOURCE_EXHAUSTED, "OVERLOADED")
        }
        assert all(delay is not None and 0.25 < delay <= MAX_RETRY_S for _, _, delay in refusals)
        assert lag > 0.25
        # The loop caught up: the SDK's append, which waits the advised delay, is stored once.
        client = LedgerClient(_target(running), timeout_s=60)
        client.append([started(RUN, SHARDS[0])])
        client.close()
        kinds = Counter(
            (e.shard_id, e.WhichOneof("payload"))
            for e in LedgerClient(_target(running)).list_events(RUN)
        )
        assert kinds[(SHARDS[0], "started")] == 1
        assert kinds[(SHARDS[1], "started")] == kinds[(SHARDS[2], "started")] == 0
    finally:
        running.stop(0.5)
