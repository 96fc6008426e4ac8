"""Shared fixtures: a real ledger server on a loopback ephemeral port over a real SQLite file."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import structlog.testing

from ledger_server.config import ServerConfig
from ledger_server.server import RunningServer, create_server
from shard_client import Ledger
from shard_client.client import LedgerClient
from tests import isolation

# The in-process servers log through structlog; keep those lines on stderr so that
# tests reading a command's stdout see only what the command printed.
structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))


# What a test starts, known from the fixture that starts it: a test using one carries the
# marker, so `-m postgres` (or `-m "not postgres"`) selects it whoever wrote it. Tests that
# start their daemon without such a fixture carry the marker in their own module.
MARKERS_BY_FIXTURE = {
    "slurm_cluster": "slurm",
    "pg_cluster": "postgres",
    "pg_url": "postgres",
    "s3_endpoint": "s3",
    "go_client": "go",
    "ray_cluster": "ray",
}


def pytest_configure(config: pytest.Config) -> None:
    # The default-address guard (tests/isolation.py): its hooks and its fixture.
    config.pluginmanager.register(isolation, "shardledger-default-address-guard")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        # A backend parameter ("sqlite", "postgres") asks for pg_url only when it is set up.
        callspec = getattr(item, "callspec", None)
        params = set(map(str, callspec.params.values())) if callspec is not None else set()
        wanted = {marker for name, marker in MARKERS_BY_FIXTURE.items() if name in names}
        if "postgres" in params:
            wanted.add("postgres")
        for marker in sorted(wanted - {m.name for m in item.iter_markers()}):
            item.add_marker(marker)


@pytest.fixture
def quiet_logs() -> Iterator[None]:
    """Captures the in-process server's log lines, so a CLI's captured output is all its own."""
    with structlog.testing.capture_logs():
        yield


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    """Returns a fresh SQLite path in a temp dir."""
    return tmp_path / "ledger.db"


@pytest.fixture
def server(db_path: Path) -> Iterator[RunningServer]:
    """Starts a real server on 127.0.0.1 with an ephemeral port."""
    running = create_server(ServerConfig(database=str(db_path), listen="127.0.0.1:0"))
    yield running
    running.stop(0.5)


@pytest.fixture
def client(server: RunningServer) -> Iterator[LedgerClient]:
    """Returns a client of the fixture server."""
    c = LedgerClient(f"127.0.0.1:{server.port}", timeout_s=10, retry_deadline_s=5)
    yield c
    c.close()


@pytest.fixture
def spool_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Points the SDK's spools at this test's temp dir (a module opts in with usefixtures)."""
    spool = tmp_path / "spool"
    monkeypatch.setenv("SHARDLEDGER_SPOOL_DIR", str(spool))
    return spool


@pytest.fixture
def target(server: RunningServer) -> str:
    """Returns the fixture server's address."""
    return f"127.0.0.1:{server.port}"


@pytest.fixture
def ledger(target: str) -> Iterator[Ledger]:
    """Returns a Ledger (the SDK) on the fixture server, closed afterwards."""
    led = Ledger(target, unavailable_after_s=0.5)
    yield led
    led.close()
