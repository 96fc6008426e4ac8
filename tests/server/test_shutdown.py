"""SIGTERM always ends `shardledger serve`, even after garbage sent to the framework services.

An independent campaign hung 3 of 6 servers this way: two undecodable bytes to the
reflection or health service, then SIGTERM logged `shutdown_requested` and the
process never exited (grpcio's graceful stop waited on a call that never ended).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

GRACE_S = 1.0
# The stop drains for the grace, waits grpcio 3 s more, then cancels every call.
BOUND_S = GRACE_S + 3.0 + 5.0
GARBAGE = b"\xff\x0f"
FRAMEWORK_METHODS = (
    ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", "stream"),
    ("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", "stream"),
    ("/grpc.health.v1.Health/Check", "unary"),
    ("/grpc.health.v1.Health/Watch", "server_stream"),
    ("/grpc.health.v1.Health/List", "unary"),
)


def serve(tmp_path: Path) -> tuple[subprocess.Popen[str], int]:
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shardledger_cli",
            "serve",
            "--db",
            str(tmp_path / "ledger.db"),
            "--listen",
            "127.0.0.1:0",
            "--port-file",
            str(port_file),
            "--grace",
            str(GRACE_S),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while not port_file.exists() or not port_file.read_text().strip():
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline, "serve did not start"
        time.sleep(0.05)
    return proc, int(port_file.read_text())


def send_garbage(port: int) -> None:
    """Sends undecodable bytes to every framework method; the answers do not matter here."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        raw = {"request_serializer": None, "response_deserializer": None}
        for path, kind in FRAMEWORK_METHODS:
            try:
                if kind == "stream":
                    list(channel.stream_stream(path, **raw)(iter([GARBAGE]), timeout=3))
                elif kind == "server_stream":
                    list(channel.unary_stream(path, **raw)(GARBAGE, timeout=3))
                else:
                    channel.unary_unary(path, **raw)(GARBAGE, timeout=3)
            except grpc.RpcError:
                pass  # refused, as it should be; whether it is refused well is another test


@pytest.mark.parametrize("round_", range(4))
def test_sigterm_ends_serve_after_garbage_to_every_framework_service(
    tmp_path: Path, round_: int
) -> None:
    proc, port = serve(tmp_path)
    try:
        for _ in range(2):
            send_garbage(port)
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=BOUND_S + 20)
        took = time.monotonic() - began
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0
    assert took < BOUND_S, f"SIGTERM took {took:.1f} s (bound {BOUND_S} s)"
