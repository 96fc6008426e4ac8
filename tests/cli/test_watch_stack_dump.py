"""The watchdog's stack dump is read when the kernel says faulthandler is done, not on a guess.

A real child process registers faulthandler on SIGUSR1, as the SDK does. The
dump is complete once SIGUSR1 is pending nowhere and no thread runs its handler
(which blocks the signal in that thread): `stack_dump` waits for exactly that.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shardledger_cli.commands.watch_diag import _dump_done, _masks, stack_dump


@pytest.fixture(autouse=True)
def _faulthandler_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are of the faulthandler path: a py-spy on the developer's PATH is not used."""
    monkeypatch.setattr(shutil, "which", lambda name, *args, **kwargs: None)


# The child: THREADS idle threads, SIGUSR1 blocked in every one until a line arrives
# on stdin, so the signal is delivered exactly when the test says.
CHILD = textwrap.dedent(
    """
    import faulthandler, signal, sys, threading, time
    stack = open(sys.argv[1], "a")
    faulthandler.register(signal.SIGUSR1, file=stack, all_threads=True)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # threads inherit it
    go = threading.Event()
    def idle_worker():
        while True:
            time.sleep(0.05)
    def hung_in_a_worker():
        go.wait()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
        while True:
            time.sleep(0.05)
    for _ in range(int(sys.argv[2])):
        threading.Thread(target=idle_worker, daemon=True).start()
    threading.Thread(target=hung_in_a_worker, daemon=True).start()
    print("ready", flush=True)
    sys.stdin.readline()
    go.set()
    while True:
        time.sleep(0.05)
    """
)
THREADS = 12


@pytest.fixture
def child(tmp_path: Path):  # type: ignore[no-untyped-def]
    stack = tmp_path / "a1.stack"
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(stack), str(THREADS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    yield proc
    proc.kill()
    proc.wait()


def test_a_pending_dump_is_not_done_and_a_delivered_one_is(child: subprocess.Popen[str]) -> None:
    import os
    import signal

    # Every thread blocks SIGUSR1 from the start (none runs a handler): it stays pending.
    blocked_before = {
        t for t, m in _masks(child.pid).items() if m["SigBlk"] & (1 << (signal.SIGUSR1 - 1))
    }
    assert len(blocked_before) == THREADS + 2  # main, the idle ones, the hung one
    os.kill(child.pid, signal.SIGUSR1)
    assert not _dump_done(child.pid, blocked_before)


def test_the_dump_is_read_whole_however_late_the_process_takes_the_signal(
    child: subprocess.Popen[str], tmp_path: Path
) -> None:
    import threading

    # The one thread that takes SIGUSR1 unblocks it only 1.5 s after the signal is sent
    # (as if a loaded machine did not schedule the process): the dump is read whole.
    assert child.stdin is not None
    timer = threading.Timer(1.5, lambda: (child.stdin.write("go\n"), child.stdin.flush()))  # type: ignore[union-attr]
    timer.start()
    try:
        text = stack_dump(child.pid, "a1", tmp_path, wait_s=30)
    finally:
        timer.join()
    assert "hung_in_a_worker" in text
    # Every thread, the main one (written last) included.
    assert text.count("(most recent call first):") == THREADS + 2
    assert text.rstrip().endswith("in <module>")
    assert text.count("idle_worker") == THREADS


def test_a_process_that_ignores_the_signal_gives_no_dump_at_once(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, sys, time; signal.signal(signal.SIGUSR1, signal.SIG_IGN);"
            " print('ready', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        text = stack_dump(proc.pid, "a1", tmp_path, wait_s=30)
        assert text.startswith("(no stack dump")
        assert proc.poll() is None  # the signal did not end it
    finally:
        proc.kill()
        proc.wait()
