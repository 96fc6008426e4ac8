"""The child of `shardledger exec`: spawned in its own process group, watched, signalled, reaped.

The wrapper passes the child's output through line by line (reading it is how
progress lines and liveness are seen), forwards TERM, INT, HUP, QUIT and USR2 to
the child's whole process group, turns a scheduler's TERM into a grace period
that ends with KILL, and runs the hang watchdog (the SDK's threshold rules,
`shard_client.watchdog.HangPolicy`, on the SDK's `ProgressClock`). SIGUSR1, the
signal `shardledger watch` sends for a stack dump, writes the child group's
state to <diagnostics dir>/<attempt>.stack instead of reaching the child, whose
default action would be to die of it.

When the child exits, whatever is left of its process group (a background job
of a shell script) is killed before anything else: a straggler holding an
output open could otherwise write into it after the commit. When the wrapper
itself dies, the child's parent-death signal and the guard kill the group
(exec/guard.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, Any, Final, Literal

from shard_client.atomic import CommitInfo
from shard_client.signals import diagnostics_dir
from shard_client.watchdog import HangPolicy, ProgressClock
from shardledger_cli.exec.diagnose import group_report, write_bundle
from shardledger_cli.exec.guard import Guard, spawn
from shardledger_cli.exec.progress import Progress, parse_progress, parse_progress_file

__all__ = ["FORWARDED", "TAIL_LINES", "ChildResult", "Hang", "Supervisor"]

log = logging.getLogger("shard_client")

FORWARDED: Final = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR2)
TAIL_LINES: Final = 200
_POLL_S: Final = 0.05
_MAX_LINE: Final = 64 * 1024
_LINE_END: Final = re.compile(rb"[\r\n]")
# How long the wrapper waits for the child's pipes to close once the group is gone.
_DRAIN_S: Final = 5.0
Liveness = Literal["output", "progress"]


@dataclass(slots=True)
class Hang:
    """The watchdog's finding: how long the child was quiet, against which threshold."""

    quiet_s: float
    threshold_s: float
    basis: str
    diagnostics: CommitInfo | None = None

    def message(self, kill_grace_s: float, liveness: Liveness) -> str:
        """Returns the failed(timeout) message."""
        seen = "progress report" if liveness == "progress" else "output line or progress report"
        return (
            f"hung: no {seen} for {self.quiet_s:.1f}s (threshold {self.threshold_s:.1f}s ="
            f" {self.basis}); stopped by shardledger exec with SIGTERM to its process group,"
            f" SIGKILL after {kill_grace_s:g}s"
        )


@dataclass(slots=True)
class ChildResult:
    """How the child ended, and what the wrapper saw on the way."""

    returncode: int  # as subprocess has it: negative for a signal
    signals: list[int] = field(default_factory=list)  # received by the wrapper and forwarded
    hang: Hang | None = None
    tail: list[str] = field(default_factory=list)  # the last output lines, stderr and stdout

    @property
    def term_received(self) -> bool:
        """Returns whether a SIGTERM reached the wrapper (a scheduler stopping the job)."""
        return signal.SIGTERM in self.signals

    @property
    def exit_code(self) -> int:
        """Returns the exit status a shell reports for the child: 128+N for signal N."""
        return 128 - self.returncode if self.returncode < 0 else self.returncode


@dataclass
class Supervisor:
    """Runs one child to its end; ``on_progress`` gets each progress report."""

    argv: Sequence[str]
    env: Mapping[str, str]
    attempt_id: str
    on_progress: Callable[[Progress], None]
    on_hang: Callable[[Hang], None]  # records failed(timeout) before any signal is sent
    policy: HangPolicy | None
    liveness: Liveness = "output"
    term_grace_s: float = 30.0
    progress_file: str = ""
    guard: Guard | None = None  # kills the child's group if the wrapper dies
    clock: ProgressClock = field(init=False, default_factory=ProgressClock)
    _tail: deque[str] = field(init=False, default_factory=lambda: deque(maxlen=TAIL_LINES))
    _signals: list[int] = field(init=False, default_factory=list)
    _dump_requested: bool = field(init=False, default=False)
    _proc: subprocess.Popen[bytes] | None = field(init=False, default=None)
    _file_stamp: tuple[int, int] = field(init=False, default=(0, 0))
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def run(self) -> ChildResult:
        """Spawns the child, supervises it to its end and returns how it ended.

        Raises OSError when the command cannot be started (not found, not executable).
        """
        previous = self._install_handlers()
        try:
            return self._run()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _install_handlers(self) -> dict[int, Any]:
        previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return previous  # signal handlers live in the main thread only
        for signum in (*FORWARDED, signal.SIGUSR1):
            previous[signum] = signal.signal(signum, self._handle)
        return previous

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGUSR1:
            self._dump_requested = True
            return
        self._signals.append(signum)
        proc = self._proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signum)

    def _run(self) -> ChildResult:
        self.clock = ProgressClock()
        # Its own group, with a parent-death signal, under the guard (exec/guard.py).
        proc = spawn(self.argv, self.env, guard=self.guard)
        self._proc = proc
        for signum in list(self._signals):  # arrived while the child was being created
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signum)
        assert proc.stdout is not None and proc.stderr is not None
        readers = [
            self._reader(proc.stdout, sys.stdout.buffer, "stdout"),
            self._reader(proc.stderr, sys.stderr.buffer, "stderr"),
        ]
        hang = self._watch(proc)
        # The group outlives its leader when a shell left a background job behind.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        returncode = proc.wait()
        if self.guard is not None:
            self.guard.disarm()
        for reader in readers:
            reader.join(_DRAIN_S)
        self._poll_progress_file()
        with self._lock:
            tail = list(self._tail)
        return ChildResult(returncode=returncode, signals=list(self._signals), hang=hang, tail=tail)

    def _reader(self, stream: IO[bytes], echo: IO[bytes], name: str) -> threading.Thread:
        thread = threading.Thread(
            target=self._read, args=(stream, echo), name=f"shardledger-exec-{name}", daemon=True
        )
        thread.start()
        return thread

    def _read(self, stream: IO[bytes], echo: IO[bytes]) -> None:
        # Chunks, not lines: a progress bar redraws one line with \r for hours, and
        # each redraw is a sign of life; lines end at \n or \r.
        echoing, pending = True, b""
        read = getattr(stream, "read1", stream.read)
        with stream:
            while chunk := read(_MAX_LINE):
                if echoing:
                    try:
                        echo.write(chunk)
                        echo.flush()
                    except OSError:  # our own output closed: keep reading, or the child blocks
                        echoing = False
                if self.liveness == "output":
                    self.clock.progressed()
                *lines, pending = _LINE_END.split(pending + chunk)
                if len(pending) > _MAX_LINE:
                    lines.append(pending)
                    pending = b""
                for raw in lines:
                    self._line(raw)
        if pending:
            self._line(pending)

    def _line(self, raw: bytes) -> None:
        if not raw.strip():
            return
        line = raw.decode("utf-8", "replace")
        with self._lock:
            self._tail.append(line + "\n")
        report = parse_progress(line)
        if report is not None:
            self._progressed(report)

    def _progressed(self, report: Progress) -> None:
        self.clock.stepped()
        self.on_progress(report)

    def _poll_progress_file(self) -> None:
        if not self.progress_file:
            return
        try:
            info = os.stat(self.progress_file)
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("progress_file_unreadable path=%s error=%s", self.progress_file, exc)
            return
        stamp = (info.st_mtime_ns, info.st_size)
        if stamp == self._file_stamp:
            return
        self._file_stamp = stamp
        try:
            with open(self.progress_file, encoding="utf-8", errors="replace") as f:
                report = parse_progress_file(f.read(4096))
        except OSError as exc:
            log.warning("progress_file_unreadable path=%s error=%s", self.progress_file, exc)
            return
        if report is None:
            log.warning(
                "progress_file_ignored path=%s: no step=N on its last line", self.progress_file
            )
            return
        self._progressed(report)

    def _exited(self, pid: int) -> bool:
        # WNOWAIT leaves the child a zombie, so its pid, the group's id, cannot be
        # reused before the group's stragglers are killed.
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None

    def _watch(self, proc: subprocess.Popen[bytes]) -> Hang | None:
        term_at = kill_at = 0.0
        hang: Hang | None = None
        while not self._exited(proc.pid):
            time.sleep(_POLL_S)
            now = time.monotonic()
            self._poll_progress_file()
            if self._dump_requested:
                self._dump_requested = False
                self._dump_stack(proc.pid)
            if not term_at and signal.SIGTERM in self._signals:
                term_at = now
                kill_at = kill_at or now + self.term_grace_s
            if hang is None and not term_at:
                hang = self._check_hang(now)
                if hang is not None:
                    self._stop_hung(proc, hang)
                    assert self.policy is not None
                    kill_at = now + self.policy.kill_grace
            if kill_at and now >= kill_at:
                log.error("exec_sigkill_sent pid=%d: still alive after its grace", proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                kill_at = float("inf")
        return hang

    def _check_hang(self, now: float) -> Hang | None:
        if self.policy is None:
            return None
        since = self.clock.quiet_since()
        limit = self.policy.threshold(self.clock.median_step())
        if since is None or limit is None or now - since < limit[0]:
            return None
        return Hang(quiet_s=now - since, threshold_s=limit[0], basis=limit[1])

    def _stop_hung(self, proc: subprocess.Popen[bytes], hang: Hang) -> None:
        assert self.policy is not None
        log.error(
            "hang_detected attempt=%s quiet_s=%.1f threshold_s=%.1f basis=%r",
            self.attempt_id,
            hang.quiet_s,
            hang.threshold_s,
            hang.basis,
        )
        try:
            with self._lock:
                tail = list(self._tail)
            hang.diagnostics = write_bundle(
                attempt_id=self.attempt_id,
                header=hang.message(self.policy.kill_grace, self.liveness),
                kind="hang",
                pgid=proc.pid,
                tail=tail,
            )
        except Exception as exc:  # diagnostics are evidence; stopping the hang matters more
            log.error("hang_diagnostics_failed attempt=%s error=%r", self.attempt_id, exc)
        self.on_hang(hang)
        log.warning("hang_sigterm_sent attempt=%s pgid=%d", self.attempt_id, proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)

    def _dump_stack(self, pgid: int) -> None:
        """Appends the group's state to <diag>/<attempt>.stack, where `shardledger watch` reads it."""
        path = os.path.join(diagnostics_dir(), f"{self.attempt_id}.stack")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write(group_report(pgid))
        except OSError as exc:  # a dump is evidence; the job goes on without it
            log.warning("stack_dump_failed path=%s error=%s", path, exc)
