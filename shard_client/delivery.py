"""Delivery of events to the ledger in order, isolating refused ones by bisection.

An append is atomic: one refused event refuses its whole batch. `deliver` sends
the batch, and on a refusal resends what precedes the refused event (named by the
server's ``event_index``, else found by halving), records the refusal, and goes on
with the rest, so every event gets its own answer. Used by the sender, the spool
drain and `shardledger plan`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Final

from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.client import LedgerClient
from shard_client.errors import (
    LedgerClientError,
    LedgerRejected,
    LedgerUnavailable,
    Overloaded,
    PermissionDenied,
    StoreFault,
)

__all__ = ["MAX_BATCH_BYTES", "MAX_BATCH_EVENTS", "Result", "deliver"]

MAX_BATCH_EVENTS: Final = 500
# Well under the 16 MiB message limit whatever the events weigh (each is <= 64 KiB).
MAX_BATCH_BYTES: Final = 4 * 1024 * 1024
# Refusals that say nothing about the event itself: keep it and try again later.
_TRANSIENT: Final = (LedgerUnavailable, Overloaded, PermissionDenied, StoreFault)

Result = pb.AppendResult | LedgerRejected


def _guarded(gate: threading.Lock | None) -> contextlib.AbstractContextManager[object]:
    return gate if gate is not None else contextlib.nullcontext()


def deliver(
    client: LedgerClient,
    events: Sequence[pb.ShardEvent],
    *,
    gate: threading.Lock | None = None,
    retry: bool = False,
) -> tuple[list[Result], LedgerClientError | None]:
    """Appends events in order, isolating refused ones; returns results for a prefix and why it stopped."""
    done: list[Result] = []
    # A stack of (start, end) slices to send, or (index, index, refusal) to record.
    todo: list[tuple[int, int, LedgerRejected | None]] = [(0, len(events), None)]
    while todo:
        start, end, refusal = todo.pop()
        if refusal is not None:
            done.append(refusal)
            continue
        if start >= end:
            continue
        try:
            with _guarded(gate):
                done.extend(client.append(events[start:end], retry=retry))
        except _TRANSIENT as exc:
            return done, exc
        except LedgerRejected as exc:
            index = int(exc.metadata.get("event_index", -1))
            if 0 <= index < end - start:
                # The batch is atomic: nothing was stored, and what precedes the
                # refused event is fine to send again.
                cut = start + index
                todo += [(cut + 1, end, None), (cut, cut, exc), (start, cut, None)]
            elif end - start > 1:
                mid = (start + end) // 2
                todo += [(mid, end, None), (start, mid, None)]
            else:
                done.append(exc)
    return done, None
