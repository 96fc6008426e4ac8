# Over 400 lines on purpose: `plan` in the order it runs (flags, close/reopen, re-plan checks, delivery, report); inputs are plan_entries.py, the re-plan rules shard_client/replan.py.
"""`shardledger plan RUN`: register a run's shards from a manifest or a directory of inputs."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from ledger_server.validation import MAX_EXPECTED_SHARDS
from shard_client import backoff
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from shard_client.delivery import deliver
from shard_client.errors import LedgerClientError, LedgerRejected
from shard_client.ids import (
    PlanEntry,
    check_id,
    plan_events,
)
from shard_client.labels import labels_from_env, merged_labels, parse_label
from shard_client.replan import StoredPlan, other_params, plan_differences, renumbered
from shardledger_cli.cli import (
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_REJECTED,
    EXIT_USAGE,
    CommandError,
    client_from,
)
from shardledger_cli.commands.plan_entries import entries_from_dir, entries_from_manifest
from shardledger_cli.commands.plan_refresh import refresh_inputs
from shardledger_cli.output import count_shards, print_json, print_json_lines, progress
from shardledger_cli.parsing import examples, json_help

__all__ = ["Outcome", "keep_stored_indexes", "register", "send_plan"]

BATCH: Final = 1000
# The server's refusal of a new shard of a closed run (RUN_CLOSED): it refuses every
# new shard alike, so the plan stops at the first batch it refuses.
RUN_CLOSED: Final = "RUN_CLOSED"

DESCRIPTION: Final = """\
Register every shard of a run, one `planned` event each, before any job starts.

From a manifest (--manifest FILE, or - for stdin), one JSON object per line:
  {"input": "/data/a.bin", "params": {"lr": 0.1}, "expected_outputs": ["out"]}
with optional "shard_id" (else derived from the input's blake3 and the params,
see shard_client.shard_id_for) and "input_blake3"/"input_bytes". An input path
that exists (relative paths are resolved against the current directory) is
hashed, and a given input_blake3 must match it; an input that does not exist
here (a URL, an object key) needs input_blake3. The line is kept, as canonical
JSON with "shard_id" filled in, as the plan line that `resume` hands back.

From a directory (--inputs DIR --glob '*.bin'), one shard per matching file in
sorted order, all with the same --params and --expected-outputs. Nothing is left
out in silence: a directory that cannot be listed or a file that cannot be read
is named with the reason (exit 5), and matching symlinks that lead nowhere
(dangling, or a loop) are listed (exit 1) unless --skip-broken-links, which
plans without them and counts them on stderr; nothing is sent in either case.

Inputs in object storage (s3://bucket/key, gs://...; needs shardledger[s3] or
[gcs], credentials from the store's standard chain) are read through fsspec: a
manifest line's object is streamed and hashed unless the line gives
input_blake3 (then only its size is read), and its version id and ETag are
recorded with the plan; --inputs s3://bucket/prefix/ --glob '*.bin' plans one
shard per object under the prefix whose key (relative to it) matches.

Every line is checked before anything is sent: a bad line is reported with its
number and nothing is registered. Planning again is idempotent: an identical
shard (same input, params and expected outputs) is counted as already planned
and keeps its first plan index and plan line; a new shard in a re-plan of a run
that has shards is numbered after the highest stored index (said on stderr), so
no two shards share an index. A shard id planned before with a different
definition or other labels is a conflict: stderr names the first one's fields
that differ, each with its stored and sent value, and counts the rest
(--json: "differences"); the conflicting shards keep their stored plan.

New shards whose params none of the run's shards has (a re-plan with
--params '{"seed": 4}' of a run planned with seed 3) are refused, exit 1 and
nothing sent, unless --add: they would grow the run silently, and a finished
run's completion would fall. A grown directory re-planned with the run's own
params adds its new inputs without --add.

--label KEY=VALUE (repeatable, over $SHARDLEDGER_LABEL_<KEY>) labels the run:
provider, pool (on-demand / spot / preemptible), region, image, or any key;
`shardledger report --by provider` compares runs by them (docs/metrics.md).

--close declares that no job of the run will start any more (a run-level
submission_closed event): run it once the last wave's jobs are done (e.g. from a
Slurm job with --dependency=afterany:JOBID), or give --submitted-until TIME, the
end of the night's window, when planning. Once every planned shard has ended
(verified, failed, or never started; none running, stale or awaiting
verification) the run is settled: `status` says so, /metrics exports
shardledger_run_settled, and the alerts about ended runs may fire. Closing again
with the same words is an idempotent retry; of several closes, the one that
closes earliest stands.

A closed run takes no new shards: once its close has taken effect, a plan that
adds a shard is refused by the ledger (RUN_CLOSED: "run R was closed at sequence
N (TIME): plan --reopen to add shards"), exit 4, one line, and nothing of the
plan is stored (the plan stops at the first batch refused; a batch is atomic).
An identical re-plan of the shards it has is still fine (already planned).
--reopen appends a run-level run_reopened event (with --reason, if given) that
undoes the close: the run is open again, `status` says "reopened at event N" (the
run's own numbering, as `events` shows it) and no longer "settled", and new shards
are accepted until the next --close.
With a manifest or inputs, --reopen reopens first and then plans (and, with
--close too, closes again after planning: a late wave in one command). A run
that is not closed cannot be reopened (RUN_NOT_CLOSED, exit 4).

Examples:
  shardledger plan night-01 --manifest jobs.jsonl
  shardledger plan night-01 --inputs /data/in --glob '*.bin' --expected-outputs out
  shardledger plan night-01 --manifest jobs.jsonl --label provider=D --label pool=spot
  SHARDLEDGER_LABEL_REGION=eu-1 shardledger plan night-01 --manifest jobs.jsonl --dry-run
  shardledger plan night-01 --manifest jobs.jsonl --close --submitted-until 2026-12-02T07:00Z
  shardledger plan night-01 --close --reason "last wave finished" --expected 1000 --json
  shardledger plan night-01 --reopen --manifest late-wave.jsonl --add --close

exit codes: 0 all shards new or already planned identically (and closed or
reopened); 1 some conflict, other params without --add, or broken links
(nothing sent); 2 a bad --label; 3 unreachable; 4 refused by the server (e.g.
--close of an unknown run, new shards of a closed run without --reopen
(RUN_CLOSED), --reopen of a run that is not closed (RUN_NOT_CLOSED)); 5 bad
manifest or inputs (nothing sent)
"""


@dataclass(slots=True)
class Outcome:
    """What the ledger said about the plan."""

    new: int = 0
    identical: int = 0
    conflicts: list[tuple[PlanEntry, str]] = field(default_factory=list)
    refused: list[tuple[PlanEntry, str]] = field(default_factory=list)
    # Stored shards this plan sends otherwise: {shard_id: {field: {stored, sent}}}.
    differences: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    # The ledger's RUN_CLOSED refusal, when the run is closed to new shards; the
    # entries it kept out (and those never sent after it) are in `refused`.
    run_closed: str = ""


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """Adds the plan command."""
    p = sub.add_parser(
        "plan",
        epilog=examples(
            "shardledger plan night-01 --manifest jobs.jsonl",
            "shardledger plan night-01 --inputs /data/in --glob '*.bin' --params '{\"lr\": 0.1}' --expected-outputs weights,metrics",
            "shardledger plan night-01 --manifest jobs.jsonl --dry-run > plan-lines.jsonl   # nothing sent",
            "shardledger plan night-01 --manifest jobs.jsonl --json | jq .new",
        ),
        parents=[common],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="register a run's shards from a manifest or a directory of inputs",
        description=DESCRIPTION,
    )
    p.add_argument("run", help="run id")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--manifest", metavar="FILE", help="JSON-lines manifest, or - for stdin")
    source.add_argument(
        "--inputs", metavar="DIR", help="plan one shard per file in DIR (or under an s3:// prefix)"
    )
    p.add_argument(
        "--glob", default="*", help="with --inputs: file pattern, ** recurses (default *)"
    )
    p.add_argument("--params", default=None, help="with --inputs: parameters as a JSON object")
    p.add_argument(
        "--skip-broken-links",
        action="store_true",
        help="with --inputs: plan without matching symlinks that lead nowhere (dangling or a"
        " loop; without it they are listed and nothing is sent, exit 1)",
    )
    p.add_argument(
        "--expected-outputs", default=None, metavar="A,B", help="with --inputs: artifact names"
    )
    p.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a run label (provider, pool, region, image, ...), repeatable; over"
        " $SHARDLEDGER_LABEL_<KEY>; `report --by KEY` groups runs by it",
    )
    p.add_argument(
        "--add",
        action="store_true",
        help="add shards whose params none of the run's shards has (without it such a plan"
        " is refused: a re-plan with other params would grow a finished run)",
    )
    p.add_argument(
        "--refresh-inputs",
        action="store_true",
        help="read every planned input of RUN again and make the inputs as they are now its"
        " plan: a shard whose input has other bytes gets a revision (its earlier attempts no"
        " longer confirm it, so it is back in `resume`); a copied or touched input with the"
        " same bytes only has its identity refreshed; gone inputs are listed (exit 1)."
        " With --dry-run: say what would be revised",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan lines; send nothing")
    p.add_argument(
        "--close", action="store_true", help="declare the submission complete (after planning)"
    )
    p.add_argument(
        "--reopen",
        action="store_true",
        help="undo the run's close so that new shards are accepted (before planning, if any)",
    )
    p.add_argument(
        "--reason", default="", help="with --close or --reopen: why, kept with the event(s)"
    )
    p.add_argument(
        "--submitted-until",
        type=aware_time,
        default=None,
        metavar="TIME",
        help="with --close: closed from this ISO 8601 time with a zone on (default: now)",
    )
    p.add_argument(
        "--expected",
        type=int,
        default=0,
        metavar="N",
        help="with --close: shards the planner submitted; fewer planned keeps the run unsettled",
    )
    p.add_argument(
        "--workers", type=int, default=min(8, os.cpu_count() or 4), help="parallel input hashing"
    )
    json_help(p, single="the plan's counts (with --dry-run: JSON Lines, one plan line per shard)")
    p.set_defaults(func=run_plan)


def aware_time(text: str) -> datetime:
    """Returns an ISO 8601 time with a zone ("2026-12-02T07:00Z"); an argparse type."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {text!r}") from None
    if when.utcoffset() is None:
        raise argparse.ArgumentTypeError(f"{text!r} needs a time zone, e.g. {text}Z")
    return when


def run_plan(args: argparse.Namespace) -> int:
    """Builds the plan, checks all of it, then sends it (unless --dry-run)."""
    try:
        check_id("run id", args.run)
    except ValueError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    if args.refresh_inputs:
        if args.manifest or args.inputs or args.close or args.reopen or args.add:
            raise CommandError(
                "--refresh-inputs reads the run's own plan: it takes no --manifest, --inputs,"
                " --add, --close or --reopen",
                EXIT_USAGE,
            )
        return refresh_inputs(args)
    if not args.close and (args.expected or args.submitted_until):
        raise CommandError("--expected and --submitted-until go with --close", EXIT_USAGE)
    if not (args.close or args.reopen) and args.reason:
        raise CommandError("--reason goes with --close or --reopen", EXIT_USAGE)
    if not 0 <= args.expected <= MAX_EXPECTED_SHARDS:
        raise CommandError(f"--expected must be between 0 and {MAX_EXPECTED_SHARDS:,}", EXIT_USAGE)
    if args.manifest is None and args.inputs is None:
        if not (args.close or args.reopen):
            raise CommandError(
                "give --manifest FILE, --inputs DIR, --close or --reopen", EXIT_USAGE
            )
        if args.dry_run:
            raise CommandError("--dry-run goes with --manifest or --inputs", EXIT_USAGE)
        client = client_from(args)
        reopened = _reopen(args, client) if args.reopen else None
        if not args.close:
            return _print_reopened(args, reopened)
        return _close(args, client, planned=None, reopened=reopened)
    if args.manifest is None:
        entries = entries_from_dir(args)
    elif args.params is not None or args.expected_outputs is not None:
        raise CommandError("--params and --expected-outputs go with --inputs", EXIT_USAGE)
    else:
        entries = entries_from_manifest(args.manifest, workers=args.workers)
    if not entries:
        raise CommandError("nothing to plan: no manifest lines or matching inputs")
    labels = run_labels(args.label)
    if args.dry_run:
        return _print_dry_run(entries, as_json=args.json)
    client = client_from(args)
    stored = stored_plans(client, args.run, namespace=args.namespace)
    if not args.add:
        refuse_other_params(args.run, entries, stored)
    # The renumbering note waits for the ledger's answer: a closed run (RUN_CLOSED) numbers
    # nothing, and its refusal is the plan's one line.
    notes: list[str] = []
    entries = keep_stored_indexes(
        client, args.run, entries, namespace=args.namespace, stored=stored, notes=notes
    )
    differences = {
        e.shard_id: diff
        for e in entries
        if e.shard_id in stored and (diff := plan_differences(e, labels, stored[e.shard_id]))
    }
    # Reopened only once every local check passed: a plan refused here sends nothing.
    reopened = _reopen(args, client) if args.reopen else None
    outcome = send_plan(
        client, args.run, entries, namespace=args.namespace, labels=labels, differences=differences
    )
    if not outcome.run_closed:
        for note in notes:
            print(note, file=sys.stderr)
    if not args.close:
        return _report(args, entries, outcome, reopened=reopened)
    if outcome.refused or outcome.conflicts:
        # A plan that did not fully register is not a complete submission.
        if not outcome.run_closed:  # a closed run is closed already: nothing to say twice
            print("shardledger: not closing the run: some shards did not register", file=sys.stderr)
        return _report(args, entries, outcome, reopened=reopened)
    return _close(args, client, planned=(entries, outcome), reopened=reopened)


def _reopen(args: argparse.Namespace, client: LedgerClient) -> dict[str, object]:
    """Sends the run's run_reopened event; returns what the report says of it."""
    try:
        result = client.reopen_submission(args.run, namespace=args.namespace, reason=args.reason)
    except LedgerRejected as exc:
        raise CommandError(
            f"cannot reopen run {args.run}: {exc.reason}: {_refusal_text(exc)}", EXIT_REJECTED
        ) from None
    return {
        "reopened": True,
        "reopen_sequence": result.sequence,
        "reopen_outcome": "appended"
        if result.outcome == pb.APPEND_OUTCOME_APPENDED
        else "duplicate",
    }


def _reopened_words(reopened: Mapping[str, object] | None) -> str:
    """Returns the text report's words about a reopen sent before the rest ("" if none)."""
    if reopened is None:
        return ""
    again = "" if reopened["reopen_outcome"] == "appended" else " (already reopened so)"
    return f"reopened at sequence {reopened['reopen_sequence']}{again}; "


def _print_reopened(args: argparse.Namespace, reopened: Mapping[str, object] | None) -> int:
    """Reports a --reopen that came without a plan or a close."""
    assert reopened is not None
    if args.json:
        print_json({"run_id": args.run, "namespace": args.namespace or "default", **reopened})
    else:
        print(
            f"run {args.run}: {_reopened_words(reopened).removesuffix('; ')}: new shards are"
            f" accepted until `shardledger plan {args.run} --close`"
        )
    return EXIT_OK


def _close(
    args: argparse.Namespace,
    client: LedgerClient,
    *,
    planned: tuple[Sequence[PlanEntry], Outcome] | None,
    reopened: Mapping[str, object] | None = None,
) -> int:
    """Sends the run's submission_closed event, then reports the plan (if any) and the close."""
    try:
        result = client.close_submission(
            args.run,
            namespace=args.namespace,
            reason=args.reason,
            expected_shards=args.expected,
            submitted_until=args.submitted_until,
        )
    except LedgerRejected as exc:
        raise CommandError(
            f"cannot close run {args.run}: {exc.reason}: {_refusal_text(exc)}", EXIT_REJECTED
        ) from None
    closed = {
        "closed": True,
        "close_sequence": result.sequence,
        "close_outcome": "appended"
        if result.outcome == pb.APPEND_OUTCOME_APPENDED
        else "duplicate",
    }
    if planned is not None:
        return _report(args, planned[0], planned[1], closed=closed, reopened=reopened)
    if args.json:
        print_json(
            {
                "run_id": args.run,
                "namespace": args.namespace or "default",
                **(reopened or {}),
                **closed,
            }
        )
    else:
        again = "" if closed["close_outcome"] == "appended" else " (already closed so)"
        print(
            f"run {args.run}: {_reopened_words(reopened)}submission closed at sequence"
            f" {result.sequence}{again}"
        )
    return EXIT_OK


def stored_plans(
    client: LedgerClient, run_id: str, *, namespace: str = ""
) -> dict[str, StoredPlan]:
    """Returns the run's shards as stored ({} for a run that does not exist yet)."""
    try:
        return {
            view.shard_id: StoredPlan(
                view.view.plan_index, view.view.plan if view.view.HasField("plan") else None
            )
            for view in client.shards(run_id, namespace=namespace)
        }
    except LedgerRejected as exc:
        if exc.reason == "RUN_NOT_FOUND":
            return {}
        raise


def _sets(keys: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def refuse_other_params(
    run_id: str, entries: Sequence[PlanEntry], stored: Mapping[str, StoredPlan]
) -> None:
    """Refuses (exit 1, nothing sent) new shards whose params none of the run's shards has.

    A re-plan with the same params set is idempotent and a grown listing adds its new
    inputs; other params would grow the run silently (a finished run's completion falls
    from 100 %), so they need --add.
    """
    found = other_params(entries, stored)
    if found is None:
        return
    raise CommandError(
        f"run {run_id} already has {count_shards(found.stored)}, planned with params"
        f" {_sets(found.have)}; this plan would add {count_shards(found.other)} with params"
        f" {_sets(found.sent)}, which none of them has. Nothing was sent: pass --add to add them"
        " to this run, or plan them into a run of their own",
        EXIT_PROBLEMS,
    )


def keep_stored_indexes(
    client: LedgerClient,
    run_id: str,
    entries: Sequence[PlanEntry],
    *,
    namespace: str = "",
    stored: Mapping[str, StoredPlan] | None = None,
    notes: list[str] | None = None,
) -> list[PlanEntry]:
    """Returns the entries renumbered for a run that already has shards.

    The ledger keeps each shard's first plan index, so a re-plan of a grown or
    re-sorted listing numbers the shards it already has as stored and the new ones
    after the highest stored index, in listing order: two shards never share an
    index (a Slurm array of the resume list would lose one). `stored` is the run's
    shards when already read (stored_plans); else they are read here. The note that
    says so goes to stderr, or into `notes` for a caller that prints it later.
    """
    if stored is None:
        stored = stored_plans(client, run_id, namespace=namespace)
    indexes = {shard_id: s.plan_index for shard_id, s in stored.items()}
    return _renumbered(run_id, entries, indexes, notes)


def _renumbered(
    run_id: str,
    entries: Sequence[PlanEntry],
    stored: Mapping[str, int],
    notes: list[str] | None = None,
) -> list[PlanEntry]:
    done = renumbered(entries, stored)
    if done.moved:
        # Only a plan that adds shards has new ones to number; a re-plan of shards the
        # run already has only keeps their stored indexes.
        after = f" (new shards are numbered from {done.following})"
        note = (
            f"shardledger: run {run_id} already has {count_shards(len(stored))}: {done.moved} of"
            " this plan's indexes follow the stored ones"
            + (after if done.new else "; there are no new shards")
        )
        if notes is None:
            print(note, file=sys.stderr)
        else:
            notes.append(note)
    return done.entries


# --- sending -----------------------------------------------------------------------


def run_labels(flags: Sequence[str]) -> dict[str, str]:
    """Returns the run's labels: $SHARDLEDGER_LABEL_<KEY>, then each --label KEY=VALUE."""
    try:
        labels = labels_from_env()
        labels.update(parse_label(text) for text in flags)
        return merged_labels(labels)
    except ValueError as exc:
        raise CommandError(f"bad label: {exc}", EXIT_USAGE) from None


def send_plan(
    client: LedgerClient,
    run_id: str,
    entries: Sequence[PlanEntry],
    *,
    namespace: str = "",
    labels: Mapping[str, str] | None = None,
    differences: dict[str, dict[str, dict[str, Any]]] | None = None,
) -> Outcome:
    """Sends the planned events in batches; refused shards are isolated, the rest still go.

    ``differences`` (plan_differences of stored shards) makes a refusal of such a shard
    a conflict: the ledger says EVENT_ID_REUSED when only the labels differ. A run
    closed to new shards (RUN_CLOSED) refuses the first batch that adds one, whole:
    nothing more is sent, and that batch's entries and the rest are refused.
    """
    events = plan_events(run_id, entries, namespace=namespace, labels=labels)
    outcome = Outcome(differences=dict(differences or {}))
    with progress("registering shards", len(events)) as advance:
        for start in range(0, len(events), BATCH):
            batch = events[start : start + BATCH]
            try:
                results = _send_batch(client, batch)
            except LedgerRejected as exc:  # RUN_CLOSED: the batch stored nothing
                outcome.run_closed = _refusal_text(exc)
                why = f"{exc.reason}: {outcome.run_closed}"
                outcome.refused += [(entry, why) for entry in entries[start:]]
                break
            for entry, result in zip(entries[start:], results, strict=False):
                _count(outcome, entry, result)
            advance(len(batch))
    return outcome


def _send_batch(
    client: LedgerClient, batch: Sequence[pb.ShardEvent]
) -> list[pb.AppendResult | LedgerRejected]:
    """Sends a batch whole; raises the ledger's RUN_CLOSED, isolates any other refusal."""
    try:
        return list(client.append(batch, retry=False))
    except LedgerRejected as exc:
        if exc.reason == RUN_CLOSED:
            raise
    except LedgerClientError:
        pass  # unreachable for a moment: _deliver_all retries within the deadline
    return _deliver_all(client, batch)


def _refusal_text(exc: LedgerRejected) -> str:
    """Returns the ledger's refusal without the batch position it names ("event 3: ...")."""
    index = exc.metadata.get("event_index")
    return str(exc).removeprefix(f"event {index}: ") if index is not None else str(exc)


def _deliver_all(
    client: LedgerClient, events: Sequence[pb.ShardEvent]
) -> list[pb.AppendResult | LedgerRejected]:
    """Delivers every event, retrying while the ledger is briefly unreachable or overloaded.

    An overloaded ledger's refusal says when to come back (RetryInfo): that wait, spread
    a little so that many planners do not return at once; otherwise a doubling step.
    """
    done: list[pb.AppendResult | LedgerRejected] = []
    give_up, step = time.monotonic() + client.retry_deadline_s, 0.1
    while len(done) < len(events):
        results, stop = deliver(client, events[len(done) :])
        done += results
        if stop is None:
            break
        wait = backoff.retry_wait(stop.retry_after_s, step, cap_s=client.max_backoff_s)
        if time.monotonic() + wait > give_up:
            raise stop
        time.sleep(wait)
        step = backoff.grown(step, client.max_backoff_s)
    return done


def _count(outcome: Outcome, entry: PlanEntry, result: pb.AppendResult | LedgerRejected) -> None:
    if isinstance(result, LedgerRejected):
        if result.reason == RUN_CLOSED:
            # Isolated beside another refusal of its batch: reported once, as a whole.
            outcome.run_closed = outcome.run_closed or _refusal_text(result)
            outcome.refused.append((entry, f"{result.reason}: {outcome.run_closed}"))
            return
        conflict = result.reason == "PLAN_CONFLICT" or entry.shard_id in outcome.differences
        target = outcome.conflicts if conflict else outcome.refused
        target.append((entry, f"{result.reason}: {result}"))
    elif result.outcome == pb.APPEND_OUTCOME_APPENDED:
        outcome.new += 1
    else:
        outcome.identical += 1


# --- output ------------------------------------------------------------------------


def _print_dry_run(entries: Sequence[PlanEntry], *, as_json: bool) -> int:
    if as_json:
        print_json_lines({**json.loads(e.plan_line), "plan_index": e.plan_index} for e in entries)
    else:
        sys.stdout.writelines(e.plan_line + "\n" for e in entries)
    return EXIT_OK


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _report(
    args: argparse.Namespace,
    entries: Sequence[PlanEntry],
    outcome: Outcome,
    *,
    closed: Mapping[str, object] | None = None,
    reopened: Mapping[str, object] | None = None,
) -> int:
    # A re-plan that differs from a stored shard's plan (the ledger answers PLAN_CONFLICT,
    # or EVENT_ID_REUSED when only the labels differ) is a conflict: the first such shard
    # is shown field by field, the rest counted.
    differing = [(e, w) for e, w in outcome.conflicts if e.shard_id in outcome.differences]
    others = [(e, w) for e, w in outcome.conflicts if e.shard_id not in outcome.differences]
    if differing:
        first, why = differing[0]
        fields = "; ".join(
            f"{name}: stored {_shown(d['stored'])}, sent {_shown(d['sent'])}"
            for name, d in outcome.differences[first.shard_id].items()
        )
        more = len(differing) - 1
        print(
            f"shardledger: shard {first.shard_id} (plan index {first.plan_index}) is planned"
            f" otherwise ({why.split(':', 1)[0]}): {fields}"
            + (
                f"; {more} more {'shard differs' if more == 1 else 'shards differ'} from"
                " their stored plan"
                if more
                else ""
            )
            + ". Nothing of a conflicting shard is changed: plan it under another run id,"
            " or keep its stored plan",
            file=sys.stderr,
        )
    closed_out = [e for e, why in outcome.refused if why.startswith(f"{RUN_CLOSED}:")]
    for entry, why in others + outcome.refused:
        if not why.startswith(f"{RUN_CLOSED}:"):
            print(
                f"shardledger: shard {entry.shard_id} (plan index {entry.plan_index}): {why}",
                file=sys.stderr,
            )
    if outcome.run_closed:
        # One line for the run, not one per shard: every new shard is refused alike.
        print(
            f"shardledger: refused ({RUN_CLOSED}): {outcome.run_closed};"
            + (
                f" {count_shards(outcome.new)} of this plan were registered before it,"
                f" {len(closed_out)} not"
                if outcome.new
                else " nothing of this plan was stored"
            ),
            file=sys.stderr,
        )
    # A plan the closed run refused alone has said all in that line (stdout stays empty).
    only_closed = bool(closed_out) and len(closed_out) == len(outcome.refused)
    if args.json:
        print_json(
            {
                "run_id": args.run,
                "namespace": args.namespace or "default",
                "shards": len(entries),
                "new": outcome.new,
                "already_planned": outcome.identical,
                "conflicting": [e.shard_id for e, _ in outcome.conflicts],
                "differences": outcome.differences,
                "refused": [e.shard_id for e, _ in outcome.refused],
                **({"run_closed": outcome.run_closed} if outcome.run_closed else {}),
                **(reopened or {}),
                **(closed or {}),
            }
        )
    elif not (only_closed and not outcome.conflicts):
        print(
            f"run {args.run}: {_reopened_words(reopened)}{len(entries)} shards: {outcome.new} new, "
            f"{outcome.identical} already planned identically, "
            f"{len(outcome.conflicts)} conflicting"
            + (f", {len(outcome.refused)} refused" if outcome.refused else "")
            + (f"; submission closed at sequence {closed['close_sequence']}" if closed else "")
        )
    if outcome.refused:
        return EXIT_REJECTED
    return EXIT_PROBLEMS if outcome.conflicts else EXIT_OK
