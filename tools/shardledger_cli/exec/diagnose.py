"""What `shardledger exec` writes about its child: the process group's state and its last output.

A child in another language has no Python stacks to dump, so the bundle reads
what Linux shows of every process in the child's process group: command line,
state, the kernel function it sleeps in (``wchan``), its kernel stack where
readable (root only), its current system call, memory, open files; then the
child's last output lines and the GPUs' state. Every section degrades to a line
saying why it is empty. Bundles are written atomically under the diagnostics
directory ($SHARDLEDGER_DIAG_DIR), as the SDK's are.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Final

from shard_client.atomic import CommitInfo, atomic_write, makedirs_durable
from shard_client.diagnostics import nvml_state
from shard_client.signals import diagnostics_dir

__all__ = ["group_members", "group_report", "write_bundle"]

_MAX_FDS: Final = 64
_MAX_MEMBERS: Final = 32


def group_members(pgid: int) -> list[int]:
    """Returns the pids whose process group is pgid, sorted (from /proc)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        fields = stat.rpartition(")")[2].split()
        # After the command name: state (3), ppid (4), pgrp (5).
        if len(fields) > 2 and fields[2] == str(pgid):
            found.append(int(entry.name))
    return sorted(found)


def _read(path: str, limit: int = 4096) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", "replace")
    except OSError as exc:
        return f"unavailable ({exc.strerror})"


def _status_fields(pid: int) -> str:
    text = _read(f"/proc/{pid}/status")
    keep = ("State:", "VmRSS:", "VmHWM:", "Threads:", "voluntary_ctxt_switches:")
    return ", ".join(" ".join(line.split()) for line in text.splitlines() if line.startswith(keep))


def _fds(pid: int) -> str:
    try:
        names = sorted(os.listdir(f"/proc/{pid}/fd"), key=int)
    except OSError as exc:
        return f"  unavailable ({exc.strerror})"
    lines = []
    for fd in names[:_MAX_FDS]:
        try:
            lines.append(f"  {fd}: {os.readlink(f'/proc/{pid}/fd/{fd}')}")
        except OSError:
            continue
    more = f"\n  ... {len(names) - _MAX_FDS} more" if len(names) > _MAX_FDS else ""
    return "\n".join(lines) + more


def _process(pid: int) -> str:
    cmdline = _read(f"/proc/{pid}/cmdline").replace("\0", " ").strip()
    stack = _read(f"/proc/{pid}/stack").rstrip()
    return (
        f"-- pid {pid}: {cmdline}\n"
        f"status: {_status_fields(pid)}\n"
        f"wchan: {_read(f'/proc/{pid}/wchan')}\n"
        f"syscall: {_read(f'/proc/{pid}/syscall').strip()}\n"
        f"kernel stack:\n{stack}\n"
        f"open files:\n{_fds(pid)}\n"
    )


def group_report(pgid: int) -> str:
    """Returns the state of every process in the group, one block each."""
    members = group_members(pgid)
    if not members:
        return f"no process left in group {pgid}\n"
    blocks = [_process(pid) for pid in members[:_MAX_MEMBERS]]
    more = (
        f"... {len(members) - _MAX_MEMBERS} more processes\n" if len(members) > _MAX_MEMBERS else ""
    )
    return f"{len(members)} processes in group {pgid}\n" + "\n".join(blocks) + more


def _section(title: str, body: Callable[[], str]) -> str:
    try:
        text = body()
    except Exception as exc:  # one unreadable section must not lose the others
        text = f"unavailable: {type(exc).__name__}: {exc}\n"
    return f"== {title} ==\n{text.rstrip()}\n\n"


def write_bundle(
    *,
    attempt_id: str,
    header: str,
    kind: str,
    pgid: int | None,
    tail: Iterable[str],
    with_gpus: bool = True,
) -> CommitInfo:
    """Writes <diagnostics dir>/<attempt>.<kind>.txt atomically; returns its commit."""
    body = (
        f"{header}\nhost {socket.gethostname()} wrapper pid {os.getpid()}"
        f" time {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n\n"
    )
    if pgid is not None:
        body += _section("child process group", lambda: group_report(pgid))
    body += _section("last output lines", lambda: "".join(tail) or "(no output)\n")
    if with_gpus:
        body += _section("nvml", nvml_state)
    path = os.path.join(diagnostics_dir(), f"{attempt_id}.{kind}.txt")
    makedirs_durable(os.path.dirname(path))
    with atomic_write(path, mode="w") as f:
        f.write(body)
    info: CommitInfo = f.commit_info
    return info
