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

With the asyncio engines the event loop is a second queue the committer's cannot
see: every message of every call waits there before an append reaches admission,
and at 10,000 streams the loop, not the writer, runs out first (measured: the loop
held the GIL 69 % of the time). So the server probes the loop (``observe_loop``:
how late a short sleep wakes) and, while its lateness stays above ``loop_lag_s``
over a few probes in a row (a standing queue, not one slow callback: CoDel's rule),
refuses appends the same way, with a waiting room that empties at the rate the
loop has been admitting events. What the loop cannot take is then refused within
the lag bound, instead of waiting until the client's deadline and being sent again.
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
# How often the event loop is probed, and over how many probes its lateness must stay
# above the bound before appends are refused for it (one slow callback is no queue).
LOOP_PROBE_S: Final = 0.05
LOOP_PROBES: Final = 4
# The loop's admitted-event rate never counts below this (events/s), so a loop that
# admitted nothing for a moment still spreads its waiting room out.
MIN_LOOP_RATE: Final = 10.0


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
        loop_lag_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.delay_s = delay_s
        self.min_events = min_events
        self.max_calls = max_calls
        self.loop_lag_s = loop_lag_s  # 0: the loop is not watched (threads engine, tests)
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
        # The event loop: its last probes' lateness, and the events it admitted per
        # second (an exponential average over RATE_MEMORY_S of wall time).
        self.lag_s = 0.0  # the least lateness of the last LOOP_PROBES probes
        self._lags: list[float] = []
        self._admitted = 0  # events admitted since the last probe
        self._loop_rate = 0.0
        self.refused_for_lag = 0

    @property
    def lagging(self) -> bool:
        """Whether the event loop holds a standing queue longer than its bound."""
        return self.loop_lag_s > 0 and self.lag_s > self.loop_lag_s

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

    def observe_loop(self, late_s: float, period_s: float) -> None:
        """Takes one probe of the event loop: how late a sleep of period_s woke."""
        with self._lock:
            self._lags.append(max(0.0, late_s))
            del self._lags[:-LOOP_PROBES]
            self.lag_s = min(self._lags) if len(self._lags) == LOOP_PROBES else 0.0
            elapsed = period_s + max(0.0, late_s)
            keep = math.exp(-elapsed / RATE_MEMORY_S)
            self._loop_rate = self._loop_rate * keep + (1 - keep) * self._admitted / elapsed
            self._admitted = 0

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
            lagging = self.enabled and self.lagging
            # An empty queue takes any batch: a batch larger than the bound must not wait
            # forever (a loop that lags is a queue of its own: it admits nothing).
            if not lagging and (
                not self.enabled
                or self.calls == 0
                or (self.events + events <= bound and self.calls < self.max_calls)
            ):
                self.events += events
                self.calls += 1
                self._admitted += events
                return
            self.refused_calls += 1
            self.refused_events += events
            if lagging:
                self.refused_for_lag += 1
                delay = self._retry_after_lag(events)
                lag = self.lag_s
            else:
                delay = self._retry_after(events, bound)
                lag = None
            queued = self.events
        raise Overloaded(delay, queued_events=queued, bound_events=bound, loop_lag_s=lag)

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
        return self._queue_behind(now, start, events / rate)

    def _retry_after_lag(self, events: int) -> float:
        """Returns how long until the loop has room: its lateness, then turns at its admitted rate."""
        rate = max(self._loop_rate, MIN_LOOP_RATE)
        if self.rate:
            rate = min(rate, self.rate)
        now = self.clock()
        return self._queue_behind(now, now + max(self.lag_s, MIN_RETRY_S), events / rate)

    def _queue_behind(self, now: float, start: float, turn_s: float) -> float:
        """Returns the delay to a turn no sooner than start, behind every client told before."""
        # They take their turns at the rate, each turn_s long; the caller locks.
        start = min(max(start, self._promised), now + MAX_RETRY_S)
        self._promised = min(start + turn_s, now + MAX_RETRY_S)
        return start - now
