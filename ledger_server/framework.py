"""The framework services: health (with List) and reflection, as both v1 and v1alpha."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final

import grpc
import structlog
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

HEALTH_SERVICE_NAME: Final = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
V1ALPHA_SERVICE_NAME: Final[str] = reflection.SERVICE_NAME
V1_SERVICE_NAME: Final = "grpc.reflection.v1.ServerReflection"
# The path the upstream grpc/reflection/v1/reflection.proto registers under.
V1_FILE: Final = "grpc/reflection/v1/reflection.proto"
_V1ALPHA_PACKAGE: Final = ".grpc.reflection.v1alpha."
_V1_PACKAGE: Final = ".grpc.reflection.v1."
log = structlog.get_logger("shardledger.server")


# How long a stop waits for the NOT_SERVING answers to reach open watches.
SHUTDOWN_DELIVERY_S: Final = 1.0
_SERVING: Final = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING: Final = health_pb2.HealthCheckResponse.NOT_SERVING
_UNKNOWN: Final = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


@dataclass(eq=False, slots=True)
class _Watch:
    """One open Watch: the status it last sent and the one it owes."""

    send: Callable[[Any], None]
    service: str
    owed: int | None
    sent: int | None = None
    finish: bool = False  # end the stream (status OK) after the owed answer
    gone: bool = False  # the client left; send nothing more


class LedgerHealth(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """The grpc.health.v1 service: Check, Watch and List.

    grpcio-health-checking 1.85 sends Watch answers while holding its lock; a send
    waits for grpcio's server thread, which may itself be waiting for that lock in a
    cancelled watch's close callback, and a stop deadlocked that way in CI (grpc#43403
    moves the sends out upstream). Here one delivery thread sends every answer and no
    lock is held while it does: set() (called by the ledger's writer when the store
    fails) never waits for a watcher, and a watcher that stops reading delays only
    other watchers, never the ledger. A watch that falls behind gets the latest status,
    not every flip in between.
    """

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._status: dict[str, int] = {"": _SERVING}
        self._watches: dict[str, set[_Watch]] = {}
        self._owing: list[_Watch] = []
        self._shutting_down = False
        self._delivery: threading.Thread | None = None

    def Check(self, request: Any, context: grpc.ServicerContext) -> Any:
        """Answers a service's status; NOT_FOUND for a name never set."""
        with self._lock:
            status = self._status.get(request.service)
        if status is None:
            context.set_code(grpc.StatusCode.NOT_FOUND)
            return health_pb2.HealthCheckResponse()
        return health_pb2.HealthCheckResponse(status=status)

    def Watch(
        self,
        request: Any,
        context: grpc.ServicerContext,
        send_response_callback: Callable[[Any], None] | None = None,
    ) -> Any:
        """Streams a service's status now and at every change, holding no worker thread."""
        if send_response_callback is None:  # a server without non-blocking streams
            raise RuntimeError("health Watch needs grpcio's non-blocking server streams")
        watch = self.open_watch(request.service, send_response_callback)
        context.add_callback(lambda: self.close_watch(watch))
        return None

    Watch.experimental_non_blocking = True  # type: ignore[attr-defined]
    Watch.experimental_thread_pool = None  # type: ignore[attr-defined]

    def open_watch(self, service: str, send: Callable[[Any], None]) -> _Watch:
        """Starts a watch of service: send(answer) now and at every change, send(None) at the end.

        send is called from the delivery thread, never with a lock held.
        """
        with self._lock:
            watch = _Watch(send, service, self._status.get(service, _UNKNOWN))
            watch.finish = self._shutting_down
            self._watches.setdefault(service, set()).add(watch)
            self._owe(watch)
            self._start_delivery()
        return watch

    def List(self, request: Any, context: grpc.ServicerContext) -> Any:
        """Answers every service's status, as Check answers each (NOT_SERVING while stopping)."""
        with self._lock:
            statuses = {
                name: health_pb2.HealthCheckResponse(status=status)
                for name, status in sorted(self._status.items())
            }
        return health_pb2.HealthListResponse(statuses=statuses)

    def set(self, service: str, status: Any) -> None:
        """Sets a service's status and queues it for its watchers; ignored once stopping."""
        with self._lock:
            if self._shutting_down:
                return
            self._status[service] = status
            for watch in self._watches.get(service, ()):
                watch.owed = status
                self._owe(watch)

    def enter_graceful_shutdown(self) -> None:
        """Sets every service NOT_SERVING for good, tells each watcher and ends its stream.

        Waits up to SHUTDOWN_DELIVERY_S for those answers to go out, so a load
        balancer hears NOT_SERVING before the drain; never longer.
        """
        with self._lock:
            if self._shutting_down:
                return
            self._shutting_down = True
            for service in self._status:
                self._status[service] = _NOT_SERVING
            for watches in self._watches.values():
                for watch in watches:
                    watch.owed = _NOT_SERVING if watch.service in self._status else watch.owed
                    watch.finish = True
                    self._owe(watch)
            self._lock.wait_for(lambda: not self._owing, SHUTDOWN_DELIVERY_S)

    def _owe(self, watch: _Watch) -> None:
        """Queues watch for the delivery thread; the caller holds the lock."""
        if watch not in self._owing:
            self._owing.append(watch)
            self._lock.notify_all()

    def close_watch(self, watch: _Watch) -> None:
        """Ends a watch whose stream ended (the client left): nothing more is sent to it."""
        with self._lock:
            watch.gone = True
            self._watches.get(watch.service, set()).discard(watch)

    def _start_delivery(self) -> None:
        if self._delivery is None:
            self._delivery = threading.Thread(
                target=self._deliver, name="health-watch-delivery", daemon=True
            )
            self._delivery.start()

    def _deliver(self) -> None:
        """Sends what each watch is owed, one at a time, with no lock held."""
        while True:
            with self._lock:
                self._lock.wait_for(lambda: bool(self._owing))
                watch = self._owing[0]
                owed, finish = watch.owed, watch.finish
                skip = watch.gone or (owed == watch.sent and not finish)
            if not skip:
                try:
                    if owed != watch.sent:
                        watch.send(health_pb2.HealthCheckResponse(status=owed))
                        watch.sent = owed
                    if finish:
                        watch.send(None)  # grpcio ends the stream with status OK
                except Exception:  # one broken stream must not end delivery to the rest
                    log.exception("health_watch_send_failed", service=watch.service)
                    finish = True
            with self._lock:
                done = watch.owed == owed and watch.finish == finish
                if done or watch.gone:
                    self._owing.remove(watch)
                if finish:
                    watch.gone = True
                    self._watches.get(watch.service, set()).discard(watch)
                self._lock.notify_all()


def _v1_file_proto() -> descriptor_pb2.FileDescriptorProto:
    """Returns v1's file descriptor: v1alpha's, renamed into the grpc.reflection.v1 package."""
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = V1_FILE, "grpc.reflection.v1"
    for message in proto.message_type:
        for field in (f for f in message.field if f.HasField("type_name")):
            field.type_name = field.type_name.replace(_V1ALPHA_PACKAGE, _V1_PACKAGE)
    for method in proto.service[0].method:
        method.input_type = method.input_type.replace(_V1ALPHA_PACKAGE, _V1_PACKAGE)
        method.output_type = method.output_type.replace(_V1ALPHA_PACKAGE, _V1_PACKAGE)
    proto.options.Clear()
    proto.options.java_package = "io.grpc.reflection.v1"
    proto.options.java_outer_classname = "ServerReflectionProto"
    proto.options.java_multiple_files = True
    proto.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    return proto


def register_v1_descriptors(pool: descriptor_pool.DescriptorPool | None = None) -> None:
    """Adds grpc.reflection.v1 to the pool, so reflection can describe itself; idempotent."""
    pool = pool or descriptor_pool.Default()
    try:
        pool.FindFileByName(V1_FILE)  # a grpcio-reflection that ships v1 has put it there
    except KeyError:
        pool.Add(_v1_file_proto())


def enable_reflection(service_names: Iterable[str], server: grpc.Server | grpc.aio.Server) -> None:
    """Serves reflection of service_names (and of itself) as both v1 and v1alpha."""
    register_v1_descriptors()
    names = (*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    # The asyncio server takes the asyncio servicer (same answers, an async generator).
    is_aio = isinstance(server, grpc.aio.Server)
    servicer = (
        reflection.aio.ReflectionServicer  # type: ignore[attr-defined]
        if is_aio
        else reflection.ReflectionServicer
    )(names)
    # grpcio-reflection 1.85 ships v1alpha only. v1's messages are v1alpha's field for
    # field (only the package differs), so the bytes on the wire are identical and the
    # one servicer answers both services with v1alpha's (de)serializers.
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": handler})
            for name in (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
        ]
    )
