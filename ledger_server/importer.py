"""Writes an exported run into a store verbatim and rebuilds its projections, all or nothing.

The rows keep their original bytes and hashes, so the imported chain and
Merkle tree are the exported ones and a head signed by the source server
still vouches for them. Projections are folded exactly as ``BatchFolder.apply``
folds an append; only the global sequences are new.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice
from typing import Final

from ledger_server import projections as proj
from ledger_server.chain import GENESIS_HASH, ChainWalker, decode_row
from ledger_server.errors import ConflictError, EventIdReused, LedgerError
from ledger_server.events import RecordedEvent, RunReopened, ShardPlanned, SubmissionClosed
from ledger_server.open_attempts import shard_row, stored_contributions
from ledger_server.record import ShardRecord
from ledger_server.replay import closes_first_pass
from ledger_server.store.base import RunRow, Store, WriteTx
from ledger_server.summary import (
    PASS_CLOSED_KEY,
    check_new_shard,
    check_reopen,
    closing_delta,
    reopening_delta,
)
from ledger_server.validation import validate

_CHUNK: Final = 500


class RunExists(ConflictError):
    """The target store already has a run with this namespace and id."""

    reason = "RUN_EXISTS"


class ImportRejected(LedgerError):
    """A row breaks the chain, the run or the event rules; nothing was written."""

    reason = "IMPORT_REJECTED"


@dataclass(frozen=True, slots=True)
class ImportRow:
    """One exported row: its place in the run's chain, its canonical bytes and its hash."""

    run_sequence: int
    row: bytes
    row_hash: bytes


@dataclass(frozen=True, slots=True)
class ImportResult:
    """What an import wrote."""

    run_pk: int
    events: int
    shards: int
    head_hash: bytes
    first_sequence: int
    last_sequence: int


def import_run(
    store: Store, *, namespace: str, run_id: str, rows: Iterable[ImportRow]
) -> ImportResult:
    """Writes the run's rows and projections in one transaction; any error writes nothing."""
    with store.write() as tx:
        if tx.get_run(namespace, run_id) is not None:
            raise RunExists(
                f"run {run_id} already exists in namespace {namespace}",
                namespace=namespace,
                run_id=run_id,
            )
        writer = _RunWriter(tx, namespace, run_id)
        iterator = iter(rows)
        while chunk := list(islice(iterator, _CHUNK)):
            writer.write(chunk)
        return writer.finish()


class _RunWriter:
    """Inserts one run's rows in order, re-checking the chain, and folds its projections."""

    def __init__(self, tx: WriteTx, namespace: str, run_id: str) -> None:
        self.tx = tx
        self.namespace = namespace
        self.run_id = run_id
        self.run: RunRow | None = None
        self.chain = ChainWalker()
        self.first_sequence = 0
        self.last_sequence = 0
        self.last_receive_us = 0
        self.records: dict[str, ShardRecord] = {}
        self.pass_closed = 0  # the global sequence of the run's first verdict, once seen
        # What the run's submission_closed and run_reopened events set.
        self.closing: Counter[str] = Counter()

    def write(self, chunk: list[ImportRow]) -> None:
        """Checks and inserts a chunk of consecutive rows."""
        decoded = [self._decode(row) for row in chunk]
        clashes = self.tx.find_events([rec.event.event_id for rec in decoded])
        if clashes:
            event_id, stored = next(iter(clashes.items()))
            raise EventIdReused(
                f"event_id {event_id} is already stored at sequence {stored.sequence}",
                event_id=event_id,
                existing_sequence=stored.sequence,
            )
        for row, rec in zip(chunk, decoded, strict=True):
            self._insert(row, rec)
        self.tx.flush()

    def _decode(self, row: ImportRow) -> RecordedEvent:
        def rejected(problem: str) -> ImportRejected:
            return ImportRejected(
                f"row {row.run_sequence}: {problem}", run_sequence=row.run_sequence
            )

        if not self.chain.in_order(row.run_sequence):
            raise rejected(f"run_sequence {self.chain.expected} was expected")
        if not self.chain.links(row.row, row.row_hash):
            raise rejected("the row does not match its chain hash")
        self.chain.advance(row.row_hash)
        try:
            event, in_row, receive_us, row_format = decode_row(row.row)
            valid = validate(event, row_format=row_format)
        except (ValueError, KeyError, TypeError) as exc:
            raise rejected(f"not a ledger row ({exc})") from None
        except LedgerError as exc:
            raise rejected(f"invalid event ({exc.message})") from None
        if (event.namespace, event.run_id, in_row) != (
            self.namespace,
            self.run_id,
            self.chain.count,
        ):
            raise rejected(f"the row belongs to {event.namespace}/{event.run_id} at {in_row}")
        if valid.canonical != event.content_json(row_format):
            raise rejected("the event is not in the normal form the ledger stores")
        # The global sequence is assigned on insert; 0 marks it as not yet known.
        return RecordedEvent(event, 0, in_row, receive_us, row.row_hash, row_format)

    def _insert(self, row: ImportRow, rec: RecordedEvent) -> None:
        if self.run is None:
            self.run = self.tx.create_run(
                self.namespace, self.run_id, now_us=rec.receive_time_us, genesis=GENESIS_HASH
            )
        sequence = self.tx.insert_event(
            run_pk=self.run.run_pk,
            run_sequence=row.run_sequence,
            event_id=rec.event.event_id,
            row=row.row,
            row_hash=row.row_hash,
        )
        self.first_sequence = self.first_sequence or sequence
        self.last_sequence = sequence
        self.last_receive_us = max(self.last_receive_us, rec.receive_time_us)
        self._fold(
            RecordedEvent(
                rec.event,
                sequence,
                rec.run_sequence,
                rec.receive_time_us,
                row.row_hash,
                rec.row_format,
            )
        )

    def _fold(self, rec: RecordedEvent) -> None:
        if isinstance(rec.event.payload, SubmissionClosed):
            # A run-level event: it sets the run's close counters, as an append does.
            self.closing.update(
                closing_delta(self.closing, rec.event.payload, rec.sequence, rec.receive_time_us)
            )
            return
        if isinstance(rec.event.payload, RunReopened):
            # A reopen of a run with no close that stands is refused, as an append refuses it.
            check_reopen(self.closing, rec.event)
            self.closing.update(reopening_delta(self.closing, rec.sequence, rec.receive_time_us))
            return
        # The same checks as an append: a row the live ledger would refuse is refused here.
        shard_id = rec.event.shard_id
        record = self.records.get(shard_id)
        if proj.check(record, rec.event):
            if record is None and isinstance(rec.event.payload, ShardPlanned):
                # A new shard of a closed run (RUN_CLOSED), judged at the row's receive time.
                check_new_shard(
                    self.closing, rec.event, rec.receive_time_us, submitted=len(self.records)
                )
            self.records[shard_id] = proj.fold(record, rec, first_pass=not self.pass_closed)
            if not self.pass_closed and closes_first_pass(rec):
                self.pass_closed = rec.sequence

    def finish(self) -> ImportResult:
        """Saves the shard projections and counters and moves the run head."""
        if self.run is None:
            raise ImportRejected("the export holds no events")
        run_pk = self.run.run_pk
        for shard_id, record in self.records.items():
            self.tx.save_shard(run_pk, shard_row(shard_id, record))
            self.tx.add_counters(run_pk, stored_contributions(record))
        if self.pass_closed:
            self.tx.add_counters(run_pk, {PASS_CLOSED_KEY: self.pass_closed})
        if self.closing:
            self.tx.add_counters(run_pk, self.closing)
        self.tx.update_run(
            run_pk,
            event_count=self.chain.count,
            head_hash=self.chain.head,
            now_us=self.last_receive_us,
        )
        return ImportResult(
            run_pk,
            self.chain.count,
            len(self.records),
            self.chain.head,
            self.first_sequence,
            self.last_sequence,
        )
