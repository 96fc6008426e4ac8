"""A refusal's RetryInfo delay: read in one place, and waited by the client and the sender.

The waits are recorded through the injected sleep and jitter, never timed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from shard_client import LedgerClient, Sender, backoff
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.errors import LedgerUnavailable, Overloaded, from_rpc_error

OVERLOADED = (grpc.StatusCode.RESOURCE_EXHAUSTED, "OVERLOADED")
STORE_AWAY = (grpc.StatusCode.UNAVAILABLE, "STORE_UNAVAILABLE")


class _Refused(grpc.RpcError, grpc.Call):
    """A refused call as grpcio raises it: code, details, and the rich status in its trailers."""

    def __init__(self, code: grpc.StatusCode, reason: str, delay_s: float | None) -> None:
        details = [any_pb2.Any()]
        details[0].Pack(error_details_pb2.ErrorInfo(reason=reason, domain="shardledger.dev"))
        if delay_s is not None:
            retry = error_details_pb2.RetryInfo()
            retry.retry_delay.FromNanoseconds(int(delay_s * 1e9))
            details.append(any_pb2.Any())
            details[-1].Pack(retry)
        status = status_pb2.Status(
            code=getattr(code_pb2, code.name), message=reason, details=details
        )
        self._code, self._status = code, status

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return str(self._status.message)

    def trailing_metadata(self) -> Any:
        return (("grpc-status-details-bin", self._status.SerializeToString()),)

    def initial_metadata(self) -> Any:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float:
        return 0.0

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Any) -> bool:
        return False


def test_the_delay_is_read_from_the_refusal_of_an_overloaded_or_unavailable_ledger() -> None:
    overloaded = from_rpc_error(_Refused(*OVERLOADED, 1.25))
    assert isinstance(overloaded, Overloaded) and overloaded.reason == "OVERLOADED"
    assert overloaded.retry_after_s == 1.25
    away = from_rpc_error(_Refused(*STORE_AWAY, 0.25))
    assert isinstance(away, LedgerUnavailable) and away.retry_after_s == 0.25
    limit = from_rpc_error(_Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED", None))
    assert isinstance(limit, Overloaded) and limit.retry_after_s is None


def _client_waits(refusals: list[_Refused], **kwargs: Any) -> tuple[str, list[float]]:
    waited: list[float] = []
    client = LedgerClient("127.0.0.1:1", sleep=waited.append, **kwargs)

    def call(_timeout: float) -> str:
        if refusals:
            raise refusals.pop(0)
        return "answered"

    return client.call(call), waited


def test_the_client_waits_the_advised_delay_stretched_by_up_to_half() -> None:
    answer, waited = _client_waits([_Refused(*OVERLOADED, 0.8), _Refused(*STORE_AWAY, 0.25)])
    assert answer == "answered" and len(waited) == 2
    assert 0.8 <= waited[0] < 1.2 and 0.25 <= waited[1] < 0.375, waited


def test_the_client_caps_an_advised_delay_at_its_maximum_backoff() -> None:
    _, waited = _client_waits([_Refused(*OVERLOADED, 30.0)], max_backoff_s=2.0)
    assert len(waited) == 1 and 2.0 <= waited[0] < 3.0, waited


def test_without_a_delay_the_client_keeps_its_own_jittered_step() -> None:
    _, waited = _client_waits([_Refused(grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE", None)] * 2)
    first = backoff.FIRST_DELAY_S
    assert first / 2 <= waited[0] < first and first <= waited[1] < 2 * first, waited


def test_a_refusal_that_gives_no_delay_is_not_retried_by_the_client() -> None:
    # gRPC's own limits (message size, calls in flight) say nothing about when room comes.
    refusal = _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED", None)
    with pytest.raises(Overloaded):
        _client_waits([refusal])


class _RefusingClient:
    """Refuses the first appends with the given errors, then stores everything."""

    target = "127.0.0.1:1"

    def __init__(self, errors: list[Exception]) -> None:
        self.errors = errors
        self.sequence = 0

    def end_stream(self) -> None:
        """The sender ends its client's append stream when it closes: there is none here."""

    def append(self, events: Sequence[pb.ShardEvent], *, retry: bool = True) -> Any:
        if self.errors:
            raise self.errors.pop(0)
        results = []
        for e in events:
            self.sequence += 1
            results.append(pb.AppendResult(event_id=e.event_id, sequence=self.sequence))
        return results


def _overloaded(delay_s: float | None) -> Overloaded:
    error = Overloaded(
        "at capacity", code=grpc.StatusCode.RESOURCE_EXHAUSTED, reason="OVERLOADED", metadata={}
    )
    error.retry_after_s = delay_s
    return error


def _sender_waits(
    errors: list[Exception], tmp_path: Path, **kwargs: Any
) -> tuple[list[float], list[float]]:
    """Returns the (advised, own) delays a sender asked to wait before it got through."""
    advised: list[float] = []
    own: list[float] = []
    lock = threading.Lock()

    def record(into: list[float]) -> Any:
        def wait(delay_s: float) -> float:
            with lock:
                into.append(delay_s)
            return 0.0  # recorded, not slept: the test asserts what was asked

        return wait

    sender = Sender(
        _RefusingClient(errors),  # type: ignore[arg-type]
        spool_root=str(tmp_path),
        drain_orphans=False,
        jitter=record(own),
        advised_jitter=record(advised),
        **kwargs,
    )
    ack = sender.emit(pb.ShardEvent(event_id="e1", run_id="r", shard_id="s"))
    assert sender.drain(60) and ack.acknowledged  # settled, and the spool (if any) drained
    sender.close()
    with lock:
        return advised, own


def test_the_sender_waits_the_advised_delay_instead_of_its_own_step(tmp_path: Path) -> None:
    advised, own = _sender_waits([_overloaded(0.7), _overloaded(1.5)], tmp_path, policy="block")
    assert (advised, own) == ([0.7, 1.5], [])


def test_the_sender_caps_an_advised_delay_at_its_maximum_backoff(tmp_path: Path) -> None:
    advised, _ = _sender_waits([_overloaded(12.0)], tmp_path, policy="block", max_backoff_s=0.4)
    assert advised == [0.4]


def test_the_sender_steps_on_its_own_when_a_refusal_gives_no_delay(tmp_path: Path) -> None:
    advised, own = _sender_waits(
        [_overloaded(None), LedgerUnavailable("down")], tmp_path, policy="block"
    )
    first = backoff.FIRST_DELAY_S
    assert (advised, own) == ([], [first, 2 * first])


def test_the_spool_drain_waits_the_advised_delay(tmp_path: Path) -> None:
    # No wait before spooling: the first refusal spools, the drain meets the second.
    advised, own = _sender_waits(
        [_overloaded(0.3), _overloaded(0.6)], tmp_path, policy="spool", unavailable_after_s=0.0
    )
    assert (advised, own) == ([0.3, 0.6], [])


def test_a_call_the_server_cancelled_is_sent_again_not_recorded_as_refused() -> None:
    # An overloaded server's gRPC core cancels calls its Python server did not take in time
    # (server.UNREQUESTED_CALL_S): nothing was stored, and an append is idempotent.
    cancelled = _Refused(grpc.StatusCode.CANCELLED, "CANCELLED", None)
    assert isinstance(from_rpc_error(cancelled), LedgerUnavailable)
    answer, waited = _client_waits([cancelled])
    assert answer == "answered" and len(waited) == 1
