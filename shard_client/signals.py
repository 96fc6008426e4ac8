"""Signals an attempt handles: SIGTERM as a grace period before Preempted, SIGUSR1 as stack dumps."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import IO, Any, Final

from shard_client.failures import Preempted

__all__ = [
    "DIAG_ENV",
    "SigtermGrace",
    "diagnostics_dir",
    "discard_empty_stack",
    "stack_dumps_on_sigusr1",
]

DIAG_ENV: Final = "SHARDLEDGER_DIAG_DIR"
_stack_owner: list[IO[str]] = []  # the file SIGUSR1 dumps into now, if ours


class SigtermGrace:
    """Turns SIGTERM into a stopping flag, then into Preempted in the main thread after a grace period.

    The handler only sets flags and calls ``on_term`` (which must be
    signal-safe, e.g. ``Event.set``); another thread calls :meth:`expire` once
    :meth:`deadline` passes. It works only when installed from the main thread,
    the one place Python runs signal handlers; elsewhere it stays inert.
    """

    def __init__(self, *, grace_s: float | None, label: str, on_term: Callable[[], None]) -> None:
        self.grace_s = grace_s
        self.label = label
        self.term_at = 0.0  # monotonic time of the first SIGTERM
        self._on_term = on_term
        self._lock = threading.Lock()
        self._installed = False
        self._over = False
        self._previous: Any = None

    def install(self) -> None:
        """Installs the handler if there is a grace period and this is the main thread."""
        if self.grace_s is None or threading.current_thread() is not threading.main_thread():
            return
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._installed = True

    def restore(self) -> None:
        """Puts the previous handler back; a SIGTERM still pending is then ignored."""
        with self._lock:  # expire() sends its signal under this lock
            installed, self._installed = self._installed, False
        if installed:
            signal.signal(signal.SIGTERM, self._previous)

    def deadline(self) -> float:
        """Returns when the grace period ends (monotonic), or infinity when none is running."""
        if not self.term_at or self._over or self.grace_s is None:
            return float("inf")
        return self.term_at + self.grace_s

    def expire(self) -> None:
        """Ends the grace period: the main thread gets Preempted at its next bytecode."""
        with self._lock:
            if self._over or not self._installed:
                return
            self._over = True
            main = threading.main_thread().ident
            if main is not None:
                # A real signal, unlike _thread.interrupt_main, also wakes a
                # main thread blocked in sleep() or a wait.
                signal.pthread_kill(main, signal.SIGTERM)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self._installed:
            return
        if self._over or self.grace_s == 0:
            self._over = True
            raise Preempted(f"{self.label}: SIGTERM grace period of {self.grace_s}s is over")
        if not self.term_at:
            self.term_at = time.monotonic()
            self._on_term()


def diagnostics_dir() -> str:
    """Returns $SHARDLEDGER_DIAG_DIR, else $TMPDIR/shardledger-diag: where `watch` looks."""
    return os.environ.get(DIAG_ENV) or os.path.join(
        os.environ.get("TMPDIR", "/tmp"), "shardledger-diag"
    )


def discard_empty_stack(attempt_id: str) -> None:
    """Removes <diagnostics dir>/<attempt>.stack if nothing was dumped into it.

    stack_dumps_on_sigusr1 removes it when its block ends; a process about to be
    SIGKILLed (its own watchdog's last step, or another's) never gets there.
    """
    path = os.path.join(diagnostics_dir(), f"{attempt_id}.stack")
    with contextlib.suppress(OSError):
        if os.path.getsize(path) == 0:
            os.unlink(path)


@contextlib.contextmanager
def stack_dumps_on_sigusr1(attempt_id: str) -> Iterator[str]:
    """Makes SIGUSR1 dump every thread's stack to <diagnostics dir>/<attempt>.stack meanwhile.

    `shardledger watch` sends SIGUSR1 to a stale attempt before killing it, so
    a silent hang leaves a stack behind. Yields the file's path ("" when it
    cannot be set up, which never stops the job); an empty file is removed.
    """
    path = os.path.join(diagnostics_dir(), f"{attempt_id}.stack")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        stream = open(path, "a", encoding="utf-8")  # noqa: SIM115 - faulthandler keeps its fd
        faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)
    except (OSError, ValueError, RuntimeError):
        yield ""
        return
    _stack_owner.append(stream)
    try:
        yield path
    finally:
        _stack_owner.remove(stream)
        if not _stack_owner:
            faulthandler.unregister(signal.SIGUSR1)
        else:  # an inner shard ended first: the outer one gets the signal back
            faulthandler.register(signal.SIGUSR1, file=_stack_owner[-1], all_threads=True)
        stream.close()
        discard_empty_stack(attempt_id)
