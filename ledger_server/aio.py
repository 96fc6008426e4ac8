# Over 450 lines on purpose: one engine, read top to bottom — the adapter of every threaded handler to the loop, the append and the append stream awaited on it, health, and the server driving the loop.
"""The asyncio ledger (grpc.aio): appends awaited on the event loop, reads on a thread pool.

gRPC's threaded server hands every call to a pool thread, and an append then waits on
that thread for the group committer: two thread hand-offs and a held thread per append
(36.5 % of the process in `futex` under a fleet, docs/performance.md). Here one event
loop thread takes every call:

- ``AppendEvents`` runs on the loop: admission, authorization and decoding as in the
  threaded server (the same ``LedgerServicer.append_steps``), then the loop *awaits*
  the committer's future; the writer thread resolves it after the commit and the loop
  answers. An acknowledgement still means committed; nothing waits on a thread.
- every read (they query the store, which blocks) runs the threaded servicer's own
  method on a pool thread the loop awaits, with a ``SyncContext`` standing in for the
  threaded server's context; a stream's messages are made there one at a time.
- health answers on the loop (a watch is an async generator fed by the delivery
  thread), and reflection is grpcio-reflection's asyncio servicer.

The interceptor's rules hold unchanged: authentication, one log line per request,
lenient parsing (MALFORMED_REQUEST, never gRPC's INTERNAL), open health and reflection.
``engine="aio-executor"`` runs ``AppendEvents`` on a pool thread too (the second way
the issue asks to measure).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from concurrent import futures
from typing import TYPE_CHECKING, Any, Final, NoReturn, TypeAlias, cast

import grpc
from grpc_health.v1 import health_pb2

from ledger_server.admission import LOOP_PROBE_S
from ledger_server.errors import StreamsExhausted
from ledger_server.framework import HEALTH_SERVICE_NAME, LedgerHealth
from ledger_server.interceptor import (
    CURRENT_METHOD,
    CURRENT_PRINCIPAL,
    OPEN_PREFIXES,
    RequestInterceptor,
    lenient,
    refuse_malformed,
)
from ledger_server.rpc_status import rich_status
from ledger_server.servicer import finish
from ledger_server.stream_append import (
    STREAM_METHOD,
    STREAM_WINDOW,
    Pending,
    StreamingServicer,
    answer,
    begin,
)
from shard_client.api.shardledger.v1 import ledger_pb2

APPEND_METHOD: Final = (
    "/" + ledger_pb2.DESCRIPTOR.services_by_name["LedgerService"].full_name + ("/AppendEvents")
)
AioContext: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
# next() past a stream's end, as a value: StopIteration cannot cross an executor's future.
_END: Final = object()


class Aborted(Exception):
    """A sync handler ended its call (abort_with_status); the loop sends the status."""

    def __init__(self, status: grpc.Status) -> None:
        super().__init__(status.details)
        self.status = status


class SyncContext:
    """What a threaded handler sees of an asyncio call: the context methods the ledger uses.

    ``abort_with_status`` raises ``Aborted``, which the loop turns into the call's
    status (grpc.aio's own abort is a coroutine, and cannot run on a pool thread).
    """

    def __init__(self, context: AioContext) -> None:
        self._context = context
        self._code: grpc.StatusCode | None = None
        self.active = True
        # Read now, on the loop: once the call ends gRPC frees it, and a stream's last
        # step (and its log line) may run on a pool thread after that.
        self._peer: str = context.peer()

    def as_grpc(self) -> grpc.ServicerContext:
        """Returns self, typed as the context the threaded handlers take."""
        return cast(grpc.ServicerContext, self)

    def abort_with_status(self, status: grpc.Status) -> NoReturn:
        self._code = status.code
        raise Aborted(status)

    def code(self) -> grpc.StatusCode | None:
        return self._code or self._context.code()

    def set_code(self, code: grpc.StatusCode) -> None:
        self._context.set_code(code)

    def is_active(self) -> bool:
        return self.active and not self._context.done() and not self._context.cancelled()

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> Any:
        return self._context.invocation_metadata()


async def _abort(context: AioContext, aborted: Aborted) -> NoReturn:
    status = aborted.status
    await context.abort(status.code, status.details, tuple(status.trailing_metadata))
    raise AssertionError("unreachable")  # grpc.aio's abort always raises


class _Deliveries:
    """Hands commits' outcomes to one loop in batches: one wake-up per group commit, not per call.

    The writer thread finishes a group's futures one after another; each one's
    callback files (waiter, done) here, and only the first since the loop last
    drained asks the loop to drain (``call_soon_threadsafe`` writes to the loop's
    self-pipe: a system call and a wake-up each, on the writer's GIL time).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._filed: list[tuple[asyncio.Future[Any], futures.Future[Any]]] = []

    def file(self, waiter: asyncio.Future[Any], done: futures.Future[Any]) -> None:
        """Files one outcome (on the writer thread)."""
        with self._lock:
            first = not self._filed
            self._filed.append((waiter, done))
        if first and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:  # on the loop
        with self._lock:
            filed, self._filed = self._filed, []
        for waiter, done in filed:
            if waiter.cancelled():
                continue
            error = done.exception()
            if error is not None:
                waiter.set_exception(error)
            else:
                waiter.set_result(done.result())

    def committed(self, future: futures.Future[Any]) -> asyncio.Future[Any]:
        """Returns an asyncio future with the commit's outcome, resolved on the loop.

        Unlike asyncio.wrap_future, cancelling it (the client left) leaves the commit's
        own future alone: the writer sets every outcome.
        """
        waiter: asyncio.Future[Any] = self.loop.create_future()
        future.add_done_callback(lambda done: self.file(waiter, done))
        return waiter


async def probe_loop(observe: Callable[[float, float], None]) -> None:
    """Measures, until cancelled, how late the loop wakes a short sleep (Admission.observe_loop)."""
    loop = asyncio.get_running_loop()
    while True:
        start = loop.time()
        await asyncio.sleep(LOOP_PROBE_S)
        observe(loop.time() - start - LOOP_PROBE_S, LOOP_PROBE_S)


def _step(stream: Iterator[Any]) -> Any:
    try:
        return next(stream)
    except StopIteration:
        return _END


if TYPE_CHECKING:
    _ServerInterceptor = grpc.aio.ServerInterceptor[Any, Any]
else:
    _ServerInterceptor = grpc.aio.ServerInterceptor


class AioInterceptor(_ServerInterceptor):
    """Adapts the threaded server's handlers, wrapped by its RequestInterceptor, to the loop."""

    def __init__(
        self,
        interceptor: RequestInterceptor,
        servicer: StreamingServicer,
        pool: futures.ThreadPoolExecutor,
        *,
        append_on_loop: bool,
        max_calls: int | None = None,
    ) -> None:
        self.interceptor = interceptor
        self.servicer = servicer
        self.pool = pool
        self.append_on_loop = append_on_loop
        # --max-concurrent-rpcs for every call but the append streams and health: gRPC's own
        # limit is raised by --max-append-streams, which long-lived streams hold.
        self.max_calls = max_calls
        self.calls = 0
        # method -> (the handler gRPC found, our adaptation of it), built once per method.
        self._adapted: dict[str, tuple[Any, Any]] = {}
        # The open StreamAppendEvents streams, each (its reader, its window): a stop ends them.
        self._streams: set[tuple[asyncio.Task[None], asyncio.Queue[Any]]] = set()
        self._stopping = False
        self._delivered: _Deliveries | None = None  # made on the loop, at the first append

    def _deliveries(self) -> _Deliveries:
        """Returns the commit outcomes' way onto the loop (called on the loop)."""
        if self._delivered is None:
            self._delivered = _Deliveries(asyncio.get_running_loop())
        return self._delivered

    async def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        known = self._adapted.get(details.method)
        if known is not None and known[0] is handler:
            return known[1]
        adapted = self._adapt(details, handler)
        self._adapted[details.method] = (handler, adapted)
        return adapted

    def _adapt(self, details: Any, handler: Any) -> Any:
        method: str = details.method
        if method.startswith(OPEN_PREFIXES):
            return _open(handler)
        if method == STREAM_METHOD:
            return grpc.stream_stream_rpc_method_handler(
                self._stream_append,
                request_deserializer=lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if method == APPEND_METHOD and self.append_on_loop:
            return grpc.unary_unary_rpc_method_handler(
                self._counted(self._append),
                request_deserializer=lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        wrapped = self.interceptor.intercept_service(lambda _details: handler, details)
        if wrapped.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._counted(self._in_pool(wrapped.unary_unary)),
                request_deserializer=wrapped.request_deserializer,
                response_serializer=wrapped.response_serializer,
            )
        if wrapped.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._counted_stream(self._stream_in_pool(wrapped.unary_stream)),
                request_deserializer=wrapped.request_deserializer,
                response_serializer=wrapped.response_serializer,
            )
        raise TypeError(f"{method}: the ledger serves no client-streaming method")

    async def _refuse_past_limit(self, context: AioContext) -> None:
        """Ends a call past --max-concurrent-rpcs as gRPC's own limit would: at once, no delay."""
        if self.max_calls is not None and self.calls >= self.max_calls:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded!"
            )

    def _counted(self, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def unary(request: Any, context: AioContext) -> Any:
            await self._refuse_past_limit(context)
            self.calls += 1
            try:
                return await behavior(request, context)
            finally:
                self.calls -= 1

        return unary

    def _counted_stream(self, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def stream(request: Any, context: AioContext) -> AsyncIterator[Any]:
            await self._refuse_past_limit(context)
            self.calls += 1
            try:
                async for item in behavior(request, context):
                    yield item
            finally:
                self.calls -= 1

        return stream

    async def _append(self, request: Any, context: AioContext) -> Any:
        sync = SyncContext(context)
        interceptor = self.interceptor
        try:
            # A refusal here is logged as request_rejected, not request_handled (as threaded).
            principal = interceptor.authenticated(sync.as_grpc(), APPEND_METHOD)
        except Aborted as aborted:
            await _abort(context, aborted)
        start, failed = time.perf_counter(), True
        try:
            # The loop runs this call in a task of its own: the principal is the task's.
            CURRENT_PRINCIPAL.set(principal)
            CURRENT_METHOD.set(APPEND_METHOD)
            refuse_malformed(request, sync.as_grpc())
            steps = self.servicer.append_steps(request, sync.as_grpc())
            future = next(steps)
            try:
                results = await self._deliveries().committed(future)
            except asyncio.CancelledError:
                # The client left; the events are still queued. Admission gives their room
                # back when the commit ends, as the threaded server's waiting thread would.
                future.add_done_callback(lambda _done: steps.close())
                raise
            except Exception as exc:  # the commit's error: the steps map it to a status
                response = finish(steps, error=exc)
            else:
                response = finish(steps, results=results)
            failed = False
            return response
        except Aborted as aborted:
            await _abort(context, aborted)
        finally:
            interceptor.handled(APPEND_METHOD, sync.as_grpc(), start, failed, principal)

    async def _stream_append(self, requests: AsyncIterator[Any], context: AioContext) -> None:
        """StreamAppendEvents on the loop: a reader submits batches, this task answers them in order."""
        sync = SyncContext(context)
        interceptor = self.interceptor
        try:
            principal = interceptor.authenticated(sync.as_grpc(), STREAM_METHOD)
        except Aborted as aborted:
            await _abort(context, aborted)
        if self._stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the ledger is stopping")
        slots = self.servicer.stream_slots
        if not slots.take():
            start = time.perf_counter()
            try:
                sync.abort_with_status(rich_status(StreamsExhausted(slots.limit)))
            except Aborted as aborted:
                interceptor.handled(STREAM_METHOD, sync.as_grpc(), start, True, principal)
                await _abort(context, aborted)
        try:
            await self._stream_batches(requests, context, sync, principal)
        finally:
            slots.give_back()

    async def _stream_batches(
        self, requests: AsyncIterator[Any], context: AioContext, sync: SyncContext, principal: Any
    ) -> None:
        interceptor = self.interceptor
        CURRENT_PRINCIPAL.set(principal)  # the reader task copies this context
        CURRENT_METHOD.set(STREAM_METHOD)
        # Submitted batches (Pending) and refusals, in request order; room for STREAM_WINDOW
        # uncommitted batches, then the reader stops reading and HTTP/2 holds the client.
        window: asyncio.Queue[Any] = asyncio.Queue()
        room = asyncio.Semaphore(STREAM_WINDOW)
        servicer, grpc_context = self.servicer, sync.as_grpc()
        deliveries = self._deliveries()

        async def read() -> None:
            try:
                async for request in requests:
                    refuse_malformed(request, grpc_context)
                    await room.acquire()
                    window.put_nowait(begin(servicer, request, grpc_context))
            except Aborted as aborted:
                window.put_nowait(aborted)
                return
            window.put_nowait(_END)

        reader = asyncio.get_running_loop().create_task(read())
        stream = (reader, window)
        self._streams.add(stream)
        start, failed = time.perf_counter(), True
        try:
            while True:
                item = await window.get()
                if item is _END:
                    break
                if isinstance(item, Aborted):
                    await _abort(context, item)
                if isinstance(item, Pending):
                    try:
                        results = await deliveries.committed(item.future)
                    except asyncio.CancelledError:
                        _release_when_committed(item)
                        raise
                    except Exception as exc:  # the commit's error: the steps map it to a status
                        item = answer(servicer, item, error=exc)
                    else:
                        item = answer(servicer, item, results=results)
                await context.write(item)
                room.release()
            failed = False
        except asyncio.CancelledError:
            sync.active = False  # the client went away: logged as CANCELLED
            raise
        finally:
            self._streams.discard(stream)
            reader.cancel()
            while not window.empty():  # read, never answered: give admission its room back
                left = window.get_nowait()
                if isinstance(left, Pending):
                    _release_when_committed(left)
            interceptor.handled(STREAM_METHOD, grpc_context, start, failed, principal)

    def end_streams(self) -> None:
        """Stops reading every open stream (on the loop): each answers what it read, then ends."""
        self._stopping = True
        for reader, window in list(self._streams):
            reader.cancel()
            window.put_nowait(_END)

    def _in_pool(self, behavior: Callable[[Any, Any], Any]) -> Callable[..., Any]:
        pool = self.pool

        async def unary(request: Any, context: AioContext) -> Any:
            sync = SyncContext(context)
            loop = asyncio.get_running_loop()
            try:
                return await loop.run_in_executor(pool, behavior, request, sync)
            except Aborted as aborted:
                await _abort(context, aborted)
            finally:
                sync.active = False

        return unary

    def _stream_in_pool(
        self, behavior: Callable[[Any, Any], Generator[Any, None, None]]
    ) -> Callable[..., Any]:
        pool = self.pool

        async def stream(request: Any, context: AioContext) -> AsyncIterator[Any]:
            sync = SyncContext(context)
            loop = asyncio.get_running_loop()
            messages = behavior(request, sync)
            running = False
            try:
                while True:
                    running = True
                    try:
                        item = await loop.run_in_executor(pool, _step, messages)
                    except Aborted as aborted:
                        running = False
                        await _abort(context, aborted)
                    running = False
                    if item is _END:
                        return
                    yield item
            finally:
                sync.active = False
                if not running:
                    messages.close()  # its own finally logs the request
                # else: a step is still running on a pool thread (the call was cancelled
                # under it); the generator sees is_active() false and ends there.

        return stream


def _release_when_committed(pending: Pending) -> None:
    """Closes a batch's steps once its commit ends, which gives admission its room back."""
    pending.future.add_done_callback(lambda _done: pending.steps.close())


async def _refuse_malformed(request: Any, context: AioContext) -> None:
    """Ends the call INVALID_ARGUMENT MALFORMED_REQUEST when the request bytes did not parse."""
    try:
        refuse_malformed(request, SyncContext(context).as_grpc())
    except Aborted as aborted:
        await _abort(context, aborted)


def _open(handler: Any) -> Any:
    """Returns an open (health, reflection) asyncio handler, parsing leniently and refusing garbage."""
    deserializer = lenient(handler.request_deserializer)
    serializer = handler.response_serializer
    if handler.unary_unary is not None:
        unary = handler.unary_unary

        async def unary_unary(request: Any, context: AioContext) -> Any:
            await _refuse_malformed(request, context)
            return await unary(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, deserializer, serializer)
    if handler.unary_stream is not None:
        server_stream = handler.unary_stream

        async def unary_stream(request: Any, context: AioContext) -> AsyncIterator[Any]:
            await _refuse_malformed(request, context)
            async for item in server_stream(request, context):
                yield item

        return grpc.unary_stream_rpc_method_handler(unary_stream, deserializer, serializer)
    bidi = handler.stream_stream

    async def stream_stream(
        requests: AsyncIterator[Any], context: AioContext
    ) -> AsyncIterator[Any]:
        async def checked() -> AsyncIterator[Any]:
            async for request in requests:
                await _refuse_malformed(request, context)
                yield request

        async for item in bidi(checked(), context):
            yield item

    return grpc.stream_stream_rpc_method_handler(stream_stream, deserializer, serializer)


def health_handler(health: LedgerHealth) -> grpc.GenericRpcHandler[Any, Any]:
    """Serves LedgerHealth (Check, Watch, List) on the loop."""

    async def check(request: Any, context: AioContext) -> Any:
        return health.Check(request, cast(grpc.ServicerContext, context))

    async def health_list(request: Any, context: AioContext) -> Any:
        return health.List(request, cast(grpc.ServicerContext, context))

    async def watch(request: Any, context: AioContext) -> AsyncIterator[Any]:
        loop = asyncio.get_running_loop()
        answers: asyncio.Queue[Any] = asyncio.Queue()

        def send(answer: Any) -> None:  # on the delivery thread
            loop.call_soon_threadsafe(answers.put_nowait, answer)

        opened = health.open_watch(request.service, send)
        try:
            while (answer := await answers.get()) is not None:
                yield answer
        finally:
            health.close_watch(opened)

    request = health_pb2.HealthCheckRequest.FromString
    response = health_pb2.HealthCheckResponse.SerializeToString
    return grpc.method_handlers_generic_handler(
        HEALTH_SERVICE_NAME,
        {
            "Check": grpc.unary_unary_rpc_method_handler(check, request, response),
            "Watch": grpc.unary_stream_rpc_method_handler(watch, request, response),
            "List": grpc.unary_unary_rpc_method_handler(
                health_list,
                health_pb2.HealthListRequest.FromString,
                health_pb2.HealthListResponse.SerializeToString,
            ),
        },
    )


class AioServer:
    """A grpc.aio server on an event loop thread of its own, driven like grpc.Server.

    Everything grpc.aio owns is made and used on the loop thread; callers on other
    threads go through run(), which waits for the loop's answer.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="grpc-aio-loop", daemon=True)
        self._thread.start()
        self.server: grpc.aio.Server | None = None
        self._stopped = threading.Event()
        # Run on the loop when a stop begins, before grpc.aio's graceful stop waits for calls.
        self.before_stop: list[Callable[[], None]] = []

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, build: Callable[[], Any], timeout: float | None = None) -> Any:
        """Runs build() (a plain function or one returning a coroutine) on the loop; returns its result."""

        async def call() -> tuple[Any, BaseException | None]:
            # A SystemExit (StartupError is one) raised in a task would end the loop
            # itself: it is carried back to the caller's thread and raised there.
            try:
                result = build()
                if asyncio.iscoroutine(result):
                    result = await result
            except BaseException as exc:
                return None, exc
            return result, None

        result, error = asyncio.run_coroutine_threadsafe(call(), self.loop).result(timeout)
        if error is not None:
            raise error
        return result

    def stop(self, grace: float | None) -> threading.Event:
        """Stops taking calls, cancels those still running after grace; the event is set when done."""
        server = self.server
        done = self._stopped
        if server is None or not self.loop.is_running():
            done.set()
            return done

        async def stop() -> None:
            for hook in self.before_stop:
                hook()
            await server.stop(grace)
            done.set()

        asyncio.run_coroutine_threadsafe(stop(), self.loop)
        return done

    def close(self) -> None:
        """Ends the loop thread (after stop)."""
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
        if not self.loop.is_running():
            self.loop.close()
