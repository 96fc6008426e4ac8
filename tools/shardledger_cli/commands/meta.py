"""`shardledger version` and `shardledger help`: what is installed, and help by name."""

from __future__ import annotations

import argparse

from shardledger_cli.cli import EXIT_OK, EXIT_USAGE, CommandError
from shardledger_cli.output import print_json
from shardledger_cli.parsing import add_json_option, examples
from shardledger_cli.versions import version_line, versions


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """Adds `version` and `help`."""
    p = sub.add_parser(
        "version",
        epilog=examples("shardledger version", "shardledger version --json | jq -r .shardledger"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="print the installed version (also --version) and what it runs on",
        description="Prints shardledger's version, the contract it speaks, the ledger formats it\n"
        "writes (the SQLite and PostgreSQL schema, a ledger at a lower one is migrated by\n"
        "`shardledger db migrate`; with --json also the event row and shard record formats)\n"
        "and the versions of Python, grpcio, protobuf and torch (null: not installed) it\n"
        "runs on.",
    )
    add_json_option(
        p,
        single="shardledger, contract, python, grpcio, protobuf, torch, and store: sqlite_schema,"
        " postgresql_schema, row_format, record_format (null without the server extra)",
    )
    p.set_defaults(func=run_version)
    h = sub.add_parser(
        "help",
        epilog=examples(
            "shardledger help", "shardledger help plan", "shardledger help spool drain"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="print the help of a command (the same as COMMAND --help)",
        description="Prints the help of COMMAND (and SUBCOMMAND), or of shardledger itself.",
    )
    h.add_argument("topic", nargs="*", metavar="COMMAND", help="a command, and a subcommand")
    h.set_defaults(func=run_help)


def run_version(args: argparse.Namespace) -> int:
    """Prints the versions."""
    if args.json:
        print_json(versions())
    else:
        print(version_line())
    return EXIT_OK


def run_help(args: argparse.Namespace) -> int:
    """Prints the help of the named command through the parser itself."""
    from shardledger_cli.cli import build_parser

    parser = build_parser()
    node: argparse.ArgumentParser = parser
    for word in args.topic:
        choices = _subcommands(node)
        if word not in choices:
            known = ", ".join(sorted(choices)) or "none"
            where = " ".join(["shardledger", *args.topic[: args.topic.index(word)]])
            raise CommandError(f"{where} has no command {word!r} (known: {known})", EXIT_USAGE)
        node = choices[word]
    node.print_help()
    return EXIT_OK


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}
