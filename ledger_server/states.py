"""The names of shard states: those a shard row stores and those a query may ask for.

A `StrEnum` member compares and encodes as its string, so rows, counters and the
wire keep the same text; SQL that names a state is built from these values.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final


class ShardState(StrEnum):
    """A shard's time-independent state, as its projection row stores it."""

    PLANNED = "planned"
    RUNNING = "running"
    COMMITTED = "committed"
    VERIFIED = "verified"
    VERIFY_FAILED = "verify_failed"
    FAILED = "failed"


class QueryState(StrEnum):
    """A state `shards --state` may filter on; stale and missing depend on the clock."""

    PLANNED = "planned"
    RUNNING = "running"
    COMMITTED = "committed"
    VERIFIED = "verified"
    VERIFY_FAILED = "verify_failed"
    FAILED = "failed"
    STALE = "stale"
    LIVE = "live"
    MISSING = "missing"
    DUPLICATE = "duplicate"
    UNCONFIRMED = "unconfirmed"


# Plain strings, in the documented order: drivers bind them as text (psycopg would
# dump an Enum member by its name).
BASE_STATES: Final[tuple[str, ...]] = tuple(s.value for s in ShardState)
QUERY_STATES: Final[tuple[str, ...]] = tuple(s.value for s in QueryState)
# The stored states of a shard that must run again: every one but verified.
RESUME_STATES: Final[tuple[str, ...]] = tuple(s for s in BASE_STATES if s != ShardState.VERIFIED)


def stored_states(query: str) -> list[str] | None:
    """Returns the stored states a query's shards are among, or None for any state."""
    if query in (QueryState.STALE, QueryState.LIVE):
        return [ShardState.RUNNING.value]
    if query == QueryState.MISSING:
        return [ShardState.PLANNED.value]
    if query == QueryState.UNCONFIRMED:
        return list(RESUME_STATES)
    if query in BASE_STATES:
        return [query]
    return None
