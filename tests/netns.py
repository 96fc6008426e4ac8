"""Hosts in network namespaces for fault tests: partitions, slow and lossy links, skewed clocks.

A `Network` is a private switch (a bridge in a namespace of its own) and one namespace per
host, each joined to the switch by a veth pair and given a private 10.x address. Nothing
is added to the machine's own namespace: traffic between the hosts stays on the switch,
and the test process talks to them only through processes it starts inside them. Each
started process also gets a UTS namespace of its own, so `socket.gethostname()` names its
host as a separate machine would (the PID namespace stays shared: a pid on one host is
visible on every other, which is what makes "a local pid that merely matches a remote
attempt's" testable).

Faults, each verified on a Debian 12 machine (kernel 6.x) as root:

- partition: an nftables table inside one host's namespace drops its traffic to and from
  the other host's address (both directions, silently: no RST, as a dead link); healing
  deletes the addresses from the table's set. (`nft` from Debian's `nftables`.)
- slow and lossy links: this kernel has no `netem` qdisc (`tc qdisc add ... netem` answers
  "Specified qdisc kind is unknown"), so a small userspace TCP proxy on the link delays
  every chunk, stalls now and then, and resets whole connections at random
  (tests/helpers/netns_proxy.py). TCP itself never loses bytes, so "lossy" is delayed
  segments and dropped connections. `tc ... tbf` works and caps a host's bandwidth.
- skewed clocks: Debian's `libfaketime` preloaded into one process (``FAKETIME=+600s``)
  moves its wall clock; ``FAKETIME_DONT_FAKE_MONOTONIC=1`` leaves its monotonic clock
  alone, as a host's skew does (faked, Python's timed waits, `threading.Event.wait`
  included, wait the whole offset: a heartbeat thread never beats).

Names are unique per process and call (`slt<pid>n<counter>`), so pytest-xdist workers
never collide; `Network.close` kills every process inside the namespaces (found by
namespace, not by name) and deletes them, and a new `Network` first removes namespaces
that a dead test process left behind.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import pwd
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, Final, TypeVar
from urllib.parse import urlsplit

import pytest

from tests import pg

ROOT: Final = Path(__file__).resolve().parents[1]
HELPERS: Final = ROOT / "tests" / "helpers"
PREFIX: Final = "slt"
# Where Debian's libfaketime package puts the library (multiarch directory).
FAKETIME_LIBS: Final = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
)
LEDGER_PORT: Final = 50551  # inside a private namespace nothing else listens
_NAME = re.compile(rf"^{PREFIX}(\d+)n\d+")
_counter = itertools.count(1)

T = TypeVar("T")


def skip_reason() -> str | None:
    """Returns why namespace tests cannot run here (not root, no `ip netns`), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, as CI does)"
    if shutil.which("ip") is None:
        return "`ip` not found (apt-get install iproute2)"
    name = f"{PREFIX}{os.getpid()}n{next(_counter)}-probe"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` is not allowed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def require_tools() -> None:
    """Fails (never skips) when a tool the suite needs is missing: CI installs them all."""
    missing = [tool for tool in ("nft", "tc", "unshare") if shutil.which(tool) is None]
    if faketime_lib() is None:
        missing.append("libfaketime")
    if missing:
        pytest.fail(
            f"missing {', '.join(missing)}: apt-get install -y nftables iproute2 util-linux"
            " faketime libfaketime (.ci/run installs them)"
        )


def faketime_lib() -> str | None:
    """Returns the path of libfaketime, or None."""
    return next((p for p in FAKETIME_LIBS if os.path.exists(p)), None)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace(ns: str) -> None:
    """SIGKILLs every process whose network namespace is ns, until none is left."""
    deadline = time.monotonic() + 10
    while True:
        done = _ip("netns", "pids", ns, check=False)
        pids = [int(p) for p in done.stdout.split()] if done.returncode == 0 else []
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} in namespace {ns} outlived SIGKILL")
        time.sleep(0.05)


def _delete_namespace(ns: str) -> None:
    _kill_namespace(ns)
    _ip("netns", "del", ns, check=False)


def sweep_abandoned() -> None:
    """Deletes namespaces of this suite whose test process is gone (a SIGKILLed pytest)."""
    done = _ip("netns", "list", check=False)
    for line in done.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        found = _NAME.match(name)
        if found and not _pid_alive(int(found.group(1))):
            _delete_namespace(name)


def wait_for(
    what: str, probe: Callable[[], T | None], *, timeout_s: float, every_s: float = 0.05
) -> T:
    """Returns probe()'s first truthy answer; fails naming `what` when the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = probe()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(every_s)


class Host:
    """One machine of the network: a namespace, an address, and the processes started on it."""

    def __init__(self, network: Network, name: str, ns: str, ip: str) -> None:
        self.network, self.name, self.ns, self.ip = network, name, ns, ip
        # What the processes started here report as their host name.
        self.hostname = f"{name}-{network.tag}"

    def __repr__(self) -> str:
        return f"Host({self.name}, {self.ip})"

    def argv(
        self, argv: Sequence[str], *, env: dict[str, str] | None = None, faketime: str = ""
    ) -> list[str]:
        """Returns the command line that runs argv on this host (its namespace, its name)."""
        extra = dict(env or {})
        if faketime:
            lib = faketime_lib()
            assert lib is not None, "libfaketime is not installed"
            # Only the job itself runs on the skewed clock, not `ip`, `unshare` or `sh`. A
            # host's skew is its wall clock's: its monotonic clock is right (faked too, it
            # would leave Python's timed waits, which take it, waiting the skew out).
            extra |= {
                "LD_PRELOAD": lib,
                "FAKETIME": faketime,
                "FAKETIME_NO_CACHE": "1",
                "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            }
        assignments = [f"{k}={v}" for k, v in extra.items()]
        script = 'hostname "$0" && exec env "$@"'
        return [
            *("ip", "netns", "exec", self.ns, "unshare", "--uts", "--", "sh", "-c", script),
            self.hostname,
            *assignments,
            *argv,
        ]

    def popen(
        self,
        argv: Sequence[str],
        *,
        log: Path,
        env: dict[str, str] | None = None,
        faketime: str = "",
        stdin: int | None = subprocess.DEVNULL,
        stdout: int | IO[Any] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Starts argv on this host, its output in log (stdout: a pipe instead, if given).

        ``cwd``: where it runs (default: the checkout). A process that drops to another user
        needs a directory that user may enter: a checkout may lie in a 0700 folder.
        """
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                self.argv(argv, env=env, faketime=faketime),
                cwd=ROOT if cwd is None else cwd,
                env=self.network.env,
                stdin=stdin,
                stdout=out if stdout is None else stdout,
                stderr=out,
            )
        self.network.processes.append(proc)
        return proc

    def run(
        self, argv: Sequence[str], *, timeout_s: float = 60, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Runs argv on this host to its end; returns its exit status and output."""
        return subprocess.run(
            self.argv(argv, env=env),
            cwd=ROOT,
            env=self.network.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def nft(self, script: str) -> None:
        """Runs an nftables script inside this host's namespace."""
        done = subprocess.run(
            ["ip", "netns", "exec", self.ns, "nft", "-f", "-"],
            input=script,
            capture_output=True,
            text=True,
            timeout=30,
        )
        if done.returncode != 0:
            raise RuntimeError(f"nft on {self.name}: {done.stderr.strip()}\n{script}")


class Network:
    """Hosts on one private switch, the faults between them, and everything they run.

    Use as a context manager (or call `close`): every process started on a host is
    killed and every namespace deleted, whatever the test did.
    """

    def __init__(self, workdir: Path) -> None:
        sweep_abandoned()
        self.workdir = workdir
        self.tag = f"{os.getpid()}n{next(_counter)}"
        self.hub = f"{PREFIX}{self.tag}-hub"
        # A second octet per network keeps the addresses in logs apart (the switches are
        # separate anyway, so two tests could even share one range).
        self.subnet = f"10.{100 + (os.getpid() + int(self.tag.split('n')[1])) % 150}.0"
        self.hosts: dict[str, Host] = {}
        self.processes: list[subprocess.Popen[bytes]] = []
        self.blocked: dict[str, set[str]] = {}
        self.clusters: list[NsPgCluster] = []
        self.round = 0  # which of the campaign's rounds the test is in
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
        _ip("netns", "add", self.hub)
        try:
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def host(self, name: str) -> Host:
        """Adds a host on the switch: its namespace, its veth, its address, loopback up."""
        index = len(self.hosts) + 1
        ns = f"{PREFIX}{self.tag}-{name}"
        host = Host(self, name, ns, f"{self.subnet}.{index}")
        self.hosts[name] = host
        port = f"p{index}"
        _ip("netns", "add", ns)
        _ip(
            "-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns
        )
        _ip("-n", self.hub, "link", "set", port, "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        # One table per host, empty until a partition names an address.
        host.nft(
            "table inet shardledger_faults {\n"
            " set cut { type ipv4_addr; }\n"
            " chain in { type filter hook input priority 0; ip saddr @cut drop; }\n"
            " chain out { type filter hook output priority 0; ip daddr @cut drop; }\n"
            "}\n"
        )
        self.blocked[name] = set()
        return host

    def partition(self, a: Host, b: Host) -> None:
        """Cuts a from b both ways: a's namespace drops what it sends b and what b sends it."""
        a.nft(f"add element inet shardledger_faults cut {{ {b.ip} }}\n")
        self.blocked[a.name].add(b.ip)

    def heal(self, a: Host, b: Host) -> None:
        """Ends a partition made by partition(a, b)."""
        a.nft(f"delete element inet shardledger_faults cut {{ {b.ip} }}\n")
        self.blocked[a.name].discard(b.ip)

    def limit_rate(self, host: Host, rate: str = "2mbit") -> None:
        """Caps what host sends at rate with a token bucket (tbf) on its link."""
        subprocess.run(
            [
                *("ip", "netns", "exec", host.ns, "tc", "qdisc", "add", "dev", "eth0"),
                *("root", "tbf", "rate", rate, "burst", "32kbit", "latency", "400ms"),
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )

    def close(self) -> None:
        """Kills every process on the hosts and deletes every namespace of this network."""
        for proc in self.processes:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        for proc in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for cluster in self.clusters:  # pg_ctl's server outlives the command that started it
            # Immediate: a fast shutdown would wait for a standby that a partition cut off.
            with contextlib.suppress(Exception):
                cluster.stop("immediate")
            if cluster.data_dir is not None:
                shutil.rmtree(cluster.data_dir.parent, ignore_errors=True)
        for host in self.hosts.values():
            _delete_namespace(host.ns)
        _delete_namespace(self.hub)


class Ledgerd:
    """`shardledger serve` on a host, listening on its address (port 50551: the namespace is private)."""

    def __init__(self, host: Host, database: str, workdir: Path, *, name: str = "ledger") -> None:
        self.host, self.database, self.name = host, database, name
        self.workdir = workdir
        self.port_file = workdir / f"{name}.port"
        self.log = workdir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def target(self) -> str:
        """Returns the HOST:PORT jobs dial."""
        return f"{self.host.ip}:{LEDGER_PORT}"

    def start(self, *, key: Path | None = None, timeout_s: float = 60) -> None:
        """Starts the server and waits until it has bound its port."""
        self.port_file.unlink(missing_ok=True)
        argv = [
            *(sys.executable, "-m", "shardledger_cli", "serve", "--db", self.database),
            *("--listen", self.target, "--insecure", "--auth", "off"),
            *("--port-file", str(self.port_file), "--log-level", "warning", "--grace", "1"),
        ]
        if key is not None:
            argv += ["--signing-key", str(key)]
        self.proc = self.host.popen(argv, log=self.log)
        proc = self.proc
        wait_for(
            f"{self.name} to serve on {self.target} (log {self.log})",
            lambda: self.port_file.exists() or _exited(proc, self.log),
            timeout_s=timeout_s,
        )

    def stop(self) -> None:
        """SIGKILLs the server (a machine that dies)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


def _exited(proc: subprocess.Popen[bytes], log: Path) -> bool:
    code = proc.poll()
    if code is not None:
        raise AssertionError(f"exited {code} early: {log.read_text(errors='replace')[-3000:]}")
    return False


class Proxy:
    """A slow, lossy link (tests/helpers/netns_proxy.py) on a host, to one upstream address."""

    def __init__(
        self, host: Host, port: int, upstream: str, workdir: Path, *faults: str, seed: int = 0
    ) -> None:
        self.host, self.port = host, port
        self.stats_file = workdir / f"proxy-{host.name}-{port}.json"
        log = workdir / f"proxy-{host.name}-{port}.log"
        self.proc = host.popen(
            [
                *(sys.executable, str(HELPERS / "netns_proxy.py"), f"{host.ip}:{port}", upstream),
                *("--stats", str(self.stats_file), "--seed", str(seed), *faults),
            ],
            log=log,
        )
        proc = self.proc
        wait_for(
            f"the proxy on {host.name}:{port}",
            lambda: self.stats_file.exists() or _exited(proc, log),
            timeout_s=30,
        )

    @property
    def target(self) -> str:
        """Returns the HOST:PORT that reaches the upstream through this link."""
        return f"{self.host.ip}:{self.port}"

    def stats(self) -> dict[str, int]:
        """Returns what the link did so far: connections, resets, stalls, bytes."""
        counts: dict[str, int] = json.loads(self.stats_file.read_text())
        return counts


PG_PORT: Final = 5432  # inside a private namespace nothing else listens


class NsPgCluster(pg.PgCluster):
    """A throwaway PostgreSQL server on a host of the network (tests/pg.py's, moved there).

    Its tools run inside the host's namespace and it listens on the host's address; the
    test reaches it through its Unix socket (a file, not in any network namespace).
    """

    def __init__(self, host: Host, root: Path, settings: tuple[str, ...]) -> None:
        # A later -c wins: the host's address replaces tests/pg.py's loopback.
        settings = (f"listen_addresses={host.ip}", *settings)
        super().__init__(
            f"postgresql://postgres@:{PG_PORT}/postgres?host={root}",
            data_dir=root / "data",
            settings=settings,
        )
        self.host = host

    def _cmd(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.host.ns, *super()._cmd(*args)]

    def new_database(self) -> str:
        """Creates an empty database; returns its name."""
        return urlsplit(self.create_database()).path.lstrip("/")

    def host_url(self, dbname: str) -> str:
        """Returns the URL another host uses for one database of this server."""
        return f"postgresql://postgres@{self.host.ip}:{PG_PORT}/{dbname}"


def start_pg(host: Host, *, settings: tuple[str, ...] = ()) -> NsPgCluster:
    """Creates and starts a cluster on host, open (trust) to the network's hosts."""
    root = Path(tempfile.mkdtemp(prefix="shardledger-pg-"))
    cluster = NsPgCluster(host, root, settings)
    host.network.clusters.append(cluster)
    if cluster.run_as:
        pw = pwd.getpwnam(cluster.run_as)
        os.chown(root, pw.pw_uid, pw.pw_gid)
    cluster.init()
    assert cluster.data_dir is not None
    hba = cluster.data_dir / "pg_hba.conf"
    hba.write_text(
        f"host replication {pg.REPLICATION_ROLE} 10.0.0.0/8 trust\n"
        "host all all 10.0.0.0/8 trust\n" + hba.read_text()
    )
    cluster.start()
    cluster.wait_ready()
    return cluster


def start_replicated_pair(
    primary_host: Host, standby_host: Host
) -> tuple[NsPgCluster, NsPgCluster]:
    """Starts a primary on one host and its synchronous streaming standby on another."""
    replication = ("wal_level=replica", "max_wal_senders=4")
    primary = start_pg(primary_host, settings=replication)
    import psycopg

    with psycopg.connect(primary.admin_url, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {pg.REPLICATION_ROLE} WITH REPLICATION LOGIN")
    root = Path(tempfile.mkdtemp(prefix="shardledger-pg-"))
    standby = NsPgCluster(standby_host, root, replication)
    standby_host.network.clusters.append(standby)
    if standby.run_as:
        pw = pwd.getpwnam(standby.run_as)
        os.chown(root, pw.pw_uid, pw.pw_gid)
    pg._start_standby(standby, primary, host=primary_host.ip)
    return primary, standby


class Observer:
    """A process on one host that answers the test's questions about ledgers (JSON lines).

    The test process stays in the machine's own namespace; this helper
    (tests/helpers/netns_observer.py) is its hands on the private network.
    """

    def __init__(self, host: Host, workdir: Path, *, name: str = "observer") -> None:
        self.host = host
        self.proc = host.popen(
            [sys.executable, str(HELPERS / "netns_observer.py")],
            log=workdir / f"{name}-{host.name}.log",
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )

    def call(self, op: str, *, timeout_s: float = 30, **args: Any) -> Any:
        """Asks one question; returns the answer, raises AssertionError with the helper's error."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            raise AssertionError(f"observer: no answer to {op} within {timeout_s} s")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"observer exited ({self.proc.poll()}) during {op}")
        answer = json.loads(line)
        if "error" in answer:
            raise AssertionError(f"observer {op} {args}: {answer['error']}")
        return answer["result"]

    def try_call(self, op: str, **args: Any) -> Any:
        """Returns the answer, or None when the ledger could not answer (unreachable, refused)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            return self.call(op, **args)
        except AssertionError as exc:
            if "LedgerUnavailable" in str(exc) or "StoreFault" in str(exc):
                return None
            raise


@contextlib.contextmanager
def network(workdir: Path) -> Iterator[Network]:
    """Yields a Network, skipping the test where namespaces cannot be made."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    require_tools()
    with Network(workdir) as net:
        yield net
