"""Capped exponential backoff: the one schedule of retry delays that the client and the sender use.

A delay starts at `FIRST_DELAY_S`, doubles after each failure and stops growing
at a cap. The client's RPC retries and the sender's waits for a ledger that is
away or overloaded sleep a jittered delay (between half and all of it), so jobs
that lost the ledger together, or were refused together, do not all retry in step.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Final

__all__ = ["CLIENT_MAX_DELAY_S", "FIRST_DELAY_S", "SENDER_MAX_DELAY_S", "grown", "jittered"]

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
