"""Checkpoint interval advice from measured data: the t that minimises p·t/2 + (T/t)·w.

The checkpoint interval follows from arithmetic: with T the shard's
duration, w one checkpoint's write time and p the chance that an attempt is
reclaimed, the expected waste of an interval t is about ``p·t/2 + (T/t)·w`` (half
an interval lost per reclaim, plus T/t writes), which is smallest at
``t* = sqrt(2·T·w/p)``. `checkpoint_advice()` measures T, w and p from a run's
events in the ledger (or takes them as numbers) so ``checkpoint_every`` comes
from data; docs/metrics.md defines each input.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Final

MAX_INTERVAL_STEPS: Final = 2**31 - 1

__all__ = [
    "CheckpointAdvice",
    "advise",
    "checkpoint_advice",
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
    # Saturated at the proto's int32 (CheckpointAdvice.interval_steps): a job counting
    # tokens as steps may need more, and "every 2**31 - 1 steps" says the same then.
    steps = min(max(1, round(t * steps_per_s)), MAX_INTERVAL_STEPS) if steps_per_s else None
    return CheckpointAdvice(T, w, p, attempts, t, steps, waste, reason)


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
