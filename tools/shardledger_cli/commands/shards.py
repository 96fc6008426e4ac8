"""`shardledger shards`: a run's shards in plan order, as columns or one JSON array."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Iterator, Mapping
from typing import Any, Final

from shardledger_cli.cli import EXIT_OK, client_from
from shardledger_cli.output import iso_us

# (header, width); the last column takes what is left.
_SHARD_COLUMNS: Final = (("INDEX", 7), ("SHARD", 32), ("STATE", 13), ("DETAIL", 16))
_SHARD_COLUMNS_2: Final = (
    ("ATTEMPTS", 8),
    ("RANKS", 9),
    ("HOST", 16),
    ("JOB", 24),
    ("LAST SEEN", 20),
    ("DUPLICATES", 0),
)


def run_shards(args: argparse.Namespace) -> int:
    """Lists shards in plan order as columns or one JSON array."""
    page = min(args.limit, 1000) if args.limit else 1000
    views = client_from(args).shards(
        args.run, namespace=args.namespace, state=args.state, page_size=page
    )
    limited: Iterator[Any] = itertools.islice(views, args.limit or None)
    # The first page is fetched before anything is printed: an unknown run or an
    # unreachable server leaves stdout empty, not a half-opened array or a header.
    first = next(limited, None)
    if first is not None:
        limited = itertools.chain([first], limited)
    out = sys.stdout
    if args.json:
        # Streamed element by element so the array never sits in memory whole.
        out.write("[")
        empty = True
        for view in limited:
            out.write(("\n  " if empty else ",\n  ") + view.view_json)
            empty = False
        out.write("]\n" if empty else "\n]\n")
        return EXIT_OK
    out.write(_columns([c for c, _ in _SHARD_COLUMNS + _SHARD_COLUMNS_2]))
    for view in limited:
        v = json.loads(view.view_json)
        cells = [str(v["plan_index"]), v["shard_id"], v["state"], v["detail"] or "-"]
        job = scheduler_label(v.get("scheduler") or {}) or "-"
        cells += [str(v["attempts"]), _ranks(v), v["host"] or "-", job, iso_us(v["last_seen_us"])]
        out.write(_columns([*cells, ",".join(v["duplicates"]) or "-"]))
    return EXIT_OK


def _ranks(view: Mapping[str, Any]) -> str:
    """Returns "alive/world" for a multi-rank attempt (ranks still heartbeating), else "-"."""
    if not view.get("world_size"):
        return "-"
    return f"{view['ranks_alive']}/{view['world_size']}"


def _columns(cells: list[str]) -> str:
    widths = [w for _, w in _SHARD_COLUMNS + _SHARD_COLUMNS_2]
    return " ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip() + "\n"


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
