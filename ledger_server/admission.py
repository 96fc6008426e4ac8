"""Admission of appends by the group committer's measured capacity.

An admitted append waits for the group committer while holding a handler thread.
Past capacity, letting every call in only lengthens that wait until calls outlive
their deadline and are sent again (measured: 124 acknowledged events/s at twice
the fleet's cadence, a quarter of what the ledger commits), and refusing them at
the door without a hint brings them back at once (347/s). So an append is admitted
while the events already waiting can be committed within ``delay_s`` at the
committer's measured rate, and while enough handler threads stay free for reads;
beyond that it is refused at once (``Overloaded``: RESOURCE_EXHAUSTED, reason
OVERLOADED) with the time to come back, computed from the queue.

The time to come back counts the clients already told to come back: each refusal
takes the next slot in a virtual waiting room that the committer empties at its
measured rate. Without it, a thousand clients refused at once are all told "in
50 ms" (the time one group takes) and are all refused again.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Final

from ledger_server.errors import Overloaded

# How long the commit rate remembers: an exponential average over this much of the
# writer's busy time, so a burst of large groups moves it within seconds.
RATE_MEMORY_S: Final = 2.0
# A refusal never says less than this (a group commit rarely frees room sooner) ...
MIN_RETRY_S: Final = 0.02
# ... nor more than this: the waiting room is an estimate, and a client told to come
# back later than it would have waited on its own gains nothing.
MAX_RETRY_S: Final = 30.0


def read_reserve(max_workers: int) -> int:
    """Returns the handler threads that appends waiting for a commit never take (kept for reads)."""
    return max(1, max_workers // 4)


class Admission:
    """Counts the events waiting for the committer and admits or refuses each append."""

    def __init__(
        self,
        *,
        delay_s: float,
        min_events: int,
        max_calls: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.delay_s = delay_s
        self.min_events = min_events
        self.max_calls = max_calls
        self.clock = clock
        self._lock = threading.Lock()
        self.events = 0  # admitted and not yet answered
        self.calls = 0
        self.refused_calls = 0
        self.refused_events = 0
        # The commit rate: events and busy seconds of recent groups, decayed together.
        self._busy_events = 0.0
        self._busy_s = 0.0
        self._group_s = 0.0  # a recent group's duration
        # Up to when the clients already refused were told to come back.
        self._promised = 0.0

    @property
    def enabled(self) -> bool:
        """Returns whether appends can be refused (a target delay of 0 admits everything)."""
        return self.delay_s > 0

    @property
    def rate(self) -> float | None:
        """Returns the measured commit rate in events per busy second of the writer (None: none yet)."""
        return self._busy_events / self._busy_s if self._busy_s > 0 else None

    def bound(self) -> int:
        """Returns how many events may wait for the committer: delay_s of commits, at least min_events."""
        rate = self.rate
        return max(self.min_events, int(rate * self.delay_s)) if rate else self.min_events

    def observe_commit(self, events: int, seconds: float) -> None:
        """Takes one group commit's size and duration into the measured rate."""
        if events <= 0 or seconds <= 0:
            return
        keep = math.exp(-seconds / RATE_MEMORY_S)
        with self._lock:
            self._busy_events = self._busy_events * keep + events
            self._busy_s = self._busy_s * keep + seconds
            self._group_s = seconds if not self._group_s else 0.8 * self._group_s + 0.2 * seconds

    @contextmanager
    def admitted(self, events: int) -> Iterator[None]:
        """Holds room for an append of ``events`` until it is answered; raises Overloaded if none."""
        self.admit(events)
        try:
            yield
        finally:
            with self._lock:
                self.events -= events
                self.calls -= 1

    def admit(self, events: int) -> None:
        """Counts an append as waiting, or raises Overloaded with the time to come back."""
        with self._lock:
            bound = self.bound()
            # An empty queue takes any batch: a batch larger than the bound must not wait forever.
            if (
                not self.enabled
                or self.calls == 0
                or (self.events + events <= bound and self.calls < self.max_calls)
            ):
                self.events += events
                self.calls += 1
                return
            self.refused_calls += 1
            self.refused_events += events
            delay = self._retry_after(events, bound)
            queued = self.events
        raise Overloaded(delay, queued_events=queued, bound_events=bound)

    def _retry_after(self, events: int, bound: int) -> float:
        """Returns how long until the queue, and the clients told before, leave room; the caller locks."""
        rate = self.rate or self.min_events / self.delay_s
        # Events that must commit before this batch fits under the event bound ...
        excess = self.events + events - bound
        if self.calls >= self.max_calls:
            # ... or before a handler thread is free for it (calls leave as their groups commit).
            per_call = self.events / self.calls
            excess = max(excess, math.ceil((self.calls - self.max_calls + 1) * per_call))
        now = self.clock()
        start = now + max(excess / rate, self._group_s, MIN_RETRY_S)
        # Behind every client already told to come back; they take their turns at the rate.
        start = min(max(start, self._promised), now + MAX_RETRY_S)
        self._promised = min(start + events / rate, now + MAX_RETRY_S)
        return start - now
