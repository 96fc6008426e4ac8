"""What `shardledger watch` collects from a hung process before it stops it: stacks and log tail."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

DIAG_ENV: Final = "SHARDLEDGER_DIAG_DIR"
LOG_FIELDS: Final = "{shard_id}, {attempt_id}, {pid}"
# How long a stack dump may take: faulthandler writes within milliseconds when the
# process runs at all, so a longer wait only delays the stop of a frozen one.
STACK_WAIT_S: Final = 5.0


def default_diag_dir() -> Path:
    """Returns where the SDK writes stack dumps and the watchdog writes its reports."""
    return Path(
        os.environ.get(DIAG_ENV) or Path(os.environ.get("TMPDIR", "/tmp")) / "shardledger-diag"
    )


def log_path(pattern: str, *, shard_id: str, attempt_id: str, pid: int | None) -> Path:
    """Returns the job log path for one attempt; ValueError names what is wrong with the pattern."""
    try:
        return Path(pattern.format(shard_id=shard_id, attempt_id=attempt_id, pid=pid))
    except KeyError as exc:
        raise ValueError(
            f"{pattern!r} names an unknown field {{{exc.args[0]}}} (known: {LOG_FIELDS})"
        ) from None
    except IndexError:
        raise ValueError(
            f"{pattern!r} has a positional field {{}} (use a named one: {LOG_FIELDS})"
        ) from None
    except (ValueError, AttributeError, TypeError) as exc:
        raise ValueError(f"{pattern!r} is not a valid path template: {exc}") from None


def _stopped(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] in ("T", "t")


_USR1_BIT: Final = 1 << (signal.SIGUSR1 - 1)  # its bit in /proc's signal masks


def _masks(pid: int) -> dict[str, dict[str, int]]:
    """Returns each thread's signal masks (SigPnd, SigBlk; ShdPnd is the process's)."""
    out: dict[str, dict[str, int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            lines = (task / "status").read_text().splitlines()
        except OSError:
            continue  # the thread ended
        fields = dict(line.split(":\t", 1) for line in lines if ":\t" in line)
        out[task.name] = {
            k: int(fields[k], 16) for k in ("SigPnd", "ShdPnd", "SigBlk") if k in fields
        }
    return out


def _dump_done(pid: int, blocked_before: set[str]) -> bool:
    """Returns True once SIGUSR1 is delivered and its handler has returned in every thread.

    faulthandler writes the whole dump inside the signal handler, and the kernel
    blocks SIGUSR1 in the thread running it until it returns: the dump is complete
    when the signal is pending nowhere and no thread that did not block it before
    blocks it now. This is the kernel's state, not a guess from the file's growth,
    which on a loaded machine can pause between threads for any length of time.
    """
    try:
        masks = _masks(pid)
    except OSError:
        return True  # the process is gone: whatever it wrote is all there is
    for tid, m in masks.items():
        if (m.get("SigPnd", 0) | m.get("ShdPnd", 0)) & _USR1_BIT:
            return False
        if m.get("SigBlk", 0) & _USR1_BIT and tid not in blocked_before:
            return False
    return True


def stack_dump(pid: int, attempt_id: str, diag_dir: Path, *, wait_s: float = STACK_WAIT_S) -> str:
    """Returns a stack dump of the process: py-spy if installed, else the SDK's faulthandler file."""
    if shutil.which("py-spy"):
        proc = subprocess.run(
            ["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30
        )
        if proc.returncode == 0:
            return proc.stdout
    if _stopped(pid):
        # SIGUSR1 stays pending in a stopped process (SIGSTOP, a debugger): no dump comes.
        return "(process is stopped: no stack dump)"
    stack_file = diag_dir / f"{attempt_id}.stack"
    before = stack_file.stat().st_size if stack_file.exists() else 0
    try:
        blocked_before = {t for t, m in _masks(pid).items() if m.get("SigBlk", 0) & _USR1_BIT}
        os.kill(pid, signal.SIGUSR1)
    except (ProcessLookupError, FileNotFoundError):
        return "(process already gone)"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(0.02)
        if _dump_done(pid, blocked_before):
            break
    size = stack_file.stat().st_size if stack_file.exists() else before
    if size <= before:
        return "(no stack dump: install py-spy, or run the job inside shard_client's shard context)"
    with stack_file.open("rb") as f:
        f.seek(before)
        return f.read().decode(errors="replace")


def log_tail(pattern: str | None, *, shard_id: str, attempt_id: str, pid: int, lines: int) -> str:
    """Returns the last lines of the attempt's job log ("" without a pattern)."""
    if not pattern:
        return ""
    path = log_path(pattern, shard_id=shard_id, attempt_id=attempt_id, pid=pid)
    if not path.exists():
        return f"(no log at {path})"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@dataclass(slots=True)
class Report:
    """The diagnostics report of one attempt: where it went and what could not be collected."""

    path: str = ""
    errors: list[str] = field(default_factory=list)


def write_report(
    *,
    shard_id: str,
    attempt_id: str,
    pid: int,
    diag_dir: Path,
    log_pattern: str | None,
    log_lines: int,
    stack: Callable[[], str] | None = None,
) -> Report:
    """Writes the stack dump and log tail to <diag_dir>/<attempt>.watchdog.txt; never raises OSError."""
    report = Report()
    # Each part is tried on its own: a hung job must still be stopped and recorded,
    # and a partial report (a stack without its log) beats none.
    try:
        diag_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        report.errors.append(f"cannot create {diag_dir}: {exc.strerror}")
    try:
        text = stack() if stack else stack_dump(pid, attempt_id, diag_dir)
    except (OSError, subprocess.SubprocessError) as exc:
        text = f"(no stack dump: {exc})"
        report.errors.append(f"stack dump failed: {exc}")
    try:
        tail = log_tail(
            log_pattern, shard_id=shard_id, attempt_id=attempt_id, pid=pid, lines=log_lines
        )
    except OSError as exc:
        tail = f"(cannot read log {exc.filename}: {exc.strerror})"
        report.errors.append(f"cannot read log {exc.filename}: {exc.strerror}")
    except ValueError as exc:
        tail = f"(bad --log-file: {exc})"
        report.errors.append(f"bad --log-file: {exc}")
    target = diag_dir / f"{attempt_id}.watchdog.txt"
    try:
        target.write_text(
            f"stale attempt {attempt_id} of shard {shard_id}, pid {pid}\n\n"
            f"== stack\n{text}\n== last log lines\n{tail}\n"
        )
    except OSError as exc:
        report.errors.append(f"cannot write {target}: {exc.strerror}")
        return report
    report.path = str(target)
    return report
