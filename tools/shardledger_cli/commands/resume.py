"""`shardledger resume`: stream exactly the shards that must run again, in one of three formats."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import IO, Any, Final

from shardledger_cli.cli import EXIT_OK, EXIT_PROBLEMS, CommandError, client_from
from shardledger_cli.output import atomic_output, count_shards, write_lines

RESUME_FORMATS: Final = ("jsonl", "ids", "slurm-array")


def run_resume(args: argparse.Namespace) -> int:
    """Streams the resume list; exits 1 when any shard must run again."""
    if args.reasons and args.format != "jsonl":
        raise CommandError("--reasons applies to --format jsonl only", code=2)
    if args.json and args.format != "jsonl":
        raise CommandError(f"--json writes JSON lines; --format {args.format} is not JSON", code=2)
    client = client_from(args)
    entries = client.resume(args.run, namespace=args.namespace)
    reasons: Counter[str] = Counter()
    with atomic_output(args.output) as out:
        if args.format == "slurm-array":
            write_slurm_array(entries, out, reasons)
        elif args.json:
            write_entries_json(entries, out, reasons)
        else:
            write_lines(entries, out, reasons, ids=args.format == "ids", with_reason=args.reasons)
    total = sum(reasons.values())
    detail = ", ".join(f"{r} {n}" for r, n in sorted(reasons.items()))
    where = f" (written to {args.output})" if args.output else ""
    print(
        f"{count_shards(total)} to re-run{where}" + (f": {detail}" if detail else ""),
        file=sys.stderr,
    )
    if reasons.get("unverified"):
        hint_unverified(client, args, reasons["unverified"])
    return EXIT_PROBLEMS if total and not args.exit_zero else EXIT_OK


def hint_unverified(client: Any, args: argparse.Namespace, unverified: int) -> None:
    """Says on stderr when the list holds committed shards only because no verify ran yet."""
    summary = json.loads(client.summary(args.run, namespace=args.namespace))
    if summary["verified"] or summary["verify_failed"]:
        return
    print(
        f"hint: nothing in {args.run} is verified yet: the {count_shards(unverified)} committed"
        f" are listed as unverified. Run `shardledger verify {args.run} --root DIR` first;"
        " only shards it cannot confirm must run again.",
        file=sys.stderr,
    )


def write_entries_json(entries: Iterable[Any], out: IO[str], reasons: Counter[str]) -> None:
    """Writes one JSON object per entry: shard id, plan index, reason, the parsed plan line."""
    for entry in entries:
        reasons[entry.reason] += 1
        line = {
            "shard_id": entry.shard_id,
            "plan_index": entry.plan_index,
            "reason": entry.reason,
            "plan_line": json.loads(entry.plan_line) if entry.plan_line else None,
        }
        out.write(json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n")


def slurm_ranges(indexes: Iterable[int]) -> Iterator[str]:
    """Yields compact ranges ("3-5", "9") of ascending indexes, merging repeats."""
    start = end = -2
    for index in indexes:
        if index == end or index == end + 1:
            end = index
            continue
        if index < end:
            raise ValueError(f"plan indexes are not ascending: {index} after {end}")
        if start >= 0:
            yield f"{start}-{end}" if end > start else str(start)
        start = end = index
    if start >= 0:
        yield f"{start}-{end}" if end > start else str(start)


def write_slurm_array(entries: Iterable[Any], out: IO[str], reasons: Counter[str]) -> None:
    """Writes plan_index ranges, comma-separated, on one line."""

    def indexes() -> Iterator[int]:
        for entry in entries:
            reasons[entry.reason] += 1
            yield entry.plan_index

    first = True
    for part in slurm_ranges(indexes()):
        out.write(part if first else "," + part)
        first = False
    if not first:
        out.write("\n")
