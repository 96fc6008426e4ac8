"""Checkpoint interval advice from measured data: the t that minimises p·t/2 + (T/t)·w.

Report 1 (§3.2) sets the checkpoint interval by arithmetic: with T the shard's
duration, w one checkpoint's write time and p the chance that an attempt is
reclaimed, the expected waste of an interval t is about ``p·t/2 + (T/t)·w`` (half
an interval lost per reclaim, plus T/t writes), which is smallest at
``t* = sqrt(2·T·w/p)``. `checkpoint_advice()` measures T, w and p from a run's
events in the ledger (or takes them as numbers) so ``checkpoint_every`` comes
from data; docs/metrics.md defines each input.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final

from shard_client.api.shardledger.v1 import ledger_pb2 as pb

__all__ = [
    "AttemptSpan",
    "CheckpointAdvice",
    "advice_from",
    "advise",
    "checkpoint_advice",
    "measure_events",
]

RECLAIM_TAGS: Final = frozenset({"preempted", "killed"})


@dataclass(frozen=True, slots=True)
class CheckpointAdvice:
    """The advised interval with the inputs it came from; ``interval_s`` None when there is none."""

    shard_duration_s: float | None
    checkpoint_write_s: float | None
    reclaim_probability: float | None
    attempts: int
    interval_s: float | None
    interval_steps: int | None
    expected_waste_s: float | None
    reason: str

    def as_json(self) -> dict[str, Any]:
        """Returns the advice as a JSON-ready dict."""
        return asdict(self)


def advise(
    *,
    shard_duration_s: float | None,
    checkpoint_write_s: float | None,
    reclaim_probability: float | None,
    attempts: int = 0,
    steps_per_s: float | None = None,
) -> CheckpointAdvice:
    """Returns t* = sqrt(2·T·w/p) (capped at T) and its expected waste, or why there is none."""
    T, w, p = shard_duration_s, checkpoint_write_s, reclaim_probability
    reason = ""
    if not T or T <= 0:
        reason = "no attempt completed, so the shard duration T is unknown"
    elif w is None or w <= 0:
        reason = (
            "no checkpoint write time was measured (checkpoint_write / save_checkpoint record it)"
        )
    elif p is None or p <= 0:
        reason = "no attempt was reclaimed: nothing to save time for; checkpoint for other reasons"
    if reason:
        return CheckpointAdvice(T, w, p, attempts, None, None, None, reason)
    assert T is not None and w is not None and p is not None
    t = min(math.sqrt(2 * T * w / p), T)
    waste = p * t / 2 + (T / t) * w
    if t >= T:
        reason = "t* is at least T: one checkpoint per shard (at the end) is enough"
    else:
        reason = "t* = sqrt(2·T·w/p) minimises p·t/2 + (T/t)·w"
    steps = max(1, round(t * steps_per_s)) if steps_per_s else None
    return CheckpointAdvice(T, w, p, attempts, t, steps, waste, reason)


@dataclass(slots=True)
class AttemptSpan:
    """What the advice needs of one attempt: its ledger times, last step, ending, commits."""

    started_us: int
    last_us: int
    last_step: int = -1
    tag: str = ""
    commits: int = 0


def _us(ts: Any) -> int:
    return int(ts.seconds) * 1_000_000 + int(ts.nanos) // 1000


def measure_events(events: Iterable[pb.ShardEvent]) -> CheckpointAdvice:
    """Returns the advice for a run from its events (as ListEvents returns them).

    T is the median span (ledger receive times, from the started event to the
    last commit) of attempts that committed and did not fail; w the median measured checkpoint write time; p the share
    of ended attempts that were reclaimed (failed preempted or killed).
    """
    attempts: dict[str, AttemptSpan] = {}
    writes: list[float] = []
    for e in events:
        now = _us(e.receive_time)
        kind = e.WhichOneof("payload")
        if kind == "started":
            attempts[e.attempt_id] = AttemptSpan(now, now)
            continue
        a = attempts.get(e.attempt_id)
        if a is None or kind == "verified":
            continue  # a verdict names the attempt it judged; it is no event of the attempt
        if not a.commits or kind == "artifact_committed":
            a.last_us = max(a.last_us, now)  # an attempt that committed ends at its last commit
        if kind == "heartbeat":
            a.last_step = max(a.last_step, e.heartbeat.step)
        elif kind == "checkpoint" and e.checkpoint.HasField("write_duration"):
            writes.append(e.checkpoint.write_duration.ToNanoseconds() / 1e9)
        elif kind == "artifact_committed":
            a.commits += 1
        elif kind == "failed":
            # FAILURE_TAG_PREEMPTED -> "preempted": the tag names the server and CLI use.
            name = pb.FailureTag.Name(e.failed.tag)
            a.tag = name.removeprefix("FAILURE_TAG_").lower() or "unknown"
    return advice_from(list(attempts.values()), writes)


def advice_from(attempts: Sequence[AttemptSpan], writes: Sequence[float]) -> CheckpointAdvice:
    """Returns the advice from attempt spans and measured checkpoint write times (seconds)."""
    done = [a for a in attempts if a.commits and not a.tag]
    ended = [a for a in attempts if a.tag or a.commits]
    durations = [(a.last_us - a.started_us) / 1e6 for a in done]
    rates = [
        a.last_step / ((a.last_us - a.started_us) / 1e6)
        for a in done
        if a.last_step > 0 and a.last_us > a.started_us
    ]
    return advise(
        shard_duration_s=statistics.median(durations) if durations else None,
        checkpoint_write_s=statistics.median(writes) if writes else None,
        reclaim_probability=(
            sum(a.tag in RECLAIM_TAGS for a in ended) / len(ended) if ended else None
        ),
        attempts=len(ended),
        steps_per_s=statistics.median(rates) if rates else None,
    )


def checkpoint_advice(
    run_id: str, *, client: Any = None, target: str | None = None, namespace: str = ""
) -> CheckpointAdvice:
    """Returns the checkpoint interval advice the ledger measured from a run (GetRunReport).

    ``client`` is a LedgerClient (else one is made for ``target``, default
    $SHARDLEDGER_SERVER, and closed afterwards). Set ``checkpoint_every`` from
    ``interval_steps`` (or ``interval_s``); ``reason`` says why there is none.
    """
    from shard_client.client import LedgerClient

    own = client is None
    client = client or LedgerClient(target)
    try:
        advice = client.run_report(run_id, namespace=namespace).report.checkpoint_advice
    finally:
        if own:
            client.close()

    def optional(name: str) -> Any:
        return getattr(advice, name) if advice.HasField(name) else None

    return CheckpointAdvice(
        shard_duration_s=optional("shard_duration_s"),
        checkpoint_write_s=optional("checkpoint_write_s"),
        reclaim_probability=optional("reclaim_probability"),
        attempts=advice.attempts,
        interval_s=optional("interval_s"),
        interval_steps=optional("interval_steps"),
        expected_waste_s=optional("expected_waste_s"),
        reason=advice.reason,
    )
