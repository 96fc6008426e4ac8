"""The shard record: everything the projections know about one shard, and its stored form.

Pure: no grpc, protobuf or SQL. The record is a cache of the fold over a shard's
events; the events stay the truth, so a record whose format version is older
than ``RECORD_VERSION`` is rebuilt from them (``db rebuild``, or the store's
upgrade on open) rather than trusted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from ledger_server import formats
from ledger_server.events import ShardPlanned
from ledger_server.states import ShardState
from shard_client.canonical import legacy_json

# 2: verdicts belong to one attempt's commit (were keyed by path and digest for the
# whole shard), attempts know whether they ran in the run's first pass, numeric
# pollution and late spooled events are recorded.
# 3: attempts of several ranks (torchrun/DDP) keep each rank's liveness, and sharded
# checkpoints count only once every part is saved.
# 4: what the field figures need (ledger_server.field): every attempt's start and end on
# both clocks, the GPUs it held, its labels, its checkpoint write times and last progress,
# whether it committed as a zombie; the plan's labels.
# 5: input identity (docs/concepts.md): the plan's evidence of its input, and for each
# attempt whether its input differed from the plan (so it may not commit).
# 6: an attempt is late when one of its events, heartbeats and checkpoints included, took
# longer to arrive than its started event did (or the start longer than it) by more than
# its heartbeat timeout: the job's clock cancels out (was: arrived a minute after its
# client time, which a skewed job clock made or hid).
# 7: the run counters gain first_verify_failed:REASON, the first pass's verification
# failures by reason (the records are as in 6; the rebuild recomputes the counters).
# 8: a running shard's open attempt has its own row (shard_open) and the run counters sum
# the open attempts (open.*), so reports and scrapes parse no record (the records are as
# in 7; the rebuild writes the rows and counters).
RECORD_VERSION: Final = formats.RECORD_FORMAT


@dataclass(slots=True)
class Rank:
    """One rank (process) of a multi-rank attempt, as far as its own events tell."""

    host: str
    pid: int
    local_rank: int
    timeout_us: int
    last_seen_us: int
    last_step: int = -1
    process_start_ticks: int = 0
    scheduler: dict[str, str] = field(default_factory=dict)
    # The rank left its block cleanly (its silence is no hang), or failed with this tag.
    finished: bool = False
    failed_tag: str = ""

    def to_json(self) -> dict[str, Any]:
        """Returns the rank as stored (defaults left out)."""
        out: dict[str, Any] = {
            "host": self.host,
            "pid": self.pid,
            "local_rank": self.local_rank,
            "timeout_us": self.timeout_us,
            "last_seen_us": self.last_seen_us,
            "last_step": self.last_step,
        }
        if self.process_start_ticks:
            out["process_start_ticks"] = self.process_start_ticks
        if self.scheduler:
            out["scheduler"] = self.scheduler
        if self.finished:
            out["finished"] = True
        if self.failed_tag:
            out["failed_tag"] = self.failed_tag
        return out


@dataclass(slots=True)
class Attempt:
    """One attempt at a shard, as far as the events tell."""

    attempt_id: str
    started_seq: int
    host: str
    pid: int
    timeout_us: int
    fingerprint_digest: str
    last_seen_us: int
    failed_tag: str = ""
    failed_message: str = ""
    # name -> (path, size_bytes, blake3_hex) of the latest commit of that name.
    artifacts: dict[str, tuple[str, int, str]] = field(default_factory=dict)
    last_step: int = -1
    last_checkpoint: str = ""
    # name -> (result, reason) of the latest verdict on this attempt's current commit of
    # the name. A verdict is about the bytes one commit vouched for, so it never carries
    # to another attempt's commit (nor to a later commit of the name by this attempt).
    verdicts: dict[str, tuple[str, str]] = field(default_factory=dict)
    # Started while the run's first pass was open (before the run's first verdict).
    first_pass: bool = True
    # Names whose current commit, and whether its failure, reached the ledger after the
    # first pass closed (drained late from a spool): the first pass did not see them.
    after_pass: list[str] = field(default_factory=list)
    failed_after_pass: bool = False
    # The first step at which a metric was reported NaN or infinite, and which metrics.
    numeric_step: int = -1
    numeric_metrics: list[str] = field(default_factory=list)
    # Some of its events reached the ledger long after they were made (left in a spool
    # while the ledger was away, and drained later).
    late: bool = False
    # Where it runs as its scheduler knows it (Slurm job, Kubernetes pod), and the start
    # time of its process, so a watchdog can stop it there and never signal a reused pid.
    scheduler: dict[str, str] = field(default_factory=dict)
    process_start_ticks: int = 0
    # A multi-rank attempt (world_size > 1): its launch, when it started (server clock),
    # each rank that started it, and the parts of sharded checkpoints saved per step.
    world_size: int = 0
    launch_id: str = ""
    restart_count: int = 0
    started_us: int = 0
    ranks: dict[int, Rank] = field(default_factory=dict)
    checkpoint_parts: dict[int, list[int]] = field(default_factory=dict)
    # What the field figures need (ledger_server.field; docs/metrics.md). The job's clock
    # at its started event and at its end (the failed event, else its latest commit);
    # the ledger's clock at that end (0: no end event yet).
    client_started_us: int = 0
    ended_us: int = 0
    client_ended_us: int = 0
    # GPUs the attempt held as its started events said (0: unknown), its own labels.
    gpus: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    # When it last saved a whole checkpoint (0: never): what a hang throws away is since then.
    saved_us: int = 0
    # Checkpoint write times (µs) as the SDK measured them, one per saved checkpoint.
    checkpoint_writes: list[int] = field(default_factory=list)
    # It committed after a newer attempt of the shard had started.
    zombie: bool = False
    # Why its input is not the plan's (ledger_server.inputs): what its started event saw
    # differed, or a revision of the plan changed the input after it started. Such an
    # attempt may not commit or checkpoint, and nothing it committed confirms the shard.
    input_changed: str = ""


@dataclass(slots=True)
class ShardRecord:
    """Everything the projections know about one shard."""

    shard_id: str
    plan_index: int
    plan_line: str
    definition_json: str
    expected_outputs: tuple[str, ...]
    planned_seq: int
    attempts: dict[str, Attempt] = field(default_factory=dict)
    latest_attempt: str = ""
    # (name, fingerprint digest) -> digests ever committed: what a verdict may name.
    commit_digests: dict[str, list[str]] = field(default_factory=dict)
    zombie_commits: int = 0
    failures: list[str] = field(default_factory=list)
    # path -> blake3 of the latest commit there, kept only for paths that two commits
    # (of any attempts or names) gave different bytes: on every other path each holder's
    # digest is the latest. An artifact is intact only while it is still its path's bytes.
    path_heads: dict[str, str] = field(default_factory=dict)
    # The labels the shard was planned with (the run's).
    labels: dict[str, str] = field(default_factory=dict)
    # The plan's evidence of its input beyond size and digest (inputs.planned_identity):
    # local mtime_ns, inode, device; object version_id, etag. Only the known ones.
    input_identity: dict[str, Any] = field(default_factory=dict)
    # base_state's answer, kept until apply() folds an event that may change it; not stored.
    state_memo: tuple[ShardState, str] | None = field(default=None, compare=False, repr=False)

    def to_json(self) -> str:
        """Returns the record as canonical JSON for storage (defaults left out, to stay small)."""
        data: dict[str, Any] = {
            "v": RECORD_VERSION,
            "shard_id": self.shard_id,
            "plan_index": self.plan_index,
            "plan_line": self.plan_line,
            "definition_json": self.definition_json,
            "expected_outputs": list(self.expected_outputs),
            "planned_seq": self.planned_seq,
            "attempts": {k: _attempt_json(a) for k, a in self.attempts.items()},
            "latest_attempt": self.latest_attempt,
            "commit_digests": self.commit_digests,
            "zombie_commits": self.zombie_commits,
            "failures": self.failures,
        }
        if self.path_heads:
            data["path_heads"] = self.path_heads
        if self.labels:
            data["labels"] = self.labels
        if self.input_identity:
            data["input_identity"] = self.input_identity
        return legacy_json(data)

    @classmethod
    def from_json(cls, text: str | bytes) -> ShardRecord:
        """Parses a record stored by to_json; a version-1 record is converted as well as it can be.

        Version 1 kept verdicts per (path, digest) for the whole shard and no pass
        flags: the conversion hands each verdict to the attempts that hold that commit
        now and puts every attempt in the first pass. Only a replay of the events is
        exact, which is why the stores rebuild older records when they open.
        """
        d = json.loads(text)
        attempts = {k: _attempt_from(a) for k, a in d["attempts"].items()}
        if d.get("v", 1) < 2:
            legacy = {k: (v[0], v[1]) for k, v in d.get("verdicts", {}).items()}
            for attempt in attempts.values():
                for name, (path, _size, digest) in attempt.artifacts.items():
                    verdict = legacy.get(f"{path}\x00{digest}")
                    if verdict is not None:
                        attempt.verdicts[name] = verdict
        return cls(
            shard_id=d["shard_id"],
            plan_index=d["plan_index"],
            plan_line=d["plan_line"],
            definition_json=d["definition_json"],
            expected_outputs=tuple(d["expected_outputs"]),
            planned_seq=d["planned_seq"],
            attempts=attempts,
            latest_attempt=d["latest_attempt"],
            commit_digests=d["commit_digests"],
            zombie_commits=d["zombie_commits"],
            failures=d["failures"],
            path_heads=d.get("path_heads", {}),
            labels=d.get("labels", {}),
            input_identity=d.get("input_identity", {}),
        )


def record_version(text: str | bytes) -> int:
    """Returns the format version of a stored record without building it."""
    version = json.loads(text).get("v", 1)
    return version if isinstance(version, int) else 1


# Attempt fields of record version 4, stored only when set.
_LATER_ATTEMPT_FIELDS: Final = (
    "client_started_us",
    "ended_us",
    "client_ended_us",
    "gpus",
    "labels",
    "saved_us",
    "checkpoint_writes",
    "zombie",
    "input_changed",
)


def _attempt_json(a: Attempt) -> dict[str, Any]:
    out: dict[str, Any] = {
        "attempt_id": a.attempt_id,
        "started_seq": a.started_seq,
        "host": a.host,
        "pid": a.pid,
        "timeout_us": a.timeout_us,
        "fingerprint_digest": a.fingerprint_digest,
        "last_seen_us": a.last_seen_us,
        "failed_tag": a.failed_tag,
        "failed_message": a.failed_message,
        "artifacts": {n: list(v) for n, v in a.artifacts.items()},
        "last_step": a.last_step,
        "last_checkpoint": a.last_checkpoint,
    }
    if a.verdicts:
        out["verdicts"] = {n: list(v) for n, v in a.verdicts.items()}
    if not a.first_pass:
        out["first_pass"] = False
    if a.after_pass:
        out["after_pass"] = a.after_pass
    if a.failed_after_pass:
        out["failed_after_pass"] = True
    if a.numeric_step >= 0:
        out["numeric_step"] = a.numeric_step
        out["numeric_metrics"] = a.numeric_metrics
    if a.late:
        out["late"] = True
    if a.scheduler:
        out["scheduler"] = a.scheduler
    if a.process_start_ticks:
        out["process_start_ticks"] = a.process_start_ticks
    if a.started_us:
        out["started_us"] = a.started_us
    for name in _LATER_ATTEMPT_FIELDS:
        value = getattr(a, name)
        if value:
            out[name] = value
    if a.world_size > 1:
        out["world_size"] = a.world_size
        out["launch_id"] = a.launch_id
        out["restart_count"] = a.restart_count
        out["ranks"] = {str(r): rank.to_json() for r, rank in sorted(a.ranks.items())}
    if a.checkpoint_parts:
        out["checkpoint_parts"] = {str(s): parts for s, parts in a.checkpoint_parts.items()}
    return out


def _attempt_from(a: dict[str, Any]) -> Attempt:
    a = dict(a)
    a["artifacts"] = {n: (v[0], v[1], v[2]) for n, v in a["artifacts"].items()}
    a["verdicts"] = {n: (v[0], v[1]) for n, v in a.get("verdicts", {}).items()}
    a["ranks"] = {int(r): Rank(**v) for r, v in a.get("ranks", {}).items()}
    a["checkpoint_parts"] = {int(s): v for s, v in a.get("checkpoint_parts", {}).items()}
    return Attempt(**a)


def record_from_row(record: str | bytes, beat_us: int | None, beat_step: int | None) -> ShardRecord:
    """Parses a stored record and folds in the heartbeat columns written after it.

    A heartbeat of the latest attempt only moves that attempt's last_seen_us and
    last_step, so the writer stores those two numbers (and the deadline) instead of
    re-encoding the whole record; both fold by max, exactly as apply() does.
    """
    out = ShardRecord.from_json(record)
    if beat_us is not None:
        latest = out.attempts.get(out.latest_attempt)
        if latest is not None:
            latest.last_seen_us = max(latest.last_seen_us, beat_us)
            latest.last_step = max(latest.last_step, beat_step if beat_step is not None else -1)
    return out


_OPEN_ATTEMPT_FIELDS: Final = frozenset(
    {
        "attempt_id",
        "started_seq",
        "host",
        "pid",
        "timeout_us",
        "fingerprint_digest",
        "last_seen_us",
        "first_pass",
        "world_size",
        "started_us",
        "client_started_us",
        "gpus",
        "labels",
        "saved_us",
    }
)


def latest_attempt_from_row(
    record: str | bytes, beat_us: int | None
) -> tuple[Attempt | None, dict[str, str], dict[str, str]]:
    """Returns a stored record's latest attempt (beat columns folded in), the plan's labels
    and the shard's own: its first attempt's over the plan's (where the shard first ran).

    The report's cheap read of a running shard: one parse (orjson where the text
    allows, as chain.parse_row) and one attempt built, not the whole record.
    """
    try:
        d = orjson.loads(record)
    except orjson.JSONDecodeError:
        d = json.loads(record)
    attempts = d["attempts"]
    raw = attempts.get(d["latest_attempt"])
    labels: dict[str, str] = d.get("labels", {})
    if raw is None:
        return None, labels, labels
    first = min(attempts.values(), key=lambda a: a["started_seq"])
    # The fields a running attempt's figures read; the rest (artifacts, verdicts, ranks)
    # stay unbuilt: a report reads every running shard of a run this way.
    attempt = Attempt(**{k: v for k, v in raw.items() if k in _OPEN_ATTEMPT_FIELDS})
    if beat_us is not None:
        attempt.last_seen_us = max(attempt.last_seen_us, beat_us)
    return attempt, labels, labels | first.get("labels", {})


def plan_line_for(shard_id: str, plan: ShardPlanned) -> str:
    """Returns the plan line handed back in resume lists (the original one when given).

    Without one, the line is built around the plan's params text, spliced in as stored
    (RFC 8785 for plans of row format 2, Python's encoding for older ones), so a record
    rebuilt from old rows says what it said.
    """
    if plan.plan_line:
        return plan.plan_line
    return (
        f'{{"expected_outputs":{legacy_json(list(plan.expected_outputs))},'
        f'"input_blake3":{legacy_json(plan.input_blake3)},'
        f'"input_bytes":{int(plan.input_bytes)},'
        f'"input_ref":{legacy_json(plan.input_ref)},'
        f'"params":{plan.params_json},'
        f'"shard_id":{legacy_json(shard_id)}}}'
    )
