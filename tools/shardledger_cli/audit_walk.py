"""Chain walks shared by `audit` and `export`: a run's rows re-chained from a server or a store."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final

from ledger_server.archive_read import archived_rows, tombstone_of
from ledger_server.audit import ChainReport, verify_rows
from ledger_server.chain import GENESIS_HASH, ChainWalker, decode_row, row_bytes
from ledger_server.codec import decode_event, timestamp_us
from ledger_server.errors import ArchiveBroken, LedgerError
from ledger_server.events import ROW_FORMAT_LEGACY
from ledger_server.merkle import MerkleTree
from ledger_server.store.base import RunRow, StoredEvent
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.errors import LedgerRejected

# Codes with which a server says it cannot read its own rows: findings, not refusals.
_UNREADABLE: Final = ("DATA_LOSS", "INTERNAL", "UNKNOWN")


@dataclass(slots=True)
class ChainWalk:
    """Recomputes one run's chain and Merkle tree row by row and remembers the first break."""

    run_id: str
    namespace: str | None = None  # None: taken from the first row
    tree: MerkleTree = field(default_factory=MerkleTree)
    head_hash: bytes = GENESIS_HASH
    where: str = ""  # the first bad row, e.g. "sequence 57" or "line 12"
    last_sequence: int = 0  # the ledger sequence of the last row a server walk added
    bad_sequence: int | None = None
    problem: str = ""

    @property
    def count(self) -> int:
        """Returns how many rows chained correctly."""
        return self.tree.size

    def add(self, row: bytes, *, row_hash: bytes, run_sequence: int, where: str) -> bool:
        """Checks one row against the chain so far; False (remembered) at the first break."""
        problem = self._problem(row, row_hash, run_sequence)
        if problem:
            self.fail(where, problem)
            return False
        self.tree.append(row)
        self.head_hash = row_hash
        return True

    def fail(self, where: str, problem: str, sequence: int | None = None) -> None:
        """Records a break found outside the row checks."""
        self.where, self.problem = where, problem
        if sequence is None and where.startswith("sequence "):
            sequence = int(where.split()[1])
        self.bad_sequence = sequence

    def _problem(self, row: bytes, row_hash: bytes, run_sequence: int) -> str:
        chain = ChainWalker(self.head_hash, self.count)
        if not chain.in_order(run_sequence):
            return (
                f"run_sequence {run_sequence} where {chain.expected} was expected"
                " (a row was deleted, inserted or reordered)"
            )
        try:
            event, in_row, receive_us, row_format = decode_row(row)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return f"row bytes are not a ledger row ({type(exc).__name__}: {exc})"
        if self.namespace is None:
            self.namespace = event.namespace
        if (event.namespace, event.run_id) != (self.namespace, self.run_id):
            return f"row belongs to {event.namespace}/{event.run_id}"
        if in_row != run_sequence:
            return f"row bytes say run_sequence {in_row}, the row sits at {run_sequence}"
        derived = row_bytes(
            event, run_sequence=in_row, receive_time_us=receive_us, row_format=row_format
        )
        if derived != row:
            return "row bytes are not canonical (edited)"
        if not chain.links(row, row_hash):
            return "row hash does not match blake3(previous hash || row)"
        return ""


def event_row(msg: pb.ShardEvent) -> bytes:
    """Returns the canonical row bytes re-derived from an event as the server sent it."""
    return row_bytes(
        decode_event(msg),
        run_sequence=msg.run_sequence,
        receive_time_us=timestamp_us(msg.receive_time),
        # A server older than the field sends 0: its rows are all of format 1.
        row_format=msg.row_format or ROW_FORMAT_LEGACY,
    )


def walk_server(
    client: Any, run_id: str, namespace: str, *, walk: ChainWalk | None = None
) -> ChainWalk:
    """Fetches the run's events over gRPC (those after a given walk's) and walks their chain."""
    if walk is None:
        walk = ChainWalk(run_id, namespace or None)
    try:
        for msg in client.list_events(
            run_id, namespace=namespace, after_sequence=walk.last_sequence, page_size=5000
        ):
            try:
                row = event_row(msg)
            except LedgerError as exc:
                walk.fail(f"sequence {msg.sequence}", f"the event cannot be decoded: {exc}")
                break
            if not walk.add(
                row,
                row_hash=msg.row_hash,
                run_sequence=msg.run_sequence,
                where=f"sequence {msg.sequence}",
            ):
                break
            walk.last_sequence = msg.sequence
    except LedgerRejected as exc:
        if exc.code.name not in _UNREADABLE:
            raise
        walk.fail(
            f"after sequence {walk.last_sequence}", f"the server cannot read the next row: {exc}"
        )
    return walk


def walk_store(view: Any, run: RunRow) -> tuple[dict[str, Any], MerkleTree]:
    """Walks one run of a store with audit.verify_rows, building its Merkle tree on the way."""
    tree = MerkleTree()

    def tap(rows: Iterator[StoredEvent]) -> Iterator[StoredEvent]:
        for stored in rows:
            yield stored
            # Reached only when verify_rows asks for the next row, i.e. this one passed.
            tree.append(stored.row)

    if not run.archived:
        return verify_rows(run, tap(view.iter_events(run.run_pk))).to_json(), tree
    # An archived run's rows are its bundle's, checked against its tombstone as they come.
    tombstone = tombstone_of(view, run)
    try:
        return verify_rows(run, tap(archived_rows(tombstone))).to_json(), tree
    except ArchiveBroken as exc:
        problem = f"the archive does not match the run's tombstone: {exc}"
        report = ChainReport(run.namespace, run.run_id, tree.size, False, None, problem)
        return report.to_json(), tree
