"""`shardledger shards`: a run's shards in plan order, as columns or JSON Lines."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Iterator, Mapping
from typing import Any, Final

from shardledger_cli.cli import EXIT_OK, client_from
from shardledger_cli.output import iso_us
from shardledger_cli.parsing import output_format

COLUMNS: Final = (
    "INDEX",
    "SHARD",
    "STATE",
    "DETAIL",
    "INPUT",
    "ATTEMPTS",
    "RANKS",
    "HOST",
    "JOB",
    "LAST SEEN",
    "DUPLICATES",
)


def run_shards(args: argparse.Namespace) -> int:
    """Lists shards in plan order: aligned columns, tab-separated columns or JSON Lines."""
    page = min(args.limit, 1000) if args.limit else 1000
    views = client_from(args).shards(
        args.run, namespace=args.namespace, state=args.state, page_size=page
    )
    limited: Iterator[Any] = itertools.islice(views, args.limit or None)
    # The first page is fetched before anything is printed: an unknown run or an
    # unreachable server leaves stdout empty, not a header.
    first = list(itertools.islice(limited, page))
    out, fmt = sys.stdout, output_format(args)
    if fmt == "json":
        # One view per line, streamed: a million shards never sit in memory whole.
        for view in itertools.chain(first, limited):
            out.write(view.view_json + "\n")
        return EXIT_OK
    rows = (row_cells(json.loads(v.view_json)) for v in itertools.chain(first, limited))
    if fmt == "plain":
        out.write("\t".join(COLUMNS) + "\n")
        out.writelines("\t".join(cells) + "\n" for cells in rows)
        return EXIT_OK
    # Aligned to the widest cell of the first page; a later, longer cell widens its
    # row only. Nothing is ever cut: a shard id is what the next command needs.
    head = [row_cells(json.loads(v.view_json)) for v in first]
    widths = [max([len(c), *(len(r[i]) for r in head)]) for i, c in enumerate(COLUMNS)]
    out.write(_aligned(list(COLUMNS), widths))
    for cells in itertools.chain(head, (row_cells(json.loads(v.view_json)) for v in limited)):
        out.write(_aligned(cells, widths))
    return EXIT_OK


def row_cells(v: Mapping[str, Any]) -> list[str]:
    """Returns one shard view as the text of its columns ("-" for nothing)."""
    job = scheduler_label(v.get("scheduler") or {}) or "-"
    return [
        str(v["plan_index"]),
        v["shard_id"],
        v["state"],
        v["detail"] or "-",
        v.get("input") or "-",
        str(v["attempts"]),
        _ranks(v),
        v["host"] or "-",
        job,
        iso_us(v["last_seen_us"]),
        ",".join(v["duplicates"]) or "-",
    ]


def _aligned(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip() + "\n"


def _ranks(view: Mapping[str, Any]) -> str:
    """Returns "alive/world" for a multi-rank attempt (ranks still heartbeating), else "-"."""
    if not view.get("world_size"):
        return "-"
    return f"{view['ranks_alive']}/{view['world_size']}"


def scheduler_label(s: Mapping[str, str]) -> str:
    """Returns a scheduler identity as one word: slurm:123_4@node, kubernetes:ns/pod@node."""
    kind, node = s.get("kind", ""), s.get("node", "")
    if not kind:
        return ""
    if kind == "slurm":
        task = s.get("array_task_id", "")
        job = f"{s.get('array_job_id', '')}_{task}" if task else s.get("job_id", "")
        cluster = s.get("cluster", "")
        where = f"{cluster}/" if cluster else ""
    else:
        namespace = s.get("namespace", "")
        job, where = s.get("job_id", ""), f"{namespace}/" if namespace else ""
    return f"{kind}:{where}{job}" + (f"@{node}" if node else "")
