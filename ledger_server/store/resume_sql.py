"""SQL both backends share: the resume reason computed in the query.

The reasons and state names come from the projections and the state
vocabulary, so the SQL and a replay cannot drift apart (the property tests
check they agree).
"""

from __future__ import annotations

from ledger_server.projections import RESUME_DETAIL_PREFIXES, RESUME_REASONS
from ledger_server.states import QueryState, ShardState


def resume_reason_sql(deadline: str, now: str) -> str:
    """Returns a SQL CASE over a shard row `s` that gives resume_reason's answer.

    The stores compute the reason in the query so a million-line resume list is
    plain tuples from the cursor to the wire; `deadline` is the SQL expression of
    the running attempt's deadline and `now` the parameter holding the instant.
    The property tests check both paths give the same reasons.
    """
    r, p, s = RESUME_REASONS, RESUME_DETAIL_PREFIXES, ShardState
    return (
        f"CASE s.state WHEN '{s.PLANNED}' THEN '{r[s.PLANNED]}'"
        f" WHEN '{s.COMMITTED}' THEN '{r[s.COMMITTED]}'"
        f" WHEN '{s.FAILED}' THEN '{p[s.FAILED]}' || s.detail"
        f" WHEN '{s.VERIFY_FAILED}' THEN '{p[s.VERIFY_FAILED]}' || s.detail"
        f" WHEN '{s.RUNNING}' THEN CASE WHEN {deadline} < {now} THEN '{r[QueryState.STALE]}'"
        f" ELSE '{r[s.RUNNING]}' END END"
    )
