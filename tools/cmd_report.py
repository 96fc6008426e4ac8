"""`shardledger status|shards|resume|events|runs`: read a run's projections and its events."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from typing import IO, Any, Final

from ledger_server.projections import QUERY_STATES
from tools.cli import EXIT_OK, EXIT_PROBLEMS, CommandError, client_from, print_json

RESUME_FORMATS: Final = ("jsonl", "ids", "slurm-array")
REASON_KEY: Final = "_resume_reason"
# The resume list can hold millions of lines; a large buffer keeps write() calls rare.
_WRITE_BUFFER: Final = 1 << 20

Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]


def register(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    """Adds the status, shards, resume, events and runs commands."""
    raw = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "status",
        parents=[common],
        formatter_class=raw,
        help="a run's summary: submitted = verified + failed + missing + ...",
        description="Print the run summary: the reconciliation equation, completion rate\n"
        "(verified / submitted), silent error rate, failure tags, duplicates and\n"
        "fingerprint groups. --json prints the summary object the server computed.\n\n"
        "exit codes: 0 every planned shard is verified; 1 some shard is not;\n"
        "3 server unreachable; 4 refused (e.g. unknown run)",
    )
    p.add_argument("run", help="run id")
    p.set_defaults(func=run_status)

    p = sub.add_parser(
        "shards",
        parents=[common],
        formatter_class=raw,
        help="list a run's shards, optionally in one state",
        description="List the run's shards in plan order as fixed-width columns (streamed,\n"
        "so a million shards print without building a table in memory).\n"
        "--json prints one JSON array of shard views.\n\n"
        "states: " + ", ".join(QUERY_STATES) + "\n"
        "exit codes: 0 listed (even when empty); 3 unreachable; 4 refused",
    )
    p.add_argument("run", help="run id")
    p.add_argument("--state", choices=QUERY_STATES, default="", help="only shards in this state")
    p.add_argument("--limit", type=_non_negative, default=0, help="at most N shards (0: all)")
    p.set_defaults(func=run_shards)

    p = sub.add_parser(
        "resume",
        parents=[common],
        formatter_class=raw,
        help="exactly the shards that must run again",
        description="Stream the resume list: every planned shard without a confirmed\n"
        "(committed and verified) artifact, in plan order.\n\n"
        "formats:\n"
        "  jsonl        the original plan lines as stored, one per line (default);\n"
        f"               --reasons adds a {REASON_KEY!r} key to each\n"
        "  ids          one shard id per line\n"
        "  slurm-array  plan_index ranges like 3-5,9,12-14 for `sbatch --array=`\n\n"
        "-o FILE replaces FILE atomically (temp file, fsync, rename); a count of\n"
        "shards by reason goes to stderr.\n"
        "exit codes: 0 nothing to re-run; 1 shards must re-run; 3 unreachable;\n"
        "4 refused; 5 the output file could not be written",
    )
    p.add_argument("run", help="run id")
    p.add_argument("-o", "--output", metavar="FILE", default=None, help="write here instead of stdout")
    p.add_argument("--format", choices=RESUME_FORMATS, default="jsonl", help="output format")
    p.add_argument("--reasons", action="store_true", help=f"jsonl only: add {REASON_KEY!r}")
    p.set_defaults(func=run_resume)

    p = sub.add_parser(
        "events",
        parents=[common],
        formatter_class=raw,
        help="print a run's events, or follow them",
        description="Print one line per event: sequence, receive time, shard, attempt,\n"
        "kind and a short payload. --json prints JSON lines (protobuf JSON mapping).\n"
        "--follow keeps streaming new events until Ctrl-C (which exits 0).",
    )
    p.add_argument("run", help="run id")
    p.add_argument("--after", type=_non_negative, default=0, metavar="SEQ", help="only events after SEQ")
    p.add_argument("--follow", "-f", action="store_true", help="stream new events as they commit")
    p.set_defaults(func=run_events)

    p = sub.add_parser(
        "runs",
        parents=[common],
        help="list runs, most recently updated first",
        description="List the namespace's runs, most recently updated first.",
    )
    p.add_argument("--limit", type=_positive, default=100, help="at most N runs (default 100)")
    p.set_defaults(func=run_runs)


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must not be negative")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def iso_us(us: int | None) -> str:
    """Returns microseconds since the epoch as an ISO-8601 UTC time ("-" for None)."""
    if us is None:
        return "-"
    return datetime.fromtimestamp(us / 1e6, tz=UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


# --- status -----------------------------------------------------------------


def run_status(args: argparse.Namespace) -> int:
    """Prints the run summary; exits 0 only when every planned shard is verified."""
    summary: dict[str, Any] = json.loads(client_from(args).summary(args.run, namespace=args.namespace))
    if args.json:
        print_json(summary)
    else:
        render_summary(summary)
    done = summary["submitted"] > 0 and summary["verified"] == summary["submitted"]
    return EXIT_OK if done else EXIT_PROBLEMS


def equation(s: dict[str, Any]) -> str:
    """Returns the reconciliation line: submitted = verified + failed + missing + ..."""
    parts = ("verified", "failed", "missing", "running", "stale", "unverified")
    return f"submitted {s['submitted']} = " + " + ".join(f"{k} {s[k]}" for k in parts)


def render_summary(s: dict[str, Any]) -> None:
    """Prints the summary as rich tables on stdout."""
    from rich.console import Console
    from rich.table import Table

    # markup off: shard ids, tags and reasons are data, never rich markup.
    console = Console(file=sys.stdout, markup=False, highlight=False, soft_wrap=True)
    console.print(
        f"run {s['run_id']} (namespace {s['namespace']}) as of {iso_us(s.get('as_of_us'))}, "
        f"{s.get('event_count', 0)} events, head {str(s.get('head_hash', ''))[:16]}",
        style="bold",
    )
    console.print(equation(s))
    sub = s["submitted"] or 1
    states = Table(title="shards", title_justify="left")
    states.add_column("state")
    states.add_column("shards", justify="right")
    states.add_column("share", justify="right")
    for key, label in (
        ("verified", "verified"),
        ("failed", "failed (incl. verify failed)"),
        ("verify_failed", "  of which verify failed"),
        ("missing", "missing (never started)"),
        ("running", "running"),
        ("stale", "stale (silent past timeout)"),
        ("unverified", "committed, not verified"),
    ):
        states.add_row(label, str(s[key]), f"{100 * s[key] / sub:.1f} %")
    console.print(states)
    console.print(f"completion rate    {100 * s['completion_rate']:.2f} %  (verified / submitted)")
    console.print(
        f"silent error rate  {100 * s['silent_error_rate']:.2f} %  "
        f"({s['silent_errors']} reported success but failed verification or were incomplete)"
    )
    dups = s["duplicates"]
    console.print(
        f"duplicates         {s['duplicate_shards']} shards: "
        + ", ".join(f"{k} {dups[k]}" for k in sorted(dups))
    )
    console.print(f"attempts           {s['attempts']}")
    for title, key, head in (
        ("failure tags (latest attempt of failed shards)", "failure_tags", "tag"),
        ("failure tags (every failed attempt)", "attempt_failure_tags", "tag"),
        ("verification failures", "verify_failures", "reason"),
        ("fingerprint groups (latest attempt)", "fingerprint_groups", "fingerprint"),
    ):
        _counts_table(console, title, head, s.get(key) or {})


def _counts_table(console: Any, title: str, head: str, counts: dict[str, int]) -> None:
    from rich.table import Table

    if not counts:
        return
    table = Table(title=title, title_justify="left")
    table.add_column(head)
    table.add_column("shards", justify="right")
    for key, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        table.add_row(key, str(n))
    console.print(table)


# --- shards -----------------------------------------------------------------

_SHARD_COLUMNS: Final = (
    ("INDEX", 7),
    ("SHARD", 32),
    ("STATE", 13),
    ("DETAIL", 16),
    ("ATTEMPTS", 8),
    ("HOST", 16),
    ("LAST SEEN", 20),
    ("DUPLICATES", 0),
)


def run_shards(args: argparse.Namespace) -> int:
    """Lists shards in plan order as columns or one JSON array."""
    client = client_from(args)
    page = min(args.limit, 1000) if args.limit else 1000
    views = client.shards(args.run, namespace=args.namespace, state=args.state, page_size=page)
    limited: Iterable[Any] = _take(views, args.limit) if args.limit else views
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
    out.write(_columns([c for c, _ in _SHARD_COLUMNS]))
    for view in limited:
        v = json.loads(view.view_json)
        out.write(
            _columns(
                [
                    str(v["plan_index"]),
                    v["shard_id"],
                    v["state"],
                    v["detail"] or "-",
                    str(v["attempts"]),
                    v["host"] or "-",
                    iso_us(v["last_seen_us"]),
                    ",".join(v["duplicates"]) or "-",
                ]
            )
        )
    return EXIT_OK


def _columns(cells: list[str]) -> str:
    parts = [cell.ljust(width) for cell, (_, width) in zip(cells, _SHARD_COLUMNS, strict=True)]
    return " ".join(parts).rstrip() + "\n"


def _take(items: Iterable[Any], n: int) -> Iterator[Any]:
    for i, item in enumerate(items):
        if i >= n:
            return
        yield item


# --- resume -----------------------------------------------------------------


def run_resume(args: argparse.Namespace) -> int:
    """Streams the resume list; exits 1 when any shard must run again."""
    if args.reasons and args.format != "jsonl":
        raise CommandError("--reasons applies to --format jsonl only", code=2)
    entries = client_from(args).resume(args.run, namespace=args.namespace)
    reasons: Counter[str] = Counter()
    with atomic_output(args.output) as out:
        if args.format == "slurm-array":
            write_slurm_array(entries, out, reasons)
        else:
            write_lines(entries, out, reasons, ids=args.format == "ids", with_reason=args.reasons)
    total = sum(reasons.values())
    detail = ", ".join(f"{r} {n}" for r, n in sorted(reasons.items()))
    where = f" (written to {args.output})" if args.output else ""
    print(f"{total} shards to re-run{where}" + (f": {detail}" if detail else ""), file=sys.stderr)
    return EXIT_PROBLEMS if total else EXIT_OK


def write_lines(
    entries: Iterable[Any], out: IO[str], reasons: Counter[str], *, ids: bool, with_reason: bool
) -> None:
    """Writes one plan line (or shard id) per entry, counting reasons."""
    batch: list[str] = []
    for entry in entries:
        reason = entry.reason
        reasons[reason] += 1
        if ids:
            batch.append(entry.shard_id + "\n")
        elif with_reason:
            batch.append(with_resume_reason(entry.plan_line, reason) + "\n")
        else:
            batch.append(entry.plan_line + "\n")
        if len(batch) >= 4096:
            out.writelines(batch)
            batch.clear()
    out.writelines(batch)


def with_resume_reason(line: str, reason: str) -> str:
    """Returns the plan line with a _resume_reason key, its other bytes unchanged."""
    stripped = line.rstrip()
    if f'"{REASON_KEY}"' in stripped or not stripped.endswith("}"):
        obj = json.loads(stripped)
        obj[REASON_KEY] = reason
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    # Appending before the closing brace keeps the stored line byte for byte.
    sep = "" if stripped[:-1].rstrip().endswith("{") else ","
    return f"{stripped[:-1]}{sep}\"{REASON_KEY}\":{json.dumps(reason)}}}"


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


@contextlib.contextmanager
def atomic_output(path: str | None) -> Iterator[IO[str]]:
    """Yields stdout, or a temp file that replaces path atomically and durably on success."""
    if path is None or path == "-":
        yield sys.stdout
        sys.stdout.flush()
        return
    target = os.path.abspath(path)
    directory = os.path.dirname(target)
    try:
        # The temp file lives beside the target: os.replace is atomic only within one filesystem.
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise CommandError(f"cannot write {path}: {exc.strerror}") from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; a resume list is an ordinary file
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n", buffering=_WRITE_BUFFER) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # makes the rename itself durable
    finally:
        os.close(dir_fd)


# --- events -----------------------------------------------------------------


def run_events(args: argparse.Namespace) -> int:
    """Prints the run's events, following new ones with --follow until Ctrl-C."""
    from google.protobuf.json_format import MessageToDict

    client = client_from(args)
    if args.follow:
        source = client.tail(args.run, namespace=args.namespace, after_sequence=args.after)
    else:
        source = client.list_events(args.run, namespace=args.namespace, after_sequence=args.after)
    out = sys.stdout
    try:
        for event in source:
            if args.json:
                data = MessageToDict(event, preserving_proto_field_name=True)
                out.write(json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n")
            else:
                out.write(event_line(event) + "\n")
            if args.follow:
                out.flush()
    except KeyboardInterrupt:
        if not args.follow:
            raise
    return EXIT_OK


def event_line(event: Any) -> str:
    """Returns the one-line text form of a ShardEvent."""
    when = iso_us(event.receive_time.seconds * 1_000_000 + event.receive_time.nanos // 1000)
    kind = event.WhichOneof("payload") or "?"
    return (
        f"{event.sequence:>8} {when} {event.shard_id} {event.attempt_id or '-'} {kind} "
        f"{short_payload(event, kind)}"
    ).rstrip()


def short_payload(event: Any, kind: str) -> str:
    """Returns a few key fields of the event's payload."""
    if kind == "planned":
        p = event.planned
        return f"index={p.plan_index} input={p.input_ref} outputs={','.join(p.expected_outputs) or '-'}"
    if kind == "started":
        s = event.started
        timeout = s.heartbeat_timeout.seconds + s.heartbeat_timeout.nanos / 1e9
        return f"host={s.host} pid={s.pid} timeout={timeout:g}s fp={s.fingerprint_digest[:12] or '-'}"
    if kind == "heartbeat":
        return f"step={event.heartbeat.step} progress={event.heartbeat.progress:.3f}"
    if kind == "checkpoint":
        return f"step={event.checkpoint.step} path={event.checkpoint.path}"
    if kind == "artifact_committed":
        a = event.artifact_committed
        return f"{a.name} {a.path} {a.size_bytes}B blake3={a.blake3_hex[:12]}"
    if kind == "verified":
        v = event.verified
        result = "PASSED" if v.result == 1 else "FAILED"
        return f"{result} {v.name} {v.path}" + (f" reason={v.reason}" if v.reason else "")
    if kind == "failed":
        from shard_client.api.shardledger.v1 import ledger_pb2 as pb

        tag = pb.FailureTag.Name(event.failed.tag).removeprefix("FAILURE_TAG_").lower()
        return f"tag={tag} {event.failed.message[:80]}"
    return ""


# --- runs -------------------------------------------------------------------


def run_runs(args: argparse.Namespace) -> int:
    """Lists runs, most recently updated first."""
    runs = client_from(args).list_runs(namespace=args.namespace, page_size=args.limit)
    rows = [
        {
            "namespace": r.namespace,
            "run_id": r.run_id,
            "event_count": r.event_count,
            "head_hash": r.head_hash.hex(),
            "create_time": iso_us(r.create_time.seconds * 1_000_000 + r.create_time.nanos // 1000),
            "update_time": iso_us(r.update_time.seconds * 1_000_000 + r.update_time.nanos // 1000),
        }
        for r in runs
    ]
    if args.json:
        print_json(rows)
        return EXIT_OK
    from rich.console import Console
    from rich.table import Table

    table = Table()
    for column in ("run", "namespace", "events", "created", "updated", "head"):
        table.add_column(column, justify="right" if column == "events" else "left")
    for row in rows:
        table.add_row(
            row["run_id"],
            row["namespace"],
            str(row["event_count"]),
            row["create_time"],
            row["update_time"],
            row["head_hash"][:16],
        )
    Console(file=sys.stdout, markup=False, highlight=False).print(table)
    return EXIT_OK
