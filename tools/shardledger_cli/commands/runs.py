"""`shardledger runs`: a namespace's runs, most recently updated first."""

from __future__ import annotations

import argparse
import json
import sys

from shardledger_cli.cli import EXIT_OK, client_from
from shardledger_cli.output import iso_us, print_table, ts_us
from shardledger_cli.parsing import output_format

__all__ = ["run_runs"]


def run_runs(args: argparse.Namespace) -> int:
    """Lists runs, most recently updated first."""
    runs = client_from(args).list_runs(namespace=args.namespace, page_size=args.limit)
    keys = ("run_id", "namespace", "event_count", "create_time", "update_time", "head_hash")
    times = [(iso_us(ts_us(r.create_time)), iso_us(ts_us(r.update_time))) for r in runs]
    rows = [
        dict(zip(keys, (r.run_id, r.namespace, r.event_count, *t, r.head_hash.hex()), strict=True))
        | {"archived": r.archived, "archive_location": r.archive_location}
        for r, t in zip(runs, times, strict=True)
    ]
    fmt = output_format(args)
    if fmt == "json":
        for row in rows:
            sys.stdout.write(json.dumps(row, sort_keys=True) + "\n")
        return EXIT_OK
    # The head is shortened to 16 hex digits (`audit` shows it whole); nothing else is cut.
    cells = [
        [str(row[k])[: 16 if k == "head_hash" else None] for k in keys]
        + [row["archive_location"] if row["archived"] else "hot"]
        for row in rows
    ]
    heads = ("run", "namespace", "events", "created", "updated", "head", "stored")
    # print_table makes rich's console for a terminal only: a pipe never imports rich.
    print_table(None, heads, cells, plain=fmt == "plain")
    return EXIT_OK
