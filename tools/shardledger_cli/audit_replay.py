"""`shardledger audit replay|diff`: every projection of a run as it stood at a past point.

A point is a global sequence (an integer) or a server receive time (ISO-8601).
The log as it stood at any moment is a prefix of it, so a point takes events in
sequence order up to the first one beyond it; the clock the stale split is
computed at is the given time, or the receive time of the last event taken.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final, TypeVar

from ledger_server import projections as proj
from ledger_server.chain import GENESIS_HASH
from ledger_server.codec import decode_event, timestamp_us
from ledger_server.events import RecordedEvent
from ledger_server.replay import RunReplay
from ledger_server.states import shown_state
from ledger_server.summary import matches, run_summary, shard_view
from shardledger_cli.audit_checks import open_database
from shardledger_cli.cli import EXIT_OK, EXIT_REJECTED, CommandError, client_from
from shardledger_cli.output import count_shards, equation, iso_us, print_json
from shardledger_cli.parsing import add_db_option, examples, json_help

# The lists `audit replay` prints, each a shard query as `shards --state` means it.
LIST_QUERIES: Final = ("missing", "stale", "failed", "verify_failed", "duplicate")
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Point:
    """A moment of a run's history: through a global sequence, or up to a receive time."""

    sequence: int | None = None
    time_us: int | None = None

    def includes(self, rec: RecordedEvent) -> bool:
        """Returns whether the event had been recorded at this point."""
        if self.sequence is not None:
            return rec.sequence <= self.sequence
        assert self.time_us is not None
        return rec.receive_time_us <= self.time_us

    def clock_us(self, last: RecordedEvent | None) -> int:
        """Returns the server clock the time-dependent states are computed at."""
        if self.time_us is not None:
            return self.time_us
        return last.receive_time_us if last is not None else 0

    def to_json(self) -> dict[str, Any]:
        """Returns the point as a JSON-ready dict."""
        if self.sequence is not None:
            return {"sequence": self.sequence}
        return {"time": iso_us(self.time_us), "time_us": self.time_us}


def parse_point(text: str) -> Point:
    """Returns the point an --until/--from/--to value names (argparse type)."""
    if text.strip().isdigit():
        return Point(sequence=int(text))
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a sequence number nor an ISO-8601 time"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)  # the server clock is UTC
    return Point(time_us=(when - _EPOCH) // timedelta(microseconds=1))


def register_replay(
    cmds: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """Adds `audit replay` and `audit diff`."""
    when = "a global sequence (e.g. 1200) or an ISO-8601 time (UTC when no offset is given)"
    p = cmds.add_parser(
        "replay",
        epilog=examples(
            "shardledger audit replay night-01 --until 1200",
            "shardledger audit replay night-01 --until 2026-12-01T06:00:00Z --json",
        ),
        parents=[common],
        help="every projection as it stood at a past point",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run", help="run id")
    p.add_argument("--until", required=True, type=parse_point, metavar="SEQ|TIME", help=when)
    add_db_option(p, required=False, env=False, help="read this database instead of a server")
    json_help(p, single="every projection at that point")
    p.set_defaults(func=run_replay)

    p = cmds.add_parser(
        "diff",
        epilog=examples(
            "shardledger audit diff night-01 --from 1200 --to 1500",
            "shardledger audit diff night-01 --from 2026-12-01T02:00:00Z --to 2026-12-01T06:00:00Z --json",
        ),
        parents=[common],
        help="the shards whose state changed between two points",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run", help="run id")
    p.add_argument("--from", dest="start", required=True, type=parse_point, metavar="SEQ|TIME")
    p.add_argument("--to", dest="end", required=True, type=parse_point, metavar="SEQ|TIME")
    add_db_option(p, required=False, env=False, help="read this database instead of a server")
    json_help(p, single="the shards that changed state")
    p.set_defaults(func=run_diff)


# --- events and the fold ----------------------------------------------------


def server_events(args: argparse.Namespace) -> Generator[RecordedEvent, None, None]:
    """Yields the run's events from the server, decoded back into domain events."""
    for msg in client_from(args).list_events(args.run, namespace=args.namespace, page_size=5000):
        yield RecordedEvent(
            decode_event(msg),
            msg.sequence,
            msg.run_sequence,
            timestamp_us(msg.receive_time),
            msg.row_hash,
        )


def database_events(path: str, namespace: str, run_id: str) -> Generator[RecordedEvent, None, None]:
    """Yields the run's events from a database (path or URL)."""
    from ledger_server.archive_read import archived_rows, tombstone_of
    from ledger_server.chain import recorded

    store = open_database(path)
    try:
        view = store.read()
        run = view.get_run(namespace or "default", run_id)
        if run is None:
            raise CommandError(f"run {run_id} is not in {path}", code=EXIT_REJECTED)
        # An archived run's events are its bundle's (checked against its tombstone), never
        # whatever dead rows a purge has not reached yet.
        rows = (
            archived_rows(tombstone_of(view, run)) if run.archived else view.iter_events(run.run_pk)
        )
        for stored in rows:
            yield recorded(stored)
    finally:
        store.close()


def replay_points(
    events: Iterable[RecordedEvent],
    points: list[Point],
    take: Callable[[RunReplay, Point, RecordedEvent | None, int], T],
) -> list[T]:
    """Folds the events once and returns take(replay, point, last event, count) at each point."""
    replay = RunReplay()
    taken: dict[int, T] = {}
    last: RecordedEvent | None = None
    count = 0
    for rec in events:
        for i, point in enumerate(points):
            if i not in taken and not point.includes(rec):
                taken[i] = take(replay, point, last, count)
        if len(taken) == len(points):
            break
        replay.feed(rec)
        last, count = rec, count + 1
    for i, point in enumerate(points):
        if i not in taken:
            taken[i] = take(replay, point, last, count)
    return [taken[i] for i in range(len(points))]


def projections_at(
    replay: RunReplay,
    point: Point,
    last: RecordedEvent | None,
    count: int,
    *,
    run_id: str = "",
    namespace: str = "default",
) -> dict[str, Any]:
    """Returns the summary and problem lists as `status`, `shards` and `resume` showed them."""
    at = point.clock_us(last)
    if last is not None:
        namespace, run_id = last.event.namespace, last.event.run_id
    summary = run_summary(
        replay.counters(),
        stale=replay.stale_count(at),
        run_id=run_id,
        namespace=namespace,
        last_event_us=last.receive_time_us if last else 0,
        now_us=at,
    )
    summary["as_of_us"] = at
    summary["event_count"] = count
    summary["head_hash"] = (last.row_hash if last else GENESIS_HASH).hex()
    records = list(replay.ordered())
    out: dict[str, Any] = {
        "until": point.to_json(),
        "last_sequence": last.sequence if last else 0,
        "summary": summary,
    }
    for query in LIST_QUERIES:
        out[query] = [shard_view(r, at) for r in records if matches(r, query, at)]
    out["resume"] = [
        {
            "shard_id": r.shard_id,
            "plan_index": r.plan_index,
            "plan_line": r.plan_line,
            "reason": reason,
        }
        for r in records
        if (reason := proj.resume_reason(r, at)) is not None
    ]
    return out


def states_at(
    replay: RunReplay, point: Point, last: RecordedEvent | None, count: int
) -> dict[str, tuple[int, str, str]]:
    """Returns shard id -> (plan index, state, detail) at the point."""
    at = point.clock_us(last)
    out = {}
    for r in replay.records.values():
        state, detail = proj.live_state(r, at)
        out[r.shard_id] = (r.plan_index, shown_state(state), detail)
    return out


# --- commands ---------------------------------------------------------------


def _events(args: argparse.Namespace) -> Generator[RecordedEvent, None, None]:
    # A generator, so callers can close it (and the database) when they stop early.
    if args.db:
        return database_events(args.db, args.namespace, args.run)
    return server_events(args)


def run_replay(args: argparse.Namespace) -> int:
    """Prints the run's projections as they stood at --until."""
    take = functools.partial(projections_at, run_id=args.run, namespace=args.namespace or "default")
    with contextlib.closing(_events(args)) as events:
        (state,) = replay_points(events, [args.until], take)
    if args.json:
        print_json(state)
        return EXIT_OK
    s = state["summary"]
    print(
        f"run {args.run} as of {iso_us(s['as_of_us'])}: through sequence"
        f" {state['last_sequence']}, {s['event_count']} events, head {s['head_hash'][:16]}"
    )
    print(equation(s))
    print(
        f"completion rate {100 * s['completion_rate']:.2f} %,"
        f" silent error rate {100 * s['silent_error_rate']:.2f} %"
    )
    for query in LIST_QUERIES:
        shards = [
            v["shard_id"] + (f" ({v['detail']})" if v["detail"] else "") for v in state[query]
        ]
        print(f"{query} ({len(shards)}): {', '.join(shards)}".rstrip(": "))
    resume = [f"{e['shard_id']} ({e['reason']})" for e in state["resume"]]
    print(f"resume ({len(resume)}): {', '.join(resume)}".rstrip(": "))
    return EXIT_OK


def _state(entry: tuple[int, str, str] | None) -> dict[str, str] | None:
    return None if entry is None else {"state": entry[1], "detail": entry[2]}


def run_diff(args: argparse.Namespace) -> int:
    """Prints the shards whose state differs between --from and --to."""
    with contextlib.closing(_events(args)) as events:
        before, after = replay_points(events, [args.start, args.end], states_at)
    changed: list[dict[str, Any]] = []
    for shard_id in sorted(before.keys() | after.keys()):
        a, b = before.get(shard_id), after.get(shard_id)
        if (a and a[1:]) != (b and b[1:]):
            index = (b or a or (0,))[0]
            changed.append(
                {"shard_id": shard_id, "plan_index": index, "from": _state(a), "to": _state(b)}
            )
    changed.sort(key=lambda c: (c["plan_index"], c["shard_id"]))
    if args.json:
        print_json({"from": args.start.to_json(), "to": args.end.to_json(), "changed": changed})
        return EXIT_OK

    def label(state: dict[str, str] | None) -> str:
        if state is None:
            return "(not planned)"
        return state["state"] + (f":{state['detail']}" if state["detail"] else "")

    for c in changed:
        print(f"{c['shard_id']:<32} {label(c['from']):<24} -> {label(c['to'])}")
    print(f"{count_shards(len(changed))} changed state", file=sys.stderr)
    return EXIT_OK
