"""The progress() calls of one heartbeat interval, folded into the one heartbeat that carries them.

A training loop calls ``shard.progress()`` every step, 50 times a second or
more; the ledger needs to know the attempt is alive and where it is, not every
step. `ProgressWindow` folds the calls of one interval into one heartbeat:
``step``, ``progress`` and ``metrics`` are the latest values, and a window of
two or more calls adds what the interval held: ``first_step`` (the lowest step
seen), ``metrics_min`` / ``metrics_max`` (each metric's finite extremes),
``nonfinite_metrics`` (every name that was NaN or ±Inf at any step) and
``progress_calls``. A window of one call is the plain heartbeat that call
would have sent alone, byte for byte.

The window's metrics share the per-heartbeat budget of shard_client.metrics:
names beyond it (a job inventing names per step) are left out of the window,
and extremes are kept only while the three maps together fit.
"""

from __future__ import annotations

from typing import Final

from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.metrics import MAX_METRICS, MAX_METRICS_JSON_BYTES, Coerced

__all__ = ["ProgressWindow"]

_NUMBER_JSON_BYTES: Final = 26  # the longest float repr, a colon and a comma


def _name_bytes(name: str) -> int:
    return len(name.encode("utf-8", "replace")) + 3  # quotes and a separator, roughly


class ProgressWindow:
    """The progress() calls since the last heartbeat; not thread-safe (the caller locks)."""

    __slots__ = (
        "_cost",
        "calls",
        "dropped",
        "first_step",
        "high",
        "last",
        "low",
        "nonfinite",
        "progress",
        "step",
    )

    def __init__(self) -> None:
        self.calls = 0
        self.first_step = self.step = 0
        self.progress = 0.0
        self.last: dict[str, float] = {}  # each metric's latest value, when it was finite
        self.low: dict[str, float] = {}
        self.high: dict[str, float] = {}
        self.nonfinite: set[str] = set()
        self.dropped = 0  # metric names left out: over the limits of one heartbeat
        self._cost = 0

    def add(self, values: Coerced) -> None:
        """Folds one call's coerced values into the window."""
        self.first_step = values.step if not self.calls else min(self.first_step, values.step)
        self.calls += 1
        self.step, self.progress = values.step, values.progress
        for name, number in values.metrics.items():
            if name not in self.low and not self._admit(name, len(self.low), _NUMBER_JSON_BYTES):
                continue
            self.last[name] = number
            low, high = self.low.get(name), self.high.get(name)
            if low is None or number < low:
                self.low[name] = number
            if high is None or number > high:
                self.high[name] = number
        for name in values.nonfinite:
            if name not in self.nonfinite and self._admit(name, len(self.nonfinite), 0):
                self.nonfinite.add(name)
            self.last.pop(name, None)  # its latest value is not finite

    def _admit(self, name: str, held: int, number_bytes: int) -> bool:
        """Whether a new name still fits one heartbeat's limits (it is charged if so)."""
        cost = _name_bytes(name) + number_bytes
        if held >= MAX_METRICS or self._cost + cost > MAX_METRICS_JSON_BYTES:
            self.dropped += 1
            return False
        self._cost += cost
        return True

    def heartbeat(self) -> pb.Heartbeat:
        """Returns the heartbeat that carries the window (one call: exactly that call's)."""
        beat = pb.Heartbeat(
            step=self.step,
            progress=self.progress,
            metrics=self.last,
            nonfinite_metrics=sorted(self.nonfinite),
        )
        if self.calls > 1:
            beat.first_step = self.first_step
            beat.progress_calls = self.calls
            # The extremes come second: a window whose names fill the budget carries its
            # latest values whole and the extremes of as many names as still fit.
            budget = MAX_METRICS_JSON_BYTES - self._cost
            for name in sorted(self.low):
                budget -= 2 * (_name_bytes(name) + _NUMBER_JSON_BYTES)
                if budget < 0:
                    break
                beat.metrics_min[name] = self.low[name]
                beat.metrics_max[name] = self.high[name]
        return beat
