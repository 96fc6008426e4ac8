"""Reading an archived run's bundle back, checked against its tombstone (archive.py writes it)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import blake3

from ledger_server.archive import EVENTS_FILE, EXPORT_FORMAT, HEAD_FILE, MANIFEST_FILE, Location
from ledger_server.chain import GENESIS_HASH, ChainWalker, encode_parsed_row
from ledger_server.compact import HOT_RECORDS, CompactRecords
from ledger_server.errors import ArchiveBroken
from ledger_server.merkle import MerkleTree
from ledger_server.projections import resume_reason
from ledger_server.rebuild import gc_paused, take_projections
from ledger_server.record import record_from_row
from ledger_server.replay import RunReplay
from ledger_server.signing import TreeHead, verify_tree_head
from ledger_server.states import RESUME_STATES
from ledger_server.store.base import ReadView, RunRow, ShardRow, StoredEvent, Tombstone


def tombstone_of(view: ReadView, run: RunRow) -> Tombstone:
    """Returns the archived run's tombstone (ArchiveBroken if it vanished)."""
    tombstone = view.get_tombstone(run.run_pk)
    if tombstone is None:
        raise ArchiveBroken(f"run {run.run_id} is marked archived but has no tombstone")
    return tombstone


def archived_rows(tombstone: Tombstone, *, location: str | None = None) -> Iterator[StoredEvent]:
    """Yields the archived run's rows from its bundle, checked against its tombstone."""
    where = Location(location or tombstone.location)
    for row in read_rows(where, Expected.of(tombstone)):
        yield row._replace(run_pk=tombstone.run_pk)


def archived_shard_rows(tombstone: Tombstone, *, hot: int = HOT_RECORDS) -> Iterator[ShardRow]:
    """Yields the archived run's shard rows in plan order, replayed from its bundle.

    The bundle is checked whole before the first row is yielded. Memory stays bounded
    whatever the night's size: the replay keeps at most ``hot`` records as objects and
    spills the rest to a temporary SQLite file (compact.CompactRecords, as `db rebuild`
    does), and the rows are read back from it in plan order as they are yielded.
    """
    # A night of at most `hot` shards (its summary says how many) keeps them all as
    # objects: bounded the same, and ~2x faster than writing every row to the temp file.
    submitted = json.loads(tombstone.summary).get("submitted")
    small = isinstance(submitted, int) and submitted <= hot
    replay = RunReplay() if small else RunReplay(records=CompactRecords(hot))
    with gc_paused():
        for row in archived_rows(tombstone):
            replay.feed_row(row.sequence, row.row, row.row_hash)
    rows, _ = take_projections(replay)
    yield from rows


def archived_resume(
    tombstone: Tombstone, now_us: int, *, hot: int = HOT_RECORDS
) -> Iterator[tuple[str, int, str, str]]:
    """Yields the archived run's resume list as the hot store's query does, in bounded memory.

    (shard_id, plan_index, plan_line, reason) in plan order: every shard without a
    confirmed artifact, from the rows archived_shard_rows reads back.
    """
    for row in archived_shard_rows(tombstone, hot=hot):
        # Only the states the hot store's query reads: a verified shard never resumes.
        if row.state not in RESUME_STATES or row.record is None:
            continue
        reason = resume_reason(record_from_row(row.record, None, None), now_us)
        if reason is not None:
            yield row.shard_id, row.plan_index, row.plan_line, reason


@dataclass(frozen=True, slots=True)
class Expected:
    """What a bundle must match: its tombstone's digest and signed head."""

    digest: str
    tree_head: dict[str, Any]
    event_count: int
    head_hash: bytes

    @classmethod
    def of(cls, tombstone: Tombstone) -> Expected:
        """Returns what the tombstone vouches for."""
        return cls(
            tombstone.digest,
            json.loads(tombstone.tree_head),
            tombstone.event_count,
            tombstone.head_hash,
        )


def read_manifest(location: Location, expected: Expected) -> dict[str, Any]:
    """Returns the bundle's manifest once its blake3 is the tombstone's."""
    data = location.read(MANIFEST_FILE)
    digest = blake3.blake3(data).hexdigest()
    if digest != expected.digest:
        raise ArchiveBroken(
            f"{location.url}/{MANIFEST_FILE} has blake3 {digest[:16]}..., the tombstone"
            f" says {expected.digest[:16]}...: the manifest was changed or replaced",
            file=MANIFEST_FILE,
        )
    manifest: dict[str, Any] = json.loads(data)
    return manifest


def read_rows(location: Location, expected: Expected) -> Iterator[StoredEvent]:
    """Yields the archived rows, each checked as it comes; the whole bundle is checked by the end.

    Streamed (memory stays at a chunk and the Merkle tree's leaves): rows are
    yielded before the end of the file is read, and ArchiveBroken is raised at the
    first difference from the tombstone: a file's blake3 or size, a broken chain,
    a missing trailer (truncated), a head that is not the tombstone's.
    """
    manifest = read_manifest(location, expected)
    files = manifest["files"]
    head_bytes = location.read(HEAD_FILE)
    _check_file(location, HEAD_FILE, head_bytes, files[HEAD_FILE])
    if json.loads(head_bytes) != expected.tree_head:
        raise ArchiveBroken(f"{location.url}/{HEAD_FILE} is not the tombstone's signed head")
    reader = _EventsReader(location, expected)
    yield from reader.rows()
    info = files[EVENTS_FILE]
    if (reader.size, reader.hasher.hexdigest()) != (info["bytes"], info["blake3"]):
        raise ArchiveBroken(
            f"{location.url}/{EVENTS_FILE} has {reader.size} bytes with blake3"
            f" {reader.hasher.hexdigest()[:16]}..., the manifest says {info['bytes']} bytes"
            f" with {info['blake3'][:16]}...",
            file=EVENTS_FILE,
        )


def _check_file(location: Location, name: str, data: bytes, info: dict[str, Any]) -> None:
    digest = blake3.blake3(data).hexdigest()
    if (len(data), digest) != (info["bytes"], info["blake3"]):
        raise ArchiveBroken(
            f"{location.url}/{name} has blake3 {digest[:16]}..., the manifest says"
            f" {info['blake3'][:16]}...",
            file=name,
        )


class _EventsReader:
    """Walks events.jsonl line by line, hashing every byte."""

    def __init__(self, location: Location, expected: Expected) -> None:
        self.location = location
        self.expected = expected
        self.hasher = blake3.blake3()
        self.size = 0
        self.chain = ChainWalker(GENESIS_HASH, 0)
        self.tree = MerkleTree()
        self.pem = ""

    def _lines(self) -> Iterator[tuple[int, bytes]]:
        pending, number = b"", 0
        for chunk in self.location.chunks(EVENTS_FILE):
            self.hasher.update(chunk)
            self.size += len(chunk)
            pending += chunk
            *complete, pending = pending.split(b"\n")
            for line in complete:
                number += 1
                yield number, line
        if pending:
            raise self.broken(number + 1, "the last line is cut short: the file is truncated")

    def broken(self, line: int, problem: str) -> ArchiveBroken:
        """Returns the error naming the file, the line and what differs."""
        return ArchiveBroken(
            f"{self.location.url}/{EVENTS_FILE} line {line}: {problem}", file=EVENTS_FILE
        )

    def rows(self) -> Iterator[StoredEvent]:
        lines = self._lines()
        trailer_seen = False
        for number, text in lines:
            record = self._json(number, text)
            kind = record.get("type")
            if number == 1:
                self._header(number, record)
            elif trailer_seen:
                raise self.broken(number, "data after the trailer")
            elif kind == "trailer":
                self._trailer(number, record)
                trailer_seen = True
            else:
                yield self._event(number, record)
        if not trailer_seen:
            raise self.broken(self.chain.count + 2, "no trailer: the file is truncated")

    def _json(self, number: int, text: bytes) -> dict[str, Any]:
        try:
            value = json.loads(text)
        except ValueError as exc:  # UnicodeDecodeError is a ValueError too
            raise self.broken(number, f"not JSON ({exc})") from None
        if not isinstance(value, dict):
            raise self.broken(number, "not a JSON object")
        return value

    def _header(self, number: int, record: dict[str, Any]) -> None:
        if record.get("type") != "header" or record.get("format") != EXPORT_FORMAT:
            raise self.broken(number, f"not a {EXPORT_FORMAT} header")
        head = self.expected.tree_head
        if (record.get("namespace"), record.get("run_id")) != (head["namespace"], head["run_id"]):
            raise self.broken(number, "the header names another run than the tombstone")
        self.pem = str(record.get("public_key_pem", ""))

    def _event(self, number: int, record: dict[str, Any]) -> StoredEvent:
        try:
            row = encode_parsed_row(record["row"])
            run_sequence, sequence = int(record["run_sequence"]), int(record["sequence"])
            row_hash = bytes.fromhex(record["row_hash"])
            event_id = str(record["row"]["event"]["event_id"])
        except (KeyError, TypeError, ValueError) as exc:
            raise self.broken(number, f"not an event line ({exc})") from None
        if not self.chain.in_order(run_sequence):
            raise self.broken(number, f"run_sequence {self.chain.expected} was expected")
        if not self.chain.links(row, row_hash):
            raise self.broken(number, "the row does not match its chain hash (edited)")
        self.chain.advance(row_hash)
        self.tree.append(row)
        return StoredEvent(sequence, 0, run_sequence, event_id, row, row_hash)

    def _trailer(self, number: int, record: dict[str, Any]) -> None:
        expected = self.expected
        if record.get("tree_head") != expected.tree_head:
            raise self.broken(number, "the trailer's signed head is not the tombstone's")
        head = TreeHead.from_json(expected.tree_head)
        if (self.chain.count, self.chain.head) != (expected.event_count, expected.head_hash):
            raise self.broken(
                number,
                f"the rows give {self.chain.count} events ending in"
                f" {self.chain.head.hex()[:16]}, the tombstone {expected.event_count} ending in"
                f" {expected.head_hash.hex()[:16]}",
            )
        if self.tree.root().hex() != head.root_hex:
            raise self.broken(number, "the rows' Merkle root is not the signed root")
        if not self.pem or not verify_tree_head(head, self.pem):
            raise self.broken(number, "the signed head does not verify under the header's key")
