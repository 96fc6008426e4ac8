"""The default-address guard: a test that reaches 127.0.0.1:50551 without saying so fails.

127.0.0.1:50551 is where `shardledger serve` listens and where the SDK and the CLI connect
when no address is given, so it is where a developer's own ledger runs. A test that falls
back on it talks to that ledger (and writes into it) instead of its own. For the session
this plugin binds the port itself, a tripwire: a thread accepts every connection at once,
closes it and records the test that was running. After the test's teardown a test that
was connected to fails, naming itself and the fix. A listener sees the connections of the
gRPC C core and of child processes, which a patched Python ``socket`` would not.

The guard is active only while the port is free when the session starts: with a ledger
already listening there it cannot listen, says so in the report header and checks
nothing, and the suite must still pass (``.ci/run`` runs it so).

A test that means the default address carries ``@pytest.mark.default_address``: the
tripwire steps aside for it (the test may serve there itself), and where another process
holds the port the test is skipped, since it would reach that process.

Before anything runs, the variables that point the SDK and the CLI at a ledger, a
database or credentials are removed from the environment, so a developer's exported
``SHARDLEDGER_SERVER`` cannot stand in for the default address either.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import pytest

DEFAULT_HOST: Final = "127.0.0.1"
DEFAULT_PORT: Final = 50551
MARKER: Final = "default_address"
# The guard's own tests watch a free port instead (the session's guard holds 50551).
PORT_ENV: Final = "SHARDLEDGER_TEST_GUARD_PORT"

# What would carry a developer's ledger, database or credentials into a test.
SCRUBBED_ENV: Final = (
    "SHARDLEDGER_SERVER",
    "SHARDLEDGER_DATABASE_URL",
    "SHARDLEDGER_TOKEN",
    "SHARDLEDGER_TOKEN_FILE",
    "SHARDLEDGER_TLS_CA",
    "SHARDLEDGER_TLS_CERT",
    "SHARDLEDGER_TLS_KEY",
)

FIX: Final = (
    "Give the test its own ledger (the `server`/`target` fixtures, or `shardledger serve "
    "--listen 127.0.0.1:0 --port-file FILE`) and pass its address explicitly (`--server`, "
    "`Ledger(target)`, SHARDLEDGER_SERVER in a child's env). A test that means the default "
    f"address carries @pytest.mark.{MARKER} and sets it explicitly."
)


@dataclass(frozen=True, slots=True)
class Hit:
    """One connection the tripwire accepted."""

    nodeid: str
    peer: str
    process: str


def _connecting_process(peer_port: int, port: int) -> str:
    """Returns "pid N: command line" of the local process whose socket is peer_port (Linux)."""
    inode = ""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as fh:
            for line in fh.readlines()[1:]:
                cols = line.split()
                if int(cols[1].rsplit(":", 1)[1], 16) == peer_port and cols[2].endswith(
                    f":{port:04X}"
                ):
                    inode = cols[9]
    if not inode:
        return "a process that had closed its end by then"
    wanted = f"socket:[{inode}]"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) == wanted:
                    argv = (proc / "cmdline").read_bytes().split(b"\0")
                    command = " ".join(a.decode(errors="replace") for a in argv if a)
                    mine = " (this pytest process)" if int(proc.name) == os.getpid() else ""
                    return f"pid {proc.name}{mine}: {command[:200]}"
    return "an unknown process"


@dataclass
class Tripwire:
    """A listener on the default address that records who connects, and during which test."""

    port: int
    current: str = "(between tests)"
    hits: list[Hit] = field(default_factory=list)
    _socks: list[socket.socket] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def open(self) -> bool:
        """Listens on 127.0.0.1 (and [::1] where there is IPv6); False where the port is taken."""
        socks = []
        for family, host in ((socket.AF_INET, DEFAULT_HOST), (socket.AF_INET6, "::1")):
            sock = socket.socket(family, socket.SOCK_STREAM)
            # SO_REUSEADDR binds past a closed ledger's TIME_WAIT, never beside a listener;
            # no SO_REUSEPORT, which would share the port with a server a test starts.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind((host, self.port))
                sock.listen(64)
            except OSError:
                sock.close()
                if family == socket.AF_INET:
                    return False
                continue  # no IPv6 loopback here: 127.0.0.1 is what the defaults name
            sock.setblocking(False)
            socks.append(sock)
        self._socks = socks
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="default-address-tripwire")
        self._thread.daemon = True
        self._thread.start()
        return True

    def close(self) -> None:
        """Stops listening, so a marked test (or nothing) may have the port."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.drain()
        for sock in self._socks:
            sock.close()
        self._socks = []

    def drain(self) -> None:
        """Accepts and records whatever connected and is not yet accepted."""
        self._accept(timeout_s=0)

    def take(self, nodeid: str) -> list[Hit]:
        """Returns and forgets the connections made during the test nodeid."""
        with self._lock:
            mine = [hit for hit in self.hits if hit.nodeid == nodeid]
            self.hits = [hit for hit in self.hits if hit.nodeid != nodeid]
        return mine

    def _run(self) -> None:
        while not self._stop.is_set():
            self._accept(timeout_s=0.05)

    def _accept(self, *, timeout_s: float) -> None:
        if not self._socks:
            return
        ready, _, _ = select.select(self._socks, [], [], timeout_s)
        for sock in ready:
            with self._lock:
                try:
                    conn, peer = sock.accept()
                except (BlockingIOError, OSError):
                    continue
                # Closed at once: a client gives up within its retry deadline, not a hang.
                with conn:
                    process = _connecting_process(int(peer[1]), self.port)
                self.hits.append(Hit(self.current, f"{peer[0]}:{peer[1]}", process))


def _port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((DEFAULT_HOST, port))
        except OSError:
            return False
    return True


_TRIPWIRE: Final = pytest.StashKey[Tripwire | None]()
_PORT: Final = pytest.StashKey[int]()
_SCRUBBED: Final = pytest.StashKey[list[str]]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_SCRUBBED] = [name for name in SCRUBBED_ENV if os.environ.pop(name, None)]
    port = int(os.environ.get(PORT_ENV, DEFAULT_PORT))
    tripwire = Tripwire(port)
    config.stash[_PORT] = port
    config.stash[_TRIPWIRE] = tripwire if tripwire.open() else None


def pytest_unconfigure(config: pytest.Config) -> None:
    tripwire = config.stash.get(_TRIPWIRE, None)
    if tripwire is not None:
        tripwire.close()


def pytest_report_header(config: pytest.Config) -> list[str]:
    port = config.stash[_PORT]
    if config.stash[_TRIPWIRE] is not None:
        lines = [f"default-address guard: active on {DEFAULT_HOST}:{port}"]
    else:
        lines = [
            f"default-address guard: inactive, {DEFAULT_HOST}:{port} is in use by another "
            "process (a ledger of yours?); tests reaching it are not detected this session"
        ]
    scrubbed: list[str] = config.stash[_SCRUBBED]
    if scrubbed:
        lines.append(f"removed from the environment: {', '.join(scrubbed)}")
    return lines


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    tripwire = item.config.stash[_TRIPWIRE]
    if tripwire is None:
        return (yield)
    tripwire.drain()  # what arrived between tests is no test's
    tripwire.current = item.nodeid
    marked = item.get_closest_marker(MARKER) is not None
    if marked:
        tripwire.close()
    try:
        return (yield)
    finally:
        if marked and not tripwire.open():
            item.config.stash[_TRIPWIRE] = None  # the test left something on the port
        tripwire.current = "(between tests)"


def pytest_runtest_setup(item: pytest.Item) -> None:
    port = item.config.stash[_PORT]
    if item.get_closest_marker(MARKER) is not None and not _port_is_free(port):
        pytest.skip(
            f"{DEFAULT_HOST}:{port} is in use by another process: this test needs the "
            "default address free and would reach that process"
        )


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    # trylast: the innermost wrapper, so every fixture of the test is torn down first.
    result = yield
    tripwire = item.config.stash[_TRIPWIRE]
    if tripwire is None or item.get_closest_marker(MARKER) is not None:
        return result
    tripwire.drain()
    hits = tripwire.take(item.nodeid)
    if hits:
        processes = sorted({hit.process for hit in hits})
        pytest.fail(
            f"{item.nodeid} connected to the default ledger address "
            f"{DEFAULT_HOST}:{tripwire.port} ({len(hits)} connection(s), from "
            f"{'; '.join(processes)}): it would have reached whatever ledger runs on this "
            f"machine. {FIX}",
            pytrace=False,
        )
    return result


@pytest.fixture
def default_address(request: pytest.FixtureRequest) -> str:
    """Returns the default address as HOST:PORT, for a test marked default_address."""
    if request.node.get_closest_marker(MARKER) is None:
        pytest.fail(f"the default_address fixture is for tests marked @pytest.mark.{MARKER}")
    return f"{DEFAULT_HOST}:{request.config.stash[_PORT]}"
