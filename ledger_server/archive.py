"""A settled run's events moved to object storage, and read back against their tombstone.

A run's bundle is a directory (a local path or an fsspec URL such as
``s3://bucket/prefix``) at ``<base>/<namespace>/<run_id>/`` holding

- ``events.jsonl``: the run in the export format (``shardledger-export-v1``; each
  event line also names its ledger ``sequence``), so `shardledger import` reads it
  and anyone can check it offline: rows re-encode to their hashed bytes, hashes
  chain, the rows' Merkle root is the signed root;
- ``head.json``: the run's signed tree head (the trailer's, on its own);
- ``manifest.json``: written last, so a bundle without it is no bundle: the run,
  its event count, first and last sequence, chain head, Merkle root, and the size
  and blake3 of every other file.

The tombstone (store.base.Tombstone) keeps the manifest's blake3 and the signed
head: every read of the archive is checked against them, so a tampered, truncated
or missing bundle is an error that names what differs, never a quiet answer.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import quote

import blake3

from ledger_server.chain import GENESIS_HASH, ChainWalker, encode_parsed_row
from ledger_server.errors import ArchiveBroken
from ledger_server.merkle import MerkleTree
from ledger_server.rebuild import gc_paused
from ledger_server.replay import RunReplay
from ledger_server.signing import (
    SigningKey,
    TreeHead,
    public_key_id,
    sign_tree_head,
    verify_tree_head,
)
from ledger_server.store.base import ReadView, RunRow, StoredEvent, Tombstone
from shard_client.canonical import legacy_json
from shard_client.storage import is_remote, local_path, store_for

EXPORT_FORMAT: Final = "shardledger-export-v1"
ARCHIVE_FORMAT: Final = "shardledger-archive-v1"
EVENTS_FILE: Final = "events.jsonl"
HEAD_FILE: Final = "head.json"
MANIFEST_FILE: Final = "manifest.json"
_READ_CHUNK: Final = 1 << 20


class ArchiveUnwritable(OSError):
    """The archive location refused or lost a write; the run stays hot."""


# --- where a bundle lives -------------------------------------------------------


class Location:
    """A bundle's directory: a local path or an fsspec URL, read and written whole files at a time."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.remote = is_remote(self.url)

    def child(self, *names: str) -> Location:
        """Returns the directory below this one (each name quoted: ids never make a path)."""
        return Location("/".join([self.url, *(quote(n, safe="") for n in names)]))

    def _path(self, name: str) -> str:
        return f"{self.url}/{name}" if self.remote else os.path.join(local_path(self.url), name)

    def put(self, name: str, source: str) -> None:
        """Writes a local file into the directory under name, replacing what is there."""
        target = self._path(name)
        try:
            if self.remote:
                store_for(target).upload(source, target, if_absent=False)
                return
            os.makedirs(os.path.dirname(target), exist_ok=True)
            # os.replace is atomic only within one filesystem: the copy goes beside the target.
            staged = f"{target}.tmp-{os.getpid()}"
            with open(source, "rb") as src, open(staged, "wb") as dst:
                while chunk := src.read(_READ_CHUNK):
                    dst.write(chunk)
                dst.flush()
                os.fsync(dst.fileno())
            os.replace(staged, target)
            fd = os.open(os.path.dirname(target), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except (OSError, ValueError, ImportError) as exc:
            raise ArchiveUnwritable(f"cannot write {target}: {exc}") from exc

    def chunks(self, name: str) -> Iterator[bytes]:
        """Yields the file's bytes; ArchiveBroken when it is missing or cannot be read."""
        source = self._path(name)
        try:
            if self.remote:
                yield from store_for(source).iter_bytes(source)
                return
            with open(source, "rb") as fh:
                while chunk := fh.read(_READ_CHUNK):
                    yield chunk
        except FileNotFoundError:
            raise ArchiveBroken(f"the archive has no {source}", file=name) from None
        except (OSError, ValueError, ImportError) as exc:
            raise ArchiveBroken(f"cannot read {source}: {exc}", file=name) from None

    def read(self, name: str) -> bytes:
        """Returns the whole (small) file."""
        return b"".join(self.chunks(name))


def bundle_location(base_url: str, namespace: str, run_id: str) -> Location:
    """Returns where a run's bundle lives under an archive base URL."""
    return Location(base_url).child(namespace, run_id)


# --- writing --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Bundle:
    """A run's bundle staged in a local directory, with what its tombstone will keep."""

    directory: str
    events: int
    first_sequence: int
    last_sequence: int
    head_hash: bytes
    head: TreeHead
    manifest: bytes
    size_bytes: int

    @property
    def digest(self) -> str:
        """Returns the blake3 of the manifest: the bundle's identity in its tombstone."""
        return blake3.blake3(self.manifest).hexdigest()


def _line(value: dict[str, Any]) -> bytes:
    # As export writes it: Python's json round-trips every parsed number exactly.
    return (legacy_json(value) + "\n").encode()


class _HashedFile:
    """A local file written through blake3, counting its bytes."""

    def __init__(self, path: str) -> None:
        self.handle = open(path, "wb")  # noqa: SIM115 - closed by close()
        self.hasher = blake3.blake3()
        self.size = 0

    def write(self, data: bytes) -> None:
        self.handle.write(data)
        self.hasher.update(data)
        self.size += len(data)

    def close(self) -> dict[str, Any]:
        self.handle.close()
        return {"bytes": self.size, "blake3": self.hasher.hexdigest()}


def stage_bundle(
    rows: Iterator[StoredEvent],
    run: RunRow,
    key: SigningKey,
    directory: str,
    *,
    now_us: int,
    figures: dict[str, Any],
) -> Bundle:
    """Writes the run's bundle into a local directory, checking its chain on the way.

    Raises ArchiveBroken when the stored rows do not chain to the run's head: a
    broken run is never archived (`audit verify` tells what changed).
    """
    events = _HashedFile(os.path.join(directory, EVENTS_FILE))
    chain, tree = ChainWalker(), MerkleTree()
    first = last = 0
    try:
        events.write(_line(_header(run, key)))
        for stored in rows:
            if chain.count == run.event_count:
                break  # appended since the head was read: the transaction will refuse
            if not chain.in_order(stored.run_sequence) or not chain.links(
                stored.row, stored.row_hash
            ):
                raise ArchiveBroken(
                    f"run {run.namespace}/{run.run_id}: the hash chain breaks at sequence"
                    f" {stored.sequence}; nothing is archived (`shardledger audit verify`)"
                )
            chain.advance(stored.row_hash)
            tree.append(stored.row)
            first, last = first or stored.sequence, stored.sequence
            body = json.loads(stored.row)
            line = {
                "type": "event",
                "sequence": stored.sequence,
                "run_sequence": stored.run_sequence,
                "receive_time_us": body["receive_time_us"],
                "row": body,
                "row_hash": stored.row_hash.hex(),
            }
            events.write(_line(line))
        if (chain.count, chain.head) != (run.event_count, run.head_hash):
            raise ArchiveBroken(
                f"run {run.namespace}/{run.run_id}: its head says {run.event_count} events,"
                f" the rows give {chain.count}; nothing is archived"
            )
        head = _sign(key, run, chain.count, tree.root(), now_us)
        events.write(_line({"type": "trailer", "events": chain.count, "tree_head": head.to_json()}))
    finally:
        events_file = events.close()
    head_bytes = (legacy_json(head.to_json()) + "\n").encode()
    with open(os.path.join(directory, HEAD_FILE), "wb") as fh:
        fh.write(head_bytes)
    manifest = {
        "format": ARCHIVE_FORMAT,
        "namespace": run.namespace,
        "run_id": run.run_id,
        "events": chain.count,
        "first_sequence": first,
        "last_sequence": last,
        "head_hash": chain.head.hex(),
        "root_hex": head.root_hex,
        "key_id": head.key_id,
        "files": {
            EVENTS_FILE: events_file,
            HEAD_FILE: {"bytes": len(head_bytes), "blake3": blake3.blake3(head_bytes).hexdigest()},
        },
        **figures,
    }
    manifest_bytes = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    with open(os.path.join(directory, MANIFEST_FILE), "wb") as fh:
        fh.write(manifest_bytes)
    return Bundle(
        directory,
        chain.count,
        first,
        last,
        chain.head,
        head,
        manifest_bytes,
        events_file["bytes"] + len(head_bytes) + len(manifest_bytes),
    )


def _header(run: RunRow, key: SigningKey) -> dict[str, Any]:
    pem = key.public_key_pem()
    return {
        "type": "header",
        "format": EXPORT_FORMAT,
        "namespace": run.namespace,
        "run_id": run.run_id,
        "public_key_pem": pem,
        "key_id": public_key_id(pem),
    }


def _sign(key: SigningKey, run: RunRow, size: int, root: bytes, now_us: int) -> TreeHead:
    return sign_tree_head(
        key,
        namespace=run.namespace,
        run_id=run.run_id,
        tree_size=size,
        root=root,
        timestamp_ms=now_us // 1000,
    )


def upload(bundle: Bundle, location: Location, step: Callable[[str], None]) -> None:
    """Puts the bundle's files at the location, the manifest last (it makes the bundle)."""
    for name in (EVENTS_FILE, HEAD_FILE):
        location.put(name, os.path.join(bundle.directory, name))
        step(f"uploaded_{name.split('.')[0]}")
    location.put(MANIFEST_FILE, os.path.join(bundle.directory, MANIFEST_FILE))


def staging_directory() -> tempfile.TemporaryDirectory[str]:
    """Returns a private directory for a bundle before it is uploaded."""
    return tempfile.TemporaryDirectory(prefix="shardledger-archive-")


# --- reading --------------------------------------------------------------------


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


def replay_archived(tombstone: Tombstone) -> RunReplay:
    """Replays the archived run's bundle, checked whole, into its shard records."""
    replay = RunReplay()
    with gc_paused():
        for row in archived_rows(tombstone):
            replay.feed_row(row.sequence, row.row, row.row_hash)
    return replay


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
