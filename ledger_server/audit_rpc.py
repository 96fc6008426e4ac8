"""Audit RPCs: signed tree heads, inclusion and consistency proofs over per-run Merkle trees.

Each run's tree has one leaf per row (leaf data = the stored canonical row
bytes, leaf index = run_sequence - 1). Trees live in a bounded in-memory LRU
and are extended with the rows committed since the last request, so a head
costs O(new rows + log n) instead of a full re-read. While extending, the
chain is re-checked and the tree must end where the run head does (its count
and hash), with the last row already in the tree still stored: the server never
signs a head over rows that break the chain or that the run head disagrees with.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import grpc

from ledger_server.archive_read import archived_rows, tombstone_of
from ledger_server.auth import AUDIT
from ledger_server.chain import ChainWalker
from ledger_server.errors import EventNotFound, InvalidEvent, LedgerCorrupt, SigningKeyMissing
from ledger_server.merkle import MerkleTree, leaf_hash, verify_inclusion
from ledger_server.rpc_status import abort_on_error
from ledger_server.signing import InclusionProofBundle, SigningKey, TreeHead, sign_tree_head
from ledger_server.store.base import ReadView, RunRow, StoredEvent, Tombstone
from ledger_server.validation import check_id
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.canonical import canonical_json

if TYPE_CHECKING:
    from ledger_server.service import LedgerService

MAX_CACHED_RUNS: Final = 64
# About 130 bytes per leaf (tree levels plus the event-id index): ~500 MiB at most.
MAX_CACHED_LEAVES: Final = 4_000_000
_PAGE: Final = 5000


@dataclass(slots=True)
class RunTree:
    """One run's Merkle tree as far as it was read, with what extending it needs."""

    run_pk: int
    tree: MerkleTree = field(default_factory=MerkleTree)
    # Walks beside the tree: its count is always the tree size.
    chain: ChainWalker = field(default_factory=ChainWalker)
    last_sequence: int = 0
    # event_id -> global sequence: inclusion proofs are asked for by event id.
    sequences: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def extend(self, view: ReadView, run: RunRow) -> None:
        """Appends the rows committed since the last call; the tree must end where the head does."""
        self._check_tail(view, run)
        while True:
            page = view.list_events(run.run_pk, after_sequence=self.last_sequence, limit=_PAGE)
            if not page:
                break
            for stored in page:
                run = self._add(view, run, stored)
        if (self.tree.size, self.chain.head) != (run.event_count, run.head_hash):
            raise LedgerCorrupt(
                f"the stored rows and the run head disagree: the head of run {run.run_id} counts"
                f" {run.event_count} events ending in {run.head_hash.hex()[:16]}, the rows give"
                f" {self.tree.size} ending in {self.chain.head.hex()[:16]}",
                run_id=run.run_id,
            )

    def _add(self, view: ReadView, run: RunRow, stored: StoredEvent) -> RunRow:
        """Appends one row after checking it; returns the run head it lies within."""
        expected = self.chain.expected
        if not self.chain.in_order(stored.run_sequence):
            raise LedgerCorrupt(
                f"row at sequence {stored.sequence} has run_sequence"
                f" {stored.run_sequence} where {expected} was expected",
                sequence=stored.sequence,
            )
        if expected > run.event_count:
            run = self._head_covering(view, run, stored)
        if not self.chain.links(stored.row, stored.row_hash):
            raise LedgerCorrupt(
                f"row at sequence {stored.sequence} does not match its chain hash",
                sequence=stored.sequence,
            )
        self.tree.append(stored.row)
        self.chain.advance(stored.row_hash)
        self.last_sequence = stored.sequence
        self.sequences[stored.event_id] = stored.sequence
        return run

    @staticmethod
    def _head_covering(view: ReadView, run: RunRow, stored: StoredEvent) -> RunRow:
        """Returns a run head read now, which must count the row: rows beyond it were forged."""
        # A row and the head that counts it commit in one transaction, so a row committed
        # after `run` was read is counted by any head read after the row: only a row
        # added behind the server stays beyond it.
        head = view.get_run(run.namespace, run.run_id)
        count = head.event_count if head is not None and head.run_pk == run.run_pk else 0
        if head is None or count < stored.run_sequence:
            raise LedgerCorrupt(
                f"the stored rows and the run head disagree: row at sequence {stored.sequence}"
                f" is event {stored.run_sequence} of run {run.run_id}, whose head counts"
                f" {count} events: a row was added behind the server",
                sequence=stored.sequence,
                run_id=run.run_id,
            )
        return head

    def _check_tail(self, view: ReadView, run: RunRow) -> None:
        """Raises LedgerCorrupt unless the last row already in the tree is still stored."""
        if not self.last_sequence:
            return
        rows = view.list_events(run.run_pk, after_sequence=self.last_sequence - 1, limit=1)
        if not rows or (rows[0].sequence, rows[0].row_hash) != (
            self.last_sequence,
            self.chain.head,
        ):
            raise LedgerCorrupt(
                f"the stored rows and the run head disagree: event {self.tree.size} of run"
                f" {run.run_id} (sequence {self.last_sequence}), which the head still counts,"
                " is no longer stored as it was: rows were deleted or edited behind the server",
                sequence=self.last_sequence,
                run_id=run.run_id,
            )


def archived_tree(tombstone: Tombstone) -> RunTree:
    """Returns an archived run's tree, built from its bundle (checked against the tombstone)."""
    entry = RunTree(tombstone.run_pk)
    for stored in archived_rows(tombstone):
        entry.tree.append(stored.row)
        entry.chain.advance(stored.row_hash)
        entry.last_sequence = stored.sequence
        entry.sequences[stored.event_id] = stored.sequence
    return entry


class RunTreeCache:
    """Holds the trees of recently audited runs, least recently used evicted first."""

    def __init__(
        self, *, max_runs: int = MAX_CACHED_RUNS, max_leaves: int = MAX_CACHED_LEAVES
    ) -> None:
        self.max_runs = max_runs
        self.max_leaves = max_leaves
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, RunTree] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, run_pk: object) -> bool:
        return run_pk in self._entries

    @contextmanager
    def locked(self, view: ReadView, run: RunRow) -> Iterator[RunTree]:
        """Yields the run's tree, extended to the run head, held exclusively."""
        entry = self._entry(run.run_pk)
        # One lock per run: a long first read of a big run never blocks other runs' audits.
        with entry.lock:
            # Re-read under the lock: every row an earlier holder added was counted by a head
            # read before this one, so a head now shorter than the tree means rows were removed.
            head = view.get_run(run.namespace, run.run_id)
            if head is None or head.run_pk != run.run_pk or head.event_count < entry.tree.size:
                raise LedgerCorrupt(
                    f"run {run.run_id} went back from {entry.tree.size} events to"
                    f" {head.event_count if head else 0}: the log was truncated or restored",
                    run_id=run.run_id,
                )
            entry.extend(view, head)
            yield entry

    def _entry(self, run_pk: int) -> RunTree:
        with self._lock:
            entry = self._entries.get(run_pk)
            if entry is None:
                entry = self._entries[run_pk] = RunTree(run_pk)
            self._entries.move_to_end(run_pk)
            leaves = sum(e.tree.size for e in self._entries.values())
            while len(self._entries) > 1 and (
                len(self._entries) > self.max_runs or leaves > self.max_leaves
            ):
                _, evicted = self._entries.popitem(last=False)
                leaves -= evicted.tree.size
            return entry


_CACHE_INIT_LOCK: Final = threading.Lock()


def tree_head_pb(head: TreeHead) -> pb.TreeHead:
    """Returns the typed form of a signed tree head (the fields of its JSON, one for one)."""
    return pb.TreeHead(
        namespace=head.namespace,
        run_id=head.run_id,
        tree_size=head.tree_size,
        root_hex=head.root_hex,
        timestamp_ms=head.timestamp_ms,
        key_id=head.key_id,
        signature_hex=head.signature_hex,
    )


class AuditRpcMixin:
    """Serves the audit RPCs of the v1 contract (mixed into LedgerServicer)."""

    ledger: LedgerService
    signing_key: SigningKey | None

    def GetTreeHead(
        self, request: pb.GetTreeHeadRequest, context: grpc.ServicerContext
    ) -> pb.GetTreeHeadResponse:
        with abort_on_error(context):
            with self._audit_tree(context, request.namespace, request.run_id) as (run, entry):
                size = _size("tree_size", request.tree_size, entry.tree.size)
                head = self._sign(run, size, entry.tree.root(size))
            return pb.GetTreeHeadResponse(
                tree_head_json=canonical_json(head.to_json()), tree_head=tree_head_pb(head)
            )

    def GetInclusionProof(
        self, request: pb.GetInclusionProofRequest, context: grpc.ServicerContext
    ) -> pb.GetInclusionProofResponse:
        with abort_on_error(context):
            check_id("event_id", request.event_id)
            with self._audit_tree(context, request.namespace, request.run_id) as (run, entry):
                bundle = self._inclusion(run, entry, request.event_id, request.tree_size)
            return pb.GetInclusionProofResponse(
                proof_bundle_json=canonical_json(bundle.to_json()),
                bundle=pb.InclusionProofBundle(
                    head=tree_head_pb(bundle.head),
                    leaf_index=bundle.leaf_index,
                    leaf_hex=bundle.leaf_hex,
                    proof_hex=list(bundle.proof_hex),
                ),
            )

    def GetConsistencyProof(
        self, request: pb.GetConsistencyProofRequest, context: grpc.ServicerContext
    ) -> pb.GetConsistencyProofResponse:
        with abort_on_error(context):
            with self._audit_tree(context, request.namespace, request.run_id) as (run, entry):
                new = _size("new_size", request.new_size, entry.tree.size)
                if not 0 <= request.old_size <= new:
                    raise InvalidEvent("old_size", f"must be between 0 and the new size {new}")
                proof = entry.tree.consistency_proof(request.old_size, new)
                head = self._sign(run, new, entry.tree.root(new))
            return pb.GetConsistencyProofResponse(
                proof=proof,
                tree_head_json=canonical_json(head.to_json()),
                tree_head=tree_head_pb(head),
            )

    def GetPublicKey(
        self, request: pb.GetPublicKeyRequest, context: grpc.ServicerContext
    ) -> pb.GetPublicKeyResponse:
        with abort_on_error(context):
            key = self._key()
            return pb.GetPublicKeyResponse(public_key_pem=key.public_key_pem(), key_id=key.key_id)

    # --- helpers ---------------------------------------------------------------

    @property
    def audit_trees(self) -> RunTreeCache:
        """Returns this servicer's tree cache, created on first use."""
        cache: RunTreeCache | None = getattr(self, "_audit_trees", None)
        if cache is None:
            with _CACHE_INIT_LOCK:
                cache = getattr(self, "_audit_trees", None)
                if cache is None:
                    cache = RunTreeCache()
                    self._audit_trees = cache
        return cache

    def _scope(
        self, context: grpc.ServicerContext, action: str, namespace: str, run_id: str
    ) -> str:
        """Returns the namespace the request means; LedgerServicer overrides it with auth."""
        return namespace

    @contextmanager
    def _audit_tree(
        self, context: grpc.ServicerContext, namespace: str, run_id: str
    ) -> Iterator[tuple[RunRow, RunTree]]:
        run = self.ledger.run(self._scope(context, AUDIT, namespace, run_id), run_id)
        if run.archived:
            # Built from the bundle, checked whole against the tombstone; not cached (rare).
            yield run, archived_tree(tombstone_of(self.ledger.store.read(), run))
            return
        with self.audit_trees.locked(self.ledger.store.read(), run) as entry:
            yield run, entry

    def _key(self) -> SigningKey:
        if self.signing_key is None:
            raise SigningKeyMissing("this server has no tree-head signing key")
        return self.signing_key

    def _sign(self, run: RunRow, size: int, root: bytes) -> TreeHead:
        return sign_tree_head(
            self._key(),
            namespace=run.namespace,
            run_id=run.run_id,
            tree_size=size,
            root=root,
            timestamp_ms=self.ledger.clock() // 1000,
        )

    def _inclusion(
        self, run: RunRow, entry: RunTree, event_id: str, tree_size: int
    ) -> InclusionProofBundle:
        sequence = entry.sequences.get(event_id)
        if sequence is None:
            raise EventNotFound(
                f"event {event_id} is not in run {run.run_id} of namespace {run.namespace}",
                event_id=event_id,
                run_id=run.run_id,
            )
        size = _size("tree_size", tree_size, entry.tree.size)
        if run.archived:
            tombstone = tombstone_of(self.ledger.store.read(), run)
            rows = [r for r in archived_rows(tombstone) if r.sequence == sequence]
        else:
            rows = self.ledger.store.read().list_events(
                run.run_pk, after_sequence=sequence - 1, limit=1
            )
        if not rows or rows[0].sequence != sequence:
            raise LedgerCorrupt(f"event {event_id} vanished from sequence {sequence}")
        stored, index = rows[0], rows[0].run_sequence - 1
        if index >= size:
            raise InvalidEvent(
                "tree_size", f"event {event_id} is leaf {index}, outside a tree of size {size}"
            )
        proof, root = entry.tree.inclusion_proof(index, size), entry.tree.root(size)
        # The cached leaf was checked when read; a row edited since then must not be proven.
        if not verify_inclusion(
            leaf_hash=leaf_hash(stored.row), index=index, size=size, proof=proof, root=root
        ):
            raise LedgerCorrupt(
                f"row at sequence {sequence} changed after it was added to the tree",
                sequence=sequence,
            )
        head = self._sign(run, size, root)
        return InclusionProofBundle(head, index, stored.row.hex(), [p.hex() for p in proof])


def _size(field_name: str, requested: int, current: int) -> int:
    """Returns the requested tree size (0 = current), or raises InvalidEvent naming the field."""
    if requested < 0:
        raise InvalidEvent(field_name, "must not be negative")
    if requested > current:
        raise InvalidEvent(
            field_name, f"is {requested}, beyond the run's current size {current}", current=current
        )
    return requested or current
