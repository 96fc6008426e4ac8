"""Chain verification: walk each run's rows and name the first one that breaks."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from ledger_server.chain import ChainWalker
from ledger_server.store.base import RunRow, Store, StoredEvent


@dataclass(frozen=True, slots=True)
class ChainReport:
    """The verdict on one run's hash chain."""

    namespace: str
    run_id: str
    events: int
    ok: bool
    first_bad_sequence: int | None = None
    problem: str = ""

    def to_json(self) -> dict[str, object]:
        """Returns the report as a JSON-ready dict."""
        return {
            "namespace": self.namespace,
            "run_id": self.run_id,
            "events": self.events,
            "ok": self.ok,
            "first_bad_sequence": self.first_bad_sequence,
            "problem": self.problem,
        }


def verify_rows(run: RunRow, rows: Iterable[StoredEvent]) -> ChainReport:
    """Recomputes the chain over the rows of one run and compares it with the stored head."""
    chain = ChainWalker()

    def bad(seq: int | None, problem: str, *, counting_row: bool = True) -> ChainReport:
        # A bad row counts among the events read, as far as the walk got.
        count = chain.count + 1 if counting_row else chain.count
        return ChainReport(run.namespace, run.run_id, count, False, seq, problem)

    for stored in rows:
        if not chain.in_order(stored.run_sequence):
            return bad(
                stored.sequence,
                f"run_sequence {stored.run_sequence} where {chain.expected} was expected"
                " (a row was deleted, inserted or reordered)",
            )
        try:
            outer = json.loads(stored.row)
            body = outer["event"]
        except (ValueError, KeyError, TypeError):
            return bad(stored.sequence, "row bytes are not a valid row (edited)")
        if (
            not isinstance(body, dict)
            or body.get("event_id") != stored.event_id
            or outer.get("run_sequence") != stored.run_sequence
            or body.get("run_id") != run.run_id
            or body.get("namespace") != run.namespace
        ):
            return bad(stored.sequence, "row columns disagree with the hashed row bytes")
        if not chain.links(stored.row, stored.row_hash):
            return bad(stored.sequence, "row hash does not match blake3(previous hash || row)")
        chain.advance(stored.row_hash)
    if chain.count != run.event_count or chain.head != run.head_hash:
        return bad(
            None,
            f"run head says {run.event_count} events ending in {run.head_hash.hex()[:16]},"
            f" the rows give {chain.count} ending in {chain.head.hex()[:16]}"
            " (rows were removed or added)",
            counting_row=False,
        )
    return ChainReport(run.namespace, run.run_id, chain.count, True)


def verify_store(
    store: Store, *, namespace: str | None = None, run_id: str | None = None
) -> list[ChainReport]:
    """Verifies the chains of every run (or one run) in the store."""
    view = store.read()
    runs = view.list_runs(namespace, 1 << 30)
    if run_id is not None:
        runs = [r for r in runs if r.run_id == run_id]
    return [
        verify_rows(run, view.iter_events(run.run_pk))
        for run in sorted(runs, key=lambda r: r.run_pk)
    ]
