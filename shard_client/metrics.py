"""Telemetry values turned into what a heartbeat may carry, without ever raising into the job.

A job reports whatever its training loop holds: floats, ints, numpy or torch
scalars, now and then a NaN loss or a value that is no number at all.
`TelemetryCoercer` makes each of them something the ledger stores: finite
values go in ``Heartbeat.metrics``; the names of NaN and ±Inf ones go in
``Heartbeat.nonfinite_metrics`` (numeric pollution is evidence, not an error);
what cannot be read as a number is dropped; everything is clamped to the
server's limits. Each kind of trouble is logged once per metric name, on
``logging.getLogger("shard_client")``.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

__all__ = [
    "MAX_METRICS",
    "MAX_METRICS_JSON_BYTES",
    "MAX_METRIC_NAME_CHARS",
    "Coerced",
    "TelemetryCoercer",
]

log = logging.getLogger("shard_client")

# The server's limits (ledger_server/validation.py), repeated: the SDK never imports the server.
MAX_METRICS: Final = 256  # MAX_MAP_ENTRIES, for metrics and for nonfinite_metrics each
MAX_METRIC_NAME_CHARS: Final = 256
# The ledger stores at most 64 KiB of canonical JSON per event; 256 names of 256
# characters alone would pass that, so the metrics share a budget that leaves room
# for the envelope (ids, times) and the rest of the heartbeat.
MAX_METRICS_JSON_BYTES: Final = 56 * 1024
_NUMBER_JSON_BYTES: Final = 26  # the longest float repr, a colon and a comma
# Names made up per step (f"loss_{step}") must not grow the set of logged problems forever.
_MAX_LOGGED: Final = 1024
_MAX_STEP: Final = 2**63 - 1  # Heartbeat.step is an int64


@dataclass(frozen=True, slots=True)
class Coerced:
    """What one progress() call may send: finite metrics, non-finite names, a valid step and progress."""

    step: int
    progress: float
    metrics: dict[str, float]
    nonfinite: tuple[str, ...]  # sorted, unique


def _name_bytes(name: str) -> int:
    return len(name.encode("utf-8", "replace")) + 3  # quotes and a separator, roughly


class TelemetryCoercer:
    """Coerces the values of one attempt's progress() calls; logs each problem once."""

    def __init__(self, *, shard_id: str, attempt_id: str) -> None:
        self._label = f"shard={shard_id} attempt={attempt_id}"
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()  # progress() may be called from several threads

    def coerce(self, step: object, progress: object, metrics: Mapping[str, object]) -> Coerced:
        """Returns the heartbeat's content; never raises for any value a caller passes."""
        numbers: dict[str, float] = {}
        cut = 0
        for raw_name, value in metrics.items():
            name = self._name(raw_name)
            if name is None:
                continue
            if len(name) > MAX_METRIC_NAME_CHARS:
                name, cut = name[:MAX_METRIC_NAME_CHARS], cut + 1
            if name in numbers:
                continue  # the first of two names cut to the same prefix wins
            number = self._number(name, value)
            if number is not None:
                numbers[name] = number
        finite: dict[str, float] = {}
        nonfinite: set[str] = set()
        budget = MAX_METRICS_JSON_BYTES
        over: list[str] = []
        # Non-finite names first: numeric pollution is the evidence the ledger flags.
        ordered = sorted(numbers.items(), key=lambda item: math.isfinite(item[1]))
        for name, number in ordered:
            ok = math.isfinite(number)
            cost = _name_bytes(name) + (_NUMBER_JSON_BYTES if ok else 0)
            if len(finite if ok else nonfinite) >= MAX_METRICS or cost > budget:
                over.append(name)
                continue
            budget -= cost
            if ok:
                finite[name] = number
            else:
                nonfinite.add(name)
                self._once(
                    "metric_nonfinite",
                    name,
                    f"value {number!r} at step {step!r}, sent in nonfinite_metrics; the job goes on",
                )
        # Limits are met with many names at once: one line per attempt, not one per name.
        if cut:
            self._once(
                "metrics_renamed", "*", f"{cut} names cut to {MAX_METRIC_NAME_CHARS} characters"
            )
        if over:
            self._once(
                "metrics_dropped",
                over[0],
                f"{len(over)} metrics left out, over the ledger's limit of {MAX_METRICS}"
                f" metrics or {MAX_METRICS_JSON_BYTES} bytes of them per heartbeat",
                key="*",
            )
        return Coerced(self._step(step), self._progress(progress), finite, tuple(sorted(nonfinite)))

    def _name(self, raw: object) -> str | None:
        if not isinstance(raw, str) or not raw:
            self._once("metric_dropped", repr(raw), "a metric name must be non-empty text")
            return None
        return raw.replace("\x00", "?")

    def _number(self, name: str, value: object) -> float | None:
        if isinstance(value, str | bytes | bytearray):
            self._once("metric_dropped", name, f"a {type(value).__name__} is not a number")
            return None
        try:
            # float() reads ints, bools, Decimal, and numpy and one-element torch scalars.
            return float(value)  # type: ignore[arg-type]
        except OverflowError:  # an int beyond any float is as infinite as a float gets
            return math.inf
        except Exception as exc:  # telemetry never raises into the job: the value is dropped
            self._once(
                "metric_dropped",
                name,
                f"a {type(value).__name__} is not a number ({type(exc).__name__}: {exc})",
            )
            return None

    def _step(self, step: object) -> int:
        try:
            number: int = int(step)  # type: ignore[call-overload]
        except Exception as exc:  # telemetry never raises into the job
            self._once("progress_invalid", "step", f"step {step!r} is no integer ({exc}); sent 0")
            return 0
        if not 0 <= number <= _MAX_STEP:
            self._once("progress_invalid", "step", f"step {number} is out of range; sent 0")
            return 0
        return number

    def _progress(self, progress: object) -> float:
        try:
            number = float(progress)  # type: ignore[arg-type]
        except Exception as exc:  # telemetry never raises into the job
            self._once("progress_invalid", "progress", f"{progress!r} is no number ({exc}); sent 0")
            return 0.0
        if math.isnan(number):
            self._once("progress_invalid", "progress", "progress is NaN; sent 0")
            return 0.0
        if not 0.0 <= number <= 1.0:
            self._once("progress_invalid", "progress", f"{number!r} clamped to [0, 1]")
            return min(max(number, 0.0), 1.0)
        return number

    def _once(self, event: str, name: str, detail: str, *, key: str | None = None) -> None:
        """Logs a problem the first time this attempt meets it for this name (or key)."""
        with self._lock:
            seen = (event, name if key is None else key)
            if seen in self._logged or len(self._logged) >= _MAX_LOGGED:
                return
            self._logged.add(seen)
        log.warning("%s %s metric=%r: %s", event, self._label, name[:80], detail)
