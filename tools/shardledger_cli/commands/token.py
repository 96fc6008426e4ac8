"""`shardledger token create|list|revoke`: manage access tokens in the ledger database."""

from __future__ import annotations

import argparse
import re
import sys
import time
from datetime import UTC, datetime

from ledger_server.auth import ROLES, new_token
from ledger_server.config import DEFAULT_DB
from ledger_server.errors import InvalidEvent
from ledger_server.validation import check_namespace
from shardledger_cli.cli import EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, CommandError, open_ledger
from shardledger_cli.output import print_json, print_json_lines, print_table
from shardledger_cli.parsing import (
    add_db_option,
    add_format_option,
    add_json_option,
    examples,
    output_format,
)

_DURATION = re.compile(r"(\d+)([smhdw])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """Adds the token commands."""
    p = sub.add_parser(
        "token",
        epilog=examples(
            "shardledger token create --role writer --namespace team-a --expires-in 30d",
            "shardledger token list",
        ),
        help="create, list and revoke access tokens",
        description="Manage bearer tokens. Tokens are stored only as hashes; the secret is printed "
        "once, at creation. These commands open the database directly (run them where the "
        "ledger's database lives); the server sees changes at the next call.",
    )
    tsub = p.add_subparsers(dest="token_command", metavar="ACTION", required=True)
    db_help = "ledger database: a SQLite path or a postgresql:// URL"
    create = tsub.add_parser(
        "create",
        epilog=examples(
            "shardledger token create --role writer --namespace team-a --expires-in 30d --description 'slurm jobs'",
            "umask 077; shardledger token create --role writer --json | jq -r .token > ~/.shardledger/token",
        ),
        help="create a token and print it once",
    )
    add_db_option(create, default=DEFAULT_DB, help=db_help)
    create.add_argument(
        "--role", required=True, choices=ROLES, help="admin, auditor, writer or reader"
    )
    create.add_argument("--namespace", default="default", help="the tenant the token belongs to")
    create.add_argument(
        "--run-prefix", default="", help="writer only: limit appends to runs starting with this"
    )
    create.add_argument(
        "--expires-in", default=None, metavar="DURATION", help="e.g. 12h, 30d, 2w (default: never)"
    )
    create.add_argument("--description", default="", help="who or what uses the token")
    add_json_option(create, single="the token (its secret, once) and its id")
    create.set_defaults(func=run_create)
    lst = tsub.add_parser(
        "list",
        epilog=examples(
            "shardledger token list",
            "shardledger token list --json | jq -r 'select(.status == \"active\") | .token_id'",
        ),
        help="list tokens (never their secrets)",
    )
    add_db_option(lst, default=DEFAULT_DB, help=db_help)
    add_json_option(lst, lines="one token (never its secret)")
    add_format_option(lst)
    lst.set_defaults(func=run_list)
    revoke = tsub.add_parser(
        "revoke",
        epilog=examples("shardledger token revoke 3f2a9c1b0d4e"),
        help="revoke a token by id",
    )
    revoke.add_argument("token_id", help="the id shown by `token list` (the part after slt_)")
    add_db_option(revoke, default=DEFAULT_DB, help=db_help)
    revoke.set_defaults(func=run_revoke)


def parse_duration(text: str) -> int:
    """Returns a duration like 30d or 12h in seconds."""
    match = _DURATION.fullmatch(text.strip())
    if not match:
        raise CommandError(
            f"bad duration {text!r}: use a number and one of s, m, h, d, w (e.g. 30d)", EXIT_USAGE
        )
    seconds = int(match.group(1)) * _UNITS[match.group(2)]
    if seconds == 0:
        # A token that expires as it is created is never usable; leave --expires-in out for "never".
        raise CommandError(
            f"bad duration {text!r}: --expires-in must be more than zero"
            " (leave it out for a token that never expires)",
            EXIT_USAGE,
        )
    return seconds


def _now_us() -> int:
    return time.time_ns() // 1000


def _iso(us: int | None) -> str:
    return "" if us is None else datetime.fromtimestamp(us / 1e6, UTC).isoformat(timespec="seconds")


def run_create(args: argparse.Namespace) -> int:
    """Creates a token."""
    try:
        namespace = check_namespace(args.namespace)
    except InvalidEvent as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    now = _now_us()
    expires = now + parse_duration(args.expires_in) * 1_000_000 if args.expires_in else None
    try:
        token, row = new_token(
            namespace=namespace,
            role=args.role,
            run_prefix=args.run_prefix,
            description=args.description,
            now_us=now,
            expires_us=expires,
        )
    except ValueError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    store = open_ledger(args.db)
    try:
        store.create_token(row)
    finally:
        store.close()
    if args.json:
        print_json(
            {
                "token": token,
                "token_id": row.token_id,
                "role": row.role,
                "namespace": namespace,
                "run_prefix": row.run_prefix,
                "expires": _iso(expires),
            }
        )
    else:
        print(token)
        print(
            f"created {row.role} token {row.token_id} for namespace {namespace!r}"
            + (f", runs {row.run_prefix}*" if row.run_prefix else "")
            + (f", expires {_iso(expires)}" if expires else "")
            + ". Store it now: it is not shown again.",
            file=sys.stderr,
        )
    return EXIT_OK


def run_list(args: argparse.Namespace) -> int:
    """Lists tokens."""
    store = open_ledger(args.db)
    try:
        rows = store.list_tokens()
    finally:
        store.close()
    now = _now_us()
    items = [
        {
            "token_id": r.token_id,
            "role": r.role,
            "namespace": r.namespace,
            "run_prefix": r.run_prefix,
            "description": r.description,
            "created": _iso(r.created_us),
            "expires": _iso(r.expires_us),
            "status": "revoked"
            if r.revoked_us
            else "expired"
            if r.expires_us and r.expires_us <= now
            else "active",
        }
        for r in rows
    ]
    fmt = output_format(args)
    if fmt == "json":
        print_json_lines(items)
        return EXIT_OK
    if fmt == "plain":
        keys: tuple[str, ...] = ("token_id", "status", "role", "namespace", "run_prefix")
        keys += ("expires", "created", "description")
        cells = [[item[k] for k in keys] for item in items]
        print_table(None, [k.replace("_", " ") for k in keys], cells, plain=True)
    for item in items if fmt == "table" else ():
        print(
            f"{item['token_id']}  {item['status']:<8} {item['role']:<8} {item['namespace']:<16} "
            f"{item['run_prefix'] or '-':<12} {item['expires'] or 'never':<26} {item['description']}"
        )
    if not items:
        print("no tokens", file=sys.stderr)
    return EXIT_OK


def run_revoke(args: argparse.Namespace) -> int:
    """Revokes a token."""
    store = open_ledger(args.db)
    try:
        done = store.revoke_token(args.token_id, now_us=_now_us())
    finally:
        store.close()
    if not done:
        print(f"shardledger: no active token with id {args.token_id}", file=sys.stderr)
        return EXIT_PROBLEMS
    print(f"revoked {args.token_id}", file=sys.stderr)
    return EXIT_OK
