"""The server interceptor: authenticates tokens, logs one line per request, counts rejections.

Every method it serves, the framework services (health, reflection) included, parses
its request bytes leniently: bytes that are not a message get INVALID_ARGUMENT
MALFORMED_REQUEST, never gRPC's own INTERNAL "Exception deserializing request!".
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, Final

import grpc
import structlog

from ledger_server.auth import Principal, TokenSource, Unauthenticated, authenticate
from ledger_server.errors import InvalidEvent
from ledger_server.rpc_status import rich_status

log = structlog.get_logger("shardledger.server")

# Set for the duration of one handler call; the servicer authorizes against it.
CURRENT_PRINCIPAL: ContextVar[Principal | None] = ContextVar("shardledger_principal", default=None)
CURRENT_METHOD: ContextVar[str] = ContextVar("shardledger_method", default="")
# Health must answer load balancers without credentials; reflection only describes the schema.
OPEN_PREFIXES: Final = ("/grpc.health.v1.Health/", "/grpc.reflection.")
# Stands in for a request whose bytes do not parse (see lenient).
_MALFORMED: Final = object()


class MalformedRequest(InvalidEvent):
    """The request bytes are not a valid message of the method's type (INVALID_ARGUMENT)."""

    reason = "MALFORMED_REQUEST"

    def __init__(self) -> None:
        super().__init__("request", "is not a valid protobuf message of the method's type")


def lenient(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """Returns a deserializer that yields _MALFORMED instead of raising."""
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception:  # DecodeError, or whatever a parser raises on hostile bytes
            # gRPC itself would answer INTERNAL (and log a traceback) for a client's garbage.
            return _MALFORMED

    return parse


def refuse_malformed(request: Any, context: grpc.ServicerContext) -> None:
    if request is _MALFORMED:
        context.abort_with_status(rich_status(MalformedRequest()))


def _checked(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
    """Yields a client stream's requests, ending the call at the first malformed one."""
    for request in requests:
        refuse_malformed(request, context)
        yield request


class RequestInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """Authenticates (when tokens are required), logs and counts every request."""

    def __init__(
        self,
        *,
        tokens: TokenSource | None,
        clock: Callable[[], int],
        on_rejected: Callable[[str], None] | None = None,
        access_log: bool = False,
    ) -> None:
        self.tokens = tokens
        # request_handled is a debug line unless the operator asks for an access log:
        # one line per call would bury the lifecycle and problems a terminal should show.
        self.handled_level = logging.INFO if access_log else logging.DEBUG
        self.clock = clock
        self.on_rejected = on_rejected
        self.rejections: Counter[str] = Counter()
        self._lock = threading.Lock()
        # method -> (the handler gRPC found, our wrapping of it). gRPC's one polling thread
        # takes every call in through intercept_service, holding the GIL that every
        # handler thread needs: it only looks the wrapping up here, built once per
        # method, and the per-call work (authentication included) runs on the call's
        # own handler thread (docs/performance.md, "Overload").
        self._wrapped: dict[str, tuple[Any, Any]] = {}

    def _reject(self, exc: Unauthenticated, method: str, peer: str) -> None:
        with self._lock:
            self.rejections[exc.reason] += 1
        if self.on_rejected is not None:
            self.on_rejected(exc.reason)
        # The token itself is never logged: only the reason and, when known, its id.
        log.warning("request_rejected", method=method, reason=exc.reason, peer=peer, **exc.metadata)

    def record_denied(self, reason: str, method: str, peer: str) -> None:
        """Counts and logs a refusal decided in a handler (authorization)."""
        with self._lock:
            self.rejections[reason] += 1
        if self.on_rejected is not None:
            self.on_rejected(reason)
        log.warning("request_rejected", method=method, reason=reason, peer=peer)

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method: str = details.method
        known = self._wrapped.get(method)
        if known is not None and known[0] is handler:
            return known[1]
        if method.startswith(OPEN_PREFIXES):
            wrapped = _tolerant(handler)
        else:
            wrapped = _wrap(handler, self._behavior_factory(method))
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _caller(self, context: grpc.ServicerContext) -> Principal | None:
        """Returns who makes this call (None: tokens are not required); raises Unauthenticated."""
        if self.tokens is None:
            return None
        header = next(
            (
                v
                for k, v in context.invocation_metadata()
                if k == "authorization" and isinstance(v, str)
            ),
            None,
        )
        return authenticate(header, self.tokens, now_us=self.clock())

    def authenticated(self, context: grpc.ServicerContext, method: str) -> Principal | None:
        """Returns the call's principal, or ends the call UNAUTHENTICATED (counted and logged)."""
        try:
            return self._caller(context)
        except Unauthenticated as failure:
            self._reject(failure, method, context.peer())
            context.abort_with_status(rich_status(failure))
            raise  # abort_with_status raises; this line is never reached

    def handled(
        self,
        method: str,
        context: grpc.ServicerContext,
        start: float,
        failed: bool,
        principal: Principal | None,
    ) -> None:
        """Logs one handled request (debug, or info as the access log): method, code, duration, peer."""
        if not log.is_enabled_for(self.handled_level):
            return  # context.peer() and the rest cost more than a filtered-out line
        code = context.code() if failed else None  # type: ignore[attr-defined]
        if code:
            name = code.name
        elif not context.is_active():
            name = "CANCELLED"  # the client went away: e.g. a tail it cancelled
        else:
            name = "UNKNOWN" if failed else "OK"
        log.log(
            self.handled_level,
            "request_handled",
            method=method,
            code=name,
            duration_ms=round((time.perf_counter() - start) * 1000, 3),
            peer=context.peer(),
            token_id=principal.token_id if principal else None,
        )

    def _behavior_factory(
        self, method: str
    ) -> Callable[[Callable[..., Any], bool], Callable[..., Any]]:
        def finish(
            context: grpc.ServicerContext,
            start: float,
            failed: bool,
            principal: Principal | None,
        ) -> None:
            self.handled(method, context, start, failed, principal)

        def make(behavior: Callable[..., Any], streaming: bool) -> Callable[..., Any]:
            def unary(request: Any, context: grpc.ServicerContext) -> Any:
                principal = self.authenticated(context, method)
                start, failed = time.perf_counter(), True
                token = CURRENT_PRINCIPAL.set(principal)
                method_token = CURRENT_METHOD.set(method)
                try:
                    refuse_malformed(request, context)
                    result = behavior(request, context)
                    failed = False
                    return result
                finally:
                    CURRENT_METHOD.reset(method_token)
                    CURRENT_PRINCIPAL.reset(token)
                    finish(context, start, failed, principal)

            def stream(request: Any, context: grpc.ServicerContext) -> Any:
                principal = self.authenticated(context, method)
                start, failed = time.perf_counter(), True
                try:
                    refuse_malformed(request, context)
                    # A generator runs on whichever thread pulls it: set the principal per step.
                    inner = behavior(request, context)
                    while True:
                        token = CURRENT_PRINCIPAL.set(principal)
                        method_token = CURRENT_METHOD.set(method)
                        try:
                            item = next(inner)
                        except StopIteration:
                            break
                        finally:
                            CURRENT_METHOD.reset(method_token)
                            CURRENT_PRINCIPAL.reset(token)
                        yield item
                    failed = False
                finally:
                    finish(context, start, failed, principal)

            return stream if streaming else unary

        return make


def _wrap(handler: Any, make: Callable[[Callable[..., Any], bool], Callable[..., Any]]) -> Any:
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            make(handler.unary_unary, False),
            request_deserializer=lenient(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            make(handler.unary_stream, True),
            request_deserializer=lenient(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
    if handler.stream_stream is not None:
        bidi = handler.stream_stream

        # Authenticated once, at the stream's start; each request checked as it arrives.
        def checked(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            return bidi(_checked(requests, context), context)

        return grpc.stream_stream_rpc_method_handler(
            make(checked, True),
            request_deserializer=lenient(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
    return handler


def _tolerant(handler: Any) -> Any:
    """Returns an open (framework) method's handler, parsing leniently and refusing garbage."""
    deserializer = lenient(handler.request_deserializer)
    serializer = handler.response_serializer
    if handler.unary_unary is not None:
        unary = handler.unary_unary

        def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
            refuse_malformed(request, context)
            return unary(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, deserializer, serializer)
    if handler.unary_stream is not None:
        server_stream = handler.unary_stream

        def unary_stream(
            request: Any,
            context: grpc.ServicerContext,
            send_response_callback: Callable[[Any], None] | None = None,
        ) -> Any:
            refuse_malformed(request, context)
            if send_response_callback is None:
                return server_stream(request, context)
            return server_stream(request, context, send_response_callback)

        # Health's Watch answers through a callback and holds no worker thread while
        # it waits; grpcio looks for these markers on the behaviour it is given.
        for marker in ("experimental_non_blocking", "experimental_thread_pool"):
            if hasattr(server_stream, marker):
                setattr(unary_stream, marker, getattr(server_stream, marker))
        return grpc.unary_stream_rpc_method_handler(unary_stream, deserializer, serializer)
    if handler.stream_unary is not None:
        client_stream = handler.stream_unary

        def stream_unary(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            return client_stream(_checked(requests, context), context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, deserializer, serializer)
    bidi = handler.stream_stream

    def stream_stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        yield from bidi(_checked(requests, context), context)

    return grpc.stream_stream_rpc_method_handler(stream_stream, deserializer, serializer)
