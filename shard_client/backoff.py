"""Capped exponential backoff: the one schedule of retry delays that the client and the sender use.

A delay starts at `FIRST_DELAY_S`, doubles after each failure and stops growing
at a cap. The client's RPC retries and the sender's waits for a ledger that is
away or overloaded sleep a jittered delay (between half and all of it), so jobs
that lost the ledger together, or were refused together, do not all retry in step.

When the ledger's refusal says when to come back (a RetryInfo delay: an
overloaded ledger, a store that is away), that delay replaces the step: capped
at the same maximum, then stretched to between all of it and half again as much
(`stretched`). Never shorter, because the ledger computed the delay as the
earliest it expects room (a client back sooner is refused again, which costs the
ledger a call); up to half longer, so that clients told the same delay, or capped
at the same maximum, do not come back in step.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Final

__all__ = [
    "CLIENT_MAX_DELAY_S",
    "FIRST_DELAY_S",
    "SENDER_MAX_DELAY_S",
    "grown",
    "jittered",
    "retry_wait",
    "stretched",
]

FIRST_DELAY_S: Final = 0.05
# The client retries one RPC within its deadline; the sender waits out a ledger that is away.
CLIENT_MAX_DELAY_S: Final = 2.0
SENDER_MAX_DELAY_S: Final = 5.0


def grown(delay_s: float, cap_s: float) -> float:
    """Returns the delay after one more failure: doubled, at most ``cap_s``."""
    return min(delay_s * 2, cap_s)


def jittered(delay_s: float, draw: Callable[[], float] = random.random) -> float:
    """Returns a delay between half and all of ``delay_s``; ``draw()`` in [0, 1) picks where."""
    return delay_s * (0.5 + draw() / 2)


def stretched(delay_s: float, draw: Callable[[], float] = random.random) -> float:
    """Returns a delay between all of ``delay_s`` and half again as much; ``draw()`` picks where."""
    return delay_s * (1 + draw() / 2)


def retry_wait(
    advised_s: float | None,
    step_s: float,
    *,
    cap_s: float,
    jitter: Callable[[float], float] = jittered,
    advised_jitter: Callable[[float], float] = stretched,
) -> float:
    """Returns how long to wait before the next try: the ledger's advice when it gave one.

    ``advised_s`` is the refusal's RetryInfo delay (``LedgerClientError.retry_after_s``),
    capped at ``cap_s`` and spread by ``advised_jitter``; without it, the caller's own
    exponential ``step_s`` spread by ``jitter``.
    """
    if advised_s is not None:
        return advised_jitter(min(advised_s, cap_s))
    return jitter(step_s)
