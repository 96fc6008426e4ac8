"""`shardledger status|shards|resume|events|runs`: read a run's projections and its events."""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import sys
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from typing import IO, Any, Final

from ledger_server.states import QUERY_STATES
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shardledger_cli.cli import EXIT_OK, EXIT_PROBLEMS, CommandError, at_least, client_from
from shardledger_cli.output import (
    REASON_KEY,
    atomic_output,
    equation,
    iso_us,
    print_json,
    shards,
    ts_us,
    write_lines,
)

RESUME_FORMATS: Final = ("jsonl", "ids", "slurm-array")


HELP: Final = {
    "status": """a run's summary: submitted = verified + failed + missing + ...

Print the run summary: the reconciliation equation, completion rate
(verified / submitted), silent error rate, failure tags, duplicates and
fingerprint groups. --json prints the summary object the server computed.

exit codes: 0 every planned shard is verified; 1 some shard is not;
3 server unreachable; 4 refused (e.g. unknown run)""",
    "shards": f"""list a run's shards, optionally in one state

List the run's shards in plan order as columns, streamed (a million shards
print without a table in memory). --json prints one JSON array of views.

states: {", ".join(QUERY_STATES)}
exit codes: 0 listed (even when empty); 3 unreachable; 4 refused""",
    "resume": f"""exactly the shards that must run again

Stream the resume list: every planned shard without a confirmed (committed
and verified) artifact, in plan order.

formats:
  jsonl        the original plan lines as stored, one per line (default);
               --reasons adds a "{REASON_KEY}" key to each
  ids          one shard id per line
  slurm-array  plan_index ranges like 3-5,9,12-14 for `sbatch --array=`

--json writes one JSON object per shard instead, {
        "shard_id", "plan_index", "reason", "plan_line"
    } with the plan line parsed (jsonl format only).

-o FILE replaces FILE atomically (temp file, fsync, rename); a count of
shards by reason goes to stderr. exit codes: 0 nothing to re-run; 1 shards must re-run; 3 unreachable;
4 refused; 5 the output file could not be written""",
    "events": """print a run's events, or follow them

Print one line per event: sequence, receive time, shard, attempt, kind and a
short payload. --json prints JSON lines (the protobuf JSON mapping). --follow
keeps streaming new events until Ctrl-C, which exits 0.""",
    "runs": "list runs, most recently updated first\n\nList the namespace's runs, newest first.",
}


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """Adds the status, shards, resume, events and runs commands."""
    funcs = {"status": run_status, "shards": run_shards, "resume": run_resume}
    funcs |= {"events": run_events, "runs": run_runs}
    parsers = {}
    for name, func in funcs.items():
        summary, _, description = HELP[name].partition("\n\n")
        raw = argparse.RawDescriptionHelpFormatter
        p = sub.add_parser(
            name, parents=[common], formatter_class=raw, help=summary, description=description
        )
        if name != "runs":
            p.add_argument("run", help="run id")
        p.set_defaults(func=func)
        parsers[name] = p
    p = parsers["shards"]
    p.add_argument("--state", choices=QUERY_STATES, default="", help="only shards in this state")
    p.add_argument("--limit", type=at_least(0), default=0, help="at most N shards (0: all)")
    p = parsers["resume"]
    p.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    p.add_argument("--format", choices=RESUME_FORMATS, default="jsonl", help="output format")
    p.add_argument("--reasons", action="store_true", help=f"jsonl only: add {REASON_KEY!r}")
    p = parsers["events"]
    p.add_argument("--after", type=at_least(0), default=0, metavar="SEQ", help="events after SEQ")
    p.add_argument("--follow", "-f", action="store_true", help="stream new events as they commit")
    parsers["runs"].add_argument("--limit", type=at_least(1), default=100, help="at most N runs")


def run_status(args: argparse.Namespace) -> int:
    """Prints the run summary; exits 0 only when every planned shard is verified."""
    summary: dict[str, Any] = json.loads(
        client_from(args).summary(args.run, namespace=args.namespace)
    )
    if args.json:
        print_json(summary)
    else:
        render_summary(summary)
    done = summary["submitted"] > 0 and summary["verified"] == summary["submitted"]
    return EXIT_OK if done else EXIT_PROBLEMS


def render_summary(s: dict[str, Any]) -> None:
    """Prints the summary as rich tables on stdout."""
    from rich.console import Console
    from rich.table import Column, Table

    # markup off: shard ids, tags and reasons are data, never rich markup.
    console = Console(file=sys.stdout, markup=False, highlight=False, soft_wrap=True)
    console.print(
        f"run {s['run_id']} (namespace {s['namespace']}) as of {iso_us(s.get('as_of_us'))}, "
        f"{s.get('event_count', 0)} events, head {str(s.get('head_hash', ''))[:16]}",
        style="bold",
    )
    console.print(equation(s))
    sub = s["submitted"] or 1
    right = ("shards", "share")
    states = Table("state", *(Column(c, justify="right") for c in right), title="shards")
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
    dups = ", ".join(f"{k} {n}" for k, n in sorted(s["duplicates"].items()))
    console.print(f"duplicates         {s['duplicate_shards']} shards: {dups}")
    console.print(
        f"repairs            {shards(s.get('repairs', 0))}  "
        "(a rerun replaced a failed, corrupted or missing result)"
    )
    console.print(f"attempts           {s['attempts']}")
    _first_pass(console, s)
    if s.get("numeric"):
        console.print(
            f"numeric pollution  {shards(s['numeric'])} reported NaN/Inf metrics"
            f" (shardledger shards {s['run_id']} --json shows the first step)"
        )
    if s.get("late_attempts"):
        console.print(
            f"late events        {s['late_attempts']} attempts' events arrived late from a"
            " spool: the figures above were wrong until they did"
        )
    for title, key, head in (
        ("failure tags (latest attempt of failed shards)", "failure_tags", "tag"),
        ("failure tags (every failed attempt)", "attempt_failure_tags", "tag"),
        ("verification failures", "verify_failures", "reason"),
        ("fingerprint groups (latest attempt)", "fingerprint_groups", "fingerprint"),
    ):
        _counts_table(console, title, head, s.get(key) or {})


def _first_pass(console: Any, s: dict[str, Any]) -> None:
    """Prints the first-pass figures beside the current ones (history no rerun rewrites)."""
    fp = s.get("first_pass")
    if not fp:
        return
    when = (
        f"closed at sequence {fp['closed_at_sequence']} (the run's first verdict)"
        if fp["closed"]
        else "still open: no verdict yet, so every attempt so far belongs to it"
    )
    console.print(f"first pass         {when}")
    console.print(
        f"  completion       {100 * fp['completion_rate']:.2f} %  now {100 * s['completion_rate']:.2f} %"
    )
    console.print(
        f"  silent errors    {100 * fp['silent_error_rate']:.2f} %  "
        f"now {100 * s['silent_error_rate']:.2f} %"
    )
    console.print(
        f"  reconciliation   {100 * fp['reconciliation_rate']:.2f} %  "
        "(verified on the first attempt / submitted)"
    )
    console.print(
        f"  recomputed       {100 * s.get('recomputed_rate', 0.0):.2f} %  "
        f"({shards(s.get('recomputed', 0))} ran more than once or after the first pass)"
    )


def _counts_table(console: Any, title: str, head: str, counts: dict[str, int]) -> None:
    from rich.table import Column, Table

    if not counts:
        return
    table = Table(head, Column("shards", justify="right"), title=title)
    for key, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        table.add_row(key, str(n))
    console.print(table)


# --- shards -----------------------------------------------------------------

# (header, width); the last column takes what is left.
_SHARD_COLUMNS: Final = (("INDEX", 7), ("SHARD", 32), ("STATE", 13), ("DETAIL", 16))
_SHARD_COLUMNS_2: Final = (
    ("ATTEMPTS", 8),
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
        cells += [str(v["attempts"]), v["host"] or "-", job, iso_us(v["last_seen_us"])]
        out.write(_columns([*cells, ",".join(v["duplicates"]) or "-"]))
    return EXIT_OK


def _columns(cells: list[str]) -> str:
    widths = [w for _, w in _SHARD_COLUMNS + _SHARD_COLUMNS_2]
    return " ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip() + "\n"


def run_resume(args: argparse.Namespace) -> int:
    """Streams the resume list; exits 1 when any shard must run again."""
    if args.reasons and args.format != "jsonl":
        raise CommandError("--reasons applies to --format jsonl only", code=2)
    if args.json and args.format != "jsonl":
        raise CommandError(f"--json writes JSON lines; --format {args.format} is not JSON", code=2)
    entries = client_from(args).resume(args.run, namespace=args.namespace)
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
    print(f"{total} shards to re-run{where}" + (f": {detail}" if detail else ""), file=sys.stderr)
    return EXIT_PROBLEMS if total else EXIT_OK


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


def run_events(args: argparse.Namespace) -> int:
    """Prints the run's events, following new ones with --follow until Ctrl-C."""
    client = client_from(args)
    ns, after, out = args.namespace, args.after, sys.stdout
    if not args.follow:
        for event in client.list_events(args.run, namespace=ns, after_sequence=after):
            out.write(_event_text(event, args.json) + "\n")
        return EXIT_OK
    tail = client.tail(args.run, namespace=ns, after_sequence=after)
    # Ctrl-C cancels the stream from another thread instead of raising inside gRPC.
    previous = signal.signal(
        signal.SIGINT, lambda *_: threading.Thread(target=tail.cancel, daemon=True).start()
    )
    try:
        for event in tail:
            out.write(_event_text(event, args.json) + "\n")
            out.flush()
    finally:
        signal.signal(signal.SIGINT, previous)
        client.close()
    return EXIT_OK


def _event_text(event: Any, as_json: bool) -> str:
    """Returns one event as a JSON line (the protobuf JSON mapping) or a text line."""
    if as_json:
        from google.protobuf.json_format import MessageToDict

        return _compact(MessageToDict(event, preserving_proto_field_name=True))
    return event_line(event)


def _compact(data: dict[str, Any]) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def event_line(event: Any) -> str:
    """Returns the one-line text form of a ShardEvent."""
    when = iso_us(ts_us(event.receive_time))
    kind = event.WhichOneof("payload")
    return (
        f"{event.sequence:>8} {when} {event.shard_id} {event.attempt_id or '-'} {kind} "
        f"{short_payload(event, kind)}"
    ).rstrip()


def short_payload(event: Any, kind: str) -> str:
    """Returns a few key fields of the event's payload."""
    p = getattr(event, kind)
    if kind == "planned":
        return f"index={p.plan_index} input={p.input_ref} outputs={','.join(p.expected_outputs)}"
    if kind == "started":
        timeout = ts_us(p.heartbeat_timeout) / 1e6
        text = f"host={p.host} pid={p.pid} timeout={timeout:g}s fp={p.fingerprint_digest[:12]}"
        if not p.HasField("scheduler"):
            return text
        fields = p.scheduler.DESCRIPTOR.fields
        return (
            text + f" job={scheduler_label({f.name: getattr(p.scheduler, f.name) for f in fields})}"
        )
    if kind == "heartbeat":
        return f"step={p.step} progress={p.progress:.3f}"
    if kind in ("checkpoint", "artifact_committed"):
        name = "" if kind == "checkpoint" else f"{p.name} "
        return f"{name}{p.path} {p.size_bytes}B blake3={p.blake3_hex[:12]}"
    if kind == "verified":
        result = "PASSED" if p.result == pb.VERIFICATION_RESULT_PASSED else "FAILED"
        return f"{result} {p.name} {p.path}" + (f" reason={p.reason}" if p.reason else "")
    tag = pb.FailureTag.Name(p.tag).removeprefix("FAILURE_TAG_").lower()
    return f"tag={tag} {p.message[:80]}"


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


def run_runs(args: argparse.Namespace) -> int:
    """Lists runs, most recently updated first."""
    runs = client_from(args).list_runs(namespace=args.namespace, page_size=args.limit)
    keys = ("run_id", "namespace", "event_count", "create_time", "update_time", "head_hash")
    times = [(iso_us(ts_us(r.create_time)), iso_us(ts_us(r.update_time))) for r in runs]
    rows = [
        dict(zip(keys, (r.run_id, r.namespace, r.event_count, *t, r.head_hash.hex()), strict=True))
        for r, t in zip(runs, times, strict=True)
    ]
    if args.json:
        print_json(rows)
        return EXIT_OK
    from rich.console import Console
    from rich.table import Table

    table = Table(*("run", "namespace", "events", "created", "updated", "head"))
    for row in rows:
        table.add_row(*(str(row[k])[: 16 if k == "head_hash" else None] for k in keys))
    Console(file=sys.stdout, markup=False, highlight=False).print(table)
    return EXIT_OK
