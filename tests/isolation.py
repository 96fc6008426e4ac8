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

Under pytest-xdist the controller holds the port and the workers ask it (over a Unix
socket) at each test's start and end: a connection is the test's that was running in
the worker whose process, or an ancestor of it, made the connection, else (the process
gone) the test's that was running alone. One the controller cannot place (no worker's,
while tests ran in several workers) fails the session, naming the tests running then.

A connection from a process outside this session (another checkout's suite whose guard
found the port taken, a CLI of the developer's) is closed and charged to no test: a
process is the session's when it descends from the session's pytest or carries the
session's token in its environment (``SHARDLEDGER_TEST_GUARD_SESSION``, which children,
daemonised grandchildren and Slurm jobs inherit). The summary counts them.

Before anything runs, the variables that point the SDK and the CLI at a ledger, a
database or credentials are removed from the environment, so a developer's exported
``SHARDLEDGER_SERVER`` cannot stand in for the default address either.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import select
import shutil
import socket
import tempfile
import threading
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import pytest

DEFAULT_HOST: Final = "127.0.0.1"
DEFAULT_PORT: Final = 50551
MARKER: Final = "default_address"
# The guard's own tests watch a free port instead (the session's guard holds 50551).
PORT_ENV: Final = "SHARDLEDGER_TEST_GUARD_PORT"

# Set by the guard's session for every process it starts: the mark of "ours".
SESSION_ENV: Final = "SHARDLEDGER_TEST_GUARD_SESSION"

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


def _connecting_process(peer_port: int, port: int) -> tuple[int | None, str]:
    """Returns the pid and "pid N: command line" of the local process whose socket is peer_port."""
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
        return None, "a process that had closed its end by then"
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
                    return int(proc.name), f"pid {proc.name}{mine}: {command[:200]}"
    return None, "an unknown process"


def _ancestors(pid: int) -> Iterator[int]:
    """Yields pid, its parent, and so on up to init (Linux /proc)."""
    while pid > 1:
        yield pid
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return
        pid = int(stat.rpartition(")")[2].split()[1])


def _is_sessions(pid: int, session: str) -> bool:
    """True when pid descends from this process or carries the session's token.

    An environment that cannot be read (another user's process) counts as the
    session's: the guard would rather fail a test than miss one.
    """
    if os.getpid() in _ancestors(pid):
        return True
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except FileNotFoundError:
        return True  # gone meanwhile: placed as a process that is gone
    except OSError:
        return True
    return f"{SESSION_ENV}={session}".encode() in environ.split(b"\0")


BETWEEN: Final = "(between tests)"


@dataclass
class Tripwire:
    """A listener on the default address that records who connects, and during which test.

    Tests run in owners: this process alone, or each xdist worker (by pid). A connection
    is the current test's of the owner its process descends from; with a single owner,
    every connection is that owner's.
    """

    port: int
    # The token this session's processes carry in SESSION_ENV ("" in the guard's own tests
    # of the rule, where every process counts as the session's).
    session: str = ""
    current: dict[int, str] = field(default_factory=dict)
    hits: list[Hit] = field(default_factory=list)
    # Connections no owner could be found for: (hit, the tests running at the time).
    unplaced: list[tuple[Hit, list[str]]] = field(default_factory=list)
    # Connections from processes outside the session: closed, charged to no test.
    foreign: list[Hit] = field(default_factory=list)
    _socks: list[socket.socket] = field(default_factory=list)
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _aside: int = 0  # marked tests running now, for which the port is let go

    def open(self) -> bool:
        """Listens on 127.0.0.1 (and [::1] where there is IPv6); False where the port is taken."""
        socks: list[socket.socket] = []
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
                    for other in socks:
                        other.close()
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

    def step_aside(self) -> None:
        """Lets the port go while a marked test runs (the first of them closes it)."""
        with self._lock:
            self._aside += 1
            if self._aside == 1:
                self.close()

    def resume(self) -> bool:
        """Listens again once no marked test runs; False where something kept the port."""
        with self._lock:
            self._aside -= 1
            return self._aside > 0 or self.open()

    def begin(self, owner: int, nodeid: str) -> None:
        """Marks nodeid as the owner's current test; what arrived before is not its."""
        with self._lock:
            self.drain()
            self.current[owner] = nodeid

    def end(self, owner: int, nodeid: str) -> list[Hit]:
        """Returns and forgets the connections made during nodeid; the owner is between tests."""
        with self._lock:
            self.drain()
            self.current[owner] = BETWEEN
            mine = [hit for hit in self.hits if hit.nodeid == nodeid]
            self.hits = [hit for hit in self.hits if hit.nodeid != nodeid]
        return mine

    def drain(self) -> None:
        """Accepts and records whatever connected and is not yet accepted."""
        self._accept(timeout_s=0)

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
                    pid, process = _connecting_process(int(peer[1]), self.port)
                self._record(pid, f"{peer[0]}:{peer[1]}", process)

    def _record(self, pid: int | None, peer: str, process: str) -> None:
        if pid is not None and self.session and not _is_sessions(pid, self.session):
            self.foreign.append(Hit(BETWEEN, peer, process))
            return
        owner = None
        if pid is not None:
            owner = next((p for p in _ancestors(pid) if p in self.current), None)
        if owner is None:
            # Its process is gone (or no worker's): the test running alone, as in one
            # process, is the one it is charged to; with tests in several, none is.
            busy = [o for o, nodeid in self.current.items() if nodeid != BETWEEN]
            if len(self.current) == 1:
                owner = next(iter(self.current))
            elif len(busy) == 1:
                owner = busy[0]
        if owner is not None:
            if pid == owner and owner != os.getpid():
                process = f"pid {pid} (the xdist worker running the test)"
            self.hits.append(Hit(self.current[owner], peer, process))
            return
        running = sorted(n for n in self.current.values() if n != BETWEEN)
        if running:  # between every owner's tests it is no test's
            self.unplaced.append((Hit(BETWEEN, peer, process), running))


class Broker:
    """Serves the controller's tripwire to xdist workers over a Unix socket (JSON lines).

    A worker sends {"op": "hello", "pid": P} once, then "begin"/"end" with a nodeid
    around each test and "step_aside"/"resume" around a marked one; each request is
    answered once the tripwire has drained what had connected by then.
    """

    def __init__(self, tripwire: Tripwire) -> None:
        self.tripwire = tripwire
        self.dir = tempfile.mkdtemp(prefix="sl-guard-")
        self.path = os.path.join(self.dir, "broker.sock")
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.path)
        self._server.listen(64)
        self._thread = threading.Thread(target=self._serve, name="default-address-broker")
        self._thread.daemon = True
        self._thread.start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()
        self._thread.join(timeout=5)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._worker, args=(conn,), daemon=True).start()

    def _worker(self, conn: socket.socket) -> None:
        owner = 0
        with conn, conn.makefile("rw", encoding="utf-8") as stream:
            for line in stream:
                request = json.loads(line)
                op = request["op"]
                reply: dict[str, Any] = {}
                if op == "hello":
                    owner = int(request["pid"])
                    with self.tripwire._lock:
                        self.tripwire.current[owner] = BETWEEN
                elif op == "begin":
                    self.tripwire.begin(owner, request["nodeid"])
                elif op == "end":
                    hits = self.tripwire.end(owner, request["nodeid"])
                    reply["hits"] = [[h.nodeid, h.peer, h.process] for h in hits]
                elif op == "step_aside":
                    self.tripwire.step_aside()
                elif op == "resume":
                    reply["ok"] = self.tripwire.resume()
                stream.write(json.dumps(reply) + "\n")
                stream.flush()
        with self.tripwire._lock:
            self.tripwire.current.pop(owner, None)


class RemoteTripwire:
    """A worker's view of the controller's tripwire: the same calls, over the broker."""

    def __init__(self, path: str, port: int) -> None:
        self.port = port
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)
        self._stream = self._sock.makefile("rw", encoding="utf-8")
        self._ask("hello", pid=os.getpid())

    def _ask(self, op: str, **fields: Any) -> dict[str, Any]:
        self._stream.write(json.dumps({"op": op, **fields}) + "\n")
        self._stream.flush()
        line = self._stream.readline()
        if not line:
            raise RuntimeError("the default-address guard's broker (the xdist controller) is gone")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def begin(self, owner: int, nodeid: str) -> None:
        self._ask("begin", nodeid=nodeid)

    def end(self, owner: int, nodeid: str) -> list[Hit]:
        return [Hit(*hit) for hit in self._ask("end", nodeid=nodeid)["hits"]]

    def step_aside(self) -> None:
        self._ask("step_aside")

    def resume(self) -> bool:
        return bool(self._ask("resume")["ok"])

    def close(self) -> None:
        self._stream.close()
        self._sock.close()


def _port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((DEFAULT_HOST, port))
        except OSError:
            return False
    return True


_TRIPWIRE: Final = pytest.StashKey["Tripwire | RemoteTripwire | None"]()
_BROKER: Final = pytest.StashKey["Broker | None"]()
_PORT: Final = pytest.StashKey[int]()
_SCRUBBED: Final = pytest.StashKey[list[str]]()
WORKER_KEY: Final = "shardledger_default_address_guard"


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_SCRUBBED] = [name for name in SCRUBBED_ENV if os.environ.pop(name, None)]
    port = int(os.environ.get(PORT_ENV, DEFAULT_PORT))
    config.stash[_PORT] = port
    config.stash[_BROKER] = None
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:  # an xdist worker: the controller holds the port
        path = workerinput.get(WORKER_KEY)
        config.stash[_TRIPWIRE] = RemoteTripwire(path, port) if path else None
        return
    session = f"{os.getpid()}-{secrets.token_hex(6)}"
    tripwire = Tripwire(port, session=session)
    if not tripwire.open():
        config.stash[_TRIPWIRE] = None
        return
    os.environ[SESSION_ENV] = session  # inherited by the workers and all they start
    config.stash[_TRIPWIRE] = tripwire
    if getattr(config.option, "numprocesses", None):
        config.stash[_BROKER] = Broker(tripwire)
    else:
        tripwire.current[os.getpid()] = BETWEEN


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """Tells each xdist worker where the controller's guard answers (none: inactive)."""
    broker = node.config.stash.get(_BROKER, None)
    node.workerinput[WORKER_KEY] = broker.path if broker is not None else ""


def pytest_sessionfinish(session: pytest.Session) -> None:
    tripwire = session.config.stash.get(_TRIPWIRE, None)
    if not isinstance(tripwire, Tripwire):
        return
    tripwire.drain()
    if tripwire.unplaced:
        lines = [
            f"{hit.peer} from {hit.process}, while these tests ran: {', '.join(running)}"
            for hit, running in tripwire.unplaced
        ]
        session.config.stash[_UNPLACED] = lines
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_UNPLACED: Final = pytest.StashKey[list[str]]()


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    tripwire = config.stash.get(_TRIPWIRE, None)
    if isinstance(tripwire, Tripwire) and tripwire.foreign:
        terminalreporter.section("default-address guard")
        terminalreporter.line(
            f"{len(tripwire.foreign)} connection(s) to {DEFAULT_HOST}:{config.stash[_PORT]}"
            " from processes outside this session (another suite, a CLI of yours) were"
            " closed and charged to no test:"
        )
        for hit in tripwire.foreign[:5]:
            terminalreporter.line(f"  {hit.peer} from {hit.process}")
    lines = config.stash.get(_UNPLACED, [])
    if lines:
        terminalreporter.section("default-address guard", red=True)
        terminalreporter.line(
            f"{len(lines)} connection(s) to {DEFAULT_HOST}:{config.stash[_PORT]} that no "
            f"test could be named for (the connecting process was gone): {FIX}"
        )
        for line in lines:
            terminalreporter.line(f"  {line}")


def pytest_unconfigure(config: pytest.Config) -> None:
    tripwire = config.stash.get(_TRIPWIRE, None)
    if tripwire is not None:
        tripwire.close()
    broker = config.stash.get(_BROKER, None)
    if broker is not None:
        broker.close()


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
    tripwire.begin(os.getpid(), item.nodeid)  # what arrived before is no test's
    marked = item.get_closest_marker(MARKER) is not None
    if marked:
        tripwire.step_aside()
    try:
        return (yield)
    finally:
        if marked and not tripwire.resume():
            item.config.stash[_TRIPWIRE] = None  # the test left something on the port


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
    if tripwire is None:
        return result
    hits = tripwire.end(os.getpid(), item.nodeid)
    if hits and item.get_closest_marker(MARKER) is None:
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
