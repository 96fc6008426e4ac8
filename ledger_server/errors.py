"""Domain errors of the ledger, each with a stable reason and metadata.

    LedgerError
    ├── InvalidEvent            a field is malformed (INVALID_ARGUMENT)
    │   └── FingerprintDigestMismatch  a digest that is not its fingerprint's
    ├── LimitExceeded           a documented limit was exceeded (INVALID_ARGUMENT, names the limit)
    ├── RunNotFound             the run has no events (NOT_FOUND)
    ├── EventNotFound           no such event in the run (NOT_FOUND)
    ├── LedgerCorrupt           stored rows break the chain (DATA_LOSS)
    │   └── ArchiveBroken       an archived run's bundle is missing or differs from its tombstone
    ├── SigningKeyMissing       no tree-head key (FAILED_PRECONDITION)
    ├── ConflictError           (ALREADY_EXISTS)
    │   ├── EventIdReused       same event_id, different content
    │   └── PlanConflict        a re-plan with a different definition
    ├── LifecycleViolation      the event breaks the shard's life cycle (FAILED_PRECONDITION)
    │   ├── RunClosed           a new shard for a run whose submission is closed
    │   ├── RunNotClosed        a reopen of a run that is not closed
    │   └── RunArchived         an event for a run whose events were archived
    └── Overloaded              appends wait past capacity: refused unread, retry later (RESOURCE_EXHAUSTED)

Clients never parse messages: they switch on ``reason`` (sent as the
``google.rpc.ErrorInfo`` reason) and read ``metadata``. The mapping to gRPC
codes lives in one table in ``servicer.py``.
"""

from __future__ import annotations

from typing import Any


class LedgerError(Exception):
    """Base of every error the ledger reports to callers."""

    reason: str = "LEDGER_ERROR"

    def __init__(self, message: str, *, reason: str | None = None, **metadata: Any) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason
        self.message = message
        self.metadata: dict[str, str] = {k: str(v) for k, v in metadata.items()}


class InvalidEvent(LedgerError):
    """A field of a request is malformed; ``field`` names it."""

    reason = "INVALID_FIELD"

    def __init__(self, field: str, problem: str, **metadata: Any) -> None:
        super().__init__(f"{field}: {problem}", field=field, **metadata)
        self.field = field


class FingerprintDigestMismatch(InvalidEvent):
    """A started event's fingerprint_digest is not the digest of its fingerprint map."""

    reason = "FINGERPRINT_DIGEST_MISMATCH"

    def __init__(self, sent: str, computed: str) -> None:
        super().__init__(
            "started.fingerprint_digest",
            f"is {sent[:16]}..., the fingerprint's digest is {computed}"
            " (leave it empty and the ledger fills it in)",
            sent=sent,
            computed=computed,
        )


class LimitExceeded(LedgerError):
    """A documented size or count limit was exceeded; ``limit`` names it."""

    reason = "LIMIT_EXCEEDED"

    def __init__(self, limit: str, value: int, maximum: int, **metadata: Any) -> None:
        super().__init__(
            f"{limit} is {value}, the limit is {maximum}",
            limit=limit,
            value=value,
            maximum=maximum,
            **metadata,
        )


class RunNotFound(LedgerError):
    """The run does not exist (it has no planned shard yet)."""

    reason = "RUN_NOT_FOUND"


class ConflictError(LedgerError):
    """A write conflicts with what is already stored."""


class EventIdReused(ConflictError):
    """The event_id was stored before with different content."""

    reason = "EVENT_ID_REUSED"


class PlanConflict(ConflictError):
    """The shard was planned before with a different definition."""

    reason = "PLAN_CONFLICT"


class EventNotFound(LedgerError):
    """The event id names no event of the run (NOT_FOUND)."""

    reason = "EVENT_NOT_FOUND"


class LedgerCorrupt(LedgerError):
    """The stored rows break the hash chain or disagree with the run head (DATA_LOSS)."""

    reason = "LEDGER_CORRUPT"


class SigningKeyMissing(LedgerError):
    """The server was started without a tree-head signing key (FAILED_PRECONDITION)."""

    reason = "SIGNING_KEY_MISSING"


class LifecycleViolation(LedgerError):
    """The event is not allowed in the shard's current life-cycle state."""

    reason = "LIFECYCLE_VIOLATION"


class RunClosed(LifecycleViolation):
    """A planned event names a new shard of a run whose submission is closed (reopen it first)."""

    reason = "RUN_CLOSED"


class RunNotClosed(LifecycleViolation):
    """A run_reopened event names a run with no close that stands."""

    reason = "RUN_NOT_CLOSED"


class RunArchived(LifecycleViolation):
    """The run's events moved to an archive: it takes no events until it is restored."""

    reason = "RUN_ARCHIVED"


class ArchiveBroken(LedgerCorrupt):
    """An archived run's bundle is missing, unreadable or differs from its tombstone."""

    reason = "ARCHIVE_BROKEN"


class Overloaded(LedgerError):
    """The committer's queue is full: the append was refused unread; retry after ``retry_after_s``."""

    reason = "OVERLOADED"

    def __init__(
        self,
        retry_after_s: float,
        *,
        queued_events: int,
        bound_events: int,
        loop_lag_s: float | None = None,
    ) -> None:
        extra: dict[str, Any] = {}
        if loop_lag_s is None:
            why = f"{queued_events} events waiting for a commit, admitting up to {bound_events}"
        else:  # the event loop, not the committer, is the queue (admission.py)
            why = f"its event loop runs {loop_lag_s * 1000:.0f} ms behind"
            extra["loop_lag_ms"] = round(loop_lag_s * 1000)
        super().__init__(
            f"the ledger is at capacity ({why}); retry in {retry_after_s:.3f}s",
            queued_events=queued_events,
            bound_events=bound_events,
            **extra,
        )
        self.retry_after_s = retry_after_s


class StreamsExhausted(LedgerError):
    """The ledger holds its most StreamAppendEvents streams: send AppendEvents instead."""

    reason = "STREAMS_EXHAUSTED"

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"the ledger holds its most append streams ({limit}, serve --max-append-streams);"
            " send the batch as AppendEvents",
            limit=limit,
        )


class EventRejected(LedgerError):
    """Wraps the first rejected event of a batch with its index; nothing was written."""

    def __init__(self, index: int, cause: LedgerError) -> None:
        super().__init__(
            f"event {index}: {cause.message}",
            reason=cause.reason,
            **cause.metadata,
            event_index=index,
        )
        self.index = index
        self.cause = cause
