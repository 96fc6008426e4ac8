"""deliver: every event of a batch gets its own answer, the refused ones isolated by bisection."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import pytest

from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.delivery import deliver
from shard_client.errors import LedgerRejected, LedgerUnavailable


class _FakeClient:
    """Refuses a whole batch that holds a bad event, as the atomic AppendEvents does."""

    def __init__(self, bad: set[str], *, name_index: bool, down_after: int | None = None) -> None:
        self.bad, self.name_index, self.down_after = bad, name_index, down_after
        self.batches: list[list[str]] = []

    def append(
        self, events: Sequence[pb.ShardEvent], *, retry: bool = True
    ) -> list[pb.AppendResult]:
        ids = [e.event_id for e in events]
        if self.down_after is not None and len(self.batches) >= self.down_after:
            raise LedgerUnavailable("down")
        self.batches.append(ids)
        refused = [i for i, event_id in enumerate(ids) if event_id in self.bad]
        if refused:
            metadata = {"event_index": str(refused[0])} if self.name_index else {}
            raise LedgerRejected(
                f"bad {ids[refused[0]]}",
                code=grpc.StatusCode.INVALID_ARGUMENT,
                reason="INVALID_FIELD",
                metadata=metadata,
            )
        return [pb.AppendResult(sequence=int(event_id[1:]) + 1) for event_id in ids]


def _events(count: int) -> list[pb.ShardEvent]:
    return [pb.ShardEvent(event_id=f"e{n}") for n in range(count)]


def _answers(results: Sequence[pb.AppendResult | LedgerRejected]) -> list[str]:
    return ["refused" if isinstance(r, LedgerRejected) else f"seq{r.sequence}" for r in results]


@pytest.mark.parametrize("name_index", [True, False], ids=["event_index", "bisection"])
def test_refused_events_are_isolated_and_the_others_stored_in_order(name_index: bool) -> None:
    client = _FakeClient({"e2", "e5"}, name_index=name_index)
    results, stop = deliver(client, _events(7))  # type: ignore[arg-type]
    assert stop is None
    assert _answers(results) == [
        "seq1", "seq2", "refused", "seq4", "seq5", "refused", "seq7"
    ]  # fmt: skip


def test_a_named_refusal_resends_only_around_it() -> None:
    client = _FakeClient({"e2"}, name_index=True)
    deliver(client, _events(5))  # type: ignore[arg-type]
    assert client.batches == [["e0", "e1", "e2", "e3", "e4"], ["e0", "e1"], ["e3", "e4"]]


def test_an_unreachable_ledger_stops_with_the_answered_prefix() -> None:
    client = _FakeClient({"e1"}, name_index=True, down_after=2)
    results, stop = deliver(client, _events(4))  # type: ignore[arg-type]
    assert isinstance(stop, LedgerUnavailable)
    assert _answers(results) == ["seq1", "refused"]
