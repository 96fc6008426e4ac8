"""Stable, content-derived shard ids and the planned events that register them.

A shard id is derived from what the shard computes (the input's bytes and the
parameters), never from where the input lives or when it was planned, so the
same work gets the same id on every re-plan and a rerun overwrites nothing it
should not.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

import blake3
from google.protobuf.timestamp_pb2 import Timestamp

from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.atomic import hash_file
from shard_client.canonical import canonical_json
from shard_client.labels import label_problem
from shard_client.ranks import RANK_PLACEHOLDER

__all__ = [
    "MAX_ID_CHARS",
    "SHARD_ID_PREFIX",
    "PlanEntry",
    "check_digest",
    "check_id",
    "duplicate_ids",
    "hash_input",
    "plan_event_id",
    "plan_events",
    "run_reopened_event",
    "shard_id_for",
    "submission_closed_event",
]

SHARD_ID_PREFIX: Final = "s-"
# The server's limits (ledger_server/events.py), repeated so bad input fails before sending.
MAX_ID_CHARS: Final = 128
_ID_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+=/-]*")
_HEX64_RE: Final = re.compile(r"[0-9a-f]{64}")


def check_id(what: str, value: str) -> None:
    """Raises ValueError unless value is an identifier the server accepts."""
    if not value:
        raise ValueError(f"{what} must not be empty")
    if len(value) > MAX_ID_CHARS:
        raise ValueError(f"{what} {value[:40]!r}... is longer than {MAX_ID_CHARS} characters")
    if not _ID_RE.fullmatch(value):
        raise ValueError(
            f"{what} {value!r} must start with a letter or digit"
            " and use only letters, digits and ._:@+=/-"
        )


def check_digest(what: str, value: str) -> None:
    """Raises ValueError unless value is a blake3 digest in lowercase hex."""
    if not _HEX64_RE.fullmatch(value):
        raise ValueError(f"{what} must be 64 lowercase hex characters (a blake3 digest)")


def shard_id_for(*, input_blake3: str, params: Mapping[str, Any]) -> str:
    """Returns "s-" plus 32 hex characters of blake3(input digest, newline, canonical params)."""
    check_digest("input_blake3", input_blake3)
    material = f"{input_blake3}\n{canonical_json(dict(params))}".encode()
    return SHARD_ID_PREFIX + blake3.blake3(material).hexdigest()[:32]


def hash_input(path: str | os.PathLike[str]) -> tuple[int, str]:
    """Returns (size_bytes, blake3_hex) of an input file."""
    return hash_file(path)


@dataclass(frozen=True, slots=True)
class PlanEntry:
    """One shard of a plan: its id, its definition and the line to hand back on resume."""

    shard_id: str
    input_ref: str
    input_bytes: int
    input_blake3: str
    params: Mapping[str, Any] = field(default_factory=dict, hash=False)
    expected_outputs: tuple[str, ...] = ()
    plan_line: str = ""
    plan_index: int = 0
    # Object-storage inputs only: which object was planned (evidence, not definition).
    input_version_id: str = ""
    input_etag: str = ""
    # Local inputs only: st_mtime_ns, st_ino and st_dev when planned (evidence too).
    input_mtime_ns: int = 0
    input_inode: int = 0
    input_device: int = 0
    # A revision of the input of a shard already planned (`plan --refresh-inputs`).
    input_revision: bool = False

    def check(self) -> None:
        """Raises ValueError when the server would refuse this entry."""
        check_id("shard_id", self.shard_id)
        if not self.input_ref:
            raise ValueError("input must not be empty")
        if self.input_bytes < 0:
            raise ValueError("input_bytes must not be negative")
        if self.input_blake3:
            check_digest("input_blake3", self.input_blake3)
        for name in self.expected_outputs:
            # weights.rank{rank} names each rank's own output (docs/multirank.md): the name
            # is checked as rank 0's, as the ledger checks it.
            check_id("expected output", name.replace(RANK_PLACEHOLDER, "0"))
        if len(set(self.expected_outputs)) != len(self.expected_outputs):
            raise ValueError("expected_outputs must be unique")
        if self.plan_index < 0:
            raise ValueError("plan_index must not be negative")

    def definition(self) -> dict[str, Any]:
        """Returns what the server compares to tell a re-plan from a conflicting plan."""
        return {
            "input_ref": self.input_ref,
            "input_bytes": self.input_bytes,
            "input_blake3": self.input_blake3,
            "params_json": canonical_json(dict(self.params)),
            "expected_outputs": list(self.expected_outputs),
        }


def plan_event_id(run_id: str, entry: PlanEntry, *, namespace: str = "") -> str:
    """Returns the deterministic id of an entry's planned event."""
    # Everything the event carries goes into its id: the server answers a
    # repeated id with DUPLICATE only when the content is identical, so a
    # re-plan that moved a shard (new index or line) needs a new id, which
    # the server then answers with ALREADY_PLANNED.
    material = canonical_json(
        {
            "namespace": namespace,
            "run_id": run_id,
            "shard_id": entry.shard_id,
            "definition": entry.definition(),
            "plan_line": entry.plan_line,
            "plan_index": entry.plan_index,
            # The cheap identity is in the plan line; a revision is another event.
            **({"revision": True} if entry.input_revision else {}),
        }
    )
    return "plan-" + blake3.blake3(material.encode()).hexdigest()[:32]


def plan_events(
    run_id: str,
    entries: Iterable[PlanEntry],
    *,
    namespace: str = "",
    labels: Mapping[str, str] | None = None,
) -> list[pb.ShardEvent]:
    """Returns one planned event per entry, with ids that make re-planning idempotent.

    ``labels`` are the run's (provider, pool, region, image, ...), carried by every
    planned event; the event ids do not depend on them, so a re-plan with other labels
    is refused (EVENT_ID_REUSED) rather than relabelling a run.
    """
    check_id("run_id", run_id)
    problem = label_problem(labels or {})
    if problem:
        raise ValueError(f"labels: {problem}")
    out: list[pb.ShardEvent] = []
    for entry in entries:
        entry.check()
        # client_time stays unset: it is part of the stored content, and a
        # second `plan` of the same manifest must send byte-identical events.
        out.append(
            pb.ShardEvent(
                event_id=plan_event_id(run_id, entry, namespace=namespace),
                namespace=namespace,
                run_id=run_id,
                shard_id=entry.shard_id,
                planned=pb.ShardPlanned(
                    input_ref=entry.input_ref,
                    input_bytes=entry.input_bytes,
                    input_blake3=entry.input_blake3,
                    params_json=canonical_json(dict(entry.params)),
                    expected_outputs=list(entry.expected_outputs),
                    plan_line=entry.plan_line,
                    plan_index=entry.plan_index,
                    labels=dict(labels or {}),
                    input_version_id=entry.input_version_id,
                    input_etag=entry.input_etag,
                    input_mtime_ns=entry.input_mtime_ns,
                    input_inode=entry.input_inode,
                    input_device=entry.input_device,
                    input_revision=entry.input_revision,
                ),
            )
        )
    return out


def submission_closed_event(
    run_id: str,
    *,
    namespace: str = "",
    reason: str = "",
    expected_shards: int = 0,
    submitted_until: datetime | None = None,
    reopened_at_sequence: int = 0,
) -> pb.ShardEvent:
    """Returns the run-level event that declares that no job of the run will start any more.

    With submitted_until (an aware datetime) the submission counts as closed from
    then on. The id is derived from the content, so closing the same run again with
    the same words is an idempotent retry (DUPLICATE), never a second close.
    reopened_at_sequence, the run's latest reopen (RunLifecycle.reopened_at_sequence;
    0 for a run never reopened), takes part in the id: a close after a reopen is a new
    close even in the same words as the one the reopen undid.
    """
    check_id("run_id", run_id)
    if expected_shards < 0:
        raise ValueError("expected_shards must not be negative")
    if submitted_until is not None and submitted_until.utcoffset() is None:
        raise ValueError("submitted_until needs a time zone (e.g. datetime.now(UTC))")
    until = Timestamp()
    if submitted_until is not None:
        until.FromDatetime(submitted_until)
    material = canonical_json(
        {
            "namespace": namespace,
            "run_id": run_id,
            "reason": reason,
            "expected_shards": expected_shards,
            "submitted_until": until.ToJsonString() if submitted_until is not None else "",
            # Only when set: a run never reopened keeps the ids its closes always had.
            **({"after_reopen": reopened_at_sequence} if reopened_at_sequence else {}),
        }
    )
    return pb.ShardEvent(
        event_id="close-" + blake3.blake3(material.encode()).hexdigest()[:32],
        namespace=namespace,
        run_id=run_id,
        submission_closed=pb.RunSubmissionClosed(
            reason=reason,
            expected_shards=expected_shards,
            submitted_until=until if submitted_until is not None else None,
        ),
    )


def run_reopened_event(
    run_id: str,
    *,
    namespace: str = "",
    reason: str = "",
    closed_at_sequence: int = 0,
    reopened_at_sequence: int = 0,
) -> pb.ShardEvent:
    """Returns the run-level event that reopens a closed run, so that shards can be added.

    The id is derived from the words and from the close it undoes, as the run's
    lifecycle names it (RunLifecycle.submission_closed_at_sequence, 0 for a close
    still ahead, and reopened_at_sequence): resending it is an idempotent retry
    (DUPLICATE), and reopening after a later close is a new reopen.
    """
    check_id("run_id", run_id)
    material = canonical_json(
        {
            "namespace": namespace,
            "run_id": run_id,
            "reason": reason,
            "closed_at_sequence": closed_at_sequence,
            "reopened_at_sequence": reopened_at_sequence,
        }
    )
    return pb.ShardEvent(
        event_id="reopen-" + blake3.blake3(material.encode()).hexdigest()[:32],
        namespace=namespace,
        run_id=run_id,
        run_reopened=pb.RunReopened(reason=reason),
    )


def duplicate_ids(entries: Sequence[PlanEntry]) -> dict[str, list[int]]:
    """Returns the shard ids that occur more than once, with their plan indexes."""
    seen: dict[str, list[int]] = {}
    for entry in entries:
        seen.setdefault(entry.shard_id, []).append(entry.plan_index)
    return {k: v for k, v in seen.items() if len(v) > 1}
