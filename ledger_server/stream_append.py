"""StreamAppendEvents: a job's batches as messages on one long-lived stream.

gRPC's cost is per call: a unary AppendEvents pays for a call's setup, its
headers and its teardown on every heartbeat, while a message on an open stream
pays for the message alone. Each request of the stream is one atomic batch,
handled by the same ``LedgerServicer.append_steps`` as AppendEvents (admission,
authorization, decoding, the commit, errors as statuses), and answered after its
commit by one response that names its ``batch_id``:

- ``appended``: the batch's results, as AppendEvents answers;
- ``error``: the rich status AppendEvents would have ended with (``AppendError``
  carries google.rpc.Status's fields), RetryInfo included: the stream goes on.

Answers come in request order. The asyncio engine (ledger_server.aio) reads ahead
up to ``STREAM_WINDOW`` batches whose commits are pending, then stops reading, so
HTTP/2 flow control holds a client that sends faster than the ledger commits;
the threaded engine answers one batch before it reads the next.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any, Final, NoReturn

import grpc

from ledger_server.errors import StreamsExhausted
from ledger_server.interceptor import CURRENT_PRINCIPAL, RequestInterceptor
from ledger_server.rpc_status import rich_status
from ledger_server.servicer import AppendSteps, LedgerServicer, finish
from shard_client.api.shardledger.v1 import ledger_pb2 as pb

__all__ = [
    "STREAM_METHOD",
    "STREAM_WINDOW",
    "BatchAborted",
    "BatchContext",
    "Pending",
    "StreamSlots",
    "StreamingServicer",
    "answer",
    "begin",
    "refused",
    "serve_sync",
]

STREAM_METHOD: Final = (
    "/" + pb.DESCRIPTOR.services_by_name["LedgerService"].full_name + "/StreamAppendEvents"
)
# Batches of one stream read and submitted while earlier ones wait for their commit.
# The SDK sends one at a time; a client that pipelines gets this much ahead, then
# waits in HTTP/2 flow control rather than in the ledger's memory.
STREAM_WINDOW: Final = 32
# A servicer built without a server's config (tests, tools) holds this many streams.
DEFAULT_STREAM_SLOTS: Final = 256
_DETAILS_KEY: Final = "grpc-status-details-bin"


class StreamSlots:
    """Counts the open streams against the limit (serve --max-append-streams)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        """Takes a slot for a new stream; False when every slot is taken."""
        with self._lock:
            if self.open >= self.limit:
                return False
            self.open += 1
            return True

    def give_back(self) -> None:
        with self._lock:
            self.open -= 1


class BatchAborted(Exception):
    """A batch was refused: its status goes into the batch's answer, not the stream's."""

    def __init__(self, status: grpc.Status) -> None:
        super().__init__(status.details)
        self.status = status


class BatchContext:
    """The context one batch's steps see: the stream's, but an abort ends the batch only."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._code: grpc.StatusCode | None = None

    def abort_with_status(self, status: grpc.Status) -> NoReturn:
        self._code = status.code
        raise BatchAborted(status)

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        self._code = code
        raise BatchAborted(_PlainStatus(code, details))

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def __getattr__(self, name: str) -> Any:  # peer, invocation_metadata, is_active, ...
        return getattr(self._stream, name)


class _PlainStatus(grpc.Status):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        self.details = details
        self.trailing_metadata = ()


def error_of(status: grpc.Status) -> pb.AppendError:
    """Returns a refusal's status as an AppendError: google.rpc.Status's bytes, as they are."""
    for key, value in status.trailing_metadata or ():
        if key == _DETAILS_KEY and isinstance(value, bytes):
            return pb.AppendError.FromString(value)
    return pb.AppendError(code=status.code.value[0], message=status.details or "")


def refused(batch_id: int, aborted: BatchAborted) -> pb.StreamAppendEventsResponse:
    """Returns the answer of a batch refused with the given status."""
    return pb.StreamAppendEventsResponse(batch_id=batch_id, error=error_of(aborted.status))


class Pending:
    """One batch submitted to the committer: its steps wait for the commit's results."""

    __slots__ = ("batch_id", "context", "future", "start", "steps")

    def __init__(
        self,
        batch_id: int,
        context: BatchContext,
        steps: AppendSteps,
        future: Future[Any],
        start: float,
    ) -> None:
        self.batch_id = batch_id
        self.context = context
        self.steps = steps
        self.future = future
        self.start = start


def begin(
    servicer: LedgerServicer, request: pb.StreamAppendEventsRequest, stream: Any
) -> Pending | pb.StreamAppendEventsResponse:
    """Admits, authorizes, decodes and submits one batch; returns it pending, or its refusal."""
    context = BatchContext(stream)
    start = time.perf_counter()
    # append_steps reads .events alone, which a stream request has as AppendEvents' does.
    steps = servicer.append_steps(request, context)  # type: ignore[arg-type]
    try:
        future = next(steps)
    except BatchAborted as aborted:
        _handled(servicer, context, start, failed=True)
        return refused(request.batch_id, aborted)
    return Pending(request.batch_id, context, steps, future, start)


def answer(
    servicer: LedgerServicer,
    pending: Pending,
    *,
    results: Any = None,
    error: BaseException | None = None,
) -> pb.StreamAppendEventsResponse:
    """Returns a pending batch's answer once its commit ended (results, or the commit's error)."""
    failed = True
    try:
        response = finish(pending.steps, results=results, error=error)
        failed = False
    except BatchAborted as aborted:
        return refused(pending.batch_id, aborted)
    finally:
        _handled(servicer, pending.context, pending.start, failed=failed)
    out = pb.StreamAppendEventsResponse(batch_id=pending.batch_id)
    out.appended.results.MergeFrom(response.results)
    return out


def _handled(servicer: LedgerServicer, context: BatchContext, start: float, failed: bool) -> None:
    """Logs the batch as one handled request, as AppendEvents' call would be."""
    interceptor: RequestInterceptor | None = servicer.interceptor
    if interceptor is not None:
        grpc_context: Any = context
        interceptor.handled(STREAM_METHOD, grpc_context, start, failed, CURRENT_PRINCIPAL.get())


class StreamingServicer(LedgerServicer):
    """The servicer the server runs: LedgerServicer and StreamAppendEvents, its streams counted.

    (The threaded engine calls StreamAppendEvents; the asyncio one serves the method on
    its loop, ledger_server.aio, with the same slots.)
    """

    def __init__(self, *args: Any, stream_slots: int = DEFAULT_STREAM_SLOTS, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stream_slots = StreamSlots(stream_slots)

    def StreamAppendEvents(
        self, requests: Iterator[pb.StreamAppendEventsRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.StreamAppendEventsResponse]:
        return serve_sync(self, requests, context)


def serve_sync(
    servicer: StreamingServicer,
    requests: Iterator[pb.StreamAppendEventsRequest],
    context: grpc.ServicerContext,
) -> Iterator[pb.StreamAppendEventsResponse]:
    """The threaded engine's stream: each batch answered after its commit, then the next read."""
    slots = servicer.stream_slots
    if not slots.take():
        context.abort_with_status(rich_status(StreamsExhausted(slots.limit)))
    try:
        yield from _serve_sync(servicer, requests, context)
    finally:
        slots.give_back()


def _serve_sync(
    servicer: StreamingServicer,
    requests: Iterator[pb.StreamAppendEventsRequest],
    context: grpc.ServicerContext,
) -> Iterator[pb.StreamAppendEventsResponse]:
    for request in requests:
        pending = begin(servicer, request, context)
        if isinstance(pending, pb.StreamAppendEventsResponse):
            yield pending
            continue
        try:
            results = pending.future.result()
        except BaseException as exc:  # the commit's error: the steps map it to a status
            yield answer(servicer, pending, error=exc)
        else:
            yield answer(servicer, pending, results=results)
