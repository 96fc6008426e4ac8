"""`shardledger plan RUN --refresh-inputs`: the run's inputs as they are now become its plan.

Every planned input is read again (shardledger_cli.input_check). One whose bytes
changed gets a revision of its shard's plan: the same input reference, params and
expected outputs with the new size, blake3 and identity. The ledger then holds
every earlier attempt of the shard as computed on other bytes (none of them
confirms it any more), so the shard is back in `resume` and its rerun, handed the
revised plan line, reads the input the plan now names. An input copied or touched
with the same bytes only gets its identity refreshed (its outputs stand).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, Final

from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.canonical import canonical_json
from shard_client.errors import LedgerRejected
from shard_client.ids import PlanEntry, plan_events
from shard_client.inputs import IDENTITY_KEY, line_identity
from shardledger_cli.cli import (
    EXIT_LOCAL,
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_REJECTED,
    CommandError,
    client_from,
)
from shardledger_cli.input_check import (
    CHANGED,
    GONE,
    SAME,
    STATUSES,
    TOUCHED,
    InputNow,
    check_inputs,
    latest_plans,
)
from shardledger_cli.output import print_json, progress

__all__ = ["refresh_inputs", "revision_entry"]

APPEND_BATCH: Final = 500


def revision_entry(stored: pb.ShardEvent, now: InputNow) -> PlanEntry:
    """Returns the revision of a stored plan for its input as it is now."""
    p = stored.planned
    line = p.plan_line
    if line:
        obj = json.loads(line)
        obj[IDENTITY_KEY] = line_identity(now.size_bytes, now.blake3, now.identity)
        line = canonical_json(obj)
    return PlanEntry(
        shard_id=stored.shard_id,
        input_ref=p.input_ref,
        input_bytes=now.size_bytes,
        input_blake3=now.blake3,
        params=json.loads(p.params_json or "{}"),
        expected_outputs=tuple(p.expected_outputs),
        plan_line=line,
        plan_index=p.plan_index,
        input_version_id=str(now.identity.get("version_id", "")),
        input_etag=str(now.identity.get("etag", "")),
        input_mtime_ns=int(now.identity.get("mtime_ns", 0)),
        input_inode=int(now.identity.get("inode", 0)),
        input_device=int(now.identity.get("device", 0)),
        input_revision=True,
    )


def refresh_inputs(args: argparse.Namespace) -> int:
    """Reads every planned input of the run again and revises the plans of those that moved."""
    client = client_from(args)
    try:
        plans = latest_plans(client.list_events(args.run, namespace=args.namespace, page_size=5000))
    except LedgerRejected as exc:
        raise CommandError(f"run {args.run}: {exc.reason}: {exc}", EXIT_REJECTED) from None
    if not plans:
        raise CommandError(f"run {args.run} has no planned shards", EXIT_REJECTED)
    order = sorted(plans, key=lambda sid: (plans[sid].planned.plan_index, sid))
    with progress("reading planned inputs", len(order)) as advance:
        found, unread = check_inputs(plans, order, workers=args.workers, on_done=lambda: advance(1))
    revise = [f for f in found if f.status in (CHANGED, TOUCHED)]
    entries = [revision_entry(plans[f.shard_id], f) for f in revise]
    sent = 0
    if entries and not args.dry_run:
        events = []
        for entry in entries:
            labels = dict(plans[entry.shard_id].planned.labels)
            events += plan_events(args.run, [entry], namespace=args.namespace, labels=labels)
        sent = _send(client, args.run, events)
    counts = {status: 0 for status in STATUSES}
    for f in found:
        counts[f.status] += 1
    report: dict[str, Any] = {
        "run_id": args.run,
        "namespace": args.namespace or "default",
        "read": len(found),
        **counts,
        "unreadable": len(unread),
        "revised": sent,
        "dry_run": bool(args.dry_run),
        "inputs": [
            {"shard_id": f.shard_id, "input": f.ref, "status": f.status, "difference": f.difference}
            for f in found
            if f.status != SAME
        ]
        + [
            {
                "shard_id": sid,
                "input": plans[sid].planned.input_ref,
                "status": "unreadable",
                "difference": why,
            }
            for sid, why in unread.items()
        ],
    }
    _print(report, as_json=args.json)
    if unread:
        return EXIT_LOCAL
    return EXIT_PROBLEMS if counts[GONE] else EXIT_OK


def _send(client: Any, run_id: str, events: Sequence[pb.ShardEvent]) -> int:
    """Appends the revisions in batches; returns how many the ledger stored now."""
    stored = 0
    for start in range(0, len(events), APPEND_BATCH):
        try:
            results = client.append(list(events[start : start + APPEND_BATCH]))
        except LedgerRejected as exc:
            raise CommandError(
                f"run {run_id}: a revision was refused ({exc.reason}): {exc}; {stored} were"
                " stored before it",
                EXIT_REJECTED,
            ) from None
        stored += sum(r.outcome == pb.APPEND_OUTCOME_APPENDED for r in results)
    return stored


def _print(report: dict[str, Any], *, as_json: bool) -> None:
    if as_json:
        print_json(report)
        return
    for item in report["inputs"]:
        detail = f": {item['difference']}" if item["difference"] else ""
        print(f"{item['status'].upper()} {item['shard_id']} {item['input']}{detail}")
    verb = "would revise" if report["dry_run"] else "revised"
    count = (
        sum(1 for i in report["inputs"] if i["status"] in (CHANGED, TOUCHED))
        if report["dry_run"]
        else report["revised"]
    )
    print(
        f"plan {report['run_id']} --refresh-inputs: {report['read']} inputs read;"
        f" {report[CHANGED]} changed (their shards run again), {report[TOUCHED]} touched with"
        f" the same bytes (identity refreshed), {report[SAME]} unchanged;"
        f" {report[GONE]} gone, {report['unreadable']} unreadable (not revised);"
        f" {verb} {count}",
        file=sys.stdout,
    )
