"""The fate of one emitted event (`Ack`): acknowledged by the ledger, spooled, or refused."""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.errors import LedgerClientError, LedgerRejected, LedgerUnavailable

if TYPE_CHECKING:
    from shard_client.sender import Sender

__all__ = ["Ack", "resolve"]

_OUTCOMES: Final = {
    pb.APPEND_OUTCOME_APPENDED: "appended",
    pb.APPEND_OUTCOME_DUPLICATE: "duplicate",
    pb.APPEND_OUTCOME_ALREADY_PLANNED: "already_planned",
}


class Ack:
    """The fate of one emitted event: acknowledged by the ledger, spooled, or refused.

    ``settled`` turns true once the ledger acknowledged the event, the spool
    holds it durably, or it failed; ``acknowledged`` once the ledger stored it
    (a spooled event when it drains).
    """

    __slots__ = (
        "_sender",
        "acknowledged",
        "error",
        "event_id",
        "input_changed",
        "outcome",
        "sequence",
        "settled",
    )

    def __init__(self, event_id: str, sender: Sender) -> None:
        self.event_id = event_id
        self.sequence = 0
        # appended | duplicate | already_planned | spooled | rejected | failed
        self.outcome = ""
        self.error: LedgerClientError | None = None
        # For a started event that named its input: what the ledger found differs from
        # the plan ("" when nothing, or not yet acknowledged).
        self.input_changed = ""
        self.settled = self.acknowledged = False
        self._sender = sender

    @property
    def spooled(self) -> bool:
        """Returns whether the event waits durably in the spool, not yet acknowledged."""
        return self.outcome == "spooled"

    def wait(self, timeout: float | None = None) -> bool:
        """Waits until the event is settled; returns False on timeout."""
        return self._sender._await(lambda: self.settled, timeout)

    def wait_acknowledged(self, timeout: float | None = None) -> bool:
        """Waits until the ledger itself acknowledged the event (a spooled one once drained)."""
        return self._sender._await(lambda: self.acknowledged, timeout)

    def result(self, timeout: float | None = None) -> Ack:
        """Waits like wait(); raises the refusal, or LedgerUnavailable when time runs out."""
        if not self.wait(timeout):
            raise LedgerUnavailable(f"event {self.event_id} was not recorded within {timeout}s")
        if self.error is not None:
            raise self.error
        return self

    def _settle(
        self, outcome: str, sequence: int = 0, error: LedgerClientError | None = None
    ) -> bool:
        """Records what happened (the sender's lock is held); returns whether it was news."""
        first = not self.settled
        if first or (outcome not in ("spooled", "failed") and not self.acknowledged):
            self.outcome, self.sequence, self.error = outcome, sequence, error
        self.acknowledged = self.acknowledged or sequence > 0
        self.settled = True
        return first


def resolve(ack: Ack, result: pb.AppendResult | LedgerRejected) -> bool:
    """Settles an ack with the ledger's answer or refusal; returns whether it was news."""
    if isinstance(result, LedgerRejected):
        return ack._settle("rejected", 0, result)
    news = ack._settle(_OUTCOMES.get(result.outcome, "appended"), result.sequence)
    if result.input_changed:
        ack.input_changed = result.input_changed
    return news
