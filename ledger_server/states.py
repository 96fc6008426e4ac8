"""The names of shard states: those a shard row stores, those every output shows, and queries.

A `StrEnum` member compares and encodes as its string, so rows, counters and the
wire keep the same text; SQL that names a state is built from these values.

One concept, one name (docs/concepts.md is the glossary): outputs (`status`,
`shards`, `resume`, `--json`, metrics) use the run summary's names. Two stored
states read differently there: a shard planned and never started is shown as
``missing`` and a committed, not yet verified one as ``unverified``. The stored
names stay as they are, so no ledger needs a migration; they never reach a user.
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
    """A state `shards --state` may filter on (the shown names); stale depends on the clock."""

    MISSING = "missing"
    RUNNING = "running"
    STALE = "stale"
    UNVERIFIED = "unverified"
    VERIFIED = "verified"
    VERIFY_FAILED = "verify_failed"
    FAILED = "failed"
    LIVE = "live"
    DUPLICATE = "duplicate"
    UNCONFIRMED = "unconfirmed"


# The query states that partition a run's submitted shards, in the order of the
# reconciliation line (`status`) and of shardledger_run_shards{state}: the summary's
# by_state, each the set `shards --state NAME` lists.
PARTITION: Final = tuple(
    s.value
    for s in (
        QueryState.VERIFIED,
        QueryState.FAILED,
        QueryState.MISSING,
        QueryState.RUNNING,
        QueryState.STALE,
        QueryState.UNVERIFIED,
        QueryState.VERIFY_FAILED,
    )
)


# Plain strings, in the documented order: drivers bind them as text (psycopg would
# dump an Enum member by its name).
BASE_STATES: Final[tuple[str, ...]] = tuple(s.value for s in ShardState)
QUERY_STATES: Final[tuple[str, ...]] = tuple(s.value for s in QueryState)
# The stored states of a shard that must run again: every one but verified.
RESUME_STATES: Final[tuple[str, ...]] = tuple(s for s in BASE_STATES if s != ShardState.VERIFIED)

# The stored names that outputs show under another name (see the module docstring).
SHOWN_NAMES: Final[dict[str, str]] = {
    ShardState.PLANNED: QueryState.MISSING,
    ShardState.COMMITTED: QueryState.UNVERIFIED,
}
# Names earlier releases printed or accepted; accepted on input for one release
# (`shards --state planned`), never printed. docs/concepts.md lists them.
QUERY_ALIASES: Final[dict[str, str]] = {
    "planned": QueryState.MISSING,
    "never-started": QueryState.MISSING,
    "committed": QueryState.UNVERIFIED,
}
_STORED_NAMES: Final[dict[str, str]] = {shown: stored for stored, shown in SHOWN_NAMES.items()}


def shown_state(state: str) -> str:
    """Returns the name outputs use for a stored or live state ("planned" -> "missing")."""
    return SHOWN_NAMES.get(state, state)


def canonical_query(query: str) -> str:
    """Returns the query state an input names, old names mapped ("" stays "": any state).

    Raises ValueError for a name that is neither a query state nor an alias.
    """
    if not query or query in QUERY_STATES:
        return query
    if query in QUERY_ALIASES:
        return QUERY_ALIASES[query]
    raise ValueError(query)


def stored_states(query: str) -> list[str] | None:
    """Returns the stored states a query's shards are among, or None for any state."""
    query = canonical_query(query)
    if query in (QueryState.STALE, QueryState.LIVE):
        return [ShardState.RUNNING.value]
    if query == QueryState.UNCONFIRMED:
        return list(RESUME_STATES)
    stored = _STORED_NAMES.get(query, query)
    if stored in BASE_STATES:
        return [stored]
    return None
