"""`shardledger shards`: a run's shards (or every attempt) in plan order, as columns or JSON Lines."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

from shardledger_cli.cli import EXIT_OK, EXIT_REJECTED, CommandError, client_from
from shardledger_cli.output import iso_us, tsv_cell
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
# shards --attempts: one row per attempt. ATTEMPT numbers a shard's attempts from 1 in
# the order they started; OUTCOME is what that attempt came to (docs/concepts.md).
ATTEMPT_COLUMNS: Final = (
    "INDEX",
    "SHARD",
    "ATTEMPT",
    "ATTEMPT ID",
    "OUTCOME",
    "DETAIL",
    "HOST",
    "JOB",
    "STARTED",
    "ENDED",
    "RECEIVED",
    "LATE",
)


def run_shards(args: argparse.Namespace) -> int:
    """Lists shards (or, with --attempts, every attempt) in plan order: columns or JSON Lines."""
    page = min(args.limit, 1000) if args.limit else 1000
    views = client_from(args).shards(
        args.run, namespace=args.namespace, state=args.state, page_size=page
    )
    limited: Iterator[Any] = itertools.islice(views, args.limit or None)
    # The first page is fetched before anything is printed: an unknown run or an
    # unreachable server leaves stdout empty, not a header.
    first = list(itertools.islice(limited, page))
    out, fmt = sys.stdout, output_format(args)
    every = itertools.chain(first, limited)
    if getattr(args, "attempts", False):
        rows = (row for v in every for row in attempt_rows(json.loads(v.view_json)))
        if fmt == "json":
            out.writelines(json.dumps(row, sort_keys=True) + "\n" for row in rows)
            return EXIT_OK
        _print_columns(ATTEMPT_COLUMNS, (attempt_cells(row) for row in rows), fmt, page)
        return EXIT_OK
    if fmt == "json":
        # One view per line, streamed: a million shards never sit in memory whole.
        out.writelines(view.view_json + "\n" for view in every)
        return EXIT_OK
    _print_columns(COLUMNS, (row_cells(json.loads(v.view_json)) for v in every), fmt, page)
    return EXIT_OK


def _print_columns(columns: Sequence[str], rows: Iterator[list[str]], fmt: str, page: int) -> None:
    """Prints a header and rows: tab-separated (plain), or aligned columns (table)."""
    out = sys.stdout
    if fmt == "plain":
        out.write("\t".join(columns) + "\n")
        out.writelines("\t".join(tsv_cell(c) for c in cells) + "\n" for cells in rows)
        return
    # Aligned to the widest cell of the first page; a later, longer cell widens its
    # row only. Nothing is ever cut: a shard id is what the next command needs.
    head = list(itertools.islice(rows, page))
    widths = [max([len(c), *(len(r[i]) for r in head)]) for i, c in enumerate(columns)]
    out.write(_aligned(list(columns), widths))
    for cells in itertools.chain(head, rows):
        out.write(_aligned(cells, widths))


def attempt_rows(view: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Returns one object per attempt of a shard view, in start order (--attempts --json)."""
    history = view.get("attempt_history")
    if history is None:
        raise CommandError(
            "this ledger server predates per-attempt views: `shards --attempts` needs a"
            " server of this release (`shardledger events RUN --shard ID` lists every attempt)",
            EXIT_REJECTED,
        )
    return [
        {
            "shard_id": view["shard_id"],
            "plan_index": view["plan_index"],
            "attempt": number,
            "latest": a["attempt_id"] == view["latest_attempt"],
            "job": scheduler_label(a.get("scheduler") or {}),
            **a,
        }
        for number, a in enumerate(history, 1)
    ]


def attempt_cells(row: Mapping[str, Any]) -> list[str]:
    """Returns one attempt as the text of ATTEMPT_COLUMNS ("-" for nothing)."""
    return [
        str(row["plan_index"]),
        row["shard_id"],
        str(row["attempt"]),
        row["attempt_id"],
        row["outcome"],
        row["detail"] or "-",
        row["host"] or "-",
        row["job"] or "-",
        *_span_times(row),
        iso_us(row["started_us"]),
        _late(row),
    ]


def _span_times(row: Mapping[str, Any]) -> tuple[str, str]:
    """Returns STARTED and ENDED on the clock the attempt's span is read on.

    The job's own clock where both ends carry it (a spool drain then never shows as the
    start); RECEIVED beside them is when the ledger had the start.
    """
    if row.get("span_clock") == "job" and row.get("client_started_us"):
        return iso_us(row["client_started_us"]), iso_us(row.get("client_ended_us"))
    return iso_us(row["started_us"]), iso_us(row["ended_us"])


def _late(row: Mapping[str, Any]) -> str:
    """Returns "late" and which end waited, or "-": whether the ledger had its events late."""
    if not row.get("late"):
        return "-"
    gap = row.get("delivery_gap_us")
    if gap is not None and abs(gap) >= 1_000_000:
        # The two transits' difference: the clocks cancel, what is left is the wait.
        return f"late (its {'start' if gap > 0 else 'end'} waited {abs(gap) / 1e6:.0f} s)"
    return "late"


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
    """Returns a scheduler identity as one word: slurm:123_4@node, kubernetes:ns/pod@node,
    ray:JOB/TASK#ATTEMPT@NODE (the node id cut to 12 hex characters)."""
    kind, node = s.get("kind", ""), s.get("node", "")
    if not kind:
        return ""
    if kind == "ray":
        task = f"/{s['task_id']}#{s.get('task_attempt', '0')}" if s.get("task_id") else ""
        return f"ray:{s.get('job_id', '')}{task}" + (f"@{node[:12]}" if node else "")
    if kind == "slurm":
        task = s.get("array_task_id", "")
        job = f"{s.get('array_job_id', '')}_{task}" if task else s.get("job_id", "")
        cluster = s.get("cluster", "")
        where = f"{cluster}/" if cluster else ""
    else:
        namespace = s.get("namespace", "")
        job, where = s.get("job_id", ""), f"{namespace}/" if namespace else ""
    return f"{kind}:{where}{job}" + (f"@{node}" if node else "")
