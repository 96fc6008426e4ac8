"""Every CLI command is documented, and the reference matches the code."""

from __future__ import annotations

import argparse
import subprocess
import sys

from shardledger_cli.cli import COMMAND_MODULES, build_parser
from tools import gen_cli_docs, gen_config_docs


def test_cli_reference_is_generated_from_the_current_help_texts() -> None:
    assert gen_cli_docs.DOC.read_text() == gen_cli_docs.render(), (
        "run: python -m tools.gen_cli_docs"
    )


def test_every_command_module_registers_a_documented_command() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    names = set(sub.choices)
    assert len(names) >= len(COMMAND_MODULES)
    text = gen_cli_docs.DOC.read_text()
    for name in names:
        assert f"## `shardledger {name}`" in text
        assert sub.choices[name].description or sub.choices[name].format_help()


def test_console_script_help_lists_commands_and_exit_codes() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "shardledger_cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "exit codes: 0 ok, 1 problems found" in out.stdout
    for name in ("serve", "plan", "status", "resume", "verify", "audit", "demo", "watch", "token"):
        assert name in out.stdout


def test_configuration_page_is_generated_from_the_parser_and_the_sources() -> None:
    assert gen_config_docs.problems() == [], "describe each variable in tools/gen_config_docs.py"
    assert gen_config_docs.DOC.read_text() == gen_config_docs.render(), (
        "run: python -m tools.gen_config_docs"
    )


def test_configuration_page_names_every_variable_the_code_reads_and_every_flag() -> None:
    text = gen_config_docs.DOC.read_text()
    for name in gen_config_docs.variables_in_code():
        assert f"| `{name}` |" in text
    for flag in ("`--db`, `--database-url`", "`--format`", "`--shard`", "`--tls-cert`"):
        assert flag in text
