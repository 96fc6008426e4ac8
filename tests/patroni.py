"""A PostgreSQL cluster that fails over by itself: Patroni on three nodes, etcd on three more.

Every member is a host of a `tests.netns.Network` (a namespace on a private switch):
``etcd1..3`` run one etcd member each (Debian's ``etcd-server`` 3.4, the v3 API that
Patroni's ``etcd3`` client speaks), ``pg1..3`` run Patroni (Debian's ``patroni`` 3.0),
which runs PostgreSQL 15 as the user ``postgres``. The configuration is the one
docs/deployment.md ("High availability with Patroni") explains line by line, with shorter
timers so that a test fails over in seconds:

* ``synchronous_mode`` and ``synchronous_mode_strict``: a COMMIT returns only once a
  standby that Patroni recorded in etcd as synchronous has it, and only such a standby
  may be promoted; with no standby left, writes stop rather than go unreplicated;
* ``use_pg_rewind`` with ``wal_log_hints``: a demoted primary rejoins as a standby of the
  new timeline, its unreplicated tail discarded;
* ``ttl`` 25 s, ``loop_wait`` 1 s, ``retry_timeout`` 10 s (Patroni's defaults are 30, 10, 10);
* ``primary_stop_timeout`` 2 s, under ``retry_timeout``: a primary cut off from etcd stops
  within it (SIGKILL past it), so that it rejoins by ``pg_rewind`` (see PRIMARY_STOP_TIMEOUT_S).

The test process reaches each PostgreSQL through its Unix socket (a file, in no
network namespace), and Patroni's REST API through processes it runs on the hosts.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

import pytest

from tests import pg
from tests.netns import Host, Network, wait_for

SCOPE: Final = "shardledger"
PG_PORT: Final = 5432
REST_PORT: Final = 8008
ETCD_CLIENT_PORT: Final = 2379
ETCD_PEER_PORT: Final = 2380
# Failover timers of the test cluster (docs/deployment.md gives the production ones).
# retry_timeout is Patroni's default: shorter ones were too short on the loaded two-core
# machine. At 3 s (Patroni's minimum), with one etcd member silently cut off, the leader's
# Patroni missed its lock update and demoted itself in every round of a campaign; at 5 s,
# at a load average of 35, the two etcd members left answered reads in up to 2.6 s and the
# leader lost its lock to another node. ttl is the least that Patroni's rule allows
# (loop_wait + 2 * retry_timeout), rounded up: a partitioned primary's machine is replaced
# after it.
TTL_S: Final = 25
LOOP_WAIT_S: Final = 1
RETRY_TIMEOUT_S: Final = 10
# A primary cut off from etcd demotes itself ("offline") from Patroni's async executor with
# a fast shutdown, which waits for the walsenders of the standbys on the other side of the
# cut (until their TCP connections break: 20 s and more). Patroni 3.0.2 meets the next
# cycle's DCS error with a second demote from its main thread (ha.py: "AsyncExecutor is
# busy, demoting from the main thread"); when the postmaster exits both start PostgreSQL,
# Patroni tracks the one that lost the race for postmaster.pid, runs pg_rewind beside the
# live one ("lock file postmaster.pid already exists"), fails, and rebuilds the node from
# a base backup (140-180 s here; upstream: patroni/patroni#3649). In synchronous mode
# primary_stop_timeout bounds the stop (then an immediate stop, then SIGKILL), so the first
# demote has ended, and the node says it is no longer a leader, before the second DCS
# error, one retry_timeout later. Nothing is lost by it: a COMMIT the standbys never
# confirmed was never acknowledged, and pg_rewind discards it.
PRIMARY_STOP_TIMEOUT_S: Final = 2
NODES: Final = ("pg1", "pg2", "pg3")


def skip_reason() -> str | None:
    """Returns why the Patroni suite cannot run here, or None."""
    missing = [tool for tool in ("patroni", "patronictl", "etcd") if shutil.which(tool) is None]
    if missing:
        return (
            f"{', '.join(missing)} not found: apt-get install -y --no-install-recommends"
            " patroni etcd-server (.ci/run installs them)"
        )
    if pg.find_bin_dir() is None:
        return pg.SKIP_REASON
    return None


def _chown(path: Path, user: str) -> None:
    pw = pwd.getpwnam(user)
    os.chown(path, pw.pw_uid, pw.pw_gid)


def _yaml(value: Any, indent: int = 0) -> str:
    """Renders dicts, lists and scalars as YAML (JSON scalars are YAML scalars)."""
    pad = "  " * indent
    if isinstance(value, dict):
        lines = []
        for key, item in value.items():
            if isinstance(item, dict | list) and item:
                lines.append(f"{pad}{key}:\n{_yaml(item, indent + 1)}")
            else:
                lines.append(f"{pad}{key}: {json.dumps(item)}")
        return "\n".join(lines)
    if isinstance(value, list):
        return "\n".join(f"{pad}- {json.dumps(item)}" for item in value)
    return f"{pad}{json.dumps(value)}"


class PatroniNode:
    """One Patroni member: its host, its files, its PostgreSQL."""

    def __init__(self, cluster: PatroniCluster, host: Host) -> None:
        self.cluster, self.host, self.name = cluster, host, host.name
        self.root = cluster.root / host.name
        self.data_dir = self.root / "data"
        self.config = self.root / "patroni.yml"
        self.log = cluster.root / f"patroni-{host.name}.log"
        self.proc: Any = None

    def write_config(self, etcd_hosts: str) -> None:
        bin_dir = pg.find_bin_dir()
        assert bin_dir is not None
        ip = self.host.ip
        config = {
            "scope": SCOPE,
            "name": self.name,
            "log": {"level": "INFO"},
            "restapi": {"listen": f"{ip}:{REST_PORT}", "connect_address": f"{ip}:{REST_PORT}"},
            "etcd3": {"hosts": etcd_hosts},
            "bootstrap": {
                "dcs": {
                    "ttl": TTL_S,
                    "loop_wait": LOOP_WAIT_S,
                    "retry_timeout": RETRY_TIMEOUT_S,
                    # In synchronous mode only the standby recorded as synchronous may be
                    # promoted, lag or not; this bounds the others should that be relaxed.
                    "maximum_lag_on_failover": 1048576,
                    # A primary whose PostgreSQL dies fails over at once instead of
                    # being restarted in place for up to 300 s: safe in synchronous mode.
                    "primary_start_timeout": 0,
                    "primary_stop_timeout": PRIMARY_STOP_TIMEOUT_S,
                    "synchronous_mode": True,
                    "synchronous_mode_strict": True,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "use_slots": True,
                        "parameters": {
                            "wal_level": "replica",
                            "hot_standby": "on",
                            "wal_log_hints": "on",
                            # pg_rewind reads the demoted primary's WAL back to the last
                            # checkpoint before the fork; its shutdown checkpoint recycles all
                            # but wal_keep_size of it (Patroni's default 128MB: a partition
                            # round of a campaign found 134 MB since that checkpoint, and the
                            # node was rebuilt). max_wal_size bounds the WAL between two
                            # checkpoints, so keeping as much keeps what pg_rewind reads.
                            "max_wal_size": "256MB",
                            "wal_keep_size": "256MB",
                            "max_wal_senders": 10,
                            "max_replication_slots": 10,
                            "max_connections": 200,
                            "synchronous_commit": "on",
                            # The tests kill processes, never machines (as tests/pg.py).
                            "fsync": "off",
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"locale": "C.UTF-8"}, "no-sync"],
            },
            "postgresql": {
                "listen": f"{ip},127.0.0.1:{PG_PORT}",
                "connect_address": f"{ip}:{PG_PORT}",
                "data_dir": str(self.data_dir),
                "bin_dir": str(bin_dir),
                "pgpass": str(self.root / "pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres", "password": "postgres"},
                    "replication": {"username": pg.REPLICATION_ROLE, "password": "replicator"},
                    "rewind": {"username": "postgres", "password": "postgres"},
                },
                "parameters": {"unix_socket_directories": str(self.root)},
                "pg_hba": [
                    "local all all trust",
                    # Patroni reads a stopped former primary's timeline over a local
                    # replication connection before it decides to rewind.
                    f"local replication {pg.REPLICATION_ROLE} trust",
                    f"host replication {pg.REPLICATION_ROLE} 127.0.0.1/32 trust",
                    f"host replication {pg.REPLICATION_ROLE} 10.0.0.0/8 trust",
                    "host all all 10.0.0.0/8 trust",
                    "host all all 127.0.0.1/32 trust",
                ],
                "remove_data_directory_on_rewind_failure": True,
                "remove_data_directory_on_diverged_timelines": True,
            },
            # No watchdog device in a test namespace; production: mode required (docs).
            "watchdog": {"mode": "off"},
        }
        self.root.mkdir(parents=True, exist_ok=True)
        self.config.write_text(_yaml(config) + "\n")
        for path in (self.root, self.config):
            _chown(path, "postgres")

    def start(self) -> None:
        """Starts Patroni (it starts, promotes, demotes and rewinds PostgreSQL itself)."""
        # In its own directory: PostgreSQL's tools fail to find themselves from a working
        # directory the postgres user may not enter (a checkout in a 0700 folder).
        self.proc = self.host.popen(
            ["runuser", "-u", "postgres", "--", "patroni", str(self.config)],
            log=self.log,
            cwd=self.cluster.root,
        )

    def log_size(self) -> int:
        """Returns how far Patroni's log has grown: where rejoined_by starts reading."""
        return self.log.stat().st_size if self.log.exists() else 0

    def rejoined_by(self, since: int) -> str:
        """Returns how this node came back after the log offset since: its data directory
        removed and rebuilt from a base backup ("rebuild"), rewound onto the leader's
        timeline ("rewind"), or only restarted ("restart")."""
        with open(self.log, "rb") as log:
            log.seek(since)
            text = log.read().decode(errors="replace")
        if "Removing data directory" in text:
            return "rebuild"
        if "pg_rewind exit code=0" in text:
            return "rewind"
        return "restart"

    def admin_url(self, dbname: str = "postgres") -> str:
        """Returns a URL that reaches this node's PostgreSQL through its Unix socket."""
        return f"postgresql://postgres@/{dbname}?host={self.root}&port={PG_PORT}"

    def postmaster_pid(self) -> int | None:
        """Returns the running postmaster's PID, or None."""
        try:
            return int((self.data_dir / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def state(self) -> dict[str, Any] | None:
        """Returns Patroni's own view of this member (GET /patroni), or None if unreachable."""
        done = self.host.run(
            [sys.executable, "-c", _GET, f"http://{self.host.ip}:{REST_PORT}/patroni"],
            timeout_s=10,
        )
        if done.returncode != 0:
            return None
        answer: dict[str, Any] = json.loads(done.stdout)
        return answer


# GET a URL with a 2 s timeout; print the body (a non-2xx answer's body too).
_GET: Final = (
    "import sys, urllib.request, urllib.error\n"
    "try:\n"
    "    body = urllib.request.urlopen(sys.argv[1], timeout=2).read()\n"
    "except urllib.error.HTTPError as exc:\n"
    "    body = exc.read()\n"
    "sys.stdout.write(body.decode())\n"
)


class PatroniCluster:
    """Three etcd members and three Patroni nodes on a network; started by start()."""

    def __init__(self, net: Network) -> None:
        self.net = net
        self.root = Path(tempfile.mkdtemp(prefix="shardledger-patroni-"))
        _chown(self.root, "postgres")
        self.etcd_hosts = [net.host(f"etcd{i}") for i in (1, 2, 3)]
        self.nodes = {name: PatroniNode(self, net.host(name)) for name in NODES}

    @property
    def etcd_endpoints(self) -> str:
        """Returns the etcd client endpoints as Patroni's ``hosts`` setting takes them."""
        return ",".join(f"{h.ip}:{ETCD_CLIENT_PORT}" for h in self.etcd_hosts)

    def start(self) -> None:
        """Starts etcd, then Patroni on every node; returns once a leader and two sync-ready standbys run."""
        initial = ",".join(f"{h.name}=http://{h.ip}:{ETCD_PEER_PORT}" for h in self.etcd_hosts)
        for host in self.etcd_hosts:
            host.popen(
                [
                    *("etcd", "--name", host.name, "--data-dir", str(self.root / host.name)),
                    *("--listen-peer-urls", f"http://{host.ip}:{ETCD_PEER_PORT}"),
                    *("--initial-advertise-peer-urls", f"http://{host.ip}:{ETCD_PEER_PORT}"),
                    *("--listen-client-urls", f"http://{host.ip}:{ETCD_CLIENT_PORT}"),
                    *("--advertise-client-urls", f"http://{host.ip}:{ETCD_CLIENT_PORT}"),
                    *("--initial-cluster", initial, "--initial-cluster-state", "new"),
                    *("--initial-cluster-token", f"sl-{self.net.tag}"),
                    "--enable-v2=false",
                    # A member back from a partition has raised its term while alone;
                    # without a pre-vote its return deposes the etcd leader, and the
                    # election meanwhile can cost Patroni's leader its lock update (etcd
                    # 3.5 pre-votes by default, 3.4 only with the flag).
                    "--pre-vote",
                ],
                log=self.root / f"etcd-{host.name}.log",
            )
        first, *rest = self.nodes.values()
        for node in self.nodes.values():
            node.write_config(self.etcd_endpoints)
        first.start()  # bootstraps the cluster: initdb, the leader key
        wait_for("pg1 to bootstrap and lead", lambda: self.leader() == first.name, timeout_s=90)
        for node in rest:
            node.start()
        wait_for("two streaming standbys, one synchronous", lambda: self.healthy(), timeout_s=120)

    def members(self) -> list[dict[str, Any]]:
        """Returns `patronictl list` as JSON: name, role, state, lag, timeline of each member."""
        done = self.nodes["pg1"].host.run(
            ["patronictl", "-c", str(self.nodes["pg1"].config), "list", "-f", "json"],
            timeout_s=30,
        )
        if done.returncode != 0:
            return []
        members: list[dict[str, Any]] = json.loads(done.stdout or "[]")
        return members

    def members_via(self, node: str) -> list[dict[str, Any]]:
        """Returns `patronictl list` as node's host sees it (its own etcd reachability)."""
        member = self.nodes[node]
        done = member.host.run(
            ["patronictl", "-c", str(member.config), "list", "-f", "json"], timeout_s=30
        )
        return list(json.loads(done.stdout or "[]")) if done.returncode == 0 else []

    def leader(self) -> str | None:
        """Returns the member etcd names leader while it runs, or None."""
        for member in self.members():
            if member.get("Role") == "Leader" and member.get("State") == "running":
                return str(member["Member"])
        return None

    def healthy(self, members: list[dict[str, Any]] | None = None) -> bool:
        """Returns whether one leader runs with one synchronous and one other streaming standby."""
        members = self.members() if members is None else members
        roles = sorted(str(m.get("Role")) for m in members)
        states = {str(m.get("State")) for m in members}
        return roles == ["Leader", "Replica", "Sync Standby"] and states <= {
            "running",
            "streaming",
        }

    def patronictl(self, *args: str, timeout_s: float = 60) -> str:
        """Runs patronictl on pg1's host; returns its output, fails the test on an error."""
        node = self.nodes["pg1"]
        done = node.host.run(["patronictl", "-c", str(node.config), *args], timeout_s=timeout_s)
        if done.returncode != 0:
            pytest.fail(f"patronictl {' '.join(args)}: {done.stdout}{done.stderr}")
        return done.stdout

    def create_database(self) -> str:
        """Creates an empty database on the leader; returns its name."""
        import psycopg

        leader = self.leader()
        assert leader is not None
        name = f"sl_{int(time.time() * 1000) % 10**9}"
        with psycopg.connect(self.nodes[leader].admin_url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return name

    def ledger_url(self, dbname: str) -> str:
        """Returns the URL the ledger replicas use: every node, the one that takes writes."""
        hosts = ",".join(f"{n.host.ip}:{PG_PORT}" for n in self.nodes.values())
        return f"postgresql://postgres@{hosts}/{dbname}?target_session_attrs=read-write"

    def close(self) -> None:
        """Keeps the logs beside the network's (pytest's tmp_path), removes the rest.

        Network.close kills the processes.
        """
        for log in self.root.glob("*.log"):
            shutil.copy(log, self.net.workdir / log.name)
        shutil.rmtree(self.root, ignore_errors=True)
