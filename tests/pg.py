"""Throwaway PostgreSQL clusters for tests: initdb into a temp dir, one database per test.

Import the fixtures into a test module (``from tests.pg import pg_cluster, pg_url``).
``SHARDLEDGER_TEST_PG_URL`` points the tests at an existing server instead (it must allow
CREATE DATABASE); without it and without PostgreSQL binaries the tests are skipped.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Final
from urllib.parse import urlsplit, urlunsplit

import pytest

ENV_URL: Final = "SHARDLEDGER_TEST_PG_URL"
SKIP_REASON: Final = (
    "PostgreSQL binaries (initdb, pg_ctl, postgres) not found and SHARDLEDGER_TEST_PG_URL not"
    " set: install the `postgresql` package (Debian: apt-get install -y postgresql)"
)


def find_bin_dir() -> Path | None:
    """Returns the directory holding initdb and pg_ctl, or None."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(os.path.realpath(found)).parent
    candidates = sorted(
        glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]), reverse=True
    )
    for candidate in [*candidates, "/usr/local/pgsql/bin"]:
        if (Path(candidate) / "initdb").exists() and (Path(candidate) / "pg_ctl").exists():
            return Path(candidate)
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _with_dbname(url: str, dbname: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path="/" + dbname))


class PgCluster:
    """A PostgreSQL server for the test session: ours (startable, stoppable) or an external one."""

    def __init__(
        self,
        admin_url: str,
        *,
        data_dir: Path | None = None,
        durable: bool = False,
        settings: tuple[str, ...] = (),
    ) -> None:
        self.admin_url = admin_url
        self.data_dir = data_dir
        self.durable = durable
        self.settings = settings  # extra "name=value" server settings, given as -c at start
        self.bin_dir = find_bin_dir()
        # initdb and postgres refuse to run as root: run them as an unprivileged user.
        self.run_as: str | None = None
        if os.geteuid() == 0:
            for user in ("postgres", "nobody"):
                try:
                    pwd.getpwnam(user)
                except KeyError:
                    continue
                self.run_as = user
                break
        self.port = urlsplit(admin_url).port or 5432

    @property
    def controllable(self) -> bool:
        """Returns whether the tests may stop and start this server."""
        return self.data_dir is not None

    def _cmd(self, *args: str) -> list[str]:
        assert self.bin_dir is not None
        cmd = [str(self.bin_dir / args[0]), *args[1:]]
        return ["runuser", "-u", self.run_as, "--", *cmd] if self.run_as else cmd

    def init(self) -> None:
        """Creates the cluster's files."""
        assert self.data_dir is not None
        subprocess.run(
            self._cmd(
                "initdb",
                *("-D", str(self.data_dir), "-U", "postgres", "-A", "trust"),
                *("-E", "UTF8", "--locale=C.UTF-8", "--no-sync"),
            ),
            check=True,
            capture_output=True,
        )

    def start(self) -> None:
        """Starts the server and waits until it accepts connections."""
        assert self.data_dir is not None
        socket_dir = self.data_dir.parent
        options = " ".join(
            [
                f"-p {self.port}",
                f"-k {socket_dir}",
                "-c listen_addresses=127.0.0.1",
                "-c max_connections=300",
                *(f"-c {setting}" for setting in self.settings),
            ]
        )
        if not self.durable:
            # The tests kill processes, never the machine: the OS page cache holds the WAL
            # across `pg_ctl stop -m immediate`, so fsync is not needed for them.
            options += " -c fsync=off -c full_page_writes=off"
        subprocess.run(
            self._cmd(
                "pg_ctl",
                *("-D", str(self.data_dir), "-l", str(socket_dir / "server.log")),
                *("-o", options, "-w", "-t", "60", "start"),
            ),
            check=True,
            capture_output=True,
        )

    def stop(self, mode: str = "fast") -> None:
        """Stops the server with pg_ctl (mode: smart, fast or immediate)."""
        assert self.data_dir is not None
        subprocess.run(
            self._cmd("pg_ctl", "-D", str(self.data_dir), "-m", mode, "-w", "stop"),
            check=True,
            capture_output=True,
        )

    def postmaster_pid(self) -> int | None:
        """Returns the running postmaster's PID, or None."""
        assert self.data_dir is not None
        try:
            return int((self.data_dir / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def kill(self) -> None:
        """Stops our postmaster by PID (fast shutdown, then SIGKILL)."""
        pid = self.postmaster_pid()
        if pid is None:
            return
        assert self.data_dir is not None
        try:
            os.kill(pid, signal.SIGINT)
            # The postmaster removes its pid file when it is done; polling the process itself
            # would wait on a zombie where PID 1 does not reap (some containers).
            deadline = time.monotonic() + 30
            while (self.data_dir / "postmaster.pid").exists():
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    return
                time.sleep(0.02)
        except ProcessLookupError:
            pass

    def destroy(self) -> None:
        """Stops our server and deletes its files."""
        self.kill()
        if self.data_dir is not None:
            shutil.rmtree(self.data_dir.parent, ignore_errors=True)

    def url(self, dbname: str) -> str:
        """Returns a URL for one database of this server."""
        return _with_dbname(self.admin_url, dbname)

    def create_database(self) -> str:
        """Creates an empty database and returns its URL."""
        import psycopg

        name = f"sl_test_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop_database(self, url: str) -> None:
        """Drops a database created by create_database, closing its sessions."""
        import psycopg

        name = urlsplit(url).path.lstrip("/")
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Blocks until the server accepts connections."""
        import psycopg

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                psycopg.connect(self.admin_url, connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def _new_cluster(*, durable: bool = False, settings: tuple[str, ...] = ()) -> PgCluster:
    """Returns an unstarted cluster on a free port, its directory owned by the server's user."""
    root = Path(tempfile.mkdtemp(prefix="shardledger-pg-"))
    url = f"postgresql://postgres@127.0.0.1:{_free_port()}/postgres"
    cluster = PgCluster(url, data_dir=root / "data", durable=durable, settings=settings)
    if cluster.run_as:
        pw = pwd.getpwnam(cluster.run_as)
        os.chown(root, pw.pw_uid, pw.pw_gid)
    return cluster


def start_cluster(*, durable: bool = False) -> PgCluster:
    """Creates and starts a throwaway cluster on 127.0.0.1 with a free port (fsync only if durable)."""
    cluster = _new_cluster(durable=durable)
    cluster.init()
    cluster.start()
    cluster.wait_ready()
    return cluster


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster]:
    """Returns the session's PostgreSQL server, starting a throwaway one when needed."""
    external = os.environ.get(ENV_URL)
    if external:
        yield PgCluster(external)
        return
    if find_bin_dir() is None:
        pytest.skip(SKIP_REASON)
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        cluster.destroy()


@pytest.fixture
def pg_url(pg_cluster: PgCluster) -> Iterator[str]:
    """Returns the URL of a fresh, empty database, dropped after the test."""
    url = pg_cluster.create_database()
    yield url
    # A test that stopped the server may leave its database to the cluster.
    with contextlib.suppress(Exception):
        pg_cluster.drop_database(url)


REPLICATION_ROLE: Final = "replicator"
STANDBY_NAME: Final = "standby1"


def _wait_streaming(primary: PgCluster, timeout_s: float = 30.0) -> None:
    """Blocks until the primary reports the standby streaming and synchronous."""
    import psycopg

    deadline = time.monotonic() + timeout_s
    with psycopg.connect(primary.admin_url, autocommit=True) as conn:
        while True:
            row = conn.execute(
                "SELECT state, sync_state FROM pg_stat_replication WHERE application_name = %s",
                (STANDBY_NAME,),
            ).fetchone()
            if row == ("streaming", "sync"):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the standby did not become a synchronous streamer: {row}")
            time.sleep(0.1)


def start_replicated_pair() -> tuple[PgCluster, PgCluster]:
    """Starts a primary and a synchronous streaming standby of it, each on its own port.

    The standby is a pg_basebackup of the primary with standby.signal and a primary_conninfo;
    once it streams, the primary names it in synchronous_standby_names, so (with the store's
    synchronous_commit=on) a COMMIT returns only after the standby has flushed its WAL.
    """
    primary = _new_cluster(settings=("wal_level=replica", "max_wal_senders=4"))
    primary.init()
    assert primary.data_dir is not None
    # A replication line of our own, first so it wins, rather than relying on initdb's sample.
    hba = primary.data_dir / "pg_hba.conf"
    hba.write_text(f"host replication {REPLICATION_ROLE} 127.0.0.1/32 trust\n" + hba.read_text())
    primary.start()
    primary.wait_ready()
    # The same settings: each becomes the other's standby after a failover, and a standby
    # refuses to start with a lower max_wal_senders (and others) than its primary's.
    standby = _new_cluster(settings=primary.settings)
    try:
        import psycopg

        with psycopg.connect(primary.admin_url, autocommit=True) as conn:
            conn.execute(f"CREATE ROLE {REPLICATION_ROLE} WITH REPLICATION LOGIN")
        _start_standby(standby, primary)
    except BaseException:
        standby.destroy()
        primary.destroy()
        raise
    return primary, standby


def _start_standby(standby: PgCluster, primary: PgCluster, *, host: str = "127.0.0.1") -> None:
    """Makes standby a base backup of primary, starts it streaming, and makes it synchronous.

    ``host`` is where the standby reaches the primary (another address than loopback
    where each runs on a host of its own: tests/netns.py).
    """
    import psycopg

    assert standby.data_dir is not None
    subprocess.run(
        standby._cmd(
            "pg_basebackup",
            *("-D", str(standby.data_dir), "-h", host, "-p", str(primary.port)),
            # fast: a spread checkpoint (the default) can take minutes, and just after a
            # promotion one is already under way.
            *("-U", REPLICATION_ROLE, "-X", "stream", "--no-sync", "--checkpoint=fast"),
        ),
        check=True,
        capture_output=True,
        timeout=120,
    )
    conninfo = (
        f"host={host} port={primary.port} user={REPLICATION_ROLE} application_name={STANDBY_NAME}"
    )
    # The backup carries the primary's own settings: a primary_conninfo (once it was a
    # standby itself) and synchronous_standby_names, which would make this server, once
    # promoted, wait forever for a standby it does not have.
    auto = standby.data_dir / "postgresql.auto.conf"
    kept = [
        line
        for line in auto.read_text().splitlines()
        if not line.startswith(("primary_conninfo", "synchronous_standby_names"))
    ]
    auto.write_text("\n".join([*kept, f"primary_conninfo = '{conninfo}'", ""]))
    (standby.data_dir / "standby.signal").touch()
    if standby.run_as:
        pw = pwd.getpwnam(standby.run_as)
        for path in (auto, standby.data_dir / "standby.signal"):
            os.chown(path, pw.pw_uid, pw.pw_gid)
    standby.start()
    standby.wait_ready()
    with psycopg.connect(primary.admin_url, autocommit=True) as conn:
        conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{STANDBY_NAME}'")
        conn.execute("SELECT pg_reload_conf()")
    _wait_streaming(primary)


def rejoin_as_standby(old: PgCluster, primary: PgCluster) -> None:
    """Rebuilds a crashed former primary, on its own port, as the synchronous standby of primary.

    A primary stopped with ``-m immediate`` may hold WAL its standby never received, so it
    cannot follow the promoted standby's timeline as it is; a fresh base backup replaces its
    files (pg_rewind would need wal_log_hints or data checksums).
    """
    assert old.data_dir is not None
    old.kill()
    shutil.rmtree(old.data_dir)
    _start_standby(old, primary)


def promote(standby: PgCluster) -> None:
    """Promotes a standby to a primary and waits until it accepts writes."""
    assert standby.data_dir is not None
    subprocess.run(
        standby._cmd("pg_ctl", "-D", str(standby.data_dir), "-w", "-t", "60", "promote"),
        check=True,
        capture_output=True,
    )
