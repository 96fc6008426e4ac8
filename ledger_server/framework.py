"""The framework services: health (with List) and reflection, as both v1 and v1alpha."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any, Final

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1ALPHA_SERVICE_NAME: Final[str] = reflection.SERVICE_NAME
V1_SERVICE_NAME: Final = "grpc.reflection.v1.ServerReflection"
# The path the upstream grpc/reflection/v1/reflection.proto registers under.
V1_FILE: Final = "grpc/reflection/v1/reflection.proto"
_V1ALPHA_PACKAGE: Final = ".grpc.reflection.v1alpha."
_V1_PACKAGE: Final = ".grpc.reflection.v1."


class LedgerHealth(health.HealthServicer):
    """grpcio's health servicer plus List, which grpcio-health-checking 1.85 leaves UNIMPLEMENTED."""

    def __init__(self) -> None:
        super().__init__()
        self._names_lock = threading.Lock()
        self._names: set[str] = {""}  # grpcio's servicer starts with "" SERVING

    def set(self, service: str, status: Any) -> None:
        """Sets a service's status, remembering its name for List."""
        with self._names_lock:
            self._names.add(service)
        super().set(service, status)

    def List(self, request: Any, context: grpc.ServicerContext) -> Any:
        """Answers every service's status, as Check answers each (NOT_SERVING while stopping)."""
        with self._names_lock:
            names = sorted(self._names)
        statuses = {
            name: self.Check(health_pb2.HealthCheckRequest(service=name), context) for name in names
        }
        return health_pb2.HealthListResponse(statuses=statuses)


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


def enable_reflection(service_names: Iterable[str], server: grpc.Server) -> None:
    """Serves reflection of service_names (and of itself) as both v1 and v1alpha."""
    register_v1_descriptors()
    names = (*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    servicer = reflection.ReflectionServicer(names)
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
