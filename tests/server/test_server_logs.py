"""What `shardledger serve` prints while a user works: lifecycle and problems, not one line per call.

The README starts the ledger with `shardledger serve &` in the user's own
terminal, so every line it logs lands between the user's commands and their
answers. Each test starts the real command, makes real calls (one of them a
NOT_FOUND a newcomer would make), stops it with SIGTERM and reads what it
wrote: to a pipe (JSON, a collector's format) or to a terminal (a pty:
structlog's readable lines).
"""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shard_client import LedgerClient
from tests.builders import planned, run_cli

HANDLED = "request_handled"


def serve(tmp_path: Path, *extra: str, tty: bool = False) -> tuple[int, str]:
    """Runs serve, makes an append and a NOT_FOUND read, stops it; returns (exit code, its stderr)."""
    port_file = tmp_path / "port"
    command = [
        sys.executable,
        "-m",
        "shardledger_cli",
        "serve",
        *("--db", str(tmp_path / "l.db"), "--listen", "127.0.0.1:0"),
        *("--port-file", str(port_file), *extra),
    ]
    if tty:
        parent, child = pty.openpty()
        proc = subprocess.Popen(command, stderr=child, stdout=subprocess.DEVNULL)
        os.close(child)
    else:
        proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text():
            assert time.monotonic() < deadline, "serve did not start"
            assert proc.poll() is None, "serve exited before it served"
            time.sleep(0.05)
        target = f"127.0.0.1:{port_file.read_text()}"
        client = LedgerClient(target)
        client.append([planned()])
        client.close()
        done = subprocess.run(
            [sys.executable, "-m", "shardledger_cli", "status", "nigth-01", "--server", target],
            capture_output=True,
            timeout=60,
        )
        assert done.returncode == 4
        proc.send_signal(signal.SIGTERM)
        if tty:
            output = _read_pty(parent, proc)
        else:
            assert proc.stderr is not None
            output = proc.stderr.read().decode()
        return proc.wait(timeout=30), output
    finally:
        if proc.poll() is None:
            proc.kill()
        if tty:
            os.close(parent)


def _read_pty(fd: int, proc: subprocess.Popen[bytes]) -> str:
    chunks = []
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: the child side closed, the process is gone
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=30)
    return b"".join(chunks).decode(errors="replace")


def test_a_piped_server_logs_json_lifecycle_lines_and_no_line_per_call(tmp_path: Path) -> None:
    code, logs = serve(tmp_path)
    assert code == 0
    lines = [json.loads(line) for line in logs.splitlines() if line.startswith("{")]
    events = [e["event"] for e in lines]
    assert "server_stopped" in events
    assert HANDLED not in events
    assert "NOT_FOUND" not in logs


def test_the_access_log_option_logs_every_call_with_its_code(tmp_path: Path) -> None:
    code, logs = serve(tmp_path, "--access-log")
    assert code == 0
    handled = [
        e
        for e in (json.loads(x) for x in logs.splitlines() if x.startswith("{"))
        if e["event"] == HANDLED
    ]
    methods = {(e["method"].rsplit("/", 1)[1], e["code"], e["level"]) for e in handled}
    # The SDK's appends go on its stream: each batch is one line, and so is the stream's end.
    assert ("StreamAppendEvents", "OK", "info") in methods
    assert not any(code == "CANCELLED" for _, code, _ in methods)  # the job ended it cleanly
    assert any(code == "NOT_FOUND" for _, code, _ in methods)


def test_debug_level_shows_each_call_without_the_access_log(tmp_path: Path) -> None:
    code, logs = serve(tmp_path, "--log-level", "debug")
    assert code == 0
    levels = {json.loads(x)["level"] for x in logs.splitlines() if HANDLED in x}
    assert levels == {"debug"}


def test_a_terminal_gets_readable_lines_and_log_format_json_still_gets_json(
    tmp_path: Path,
) -> None:
    code, logs = serve(tmp_path, tty=True)
    assert code == 0
    stopped = [line for line in logs.splitlines() if "server_stopped" in line]
    assert len(stopped) == 1 and not stopped[0].lstrip().startswith("{"), logs
    assert HANDLED not in logs
    (tmp_path / "json").mkdir()
    code, logs = serve(tmp_path / "json", "--log-format", "json", tty=True)
    assert code == 0
    (stopped_json,) = [line for line in logs.splitlines() if "server_stopped" in line]
    assert json.loads(stopped_json)["event"] == "server_stopped"


def test_an_unknown_log_format_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "serve", "--log-format", "yaml")
    assert code == 2
    assert "console" in err and "json" in err
