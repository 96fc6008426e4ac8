"""Names the SDK and the server share: failure tags, the verifier's own reasons, scheduler fields.

One home for each string a job, the ledger and the CLI must agree on. A
`StrEnum` member compares and serializes as its string, so stored events and
the wire format are unchanged.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

__all__ = ["FAILURE_TAGS", "SCHEDULER_FIELDS", "VERIFIER_REASONS", "FailureTag"]


class FailureTag(StrEnum):
    """Why an attempt failed: one tag per failed attempt, in every log line and summary."""

    OOM = "oom"
    TIMEOUT = "timeout"
    KILLED = "killed"
    PREEMPTED = "preempted"
    NCCL = "nccl"
    DATA = "data"
    INCOMPLETE = "incomplete"
    UNKNOWN = "unknown"
    # The input differs from the plan's (docs/concepts.md, "Input identity").
    INPUT_CHANGED = "input_changed"


# In the documented order (the proto comment and docs/projections.md list them so).
FAILURE_TAGS: Final[tuple[str, ...]] = tuple(tag.value for tag in FailureTag)

# Verification outcomes that describe the verifier, not the artifact (a path outside
# its --root, a file it may not read): never recorded as verdicts, and folded as no
# verdict where an older verifier recorded them.
VERIFIER_REASONS: Final = frozenset(
    {
        "outside_root",
        "permission_denied",
        "storage_unreachable",
        "credentials_refused",
        "storage_throttled",
    }
)

# The fields of a scheduler identity (the proto's SchedulerIdentity), in its order.
SCHEDULER_FIELDS: Final = (
    "kind",
    "job_id",
    "array_job_id",
    "array_task_id",
    "cluster",
    "node",
    "namespace",
    "task_id",
    "task_attempt",
    "actor_id",
)
