"""The benchmarks' shared baselines: a bare grpcio echo server, and a process's CPU time."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent import futures

import grpc

__all__ = ["echo_server", "process_cpu_s"]


def echo_server() -> tuple[grpc.Server, int]:
    """A bare grpcio server answering Echo (unary) and EchoStream (each message back)."""

    def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
        return request

    def echo_stream(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        yield from requests

    handler = grpc.method_handlers_generic_handler(
        "bench.Echo",
        {
            "Echo": grpc.unary_unary_rpc_method_handler(echo),
            "EchoStream": grpc.stream_stream_rpc_method_handler(echo_stream),
        },
    )
    # A stream holds a thread for its life: room for bench stream's 64 callers.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=96))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def process_cpu_s() -> float:
    times = os.times()
    return times.user + times.system
