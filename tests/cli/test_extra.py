"""A base install (no server extra) says exactly what to install, from the CLI and ledger_server."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shardledger_cli.cli import (
    EXIT_LOCAL,
    INSTALL_HINT,
    SERVER_EXTRA_MODULES,
    main,
    missing_server_extra,
    server_extra_message,
)


def test_the_message_names_the_missing_packages_and_the_command() -> None:
    message = server_extra_message(["rich", "structlog"])
    assert message == (
        "shardledger: the command line needs rich, structlog (not installed): "
        "pip install 'shardledger[server]'"
    )
    assert INSTALL_HINT == "pip install 'shardledger[server]'"


def test_a_full_install_misses_nothing() -> None:
    assert missing_server_extra() == []


@pytest.mark.parametrize("module", SERVER_EXTRA_MODULES)
def test_the_cli_without_one_package_exits_with_the_message(
    module: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # find_spec answers None: not installed
    assert main(["--help"]) == EXIT_LOCAL
    out, err = capsys.readouterr()
    assert out == ""
    assert err == server_extra_message([module]) + "\n"


def test_importing_ledger_server_without_its_packages_says_what_to_install() -> None:
    code = (
        "import sys\n"
        "sys.modules['structlog'] = sys.modules['prometheus_client'] = None\n"
        "try:\n"
        "    import ledger_server\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout == (
        "ledger_server needs prometheus_client, structlog (not installed): "
        "pip install 'shardledger[server]'\n"
    )
