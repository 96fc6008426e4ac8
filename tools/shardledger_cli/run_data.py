"""One run fetched for analysis: its events folded into tables, its summary, its shard views.

`export --sqlite` starts here: the events over ListEvents (the truth), and the server's
own summary and shard views for the states it judges. (`report`, `--by` and `--html`
read the figures the server serves instead: GetRunReport, CompareRuns.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ledger_server.analysis import RunTables, fold_run
from ledger_server.codec import decode_event, timestamp_us
from ledger_server.events import RecordedEvent
from shard_client.labels import WELL_KNOWN_LABELS

__all__ = ["RunData", "load_run", "shard_rows", "silent"]


@dataclass(frozen=True, slots=True)
class RunData:
    """What the analysis commands know about one run."""

    tables: RunTables
    summary: dict[str, Any]
    views: list[dict[str, Any]]

    @property
    def run_id(self) -> str:
        """Returns the run id."""
        return str(self.summary["run_id"])


def _recorded(client: Any, run_id: str, namespace: str) -> Iterator[RecordedEvent]:
    for msg in client.list_events(run_id, namespace=namespace, page_size=5000):
        yield RecordedEvent(
            decode_event(msg),
            msg.sequence,
            msg.run_sequence,
            timestamp_us(msg.receive_time),
            bytes(msg.row_hash),
        )


def load_run(
    client: Any, run_id: str, *, namespace: str = "", keep_events: bool = False
) -> RunData:
    """Fetches one run (summary first, so an unknown run is refused before any listing)."""
    summary: dict[str, Any] = json.loads(client.summary(run_id, namespace=namespace))
    tables = fold_run(_recorded(client, run_id, namespace), keep_events=keep_events)
    views = [json.loads(v.view_json) for v in client.shards(run_id, namespace=namespace)]
    return RunData(tables, summary, views)


def silent(view: dict[str, Any]) -> bool:
    """Returns whether the shard said it succeeded and was wrong (the summary's silent errors)."""
    return bool(
        view["state"] == "verify_failed"
        or (view["state"] == "failed" and view["detail"] == "incomplete")
    )


def shard_rows(data: RunData) -> list[dict[str, Any]]:
    """Returns one row per planned shard: plan, state, first pass, and where it first ran."""
    first: dict[str, dict[str, str]] = {}
    for attempt in sorted(data.tables.attempts.values(), key=lambda a: a.started_sequence):
        first.setdefault(attempt.shard_id, data.tables.attempt_labels(attempt.attempt_id))
    verdicts: dict[str, list[str]] = {}
    for v in data.tables.verdicts:
        if v["result"] == "failed":
            verdicts.setdefault(v["shard_id"], []).append(str(v["reason"]))
    rows = []
    for view in data.views:
        sid = view["shard_id"]
        plan = data.tables.plans.get(sid, {})
        labels = first.get(sid, data.tables.labels)
        row = {
            "run_id": data.run_id,
            "shard_id": sid,
            "plan_index": view["plan_index"],
            "input_ref": plan.get("input_ref"),
            "input_bytes": plan.get("input_bytes"),
            "params": plan.get("params"),
            "state": view["state"],
            "detail": view["detail"] or None,
            "attempts": view["attempts"],
            "fingerprint": view["fingerprint"] or None,
            "first_pass": view["first_pass"],
            "silent": silent(view),
            "first_pass_silent": view["first_pass"] == "silent",
            "failed_reasons": json.dumps(sorted(set(verdicts.get(sid, [])))),
            "duplicates": json.dumps(view["duplicates"]),
            "repaired": view["repaired"],
            "labels": json.dumps(labels, sort_keys=True),
        }
        row |= {key: labels.get(key, "") for key in WELL_KNOWN_LABELS}
        rows.append(row)
    return rows
