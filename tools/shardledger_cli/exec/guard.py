"""Nothing the child of `shardledger exec` starts outlives the wrapper, SIGKILLed or not.

Two processes make it so; neither is a thread of the wrapper, which has several
(heartbeats, output readers, gRPC's), so neither runs Python code between a fork
and an exec of the wrapper's:

* The launcher (LAUNCHER, run as ``python -I -S -c``: one thread, no site) is the
  child itself until it execs the command, under the same pid and in the same
  process group. It sets PR_SET_PDEATHSIG(SIGKILL), then checks getppid(): the
  wrapper may have died before it was set. It runs the command only after the
  wrapper's go, which comes once the guard knows the group. It restores the
  signal dispositions Python's start-up changed (SIGPIPE, SIGXFSZ ignored; SIGINT
  handled), as Popen's restore_signals does, and reports an exec failure's errno
  on a close-on-exec pipe, as Popen reports its own, so a missing command is still
  FileNotFoundError here. PDEATHSIG fires when the *thread* that forked the child
  ends, not the process: the child is forked by the thread that then watches it
  to its end (the main thread, in exec), which outlives it.
* The guard (GUARD_SCRIPT, /bin/sh) reaches what PDEATHSIG does not: the child's
  own children (a shell script's background job, a launcher's workers). It sits in
  a process group of its own, deaf to the job signals, reading a pipe whose only
  write end the wrapper holds. When the wrapper dies, by SIGKILL too, the kernel
  closes that end: the guard SIGKILLs the child's whole process group and removes
  the attempt's temp files (its outputs' temp paths, its progress file). The
  wrapper disarms it once it has reaped the group itself (the group's id may be
  reused after that) and says goodbye once it has cleaned up on its own.

A process that leaves the group (setsid, a daemon) escapes both; the job's
cgroup is what ends it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Final

__all__ = ["GUARD_BOUND_S", "GUARD_SCRIPT", "LAUNCHER", "Guard", "spawn"]

log = logging.getLogger("shard_client")

# How soon after the wrapper's death its child's group is gone: the guard wakes
# when the kernel closes the wrapper's descriptors and kills at once (docs/exec.md).
GUARD_BOUND_S: Final = 1.0
_GUARD_EXIT_S: Final = 5.0

LAUNCHER: Final = r"""
import os, signal, sys
if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
go, status, wrapper = (int(word) for word in sys.argv[1:4])
argv = sys.argv[4:]
try:
    import ctypes
    if ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0):
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
except Exception as exc:
    os.write(2, ("shardledger exec: no parent-death signal for the child (%s); its group"
                 " is still killed when exec dies\n" % (exc,)).encode())
if os.getppid() != wrapper or not os.read(go, 1):
    os._exit(137)
os.close(go)
for name in ("SIGPIPE", "SIGXFZ", "SIGXFSZ"):
    if hasattr(signal, name):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
os.set_inheritable(status, False)
try:
    os.execvp(argv[0], argv)
except OSError as exc:
    os.write(status, str(exc.errno or 0).encode())
os._exit(127)
"""

GUARD_SCRIPT: Final = r"""
trap '' HUP INT QUIT TERM USR1 USR2
wrapper=$1
shift
pgid=
while read -r word arg; do
    case $word in
        arm) pgid=$arg ;;
        disarm) pgid= ;;
        bye) exit 0 ;;
    esac
done
if [ -n "$pgid" ]; then
    kill -9 "-$pgid" 2>/dev/null
    echo "shardledger exec: pid $wrapper died; killed its child's process group $pgid" >&2
fi
rm -f -- "$@"
"""


class Guard:
    """The guard process of one attempt: kills the child's group and removes its temps if exec dies."""

    def __init__(self, proc: subprocess.Popen[bytes], write_fd: int) -> None:
        self._proc = proc
        self._fd = write_fd
        self._armed = False

    @classmethod
    def start(cls, *, attempt_id: str, temps: Sequence[str]) -> Guard:
        """Starts the guard for these temp paths; raises OSError when /bin/sh cannot be run."""
        read_fd, write_fd = os.pipe()
        try:
            proc = subprocess.Popen(
                ["/bin/sh", "-c", GUARD_SCRIPT, "shardledger-exec-guard", str(os.getpid()), *temps],
                stdin=read_fd,
                stdout=subprocess.DEVNULL,
                # Its own group: a terminal's Ctrl-C and the signals exec forwards to the
                # child's group never reach it; it ends when exec's pipe says so.
                process_group=0,
                # SHARDLEDGER_ATTEMPT: the attempt's processes can all be found by it.
                env={"PATH": os.environ.get("PATH", os.defpath), "SHARDLEDGER_ATTEMPT": attempt_id},
            )
        except OSError:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        return cls(proc, write_fd)

    def _say(self, line: str) -> None:
        if self._fd < 0:
            return
        try:
            os.write(self._fd, line.encode() + b"\n")
        except OSError as exc:  # the guard is gone: the child has PDEATHSIG still
            log.warning("exec_guard_lost error=%s", exc)

    def arm(self, pgid: int) -> None:
        """Tells the guard the child's process group, to kill if exec dies from now on."""
        self._say(f"arm {pgid}")
        self._armed = True

    def disarm(self) -> None:
        """Tells the guard the group is reaped: its id may belong to another group soon."""
        self._say("disarm")
        self._armed = False

    def close(self) -> None:
        """Ends the guard: goodbye when the group is reaped, else EOF, which kills the group."""
        if self._fd < 0:
            return
        if not self._armed:
            self._say("bye")
        os.close(self._fd)
        self._fd = -1
        try:
            self._proc.wait(_GUARD_EXIT_S)
        except subprocess.TimeoutExpired:
            log.warning("exec_guard_lingers pid=%d", self._proc.pid)


def spawn(
    argv: Sequence[str], env: Mapping[str, str], *, guard: Guard | None
) -> subprocess.Popen[bytes]:
    """Starts the command through the launcher, in its own process group, its output piped.

    Returns once the command is exec'd; raises OSError (FileNotFoundError, PermissionError)
    when it cannot be, as Popen does.
    """
    go_r, go_w = os.pipe()
    status_r, status_w = os.pipe()
    launcher = [sys.executable, "-I", "-S", "-c", LAUNCHER, str(go_r), str(status_w)]
    try:
        proc = subprocess.Popen(
            [*launcher, str(os.getpid()), *argv],
            env=dict(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            # Its own group: the wrapper forwards each signal once, to every process
            # of the job, and a terminal's Ctrl-C reaches the wrapper alone.
            process_group=0,
            pass_fds=(go_r, status_w),
        )
    except OSError:
        for fd in (go_w, status_r):
            os.close(fd)
        raise
    finally:
        os.close(go_r)
        os.close(status_w)
    try:
        if guard is not None:
            guard.arm(proc.pid)
        with contextlib.suppress(BrokenPipeError):  # the launcher died: its status says how
            os.write(go_w, b"g")
    finally:
        os.close(go_w)
    with open(status_r, "rb") as status:
        failure = status.read()
    if not failure:
        return proc
    proc.wait()
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()
    if guard is not None:
        guard.disarm()
    code = int(failure)
    raise OSError(code, os.strerror(code), argv[0])
