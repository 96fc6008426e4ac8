"""The diagnostics bundle a hung attempt leaves: stacks, GPU state, last log lines, open files.

One plain-text file per attempt, ``<diagnostics dir>/<attempt>.hang.txt``,
committed atomically (temp file, fsync, rename) so a reader never sees half of
it, and its BLAKE3 recorded with ``failed(timeout)``. It is evidence, not an
output of the shard. Every section degrades to a line saying why it is empty:
a missing NVML, an unreadable log or no /proc never stops the bundle.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from shard_client.atomic import CommitInfo, atomic_write, makedirs_durable
from shard_client.environment import NvmlSeam, PynvmlSeam
from shard_client.signals import diagnostics_dir

__all__ = ["LOG_TAIL_LINES", "BundleContext", "bundle_path", "write_bundle"]

LOG_TAIL_LINES: Final = 200
_LOG_TAIL_BYTES: Final = 256 * 1024
_MAX_FDS: Final = 512


@dataclass(frozen=True, slots=True)
class BundleContext:
    """Who the bundle is about."""

    run_id: str
    shard_id: str
    attempt_id: str


def bundle_path(attempt_id: str) -> str:
    """Returns where an attempt's bundle goes: <diagnostics dir>/<attempt>.hang.txt."""
    return os.path.join(diagnostics_dir(), f"{attempt_id}.hang.txt")


def _section(title: str, body: Callable[[], str]) -> str:
    try:
        text = body()
    except Exception as exc:  # one unreadable section must not lose the others
        text = f"unavailable: {type(exc).__name__}: {exc}\n"
    return f"== {title} ==\n{text.rstrip()}\n\n"


def thread_stacks() -> str:
    """Returns every thread's Python stack, named, the way traceback prints them."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sorted(sys._current_frames().items()):
        name = names.get(ident, "?")
        stack = "".join(traceback.format_stack(frame))
        parts.append(f"Thread {ident} ({name}), most recent call last:\n{stack}")
    return "\n".join(parts)


def nvml_state(nvml: NvmlSeam | None = None) -> str:
    """Returns the driver and each GPU's fields from NVML, or why NVML is unavailable."""
    seam = nvml if nvml is not None else PynvmlSeam()
    try:
        seam.init()
    except Exception as exc:
        return f"nvml unavailable: {type(exc).__name__}: {exc}\n"
    lines: list[str] = []
    try:
        lines.append(f"driver {seam.driver_version()} cuda {seam.cuda_driver_version()}")
        for index in range(seam.device_count()):
            fields = seam.device(index)
            lines.append(f"gpu {index}: " + " ".join(f"{k}={v}" for k, v in fields.items()))
    except Exception as exc:  # keep what was read before the failing query
        lines.append(f"nvml query failed: {type(exc).__name__}: {exc}")
    try:
        seam.shutdown()
    except Exception as exc:  # what was read stands; say so rather than hide it
        lines.append(f"nvml shutdown failed: {exc}")
    return "\n".join(lines) + "\n"


def log_tail(path: str | None, lines: int = LOG_TAIL_LINES) -> str:
    """Returns the last lines of the job's log file (at most 256 KiB), or why there are none."""
    if not path:
        return "no log_file configured (ledger.shard(..., log_file=PATH))\n"
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(size - _LOG_TAIL_BYTES, 0))
        data = f.read()
    text = data.decode("utf-8", errors="replace").splitlines()[-lines:]
    return f"{path} (last {len(text)} lines)\n" + "\n".join(text) + "\n"


def _socket_table() -> dict[str, str]:
    """Returns socket inode -> 'proto local -> remote state' from /proc/self/net."""
    states = {"01": "ESTABLISHED", "02": "SYN_SENT", "06": "TIME_WAIT", "0A": "LISTEN"}
    table: dict[str, str] = {}
    for proto in ("tcp", "tcp6"):
        try:
            with open(f"/proc/self/net/{proto}", encoding="ascii") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9:
                state = states.get(cols[3], cols[3])
                table[cols[9]] = f"{proto} {_addr(cols[1])} -> {_addr(cols[2])} {state}"
    return table


def _addr(hex_addr: str) -> str:
    """Returns a /proc/net address (hex ip:port) as ip:port; IPv6 stays hex."""
    ip, _, port = hex_addr.partition(":")
    if len(ip) == 8:
        ip = ".".join(str(int(ip[i : i + 2], 16)) for i in (6, 4, 2, 0))
    return f"{ip}:{int(port, 16)}"


def open_files() -> str:
    """Returns the process's open descriptors from /proc/self/fd, sockets resolved where TCP."""
    fds = sorted(os.listdir("/proc/self/fd"), key=int)
    sockets = _socket_table()
    lines, kinds = [], dict[str, int]()
    for fd in fds[:_MAX_FDS]:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (the listdir's own descriptor, for one)
        kind = target.split(":", 1)[0] if ":" in target and not target.startswith("/") else "file"
        kinds[kind] = kinds.get(kind, 0) + 1
        if kind == "socket":
            target += f" {sockets.get(target[8:-1], '(not TCP)')}"
        lines.append(f"{fd}: {target}")
    summary = ", ".join(f"{k}={n}" for k, n in sorted(kinds.items()))
    more = f"\n... {len(fds) - _MAX_FDS} more" if len(fds) > _MAX_FDS else ""
    return f"{len(fds)} open: {summary}\n" + "\n".join(lines) + more + "\n"


def write_bundle(
    ctx: BundleContext,
    *,
    message: str,
    log_file: str | None = None,
    nvml: NvmlSeam | None = None,
) -> CommitInfo:
    """Writes the attempt's bundle atomically under the diagnostics dir; returns its commit."""
    header = (
        f"run {ctx.run_id} shard {ctx.shard_id} attempt {ctx.attempt_id}\n"
        f"host {socket.gethostname()} pid {os.getpid()}"
        f" time {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n{message}\n\n"
    )
    # Stacks first: they are the point, and the later sections take time to read.
    body = header + _section("thread stacks", thread_stacks)
    body += _section("nvml", lambda: nvml_state(nvml))
    body += _section("log tail", lambda: log_tail(log_file))
    body += _section("open file descriptors", open_files)
    path = bundle_path(ctx.attempt_id)
    makedirs_durable(os.path.dirname(path))
    with atomic_write(path, mode="w") as f:
        f.write(body)
    info: CommitInfo = f.commit_info
    return info
