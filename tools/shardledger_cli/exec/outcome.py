"""How an exec'd child's end is tagged: exit status, signals, the cgroup's OOM counter, its last words.

The rules, in order (the first that applies wins):

1. the cgroup's ``memory.events`` ``oom_kill`` counter rose while the child ran → ``oom``;
2. the wrapper got SIGTERM (a scheduler's preemption or time limit), or the child
   died of SIGTERM (exit 143) → ``preempted``;
3. the child died of SIGKILL (exit 137) → ``oom`` if its last output says so, else ``killed``;
4. SIGINT (exit 130), to the child or the wrapper → ``killed``;
5. anything else non-zero → what the last output lines point to
   (`shard_client.classify.failure_tag_of_output`: ``oom``, ``data``, ``nccl``), else ``unknown``.

Exit statuses above 128 count as 128 + a signal number, as shells report a
child's death by signal (``bash -c 'kill -9 $$'`` is 137 to its parent).
"""

from __future__ import annotations

import shlex
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from shard_client.classify import MAX_MESSAGE_CHARS, failure_tag_of_output
from shard_client.vocabulary import FailureTag
from shardledger_cli.exec.supervise import ChildResult

__all__ = ["Verdict", "cgroup_oom_kills", "judge_failure", "oom_delta", "signal_of"]

_CGROUP_ROOT: Final = Path("/sys/fs/cgroup")
_MESSAGE_TAIL_LINES: Final = 20


@dataclass(frozen=True, slots=True)
class Verdict:
    """The failure tag and message of a child that did not end cleanly."""

    tag: FailureTag
    message: str


def cgroup_oom_kills(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = _CGROUP_ROOT
) -> int | None:
    """Returns the OOM kills counted in this process's memory cgroup, or None when unreadable.

    cgroup v2: ``memory.events`` ``oom_kill`` (the subtree's); cgroup v1:
    ``memory.oom_control`` ``oom_kill`` of the memory hierarchy.
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if controllers == "":
            candidates.append(root / path.lstrip("/") / "memory.events")
        elif "memory" in controllers.split(","):
            candidates.append(root / "memory" / path.lstrip("/") / "memory.oom_control")
    for events in candidates:
        count = _oom_kill_count(events)
        if count is not None:
            return count
    return None


def _oom_kill_count(events: Path) -> int | None:
    try:
        text = events.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def signal_of(returncode: int) -> int | None:
    """Returns the signal a child died of: -N from subprocess, or 128+N from a shell."""
    if returncode < 0:
        return -returncode
    if 128 < returncode < 128 + signal.NSIG:
        return returncode - 128
    return None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _tag(result: ChildResult, oom_kills: int) -> tuple[FailureTag, str]:
    sig = signal_of(result.returncode)
    said = failure_tag_of_output("".join(result.tail[-_MESSAGE_TAIL_LINES:]))
    if oom_kills > 0:
        return FailureTag.OOM, f"the cgroup's memory.events oom_kill rose by {oom_kills}"
    if result.term_received:
        return FailureTag.PREEMPTED, "SIGTERM reached shardledger exec and was forwarded"
    if sig == signal.SIGTERM:
        return FailureTag.PREEMPTED, "the child died of SIGTERM"
    if sig == signal.SIGKILL:
        if said == FailureTag.OOM:
            return FailureTag.OOM, "SIGKILL, and its last output says it ran out of memory"
        return FailureTag.KILLED, "the child died of SIGKILL"
    if sig == signal.SIGINT or signal.SIGINT in result.signals:
        return FailureTag.KILLED, "interrupted (SIGINT)"
    return said, ""


def judge_failure(result: ChildResult, argv: Sequence[str], *, oom_kills: int) -> Verdict:
    """Returns the tag and message for a child that exited non-zero or died of a signal."""
    tag, why = _tag(result, oom_kills)
    sig = signal_of(result.returncode)
    if sig is None:
        how = f"exited with status {result.returncode}"
    elif result.returncode < 0:
        how = f"was killed by {_signal_name(sig)} (exit status {result.exit_code})"
    else:
        how = f"exited with status {result.returncode} ({_signal_name(sig)} in a child of it)"
    command = shlex.join(argv)
    head = f"{command[:200]} {how}" + (f": {why}" if why else "")
    tail = "".join(result.tail[-_MESSAGE_TAIL_LINES:]).rstrip()
    message = head + (f"\nlast output:\n{tail}" if tail else "")
    return Verdict(tag=tag, message=message[:MAX_MESSAGE_CHARS])


def oom_delta(before: int | None) -> int:
    """Returns how much the cgroup's oom_kill counter rose since ``before`` (0 when unknown)."""
    after = cgroup_oom_kills()
    if before is None or after is None:
        return 0
    return max(after - before, 0)
