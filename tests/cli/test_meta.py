"""`shardledger --version`, `version`, `help CMD` and a bare `shardledger`."""

from __future__ import annotations

import importlib.metadata
import json
import platform
import subprocess
import sys

import pytest

from ledger_server.events import ROW_FORMAT
from ledger_server.record import RECORD_VERSION
from ledger_server.store.postgres_sql import MIGRATIONS as POSTGRESQL
from ledger_server.store.sqlite_sql import MIGRATIONS as SQLITE
from tests.builders import run_cli


def test_version_says_the_package_the_contract_and_python(
    capsys: pytest.CaptureFixture[str],
) -> None:
    installed = importlib.metadata.version("shardledger")
    line = (
        f"shardledger {installed} (contract shardledger.v1, store schema {SQLITE[-1][0]} (SQLite),"
        f" {POSTGRESQL[-1][0]} (PostgreSQL), Python {platform.python_version()})"
    )
    code, out, _ = run_cli(capsys, "version")
    assert (code, out.strip()) == (0, line)
    # --version is argparse's: it exits 0 after printing the same line.
    done = subprocess.run(
        [sys.executable, "-m", "shardledger_cli", "--version"], capture_output=True, text=True
    )
    assert (done.returncode, done.stdout.strip()) == (0, line)
    code, out, _ = run_cli(capsys, "version", "--json")
    v = json.loads(out)
    assert (v["shardledger"], v["contract"]) == (installed, "shardledger.v1")
    assert v["grpcio"] == importlib.metadata.version("grpcio")
    # The formats are the ones the store and the chain really write.
    assert v["store"] == {
        "sqlite_schema": SQLITE[-1][0],
        "postgresql_schema": POSTGRESQL[-1][0],
        "row_format": ROW_FORMAT,
        "record_format": RECORD_VERSION,
    }


def test_help_prints_a_commands_help_and_names_the_known_ones_on_a_typo(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run_cli(capsys, "help", "spool", "drain")
    assert code == 0 and out.startswith("usage: shardledger spool drain")
    code, out, _ = run_cli(capsys, "help")
    assert code == 0 and out.startswith("usage: shardledger [-h] [--version] COMMAND")
    code, _, err = run_cli(capsys, "help", "spool", "flush")
    assert code == 2
    assert "shardledger spool has no command 'flush' (known: drain, status)" in err


def test_a_bare_shardledger_prints_its_help_and_exits_0() -> None:
    done = subprocess.run([sys.executable, "-m", "shardledger_cli"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: shardledger")
    assert "plan" in done.stdout and "Examples: a typical night" in done.stdout
