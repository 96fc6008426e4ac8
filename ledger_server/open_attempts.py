"""The open attempts' share of the field figures, kept by the writer instead of rescanned.

A running shard's open latest attempt adds to the run's GPU time as "running" while
it beats, and as "hung" once it is past its deadline (field.open_part_of). Two
stored things replace a parse of every running shard at each report and scrape:

* the run counters ``open.*`` sum every open attempt as if it were running, per
  group of attempts that share labels and pass (`open_counters`): the writer adds
  each batch's change, a replay sums the same (summary.stored_contributions);
* one narrow row per open attempt (`open_row`, the store's shard_open table) whose
  deadline index gives the stale ones, summed in SQL by group (StaleOpen).

`open_figures` turns both into exactly what field.add_open adds for each open part
at a moment. Staleness depends on the clock, so it is never stored: only found.
Pure: no SQL, the time is the caller's.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Final

from ledger_server import field
from ledger_server.projections import base_state, deadline_us, row_columns
from ledger_server.record import Attempt, ShardRecord
from ledger_server.states import ShardState
from ledger_server.store.base import OpenRow, ShardRow, StaleOpen
from ledger_server.summary import contributions

__all__ = [
    "OPEN_PREFIX",
    "OpenBefore",
    "field_counters",
    "open_counters",
    "open_delta",
    "open_figures",
    "open_row",
    "shard_row",
    "stored_contributions",
]

# Every open-attempt counter starts with this: the summary and field figures never read them.
OPEN_PREFIX: Final = "open."
# The three sums kept per group: attempts, GPU-µs as running, attempts whose GPUs are unknown.
_ATTEMPTS: Final = OPEN_PREFIX + "n:"
_GPU: Final = OPEN_PREFIX + "gpu:"
_UNKNOWN: Final = OPEN_PREFIX + "unknown:"


def _labels_json(labels: Mapping[str, str]) -> str:
    # The writer asks twice per heartbeat, and a night has a few label sets: cached by items.
    return _json_of_items(tuple(labels.items()))


@lru_cache(maxsize=4096)
def _json_of_items(items: tuple[tuple[str, str], ...]) -> str:
    return json.dumps(dict(items), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@lru_cache(maxsize=4096)
def _group(first_pass: bool, labels: str, shard_labels: str) -> str:
    # A JSON array of the two JSON texts: any label value can be told apart.
    return json.dumps([int(first_pass), labels, shard_labels], separators=(",", ":"))


def open_row(record: ShardRecord | None) -> OpenRow | None:
    """Returns the row of the shard's open attempt while the shard runs, else None.

    The same attempt, labels and deadline the report read from a running shard's row
    (record.latest_attempt_from_row): the latest attempt, the plan's labels under its
    own, the shard's first attempt's labels over the plan's.
    """
    if record is None or base_state(record)[0] != ShardState.RUNNING:
        return None
    attempt = record.attempts.get(record.latest_attempt)
    if attempt is None:
        return None
    attempts = record.attempts
    first = attempt if len(attempts) == 1 else min(attempts.values(), key=_started_seq)
    gpus, known = field.attempt_gpus(record, attempt)
    # Positional: the writer builds two of these per heartbeat.
    return OpenRow(
        deadline_us(record),
        attempt.last_seen_us,  # seen_us
        attempt.started_us,
        gpus,
        known,  # gpus_known
        attempt.saved_us or attempt.started_us,  # saved_us
        attempt.first_pass,
        _labels_json(record.labels | attempt.labels),  # labels
        _labels_json(record.labels | first.labels),  # shard_labels
    )


def _started_seq(attempt: Attempt) -> int:
    return attempt.started_seq


def shard_row(shard_id: str, record: ShardRecord) -> ShardRow:
    """Returns the shard's projection row as every writer saves it, its open attempt's row too."""
    return ShardRow(shard_id=shard_id, **row_columns(record), open=open_row(record))


def open_counters(row: OpenRow | None) -> Counter[str]:
    """Returns what one open attempt adds to the run's open.* counters (as if running)."""
    out: Counter[str] = Counter()
    if row is None:
        return out
    group = _group(row.first_pass, row.labels, row.shard_labels)
    out[_ATTEMPTS + group] = 1
    out[_GPU + group] = row.gpus * max(0, row.seen_us - row.started_us)
    out[_UNKNOWN + group] = int(not row.gpus_known)
    return +out  # no zero entries: the store keeps none


def stored_contributions(record: ShardRecord) -> Counter[str]:
    """Returns every counter one shard adds to its run's stored counters (a replay sums them).

    The summary's (summary.contributions) and its open attempt's. The writer adds the
    two apart: the summary's only when an event may change them, the open attempt's
    after every batch that touched the shard (a heartbeat moves its span).
    """
    out = contributions(record)
    out.update(open_counters(open_row(record)))
    return out


def open_delta(before: OpenRow | None, after: OpenRow | None) -> dict[str, int]:
    """Returns how a shard's open.* counters move when its open attempt goes from before to after."""
    if after == before:
        return {}
    if before is not None and after is not None and before[2:] == after[2:]:
        # A heartbeat moved the last-seen time (and the deadline) alone: only the span grew.
        group = _group(after.first_pass, after.labels, after.shard_labels)
        span, was = after.seen_us - after.started_us, before.seen_us - before.started_us
        return {_GPU + group: after.gpus * (max(0, span) - max(0, was))}
    delta = open_counters(after)
    delta.subtract(open_counters(before))
    return delta


class OpenBefore:
    """A shard's open attempt as a batch found it, for the batch's open_delta.

    Most of a night's events are plain heartbeats, which move only the latest
    attempt's last-seen time: the time is kept at once, the whole row is built only
    before another kind of event changes the record (`before_change`).
    """

    __slots__ = ("built", "row", "seen_us")

    def __init__(self, record: ShardRecord | None) -> None:
        latest = record.attempts.get(record.latest_attempt) if record is not None else None
        self.seen_us = latest.last_seen_us if latest is not None else 0
        self.row: OpenRow | None = None
        self.built = False

    def before_change(self, record: ShardRecord | None) -> None:
        """Builds the row before an event other than a plain heartbeat folds into the record."""
        if self.built:
            return
        row = open_row(record)
        # Plain heartbeats folded earlier in the batch moved only the last-seen time.
        self.row = None if row is None else row._replace(seen_us=self.seen_us)
        self.built = True

    def delta(self, after: OpenRow | None) -> dict[str, int]:
        """Returns how the run's open.* counters move from this to the attempt's row after."""
        if self.built:
            return open_delta(self.row, after)
        # Only plain heartbeats: the row is what it was, but for its last-seen time.
        return open_delta(None if after is None else after._replace(seen_us=self.seen_us), after)


def field_counters(counters: Mapping[str, int]) -> Counter[str]:
    """Returns the run counters without the open.* sums (what the figures read)."""
    return Counter({k: n for k, n in counters.items() if not k.startswith(OPEN_PREFIX)})


def open_figures(
    counters: Mapping[str, int], stale: Iterable[StaleOpen], *, by_label: bool = True
) -> Counter[str]:
    """Returns what the open attempts add to the field counters at the moment ``stale`` was read.

    ``counters`` are the run's counters (its open.* sums), ``stale`` its open attempts
    past their deadline then: those are hung, the rest running, exactly as
    field.add_open adds each open part.
    """
    sums: dict[str, list[int]] = {}
    for key, n in counters.items():
        if key.startswith(OPEN_PREFIX):
            figure, group = key.split(":", 1)
            index = (_ATTEMPTS, _GPU, _UNKNOWN).index(figure + ":")
            sums.setdefault(group, [0, 0, 0])[index] += n
    out: Counter[str] = Counter()
    for s in stale:
        group = _group(s.first_pass, s.labels, s.shard_labels)
        running = sums.setdefault(group, [0, 0, 0])
        running[0] -= s.attempts
        running[1] -= s.gpu_us
        running[2] -= s.gpus_unknown
        field.add_opens(
            out,
            field.OpenSum(
                "hung",
                attempts=s.attempts,
                gpu_us=s.gpu_us,
                gpus_unknown=s.gpus_unknown,
                hang_lost_us=s.hang_lost_us,
                labels=json.loads(s.labels),
                shard_labels=json.loads(s.shard_labels),
                first_pass=s.first_pass,
            ),
            by_label=by_label,
        )
    for group, (attempts, gpu_us, unknown) in sums.items():
        if not attempts:
            continue
        first_pass, labels, shard_labels = json.loads(group)
        field.add_opens(
            out,
            field.OpenSum(
                "running",
                attempts=attempts,
                gpu_us=gpu_us,
                gpus_unknown=unknown,
                hang_lost_us=0,
                labels=json.loads(labels),
                shard_labels=json.loads(shard_labels),
                first_pass=bool(first_pass),
            ),
            by_label=by_label,
        )
    return out
