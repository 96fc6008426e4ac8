"""Subprocess for the kill -9 test: one atomic_write, logging the commit, then waiting to be killed.

Usage: atomic_kill_writer.py TARGET LOG SIZE SEED KILL_AT

The payload is ``random.Random(SEED).randbytes(SIZE)`` so the parent can recompute
it. KILL_AT names where the process SIGKILLs itself: a failpoint of the recipe,
"chunk:N" (after the N-th write call), "before_log" / "after_log" (inside
on_commit), or "none" (the parent kills it after a random delay). After the
commit the process blocks on stdin, so every run ends in a real SIGKILL.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

_CHUNK = 64 * 1024


def load_atomic() -> ModuleType:
    """Loads shard_client/atomic.py by path, skipping the package's heavier __init__."""
    # One interpreter start per kill: importing only atomic.py keeps 100+ runs fast.
    source = Path(__file__).resolve().parents[2] / "shard_client" / "atomic.py"
    spec = importlib.util.spec_from_file_location("shardledger_atomic_under_test", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def die() -> None:
    """Kills this process with SIGKILL, the signal no cleanup can intercept."""
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    """Runs one atomic write under the kill plan given on the command line."""
    target, log, size, seed, kill_at = sys.argv[1:6]
    atomic = load_atomic()
    payload = random.Random(int(seed)).randbytes(int(size))

    def failpoint(name: str) -> None:
        if name == kill_at:
            die()

    def on_commit(info: Any) -> None:
        if kill_at == "before_log":
            die()
        line = json.dumps({"path": info.path, "size": info.size_bytes, "blake3": info.blake3_hex})
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        if kill_at == "after_log":
            die()

    os.write(1, b"ready\n")
    with atomic.atomic_write(target, on_commit=on_commit, failpoint=failpoint) as f:
        for index, start in enumerate(range(0, len(payload), _CHUNK)):
            f.write(payload[start : start + _CHUNK])
            if kill_at == f"chunk:{index}":
                die()
    os.write(1, b"committed\n")
    sys.stdin.read()


if __name__ == "__main__":
    main()
