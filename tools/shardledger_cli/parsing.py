"""The conventions every command follows, in one place: parsing, help, --db, --json, --format.

A command module uses them like this (see commands/reads.py)::

    p = sub.add_parser("shards", parents=[common], help=..., description=...,
                       epilog=examples(
                           "shardledger shards night-01 --state stale",
                           "shardledger shards night-01 --json | jq .shard_id",
                       ))
    json_help(p, lines="one object per shard")   # says which --json shape it prints
    add_format_option(p)                           # --format table|plain|json
    ...
    fmt = output_format(args)                      # json, table (a terminal) or plain

* `Parser` is the class of every parser and subparser (`add_subparsers` passes its
  own class on): a mistake is answered with the usage of the (sub)command it was
  made in, exit 2, and "did you mean" for a misspelt command, choice or flag.
* Every command's `--help` ends with an Examples block (`examples()`); a test
  walks the whole parser and fails for a command without one.
* `--db` / `--database-url` are one option (`add_db_option`), defaulting to
  $SHARDLEDGER_DATABASE_URL wherever a database is opened directly; on a read command
  that otherwise asks a server (`local_ledger.serve_db_option`) it is only ever given.
* `--json` prints an object for a single answer and JSON Lines (one object a
  line) for lists and streams; `json_help` states which in each command's help.
* Output formats: every command that prints a table or a report takes `--format
  table|plain|json` (`add_format_option`; `--json` is `--format json`). table is for
  a person, the default on a terminal. plain, the default when stdout is not a
  terminal, never draws boxes: blocks of tab-separated lines, each a header line then
  its rows; a command printing several blocks puts a `# NAME` line before each, and
  any other line starting with `#` is a note. Scripts should read --json, whose shape
  is stable; plain is for grep, cut and logs.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, Final, Literal, NoReturn

ENV_DATABASE_URL: Final = "SHARDLEDGER_DATABASE_URL"
EXAMPLES_HEADING: Final = "Examples:"
FORMATS: Final = ("table", "plain", "json")
JSON_RULE: Final = (
    "print JSON: one object for a single answer, JSON Lines (one object per line) for lists"
    " and streams"
)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps texts written over several lines as written (Examples), wraps one-line texts."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text.strip():
            return super()._fill_text(text, width, indent)
        return argparse.HelpFormatter._fill_text(self, text, width, indent)


class DefaultsHelpFormatter(HelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to options whose help does not already say it and whose X is real."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action) or text


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that answers mistakes in the right (sub)command with a suggestion."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        # A subcommand's leftovers are its own mistakes: argparse would hand them up and
        # the top level would print its usage, not the subcommand's (`status RUN --jsn`).
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(self.unrecognized(extras))
        assert parsed is not None
        return parsed, extras

    def unrecognized(self, extras: Sequence[str]) -> str:
        """Returns "unrecognized arguments: ..." with the closest flag for a misspelt one."""
        message = "unrecognized arguments: " + " ".join(extras)
        flags = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        for extra in extras:
            if extra.startswith("-"):
                import difflib  # only a mistake pays for it

                close = difflib.get_close_matches(extra.split("=", 1)[0], flags, n=1, cutoff=0.6)
                if close:
                    return f"{message} (did you mean {close[0]}?)"
        return message

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is None or value in action.choices:
            return
        names = [str(c) for c in action.choices]
        import difflib

        close = difflib.get_close_matches(str(value), names, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise argparse.ArgumentError(
            action, f"invalid choice: {value!r}{hint} (choose from {', '.join(names)})"
        )

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def whole_number(minimum: int) -> Callable[[str], int]:
    """Returns an argparse type: an int of at least `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, not {value}")
        return value

    return parse


def examples(*lines: str, notes: str = "") -> str:
    """Returns an epilog: the Examples block (one command a line, `  # why` allowed), then notes."""
    block = "\n".join(f"  {line}" for line in lines)
    text = f"{EXAMPLES_HEADING}\n{block}\n"
    return f"{text}\n{notes.strip()}\n" if notes.strip() else text


def with_examples(epilog: str | None, *lines: str) -> str:
    """Returns an existing epilog with an Examples block in front of it."""
    return examples(*lines, notes=epilog or "")


def json_help(parser: argparse.ArgumentParser, *, lines: str = "", single: str = "") -> None:
    """States this command's --json shape in its help: JSON Lines of `lines`, or one `single`.

    The --json option comes from the shared parent parser, whose action object every
    command shares; it is replaced by a copy here so only this command's help changes.
    """
    shape = (
        f"print JSON Lines: {lines}, one per line"
        if lines
        else f"print one JSON object: {single or 'the answer'}"
    )
    for group in parser._action_groups:
        for i, action in enumerate(group._group_actions):
            if "--json" not in action.option_strings:
                continue
            clone = copy.copy(action)
            clone.help = shape
            group._group_actions[i] = clone
            parser._actions[parser._actions.index(action)] = clone
            for option in action.option_strings:
                parser._option_string_actions[option] = clone
            return
    raise ValueError(f"{parser.prog} has no --json option")


def add_json_option(parser: argparse.ArgumentParser, *, lines: str = "", single: str = "") -> None:
    """Adds --json to a command without the shared client options, stating its shape."""
    parser.add_argument("--json", action="store_true", help=JSON_RULE)
    json_help(parser, lines=lines, single=single)


def add_format_option(parser: argparse.ArgumentParser) -> None:
    """Adds --format table|plain|json (default: table on a terminal, plain when piped)."""
    parser.add_argument(
        "--format",
        dest="output_format",
        choices=FORMATS,
        default=None,
        help="table: for a person (the default on a terminal); plain: tab-separated, a"
        " header line per block, a '# NAME' line before each block where there are"
        " several, other '#' lines notes, never box drawing (the default when stdout is"
        " not a terminal); json: as --json, what a script should read",
    )


def output_format(args: argparse.Namespace) -> Literal["table", "plain", "json"]:
    """Returns how to print: json for --json, the --format given, else by what stdout is."""
    if getattr(args, "json", False):
        return "json"
    chosen = getattr(args, "output_format", None)
    if chosen == "json":
        return "json"
    if chosen == "plain":
        return "plain"
    if chosen == "table":
        return "table"
    return "table" if sys.stdout.isatty() else "plain"


def add_db_option(
    parser: argparse.ArgumentParser | Any,
    *,
    default: str | None = None,
    required: bool = True,
    env: bool = True,
    help: str = "the ledger database: a SQLite path, sqlite:///PATH or postgresql://USER@HOST/DB",
) -> None:
    """Adds --db (alias --database-url), from $SHARDLEDGER_DATABASE_URL when env, else default.

    Read into args.db. Without env the variable is not consulted: a command whose --db
    switches from the server to a file (audit --db) must not switch because of it.
    """
    value = (os.environ.get(ENV_DATABASE_URL) or None) if env else None
    value = value or default
    where = f"${ENV_DATABASE_URL}" if env else ""
    if where and default:
        where += f", else {default}"
    elif default:
        where = default
    parser.add_argument(
        "--db",
        "--database-url",
        dest="db",
        metavar="PATH|URL",
        default=value,
        required=required and value is None,
        help=f"{help} (default: {where})" if where else help,
    )


def subcommand_parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ("shardledger",)
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Returns every parser under parser, with its command path, parents first."""
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found += subcommand_parsers(child, (*path, name))
    return found
