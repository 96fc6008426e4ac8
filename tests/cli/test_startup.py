"""A CLI that answers at once: a call imports what its command needs and nothing more.

`shardledger --help` once imported every command module, and with them the server,
structlog, prometheus, cryptography and gRPC (1.2 s of CPU); every call paid it. Now
`import shardledger_cli.cli` loads none of them, a run imports only its command's
module, and the other commands stand in the parser as their name and help line
(cli.COMMANDS). These tests hold that table to what the modules register, so the
help a stand-in gives is the help the command gives. CPU figures are in
`python -m tools.bench.cli`, never asserted here.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
from typing import Final

import pytest

from shardledger_cli import cli
from shardledger_cli.parsing import Parser

HEAVY = (
    "ledger_server",
    "structlog",
    "prometheus_client",
    "cryptography",
    "grpc",
    "google.protobuf",
    "rich",
    "torch",
)


# The ledger's format numbers (`version` prints them) and state names load nothing else:
# the parts of ledger_server a light command may import.
LIGHT: Final = ("ledger_server", "ledger_server.formats", "ledger_server.states")


def loaded_after(code: str) -> list[str]:
    """Returns the heavy packages a fresh interpreter has loaded after running code."""
    probe = (
        "import sys\n"
        + code
        + "\nimport json\n"
        + f"print(json.dumps(sorted({{m.split('.')[0] if not m.startswith('google.protobuf')"
        f" else 'google.protobuf' for m in sys.modules if m not in {LIGHT!r}}}"
        f" & set({list(HEAVY)!r}))))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 0, run.stderr
    loaded: list[str] = json.loads(run.stdout.splitlines()[-1])
    return loaded


def test_importing_the_cli_loads_no_server_logging_metrics_crypto_or_grpc() -> None:
    assert loaded_after("import shardledger_cli.cli") == []


def test_help_and_version_load_no_command_module() -> None:
    code = (
        "import contextlib, io\n"
        "from shardledger_cli.cli import main\n"
        "for argv in (['--help'], ['--version'], []):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        main(argv)\n"
        "assert not [m for m in sys.modules if m.startswith('shardledger_cli.commands.')], [\n"
        "    m for m in sys.modules if m.startswith('shardledger_cli.commands.')]\n"
    )
    assert loaded_after(code) == []


def test_a_typo_gets_its_suggestion_without_loading_a_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["statsu", "night-01"])
    assert exit_.value.code == 2
    assert "did you mean 'status'" in capsys.readouterr().err


def test_the_command_table_is_what_the_modules_register() -> None:
    registered = []
    for module in cli.COMMAND_MODULES:
        parser = Parser(prog="shardledger")
        sub = parser.add_subparsers(dest="command")
        importlib.import_module(module).register(sub, cli.common_parent())
        registered += [(a.dest, module, a.help) for a in sub._choices_actions]
    assert registered == list(cli.COMMANDS)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_the_parser_of_a_run_helps_as_the_full_parser_does() -> None:
    full = cli.build_parser()
    assert cli.parser_for(["--help"]).format_help() == full.format_help()
    commands = _subparsers(full)
    for name, _, _ in cli.COMMANDS:
        lazy = cli.parser_for([name, "--help"])
        assert lazy.format_help() == full.format_help(), name
        assert _subparsers(lazy)[name].format_help() == commands[name].format_help(), name


def test_a_command_runs_with_only_its_module_loaded() -> None:
    code = (
        "import contextlib, io\n"
        "from shardledger_cli.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['version', '--json']) == 0\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('shardledger_cli.commands.'))\n"
        "assert loaded == ['shardledger_cli.commands.meta'], loaded\n"
    )
    assert loaded_after(code) == []
