"""A run's events as tidy analysis tables: attempts, artifacts, checkpoints, verdicts, events.

Pure: a fold over recorded events, no grpc or SQL. `shardledger export --sqlite`
writes these rows into an analysis database, and `report --by`, `report --html`,
the checkpoint advice and the cost of failures are computed from the same rows,
so every number a report shows can be re-derived with a query (docs/analysis.md).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from ledger_server.events import (
    ArtifactCommitted,
    ArtifactVerified,
    AttemptFailed,
    AttemptStarted,
    CheckpointSaved,
    Heartbeat,
    RecordedEvent,
    ShardPlanned,
    payload_dict,
)
from ledger_server.field import span_of
from shard_client.labels import WELL_KNOWN_LABELS

__all__ = ["RunTables", "fold_run"]

# Verdict reasons that mean "the job said it succeeded and left nothing usable"
# (a silent missing or empty output) and "the file is cut short" (a silent truncation).
# shard_client.checks names them.
EMPTY_REASONS: Final = frozenset({"empty", "missing"})
TRUNCATED_REASONS: Final = frozenset({"truncated", "size_mismatch"})
# Failure tags of an attempt the platform took away (an instance reclaimed).
RECLAIM_TAGS: Final = frozenset({"preempted", "killed"})
HANG_TAG: Final = "timeout"


@dataclass(slots=True)
class AttemptRow:
    """One attempt as the events tell it; times are the ledger's receive times (µs).

    ``last_us`` is the last event the attempt itself sent (never a verdict on its
    commits); its span (``duration_s``) is ledger_server.field's: from its started
    event to its failed event, else its latest commit, on the job's clock where
    both carry it.
    """

    run_id: str
    shard_id: str
    attempt_id: str
    started_sequence: int
    started_us: int
    host: str
    pid: int
    fingerprint: str
    labels: dict[str, str]
    last_us: int
    timeout_us: int = 0
    heartbeats: int = 0
    last_step: int = -1
    checkpoints: int = 0
    checkpoint_write_us: int = 0
    commits: int = 0
    failed_tag: str = ""
    failed_message: str = ""
    failed_us: int | None = None
    client_started_us: int = 0
    ended_us: int = 0
    client_ended_us: int = 0
    world_size: int = 0
    gpu_count: int = 0

    def span(self) -> tuple[int, str]:
        """Returns the attempt's span (µs) and the clock it was read on (field.span_of)."""
        return span_of(
            started_us=self.started_us,
            last_us=self.last_us,
            ended_us=self.ended_us,
            client_started_us=self.client_started_us,
            client_ended_us=self.client_ended_us,
            one_process=self.world_size <= 1,
        )

    def row(self) -> dict[str, Any]:
        """Returns the attempt as a flat row (labels as JSON and one column each well-known)."""
        out = {
            "run_id": self.run_id,
            "shard_id": self.shard_id,
            "attempt_id": self.attempt_id,
            "started_sequence": self.started_sequence,
            "started_us": self.started_us,
            "last_us": self.last_us,
            "duration_s": self.span()[0] / 1e6,
            "clock": self.span()[1],
            "host": self.host,
            "pid": self.pid,
            "fingerprint": self.fingerprint,
            "labels": json.dumps(self.labels, sort_keys=True),
        }
        out |= {key: self.labels.get(key, "") for key in WELL_KNOWN_LABELS}
        out |= {
            "heartbeats": self.heartbeats,
            "last_step": self.last_step,
            "checkpoints": self.checkpoints,
            "checkpoint_write_s": self.checkpoint_write_us / 1e6,
            "commits": self.commits,
            "gpu_count": self.gpu_count or None,
            "failed_tag": self.failed_tag or None,
            "failed_message": self.failed_message or None,
        }
        return out


@dataclass(slots=True)
class RunTables:
    """The rows of one run's analysis tables, in event order."""

    run_id: str = ""
    namespace: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    plans: dict[str, dict[str, Any]] = field(default_factory=dict)
    attempts: dict[str, AttemptRow] = field(default_factory=dict)
    artifacts: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    verdicts: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    # The global sequence of the run's first verdict: where its first pass closed.
    first_verdict_sequence: int = 0
    first_us: int = 0
    last_us: int = 0
    # (shard, path, digest) -> the attempt that committed those bytes there last.
    commits: dict[tuple[str, str, str], str] = field(default_factory=dict)

    def attempt_rows(self) -> list[dict[str, Any]]:
        """Returns the attempt rows in start order."""
        return [a.row() for a in sorted(self.attempts.values(), key=lambda a: a.started_sequence)]

    def attempt_labels(self, attempt_id: str) -> dict[str, str]:
        """Returns the labels an attempt ran under: its own over the run's."""
        attempt = self.attempts.get(attempt_id)
        return self.labels | (attempt.labels if attempt else {})


def fold_run(events: Iterable[RecordedEvent], *, keep_events: bool = False) -> RunTables:
    """Returns the analysis tables of one run's recorded events (in sequence order).

    The ``events`` rows (one per event, heartbeats included: most of a night) are
    kept only when asked for; the reports need the other tables alone.
    """
    out = RunTables()
    for recorded in events:
        _fold(out, recorded, keep_events)
    return out


def _fold(out: RunTables, recorded: RecordedEvent, keep_events: bool) -> None:
    e, now = recorded.event, recorded.receive_time_us
    out.run_id, out.namespace = e.run_id, e.namespace
    out.first_us = out.first_us or now
    out.last_us = max(out.last_us, now)
    if keep_events:
        _event_row(out, recorded)
    _fold_payload(out, recorded)


def _event_row(out: RunTables, recorded: RecordedEvent) -> None:
    e = recorded.event
    out.events.append(
        {
            "run_id": e.run_id,
            "sequence": recorded.sequence,
            "run_sequence": recorded.run_sequence,
            "receive_us": recorded.receive_time_us,
            "client_us": e.client_time_us or None,
            "shard_id": e.shard_id,
            "attempt_id": e.attempt_id or None,
            "kind": e.kind,
            "payload": json.dumps(payload_dict(e.payload), sort_keys=True),
        }
    )


def _fold_payload(out: RunTables, recorded: RecordedEvent) -> None:
    e, now = recorded.event, recorded.receive_time_us
    p = e.payload
    attempt = out.attempts.get(e.attempt_id)
    if attempt is not None and not isinstance(p, ArtifactVerified):
        attempt.last_us = max(attempt.last_us, now)  # a verdict is no event of the attempt
    where = {"run_id": e.run_id, "shard_id": e.shard_id, "attempt_id": e.attempt_id or None}
    if isinstance(p, ShardPlanned):
        out.labels = out.labels or dict(p.labels)
        out.plans.setdefault(e.shard_id, _plan_row(e.run_id, e.shard_id, p))
    elif isinstance(p, AttemptStarted):
        if attempt is not None:  # another rank of a multi-rank attempt
            attempt.gpu_count += p.gpu_count
            return
        out.attempts[e.attempt_id] = AttemptRow(
            run_id=e.run_id,
            shard_id=e.shard_id,
            attempt_id=e.attempt_id,
            started_sequence=recorded.sequence,
            started_us=now,
            host=p.host,
            pid=p.pid,
            fingerprint=p.fingerprint_digest,
            labels=dict(p.labels),
            last_us=now,
            timeout_us=p.heartbeat_timeout_us,
            client_started_us=e.client_time_us,
            world_size=p.world_size,
            gpu_count=p.gpu_count,
        )
    elif isinstance(p, Heartbeat) and attempt is not None:
        attempt.heartbeats += 1
        if p.step > attempt.last_step:
            attempt.last_step = p.step
    elif isinstance(p, CheckpointSaved):
        if attempt is not None:
            attempt.checkpoints += 1
            attempt.checkpoint_write_us += p.write_us
            attempt.last_step = max(attempt.last_step, p.step)
        out.checkpoints.append(
            where
            | {
                "step": p.step,
                "path": p.path,
                "size_bytes": p.size_bytes,
                "blake3": p.blake3_hex,
                "write_s": p.write_us / 1e6 if p.write_us else None,
                "saved_us": now,
                "sequence": recorded.sequence,
            }
        )
    elif isinstance(p, ArtifactCommitted):
        if attempt is not None:
            attempt.commits += 1
            if not attempt.failed_tag:  # an attempt that ends cleanly ends at its last commit
                attempt.ended_us, attempt.client_ended_us = now, e.client_time_us
        out.commits[(e.shard_id, p.path, p.blake3_hex)] = e.attempt_id
        out.artifacts.append(
            where
            | {
                "name": p.name,
                "path": p.path,
                "size_bytes": p.size_bytes,
                "blake3": p.blake3_hex,
                "media_type": p.media_type,
                "committed_us": now,
                "sequence": recorded.sequence,
            }
        )
    elif isinstance(p, ArtifactVerified):
        out.first_verdict_sequence = out.first_verdict_sequence or recorded.sequence
        # The attempt the verdict names judged its own commit; an older verifier named
        # none, and then it is the attempt that committed those bytes there last.
        owner = e.attempt_id or out.commits.get((e.shard_id, p.path, p.blake3_hex))
        out.verdicts.append(
            where
            | {
                "attempt_id": owner,
                "name": p.name,
                "path": p.path,
                "blake3": p.blake3_hex,
                "result": p.result,
                "reason": p.reason or None,
                "detail": p.detail or None,
                "verified_us": now,
                "sequence": recorded.sequence,
            }
        )
    elif isinstance(p, AttemptFailed) and attempt is not None:
        if not attempt.failed_tag:
            attempt.ended_us, attempt.client_ended_us = now, e.client_time_us
        attempt.failed_tag, attempt.failed_message = p.tag, p.message
        attempt.failed_us = now


def _plan_row(run_id: str, shard_id: str, p: ShardPlanned) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "shard_id": shard_id,
        "plan_index": p.plan_index,
        "input_ref": p.input_ref,
        "input_bytes": p.input_bytes,
        "input_blake3": p.input_blake3,
        "params": p.params_json,
        "expected_outputs": json.dumps(list(p.expected_outputs)),
    }
